"""Exceptions. Every `LlmadaptError` is meant to be displayed to the user as one line."""

from __future__ import annotations


class LlmadaptError(Exception):
    """Base class: the CLI prints ``str(error)`` and exits non-zero, without a traceback."""


class WorkloadError(LlmadaptError, ValueError):
    """A workload is malformed or contradictory. The message names the field, value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"workload field {field!r}: got {excerpt(value)}; {allowed}")


def excerpt(value: object, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error line never echoes megabytes of input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class UnknownAdapterError(LlmadaptError, LookupError):
    """No adapter of that name is registered."""


class UnsupportedError(LlmadaptError):
    """An adapter was asked for something it declares it does not support."""


class EnvironmentNotReadyError(LlmadaptError):
    """The Python environment that runs an adapter has not been built."""


class ContractError(LlmadaptError, ValueError):
    """A record does not match the metrics contract."""


class TraceMismatchError(LlmadaptError):
    """Traces of different workloads were compared without being told to."""


class Terminated(KeyboardInterrupt):
    """SIGTERM to the orchestrator (a scheduler's cancel): handled like Ctrl-C, with the signal named."""

    exit_code = 143
