"""What an adapter author sees: everything an adapter imports from llmadapt comes from here.

Importable without torch (the orchestrator imports adapters' declarations): frameworks load only in the
classes an adapter names in ``AdapterInfo.roles``, inside its own environment. Each name is imported on first
use, so registering a plugin (``from llmadapt.adapter import AdapterInfo, hookimpl``) loads the declaration and
the hook alone, not the records, the workload or the plugin manager: `llmadapt adapters` stays quick.

- declaration: ``AdapterInfo``, ``EnvironmentSpec``, ``Supports``, ``ROLES``, and ``TOOLS_ENVIRONMENT``, the
  core's tools environment (torch, transformers) that an adapter on plain torch may share
- interfaces: ``Trainer``, ``FineTuner``, ``Server``, ``StepResult``; ``Generated`` (an offline engine's output)
- context: ``WorkerContext``, ``StepBatch`` (``MicroBatch``, ``Sample``), ``ServeContext``, ``PlannedRequest``,
  ``Chunk``, ``RequestFailed``, ``WrongServer``
- records a step or a run reports: ``Phase``, ``Span``, ``Patch``, ``Comm``, ``Metric``; ``bandwidths`` of a
  collective
- engines an adapter starts: ``engine_popen_options``, ``stop_engine``, ``group_members``,
  ``installed_versions``, ``RunDir`` (the run folder: ``engine_log``, ``engine_pid``), ``state_dir`` (caches),
  ``VERSION`` (llmadapt's release)
- weights: ``CheckpointWeights``, ``save_hf_model``, ``write_safetensors``, the canonical checkpoint's
  ``checkpoint_key`` and ``recorded_weights_hash``; the module ``llmadapt.adapter.weights`` also has the
  checkpoint folder's file helpers
- serving: ``OpenAICompatibleServer`` (the module ``llmadapt.adapter.sse`` has its SSE helpers)
- MoE: ``ExpertLoadCounter`` (the module ``llmadapt.adapter.moe`` has the near-tie and all-reduce helpers)
- quantization: the module ``llmadapt.adapter.quantization`` loads a transformers model for QLoRA as every stack
  does (``bnb_config``, ``quantize_fused_experts``) and says what it holds per module class, refusing a quantization
  that leaves a part unquantized (``quantized_model_classes``, for ``Trainer.weights``)
- tracking sinks: the module ``llmadapt.adapter.tracking`` names the metrics of a record and a summary
- kernels: the module ``llmadapt.adapter.kernels``'s ``slow_paths(model)``, lines for ``Trainer.notes`` naming the
  layers that run transformers' PyTorch reference where a fused kernel's package is missing (Jamba's Mamba mixer)
- hookspecs: ``hookimpl`` and the hooks ``llmadapt_register_adapters``, ``llmadapt_record_sink`` and
  ``llmadapt_experiment_sink``
- plugins: how adapters are found (``adapters()``, ``get_adapter``, ``check_supported``)
- errors: ``LlmadaptError`` (an adapter's one-line failure) and its kinds
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and readers
    from llmadapt.adapter.context import (
        IGNORE,
        Chunk,
        MicroBatch,
        PlannedRequest,
        RequestFailed,
        Sample,
        ServeContext,
        StepBatch,
        WorkerContext,
        WrongServer,
        engine_popen_options,
        group_members,
        installed_versions,
        stop_engine,
    )
    from llmadapt.adapter.declaration import ROLES, TOOLS_ENVIRONMENT, AdapterInfo, EnvironmentSpec, Supports
    from llmadapt.adapter.hookspecs import hookimpl
    from llmadapt.adapter.interfaces import FineTuner, Generated, Server, StepResult, Trainer
    from llmadapt.adapter.moe import ExpertLoadCounter
    from llmadapt.adapter.plugins import adapters, check_supported, get_adapter
    from llmadapt.adapter.sse import OpenAICompatibleServer
    from llmadapt.adapter.weights import CheckpointWeights, save_hf_model, write_safetensors
    from llmadapt.contract.records import Comm, Metric, Patch, Phase, Span, bandwidths
    from llmadapt.contract.rundir import RunDir
    from llmadapt.errors import (
        ContractError,
        EnvironmentNotReadyError,
        LlmadaptError,
        TraceMismatchError,
        UnknownAdapterError,
        UnsupportedError,
        WorkloadError,
    )
    from llmadapt.host import VERSION, state_dir
    from llmadapt.models import recorded_weights_hash
    from llmadapt.spec.model import checkpoint_key

# Each public name and the module it lives in.
_HOME = {
    **dict.fromkeys(["IGNORE", "Chunk", "MicroBatch", "PlannedRequest", "RequestFailed", "Sample", "ServeContext",
                     "StepBatch", "WorkerContext", "WrongServer", "engine_popen_options", "group_members",
                     "installed_versions", "stop_engine"], "llmadapt.adapter.context"),
    **dict.fromkeys(["ROLES", "TOOLS_ENVIRONMENT", "AdapterInfo", "EnvironmentSpec", "Supports"],
                    "llmadapt.adapter.declaration"),
    "hookimpl": "llmadapt.adapter.hookspecs",
    **dict.fromkeys(["FineTuner", "Generated", "Server", "StepResult", "Trainer"], "llmadapt.adapter.interfaces"),
    "ExpertLoadCounter": "llmadapt.adapter.moe",
    **dict.fromkeys(["adapters", "check_supported", "get_adapter"], "llmadapt.adapter.plugins"),
    "OpenAICompatibleServer": "llmadapt.adapter.sse",
    **dict.fromkeys(["CheckpointWeights", "save_hf_model", "write_safetensors"], "llmadapt.adapter.weights"),
    **dict.fromkeys(["Comm", "Metric", "Patch", "Phase", "Span", "bandwidths"], "llmadapt.contract.records"),
    "RunDir": "llmadapt.contract.rundir",
    **dict.fromkeys(["ContractError", "EnvironmentNotReadyError", "LlmadaptError", "TraceMismatchError",
                     "UnknownAdapterError", "UnsupportedError", "WorkloadError"], "llmadapt.errors"),
    **dict.fromkeys(["VERSION", "state_dir"], "llmadapt.host"),
    "recorded_weights_hash": "llmadapt.models",
    "checkpoint_key": "llmadapt.spec.model",
}


def __getattr__(name: str):
    import importlib

    if name == "__all__":
        # Who asks for every name (pdoc's `make reference`, `import *`) gets each bound, as an eager import would.
        for each in _HOME:
            __getattr__(each)
        value = sorted(_HOME)
    elif name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:  # a submodule (llmadapt.adapter.sse), as attribute access reached it when this package imported them
        import importlib.util

        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    globals()[name] = value  # bound once, as an import would
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
