"""Old path of ``llmadapt.adapter.moe`` (before 0.2), kept for one release for adapters written against it.

New code imports from ``llmadapt.adapter.moe``; nothing inside llmadapt imports this module."""

from llmadapt.adapter.moe import NEAR_TIE_RTOL, ExpertLoadCounter, all_reduce_counts, near_tie_count
from llmadapt.compat import moved

moved("llmadapt.moe", "llmadapt.adapter.moe", __name__)

__all__ = ['ExpertLoadCounter', 'all_reduce_counts', 'near_tie_count', 'NEAR_TIE_RTOL']
