"""llmadapt: run one LLM workload on several stacks and get traces you can compare line by line.

Importing this package is cheap (no torch); frameworks load only inside workers.
"""

from __future__ import annotations

__version__ = "0.1.0"

from llmadapt.contract import (
    SCHEMA_VERSION,
    Comm,
    Failure,
    Header,
    Metric,
    Patch,
    Phase,
    Span,
    Step,
    Summary,
    json_schema,
)
from llmadapt.errors import (
    ContractError,
    EnvironmentNotReadyError,
    LlmadaptError,
    TraceMismatchError,
    UnknownAdapterError,
    UnsupportedError,
    WorkloadError,
)
from llmadapt.hookspecs import hookimpl
from llmadapt.interfaces import AdapterInfo, EnvironmentSpec, FineTuner, Server, StepResult, Supports, Trainer
from llmadapt.spec import MODEL_PRESETS, Workload

__all__ = [
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
        from llmadapt.plugins import adapters

        return adapters
    raise AttributeError(f"module 'llmadapt' has no attribute {name!r}")
