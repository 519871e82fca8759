"""Attach llmadapt's load generator to any OpenAI-compatible server (completions and chat)."""

__version__ = "0.1.0"
