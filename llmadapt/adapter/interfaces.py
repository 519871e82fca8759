"""The role interfaces an adapter's worker classes implement: ``Trainer``, ``FineTuner`` and ``Server``;
what a training step returns (``StepResult``) and what an offline engine gives per request (``Generated``). They run inside the adapter's own environment.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, AsyncIterator

import attrs

from llmadapt.adapter.breakdown import hf_module_class, rotary_calls
from llmadapt.adapter.context import Chunk, PlannedRequest, ServeContext, StepBatch, WorkerContext
from llmadapt.contract.records import Comm, Metric, Patch, Phase, Span, WeightClass


@attrs.frozen
class StepResult:
    """What an adapter reports for one global step."""

    loss: float
    """Global-batch loss: sum of token losses over every rank / batch.loss_tokens_global."""
    phases: list[Phase] = attrs.Factory(list)
    expert_load: list[list[int]] | None = None
    expert_near_ties: list[int] | None = None
    """Per MoE layer, tokens routed by a near-tie (see llmadapt.adapter.moe)."""
    spans: list[Span] = attrs.Factory(list)
    comms: list[Comm] = attrs.Factory(list)
    """The framework's own collective records for this step (written as 'comm' records)."""
    metrics: list[Metric] = attrs.Factory(list)
    grad_norm: float | None = None
    """Global L2 norm of the gradients the optimizer step received, over every rank's shard, as the framework
    reduces it (the value it would clip by). A NaN or infinite norm ends the run as 'diverged'."""


@attrs.frozen
class Generated:
    """What an offline engine's ``generate`` gives for one request (instead of the bare token count), where its
    API says when the tokens came, on the monotonic clock (``time.monotonic_ns()``): each output token's time
    (``token_ns``, the first at the end of its prefill), or only the first and the last token's. The run then
    has the request's TTFT (from the call) and TPOT, and with every token's time its ITL, with the same
    statistics as an online run."""

    tokens: int
    token_ns: list[int] = attrs.Factory(list)
    first_token_ns: int | None = None
    last_token_ns: int | None = None


class Trainer(abc.ABC):
    """Pre-training: the core drives the loop and owns the clock; ``step`` does one global step.

    Lifecycle, all inside the worker process: ``__init__(ctx)``, ``setup()`` (build or load
    the model from ``ctx.checkpoint``, wrap it, make the optimizer; append any compatibility
    patch to ``self.patches``, and to ``self.notes`` a line for what a reader must know of how it ran, such as
    a model's slow path: ``llmadapt.adapter.kernels.slow_paths``), and to ``self.weights`` what the model holds per
    module class (``llmadapt.adapter.quantization.quantized_model_classes``, which also refuses a quantization that
    leaves a part unquantized), then ``step(batch)`` for every warm-up and measured step, then
    ``teardown()``. Raise exceptions freely: the core records them as failures.
    """

    role = "train"

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.patches: list[Patch] = []
        self.notes: list[str] = []
        self.weights: list[WeightClass] = []

    @abc.abstractmethod
    def setup(self) -> None:
        """Build the model from the canonical checkpoint, the optimizer and the parallel layout."""

    @abc.abstractmethod
    def step(self, batch: StepBatch) -> StepResult:
        """Run one global step over ``batch.micro_batches`` (this rank's share) and the optimizer step."""

    def teardown(self) -> None:
        """Release framework resources (the core destroys the default process group)."""

    def model_loaded(self) -> None:
        """Call in ``setup`` when the checkpoint's weights are in place, before wrapping the model and making the
        optimizer: the trace then has what loading cost apart from the rest of setup (``load_seconds``,
        ``load_peak_rss_bytes``: the process's memory high-water mark at that moment)."""
        import resource
        import time

        self.loaded_at = (time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0)

    def save_pretrained(self, folder: Path, adapter_only: bool = False) -> None:
        """Write the trained weights into ``folder`` as Hugging Face safetensors with the model's config.json
        (``workload.save.path``, and each evaluation; declare ``Supports.save``). Called on every rank: gather
        what is sharded, rank 0 writes. The core adds the tokenizer. ``adapter_only`` (save.lora = 'adapter', LoRA
        runs only): the LoRA adapter alone, as peft writes it; otherwise LoRA merged into the base."""
        raise NotImplementedError(f"{type(self).__name__} cannot save the trained model")

    def plain_transformers(self):
        """A context in which transformers runs as in a process without this framework: evaluation loads the saved
        model in it, on rank 0 alone (llmadapt.runtime.evaluation). Undo there what the framework registered with
        transformers globally (e.g. a ZeRO-3 config that makes every load a collective). Default: nothing."""
        import contextlib

        return contextlib.nullcontext()

    def final_records(self) -> list[Comm | Metric]:
        """Run-level figures from the framework (comms summaries, FLOPs profiler totals), written after the last step."""
        return []

    def data_rank(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size) of this process: which share of the global batch it reads."""
        return self.ctx.rank, self.ctx.world_size

    def framework_version(self) -> str:
        """Installed version of the wrapped framework, for the trace header."""
        return ""

    def rank_role(self) -> str:
        """Where this rank sits in the framework's layout (e.g. 'pipeline stage 1/2'), named in its failure records."""
        return ""

    def profiled_modules(self) -> list[Any]:
        """The torch modules this rank runs, whose parts a profiled step times (workload.profile). Default: every
        ``torch.nn.Module`` among this object's attributes (a model, a DeepSpeed engine, a wrapped model)."""
        import torch

        return [v for v in vars(self).values() if isinstance(v, torch.nn.Module)]

    def module_class(self, name: str, type_name: str) -> str | None:
        """The breakdown class (llmadapt.adapter.breakdown.MODULE_CLASSES) of one module, by its qualified name
        and type name; None leaves it to its structure (llmadapt.adapter.structure: a state-space mixer, experts,
        a norm ...), else its time to the enclosing module's. Default: transformers' Llama and Mixtral."""
        return hf_module_class(name, type_name)

    def profiled_calls(self) -> list[tuple[Any, str, str]]:
        """Work a stack does outside any module, timed as a class during profiled steps: (object, method name,
        class) triples, e.g. Megatron-core computes the loss in a method of GPTModel. Default: transformers'
        rotary embedding, applied by a function of the model's Python module (an override adds to these)."""
        return rotary_calls(self.profiled_modules())


class FineTuner(Trainer):
    """Fine-tuning from the canonical checkpoint: full, LoRA or QLoRA, per ``workload.lora`` and quantization."""

    role = "finetune"


class Server(abc.ABC):
    """Serving: start (or attach to) an engine, say when it is ready, stream one request, scrape its metrics, stop.

    Unlike the training roles, a Server runs in the orchestrator, next to the load generator,
    so its module must stay light (no torch): the engine itself runs as a subprocess in the
    adapter's environment (``ctx.python``) or elsewhere (``workload.serve.url``). The load
    generator owns the clock: ``stream`` only yields chunks as they arrive; the generator
    stamps them. Raise ``RequestFailed(cause, message)`` for a failed request.
    """

    role = "serve"
    itl_histogram: str | None = None
    """The engine's inter-token latency histogram among its scraped metrics (Prometheus, seconds; e.g.
    ``vllm:inter_token_latency_seconds``): with it, a run sees chunks that reached the client in bursts."""
    prefix_cache_counters: tuple[str, str] | None = None
    """The engine's prefix-cache counters among its scraped metrics, (tokens found, tokens looked up), e.g.
    ``("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")``: the summary gives their ratio over the
    run beside the share of the stream's prompt tokens that a prefix cache could find."""

    def __init__(self, ctx: ServeContext) -> None:
        self.ctx = ctx
        self.patches: list[Patch] = []
        self.notes: list[str] = []
        """Lines for what a reader must know of how the engine ran (the header's ``notes``), added by ``start``."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start the engine (a subprocess on 127.0.0.1, in its own process group) or attach to ctx.workload.serve.url."""

    @abc.abstractmethod
    async def ready(self, session: Any) -> bool:
        """True once the engine accepts requests (e.g. GET /health answers 200). ``session``: an aiohttp session."""

    @abc.abstractmethod
    def stream(self, session: Any, request: PlannedRequest) -> AsyncIterator[Chunk]:
        """An async iterator of chunks for one request, in arrival order."""

    async def scrape(self, session: Any) -> dict[str, float]:
        """The engine's own metrics now (name -> value); empty when the engine has none."""
        return {}

    async def start_profile(self, session: Any) -> None:
        """Start the engine's own torch profiler (``serve.profile``; only where ``Supports.engine_profile``)."""
        raise NotImplementedError(f"{type(self).__name__} gives no profile of its own")

    async def stop_profile(self, session: Any) -> list[Path]:
        """Stop it and return the trace files it wrote (Kineto JSON, gzipped or not) of the engine's model worker."""
        raise NotImplementedError(f"{type(self).__name__} gives no profile of its own")

    def alive(self) -> bool:
        """False once a started engine has exited (its in-flight and remaining requests then fail fast)."""
        return True

    def exit_code(self) -> int | None:
        """A started engine's exit status once it has exited, as ``subprocess`` gives it (negative: killed by that
        signal), for the failure record; None while it runs, when attached, or when not known."""
        return None

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the engine and leave no process behind (a no-op when attached)."""

    def engine_version(self) -> str:
        return ""

    def engine_weights(self) -> str | None:
        """The weights the engine runs, in words for a row's label (the header's ``engine_weights``): their
        precision and quantization type, and where they came from where an adapter knows better than the workload
        (llama.cpp: the GGUF type it serves). Called once the engine is ready; None when attached."""
        if self.ctx.workload.serve.url:
            return None
        w = self.ctx.workload
        q = w.serve.engine.quantization
        source = Path(w.model.path).name if w.model.path and Path(w.model.path).suffix.lower() == ".gguf" else None
        return (w.precision + (f", quantization {q}" if q != "none" else "")
                + (f", from the fp32 folder of {source}" if source else ""))

    def metrics_source(self) -> str:
        """Label for scraped metrics, e.g. 'vllm' or 'tgi'."""
        return self.ctx.adapter
