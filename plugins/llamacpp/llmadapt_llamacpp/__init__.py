"""llmadapt-llamacpp: the llama.cpp serving adapter (llama-cpp-python's OpenAI-compatible server on a GGUF file
written from the canonical checkpoint)."""

__version__ = "0.1.0"
