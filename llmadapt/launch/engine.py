"""What starts a serving run's engine: the adapter's Server started in its environment (or attached to by URL),
waited for until it is ready, stopped; and how its end reads when its process is gone. Bad input (no environment, an
attached URL where nothing listens, a checkpoint that cannot be prepared) raises LlmadaptError before the engine
starts; from then on, an engine that fails to start, dies or never gets ready is a ``Failure`` record of the run."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import attrs

from llmadapt.adapter.context import ServeContext, WrongServer
from llmadapt.adapter.declaration import load_role
from llmadapt.contract.records import Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.host import exit_cause, exit_text, free_port
from llmadapt.launch.environments import process_env, python_for
from llmadapt.runtime.loadgen import redact, sent_secrets
from llmadapt.spec import Workload

STARTUP_TIMEOUT_S = 600.0

REFUSED_GRACE_S = 5.0
"""Attached: how long connections may be refused before the run fails (nothing listens at that address).
A managed engine may refuse them for as long as it is starting, i.e. while its process lives."""


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


@attrs.define
class Engine:
    """One engine for a series of load points: its adapter's Server, the checkpoint it serves (None attached), the
    tokenizer the request plan is cut with, and the secrets its messages must not show."""

    server: Any
    dir: Path
    attach: bool
    checkpoint: Path | None
    tokenizer: Any
    secrets: tuple = ()

    @classmethod
    def prepare(cls, workload: Workload, info, engine_dir: Path) -> Engine:
        """The Server object, not started yet; raises LlmadaptError when the checkpoint cannot be prepared."""
        launcher, python = engine_launch(workload, info)
        attach = launcher == "attach"
        checkpoint = None
        if not attach:
            from llmadapt.launch.prepare import ensure_checkpoint

            checkpoint = ensure_checkpoint(workload, info.environment)
        tokenizer = _load_tokenizer(workload, checkpoint)
        env = None if attach else process_env(info.environment)
        server = load_role(info.roles["serve"])(
            ServeContext(workload, info.name, engine_dir, python, checkpoint, free_port(), env))
        return cls(server, engine_dir, attach, checkpoint, tokenizer, tuple(sent_secrets(server)))

    def failure(self, cause: str, message: str) -> Failure:
        return Failure(cause=cause, message=redact(message, self.secrets))  # messages may quote the server

    def ended(self, when: str) -> Failure:
        """The engine's process is gone: how it ended (its exit status, the signal that killed it), and when."""
        code = self.server.exit_code()
        how = "exited" if code is None else exit_text(code)
        return Failure(cause="crash" if code is None else exit_cause(code), exit_code=code,
                       message=f"the engine {how} {when}; see {RunDir(self.dir).engine_log}")

    def start(self) -> Failure | None:
        try:
            self.server.start()
        except Exception as exc:  # a failed start is a result of the run, with its trace and summary
            return self.failure("error", f"the engine failed to start: {type(exc).__name__}: {exc}")
        return None

    def stop(self) -> None:
        self.server.stop()
        # the engine is stopped: a pid file left would name a process that is gone, or later another one
        RunDir(self.dir).engine_pid.unlink(missing_ok=True)

    def group(self) -> int | None:
        """The process group of the engine the adapter started (its pid file: engines start in their own group);
        None when attached by URL or not recorded."""
        try:
            return int(RunDir(self.dir).engine_pid.read_text())
        except (OSError, ValueError):
            return None

    async def wait_ready(self, session, timeout: float | None, started: float) -> Failure | None:
        """None once the engine answers ready; else why it never will (it died, it is another server, nothing
        listens at an attached URL, the start-up time ran out)."""
        limit = STARTUP_TIMEOUT_S if timeout is None else min(timeout, STARTUP_TIMEOUT_S)  # --timeout 0 is 0
        refused_since = None
        while True:
            try:
                ready, refused = await _ready(self.server, session)
            except WrongServer as exc:
                return self.failure("error", str(exc))
            # alive after ready too: a health check answered by another process on the port is not our engine
            if ready and self.server.alive():
                return None
            if not self.server.alive():
                return self.ended("during start-up")
            # Attached, a refused connection means nothing listens there: waiting would only hide that. A
            # managed engine refuses until it listens, so it gets the whole start-up time while it lives.
            refused_since = None if refused is None else refused_since or time.monotonic()
            if self.attach and refused_since is not None and time.monotonic() - refused_since >= REFUSED_GRACE_S:
                return self.failure("error", f"nothing answers at {self.server.ctx.base_url}: {refused} (retried "
                                             f"for {REFUSED_GRACE_S:g} s; is the server running there, and is "
                                             "serve.url right?)")
            if time.monotonic() - started >= limit:
                return self.failure("timeout", f"the engine was not ready within {limit:g} s")
            await asyncio.sleep(0.5)


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
