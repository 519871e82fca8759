"""A serving run: start the engine through its adapter (or attach to a URL), wait until it is ready, drive
the load generator, scrape the engine's metrics, and summarise; Ctrl-C keeps what was measured.

It is over 400 lines because a serving run's whole life is here, in the order it happens: the checks before its
folder exists (the engine's interpreter, an attached URL's reachability), the folder, the engine's start and stop
with the signals held meanwhile, the load points against it, and the partial summary of an interrupted run.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.adapter.context import ServeContext, WrongServer
from llmadapt.adapter.declaration import load_role
from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.launch import LaunchRequest, run_header
from llmadapt.contract.records import Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, Terminated
from llmadapt.host import exit_cause, exit_text, node_name, software_versions
from llmadapt.launch.quality import measure as measure_quality
from llmadapt.launch.environments import process_env, python_for
from llmadapt.launch.settings import launch_request
from llmadapt.contract.readback import RunResult, summarise
from llmadapt.launch.supervise import interrupt_text
from llmadapt.runtime import interference
from llmadapt.runtime.loadgen import LoadGenerator, redact, sent_secrets
from llmadapt.runtime.requests import plan_requests
from llmadapt.runtime.streams import completed_note, request_source
from llmadapt.spec import Workload


@attrs.frozen
class LoadPoint:
    """One serving run against an engine that may serve several in a row (llmadapt.experiments.loadsweep): the run's
    workload (its arrival process and request stream) and its folder, already holding launch.json."""

    workload: Workload
    run_id: str
    run_dir: Path
    launch: LaunchRequest


def engine_launch(workload: Workload, info) -> tuple[str, Path | None]:
    """(launcher, interpreter) for the workload's engine: attached by URL, or started in the adapter's
    environment (whose absence fails here, before anything is written)."""
    attach = workload.serve.url is not None
    if not attach and info.environment is None:
        raise LlmadaptError(f"adapter {info.name!r} only attaches to a running engine: set serve.url")
    return ("attach", None) if attach else ("subprocess", python_for(info.environment))


def check_reachable(workload: Workload) -> None:
    """Attached (serve.url): something must accept connections there before any run folder is made; else one
    line (LlmadaptError: bad input). Refused connections are retried for REFUSED_GRACE_S (a server restarting);
    an unknown host is not. Whether it is the right server is judged later, by the adapter's readiness check."""
    import socket
    from urllib.parse import urlsplit

    url = workload.serve.url
    if url is None:
        return
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise LlmadaptError(f"serve.url {url!r} is not a URL ({exc}): write http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not host:
        raise LlmadaptError(f"serve.url {url!r} is not an http(s) URL: write http://HOST:PORT")
    deadline = time.monotonic() + REFUSED_GRACE_S
    while True:
        try:
            socket.create_connection((host, port), timeout=REFUSED_GRACE_S).close()
            return
        except socket.gaierror as exc:
            why = f"unknown host {host!r} ({exc.strerror or exc})"
            break
        except ConnectionRefusedError:
            why = "connection refused"
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    raise LlmadaptError(f"nothing answers at {url}: {why} (retried for {REFUSED_GRACE_S:g} s; is the server running "
                        "there, and is serve.url right?)")


def new_point(workload: Workload, info, out, run_id: str | None, progress) -> LoadPoint:
    """A serving run's folder with its launch.json, announced to ``progress``."""
    launcher, python = engine_launch(workload, info)
    launch = launch_request(workload, info, launcher, python, run_id)
    run_dir = Path(out) / launch.run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    RunDir(run_dir).write_launch(launch)
    RunDir(run_dir).rank_file(0).touch()  # a run that fails before its header still has its (empty) record file
    if progress:
        progress({"type": "start", "run_dir": str(run_dir), "adapter": info.name, "label": workload.label,
                  "world_size": 1, "launcher": launcher})
        note = completed_note(request_source(workload))
        if note:
            progress({"type": "warning", "message": note})
    return LoadPoint(workload, launch.run_id, run_dir, launch)


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
        checkpoint_hash=_recorded_hash(workload, checkpoint)))
    try:
        failures += supervise(worker_command("subprocess", point.launch.python, point.run_dir),
                              env=worker_env(1, info.environment), log=RunDir(point.run_dir).engine_log, tail=None,
                              timeout=timeout, memory_limit_bytes=None, progress=progress)
    except KeyboardInterrupt as exc:
        summarise_interrupted(point.run_dir, exc)
        raise
    return RunResult(run_dir=point.run_dir, summary=summarise(point.run_dir, failures))


# -- orchestration ------------------------------------------------------------------------------
STARTUP_TIMEOUT_S = 600.0


REFUSED_GRACE_S = 5.0
"""Attached: how long connections may be refused before the run fails (nothing listens at that address).
A managed engine may refuse them for as long as it is starting, i.e. while its process lives."""


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
        return _serve(workload, info, engine_dir, timeout, progress, next_point, interrupts)


def _serve(workload: Workload, info, engine_dir: Path, timeout: float | None, progress,
           next_point: Callable[[list[RunResult]], LoadPoint | None], interrupts: _Interrupts) -> list[RunResult]:
    from llmadapt.contract.records import Failure
    from llmadapt.host import free_port

    results: list[RunResult] = []
    point = next_point(results)
    if point is None:
        return results
    launcher, python = engine_launch(workload, info)
    attach = launcher == "attach"
    failures: list = []

    def finish(current: LoadPoint) -> None:
        results.append(RunResult(run_dir=current.run_dir, summary=summarise(current.run_dir, list(failures))))
        failures.clear()

    checkpoint = None
    if not attach:
        from llmadapt.launch.prepare import ensure_checkpoint

        try:
            checkpoint = ensure_checkpoint(workload, info.environment)
        except LlmadaptError as exc:
            failures.append(Failure(cause="error", message=str(exc)))
            finish(point)
            return results
    tokenizer = _load_tokenizer(workload, checkpoint)
    cls = load_role(info.roles["serve"])
    env = None if attach else process_env(info.environment)
    server = cls(ServeContext(workload, info.name, engine_dir, python, checkpoint, free_port(), env))
    secrets = sent_secrets(server)
    current: list[LoadPoint] = [point]  # the point being run, for the interrupt's summary

    def fail(cause: str, message: str) -> None:
        failures.append(Failure(cause=cause, message=redact(message, secrets)))  # messages may quote the server

    def engine_ended(when: str) -> None:
        """The engine's process is gone: how it ended (its exit status, the signal that killed it), and when."""
        code = server.exit_code()
        how = "exited" if code is None else exit_text(code)
        failures.append(Failure(cause="crash" if code is None else exit_cause(code), exit_code=code,
                                message=f"the engine {how} {when}; see {RunDir(engine_dir).engine_log}"))

    async def main() -> None:
        import aiohttp

        interrupts.task = asyncio.current_task()
        try:
            await serve(aiohttp)
        finally:
            interrupts.task, interrupts.hold = None, True  # the loop closes: a signal now is noted, raised after

    async def serve(aiohttp) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as session:
            started = time.monotonic()
            if not await _wait_ready(session, started):
                finish(current[0])
                return
            while True:
                p = current[0]
                await _one_point(p, session, started)
                if not server.alive():
                    engine_ended("during this load point")
                finish(p)
                started = time.monotonic()
                following = next_point(results)
                if following is None:
                    return
                current[0] = following
                if not server.alive():  # the engine died: the points left would only fail
                    engine_ended("before this load point")
                    finish(following)
                    return

    async def _wait_ready(session, started: float) -> bool:
        limit = STARTUP_TIMEOUT_S if timeout is None else min(timeout, STARTUP_TIMEOUT_S)  # --timeout 0 is 0
        refused_since = None
        while True:
            try:
                ready, refused = await _ready(server, session)
            except WrongServer as exc:
                fail("error", str(exc))
                return False
            # alive after ready too: a health check answered by another process on the port is not our engine
            if ready and server.alive():
                return True
            if not server.alive():
                engine_ended("during start-up")
                return False
            # Attached, a refused connection means nothing listens there: waiting would only hide that. A
            # managed engine refuses until it listens, so it gets the whole start-up time while it lives.
            refused_since = None if refused is None else refused_since or time.monotonic()
            if attach and refused_since is not None and time.monotonic() - refused_since >= REFUSED_GRACE_S:
                fail("error", f"nothing answers at {server.ctx.base_url}: {refused} (retried for "
                              f"{REFUSED_GRACE_S:g} s; is the server running there, and is serve.url right?)")
                return False
            if time.monotonic() - started >= limit:
                fail("timeout", f"the engine was not ready within {limit:g} s")
                return False
            await asyncio.sleep(0.5)

    async def _one_point(p: LoadPoint, session, started: float) -> None:
        if interrupts.signal:
            raise asyncio.CancelledError
        w = p.workload
        writer = JsonlWriter(RunDir(p.run_dir).rank_file(0))
        try:
            writer.write(run_header(
                p.launch, framework_version=redact(server.engine_version(), secrets), device=None,
                software=software_versions(("aiohttp", "tokenizers")), patches=list(server.patches), workload=w,
                checkpoint_hash=_recorded_hash(w, checkpoint), model_source=_recorded_source(checkpoint),
                request_source=request_source(w),
                notes=list(getattr(server, "notes", [])),  # a server written before notes may not call our __init__
                engine_weights=getattr(server, "engine_weights", lambda: None)()))
            run = LoadGenerator(server, w, plan_requests(w, tokenizer), writer, progress).run(session)
            engine = _engine_group(engine_dir)
            quiet_start, engine_start = interference.snapshot(), interference.group_cpu_s(engine)
            try:
                if timeout is None:
                    await run
                else:
                    try:
                        await asyncio.wait_for(run, timeout=max(1.0, timeout - (time.monotonic() - started)))
                    except TimeoutError:
                        fail("timeout", f"the run exceeded its timeout of {timeout:g} s")
            finally:  # what ran beside the run while it sent its requests, the engine's CPU counted as its own
                writer.write(interference.serving_window(quiet_start, interference.snapshot(), engine_start,
                                                         interference.group_cpu_s(engine), node_name()))
            if w.serve.quality.texts and server.alive():  # after the speed measurement, outside its window
                try:
                    writer.write(await measure_quality(server, session, w, checkpoint, p.run_dir))
                except LlmadaptError as exc:
                    fail("error", str(exc))
        finally:
            writer.close()

    try:
        interrupts.hold = True  # a signal now is noted, not raised: a half-started engine could escape stop()
        try:
            server.start()
            startup_failed = False
        except Exception as exc:  # a failed start is a result of the run, with its trace and summary
            fail("error", f"the engine failed to start: {type(exc).__name__}: {exc}")
            startup_failed = True
        interrupts.hold = False
        if startup_failed:
            finish(point)
        elif not interrupts.signal:
            try:
                asyncio.run(main())
            except asyncio.CancelledError:
                if not interrupts.signal:
                    raise
    finally:
        interrupts.hold = True
        server.stop()
        # the engine is stopped: a pid file left would name a process that is gone, or later another one
        RunDir(engine_dir).engine_pid.unlink(missing_ok=True)
    if interrupts.signal:
        exc = interrupts.exception()
        if not results or results[-1].run_dir != current[0].run_dir:
            failures.append(Failure(cause="interrupted", message=f"{interrupt_text(exc)} in the orchestrator"))
            finish(current[0])
        raise exc
    return results


async def _ready(server, session) -> tuple[bool, str | None]:
    """(ready, why nothing answers): the second is set only when no connection could be made at all (refused,
    unknown host), never for a server that answers but is not ready yet. WrongServer propagates."""
    import aiohttp

    try:
        return bool(await asyncio.wait_for(server.ready(session), timeout=5)), None
    except WrongServer:
        raise
    except aiohttp.ClientSSLError:  # something answers, in another TLS mode: not "nothing there"
        return False, None
    except aiohttp.ClientConnectorError as exc:
        os_error = exc.os_error
        return False, "connection refused" if isinstance(os_error, ConnectionRefusedError) else (
            os_error.strerror or str(exc))
    except Exception:
        return False, None


def _load_tokenizer(workload: Workload, checkpoint: Path | None):
    from tokenizers import Tokenizer

    if checkpoint is not None:
        return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    from llmadapt.models import train_tokenizer

    return train_tokenizer(workload.model.vocab_size)


def _engine_group(engine_dir: Path) -> int | None:
    """The process group of the engine the adapter started (its pid file: engines start in their own group);
    None when attached by URL or not recorded."""
    try:
        return int(RunDir(engine_dir).engine_pid.read_text())
    except (OSError, ValueError):
        return None


def _recorded_hash(workload: Workload, checkpoint: Path | None) -> str | None:
    """The header's checkpoint hash, as a training rank records it: model.checksum (a folder's content hash, a
    GGUF file's hash), else the canonical checkpoint's; none for an attached server (what it serves is its own)."""
    if checkpoint is None:
        return None
    from llmadapt.models import recorded_weights_hash

    return workload.model.checksum or recorded_weights_hash(checkpoint)


def _recorded_source(checkpoint: Path | None):
    if checkpoint is None:
        return None
    from llmadapt.models import recorded_source

    return recorded_source(checkpoint)
