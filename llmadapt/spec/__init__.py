"""The workload specification: what to run, independent of which stack runs it.

A `Workload` is immutable and builds offline with no side effects. Load one from TOML, YAML
or JSON with `Workload.from_file`, from a dict with `Workload.from_dict`, or build it in
Python; `Workload.with_overrides(["train.steps=5"])` applies ``--set`` style changes.
Every validation error names the field path, the value and what is allowed.

Import from here; the modules hold one concern each: ``model``, ``data``, ``training`` (train, LoRA,
evaluation, saving, profiling, telemetry), ``serving``, ``parallelism`` (and the optimizations),
``workload`` (the sections together, their settings and hashes), ``validation`` (rules across fields),
``loading`` (files and dicts to classes) and ``fields`` (single-field checks).
"""

from llmadapt.spec.data import DATA_SOURCES, DataSpec
from llmadapt.spec.loading import load_yaml, read_document
from llmadapt.spec.model import CHECKPOINT_RECIPE, FAMILIES, MODEL_PRESETS, ModelSpec
from llmadapt.spec.parallelism import OFFLOADS, QUANTIZATIONS, RECOMPUTES, Optimizations, Parallelism
from llmadapt.spec.serving import (
    APIS,
    ARRIVALS,
    LENGTH_DISTS,
    SOURCE_KINDS,
    ArrivalSpec,
    EngineSpec,
    LengthSpec,
    ServeSpec,
    SloSpec,
    QualitySpec,
    SourceSpec,
)
from llmadapt.spec.training import (
    EVAL_MATCHES,
    LORA_TARGETS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PROFILE_LEVELS,
    EvalSpec,
    LoraSpec,
    ProfileSpec,
    SaveSpec,
    TelemetrySpec,
    TrainSpec,
)
from llmadapt.spec.workload import KINDS, PRECISIONS, Workload, problem_difference, varied_fields

__all__ = [
    "Workload", "problem_difference", "varied_fields", "read_document", "load_yaml",
    "ModelSpec", "MODEL_PRESETS", "CHECKPOINT_RECIPE", "FAMILIES",
    "DataSpec", "DATA_SOURCES",
    "TrainSpec", "LoraSpec", "EvalSpec", "SaveSpec", "ProfileSpec", "TelemetrySpec",
    "OPTIMIZERS", "OPTIMIZER_IMPLS", "EVAL_MATCHES", "PROFILE_LEVELS", "LORA_TARGETS",
    "Parallelism", "Optimizations", "OFFLOADS", "RECOMPUTES", "QUANTIZATIONS",
    "ServeSpec", "LengthSpec", "ArrivalSpec", "SourceSpec", "SloSpec", "EngineSpec", "QualitySpec",
    "ARRIVALS", "SOURCE_KINDS", "LENGTH_DISTS", "APIS",
    "KINDS", "PRECISIONS",
]
