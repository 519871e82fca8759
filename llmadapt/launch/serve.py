"""A serving run: start the engine through its adapter (or attach to a URL), wait until it is ready, drive
the load generator, scrape the engine's metrics, and summarise; Ctrl-C keeps what was measured.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

from llmadapt.adapter.context import ServeContext, WrongServer
from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.records import Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, Terminated
from llmadapt.host import software_versions
from llmadapt.launch.environments import python_for
from llmadapt.launch.settings import make_run_id
from llmadapt.launch.summary import RunResult, summarise
from llmadapt.launch.supervise import interrupt_text
from llmadapt.runtime.loadgen import LoadGenerator, redact, sent_secrets
from llmadapt.runtime.requests import plan_requests
from llmadapt.spec import Workload


def run_serving(workload: Workload, info, out, run_id, timeout, progress) -> RunResult:
    from llmadapt.launch.serve import run_serve

    attach = workload.serve.url is not None
    if not attach and info.environment is None:
        raise LlmadaptError(f"adapter {info.name!r} only attaches to a running engine: set serve.url")
    python = None if attach else python_for(info.environment)  # fails before anything is written
    launcher = "attach" if attach else "subprocess"
    run_id = run_id or make_run_id(info.name, workload)
    run_dir = Path(out) / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    launch = {
        "run_id": run_id, "adapter": info.name, "framework": info.framework, "role": "serve", "launcher": launcher,
        "world_size": 1, "workload": workload.to_dict(), "workload_hash": workload.content_hash,
        "python": str(python) if python else None, "created": time.time(),
    }
    RunDir(run_dir).write_launch(launch)
    if progress:
        progress({"type": "start", "run_dir": str(run_dir), "adapter": info.name, "label": workload.label,
                  "world_size": 1, "launcher": launcher})
    failures: list[Failure] = []
    try:
        failures = run_serve(workload, info, run_id, run_dir, launcher, python, timeout, progress)
    except KeyboardInterrupt as exc:
        summarise(run_dir, [Failure(cause="interrupted", message=f"{interrupt_text(exc)} in the orchestrator")])
        raise
    return RunResult(run_dir=run_dir, summary=summarise(run_dir, failures))


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


def run_serve(workload: Workload, info, run_id: str, run_dir: Path, launcher: str, python: Path | None,
              timeout: float | None, progress) -> list:
    """Start (or attach to) the engine, wait until ready, drive the request plan, stop the engine.

    Returns launcher-level failures; every request outcome is in the records. Raises KeyboardInterrupt
    (``Terminated`` for SIGTERM) once the engine is stopped, when the run was interrupted.
    """
    with _Interrupts() as interrupts:
        return _serve(workload, info, run_id, run_dir, launcher, python, timeout, progress, interrupts)


def _serve(workload: Workload, info, run_id: str, run_dir: Path, launcher: str, python: Path | None,
           timeout: float | None, progress, interrupts: _Interrupts) -> list:
    import importlib

    from llmadapt.contract.records import Failure, Header
    from llmadapt.host import free_port

    attach = workload.serve.url is not None
    checkpoint = None
    if not attach:
        from llmadapt.launch.prepare import ensure_checkpoint

        try:
            checkpoint = ensure_checkpoint(workload, info.environment)
        except LlmadaptError as exc:
            return [Failure(cause="error", message=str(exc))]
    tokenizer = _load_tokenizer(workload, checkpoint)
    plan = plan_requests(workload, tokenizer)
    module_name, _, class_name = info.roles["serve"].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    server = cls(ServeContext(workload, info.name, run_dir, python, checkpoint, free_port()))
    secrets = sent_secrets(server)
    writer = JsonlWriter(run_dir / "rank-00000.jsonl")
    failures: list = []

    def fail(cause: str, message: str) -> None:
        failures.append(Failure(cause=cause, message=redact(message, secrets)))  # messages may quote the server

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
            limit = STARTUP_TIMEOUT_S if timeout is None else min(timeout, STARTUP_TIMEOUT_S)  # --timeout 0 is 0
            refused_since = None
            while True:
                try:
                    ready, refused = await _ready(server, session)
                except WrongServer as exc:
                    fail("error", str(exc))
                    return
                # alive after ready too: a health check answered by another process on the port is not our engine
                if ready and server.alive():
                    break
                if not server.alive():
                    fail("crash", f"the engine exited during start-up; see {run_dir / 'engine.log'}")
                    return
                # Attached, a refused connection means nothing listens there: waiting would only hide that. A
                # managed engine refuses until it listens, so it gets the whole start-up time while it lives.
                refused_since = None if refused is None else refused_since or time.monotonic()
                if attach and refused_since is not None and time.monotonic() - refused_since >= REFUSED_GRACE_S:
                    fail("error", f"nothing answers at {server.ctx.base_url}: {refused} (retried for "
                                  f"{REFUSED_GRACE_S:g} s; is the server running there, and is serve.url right?)")
                    return
                if time.monotonic() - started >= limit:
                    fail("timeout", f"the engine was not ready within {limit:g} s")
                    return
                await asyncio.sleep(0.5)
            if interrupts.signal:
                raise asyncio.CancelledError
            writer.write(Header.starting_now(
                run_id=run_id, rank=0, local_rank=0, world_size=1, role="serve",
                adapter=info.name, adapter_version=info.version, framework=info.framework,
                framework_version=redact(server.engine_version(), secrets), launcher=launcher,
                workload_hash=workload.content_hash, problem_hash=workload.problem_hash, workload=workload.to_dict(),
                checkpoint_hash=_recorded_hash(checkpoint), device=None, software=software_versions(("aiohttp", "tokenizers")),
                patches=list(server.patches),
            ))
            run = LoadGenerator(server, workload, plan, writer, progress).run(session)
            if timeout is None:
                await run
                return
            try:
                await asyncio.wait_for(run, timeout=max(1.0, timeout - (time.monotonic() - started)))
            except TimeoutError:
                fail("timeout", f"the run exceeded its timeout of {timeout:g} s")

    try:
        interrupts.hold = True  # a signal now is noted, not raised: a half-started engine could escape stop()
        try:
            server.start()
            startup_failed = False
        except Exception as exc:  # a failed start is a result of the run, with its trace and summary
            fail("error", f"the engine failed to start: {type(exc).__name__}: {exc}")
            startup_failed = True
        interrupts.hold = False
        if not startup_failed and not interrupts.signal:
            try:
                asyncio.run(main())
            except asyncio.CancelledError:
                if not interrupts.signal:
                    raise
    finally:
        interrupts.hold = True
        server.stop()
        writer.close()
    if interrupts.signal:
        raise interrupts.exception()
    return failures


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


def _recorded_hash(checkpoint: Path | None) -> str | None:
    if checkpoint is None:
        return None
    from llmadapt.models import recorded_weights_hash

    return recorded_weights_hash(checkpoint)
