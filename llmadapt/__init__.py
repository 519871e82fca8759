"""llmadapt: run one LLM workload on several stacks and get traces you can compare line by line.

Importing this package is cheap (no torch); frameworks load only inside workers.

This module is the facade: users and adapter authors import from here (or from ``llmadapt.adapter``);
nothing inside the package imports it. docs/architecture.md shows the layers behind it.
"""

from __future__ import annotations

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
    "RunResult", "Server", "Span", "Step", "StepResult", "Summary", "Supports", "TraceMismatchError", "Trainer",
    "UnknownAdapterError", "UnsupportedError", "Workload", "WorkloadError", "adapters", "compare", "hookimpl",
    "json_schema", "parity", "run", "show",
]


def __getattr__(name: str):
    # The orchestrator API loads on first use, keeping `import llmadapt` (and plugin modules) light.
    if name in ("run", "RunResult"):
        from llmadapt import launch

        return getattr(launch, name)
    if name in ("compare", "parity", "show", "Comparison", "ParityReport"):
        from llmadapt import analysis

        return getattr(analysis, name)
    if name == "adapters":
        from llmadapt.adapter.plugins import adapters

        return adapters
    raise AttributeError(f"module 'llmadapt' has no attribute {name!r}")
