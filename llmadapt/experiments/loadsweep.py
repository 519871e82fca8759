"""Serving at several loads against one engine: load sweeps and SLA searches (docs/serving.md).

A load is a request rate (the workload's open-loop arrival process, Poisson by default) or a concurrency (a closed
loop). The engine starts once (or is attached to); every load point is a serving run of its own, a run folder that
show, compare, the run store and the report read, with a request stream of its own (``serve.stream``): the same
point gets the same stream on every engine, and no engine's prefix cache sees a prompt twice.

The SLA search finds the highest load whose points meet every objective (e.g. ``ttft_p99_ms<=500``), the way
AIPerf's recipes do: an exponential probe (start, x2, x4 ... until a point fails), then bisection between the
highest passing and lowest failing load down to a resolution, then repeats at the answer (a repeat that fails
moves the bracket down). Beside the bracket it fits the objectives' margin against load with isotonic
(non-increasing) regression, which gives a boundary estimate robust to one noisy probe and says whether the
boundary is smooth or a cliff. Every probe is in the search's history (sla.json), in order.

Both resume: run the same command again with the same ``out`` and an interrupted series there (its file not
``"finished"``) of the same engine, adapter version, workload, machine and kind of load goes on in its folder: the
points that ended in it are not run again (a sweep runs the loads missing; a search is replayed through them and
continues where it stopped). An interrupted series of another workload is left as it is, and said so.

It is over 400 lines because both ways of choosing load points (a sweep, the search) share one way of running them
against one engine and of judging them (objectives, margins, the isotonic fit): one file to read for serving at
several loads.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.contract.launch import new_run_id
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.launch.serve import LoadPoint, check_reachable, engine_launch, new_point, serve_points
from llmadapt.contract.readback import RunResult
from llmadapt.spec import Workload

METRICS = ("ttft", "tpot", "itl", "e2el")
QUANTILES = ("p50", "p90", "p99", "mean")
CLIFF = 5.0
"""A boundary is a cliff when the fitted margin falls faster than this per unit of ln(load) across the bracket:
beyond 5% of the limit for a 1% increase of load (a latency that explodes past saturation), else smooth."""
FAILED_MARGIN = -1.0
"""The margin of a point whose requests failed, or whose load generator fell behind: it meets no objective."""


@attrs.frozen
class Objective:
    """One service-level objective on a percentile of a serving latency: ``ttft_p99_ms<=500``."""

    metric: str
    quantile: str
    limit_ms: float

    @classmethod
    def parse(cls, text: str) -> Objective:
        m = re.fullmatch(r"\s*([a-z0-9]+)_([a-z0-9]+)_ms\s*<=?\s*([0-9.eE+-]+)\s*", text)
        if not m:
            raise LlmadaptError(f"SLO {text!r}: write METRIC_QUANTILE_ms<=LIMIT, e.g. ttft_p99_ms<=500 (metrics: "
                                f"{', '.join(METRICS)}; quantiles: {', '.join(QUANTILES)})")
        metric, quantile, limit = m.group(1), m.group(2), m.group(3)
        if metric not in METRICS:
            raise LlmadaptError(f"SLO {text!r}: unknown metric {metric!r}; known: {', '.join(METRICS)} (AIPerf's "
                                "ITL is vLLM's TPOT: see docs/serving.md)")
        if quantile not in QUANTILES:
            raise LlmadaptError(f"SLO {text!r}: unknown quantile {quantile!r}; known: {', '.join(QUANTILES)}")
        try:
            value = float(limit)
        except ValueError:
            raise LlmadaptError(f"SLO {text!r}: the limit {limit!r} is not a number") from None
        if not value > 0 or math.isinf(value):
            raise LlmadaptError(f"SLO {text!r}: the limit must be a positive number of milliseconds")
        return cls(metric, quantile, value)

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.quantile}_ms"

    def __str__(self) -> str:
        return f"{self.name}<={self.limit_ms:g}"


@attrs.frozen
class Load:
    """How hard a point pushes: ``rate`` requests/s (open loop) or ``concurrency`` requests in flight."""

    kind: str
    value: float

    def apply(self, workload: Workload, stream: int) -> Workload:
        if self.kind == "rate":
            return workload.with_overrides([f"serve.arrival.rate={self.value!r}", f"serve.stream={stream}"],
                                           source="sweep")
        return workload.with_overrides(["serve.arrival.process=closed", f"serve.arrival.concurrency={int(self.value)}",
                                        f"serve.stream={stream}"], source="sweep")

    def __str__(self) -> str:
        return f"{self.value:g} req/s" if self.kind == "rate" else f"concurrency {int(self.value)}"


@attrs.frozen
class Loads:
    """The loads of a sweep: ``values`` in order, or a geometric series from values[0] by ``factor`` up to
    saturation or ``maximum``."""

    kind: str
    values: list[float]
    factor: float | None = None
    maximum: float | None = None


def parse_loads(text: str, kind: str) -> Loads:
    """``1,2,4,8`` (increasing) or ``geometric:START:FACTOR[:MAX]``; one line naming what is wrong."""
    what = "--rates" if kind == "rate" else "--concurrencies"
    whole = kind == "concurrency"
    if text.startswith("geometric:"):
        parts = text.split(":")[1:]
        try:
            start, factor = float(parts[0]), float(parts[1])
            top = float(parts[2]) if len(parts) > 2 else None
        except (ValueError, IndexError):
            raise LlmadaptError(f"{what} {text!r}: write geometric:START:FACTOR or geometric:START:FACTOR:MAX") from None
        if not start > 0 or not factor > 1 or (top is not None and top < start) or (whole and start != int(start)):
            raise LlmadaptError(f"{what} {text!r}: needs START > 0{' (whole)' if whole else ''}, FACTOR > 1 and "
                                "MAX >= START")
        return Loads(kind, [start], factor, top)
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise LlmadaptError(f"{what} {text!r}: a comma-separated list of numbers, e.g. 1,2,4,8") from None
    if not values:
        raise LlmadaptError(f"{what} is empty: give at least one load")
    if any(not v > 0 or math.isinf(v) for v in values):
        raise LlmadaptError(f"{what} {text!r}: every load must be a number > 0")
    if any(b <= a for a, b in zip(values, values[1:])):
        raise LlmadaptError(f"{what} {text!r}: the loads must increase")
    if whole and any(v != int(v) for v in values):
        raise LlmadaptError(f"{what} {text!r}: concurrencies are whole numbers")
    return Loads(kind, values)


def stream_for(load: Load, repeat: int) -> int:
    """The request stream of a load point: fixed by the load and the repeat, so every engine gets the same."""
    return zlib.crc32(f"{load.kind}:{load.value:.6g}:{repeat}".encode()) % (2**31 - 1) + 1


# -- figures of one point ----------------------------------------------------------------------------------------
def point_figures(result: RunResult) -> dict[str, Any]:
    """What a load point measured: achieved throughput, latency percentiles, goodput, send lag, validity."""
    s = result.summary
    v = s.serving
    out: dict[str, Any] = {"run_dir": str(result.run_dir), "status": s.status}
    if v is None:
        return out
    out.update(request_throughput=v.request_throughput, output_throughput=v.output_throughput,
               goodput=v.request_goodput, completed=v.completed, failed=v.failed,
               truncated=v.failures_by_cause.get("truncated", 0), valid=v.valid, validity=v.validity,
               send_lag_p99_ms=v.send_lag_ms.p99 if v.send_lag_ms else None)
    for metric in METRICS:
        st = getattr(v, f"{metric}_ms")
        for q in QUANTILES:
            out[f"{metric}_{q}_ms"] = getattr(st, q) if st else None
    return out


def margin(figures: dict[str, Any], objectives: list[Objective]) -> tuple[float, str]:
    """The smallest (limit - value) / limit over the objectives (>= 0: all met) and what decided it."""
    if figures.get("status") != "ok" or figures.get("failed") or not figures.get("valid", False):
        failed, total = figures.get("failed"), (figures.get("completed") or 0) + (figures.get("failed") or 0)
        why = (f"{failed} of {total} requests failed" + (f" ({figures['truncated']} truncated)"
                                                         if figures.get("truncated") else "") if failed
               else "the load generator fell behind its schedule" if figures.get("status") == "ok"
               else "the run failed")
        return FAILED_MARGIN, why
    worst, why = math.inf, ""
    for o in objectives:
        value = figures.get(o.name)
        if value is None:
            return FAILED_MARGIN, f"no {o.name} measured"
        m = (o.limit_ms - value) / o.limit_ms
        if m < worst:
            worst, why = m, f"{o.name} {value:.1f} (limit {o.limit_ms:g})"
    return worst, why


def client_behind(figures: dict[str, Any]) -> bool:
    """A point that measured the client, not the engine: every request answered, but the load generator did not
    deliver the load on time (open loop: sends late; closed loop: its event loop stalled)."""
    return figures.get("status") == "ok" and not figures.get("failed") and figures.get("valid") is False \
        and str(figures.get("validity", "invalid:")).startswith("invalid:")


BEHIND_REMEDY = ("this machine could not run the load generator on time, so the point measures the client, not "
                 "the engine: run where the client has CPU to spare (a quieter machine; no other work on its cores; "
                 "the engine started from the same terminal session, see docs/serving.md), or set "
                 "serve.send_spin_ms=0 where the engine shares the client's CPUs")


def isotonic_decreasing(xs: list[float], ys: list[float]) -> list[float]:
    """The non-increasing function of x closest to the points in squared error (pool adjacent violators), at each
    point's x: points at one x (repeats) get one value."""
    pooled: dict[float, list[float]] = {}
    for x, y in zip(xs, ys):
        pooled.setdefault(x, []).append(y)
    blocks: list[list[Any]] = []  # [mean, weight, xs]
    for x in sorted(pooled):
        blocks.append([sum(pooled[x]) / len(pooled[x]), len(pooled[x]), [x]])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m2, w2, x2), (m1, w1, x1) = blocks[-2], blocks[-1]
            blocks[-2:] = [[(m2 * w2 + m1 * w1) / (w2 + w1), w2 + w1, x2 + x1]]
    value = {x: m for m, _, members in blocks for x in members}
    return [value[x] for x in xs]


# -- running points, and resuming them ---------------------------------------------------------------------------
def _engine_dir(out: Path, adapter: str, what: str) -> Path:
    folder = Path(out) / new_run_id(adapter, what)
    folder.mkdir(parents=True, exist_ok=False)
    return folder


@attrs.frozen
class _Recorded:
    """A point that ended in an interrupted series being resumed: its figures, as that series wrote them."""

    figures: dict[str, Any]


def _figures(result) -> dict[str, Any]:
    return dict(result.figures) if isinstance(result, _Recorded) else point_figures(result)


def _identity(workload: Workload, info, kind: str) -> dict[str, Any]:
    """What a series must share with an interrupted one to resume it (its file holds these keys)."""
    from llmadapt.host import node_name

    return {"adapter": info.name, "adapter_version": getattr(info, "version", None),
            "workload_hash": workload.content_hash, "machine": node_name(), "kind": kind}


_DIFFERS = {"adapter_version": "adapter version", "workload_hash": "workload", "machine": "machine",
            "kind": "kind of load"}


def _note(progress, text: str) -> None:
    if progress:
        progress({"type": "note", "text": text})


def _resumable(out: Path, what: str, name: str, identity: dict[str, Any],
               progress) -> tuple[Path | None, dict[tuple[float, int], dict[str, Any]]]:
    """The newest interrupted series in OUT of this identity (folder, its points that ended by (load, repeat)), or
    (None, {}). An interrupted one of another workload (version, machine, kind) is left as it is, and said so."""
    for path in sorted(Path(out).glob(f"*-{identity['adapter']}-{what}-*/{name}"), reverse=True):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("state") not in ("running", "interrupted") \
                or data.get("adapter") != identity["adapter"]:  # the glob also finds a tgi-openai's for openai
            continue
        differs = [_DIFFERS.get(k, k) for k, v in identity.items() if data.get(k) != v]
        if differs:
            _note(progress, f"{path}: an interrupted {what} of another {', '.join(differs)}: left as it is")
            continue
        points = data.get("points") or [{**p.get("figures", {}), "load": p.get("load"), "repeat": p.get("repeat")}
                                        for p in data.get("probes", [])]
        recorded = {(float(p["load"]), int(p["repeat"])): {k: v for k, v in p.items()
                                                           if k not in ("load", "kind", "repeat")}
                    for p in points if p.get("status") in ("ok", "degraded")
                    and (not p.get("run_dir") or Path(p["run_dir"]).is_dir())}
        log = RunDir(path.parent).engine_log
        if log.is_file():  # the engine started again writes a log of its own
            log.rename(next(log.with_name(f"{log.name}.{i}") for i in range(1, 10**6)
                            if not log.with_name(f"{log.name}.{i}").exists()))
        _note(progress, f"resuming {path}: {len(recorded)} point(s) that ended there are kept, not run again")
        return path.parent, recorded
    return None, {}


class _Replay:
    """A ``choose`` that gives the points an interrupted series measured (``recorded``) to ``choose`` as results,
    without running them, and passes on only the points still to run."""

    def __init__(self, choose: Callable[[list[Any]], tuple[Load, int] | None],
                 recorded: dict[tuple[float, int], dict[str, Any]]) -> None:
        self.choose, self.recorded = choose, dict(recorded)
        self.given: list[_Recorded | None] = []  # per pick in order: its record, or None (it runs)

    def merged(self, ran: list[Any]) -> list[Any]:
        """Every point's result so far, in the order chosen: the recorded ones and those run."""
        out, left = [], iter(ran)
        for record in self.given:
            result = record if record is not None else next(left, None)
            if result is None:
                break
            out.append(result)
        return out

    def __call__(self, ran: list[Any]) -> tuple[Load, int] | None:
        while True:
            pick = self.choose(self.merged(ran))
            if pick is None:
                return None
            figures = self.recorded.pop((pick[0].value, pick[1]), None)
            self.given.append(None if figures is None else _Recorded(figures))
            if figures is None:
                return pick


def _run_points(workload: Workload, info, out: Path, engine_dir: Path, timeout: float | None, progress,
                choose: Callable[[list[RunResult]], tuple[Load, int] | None]) -> list[tuple[Load, int, RunResult]]:
    """Run the points ``choose`` picks (given the results so far) against one engine; (load, repeat, result)."""
    chosen: list[tuple[Load, int]] = []

    def next_point(done: list[RunResult]) -> LoadPoint | None:
        pick = choose(done)
        if pick is None:
            return None
        chosen.append(pick)
        load, repeat = pick
        return new_point(load.apply(workload, stream_for(load, repeat)), info, out, None, progress)

    results = serve_points(workload, info, engine_dir, timeout, progress, next_point)
    return [(load, repeat, r) for (load, repeat), r in zip(chosen, results)]


@attrs.frozen
class SweepPoint:
    load: Load
    repeat: int
    figures: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"load": self.load.value, "kind": self.load.kind, "repeat": self.repeat, **self.figures}


def load_sweep(workload: Workload, info, loads: Loads, out: Path, *, repeat: int = 1, timeout: float | None = None,
               progress=None) -> tuple[Path, list[SweepPoint]]:
    """Every load in order, ``repeat`` times each, against one engine; a geometric series continues until the
    engine saturates (achieved request rate below 90% of the offered rate; or, for concurrencies, under 5% more
    throughput than the best lower one) or passes its maximum. Writes load-sweep.json in the sweep's folder
    (which also holds the engine's log) and returns the folder and the points. An interrupted sweep of the same
    identity in ``out`` is resumed (the module's docstring)."""
    identity = _identity(workload, info, loads.kind)
    engine_dir, recorded = _resumable(out, "load-sweep", "load-sweep.json", identity, progress)
    engine_dir = engine_dir or _engine_dir(out, info.name, "load-sweep")
    series = [Load(loads.kind, v) for v in loads.values]
    picks: list[tuple[Load, int]] = []

    def save(done: list[RunResult], state: str) -> None:
        points = [SweepPoint(load, rep, _figures(r)) for (load, rep), r in zip(picks, done)]
        _write(engine_dir / "load-sweep.json", {**identity, "state": state, "points": [p.to_dict() for p in points]})

    def choose(done: list[RunResult]) -> tuple[Load, int] | None:
        save(done, "running")  # as each point ends: an interrupted sweep leaves what it measured
        if loads.factor is not None and done and picks[-1][1] == repeat - 1:  # a load's last repeat is in
            so_far = [SweepPoint(load, rep, _figures(r)) for (load, rep), r in zip(picks, done)]
            if _saturated(so_far, loads.kind):
                return None
        index, rep = divmod(len(done), repeat)
        if index == len(series):
            if loads.factor is None:
                return None
            step = series[-1].value * loads.factor
            if loads.kind == "concurrency":
                step = max(series[-1].value + 1, round(step))
            if loads.maximum is not None and step > loads.maximum:
                return None
            series.append(Load(loads.kind, step))
        picks.append((series[index], rep))
        return picks[-1]

    replay = _Replay(choose, recorded)
    try:
        ran = _run_points(workload, info, out, engine_dir, timeout, progress, replay)
    except KeyboardInterrupt as exc:  # the points that ended are in the file; the interrupted one is in its folder
        _mark_interrupted(engine_dir / "load-sweep.json", exc, progress)
        raise
    points = [SweepPoint(load, rep, _figures(r)) for (load, rep), r in zip(picks, replay.merged([r for *_, r in ran]))]
    _write(engine_dir / "load-sweep.json", {**identity, "state": "finished", "points": [p.to_dict() for p in points]})
    return engine_dir, points


def _mark_interrupted(path: Path, exc: KeyboardInterrupt, progress) -> None:
    """The file written as each point ended, marked as a partial result of an interrupted series."""
    from llmadapt.launch.supervise import interrupt_text

    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        data = {}
    data.update(state="interrupted", note=f"{interrupt_text(exc)}: the points that ended before it are here; the "
                                          "interrupted one has its partial summary in its own run folder; the same "
                                          "command with the same --out resumes it")
    _write(path, data)
    _note(progress, f"{interrupt_text(exc)}: what ended is in {path}; run the same command again (same --out) to "
                    "resume it")


def _saturated(points: list[SweepPoint], kind: str) -> bool:
    last = points[-1]
    achieved = last.figures.get("request_throughput")
    if achieved is None or last.figures.get("status") != "ok":
        return True
    if kind == "rate":
        return achieved < 0.9 * last.load.value
    earlier = [p for p in points if p.load.value < last.load.value and p.figures.get("request_throughput")]
    return bool(earlier) and achieved < 1.05 * max(p.figures["request_throughput"] for p in earlier)


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


# -- the SLA search ----------------------------------------------------------------------------------------------
@attrs.frozen
class Probe:
    """One point the search ran, in order: its load, repeat, phase, figures, margin and whether it passed."""

    load: float
    repeat: int
    phase: str
    """'probe' (exponential, up or down), 'bisect', or 'repeat' (at the answer)."""
    figures: dict[str, Any]
    margin: float
    why: str
    passed: bool


@attrs.frozen
class SlaResult:
    adapter: str
    kind: str
    objectives: list[str]
    capacity: float | None
    """The highest load all of whose probes met every objective (None: not even the lowest probed)."""
    above: float | None
    """The lowest load above it that failed (None: the search reached its maximum still passing)."""
    boundary: float | None
    """Where the isotonic fit of the margin crosses zero, interpolated in log(load)."""
    shape: str | None
    """'smooth' or 'cliff' (CLIFF), judged across the final bracket; None without a bracket."""
    passes_at_capacity: str
    probes: list[Probe]
    scan_probes: int | None
    """Probes a plain scan at the same resolution would spend to bracket the same answer (repeats included)."""
    note: str = ""


def sla_search(workload: Workload, info, objectives: list[Objective], kind: str, out: Path, *, start: float,
               maximum: float, resolution: float = 0.1, repeats: int = 2, max_probes: int = 40,
               timeout: float | None = None, progress=None, floor: bool = False) -> tuple[Path, SlaResult]:
    """The highest load meeting every objective, against one engine (see the module's docstring). Writes
    sla.json (the objectives, every probe in order, the answer) after every probe; returns its folder and the
    result. An interrupted search of the same identity in ``out`` is resumed (the module's docstring).
    ``floor``: only a capacity of ``start`` or more is sought (the load another configuration already meets): a
    first probe that fails ends the search, with no capacity, instead of halving down."""
    identity = _identity(workload, info, kind)
    maximum, capped = within_requests(workload, kind, maximum)
    engine_dir, recorded = _resumable(out, "sla", "sla.json", identity, progress)
    engine_dir = engine_dir or _engine_dir(out, info.name, "sla")
    probes: list[Probe] = []
    picks: list[tuple[float, int, str]] = []
    state: dict[str, Any] = {"lo": None, "hi": None, "phase": "probe", "note": ""}

    def passed_everywhere(load: float) -> bool:
        mine = [p for p in probes if p.load == load]
        return bool(mine) and all(p.passed for p in mine)

    def pick(load: float, phase: str) -> tuple[Load, int]:
        repeat = sum(1 for p in picks if p[0] == load)
        picks.append((load, repeat, phase))
        return Load(kind, load), repeat

    def take(done: list[RunResult]) -> None:
        for (load, repeat, phase), r in zip(picks[len(probes):], done[len(probes):]):
            figures = _figures(r)
            m, why = margin(figures, objectives)
            probes.append(Probe(load, repeat, phase, figures, m, why, m >= 0))

    def choose(done: list[RunResult]) -> tuple[Load, int] | None:
        take(done)
        following = decide()
        state["finished"] = following is None
        return following

    def decide() -> tuple[Load, int] | None:
        result = _sla_result(info.name, kind, objectives, probes, state, start, resolution, repeats)
        _write(engine_dir / "sla.json", {**attrs.asdict(result), **identity, "state": "running"})
        if not probes:
            return pick(start, "probe")
        if len(probes) == 1 and client_behind(probes[0].figures):  # nothing was measured: a lower load says no more
            state["note"] = (f"no capacity found because the first probe ({Load(kind, start)}) is invalid, not "
                             f"failed: the load generator fell behind ({probes[0].figures.get('validity', '')}); "
                             + BEHIND_REMEDY)
            return None
        if len(probes) >= max_probes:
            state["note"] = f"stopped after {max_probes} probes"
            return None
        last = probes[-1]
        lo, hi = state["lo"], state["hi"]
        if last.phase == "repeat" and not last.passed:  # the answer did not hold: the bracket moves down
            hi = last.load
            lo = max((p.load for p in probes if p.load < hi and passed_everywhere(p.load)), default=None)
        elif last.phase != "repeat":
            if last.passed:
                lo = last.load if lo is None else max(lo, last.load)
            else:
                hi = last.load if hi is None else min(hi, last.load)
        state["lo"], state["hi"] = lo, hi
        if lo is None and floor:  # below the load to beat: how far below is not asked
            state["note"] = f"fails at {Load(kind, start)}, the load to beat: lower loads not searched"
            return None
        if lo is None:  # nothing passes yet: halve
            lower = _halved(kind, start, min(p.load for p in probes))
            if lower is None:
                behind = sum(client_behind(p.figures) for p in probes)
                state["note"] = "no load tried meets the objectives" + (
                    f"; {behind} of the {len(probes)} probes were invalid (the load generator fell behind): "
                    + BEHIND_REMEDY if behind else "")
                return None
            return pick(lower, "probe")
        if hi is None:  # everything passes yet: double, up to the maximum
            if lo >= maximum:
                return _repeat_or_stop(lo)
            return pick(min(maximum, lo * 2), "probe")
        if not (hi - lo <= 1 if kind == "concurrency" else hi / lo - 1 <= resolution):  # not resolved yet: bisect
            return pick(_midpoint(kind, lo, hi), "bisect")
        return _repeat_or_stop(lo)

    def _repeat_or_stop(lo: float) -> tuple[Load, int] | None:
        if sum(1 for p in probes if p.load == lo) < repeats:
            return pick(lo, "repeat")
        return None

    replay = _Replay(choose, recorded)
    try:
        ran = _run_points(workload, info, out, engine_dir, timeout, progress, replay)
    except KeyboardInterrupt as exc:  # sla.json holds every probe that ended (written as each did)
        _mark_interrupted(engine_dir / "sla.json", exc, progress)
        raise
    take(replay.merged([r for *_, r in ran]))  # a series the engine ended early: its last point never went to choose
    if not state.get("finished"):
        state["note"] = "the engine stopped the search early (its start failed, or it died: see the last run)"
    if capped and state["hi"] is None and state["lo"] == maximum:
        state["note"] = "; ".join(filter(None, [state["note"], CAPPED.format(maximum)]))
    result = _sla_result(info.name, kind, objectives, probes, state, start, resolution, repeats)
    _write(engine_dir / "sla.json", {**attrs.asdict(result), **identity, "state": "finished"})
    return engine_dir, result


CAPPED = ("met the objectives with all {:g} requests of a probe in flight at once: a higher concurrency is the same "
          "load (raise serve.requests to search above it)")


def within_requests(workload: Workload, kind: str, maximum: float) -> tuple[float, bool]:
    """(the search's maximum, whether it was lowered): more users in a closed loop than a probe's requests is the same
    load as one user per request (all in flight at once), so a search over concurrency goes no higher (probes above
    it would tell apart only noise)."""
    capped = kind == "concurrency" and maximum > workload.serve.requests
    return (float(workload.serve.requests) if capped else maximum), capped


def _halved(kind: str, start: float, lowest: float) -> float | None:
    """Half the lowest load tried (a whole number of requests in flight); None below the least worth probing: one
    request in flight, or an eighth of the start rate (a slow point sends its requests at its rate)."""
    lower = float(int(lowest / 2)) if kind == "concurrency" else lowest / 2
    return None if lower < (1 if kind == "concurrency" else start / 8) else lower


def _midpoint(kind: str, lo: float, hi: float) -> float:
    """Between a passing and a failing load: the whole-number middle, or a rate's geometric mean."""
    return float((int(lo) + int(hi)) // 2) if kind == "concurrency" else float(f"{math.sqrt(lo * hi):.4g}")


def _sla_result(adapter: str, kind: str, objectives: list[Objective], probes: list[Probe], state: dict[str, Any],
                start: float, resolution: float, repeats: int) -> SlaResult:
    lo, hi = state["lo"], state["hi"]
    if lo is not None and not all(p.passed for p in probes if p.load == lo):
        lo = None
    at = [p for p in probes if p.load == lo]
    boundary = shape = None
    if probes:
        xs, ys = [math.log(p.load) for p in probes], [p.margin for p in probes]
        fitted = isotonic_decreasing(xs, ys)
        by_x = sorted(dict(zip(xs, fitted)).items())
        for (x0, f0), (x1, f1) in zip(by_x, by_x[1:]):
            if f0 >= 0 > f1:
                boundary = math.exp(x0 + (x1 - x0) * f0 / (f0 - f1))
                break
        if lo is not None and hi is not None:
            f = dict(by_x)
            slope = (f[math.log(lo)] - f[math.log(hi)]) / (math.log(hi) - math.log(lo))
            shape = "cliff" if slope > CLIFF else "smooth"
    scan = None
    if hi is not None and lo is not None:
        step = math.log1p(resolution)
        scan = (int(hi - start) + 1 if kind == "concurrency" else math.ceil(math.log(hi / start) / step) + 1) \
            + repeats - 1
    return SlaResult(adapter=adapter, kind=kind, objectives=[str(o) for o in objectives], capacity=lo, above=hi,
                     boundary=boundary, shape=shape, passes_at_capacity=f"{sum(p.passed for p in at)}/{len(at)}",
                     probes=list(probes), scan_probes=scan, note=state.get("note", ""))


def prepared(workload: Workload, adapter: str):
    """(adapter info, the workload as that adapter runs it), checked as `run` checks a serving run: before any
    engine starts."""
    from llmadapt.launch.settings import resolve

    info, w = resolve(workload, adapter)
    if w.kind != "serve":
        raise LlmadaptError(f"load sweeps and SLA searches serve requests: the workload's kind is {w.kind!r}, "
                            "not 'serve'")
    engine_launch(w, info)
    check_reachable(w)
    return info, w
