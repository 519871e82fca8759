"""The workload specification: what to run, independent of which stack runs it.

A `Workload` is immutable and builds offline with no side effects. Load one from TOML, YAML
or JSON with `Workload.from_file`, from a dict with `Workload.from_dict`, or build it in
Python; `Workload.with_overrides(["train.steps=5"])` applies ``--set`` style changes.
Every validation error names the field path, the value and what is allowed.

Size: over 400 lines because the whole workload schema, every field with its default and its check, is
one reading for whoever adds a field; splitting it by section would scatter the cross-field checks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import attrs

from llmadapt.errors import WorkloadError

KINDS = ("train", "finetune", "serve")
ARRIVALS = ("constant", "poisson", "gamma", "closed", "trace")
LENGTH_DISTS = ("fixed", "uniform", "normal", "dataset")
APIS = ("completions", "chat")
PRECISIONS = ("fp32", "bf16", "fp16")
OFFLOADS = ("none", "optimizer", "optimizer+params")
RECOMPUTES = ("none", "selective", "full")
PROFILE_LEVELS = ("module", "operator", "full")
QUANTIZATIONS = ("none", "int8", "nf4")
OPTIMIZERS = ("adamw", "adam", "sgd")
OPTIMIZER_IMPLS = ("torch", "cpu_adam")
DATA_SOURCES = ("synthetic", "jsonl")
FAMILIES = ("llama", "mixtral")
# Linear layers LoRA can wrap, by family (transformers' module names). Mixtral's experts are fused
# parameters in transformers 5, not linear layers: LoRA targets its attention projections.
LORA_TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


def _choice(options: tuple[str, ...]):
    def check(inst, attribute, value):
        if value not in options:
            raise WorkloadError(attribute.name, value, f"allowed: {', '.join(map(str, options))}")

    return check


def _at_least(low: int | float):
    def check(inst, attribute, value):
        if value is None:
            return
        if isinstance(value, float) and not math.isfinite(value):
            raise WorkloadError(attribute.name, value, f"must be a finite number >= {low}")
        if value < low:
            raise WorkloadError(attribute.name, value, f"must be >= {low}")

    return check


def _above(low: float):
    """Optional and finite, strictly above ``low`` (durations, SLO limits)."""
    def check(inst, attribute, value):
        if value is not None and not (math.isfinite(value) and value > low):
            raise WorkloadError(attribute.name, value, f"must be a finite number > {low}")

    return check


@attrs.frozen
class ModelSpec:
    """Model shape. Decoder-only Llama-style (RMSNorm, rotary, SwiGLU, GQA); MoE when num_experts > 0."""

    name: str = "custom"
    """Preset name or 'custom'; a label only (not part of the workload hash)."""
    family: str = attrs.field(default="llama", validator=_choice(FAMILIES))
    vocab_size: int = attrs.field(default=512, validator=_at_least(2))
    hidden_size: int = attrs.field(default=64, validator=_at_least(1))
    intermediate_size: int = attrs.field(default=176, validator=_at_least(1))
    num_layers: int = attrs.field(default=2, validator=_at_least(1))
    num_heads: int = attrs.field(default=4, validator=_at_least(1))
    num_kv_heads: int = attrs.field(default=2, validator=_at_least(1))
    max_position_embeddings: int = attrs.field(default=256, validator=_at_least(1))
    rope_theta: float = attrs.field(default=10000.0, validator=_at_least(1.0))
    norm_eps: float = 1e-5
    num_experts: int = attrs.field(default=0, validator=_at_least(0))
    """0 for a dense model; otherwise experts per MoE layer (every layer is MoE)."""
    experts_per_token: int = attrs.field(default=2, validator=_at_least(1))
    """Top-k routing: experts each token is sent to (MoE only)."""
    tie_embeddings: bool = False
    path: str | None = None
    """A local Hugging Face model folder (config.json, safetensors, tokenizer.json): its weights and tokenizer
    instead of a preset's random ones; the shape fields then come from its config.json. Not part of either hash
    (the same folder elsewhere is the same model): its content is, as ``checksum``."""
    checksum: str | None = None
    """Content hash of the folder at ``path`` (config, weights index, shard hashes, tokenizer), recorded by
    llmadapt when the workload is built and checked again before launch; not set by hand."""

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise WorkloadError("hidden_size", self.hidden_size, f"must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise WorkloadError("num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        if self.family == "mixtral" and self.num_experts < 1:
            raise WorkloadError("num_experts", self.num_experts, "family 'mixtral' needs num_experts >= 1")
        if self.family == "llama" and self.num_experts:
            raise WorkloadError("num_experts", self.num_experts, "family 'llama' is dense: use 0 or family 'mixtral'")
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise WorkloadError(
                "experts_per_token", self.experts_per_token, f"must be <= num_experts={self.num_experts}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Real shapes, from the published configs.
    "llama2-7b": dict(family="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=32, num_heads=32, num_kv_heads=32, max_position_embeddings=4096),
    "llama2-13b": dict(family="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                       num_layers=40, num_heads=40, num_kv_heads=40, max_position_embeddings=4096),
    "llama2-70b": dict(family="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                       num_layers=80, num_heads=64, num_kv_heads=8, max_position_embeddings=4096),
    "mixtral-8x7b": dict(family="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, max_position_embeddings=32768,
                         rope_theta=1e6, num_experts=8, experts_per_token=2),
    # Tiny shapes for CPU: same architecture, GQA included, seconds per run.
    "tiny-llama": dict(family="llama", vocab_size=512, hidden_size=64, intermediate_size=176,
                       num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256),
    "tiny-mixtral": dict(family="mixtral", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                         rope_theta=1e6, num_experts=4, experts_per_token=2),
}


@attrs.frozen
class DataSpec:
    """Where tokens come from. Every stack and every layout sees the same tokens at the same global step."""

    source: str = attrs.field(default="synthetic", validator=_choice(DATA_SOURCES))
    """'synthetic': seeded token sequences a model can learn; 'jsonl': instruction/answer pairs."""
    path: str | None = None
    """JSONL file (source='jsonl'); one object per line with the prompt and answer fields."""
    prompt_field: str = "instruction"
    answer_field: str = "answer"


@attrs.frozen
class TrainSpec:
    """Training and fine-tuning parameters."""

    seq_len: int = attrs.field(default=64, validator=_at_least(1))
    global_batch: int = attrs.field(default=8, validator=_at_least(1))
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch: int | None = None
    """Samples per forward/backward; default: the whole per-rank batch (no accumulation)."""
    steps: int = attrs.field(default=10, validator=_at_least(1))
    """Measured steps."""
    warmup_steps: int = attrs.field(default=2, validator=_at_least(0))
    """Steps run before the measured ones; they train too but are excluded from statistics."""
    optimizer: str = attrs.field(default="adamw", validator=_choice(OPTIMIZERS))
    lr: float = attrs.field(default=1e-3, validator=_at_least(0.0))
    weight_decay: float = attrs.field(default=0.0, validator=_at_least(0.0))
    optimizer_impl: str = attrs.field(default="torch", validator=_choice(OPTIMIZER_IMPLS))
    """Which implementation runs the optimizer's update: 'torch' (torch.optim, every adapter) or 'cpu_adam'
    (the framework's C++ CPU Adam, e.g. DeepSpeedCPUAdam, compiled at first use). The same update in exact
    arithmetic: a layout choice, not part of the problem hash."""

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps


@attrs.frozen
class Parallelism:
    """Degrees of parallelism; world size = dp * tp * pp (expert parallelism is carved out of dp * tp)."""

    dp: int = attrs.field(default=1, validator=_at_least(1))
    tp: int = attrs.field(default=1, validator=_at_least(1))
    pp: int = attrs.field(default=1, validator=_at_least(1))
    ep: int = attrs.field(default=1, validator=_at_least(1))
    p2p: bool = True
    """Peer-to-peer between GPUs (NVLink, or PCIe P2P); false sets NCCL_P2P_DISABLE=1 for the ranks, so collectives
    go through host memory (study A's NVLink against PCIe). Needs NCCL: refused where no GPU is visible."""
    threads_per_rank: int = attrs.field(default=0, validator=_at_least(0))
    """CPU threads of each rank (torch's intra-op pool, OpenMP, MKL). 0: the launcher's choice, OMP_NUM_THREADS
    where exported, else the node's cores shared among its ranks. A comparison whose cells would get different
    counts gives them all the fewest (llmadapt.analysis.compare): on a CPU, threads per rank decide the step time
    as much as the layout does."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@attrs.frozen
class Optimizations:
    """Memory and speed techniques (study A's R, F, Z2, Z3, Z2O, Z3O, Q)."""

    zero_stage: int = attrs.field(default=0, validator=_choice((0, 1, 2, 3)))
    offload: str = attrs.field(default="none", validator=_choice(OFFLOADS))
    recompute: str = attrs.field(default="none", validator=_choice(RECOMPUTES))
    flash_attention: bool = False
    quantization: str = attrs.field(default="none", validator=_choice(QUANTIZATIONS))
    """Base-weight quantization (bitsandbytes); needs LoRA (QLoRA) since quantized weights do not train."""


@attrs.frozen
class SaveSpec:
    """Keep what training produced: the trained model as a Hugging Face model folder (docs/workloads.md)."""

    path: str | None = None
    """Write the model after the last step here: config.json, safetensors shards and the tokenizer, gathered from
    every rank's shards (ZeRO-3 partitions, tensor- and pipeline-parallel slices); LoRA weights merged into the
    base. A new or empty folder; a serving workload's ``model.path`` can name it."""
    lora: str = attrs.field(default="merged", validator=_choice(("merged", "adapter")))
    """LoRA fine-tunes: 'merged' (the whole model, LoRA merged into the base: a model folder any engine serves)
    or 'adapter' (only the adapter, as peft writes it: adapter_config.json and adapter_model.safetensors, for
    engines that load LoRA adapters onto the base)."""


@attrs.frozen
class EvalSpec:
    """Evaluate the model being trained on held-out examples: before the first step, every ``every`` steps and after
    the last (docs/workloads.md). The same examples, order and metric code on every stack (llmadapt.runtime.evaluation)."""

    examples: int = attrs.field(default=0, validator=_at_least(0))
    """Held-out examples; 0: no evaluation. Without ``path``, a jsonl data set's last ``examples`` rows are held out
    of training, and synthetic data gets a stream of its own (other seeds than training's)."""
    path: str | None = None
    """A JSONL file of held-out examples (its first ``examples`` rows), with data's prompt and answer fields and an
    optional ``choices`` list (multiple choice: the answer is one of them)."""
    every: int = attrs.field(default=0, validator=_at_least(0))
    """Also evaluate after every N steps (warm-up steps count: they train too); 0: before and after only."""
    batch: int = attrs.field(default=16, validator=_at_least(1))
    """Examples per forward pass (a memory bound only: the figures do not depend on it beyond rounding)."""


@attrs.frozen
class ProfileSpec:
    """Profile chosen measured steps with torch.profiler (docs/breakdown.md); the other steps run unprofiled."""

    steps: tuple[int, ...] = ()
    """Step indices to profile (measured steps: warmup_steps <= i < warmup_steps + steps); empty: no profiling."""
    level: str = attrs.field(default="module", validator=_choice(PROFILE_LEVELS))
    """module: time per module class, layer and collective; operator: also per operator class, with GEMM FLOPs and
    collective bytes from shapes; full: also the profiler's timeline per step and rank (Kineto JSON,
    profile/step-N/rank-R.json in the run folder, as Holistic Trace Analysis reads it)."""
    in_statistics: bool = False
    """Count the profiled steps in the step-time statistics too (they are slower by the profiler's cost)."""


@attrs.frozen
class TelemetrySpec:
    """Hardware telemetry sampled in the background of every training rank (llmadapt.runtime.telemetry)."""

    interval_s: float = attrs.field(default=0.5, validator=_at_least(0.0))
    """Seconds between samples; 0 turns the sampler off. CPU and memory per rank; on GPU, utilisation, memory,
    power and energy through NVML."""


@attrs.frozen
class LoraSpec:
    """LoRA adapters; rank 0 means off (full fine-tuning)."""

    rank: int = attrs.field(default=0, validator=_at_least(0))
    alpha: float = attrs.field(default=16.0, validator=_above(0))
    dropout: float = attrs.field(default=0.0, validator=_at_least(0.0))
    """Probability in [0, 1)."""
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")


@attrs.frozen
class LengthSpec:
    """A token-length distribution. Samples are clipped to [low, high] and drawn from the workload's seed."""

    dist: str = attrs.field(default="fixed", validator=_choice(LENGTH_DISTS))
    """fixed (= mean), uniform (low..high), normal (mean, std), dataset (lengths of data.path's prompts/answers)."""
    mean: int = attrs.field(default=32, validator=_at_least(1))
    low: int = attrs.field(default=1, validator=_at_least(1))
    high: int = attrs.field(default=128, validator=_at_least(1))
    std: float = attrs.field(default=0.0, validator=_at_least(0.0))


@attrs.frozen
class ArrivalSpec:
    """When requests are sent."""

    process: str = attrs.field(default="poisson", validator=_choice(ARRIVALS))
    """constant, poisson, gamma (shape = burstiness; 1 = Poisson, < 1 burstier), closed (fixed concurrency),
    trace (replay a JSONL of send_time_s, input_len, output_len)."""
    rate: float = attrs.field(default=4.0, validator=_at_least(0.0))
    """Requests per second (open-loop processes)."""
    burstiness: float = attrs.field(default=1.0, validator=_at_least(0.0))
    concurrency: int = attrs.field(default=4, validator=_at_least(1))
    """Requests in flight at all times (closed loop)."""
    trace: str | None = None


@attrs.frozen
class SloSpec:
    """Service-level objectives for goodput: a request counts if it meets every one given."""

    ttft_ms: float | None = attrs.field(default=None, validator=_above(0))
    tpot_ms: float | None = attrs.field(default=None, validator=_above(0))
    e2el_ms: float | None = attrs.field(default=None, validator=_above(0))


@attrs.frozen
class EngineSpec:
    """Arguments of the serving engine, by one name on every engine: each adapter declares which it takes
    (``Supports.engine``) and passes them as its engine's own flags; the defaults leave the engine's own defaults
    (and the adapter's). Recorded with the workload in every trace's header."""

    tensor_parallel: int = attrs.field(default=1, validator=_at_least(1))
    """Tensor-parallel degree inside the engine (vLLM's --tensor-parallel-size)."""
    quantization: str = "none"
    """The engine's weight quantization method, by its name (vLLM's --quantization, e.g. 'fp8'); 'none': off."""
    kv_cache_bytes: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least(1)))
    """KV-cache size (vLLM's --kv-cache-memory-bytes); None: the adapter's default."""
    max_batched_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least(1)))
    """Tokens per engine step (vLLM's --max-num-batched-tokens; the reference server's --cb-max-batch-tokens)."""
    max_sequences: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least(1)))
    """Sequences in one batch (vLLM's --max-num-seqs)."""
    scheduling: str = attrs.field(default="fcfs", validator=_choice(("fcfs", "priority")))
    """Scheduling policy (vLLM's --scheduling-policy)."""

    def given(self) -> dict[str, Any]:
        """The arguments set away from their defaults."""
        default = EngineSpec()
        return {f.name: getattr(self, f.name) for f in attrs.fields(EngineSpec)
                if getattr(self, f.name) != getattr(default, f.name)}


@attrs.frozen
class ServeSpec:
    """Serving: the request stream the load generator sends, the same to every engine."""

    arrival: ArrivalSpec = attrs.field(factory=ArrivalSpec)
    requests: int = attrs.field(default=32, validator=_at_least(1))
    """Measured requests (warm-up requests come on top)."""
    duration_s: float | None = attrs.field(default=None, validator=_above(0))
    """Stop scheduling after this many seconds (requests still bounds the count)."""
    warmup_requests: int = attrs.field(default=2, validator=_at_least(0))
    max_concurrency: int | None = attrs.field(default=None, validator=_at_least(1))
    """Cap on requests in flight for open-loop processes (none: unbounded)."""
    input_len: LengthSpec = attrs.field(factory=lambda: LengthSpec(mean=32))
    output_len: LengthSpec = attrs.field(factory=lambda: LengthSpec(mean=16))
    ignore_eos: bool = True
    """Force the output length where the engine allows it (recorded either way)."""
    api: str = attrs.field(default="completions", validator=_choice(APIS))
    slo: SloSpec = attrs.field(factory=SloSpec)
    request_timeout_s: float = attrs.field(default=120.0, validator=_at_least(0.001))
    scrape_interval_s: float = attrs.field(default=1.0, validator=_at_least(0.05))
    """How often the engine's own metrics are sampled."""
    send_spin_ms: float = attrs.field(default=5.0, validator=_at_least(0))
    """Open loops: each request's task yield-spins this long before its send time, for a sub-millisecond
    send lag (the event loop's timer alone woke >1.5 ms late for ~1 % of sends on an idle VM); it keeps
    most of a core busy at hundreds of requests/s. 0 (the timer only, as `vllm bench serve` does) where
    the engine shares the client's CPUs."""
    url: str | None = None
    """Attach to a running server at this URL instead of starting one (adapters that can)."""
    engine: EngineSpec = attrs.field(factory=EngineSpec)
    mode: str = attrs.field(default="online", validator=_choice(("online", "offline")))
    """'online': requests sent over the engine's API at their arrival times (the load generator); 'offline': the
    whole request set handed to the engine's offline API at once (vLLM's LLM.generate, transformers' generate),
    for tokens per second without a server (llmadapt.runtime.offline)."""
    stream: int = attrs.field(default=0, validator=_at_least(0))
    """Which of the workload's request streams (prompts, lengths, arrival times) to send; 0: the usual one. Load
    sweeps give each load point its own, so that no prompt reaches one engine twice (a prefix cache would answer
    it from memory), and the same point the same stream on every engine."""


CHECKPOINT_RECIPE = 2
"""How llmadapt builds a preset's canonical checkpoint (llmadapt.models); bump whenever the weights it writes for a
preset and seed change (2: written streaming, in shards). A preset problem's identity includes it: the same preset
and seed with other weights is another problem (tests/test_docs.py fails when a documented loss stops reproducing)."""

# Fields that change how a workload runs but not the numbers it computes (in exact arithmetic).
# Runs whose workloads differ only here share a problem hash, so their losses can be compared.
_LAYOUT_FIELDS = {
    "parallelism": None,
    "train": ("micro_batch", "optimizer_impl"),
    "optimizations": ("zero_stage", "offload", "recompute", "flash_attention"),
    "profile": None,  # looking does not change the numbers
    "save": None,  # nor does keeping the result
    "eval": ("batch",),  # how many examples share a forward pass
    "telemetry": None,
}


@attrs.frozen
class Workload:
    """One workload: the unit that runs identically on every stack."""

    kind: str = attrs.field(default="train", validator=_choice(KINDS))
    name: str = ""
    """A label only (not part of the hash)."""
    seed: int = 0
    model: ModelSpec = attrs.field(factory=lambda: ModelSpec(name="tiny-llama", **MODEL_PRESETS["tiny-llama"]))
    data: DataSpec = attrs.field(factory=DataSpec)
    train: TrainSpec = attrs.field(factory=TrainSpec)
    precision: str = attrs.field(default="fp32", validator=_choice(PRECISIONS))
    parallelism: Parallelism = attrs.field(factory=Parallelism)
    optimizations: Optimizations = attrs.field(factory=Optimizations)
    lora: LoraSpec = attrs.field(factory=LoraSpec)
    serve: ServeSpec = attrs.field(factory=ServeSpec)
    profile: ProfileSpec = attrs.field(factory=ProfileSpec)
    save: SaveSpec = attrs.field(factory=SaveSpec)
    eval: EvalSpec = attrs.field(factory=EvalSpec)
    telemetry: TelemetrySpec = attrs.field(factory=TelemetrySpec)
    adapters: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    """Settings for one adapter only: adapter name -> {dotted path: value} (``[adapters.megatron]`` in a file,
    ``--set megatron:parallelism.tp=2``). They wait here until `for_adapter` applies one adapter's; not part of
    either hash."""
    sources: dict[str, str] = attrs.field(factory=dict, eq=False)
    """Where each field that was set explicitly came from: dotted path -> 'file', 'file [adapters.NAME]',
    '--set', '--set NAME:', 'cell', 'matrix'. Settings still waiting for their adapter are under 'NAME:path'.
    Recorded in every trace header with the final workload; not part of either hash."""

    def __attrs_post_init__(self) -> None:
        _check_workload(self)
        known = self.to_dict() if self.adapters else {}
        for name, settings in self.adapters.items():
            if not isinstance(settings, dict):
                raise WorkloadError(f"adapters.{name}", settings, "must be a table of settings for that adapter")
            for path, value in settings.items():
                _field_at(known, path, value, name)  # an unknown field is refused now, not at for_adapter

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        """Build from plain data (parsed TOML/YAML/JSON); model.preset expands to its fields."""
        return _build(cls, data, "")

    @classmethod
    def from_file(cls, path: str | Path) -> Workload:
        path = Path(path)
        if not path.is_file():
            raise WorkloadError("file", str(path), "no such workload file")
        try:
            data = read_document(path)
        except ValueError as exc:
            raise WorkloadError("file", str(path), str(exc)) from None
        if not isinstance(data, dict):
            raise WorkloadError("file", str(path), "the top level must be a table/mapping")
        if not data:  # running the defaults is never what an empty file meant
            raise WorkloadError("file", str(path), "is empty: it sets no field of the workload")
        # A workload llmadapt wrote (to_dict, a run's launch.json) carries its old record of where each setting
        # came from; read back, every setting now comes from this file.
        recorded = data.pop("sources", {})
        if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
            raise WorkloadError("sources", recorded, "is recorded by llmadapt (where each setting came from), "
                                "not set by hand")
        sections = data.get("adapters", {})
        if not isinstance(sections, dict) or not all(isinstance(v, dict) for v in sections.values()):
            raise WorkloadError("adapters", sections, "must hold one table per adapter, e.g. [adapters.megatron] "
                                "with parallelism.tp = 2")
        data = {**data, "adapters": {name: _flatten(section) for name, section in sections.items()}}
        data["sources"] = {p: "file" for p in _flatten({k: v for k, v in data.items() if k != "adapters"})}
        data["sources"].update({f"{name}:{p}": f"file [adapters.{name}]"
                                for name, section in data["adapters"].items() for p in section})
        for key in ("data", "model", "eval"):
            section = data.get(key)
            if isinstance(section, dict) and isinstance(section.get("path"), str) and not Path(section["path"]).is_absolute():
                # Data and model paths in a file are relative to that file, so examples run from anywhere
                # (a hub-like name that is no folder there stays as written, to be named as such).
                local = (path.parent / section["path"]).resolve()
                if key != "model" or local.exists():
                    data = {**data, key: {**section, "path": str(local)}}
        return cls.from_dict(data)

    def with_overrides(self, assignments: list[str] | tuple[str, ...], *, source: str = "override") -> Workload:
        """Apply ``path=value`` assignments (values parsed as YAML scalars/lists), in order.

        ``NAME:path=value`` is a setting for adapter NAME only: it waits in ``adapters`` until `for_adapter`.
        A setting for all adapters replaces any earlier one-adapter setting of the same field: the last
        setting of a field wins. ``source`` is recorded in ``sources`` ('--set', 'cell', 'matrix', ...).
        """
        if not assignments:
            return self
        import yaml

        items = []
        for assignment in assignments:
            key, sep, raw = assignment.partition("=")
            adapter, colon, path = key.strip().rpartition(":")
            if not sep or not path or (colon and not adapter):
                raise WorkloadError(source, assignment, "use path=value, e.g. train.steps=5, or adapter:path=value "
                                    "for one adapter, e.g. megatron:parallelism.tp=2")
            try:
                value = load_yaml(raw) if raw else ""
            except yaml.YAMLError:
                value = raw
            items.append((adapter.strip() or None, path.strip(), value))
        return self._with_values(items, source)

    def for_adapter(self, name: str) -> Workload:
        """This workload as adapter ``name`` runs it: its own settings applied, in order, after the settings
        for all; no adapter's settings left waiting. Errors name the adapter ('megatron:parallelism.tp')."""
        own = self.adapters.get(name, {})
        base = attrs.evolve(self, adapters={}, sources={k: v for k, v in self.sources.items() if ":" not in k})
        origins = {path: self.sources.get(f"{name}:{path}", f"{name}:") for path in own}
        return base._with_values([(None, path, value) for path, value in own.items()], origins, scope=name)

    def _with_values(self, items: list[tuple[str | None, str, Any]], source: str | dict[str, str], *,
                     scope: str | None = None) -> Workload:
        """Apply (adapter or None, dotted path, value) settings in order. ``source``: what to record for each
        (one label, or one per path); ``scope``: the adapter every error names."""
        if not items:
            return self
        data = self.to_dict()
        waiting, sources = data["adapters"], data["sources"]
        for adapter, path, value in items:
            origin = source.get(path, "") if isinstance(source, dict) else f"{source} {adapter}:" if adapter else source
            target = _field_at(data, path, value, adapter or scope)
            if adapter:  # waits for its adapter; a field set again moves to the end (applied in the order given)
                waiting.setdefault(adapter, {}).pop(path, None)
                waiting[adapter][path] = value
                sources[f"{adapter}:{path}"] = origin
                continue
            if path in ("model.preset", "model.path"):  # a preset or a folder replaces the whole model section
                data["model"] = {path.split(".")[1]: value}
                for key in [k for k in sources if k.startswith("model.")]:
                    del sources[key]
            else:
                target[path.split(".")[-1]] = value
            sources[path] = origin
            for name in list(waiting):  # a later setting for all wins over an earlier one for one adapter
                if path in waiting[name]:
                    del waiting[name][path]
                    sources.pop(f"{name}:{path}", None)
                if not waiting[name]:
                    del waiting[name]
        try:
            return Workload.from_dict(data)
        except WorkloadError as exc:
            if scope and not exc.field.startswith(f"{scope}:"):
                raise WorkloadError(f"{scope}:{exc.field}", exc.value, exc.allowed) from None
            raise

    # -- identity -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @property
    def content_hash(self) -> str:
        """Stable hash of everything that defines the workload (labels, per-adapter settings and sources
        excluded: apply `for_adapter` first)."""
        return _hash(_without_labels(self.to_dict()))

    def problem_dict(self) -> dict[str, Any]:
        """What determines the loss trajectory, the problem hash's input: layout and memory techniques (the
        parallelism section, micro-batch, optimizer implementation, ZeRO, offload, recompute, flash attention),
        labels and per-adapter settings left out; the weights' identity in (a model folder's content checksum, or
        for a preset the recipe that builds its canonical checkpoint)."""
        data = _without_labels(self.to_dict())
        if "checksum" not in data["model"]:  # a preset: its weights are the recipe's (a model folder's, its content)
            data["model"]["checkpoint_recipe"] = CHECKPOINT_RECIPE
        for section, fields in _LAYOUT_FIELDS.items():
            if section not in data:  # left out of the hash altogether (an eval section that evaluates nothing)
                continue
            if fields is None:
                data.pop(section)
            else:
                for field in fields:
                    data[section].pop(field)
        return data

    @property
    def problem_hash(self) -> str:
        """Hash of what determines the loss trajectory: layout and memory techniques excluded."""
        return _hash(self.problem_dict())

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def per_rank_batch(self) -> int:
        return self.train.global_batch // self.parallelism.dp

    @property
    def micro_batch(self) -> int:
        return self.train.micro_batch or self.per_rank_batch

    @property
    def label(self) -> str:
        return self.name or f"{self.kind}-{self.model.name}"


def _without_labels(data: dict[str, Any]) -> dict[str, Any]:
    """A workload's dict less what does not define it: labels, per-adapter settings, sources, the model
    folder's location (its content is the checksum; absent for a preset, so older hashes stay as they were), and
    the eval section when nothing is evaluated, save.lora, serve.stream, serve.mode, serve.engine,
    parallelism.p2p and parallelism.threads_per_rank at their defaults (so are older hashes)."""
    for key in ("name", "adapters", "sources"):
        data.pop(key)
    if not data["eval"]["examples"]:
        data.pop("eval")
    if data["save"]["lora"] == "merged":
        data["save"].pop("lora")
    if not data["serve"]["stream"]:
        data["serve"].pop("stream")
    if data["serve"]["mode"] == "online":
        data["serve"].pop("mode")
    if data["serve"]["engine"] == attrs.asdict(EngineSpec()):
        data["serve"].pop("engine")
    if data["parallelism"]["p2p"]:
        data["parallelism"].pop("p2p")
    if not data["parallelism"]["threads_per_rank"]:
        data["parallelism"].pop("threads_per_rank")
    for key in ("name", "path"):
        data["model"].pop(key)
    if data["model"]["checksum"] is None:
        data["model"].pop("checksum")
    return data


def problem_difference(a: Workload, b: Workload) -> list[str]:
    """The fields (dotted paths, with both values) where two workloads pose different problems."""
    fa, fb = _flatten(a.problem_dict()), _flatten(b.problem_dict())
    return [f"{k} ({fa.get(k)!r} vs {fb.get(k)!r})" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"parallelism": {"tp": 2}} -> {"parallelism.tp": 2}; keys that are dotted paths already stay as they are."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _field_at(data: dict[str, Any], path: str, value: Any, scope: str | None = None) -> dict[str, Any]:
    """The section of a workload's dict that holds the field at ``path``; one line naming it when none does
    (as 'scope:path' for a setting of one adapter)."""
    parts = path.split(".")
    named = (lambda p: f"{scope}:{p}") if scope else (lambda p: p)
    if parts[0] in ("adapters", "sources"):
        raise WorkloadError(named(path), value, "is not a field to set (settings for one adapter are "
                            "adapter:path=value)")
    target = data
    for i, part in enumerate(parts[:-1]):
        if not isinstance(target.get(part), dict):
            raise WorkloadError(named(".".join(parts[: i + 1])), part, "is not a section of the workload")
        target = target[part]
    if parts[-1] not in target and path != "model.preset":
        known = ", ".join(sorted(k for k in target if k not in ("adapters", "sources")))
        raise WorkloadError(named(path), value, f"unknown field; known here: {known}")
    return target


def _hash(data: dict[str, Any]) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def read_document(path: Path) -> Any:
    """A TOML, YAML (empty: {}) or JSON file's content, by its suffix; ValueError with the reason, in one line, when
    it cannot be read or parsed (workload files, sweep files)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or exc}") from None
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ValueError("use a .toml, .yaml, .yml or .json file")
    try:
        if suffix == ".toml":
            import tomllib

            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text)
        return load_yaml(text) or {}
    except Exception as exc:  # parse errors of three libraries: one clear line
        raise ValueError(f"could not be parsed: {exc}") from None


def _check_workload(w: Workload) -> None:
    """Cross-field rules; each failure names one field."""
    p, t, o = w.parallelism, w.train, w.optimizations
    if t.global_batch % p.dp:
        raise WorkloadError("train.global_batch", t.global_batch, f"must be divisible by parallelism.dp={p.dp}")
    if t.micro_batch is not None:
        if t.micro_batch < 1 or w.per_rank_batch % t.micro_batch:
            raise WorkloadError(
                "train.micro_batch", t.micro_batch,
                f"must divide the per-rank batch global_batch/dp = {w.per_rank_batch}",
            )
    if t.seq_len > w.model.max_position_embeddings:
        raise WorkloadError(
            "train.seq_len", t.seq_len, f"must be <= model.max_position_embeddings={w.model.max_position_embeddings}"
        )
    if w.model.num_heads % p.tp or w.model.num_kv_heads % p.tp:
        raise WorkloadError(
            "parallelism.tp", p.tp,
            f"must divide model.num_heads={w.model.num_heads} and model.num_kv_heads={w.model.num_kv_heads}",
        )
    if p.pp > w.model.num_layers:
        raise WorkloadError("parallelism.pp", p.pp, f"must be <= model.num_layers={w.model.num_layers}")
    if p.ep > 1:
        if not w.model.is_moe:
            raise WorkloadError("parallelism.ep", p.ep, "expert parallelism needs an MoE model (model.num_experts > 0)")
        if w.model.num_experts % p.ep:
            raise WorkloadError("parallelism.ep", p.ep, f"must divide model.num_experts={w.model.num_experts}")
        if (p.dp * p.tp) % p.ep:
            raise WorkloadError("parallelism.ep", p.ep, f"must divide dp*tp={p.dp * p.tp}")
    if w.profile.steps:
        if w.kind == "serve":
            raise WorkloadError("profile.steps", list(w.profile.steps), "profiling is for train and finetune workloads")
        first, last = t.warmup_steps, t.total_steps - 1
        for i in w.profile.steps:
            if not first <= i <= last:
                raise WorkloadError("profile.steps", list(w.profile.steps),
                                    f"step {i} is not a measured step: measured steps are {first}..{last} "
                                    f"(after train.warmup_steps={t.warmup_steps})")
        if len(set(w.profile.steps)) != len(w.profile.steps):
            raise WorkloadError("profile.steps", list(w.profile.steps), "names a step twice")
    if t.optimizer_impl == "cpu_adam" and t.optimizer == "sgd":
        raise WorkloadError("train.optimizer_impl", t.optimizer_impl, "cpu_adam needs train.optimizer adam or adamw")
    if o.offload == "optimizer" and o.zero_stage == 0:
        raise WorkloadError("optimizations.offload", o.offload, "optimizer offload needs optimizations.zero_stage >= 1")
    if o.offload == "optimizer+params" and o.zero_stage != 3:
        raise WorkloadError("optimizations.offload", o.offload, "parameter offload needs optimizations.zero_stage = 3")
    if w.lora.rank and w.kind != "finetune":
        raise WorkloadError("lora.rank", w.lora.rank, "LoRA needs kind = 'finetune'")
    if not w.lora.dropout < 1:
        raise WorkloadError("lora.dropout", w.lora.dropout, "must be in [0, 1)")
    if w.lora.rank:
        known = LORA_TARGETS[w.model.family]
        if not w.lora.target_modules:
            raise WorkloadError("lora.target_modules", [], f"name at least one of: {', '.join(known)}")
        wrong = [m for m in w.lora.target_modules if m not in known]
        if wrong:
            raise WorkloadError("lora.target_modules", wrong[0][:40],
                                f"not a linear layer of a {w.model.family} model; known: {', '.join(known)}")
    if o.quantization != "none" and not w.lora.rank:
        raise WorkloadError(
            "optimizations.quantization", o.quantization, "quantized base weights do not train: set lora.rank > 0 (QLoRA)"
        )
    if w.save.path is not None and w.kind == "serve":
        raise WorkloadError("save.path", w.save.path, "saving the trained model is for train and finetune workloads")
    if w.save.lora == "adapter" and not w.lora.rank:
        raise WorkloadError("save.lora", w.save.lora, "'adapter' saves a LoRA adapter: needs lora.rank > 0")
    if w.save.path is not None and o.quantization != "none":
        raise WorkloadError("save.path", w.save.path, "quantized base weights cannot be saved as a model (QLoRA "
                            "merged into 4- or 8-bit weights would be dequantized): train without quantization")
    if w.kind == "serve":
        _check_serve(w)
    rows = None
    if w.data.source == "jsonl":
        if not w.data.path:
            raise WorkloadError("data.path", w.data.path, "data.source = 'jsonl' needs a path to a JSONL file")
        if not Path(w.data.path).is_file():
            raise WorkloadError("data.path", w.data.path, "no such file")
        rows = _check_jsonl(w.data, w.data.path, "data.path")
    _check_eval(w, rows)


def _check_eval(w: Workload, data_rows: int | None) -> None:
    e = w.eval
    if not e.examples:
        for name in ("path", "every"):
            if getattr(e, name):
                raise WorkloadError(f"eval.{name}", getattr(e, name), "needs eval.examples > 0 (how many to evaluate)")
        return
    if w.kind == "serve":
        raise WorkloadError("eval.examples", e.examples, "evaluation is for train and finetune workloads")
    if w.optimizations.quantization != "none":
        raise WorkloadError("eval.examples", e.examples, "evaluation reads the trained model as a Hugging Face "
                            "folder, which quantized base weights cannot be saved as (see save.path)")
    if e.path is not None:
        if not Path(e.path).is_file():
            raise WorkloadError("eval.path", e.path, "no such file")
        rows = _check_jsonl(w.data, e.path, "eval.path", choices=True)
        if e.examples > rows:
            raise WorkloadError("eval.examples", e.examples, f"more than the {rows} examples in eval.path")
    elif data_rows is not None and e.examples >= data_rows:
        raise WorkloadError("eval.examples", e.examples, f"holds out too many of data.path's {data_rows} examples: "
                            "training needs at least one (or give eval.path)")


def _check_jsonl(d: DataSpec, path: str, field_name: str, choices: bool = False) -> int:
    """Every line an object with the prompt and answer fields as text (and for evaluation, an optional ``choices``
    list of texts holding the answer): checked here, not minutes later. Returns the number of examples."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(field_name, path, f"cannot be read as UTF-8 text: {exc}") from None
    rows = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(field_name, path, f"line {number} is not JSON ({exc.msg})") from None
        for field in (d.prompt_field, d.answer_field):
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise WorkloadError(field_name, path, f"line {number} needs a text field {field!r} "
                                    "(set data.prompt_field / data.answer_field to the file's names)")
        if choices and "choices" in row:
            options = row["choices"]
            if not isinstance(options, list) or len(options) < 2 or not all(isinstance(c, str) for c in options):
                raise WorkloadError(field_name, path, f"line {number}: choices must be a list of two or more texts")
            if row[d.answer_field] not in options:
                raise WorkloadError(field_name, path, f"line {number}: the answer is not one of its choices")
        rows += 1
    if not rows:
        raise WorkloadError(field_name, path, "has no examples (the file is empty)")
    return rows


def _check_serve(w: Workload) -> None:
    s = w.serve
    if s.mode == "offline" and s.url is not None:
        raise WorkloadError("serve.mode", s.mode, "offline runs the engine's offline API here: not with serve.url")
    if s.url is not None and s.engine.given():
        name, value = next(iter(s.engine.given().items()))
        raise WorkloadError(f"serve.engine.{name}", value, "an attached engine (serve.url) runs with the arguments "
                            "it was started with: set them where it is started")
    if s.url is not None:
        from urllib.parse import urlsplit

        parts = urlsplit(s.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WorkloadError("serve.url", s.url[:80], "must be an http:// or https:// URL with a host")
    for name in ("input_len", "output_len"):
        spec: LengthSpec = getattr(s, name)
        if spec.low > spec.high:
            raise WorkloadError(f"serve.{name}.low", spec.low, f"must be <= serve.{name}.high={spec.high}")
        if spec.dist == "dataset" and w.data.source != "jsonl":
            raise WorkloadError(f"serve.{name}.dist", "dataset", "needs data.source = 'jsonl' with a data.path")
    longest = s.input_len.high if s.input_len.dist != "fixed" else s.input_len.mean
    longest += s.output_len.high if s.output_len.dist != "fixed" else s.output_len.mean
    if longest > w.model.max_position_embeddings:
        raise WorkloadError("serve.input_len", longest, f"input + output tokens must fit "
                            f"model.max_position_embeddings={w.model.max_position_embeddings}")
    if s.arrival.process == "trace":
        if not s.arrival.trace or not Path(s.arrival.trace).is_file():
            raise WorkloadError("serve.arrival.trace", s.arrival.trace, "process 'trace' needs an existing JSONL file")
    elif s.arrival.process != "closed" and s.arrival.rate <= 0:
        raise WorkloadError("serve.arrival.rate", s.arrival.rate, "must be > 0 for open-loop arrivals")
    if s.arrival.process == "gamma" and s.arrival.burstiness <= 0:
        raise WorkloadError("serve.arrival.burstiness", s.arrival.burstiness, "must be > 0")


# -- dict -> attrs, with field paths in every error --------------------------------------------
def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise WorkloadError(path or "workload", data, "must be a table/mapping")
    data = dict(data)
    if cls is ModelSpec and "preset" in data:
        preset = data.pop("preset")
        if not isinstance(preset, str) or preset not in MODEL_PRESETS:
            raise WorkloadError(f"{path}.preset", preset, f"known presets: {', '.join(MODEL_PRESETS)}")
        if data.get("path") is not None:
            raise WorkloadError(f"{path}.path", data["path"], f"model.preset {preset!r} is set too: give one of the two")
        data = {"name": preset, **MODEL_PRESETS[preset], **data}
    if cls is ModelSpec and data.get("path") is not None:
        data = _model_folder(data, path)
    if cls is SaveSpec and isinstance(data.get("path"), str) and data["path"]:
        data["path"] = str(Path(data["path"]).resolve())  # workers run elsewhere: the folder the user meant
    fields = {f.name: f for f in attrs.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise WorkloadError(where, data[unknown[0]], f"unknown field; known: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        field_path = f"{path}.{name}" if path else name
        kwargs[name] = _convert(hints[name], value, field_path)
    try:
        return cls(**kwargs)
    except WorkloadError as exc:
        # Validators know only their own field name: prefix the section path.
        field = exc.field if not path or exc.field.startswith(path) else f"{path}.{exc.field}"
        raise WorkloadError(field, exc.value, exc.allowed) from None


def _model_folder(data: dict[str, Any], where: str) -> dict[str, Any]:
    """model.path: the shape fields from the folder's config.json, after checking the folder; its content hash.
    A workload llmadapt recorded carries the checksum and the fields already: taken as they are here (the folder
    may be on another machine) and checked against the folder before launch."""
    folder = data["path"]
    if not isinstance(folder, str) or not folder:
        raise WorkloadError(f"{where}.path", folder, "must be the path of a local model folder")
    if data.get("checksum"):
        return data
    from llmadapt.modelfolder import FolderError, content_hash, shape_of

    if Path(folder).exists():
        folder = str(Path(folder).resolve())
    try:
        fields = shape_of(folder)
        checksum = content_hash(folder)
    except FolderError as exc:
        raise WorkloadError(f"{where}.path", folder, str(exc)) from None
    for key, value in data.items():
        if key in fields and value != fields[key]:
            raise WorkloadError(f"{where}.{key}", value, f"model.path's config.json says {fields[key]!r}: leave it out")
    return {"name": Path(folder).name, **data, **fields, "path": folder, "checksum": checksum}


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if attrs.has(hint):
        return _build(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(options[0], value, path)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise WorkloadError(path, value, "must be a list")
        return tuple(_convert(typing.get_args(hint)[0], v, path) for v in value)
    if origin is Literal:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise WorkloadError(path, value, "must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WorkloadError(path, value, "must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WorkloadError(path, value, "must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise WorkloadError(path, value, "must be a string")
        return value
    return value


def load_yaml(text: str):
    """YAML as people write numbers: ``3e-3``, ``1e-4`` and ``1E5`` are numbers (YAML 1.2), not strings.

    PyYAML follows YAML 1.1, whose float needs a dot and a signed exponent (``3.0e-3``), so the
    documented ``--set train.lr=3e-3`` arrived as the string "3e-3" and was refused."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass


@functools.cache
def _yaml_loader():
    """PyYAML's SafeLoader plus YAML 1.2's floats; built once (load_yaml runs for every --set value)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"))
    return Loader
