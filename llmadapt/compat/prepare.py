"""Old path of ``llmadapt.launch.prepare`` (before 0.2), kept for one release for adapters written against it.

New code imports from ``llmadapt.launch.prepare``; nothing inside llmadapt imports this module."""

from llmadapt.compat import moved
from llmadapt.launch.prepare import checkpoint_dir, ensure_checkpoint

moved("llmadapt.prepare", "llmadapt.launch.prepare", __name__)

__all__ = ['ensure_checkpoint', 'checkpoint_dir']
