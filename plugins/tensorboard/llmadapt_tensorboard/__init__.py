"""An llmadapt record sink that writes each run as a TensorBoard run, active when ``LLMADAPT_TENSORBOARD_DIR`` is set.

The names load on first use: the entry point (``llmadapt_tensorboard.plugin``) imports this package on every
command, `llmadapt adapters` included, and the sink is needed only for a run.
"""

__all__ = ["ComparisonFolder", "TensorBoardSink"]


def __getattr__(name: str):
    if name in __all__:
        from llmadapt_tensorboard import sink

        return getattr(sink, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
