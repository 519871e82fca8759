"""The load generator that measures every engine the same way.

The generator runs in the orchestrator's process (no torch), on asyncio with one aiohttp
session. It owns the clock: it decides when each request is due (the arrival process), stamps
the actual send, every content-bearing chunk and the end on its monotonic clock, and writes one
``request`` record per request as it finishes, plus periodic ``server_sample`` records of the
engine's own metrics. Adapters only speak their engine's protocol (``Server.stream``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.adapter.context import Chunk, PlannedRequest, RequestFailed
from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.records import Request, ServerSample
from llmadapt.contract.stats import LAG_P99_LIMIT_MS
from llmadapt.spec import Workload

LEAD_S = 0.05  # the schedule starts this long after planning, so the first requests are not born late


LOOP_SAMPLE_S = 0.01  # how often the event loop's wake-up lag is sampled during a run


REDACTED = "[redacted]"


SECRET_HEADERS = ("authorization", "proxy-authorization", "x-api-key", "api-key")


def sent_secrets(server) -> list[str]:
    """The credentials a Server sends (its ``headers()``: API keys, bearer tokens), longest first.

    A server may echo them back (an error body quoting the key it refused); nothing recorded may hold them."""
    headers = server.headers() if callable(getattr(server, "headers", None)) else {}
    found = set()
    for name, value in headers.items():
        if name.lower() in SECRET_HEADERS and value:
            found.add(value)
            token = value.partition(" ")[2].strip()  # "Bearer KEY" -> KEY, which may be echoed alone
            if token:
                found.add(token)
    return sorted(found, key=len, reverse=True)  # "Bearer KEY" before "KEY"


def redact(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def check_chunk(chunk: Chunk) -> None:
    """What goes into a request record must have the contract's types, whatever the adapter parsed: a value of
    another type would make the run's own summary step refuse the trace (and so lose every measured request)."""
    for name in ("tokens", "usage_output_tokens", "usage_input_tokens"):
        value = getattr(chunk, name)
        if value is not None and (type(value) is not int or value < 0):
            raise RequestFailed("malformed", f"malformed response: {name} is {value!r:.80}, not a count")
    if chunk.finish_reason is not None and not isinstance(chunk.finish_reason, str):
        raise RequestFailed("malformed", f"malformed response: finish_reason is {chunk.finish_reason!r:.80}, "
                                         "not text")


def sched_autogroup() -> bool | None:
    """Whether this Linux kernel groups scheduling by session (None: not Linux, or not known)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


# -- the generator ------------------------------------------------------------------------------
class LoadGenerator:
    def __init__(self, server, workload: Workload, plan: list[PlannedRequest], writer: JsonlWriter,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.server, self.w, self.plan, self.writer, self.progress = server, workload, plan, writer, progress
        self.done = self.sent = 0
        self.secrets = sent_secrets(server)

    async def run(self, session) -> None:
        s = self.w.serve
        # Stopped by an event, not cancel(): a cancel that lands as a scrape completes can be lost (3.11).
        stop = asyncio.Event()
        await self._scrape_once(session)  # the engine's counters before the first request: differences cover them all
        if s.profile:
            await self.server.start_profile(session)
        scraper = asyncio.create_task(self._scrape_loop(session, stop))
        watch = _LoopWatch()
        watcher = asyncio.create_task(watch.run(stop))
        try:
            if any(getattr(req, "conversation", None) is not None for req in self.plan):
                await self._conversations(session)
            elif s.arrival.process == "closed":
                await self._closed_loop(session)
            else:
                await self._open_loop(session)
            if s.profile:
                self._write_engine_profile(await self.server.stop_profile(session))
        finally:
            stop.set()
            await scraper
            await watcher
            self.writer.write(watch.record(self.sent, self.server.itl_histogram,
                                           getattr(self.server, "prefix_cache_counters", None),
                                           prefix_share(self.plan)))
            await self._scrape_once(session)

    def _write_engine_profile(self, traces: list[Path]) -> None:
        """The engine's trace, one breakdown record per engine step (llmadapt.runtime.engine_profile)."""
        from llmadapt.runtime.engine_profile import engine_steps, read_trace

        if not traces:
            raise RuntimeError("the engine wrote no profile trace after its profiler stopped")
        for path in traces:
            for record in engine_steps(read_trace(path)):
                self.writer.write(record)

    async def _open_loop(self, session) -> None:
        s = self.w.serve
        sem = asyncio.Semaphore(s.max_concurrency) if s.max_concurrency else None
        spin_ns = int(s.send_spin_ms * 1e6)
        start = time.monotonic_ns() + int(LEAD_S * 1e9)
        deadline = start + int(s.duration_s * 1e9) if s.duration_s else None
        tasks = []
        try:
            for req in self.plan:
                due = start + int(req.offset_s * 1e9)
                if deadline and due > deadline:
                    break
                # wake a little early and let the request's own task spin to its send time: it then sends in
                # the step that finds it due, instead of queueing behind that step's other callbacks
                await nap_until(due - spin_ns)
                tasks.append(asyncio.create_task(self._one(session, req, due, sem)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _closed_loop(self, session) -> None:
        s = self.w.serve
        queue = list(reversed(self.plan))
        deadline = time.monotonic_ns() + int(s.duration_s * 1e9) if s.duration_s else None

        async def worker() -> None:
            while queue:
                if deadline and time.monotonic_ns() > deadline:
                    return
                req = queue.pop()
                await self._one(session, req, time.monotonic_ns(), None)

        workers = [asyncio.create_task(worker()) for _ in range(s.arrival.concurrency)]
        try:
            await asyncio.gather(*workers)
        except asyncio.CancelledError:
            for t in workers:
                t.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise

    async def _conversations(self, session) -> None:
        """Multi-turn conversations (llmadapt.runtime.streams.TurnRequest): a conversation starts at its first
        turn's arrival time (open loop) or when one of serve.arrival.concurrency slots frees (closed loop); each
        later turn is due its think time after the previous turn's answer ended, whatever became of it."""
        s = self.w.serve
        convs: dict[int, list[PlannedRequest]] = {}
        for req in self.plan:
            convs.setdefault(req.conversation, []).append(req)
        sem = asyncio.Semaphore(s.max_concurrency) if s.max_concurrency else None
        spin_ns = int(s.send_spin_ms * 1e6)
        closed = s.arrival.process == "closed"
        start = time.monotonic_ns() + (0 if closed else int(LEAD_S * 1e9))
        deadline = start + int(s.duration_s * 1e9) if s.duration_s else None

        async def converse(turns: list[PlannedRequest], due: int) -> None:
            for i, req in enumerate(turns):
                if i:
                    due = time.monotonic_ns() + int(req.think_s * 1e9)
                if deadline and due > deadline:
                    return
                await nap_until(due - spin_ns)
                await self._one(session, req, due, sem)

        tasks = []
        try:
            if closed:
                queue = list(reversed(convs.values()))

                async def worker() -> None:
                    while queue and not (deadline and time.monotonic_ns() > deadline):
                        await converse(queue.pop(), time.monotonic_ns())

                tasks = [asyncio.create_task(worker()) for _ in range(s.arrival.concurrency)]
            else:
                for turns in convs.values():
                    due = start + int(turns[0].offset_s * 1e9)
                    if deadline and due > deadline:
                        break
                    await nap_until(due - spin_ns)
                    tasks.append(asyncio.create_task(converse(turns, due)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, session, req: PlannedRequest, scheduled_ns: int, sem) -> None:
        chunk_ns: list[int] = []
        chunk_tokens: list[int | None] = []
        first = finish = usage_out = usage_in = last = None
        status, error, cause = "ok", None, None
        sent = None
        await spin_until(scheduled_ns)
        if sem:
            await sem.acquire()
        try:
            if not self.server.alive():
                raise RequestFailed("engine_dead", "the engine had exited before this request was sent")
            sent = time.monotonic_ns()
            self.sent += 1
            async with asyncio.timeout(self.w.serve.request_timeout_s):
                async for chunk in self.server.stream(session, req):
                    now = last = time.monotonic_ns()
                    check_chunk(chunk)
                    if chunk.text or chunk.tokens:
                        first = first or now
                        chunk_ns.append(now)
                        chunk_tokens.append(chunk.tokens)
                    finish = chunk.finish_reason or finish
                    usage_out = chunk.usage_output_tokens if chunk.usage_output_tokens is not None else usage_out
                    usage_in = chunk.usage_input_tokens if chunk.usage_input_tokens is not None else usage_in
            if first is None and usage_out:
                # tokens that make no whole UTF-8 character (a tiny random model's byte soup): an engine that
                # streams text sends none, and its usage counts them; they reached the client with its last event
                first = last
                chunk_ns.append(last)
                chunk_tokens.append(usage_out)
            if first is None:
                raise RequestFailed("malformed", "the stream ended without any content")
        except TimeoutError:
            status, cause, error = "timeout", "timeout", f"no complete response within {self.w.serve.request_timeout_s:g} s"
        except RequestFailed as exc:  # a stream without its end marker is 'truncated': it may be cut short
            status, cause, error = "truncated" if exc.cause == "truncated" else "error", exc.cause, str(exc)
        except asyncio.CancelledError:
            status, cause, error = "cancelled", "cancelled", "cancelled (interrupted)"
            self._write(req, scheduled_ns, sent, first, chunk_ns, chunk_tokens, finish, usage_out, usage_in,
                        status, error, cause)
            raise
        except Exception as exc:  # connection resets, protocol errors: failures, never crashes
            dead = not self.server.alive()
            status, cause = "error", "engine_dead" if dead else "connection"
            error = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            if sem:
                sem.release()
        self._write(req, scheduled_ns, sent, first, chunk_ns, chunk_tokens, finish, usage_out, usage_in,
                    status, error, cause)

    def _write(self, req, scheduled_ns, sent, first, chunk_ns, chunk_tokens, finish, usage_out, usage_in,
               status, error, cause) -> None:
        error = redact(error, self.secrets) if error else error
        known = [t for t in chunk_tokens if t is not None]
        output = usage_out if usage_out is not None else (sum(known) if chunk_tokens and len(known) ==
                                                          len(chunk_tokens) else None)
        record = Request(
            index=req.index, warmup=req.warmup, scheduled_ns=scheduled_ns, sent_ns=sent, first_token_ns=first,
            end_ns=time.monotonic_ns() if sent else None, chunk_ns=chunk_ns, chunk_tokens=chunk_tokens,
            input_tokens=req.input_tokens, output_tokens=output,
            requested_output_tokens=req.output_tokens, output_forced=req.ignore_eos and self.server_forces(),
            finish_reason=finish, status=status, error=error, error_cause=cause, server_input_tokens=usage_in,
        )
        self.writer.write(record)
        self.done += 1
        if self.progress:
            self.progress(attrs.asdict(record))

    def server_forces(self) -> bool:
        return bool(getattr(self.server, "forces_output_length", False))

    async def _scrape_loop(self, session, stop: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.w.serve.scrape_interval_s)
                return
            except TimeoutError:
                await self._scrape_once(session)

    async def _scrape_once(self, session) -> None:
        try:
            async with asyncio.timeout(5):
                values = await self.server.scrape(session)
        except Exception:
            return  # a metrics endpoint that fails is missing data, not a failed run
        if values:
            values = {redact(k, self.secrets): v for k, v in values.items()}  # label values can echo a key
            self.writer.write(ServerSample(t_ns=time.monotonic_ns(), source=self.server.metrics_source(),
                                           values=values))


class _LoopWatch:
    """Samples the event loop's wake-up lag and the process's CPU while a run is on (a ClientLoad record).

    Every stream and every due send shares this loop: a wake-up late by X ms means they all waited
    X ms, and chunks that arrived meanwhile are read together, as one burst.
    """

    def __init__(self, interval_s: float = LOOP_SAMPLE_S) -> None:
        self.interval_ns = int(interval_s * 1e9)
        self.lags_ms: list[float] = []
        self.stalls: list[list[float]] = []
        self.start_ns = time.monotonic_ns()
        self.cpu0 = time.process_time()
        self.end_ns, self.cpu1 = self.start_ns, self.cpu0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            before, cpu, queued = time.monotonic_ns(), time.process_time(), _runqueue_wait_ns()
            await asyncio.sleep(self.interval_ns / 1e9)
            now = time.monotonic_ns()
            lag = max(0, now - before - self.interval_ns) / 1e6
            self.lags_ms.append(lag)
            if lag > LAG_P99_LIMIT_MS and len(self.stalls) < 200:
                # What the loop's thread did meanwhile: CPU near the lag is a busy loop; time runnable but
                # waiting for a CPU near the lag is a starved one; neither, blocked in a system call.
                waited = _runqueue_wait_ns()
                self.stalls.append([round((before - self.start_ns) / 1e9, 3), round(lag, 2),
                                    round((time.process_time() - cpu) * 1e3, 2),
                                    None if waited is None or queued is None else round((waited - queued) / 1e6, 2)])
        self.end_ns, self.cpu1 = time.monotonic_ns(), time.process_time()

    def record(self, sent: int, itl_metric: str | None, prefix_metrics: tuple[str, str] | None = None,
               stream_prefix_share: float | None = None):
        from llmadapt.contract.records import ClientLoad
        from llmadapt.contract.stats import describe

        return ClientLoad(interval_ms=self.interval_ns / 1e6, loop_lag_ms=describe(self.lags_ms), stalls=self.stalls,
                          cpu_s=self.cpu1 - self.cpu0, wall_s=(self.end_ns - self.start_ns) / 1e9,
                          requests_sent=sent, engine_itl_metric=itl_metric, sched_autogroup=sched_autogroup(),
                          prefix_cache_metrics=list(prefix_metrics) if prefix_metrics else None,
                          stream_prefix_share=stream_prefix_share)


def prefix_share(plan: list[PlannedRequest]) -> float | None:
    """Of the measured requests' prompt tokens, the share that repeats the start of an earlier prompt of the plan
    (warm-up prompts count as earlier; the plan's order, which is the send order but for multi-turn conversations,
    whose turns interleave): the most a prefix cache could find. A token trie, one pass."""
    root: dict = {}
    found = total = 0
    for req in plan:
        ids = req.prompt_token_ids or []
        node, shared, matching = root, 0, True
        for token in ids:
            child = node.get(token)
            if child is None:
                matching, child = False, node.setdefault(token, {})
            elif matching:
                shared += 1
            node = child
        if not req.warmup:
            found, total = found + shared, total + len(ids)
    return found / total if total else None


def _runqueue_wait_ns() -> int | None:
    """Time this thread has spent runnable but waiting for a CPU (Linux schedstat), None where not available."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


async def nap_until(when_ns: int) -> None:
    """The event loop's timer: cheap, but it can wake a millisecond or more late (an idle vCPU's wake-up)."""
    remaining = (when_ns - time.monotonic_ns()) / 1e9
    if remaining > 0:
        await asyncio.sleep(remaining)


async def spin_until(due_ns: int) -> None:
    """Yield-spin: other callbacks run meanwhile, and the CPU stays awake for a sub-millisecond wake-up."""
    while time.monotonic_ns() < due_ns:
        await asyncio.sleep(0)
