"""Old path of ``llmadapt.adapter.hookspecs`` (before 0.2), kept for one release for adapters written against it.

New code imports from ``llmadapt.adapter.hookspecs``; nothing inside llmadapt imports this module."""

from llmadapt.adapter.hookspecs import hookimpl, hookspec, llmadapt_register_adapters
from llmadapt.compat import moved

moved("llmadapt.hookspecs", "llmadapt.adapter.hookspecs", __name__)

__all__ = ['hookimpl', 'hookspec', 'llmadapt_register_adapters']
