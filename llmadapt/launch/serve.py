"""A serving run, the door: the checks before its folder exists, then one engine and the load points run against
it (experiments.loadsweep runs several), the signals held while the engine starts and stops, and the partial
summary of an interrupted run; Ctrl-C keeps what was measured. The pieces: what starts the engine in
``launch.engine``, what drives load against it and writes each point's records in ``launch.loadpoint``."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.contract.readback import RunResult, summarise
from llmadapt.contract.records import Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, Terminated
from llmadapt.launch.engine import Engine, check_reachable, engine_launch
from llmadapt.launch.loadpoint import LoadPoint, drive, new_point, recorded_hash
from llmadapt.launch.supervise import interrupt_text
from llmadapt.spec import Workload

__all__ = ["LoadPoint", "check_reachable", "engine_launch", "new_point", "run_offline", "run_serving",
           "serve_points"]


def run_serving(workload: Workload, info, out, run_id, timeout, progress) -> RunResult:
    if workload.serve.mode == "offline":
        return run_offline(workload, info, out, run_id, timeout, progress)
    check_reachable(workload)  # before the run folder: an address where nothing listens is bad input
    point = new_point(workload, info, out, run_id, progress)
    try:
        return serve_points(workload, info, point.run_dir, timeout, progress,
                            lambda done: None if done else point)[0]
    except KeyboardInterrupt as exc:  # stopped before the engine's loop could summarise the run
        if not RunDir(point.run_dir).summary_file.is_file():
            summarise_interrupted(point.run_dir, exc)
        raise


def summarise_interrupted(run_dir: Path, exc: KeyboardInterrupt) -> None:
    """The partial summary of a serving run stopped by a signal in the orchestrator."""
    summarise(run_dir, [Failure(cause="interrupted", message=f"{interrupt_text(exc)} in the orchestrator")])


def run_offline(workload: Workload, info, out, run_id, timeout, progress) -> RunResult:
    """serve.mode = 'offline': the adapter's offline engine over the whole request plan, in its environment
    (llmadapt.runtime.offline), as one worker supervised like a training rank; its records summarised like any
    serving run's."""
    from llmadapt.launch.prepare import ensure_checkpoint
    from llmadapt.launch.supervise import supervise, worker_command, worker_env

    point = new_point(workload, info, out, run_id, progress)
    failures: list[Failure] = []
    try:
        checkpoint = ensure_checkpoint(workload, info.environment)
    except LlmadaptError as exc:
        return RunResult(run_dir=point.run_dir, summary=summarise(point.run_dir, [Failure(cause="error",
                                                                                           message=str(exc))]))
    RunDir(point.run_dir).write_launch(attrs.evolve(
        point.launch, launcher="offline", checkpoint=str(checkpoint), offline_class=info.roles["offline"],
        checkpoint_hash=recorded_hash(workload, checkpoint)))
    try:
        failures += supervise(worker_command("subprocess", point.launch.python, point.run_dir),
                              env=worker_env(1, info.environment), log=RunDir(point.run_dir).engine_log, tail=None,
                              timeout=timeout, memory_limit_bytes=None, progress=progress)
    except KeyboardInterrupt as exc:
        summarise_interrupted(point.run_dir, exc)
        raise
    return RunResult(run_dir=point.run_dir, summary=summarise(point.run_dir, failures))


class _Interrupts:
    """SIGINT (Ctrl-C) and SIGTERM (what Slurm and Kubernetes send on cancel) stop a serving run alike: the
    engine is stopped, the records so far stay, and KeyboardInterrupt (``Terminated`` for SIGTERM) tells the
    caller to write the partial summary and exit non-zero.

    While the event loop runs, a signal cancels the run's task: a KeyboardInterrupt raised inside the loop
    could land anywhere, and asyncio.run's own handler only says "interrupted" when the cancellation surfaces
    as such (a wait_for that completes as it is cancelled swallows it, Python 3.11), so the flag is checked
    afterwards. While ``hold`` is set (starting or stopping the engine) a signal is only noted, so that an
    engine is never half-started or half-stopped. Outside the main thread (embedded) signals stay the caller's.
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self.task: asyncio.Task | None = None
        self.hold = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (nohup, a background job): left so
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            return  # one is enough: a second must not cut the engine's stop short
        self.signal = signal.Signals(signum).name
        if self.task is not None:
            try:
                self.task.get_loop().call_soon_threadsafe(self.task.cancel)
            except RuntimeError:  # the loop has just closed: the flag is checked after it
                pass
        elif not self.hold:
            raise self.exception()

    def exception(self) -> KeyboardInterrupt:
        return Terminated("terminated by SIGTERM") if self.signal == "SIGTERM" else KeyboardInterrupt()


def serve_points(workload: Workload, info, engine_dir: Path, timeout: float | None, progress,
                 next_point: Callable[[list[RunResult]], LoadPoint | None]) -> list[RunResult]:
    """Start (or attach to) the engine of ``workload`` once, wait until it is ready, then run load points one after
    the other against it, each summarised in its own folder, until ``next_point`` (given the results so far)
    returns None; stop the engine. The engine's log goes to ``engine_dir``.

    ``timeout`` bounds each point (the first one's from the engine's start). A point that fails (timeout, failed
    requests) is a result; an engine that fails to start or dies ends the series with the current point failed.
    Raises KeyboardInterrupt (``Terminated`` for SIGTERM) once the engine is stopped and the current point is
    summarised as interrupted.
    """
    with _Interrupts() as interrupts:
        return _Series(workload, info, engine_dir, timeout, progress, next_point, interrupts).run()


@attrs.define
class _Series:
    """Load points run one after the other against one engine, and the state they share: the results so far, the
    point being run and its failures (kept as they happen: an interrupt's summary holds them), the engine."""

    workload: Workload
    info: Any
    engine_dir: Path
    timeout: float | None
    progress: Any
    next_point: Callable[[list[RunResult]], LoadPoint | None]
    interrupts: _Interrupts
    results: list[RunResult] = attrs.Factory(list)
    failures: list[Failure] = attrs.Factory(list)
    current: LoadPoint | None = None
    engine: Engine | None = None

    def finish(self) -> None:
        """The current point's summary, with the failures it met."""
        summary = summarise(self.current.run_dir, list(self.failures))
        self.results.append(RunResult(run_dir=self.current.run_dir, summary=summary))
        self.failures.clear()

    def run(self) -> list[RunResult]:
        self.current = self.next_point(self.results)
        if self.current is None:
            return self.results
        try:
            self.engine = Engine.prepare(self.workload, self.info, self.engine_dir)
        except LlmadaptError as exc:
            self.failures.append(Failure(cause="error", message=str(exc)))
            self.finish()
            return self.results
        try:
            self.interrupts.hold = True  # a signal now is noted, not raised: a half-started engine could escape stop()
            failed = self.engine.start()
            self.interrupts.hold = False
            if failed:
                self.failures.append(failed)
                self.finish()
            elif not self.interrupts.signal:
                try:
                    asyncio.run(self._main())
                except asyncio.CancelledError:
                    if not self.interrupts.signal:
                        raise
        finally:
            self.interrupts.hold = True
            self.engine.stop()
        if self.interrupts.signal:
            exc = self.interrupts.exception()
            if not self.results or self.results[-1].run_dir != self.current.run_dir:
                self.failures.append(Failure(cause="interrupted", message=f"{interrupt_text(exc)} in the orchestrator"))
                self.finish()
            raise exc
        return self.results

    async def _main(self) -> None:
        import aiohttp

        self.interrupts.task = asyncio.current_task()
        try:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
            async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
                await self._points(session)
        finally:
            self.interrupts.task, self.interrupts.hold = None, True  # the loop closes: a signal now is noted

    async def _points(self, session) -> None:
        engine, started = self.engine, time.monotonic()
        failed = await engine.wait_ready(session, self.timeout, started)
        if failed:
            self.failures.append(failed)
            self.finish()
            return
        while True:
            if self.interrupts.signal:
                raise asyncio.CancelledError
            await drive(engine, self.current, session, started, self.timeout, self.progress, self.failures)
            if not engine.server.alive():
                self.failures.append(engine.ended("during this load point"))
            self.finish()
            started = time.monotonic()
            following = self.next_point(self.results)
            if following is None:
                return
            self.current = following
            if not engine.server.alive():  # the engine died: the points left would only fail
                self.failures.append(engine.ended("before this load point"))
                self.finish()
                return


