"""An llmadapt record sink that makes each run an MLflow run, active when ``MLFLOW_TRACKING_URI`` is set.

``parent_run`` groups the runs made inside it (a comparison's cells, a sweep) under one parent MLflow run.
The names load on first use: the entry point (``llmadapt_mlflow.plugin``) imports this package on every
command, `llmadapt adapters` included, and the sink is needed only for a run.
"""

__all__ = ["MlflowSink", "flat_params", "parent_run"]


def __getattr__(name: str):
    if name in __all__:
        from llmadapt_mlflow import sink

        return getattr(sink, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
