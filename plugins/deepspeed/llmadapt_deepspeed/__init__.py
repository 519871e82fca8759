"""llmadapt-deepspeed: runs llmadapt training and fine-tuning workloads on DeepSpeed."""

__version__ = "0.1.0"
