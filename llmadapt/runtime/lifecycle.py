"""How every worker process the launcher starts begins and ends (training runs and micro-benchmarks alike).

Three rules, each here once:

- Stop on request: SIGTERM (the launcher stopping a rank) raises ``Stopped`` in the main thread, once, so
  the loop unwinds and writes why it stopped; ``write_failure`` keeps that record whole when the signal
  lands while it is being written.
- Never outlive the orchestrator: the launcher names itself in ``LLMADAPT_ORCHESTRATOR`` (``node:pid``);
  a thread waits on that process and stops this one when it is gone (the orchestrator was SIGKILLed, or
  its machine's job was cancelled), instead of training on, orphaned.
- End without racing gloo: ``end_distributed`` synchronises every rank, then destroys the group, and
  ``exit_process`` ends the process with ``os._exit`` once every record is flushed. Why: a rank that
  destroys its group while a peer still uses it, or an interpreter that runs its finalisers while the
  group's threads are alive, aborts with "terminate called without an active exception" (a joinable
  std::thread destroyed at exit). That was 3 of 20 dp=2 runs failing after their last step. After the
  barrier no rank sends again, and ``os._exit`` skips the C++ static destructors and atexit hooks that
  race the threads; nothing is left to run by then (records are closed, stdout/stderr flushed).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

ORCHESTRATOR_VAR = "LLMADAPT_ORCHESTRATOR"


RUN_TOKEN_VAR = "LLMADAPT_RUN_TOKEN"
"""Set in the environment of everything a launch starts, so the launcher can find all of it afterwards."""


ORPHAN_GRACE_S = 10.0
"""After its orchestrator is gone, how long a rank may take to write why it stopped before it is ended."""


class Stopped(BaseException):
    """Raised in the main thread when this process is asked to stop; the message says by whom."""


_stop: dict[str, str] = {}
"""``reason``: why the orchestrator watch stops this process; ``message``: the stop signal handled."""


def install_stop_handler() -> object:
    """SIGTERM -> ``Stopped``, once. Returns the previous handler (for ``signal.signal`` to restore).

    Once: a rank being stopped often gets a second SIGTERM (torchrun stopping the others after the first
    rank left), and one raised while the first one's failure record is being written would cut it short.
    """

    def on_term(signum, frame):
        if "message" in _stop:
            return  # already unwinding
        reason = _stop.get("reason", "the launcher stopped this rank: another rank failed, a timeout, or an interrupt")
        _stop["message"] = f"stopped by signal {signal.Signals(signum).name} ({reason})"
        raise Stopped(_stop["message"])

    return signal.signal(signal.SIGTERM, on_term)


def stop_message() -> str | None:
    """Why this process is being stopped, once it is (a stop signal handled, or its orchestrator gone)."""
    if "message" in _stop:
        return _stop["message"]
    return f"stopping ({_stop['reason']})" if "reason" in _stop else None


def failure_cause(exc: BaseException, describe) -> tuple[str, int, str]:
    """(cause, exit code, message) of the exception a worker ends with; ``describe(exc)`` words an error."""
    stop = stop_message()
    if isinstance(exc, Stopped):
        return "killed", 143, str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 130, str(exc)
    if stop:  # a peer was stopped first and this rank's collective failed for it: the stop is the cause
        return "killed", 143, f"{stop}; then {describe(exc)}"
    return ("oom" if is_oom(exc) else "error"), 1, describe(exc)


def short_trace(exc: BaseException) -> str:
    """'Type: message (at file.py:line)': an error in one line, where it was raised."""
    import traceback
    from pathlib import Path

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text.lower() or "can't allocate memory" in text


def write_failure(exc: BaseException, write):
    """``return write(exc)``: the failure record, even if the stop signal lands while it is being written.

    The usual case: a peer was stopped, so this rank's collective fails, and the SIGTERM that was pending
    during that C++ call is handled in the middle of the except block. The record is then written for the
    stop, which says who stopped the run. The handler raises only once, so this ends.
    """
    while True:
        try:
            return write(exc)
        except Stopped as stop:
            exc = stop


def orchestrator_env(node: str) -> dict[str, str]:
    """What the launcher puts in its workers' environment so that they can watch it."""
    return {ORCHESTRATOR_VAR: f"{node}:{os.getpid()}"}


def watch_orchestrator(node: str) -> None:
    """Stop this process when the orchestrator that started it is gone (only if it runs on this node)."""
    where, _, pid = os.environ.get(ORCHESTRATOR_VAR, "").rpartition(":")
    if not pid.isdigit() or where != node:
        return  # started by hand, or from another machine (Slurm): nothing here to watch
    pid_ = int(pid)
    try:
        fd = os.pidfd_open(pid_)  # a handle on that very process: immune to pid reuse
    except ProcessLookupError:
        _orphaned(pid_)
        return
    except (AttributeError, OSError):
        fd = None  # no pidfd (old kernel): poll the pid

    def wait() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while _alive(pid_):
                time.sleep(1.0)
        _orphaned(pid_)

    threading.Thread(target=wait, name="llmadapt-orchestrator-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _orphaned(pid: int) -> None:
    _stop.setdefault("reason", f"its orchestrator, pid {pid}, is gone")
    os.kill(os.getpid(), signal.SIGTERM)
    # The main thread may be blocked in a collective whose peer is gone too: end it after a grace period.
    time.sleep(ORPHAN_GRACE_S)
    exit_process(143)


def end_distributed(completed: bool) -> str | None:
    """Leave the process group; returns what went wrong, if anything (a teardown problem, not a failed run).

    ``completed``: this rank finished. Then it waits for every rank before destroying the group (see the
    module's docstring). A rank that failed does not wait: its peers are being stopped by the launcher.
    """
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        if completed:
            dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported, never raised: every record is already written
        return f"{type(exc).__name__}: {exc}"
    return None


def exit_process(code: int) -> None:
    """End this process now: flush what Python buffers, skip finalisers (see the module's docstring)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream cannot hold anything to flush
            pass
    os._exit(code)
