"""An llmadapt record sink that makes each run an MLflow run, active when ``MLFLOW_TRACKING_URI`` is set.

``parent_run`` groups the runs made inside it (a comparison's cells, a sweep) under one parent MLflow run.
"""

from llmadapt_mlflow.sink import MlflowSink, flat_params, parent_run

__all__ = ["MlflowSink", "flat_params", "parent_run"]
