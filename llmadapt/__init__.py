"""llmadapt: run one LLM workload on several stacks and get traces you can compare line by line.

Importing this package is cheap (no torch); frameworks load only inside workers.

This module is the facade for users (it also re-exports the adapter author's main names, whose home is
``llmadapt.adapter``: an adapter imports from there); nothing inside the package imports it.
docs/architecture.md shows the layers behind it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmadapt import compat

compat.install()  # the module paths of before 0.2 (llmadapt.sse, ...), which warn with their new ones

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and readers
    from llmadapt.adapter import (
        ROLES,
        AdapterInfo,
        Chunk,
        EnvironmentSpec,
        FineTuner,
        MicroBatch,
        PlannedRequest,
        RequestFailed,
        Sample,
        ServeContext,
        Server,
        StepBatch,
        StepResult,
        Supports,
        Trainer,
        WorkerContext,
        WrongServer,
        engine_popen_options,
        hookimpl,
    )
    from llmadapt.contract.records import SCHEMA_VERSION, Comm, Failure, Header, Metric, Patch, Phase, Span, Step, Summary
    from llmadapt.contract.schema import json_schema
    from llmadapt.errors import (
        ContractError,
        EnvironmentNotReadyError,
        LlmadaptError,
        TraceMismatchError,
        UnknownAdapterError,
        UnsupportedError,
        WorkloadError,
    )
    from llmadapt.host import VERSION as __version__  # noqa: F401 - the package's version attribute
    from llmadapt.spec import MODEL_PRESETS, Workload

__all__ = [
    # the adapter author's API (llmadapt.adapter)
    "ROLES", "Chunk", "MicroBatch", "PlannedRequest", "RequestFailed", "Sample", "ServeContext", "StepBatch",
    "WorkerContext", "WrongServer", "engine_popen_options",
    # the user's API
    "SCHEMA_VERSION", "AdapterInfo", "Comm", "Comparison", "ContractError", "EnvironmentNotReadyError", "EnvironmentSpec",
    "Failure", "FineTuner", "Header", "LlmadaptError", "MODEL_PRESETS", "Metric", "ParityReport", "Patch", "Phase",
    "RunResult", "ScalingPoint", "Server", "Span", "Step", "StepResult", "Summary", "Supports", "TraceMismatchError",
    "Trainer", "UnknownAdapterError", "UnsupportedError", "Verdict", "Workload", "WorkloadError", "adapters", "compare",
    "hookimpl",
    "json_schema", "parity", "run", "show",
]


# Each public name and the module it lives in, imported on first use (PEP 562): `import llmadapt`, and the
# command line, which imports the package before any of its modules, stay light.
_HOME = {
    **dict.fromkeys(["ROLES", "AdapterInfo", "Chunk", "EnvironmentSpec", "FineTuner", "MicroBatch", "PlannedRequest",
                     "RequestFailed", "Sample", "ServeContext", "Server", "StepBatch", "StepResult", "Supports",
                     "Trainer", "WorkerContext", "WrongServer", "engine_popen_options", "hookimpl"],
                    "llmadapt.adapter"),
    **dict.fromkeys(["SCHEMA_VERSION", "Comm", "Failure", "Header", "Metric", "Patch", "Phase", "Span", "Step",
                     "Summary"], "llmadapt.contract.records"),
    "json_schema": "llmadapt.contract.schema",
    **dict.fromkeys(["ContractError", "EnvironmentNotReadyError", "LlmadaptError", "TraceMismatchError",
                     "UnknownAdapterError", "UnsupportedError", "WorkloadError"], "llmadapt.errors"),
    **dict.fromkeys(["MODEL_PRESETS", "Workload"], "llmadapt.spec"),
    # the orchestrator API
    **dict.fromkeys(["run", "RunResult"], "llmadapt.launch"),
    **dict.fromkeys(["compare", "parity"], "llmadapt.experiments"),
    **dict.fromkeys(["show", "Comparison", "ParityReport", "ScalingPoint", "Verdict"], "llmadapt.analysis"),
    "adapters": "llmadapt.adapter.plugins",
}
_ORCHESTRATOR = {"llmadapt.launch", "llmadapt.experiments", "llmadapt.analysis", "llmadapt.adapter.plugins"}


def __getattr__(name: str):
    if name == "__version__":
        from llmadapt.host import VERSION

        value = VERSION
    elif name in _HOME:
        import importlib

        value = getattr(importlib.import_module(_HOME[name]), name)
    else:  # a submodule, as `import llmadapt; llmadapt.spec.X` reached it when the package imported them eagerly
        import importlib
        import importlib.util

        if importlib.util.find_spec(f"llmadapt.{name}") is None:
            raise AttributeError(f"module 'llmadapt' has no attribute {name!r}")
        return importlib.import_module(f"llmadapt.{name}")
    if _HOME.get(name) not in _ORCHESTRATOR:  # bound once, as an import would; the orchestrator's looked up each time
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
