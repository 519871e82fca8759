"""Attach llmadapt's load generator to a running text-generation-inference (TGI) 3.3.x server.

Two adapters: ``tgi`` speaks TGI's native protocol (POST /generate_stream, one SSE event per
token); ``tgi-openai`` speaks its OpenAI-style /v1/completions and /v1/chat/completions routes.
"""

__version__ = "0.1.0"
TARGET_TGI = "3.3.x"
