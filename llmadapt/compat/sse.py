"""Old path of ``llmadapt.adapter.sse`` (before 0.2), kept for one release for adapters written against it.

New code imports from ``llmadapt.adapter.sse``; nothing inside llmadapt imports this module."""

from llmadapt.adapter.sse import (
    OpenAICompatibleServer,
    excerpt,
    field,
    http_failure,
    json_event,
    malformed,
    parse_prometheus,
    sse_events,
)
from llmadapt.compat import moved

moved("llmadapt.sse", "llmadapt.adapter.sse", __name__)

__all__ = ['OpenAICompatibleServer', 'sse_events', 'excerpt', 'malformed', 'json_event', 'field', 'http_failure', 'parse_prometheus']
