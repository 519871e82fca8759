"""llmadapt-colossalai: runs llmadapt training and fine-tuning workloads on ColossalAI's Booster."""

__version__ = "0.1.0"
