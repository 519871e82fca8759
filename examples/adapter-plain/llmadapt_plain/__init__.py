"""llmadapt-plain: a worked-example llmadapt adapter with a hand-written PyTorch training loop."""

__version__ = "0.1.0"
