"""How every worker process the launcher starts begins and ends: training, micro-benchmark and offline workers alike.

``WorkerProcess`` is the shell each of them runs in (``with WorkerProcess(...) as worker:``), so the rules below
and the records a worker leaves (its ``End``, or one failure record with the exit code it stands for) are kept
in one place. Three rules, each here once:

- Stop on request: SIGTERM (the launcher stopping a rank) raises ``Stopped`` in the main thread, once, so
  the loop unwinds and writes why it stopped; ``write_failure`` keeps that record whole when the signal
  lands while it is being written.
- Never outlive the orchestrator: the launcher names itself in ``LLMADAPT_ORCHESTRATOR`` (``node:pid``);
  a thread waits on that process and stops this one when it is gone (the orchestrator was SIGKILLed, or
  its machine's job was cancelled), instead of training on, orphaned.
- End without racing gloo: the shell's teardown synchronises every rank, then destroys the group
  (``end_distributed``), and ``exit_process`` ends the process with ``os._exit`` once every record is
  flushed. Why: a rank that destroys its group while a peer still uses it, or an interpreter that runs its
  finalisers while the group's threads are alive, aborts with "terminate called without an active
  exception" (a joinable std::thread destroyed at exit). That was 3 of 20 dp=2 runs failing after their
  last step. After the barrier no rank sends again, and ``os._exit`` skips the C++ static destructors and
  atexit hooks that race the threads; nothing is left to run by then (records are closed, stdout/stderr
  flushed). The offline worker has no process group and exits as Python does, its engine's exit hooks
  included.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

from llmadapt.contract.records import End, Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.host import node_name, utc_now

ORCHESTRATOR_VAR = "LLMADAPT_ORCHESTRATOR"


RUN_TOKEN_VAR = "LLMADAPT_RUN_TOKEN"
"""Set in the environment of everything a launch starts, so the launcher can find all of it afterwards."""


ORPHAN_GRACE_S = 10.0
"""After its orchestrator is gone, how long a rank may take to write why it stopped before it is ended."""


def launch_record(run_dir: Path) -> Any:
    """The run's launch record (a LaunchRequest); a Slurm job carries it in LLMADAPT_LAUNCH (nodes need not share a
    disk): written into the run folder first."""
    path = RunDir(run_dir).launch_file
    if not path.is_file() and os.environ.get("LLMADAPT_LAUNCH"):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".launch-{os.getpid()}.json")  # several ranks of one node may race here
        tmp.write_text(os.environ["LLMADAPT_LAUNCH"])
        os.replace(tmp, path)
    return RunDir(run_dir).read_launch()


class Stopped(BaseException):
    """Raised in the main thread when this process is asked to stop; the message says by whom."""


class Diverged(Exception):
    """A loss that is NaN or infinite ended the run (``train.on_nonfinite = "stop"``): an outcome, not an error."""


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
    if isinstance(exc, Diverged):
        return "diverged", 1, str(exc)
    if stop:  # a peer was stopped first and this rank's collective failed for it: the stop is the cause
        return "killed", 143, f"{stop}; then {describe(exc)}"
    return ("oom" if is_oom(exc) else "error"), 1, describe(exc)


def short_trace(exc: BaseException) -> str:
    """'Type: message (at file.py:line)': an error in one line, where it was raised."""
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


def end_distributed() -> str | None:
    """Leave the process group; returns what went wrong, if anything (a teardown problem, not a failed run).

    A rank that finished has waited for every rank before this (``WorkerProcess``'s teardown; see the module's
    docstring); a rank that failed does not wait: its peers are being stopped by the launcher.
    """
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
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


class WorkerProcess:
    """The shell of one worker process, from its first record to its exit code::

        with WorkerProcess(writer, place, "worker") as worker:
            ...  # the header, then what is measured
        return worker.code  # for exit_process

    On the way in: the stop handler and the orchestrator watch (``signals=False``: an inline run, which may be
    called from any thread and leaves the caller's signals alone). On the way out, whatever ended the block: the
    ``End`` record if it finished, else one failure record (``write_failure``) naming the step in progress
    (``steps``), the rank's role and its node; what ``at_close`` registered; the records closed. Then the teardown,
    after the last record, which can only warn: the ranks wait for each other, ``at_teardown``'s functions run
    (only if the block finished), the process group is left (``end_distributed``). Every exception ends here as a
    record and an exit code; the block's is not raised again.
    """

    def __init__(self, writer: Any, place: Any, name: str, *, signals: bool = True,
                 describe: Callable[[BaseException], str] = short_trace) -> None:
        self.writer, self.place, self.name, self.signals, self.describe = writer, place, name, signals, describe
        self.role: Callable[[], str] = lambda: ""
        """This rank's part of the layout ('pp stage 1'), prefixed to its failure message."""
        self.step: int | None = None
        """The step in progress, named in the failure record."""
        self.distributed = self.completed = False
        self.code = 0
        self._at_close: list[Callable[[], None]] = []
        self._at_teardown: list[Callable[[], None]] = []
        self._previous_handler: Any = None

    def __enter__(self) -> WorkerProcess:
        if self.signals:
            self._previous_handler = install_stop_handler()
            watch_orchestrator(node_name())
        return self

    def join_group(self, device: Any) -> None:
        """Several ranks: join the process group (NCCL on CUDA, else gloo); the teardown leaves it."""
        if self.place.world_size == 1:
            return
        import torch.distributed as dist

        # Rank and size given explicitly: under srun there are no RANK/WORLD_SIZE variables.
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=self.place.rank,
                                world_size=self.place.world_size, device_id=device if device.type == "cuda" else None)
        self.distributed = True

    def steps(self, count: int) -> Iterator[int]:
        """``range(count)``, each index kept as the step in progress (the caller clears ``step`` when it is past)."""
        for self.step in range(count):
            yield self.step

    def at_close(self, close: Callable[[], None]) -> None:
        """Run ``close`` on every way out, after the End or failure record, before the records are closed."""
        self._at_close.append(close)

    def at_teardown(self, teardown: Callable[[], None]) -> None:
        """Run ``teardown`` after the last record once the block finished; what it raises is a warning."""
        self._at_teardown.append(teardown)

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            try:
                self.writer.write(End(rank=self.place.rank, time=utc_now()))
                self.completed = True
            except BaseException as error:  # noqa: BLE001 - a disk gone full, a stop: recorded like any other
                exc = error
        if exc is not None:
            self.code = write_failure(exc, self._write_failure)
        for close in self._at_close:
            close()
        try:
            self.writer.close()
        except OSError:  # nothing more could be flushed (disk full): what was written stays readable
            pass
        problem = self._teardown()
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
        if problem:  # every record is written: the launcher reports this as a teardown warning
            print(f"llmadapt {self.name} rank {self.place.rank}: teardown after the last record failed: {problem}",
                  file=sys.stderr)
            self.code = self.code or 1
        return True

    def _write_failure(self, exc: BaseException) -> int:
        """The failure record for EXC; returns the exit code it stands for."""
        cause, code, message = failure_cause(exc, self.describe)
        try:
            role = self.role()
        except Exception:  # noqa: BLE001 - the layout may not exist yet (failure during setup)
            role = ""
        if role:
            message = f"[{role}] {message}"
        if self.place.nnodes > 1:
            message = f"[node {self.place.node_rank} {node_name()}] {message}"
        try:
            self.writer.write(Failure(cause=cause, message=message, rank=self.place.rank, step=self.step,
                                      exit_code=code, time=utc_now()))
        except OSError as write_error:  # the disk is full: say so where the launcher's log keeps it
            print(f"llmadapt {self.name} rank {self.place.rank}: could not write the failure record: {write_error}",
                  file=sys.stderr)
        if cause in ("error", "oom"):
            traceback.print_exception(exc)
        return code

    def _teardown(self) -> str | None:
        """After the last record: wait for every rank, run the block's teardowns, leave the group."""
        problem = None
        try:
            if self.completed and self.distributed:
                import torch.distributed as dist

                dist.barrier()  # no rank destroys a group its peers still use (see the module's docstring)
            if self.completed:
                for teardown in self._at_teardown:
                    teardown()
        except BaseException as exc:  # noqa: BLE001 - a stop signal here ends only the teardown
            problem = f"{type(exc).__name__}: {exc}"
        if self.distributed:
            problem = end_distributed() or problem
        return problem
