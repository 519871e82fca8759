"""Old path of ``llmadapt.adapter.plugins`` (before 0.2), kept for one release for adapters written against it.

New code imports from ``llmadapt.adapter.plugins``; nothing inside llmadapt imports this module."""

from llmadapt.adapter.plugins import GROUP, adapters, check_supported, collect_adapters, get_adapter, plugin_manager
from llmadapt.compat import moved

moved("llmadapt.plugins", "llmadapt.adapter.plugins", __name__)

__all__ = ['adapters', 'get_adapter', 'check_supported', 'plugin_manager', 'collect_adapters', 'GROUP']
