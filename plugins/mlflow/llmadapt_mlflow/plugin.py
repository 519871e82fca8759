"""The hook: a sink for each run while ``MLFLOW_TRACKING_URI`` names a tracking server (or store)."""

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
