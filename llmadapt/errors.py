"""Exceptions, and the exit codes every command ends with. Every `LlmadaptError` is meant to be displayed to the
user as one line."""

from __future__ import annotations

import enum
import errno
from pathlib import Path


class ExitCode(enum.IntEnum):
    """What a command's exit status means (docs/runs.md, "Exit codes"): one table for every command."""

    OK = 0
    RUN_FAILED = 1
    """A run failed, diverged, or a serving run's failures were over its threshold; a regression was found."""
    BAD_INPUT = 2
    """The command line, a workload or a file named on it is wrong: nothing was run (LlmadaptError by default)."""
    ENVIRONMENT = 3
    """An adapter's environment is not built or is damaged (EnvironmentNotReadyError)."""
    IO = 4
    """Reading or writing failed for a reason other than the input: disk full, permission denied, read-only."""
    INTERRUPTED = 130
    """Ctrl-C (128 + SIGINT)."""
    CLOSED_PIPE = 141
    """stdout's reader went away (`llmadapt runs --json | head -1`): the command ends quietly, as one killed by
    SIGPIPE would (128 + SIGPIPE)."""
    TERMINATED = 143
    """SIGTERM (128 + SIGTERM): a scheduler's cancel, `kill`."""


# OSErrors that say something about the machine, not about what was asked: exit code IO.
IO_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EACCES", "EPERM", "EROFS", "EIO",
                                                        "EFBIG", "ENOMEM", "EMFILE", "ENFILE", "ETXTBSY")
                      if hasattr(errno, name))
# OSErrors that say a path given was wrong: exit code BAD_INPUT.
INPUT_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOENT", "ENOTDIR", "EISDIR", "ENAMETOOLONG", "EEXIST",
                                                           "ELOOP", "EINVAL") if hasattr(errno, name))


def exit_code_of(exc: BaseException) -> int:
    """The exit code a command ends with when ``exc`` ends it (``ExitCode``). An error's own ``exit_code`` wins;
    an OSError is an I/O error unless it says a path given was wrong; an LlmadaptError raised from (or while
    handling) an OSError of the machine's, a full disk, is an I/O error too."""
    if isinstance(exc, KeyboardInterrupt):
        return int(getattr(exc, "exit_code", ExitCode.INTERRUPTED))
    own = getattr(exc, "exit_code", None)
    if isinstance(own, int):
        return int(own)
    if isinstance(exc, OSError):
        return ExitCode.BAD_INPUT if exc.errno in INPUT_ERRNOS else ExitCode.IO
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, OSError) and cause.errno in IO_ERRNOS:
        return ExitCode.IO
    return ExitCode.BAD_INPUT


def os_error_line(exc: OSError) -> str:
    """One line for an OSError, naming the path it is about: 'PATH: No space left on device'."""
    paths = [str(p) for p in (exc.filename, exc.filename2) if p is not None]
    what = exc.strerror or str(exc)
    return f"{' -> '.join(paths)}: {what}" if paths else what


def not_a_file(path: str | Path) -> str:
    """Why a path that was to be a file cannot be read as one: 'is a folder, expected a file' or 'no such file'."""
    return "is a folder, expected a file" if Path(path).is_dir() else "no such file"


class LlmadaptError(Exception):
    """Base class: the CLI prints ``str(error)`` and exits non-zero, without a traceback."""


class WorkloadError(LlmadaptError, ValueError):
    """A workload is malformed or contradictory. The message names the field, value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"workload field {field!r}: got {excerpt(value)}; {allowed}")


def did_you_mean(name: object, choices) -> str:
    """" (did you mean 'torch'?)" for a name close to one of ``choices`` (difflib), else "": a typo's one-line
    error names the likely intent before the list of valid names."""
    import difflib

    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, [str(c) for c in choices], n=1, cutoff=0.8)
    return f" (did you mean {close[0]!r}?)" if close else ""


def excerpt(value: object, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error line never echoes megabytes of input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class UnknownAdapterError(LlmadaptError, LookupError):
    """No adapter of that name is registered."""


class UnsupportedError(LlmadaptError):
    """An adapter was asked for something it declares it does not support."""


class EnvironmentNotReadyError(LlmadaptError):
    """The Python environment that runs an adapter has not been built, or is damaged."""

    exit_code = ExitCode.ENVIRONMENT


class StorageError(LlmadaptError):
    """Reading or writing a path failed for a reason of the machine's (disk full, permission denied): one line
    naming the path."""

    exit_code = ExitCode.IO


class ContractError(LlmadaptError, ValueError):
    """A record does not match the metrics contract."""


class TraceMismatchError(LlmadaptError):
    """Traces of different workloads were compared without being told to."""


class Terminated(KeyboardInterrupt):
    """SIGTERM to the orchestrator (a scheduler's cancel): handled like Ctrl-C, with the signal named."""

    exit_code = ExitCode.TERMINATED
