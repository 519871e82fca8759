"""Serving: the request plan and the load generator that measures every engine the same way.

The generator runs in the orchestrator's process (no torch), on asyncio with one aiohttp
session. It owns the clock: it decides when each request is due (the arrival process), stamps
the actual send, every content-bearing chunk and the end on its monotonic clock, and writes one
``request`` record per request as it finishes, plus periodic ``server_sample`` records of the
engine's own metrics. Adapters only speak their engine's protocol (``Server.stream``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.contract import JsonlWriter, Request, ServerSample
from llmadapt.errors import LlmadaptError, Terminated
from llmadapt.spec import LengthSpec, Workload

LEAD_S = 0.05  # the schedule starts this long after planning, so the first requests are not born late
LAG_P99_LIMIT_MS = 10.0  # a run whose p99 send lag (or event-loop lag) exceeds this did not deliver its load
LOOP_SAMPLE_S = 0.01  # how often the event loop's wake-up lag is sampled during a run
BUNCHED_GAP = 0.1  # an inter-chunk gap below this fraction of the engine's inter-token latency is a bunched arrival
BUNCHED_LIMIT = 0.2  # a run with more bunched gaps than this share measured its own client, not the engine


@attrs.frozen
class PlannedRequest:
    index: int
    warmup: bool
    offset_s: float | None
    """Due time after the schedule's start (open loop); None in a closed loop."""
    prompt: str
    prompt_token_ids: list[int]
    input_tokens: int
    output_tokens: int
    ignore_eos: bool
    api: str


@attrs.frozen
class Chunk:
    """One piece of a streamed response as the adapter parsed it."""

    text: str = ""
    tokens: int | None = None
    """Tokens in this chunk when the protocol says; None when it does not."""
    finish_reason: str | None = None
    usage_output_tokens: int | None = None
    usage_input_tokens: int | None = None


class RequestFailed(Exception):
    """Raised by a Server's stream for a failed request; ``cause`` is counted in the summary."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class WrongServer(Exception):
    """Raised by ``Server.ready`` when what answers is not the engine the adapter speaks to (an HTML page, JSON
    of another shape): waiting will not change that, so the run fails at once with this one-line message."""


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


@attrs.define
class ServeContext:
    workload: Workload
    adapter: str
    run_dir: Path
    python: Path | None
    """Interpreter of the adapter's environment (to start the engine); None when attaching."""
    checkpoint: Path | None
    """The canonical checkpoint to serve; None when attaching to a server of another model."""
    port: int

    @property
    def base_url(self) -> str:
        return (self.workload.serve.url or f"http://127.0.0.1:{self.port}").rstrip("/")


def engine_popen_options() -> dict[str, Any]:
    """``subprocess.Popen`` options for an engine an adapter starts: its own process group (``stop`` signals the
    group), in this process's session, with no terminal input.

    Not a session of its own (``start_new_session``): with Linux's autogroup scheduling, on by default in most
    distributions, every session is a task group with an equal share of the CPUs. A busy engine in a session of
    its own left the light, bursty load generator waiting runnable for a CPU for up to 0.9 s at 30 req/s on 2
    cores, while the engine's group kept its share; in one session, each thread competes for itself and the
    client's wake-ups preempt (measured: docs/serving.md, "The client beside a busy engine").
    """
    import subprocess

    if sys.version_info >= (3, 11):
        return {"process_group": 0, "stdin": subprocess.DEVNULL}
    return {"preexec_fn": os.setpgrp, "stdin": subprocess.DEVNULL}


def sched_autogroup() -> bool | None:
    """Whether this Linux kernel groups scheduling by session (None: not Linux, or not known)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


# -- the plan -----------------------------------------------------------------------------------
def sample_lengths(spec: LengthSpec, n: int, rng: random.Random, dataset: list[int] | None = None) -> list[int]:
    def clip(x: float) -> int:
        return max(spec.low, min(spec.high, int(round(x))))

    if spec.dist == "fixed":
        return [spec.mean] * n
    if spec.dist == "uniform":
        return [rng.randint(spec.low, spec.high) for _ in range(n)]
    if spec.dist == "normal":
        return [clip(rng.gauss(spec.mean, spec.std)) for _ in range(n)]
    if not dataset:
        raise ValueError("length distribution 'dataset' needs lengths from data.path")
    return [clip(rng.choice(dataset)) for _ in range(n)]


def arrival_offsets(workload: Workload, n: int, rng: random.Random) -> list[float | None]:
    """Due times (s after start) for n requests; None for every request of a closed loop."""
    a = workload.serve.arrival
    if a.process == "closed":
        return [None] * n
    if a.process == "trace":
        rows = [json.loads(line) for line in Path(a.trace).read_text().splitlines() if line.strip()]
        return [float(r["send_time_s"]) for r in rows[:n]]
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if a.process == "constant":
            gap = 1.0 / a.rate
        elif a.process == "poisson":
            gap = rng.expovariate(a.rate)
        else:  # gamma: shape = burstiness, mean gap = 1 / rate
            gap = rng.gammavariate(a.burstiness, 1.0 / (a.rate * a.burstiness))
        t += gap
    return out


def word_pool(tokenizer) -> list[str]:
    """Words that are one token each with a leading space, so a prompt of n words is exactly n tokens."""
    pool = []
    for token in sorted(tokenizer.get_vocab()):
        if token.startswith("\u0120") and token[1:].isalpha() and len(token) > 2:
            word = " " + token[1:]
            if len(tokenizer.encode(word, add_special_tokens=False).ids) == 1:
                pool.append(word)
    if len(pool) < 8:
        raise ValueError(f"the tokenizer has only {len(pool)} single-token words: cannot build exact prompts")
    return pool


def plan_requests(workload: Workload, tokenizer) -> list[PlannedRequest]:
    """Every request of the run, warm-up first, from the workload's seed: the same stream for every engine."""
    s = workload.serve
    rng = random.Random(f"{workload.seed}:serve")
    total = s.warmup_requests + s.requests
    trace_rows = None
    if s.arrival.process == "trace":
        trace_rows = [json.loads(line) for line in Path(s.arrival.trace).read_text().splitlines() if line.strip()]
        total = min(total, len(trace_rows))
    dataset_in = dataset_out = None
    if workload.data.source == "jsonl" and workload.data.path:
        rows = [json.loads(line) for line in Path(workload.data.path).read_text().splitlines() if line.strip()]
        dataset_in = [len(tokenizer.encode(r[workload.data.prompt_field], add_special_tokens=False).ids) or 1
                      for r in rows]
        dataset_out = [len(tokenizer.encode(r[workload.data.answer_field], add_special_tokens=False).ids) or 1
                       for r in rows]
    inputs = sample_lengths(s.input_len, total, rng, dataset_in)
    outputs = sample_lengths(s.output_len, total, rng, dataset_out)
    if trace_rows:
        inputs = [int(r.get("input_len", i)) for r, i in zip(trace_rows, inputs)]
        outputs = [int(r.get("output_len", o)) for r, o in zip(trace_rows, outputs)]
    offsets = arrival_offsets(workload, total, rng)
    pool = word_pool(tokenizer)
    plan = []
    for i in range(total):
        prompt = "".join(rng.choice(pool) for _ in range(inputs[i]))
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        if len(ids) != inputs[i]:
            raise ValueError(f"prompt {i}: built {len(ids)} tokens, wanted {inputs[i]}")
        plan.append(PlannedRequest(index=i, warmup=i < s.warmup_requests, offset_s=offsets[i], prompt=prompt,
                                   prompt_token_ids=ids, input_tokens=len(ids), output_tokens=outputs[i],
                                   ignore_eos=s.ignore_eos, api=s.api))
    return plan


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
        scraper = asyncio.create_task(self._scrape_loop(session, stop))
        watch = _LoopWatch()
        watcher = asyncio.create_task(watch.run(stop))
        try:
            if s.arrival.process == "closed":
                await self._closed_loop(session)
            else:
                await self._open_loop(session)
        finally:
            stop.set()
            await scraper
            await watcher
            self.writer.write(watch.record(self.sent, self.server.itl_histogram))
            await self._scrape_once(session)

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
                await _nap_until(due - spin_ns)
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

    async def _one(self, session, req: PlannedRequest, scheduled_ns: int, sem) -> None:
        chunk_ns: list[int] = []
        chunk_tokens: list[int | None] = []
        first = finish = usage_out = usage_in = None
        status, error, cause = "ok", None, None
        sent = None
        await _spin_until(scheduled_ns)
        if sem:
            await sem.acquire()
        try:
            if not self.server.alive():
                raise RequestFailed("engine_dead", "the engine had exited before this request was sent")
            sent = time.monotonic_ns()
            self.sent += 1
            async with asyncio.timeout(self.w.serve.request_timeout_s):
                async for chunk in self.server.stream(session, req):
                    now = time.monotonic_ns()
                    check_chunk(chunk)
                    if chunk.text or chunk.tokens:
                        first = first or now
                        chunk_ns.append(now)
                        chunk_tokens.append(chunk.tokens)
                    finish = chunk.finish_reason or finish
                    usage_out = chunk.usage_output_tokens if chunk.usage_output_tokens is not None else usage_out
                    usage_in = chunk.usage_input_tokens if chunk.usage_input_tokens is not None else usage_in
            if first is None:
                raise RequestFailed("malformed", "the stream ended without any content")
        except TimeoutError:
            status, cause, error = "timeout", "timeout", f"no complete response within {self.w.serve.request_timeout_s:g} s"
        except RequestFailed as exc:
            status, cause, error = "error", exc.cause, str(exc)
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

    def record(self, sent: int, itl_metric: str | None):
        from llmadapt.contract import ClientLoad
        from llmadapt.stats import describe

        return ClientLoad(interval_ms=self.interval_ns / 1e6, loop_lag_ms=describe(self.lags_ms), stalls=self.stalls,
                          cpu_s=self.cpu1 - self.cpu0, wall_s=(self.end_ns - self.start_ns) / 1e9,
                          requests_sent=sent, engine_itl_metric=itl_metric, sched_autogroup=sched_autogroup())


def _runqueue_wait_ns() -> int | None:
    """Time this thread has spent runnable but waiting for a CPU (Linux schedstat), None where not available."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


async def _nap_until(when_ns: int) -> None:
    """The event loop's timer: cheap, but it can wake a millisecond or more late (an idle vCPU's wake-up)."""
    remaining = (when_ns - time.monotonic_ns()) / 1e9
    if remaining > 0:
        await asyncio.sleep(remaining)


async def _spin_until(due_ns: int) -> None:
    """Yield-spin: other callbacks run meanwhile, and the CPU stays awake for a sub-millisecond wake-up."""
    while time.monotonic_ns() < due_ns:
        await asyncio.sleep(0)


# -- statistics ---------------------------------------------------------------------------------
def serving_stats(records: list[dict[str, Any]], workload: Workload):
    """Client-side serving figures from request records (measured requests only)."""
    from llmadapt.contract import ServingStats, Stats
    from llmadapt.stats import describe

    reqs = [r for r in records if r["type"] == "request" and not r["warmup"]]
    ok = [r for r in reqs if r["status"] == "ok"]
    failed = [r for r in reqs if r["status"] != "ok"]
    causes: dict[str, int] = {}
    for r in failed:
        causes[r["error_cause"] or r["status"]] = causes.get(r["error_cause"] or r["status"], 0) + 1
    sent = [r for r in reqs if r["sent_ns"] is not None]
    if sent:
        start = min(r["sent_ns"] for r in sent)
        end = max(r["end_ns"] for r in sent if r["end_ns"] is not None)
        duration = max((end - start) / 1e9, 1e-9)
    else:
        duration = 0.0
    ms = 1e-6
    ttft = [(r["first_token_ns"] - r["sent_ns"]) * ms for r in ok]
    e2el = [(r["end_ns"] - r["sent_ns"]) * ms for r in ok]
    tpot = [((r["end_ns"] - r["first_token_ns"]) * ms) / (r["output_tokens"] - 1)
            for r in ok if r["output_tokens"] and r["output_tokens"] > 1]
    itl = [(b - a) * ms for r in ok for a, b in zip(r["chunk_ns"], r["chunk_ns"][1:])]
    lags = [(r["sent_ns"] - r["scheduled_ns"]) * ms for r in sent]
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    in_tokens = sum(r["input_tokens"] for r in ok)
    slo = workload.serve.slo
    goodput = None
    if any(v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms)) and duration:
        def meets(r) -> bool:
            t = (r["first_token_ns"] - r["sent_ns"]) * ms
            e = (r["end_ns"] - r["sent_ns"]) * ms
            p = ((r["end_ns"] - r["first_token_ns"]) * ms) / (r["output_tokens"] - 1) \
                if r["output_tokens"] and r["output_tokens"] > 1 else 0.0
            return ((slo.ttft_ms is None or t <= slo.ttft_ms) and (slo.tpot_ms is None or p <= slo.tpot_ms)
                    and (slo.e2el_ms is None or e <= slo.e2el_ms))
        goodput = sum(1 for r in ok if meets(r)) / duration
    lag_stats = describe(lags)
    client = next((r for r in reversed(records) if r["type"] == "client_load"), None)
    loop = Stats(**client["loop_lag_ms"]) if client and client["loop_lag_ms"] else None
    cpu_s = client["cpu_s"] if client else None
    cpu_per_request = cpu_s * 1e3 / client["requests_sent"] if client and client["requests_sent"] else None
    engine_itl = _engine_mean_ms(records, client["engine_itl_metric"]) if client else None
    bunched = sum(1 for gap in itl if gap < BUNCHED_GAP * engine_itl) / len(itl) if engine_itl and itl else None

    problems = []
    if workload.serve.arrival.process != "closed" and lag_stats and lag_stats.p99 > LAG_P99_LIMIT_MS:
        problems.append(f"the generator fell behind its schedule (p99 send lag {lag_stats.p99:.1f} ms > "
                        f"{LAG_P99_LIMIT_MS:.0f} ms): the arrival process asked for was not delivered")
    if loop and loop.p99 > LAG_P99_LIMIT_MS:
        problems.append(f"the client's event loop stalled (loop lag p99 {loop.p99:.1f} ms, max {loop.max:.0f} ms > "
                        f"{LAG_P99_LIMIT_MS:.0f} ms): open streams were not read meanwhile" + _stall_cause(client))
    if bunched is not None and bunched > BUNCHED_LIMIT:
        problems.append(f"{bunched:.0%} of inter-chunk gaps were under a tenth of the engine's own inter-token "
                        f"latency ({engine_itl:.2f} ms): chunks reached the client in bursts")
    if problems:
        cpu = f" (client CPU {cpu_per_request:.2f} ms per request)" if cpu_per_request is not None else ""
        valid, why = False, "invalid: " + "; ".join(problems) + cpu
    elif workload.serve.arrival.process == "closed":
        valid, why = True, "closed loop: requests are sent as slots free up (no schedule to fall behind)"
    else:
        valid, why = True, "the generator met its schedule (p99 send lag within %.0f ms)" % LAG_P99_LIMIT_MS
    if not reqs:
        valid, why = False, "no measured request was sent"
    return ServingStats(
        completed=len(ok), failed=len(failed), failures_by_cause=causes, duration_s=duration,
        request_throughput=len(ok) / duration if duration else 0.0,
        output_throughput=out_tokens / duration if duration else 0.0,
        total_token_throughput=(in_tokens + out_tokens) / duration if duration else 0.0,
        request_goodput=goodput, ttft_ms=describe(ttft), tpot_ms=describe(tpot), itl_ms=describe(itl),
        e2el_ms=describe(e2el), send_lag_ms=lag_stats, valid=valid, validity=why,
        output_length_forced=all(r["output_forced"] for r in reqs) if reqs else False,
        total_input_tokens=in_tokens, total_output_tokens=out_tokens, loop_lag_ms=loop, client_cpu_s=cpu_s,
        client_cpu_ms_per_request=cpu_per_request, engine_itl_ms=engine_itl, bunched_share=bunched,
    )


def _stall_cause(client: dict[str, Any]) -> str:
    """What the loop's thread did during its stalls, when one thing explains most of them."""
    stalls = client.get("stalls") or []
    lagged = sum(s[1] for s in stalls)
    queued = sum(s[3] for s in stalls if len(s) > 3 and s[3] is not None)
    busy = sum(s[2] for s in stalls)
    if not lagged:
        return ""
    if queued > lagged / 2:
        hint = (" (Linux autogroup is on: an engine started in another session, e.g. another terminal, has a CPU "
                "share equal to this whole session's; start it from this one, see docs/serving.md)"
                if client.get("sched_autogroup") else "")
        return f"; it waited runnable for a CPU {queued:.0f} of those {lagged:.0f} ms: starved by other processes{hint}"
    if busy > lagged / 2:
        return f"; it was busy {busy:.0f} of those {lagged:.0f} ms: work on the event loop"
    return f"; it neither ran nor waited for a CPU most of those {lagged:.0f} ms: blocked in a system call"


def _engine_mean_ms(records: list[dict[str, Any]], histogram: str | None) -> float | None:
    """The engine's mean of a Prometheus histogram (seconds) between its first and last sample, in ms."""
    if not histogram:
        return None
    samples = [r["values"] for r in records if r["type"] == "server_sample"]

    def total(values: dict[str, float], suffix: str) -> float:
        return sum(v for k, v in values.items() if k.partition("{")[0] == histogram + suffix)

    if len(samples) < 2:
        return None
    count = total(samples[-1], "_count") - total(samples[0], "_count")
    return (total(samples[-1], "_sum") - total(samples[0], "_sum")) / count * 1e3 if count > 0 else None


def vllm_bench_keys(summary: dict[str, Any]) -> dict[str, Any]:
    """The serving summary under `vllm bench serve`'s result keys, for tools that read those."""
    s = summary["serving"]
    out = {
        "completed": s["completed"], "failed": s["failed"], "duration": s["duration_s"],
        "request_throughput": s["request_throughput"], "request_goodput": s["request_goodput"],
        "output_throughput": s["output_throughput"], "total_token_throughput": s["total_token_throughput"],
        "total_input_tokens": s["total_input_tokens"], "total_output_tokens": s["total_output_tokens"],
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        st = s[f"{metric}_ms"]
        for key, field in (("mean", "mean"), ("median", "p50"), ("std", "std"), ("p50", "p50"), ("p90", "p90"),
                           ("p99", "p99")):
            out[f"{key}_{metric}_ms"] = st[field] if st else math.nan
    return out


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
    import socket

    from llmadapt.contract import Failure, Header
    from llmadapt.launch import free_port
    from llmadapt.runtime import _now

    attach = workload.serve.url is not None
    checkpoint = None
    if not attach:
        from llmadapt.prepare import ensure_checkpoint

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
            wall, mono = time.time_ns(), time.monotonic_ns()
            writer.write(Header(
                run_id=run_id, rank=0, local_rank=0, world_size=1, node=socket.gethostname(), role="serve",
                adapter=info.name, adapter_version=info.version, framework=info.framework,
                framework_version=redact(server.engine_version(), secrets), launcher=launcher,
                workload_hash=workload.content_hash, problem_hash=workload.problem_hash, workload=workload.to_dict(),
                checkpoint_hash=_recorded_hash(checkpoint), device=None, software=_client_software(),
                patches=list(server.patches), start_time=_now(), wall_anchor_ns=wall, mono_anchor_ns=mono,
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


def _client_software() -> dict[str, str]:
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("llmadapt", "aiohttp", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out
