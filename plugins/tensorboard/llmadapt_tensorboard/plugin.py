"""The hooks: a sink for each run, and a folder for each comparison, while ``LLMADAPT_TENSORBOARD_DIR`` names one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmadapt.adapter import hookimpl


@hookimpl
def llmadapt_record_sink(run: dict[str, Any]):
    folder = os.environ.get("LLMADAPT_TENSORBOARD_DIR")
    if not folder:
        return None
    from llmadapt_tensorboard.sink import TensorBoardSink

    return TensorBoardSink(Path(folder), run)


@hookimpl
def llmadapt_experiment_sink(experiment: dict[str, Any]):
    folder = os.environ.get("LLMADAPT_TENSORBOARD_DIR")
    if not folder or experiment.get("kind") != "compare":
        return None
    from llmadapt_tensorboard.sink import ComparisonFolder

    return ComparisonFolder(Path(folder), str(experiment.get("name") or "comparison"))
