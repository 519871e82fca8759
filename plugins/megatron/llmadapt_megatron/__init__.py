"""llmadapt-megatron: the Megatron-core adapter (GPTModel, TP/PP/DP/EP, distributed optimizer, MoE)."""

__version__ = "0.1.0"
