"""The metrics contract: every record a run writes, their JSON Schema, and the JSONL files that hold them.

The bottom layer with ``llmadapt.spec`` and ``llmadapt.errors``: it imports nothing else of llmadapt.
"""

from __future__ import annotations

from llmadapt.contract.jsonl import JsonlWriter, read_jsonl
from llmadapt.contract.launch import LaunchRequest
from llmadapt.contract.perf import (
    Estimate,
    Fit,
    FitPoint,
    MaxBatch,
    MemoryEstimate,
    OpBench,
    Probe,
    Validation,
    ValidationRow,
)
from llmadapt.contract.records import (
    SCHEMA_VERSION,
    ClientLoad,
    Comm,
    Device,
    End,
    Failure,
    Header,
    Memory,
    Metric,
    Patch,
    Phase,
    Request,
    ServerSample,
    ServingStats,
    Span,
    Stats,
    Step,
    Summary,
    bandwidths,
    bus_factor,
)
from llmadapt.contract.schema import json_schema, to_json, upgrade, validate

__all__ = ['ClientLoad', 'Comm', 'Device', 'End', 'Estimate', 'Failure', 'Fit', 'FitPoint', 'Header', 'JsonlWriter', 'LaunchRequest', 'MaxBatch', 'Memory', 'MemoryEstimate', 'Metric', 'OpBench', 'Patch', 'Phase', 'Probe', 'Request', 'SCHEMA_VERSION', 'ServerSample', 'ServingStats', 'Span', 'Stats', 'Step', 'Summary', 'Validation', 'ValidationRow', 'bandwidths', 'bus_factor', 'json_schema', 'read_jsonl', 'to_json', 'upgrade', 'validate']
