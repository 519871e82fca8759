"""Old path of ``llmadapt.adapter.context`` (before 0.2), kept for one release for adapters written against it.

New code imports from ``llmadapt.adapter.context``; nothing inside llmadapt imports this module."""

from llmadapt.adapter.context import IGNORE, MicroBatch, Sample, StepBatch
from llmadapt.compat import moved
from llmadapt.runtime.data import TokenData

moved("llmadapt.data", "llmadapt.adapter (TokenData: llmadapt.runtime.data)", __name__)

__all__ = ['IGNORE', 'Sample', 'MicroBatch', 'StepBatch', 'TokenData']
