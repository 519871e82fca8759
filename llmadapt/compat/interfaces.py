"""Old path of ``llmadapt.adapter`` (before 0.2), kept for one release for adapters written against it.

New code imports from ``llmadapt.adapter``; nothing inside llmadapt imports this module."""

from llmadapt.adapter import ROLES, AdapterInfo, EnvironmentSpec, FineTuner, Server, StepResult, Supports, Trainer
from llmadapt.compat import moved

moved("llmadapt.interfaces", "llmadapt.adapter", __name__)

__all__ = ['ROLES', 'EnvironmentSpec', 'Supports', 'AdapterInfo', 'StepResult', 'Trainer', 'FineTuner', 'Server']
