"""Training and fine-tuning: the train section, LoRA, evaluation, saving the trained model, profiling and
telemetry."""

from __future__ import annotations

import attrs

from llmadapt.dataformats import FORMATS as DATA_FORMATS
from llmadapt.spec.fields import above, at_least, choice

PROFILE_LEVELS = ("module", "operator", "full")
OPTIMIZERS = ("adamw", "adam", "sgd")
OPTIMIZER_IMPLS = ("torch", "cpu_adam")
EVAL_MATCHES = ("tokens", "number")
# Linear layers LoRA can wrap, by family (transformers' module names). Mixtral's experts are fused
# parameters in transformers 5, not linear layers: LoRA targets its attention projections.
LORA_TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    # mixtral: attention, and the experts' w1/w2/w3 and the router as transformers 4 names them (peft maps these names
    # onto transformers 5's fused experts)
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3", "gate"),
    # jamba: the attention layers' projections and the Mamba mixers' (experts fused, as Mixtral's)
    "jamba": ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "x_proj", "dt_proj", "out_proj"),
}


@attrs.frozen
class TrainSpec:
    """Training and fine-tuning parameters."""

    seq_len: int = attrs.field(default=64, validator=at_least(1))
    global_batch: int = attrs.field(default=8, validator=at_least(1))
    """Samples per optimizer step, over all data-parallel ranks (packed rows with data.packing)."""
    micro_batch: int | None = None
    """Samples (packed rows) per forward/backward; default: the whole per-rank batch (no accumulation)."""
    steps: int = attrs.field(default=10, validator=at_least(1))
    """Measured steps."""
    warmup_steps: int = attrs.field(default=2, validator=at_least(0))
    """Steps run before the measured ones; they train too but are excluded from statistics."""
    optimizer: str = attrs.field(default="adamw", validator=choice(OPTIMIZERS))
    lr: float = attrs.field(default=1e-3, validator=at_least(0.0))
    weight_decay: float = attrs.field(default=0.0, validator=at_least(0.0))
    optimizer_impl: str = attrs.field(default="torch", validator=choice(OPTIMIZER_IMPLS))
    """Which implementation runs the optimizer's update: 'torch' (torch.optim, every adapter) or 'cpu_adam'
    (the framework's C++ CPU Adam, e.g. DeepSpeedCPUAdam, compiled at first use). The same update in exact
    arithmetic: a layout choice, not part of the problem hash."""
    on_nonfinite: str = attrs.field(default="stop", validator=choice(("stop", "continue")))
    """A loss or gradient norm that is NaN or infinite: 'stop' ends the run there as 'diverged' (the step and
    rank named); 'continue' runs every step and the run still ends 'diverged'. Not part of the problem hash."""

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps


@attrs.frozen
class SaveSpec:
    """Keep what training produced: the trained model as a Hugging Face model folder (docs/workloads.md)."""

    path: str | None = None
    """Write the model after the last step here: config.json, safetensors shards and the tokenizer, gathered from
    every rank's shards (ZeRO-3 partitions, tensor- and pipeline-parallel slices); LoRA weights merged into the
    base. A new or empty folder; a serving workload's ``model.path`` can name it."""
    lora: str = attrs.field(default="merged", validator=choice(("merged", "adapter")))
    """LoRA fine-tunes: 'merged' (the whole model, LoRA merged into the base: a model folder any engine serves)
    or 'adapter' (only the adapter, as peft writes it: adapter_config.json and adapter_model.safetensors, for
    engines that load LoRA adapters onto the base)."""


@attrs.frozen
class EvalSpec:
    """Evaluate the model being trained on held-out examples: before the first step, every ``every`` steps and after
    the last (docs/workloads.md). The same examples, order and metric code on every stack (llmadapt.runtime.evaluation)."""

    examples: int = attrs.field(default=0, validator=at_least(0))
    """Held-out examples; 0: no evaluation. Without ``path`` or ``share``, a jsonl data set's last ``examples`` rows
    are held out of training, and synthetic data gets a stream of its own (other seeds than training's)."""
    path: str | None = None
    """A JSONL file of held-out examples (its first ``examples`` rows), with data's prompt and answer fields and an
    optional ``choices`` list (multiple choice: the answer is one of them); for eval.format 'sharegpt', a ShareGPT
    file (its first ``examples`` conversations with an answer token within train.seq_len)."""
    every: int = attrs.field(default=0, validator=at_least(0))
    """Also evaluate after every N steps (warm-up steps count: they train too); 0: before and after only."""
    batch: int = attrs.field(default=16, validator=at_least(1))
    """Examples per forward pass (a memory bound only: the figures do not depend on it beyond rounding)."""
    format: str | None = attrs.field(default=None, validator=attrs.validators.optional(choice(DATA_FORMATS)))
    """The layout of ``path`` (data.format's values); default: data.format. Left out of the hashes when unset."""
    match: str | None = attrs.field(default=None, validator=attrs.validators.optional(choice(EVAL_MATCHES)))
    """What exact match compares: 'tokens' (every answer token is the greedy one, teacher-forced) or 'number' (the
    last number greedy generation writes against the answer's number, GSM8K's rule); default: 'number' for the
    gsm8k format, else 'tokens'. Left out of the hashes when unset."""
    share: float = attrs.field(default=0.0, validator=at_least(0.0))
    """Hold out rows of data.path by content hash: a row (a conversation, for data.format 'sharegpt') is held out
    of training when the hash of its content falls below ``share`` (in [0, 1)), whatever the file's order or the
    other rows; the held-out rows are evaluated in hash order, at most ``examples`` of them. 0: the file's last
    ``examples`` rows instead. Left out of the hashes when 0."""

    def resolved_match(self, data_format: str) -> str:
        return self.match or ("number" if (self.format or data_format) == "gsm8k" else "tokens")


@attrs.frozen
class ProfileSpec:
    """Profile chosen measured steps with torch.profiler (docs/breakdown.md); the other steps run unprofiled."""

    steps: tuple[int, ...] = ()
    """Step indices to profile (measured steps: warmup_steps <= i < warmup_steps + steps); empty: no profiling."""
    level: str = attrs.field(default="module", validator=choice(PROFILE_LEVELS))
    """module: time per module class, layer and collective; operator: also per operator class, with GEMM FLOPs and
    collective bytes from shapes; full: also the profiler's timeline per step and rank (Kineto JSON,
    profile/step-N/rank-R.json in the run folder, as Holistic Trace Analysis reads it)."""
    in_statistics: bool = False
    """Count the profiled steps in the step-time statistics too (they are slower by the profiler's cost)."""


@attrs.frozen
class TelemetrySpec:
    """Hardware telemetry sampled in the background of every training rank (llmadapt.runtime.telemetry)."""

    interval_s: float = attrs.field(default=0.5, validator=at_least(0.0))
    """Seconds between samples; 0 turns the sampler off. CPU and memory per rank; on GPU, utilisation, memory,
    power and energy through NVML."""


@attrs.frozen
class LoraSpec:
    """LoRA adapters; rank 0 means off (full fine-tuning)."""

    rank: int = attrs.field(default=0, validator=at_least(0))
    alpha: float = attrs.field(default=16.0, validator=above(0))
    dropout: float = attrs.field(default=0.0, validator=at_least(0.0))
    """Probability in [0, 1)."""
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
