"""What an adapter author sees: declare an adapter, implement its roles, read what a step is given.

Importable without torch (the orchestrator imports adapters' declarations): frameworks load only in the
classes an adapter names in ``AdapterInfo.roles``, inside its own environment.

- declaration: ``AdapterInfo``, ``EnvironmentSpec``, ``Supports``, ``ROLES``
- interfaces: ``Trainer``, ``FineTuner``, ``Server``, ``StepResult``
- context: ``WorkerContext``, ``StepBatch`` (``MicroBatch``, ``Sample``), ``ServeContext``, ``PlannedRequest``,
  ``Chunk``, ``RequestFailed``, ``WrongServer``; for engines an adapter starts, ``engine_popen_options``,
  ``stop_engine``, ``group_members`` and ``installed_versions``
- hookspecs: ``hookimpl`` and the one hook, ``llmadapt_register_adapters``
- plugins: how adapters are found (``adapters()``, ``get_adapter``, ``check_supported``)
- helpers: ``sse`` (an OpenAI-compatible streaming server client), ``moe`` (expert-load counting)
"""

from __future__ import annotations

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
from llmadapt.adapter.declaration import ROLES, AdapterInfo, EnvironmentSpec, Supports
from llmadapt.adapter.hookspecs import hookimpl
from llmadapt.adapter.interfaces import FineTuner, Server, StepResult, Trainer
from llmadapt.adapter.plugins import adapters, check_supported, get_adapter

__all__ = [
    "IGNORE", "ROLES", "AdapterInfo", "Chunk", "EnvironmentSpec", "FineTuner", "MicroBatch", "PlannedRequest",
    "RequestFailed", "Sample", "ServeContext", "Server", "StepBatch", "StepResult", "Supports", "Trainer",
    "WorkerContext", "WrongServer", "adapters", "check_supported", "engine_popen_options", "get_adapter",
    "group_members", "hookimpl", "installed_versions", "stop_engine",
]
