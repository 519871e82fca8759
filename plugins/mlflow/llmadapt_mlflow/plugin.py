"""The hooks: a sink for each run, and a parent run for each comparison, while ``MLFLOW_TRACKING_URI`` names a
tracking server (or store)."""

from __future__ import annotations

import os
from typing import Any

from llmadapt.adapter import hookimpl


@hookimpl
def llmadapt_record_sink(run: dict[str, Any]):
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    from llmadapt_mlflow.sink import MlflowSink

    return MlflowSink(uri, run)


@hookimpl
def llmadapt_experiment_sink(experiment: dict[str, Any]):
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or experiment.get("kind") != "compare":
        return None
    from llmadapt_mlflow.sink import PARENT_RUN_VAR, ComparisonRun, current_parent

    if current_parent.get() is not None or os.environ.get(PARENT_RUN_VAR):
        return None  # inside a parent the user made: the runs go there
    return ComparisonRun(uri, str(experiment.get("name") or "comparison"), {"llmadapt.kind": "compare"})
