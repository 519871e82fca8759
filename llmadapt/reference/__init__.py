"""The reference adapter ``torch``: plain PyTorch + transformers, the embedded default."""
