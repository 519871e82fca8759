"""The kernel-basis breakdown of Kineto traces from any job: torch.profiler's JSON (gzipped or not) written by a
user's own DeepSpeed, Megatron or FSDP script, read with the code that reads llmadapt's own profiled GPU steps
(``llmadapt.runtime.timeline.device_breakdown``): one implementation, not two.

Per rank (the trace's ``distributedInfo``): operator classes from kernel names, each NCCL collective kind with
bytes and bus bandwidth where the kernels carry them, the temporal breakdown (computation, communication exposed
and overlapped, copies, idle) with Holistic Trace Analysis's definitions, and module classes where the trace
carries annotations (``record_function`` ranges: a kernel goes to the innermost one around its launch). Across
ranks: stragglers, the ranks ranked by their computation time (the others wait for them in collectives).
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs

from llmadapt.contract.records import Breakdown, ClassTime
from llmadapt.errors import LlmadaptError, excerpt

_MODULE = "llmadapt::module::"


def trace_files(paths: list[str | Path]) -> list[Path]:
    """The trace files named, a folder standing for the traces in it (``*.json``, ``*.json.gz``)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.name.endswith((".json", ".json.gz")) and f.is_file())
            if not found:
                raise LlmadaptError(f"{p}: no trace files (*.json, *.json.gz) in this folder")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise LlmadaptError(f"{p}: no such trace file or folder")
    return files


def read_trace(path: str | Path) -> dict[str, Any]:
    """One Kineto trace (JSON, gzipped where the name ends in .gz)."""
    path = Path(path)
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        raise LlmadaptError(f"{path}: not a readable trace ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise LlmadaptError(f"{path}: not a Kineto trace (no traceEvents list)")
    check_trace(trace, path)
    return trace


def check_trace(trace: dict[str, Any], path: str | Path) -> None:
    """Every field the breakdown reads, of the type it is read as (the rank a whole number, an event's times
    numbers, its correlation and stream ids integers): a trace that differs is one line naming the file, the field
    and what was expected, before anything is computed from it."""
    from llmadapt.runtime.timeline import DEVICE_CATEGORIES

    def wrong(field: str, value: Any, expected: str) -> LlmadaptError:
        return LlmadaptError(f"{path}: {field} is {excerpt(value, 60)}, expected {expected}")

    info = trace.get("distributedInfo")
    if info is not None and not isinstance(info, dict):
        raise wrong("distributedInfo", info, "an object (rank, world_size)")
    for key, least in (("rank", 0), ("world_size", 1)):
        if key in (info or {}) and not (_integer(info[key]) and info[key] >= least):
            raise wrong(f"distributedInfo.{key}", info[key], f"a whole number >= {least}")
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, dict):
            raise wrong(f"traceEvents[{i}]", e, "an event (a JSON object)")
        if e.get("ph") != "X":
            continue  # instants, counters, flows, metadata: not read
        if not _finite(e.get("ts")):
            raise wrong(f"traceEvents[{i}].ts", e.get("ts"), "a time in microseconds (a number)")
        if "dur" in e and not (_finite(e["dur"]) and e["dur"] >= 0):
            raise wrong(f"traceEvents[{i}].dur", e["dur"], "a duration in microseconds (a number >= 0)")
        for key in ("pid", "tid"):
            if isinstance(e.get(key), (list, dict)):
                raise wrong(f"traceEvents[{i}].{key}", e[key], "an id (a number or a text)")
        args = e.get("args")
        if args is None:
            continue
        if not isinstance(args, dict):
            raise wrong(f"traceEvents[{i}].args", args, "an object")
        ids = ("correlation", "stream") if e.get("cat") in DEVICE_CATEGORIES else ("correlation",)
        for key in ids + ("In msg nelems", "Out msg nelems", "Group size"):
            if key in args and not _integer(args[key]) and not (args[key] is None and key not in ids):
                raise wrong(f"traceEvents[{i}].args.{key}", args[key], "a whole number")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def trace_breakdown(trace: dict[str, Any], *, include_last_step: bool = False) -> Breakdown:
    """One rank's breakdown on the kernel basis (see the module docstring); ``step`` is the first profiled step
    the analysed kernels were launched in (-1 where the trace marks none)."""
    from llmadapt.runtime.timeline import STEP_MARK, device_activities, device_breakdown

    info = trace.get("distributedInfo") or {}
    rank, world = int(info.get("rank", 0)), int(info.get("world_size", 1))
    activities = device_activities(trace, include_last_step=include_last_step)
    figures = device_breakdown(trace, world, activities=activities)
    if not figures:
        return Breakdown(rank, -1, "operator", "device", 0.0, source="kineto",
                         error="no GPU activity in this trace (kernels, copies or sets with a stream)")
    marks = (re.match(re.escape(STEP_MARK) + r"(\d+)", str(e.get("name", ""))) for e in trace["traceEvents"])
    steps = sorted(int(m.group(1)) for m in marks if m)
    modules = annotated_modules(trace, activities)
    return Breakdown(rank=rank, step=steps[0] if steps else -1, level="operator", basis="device",
                     modules=modules, source="kineto", **figures)


def annotated_modules(trace: dict[str, Any], activities: list[dict[str, Any]]) -> list[ClassTime]:
    """GPU time by the innermost annotation (a ``record_function`` range, cat user_annotation) around each
    activity's launch, on the launching thread or else on any thread of its process (the autograd engine's
    thread launches backward kernels inside the main thread's '## backward ##'). llmadapt's module ranges give
    their class; an optimizer's step and zero_grad are 'optimizer'; collectives' ranges are 'communication';
    a launch under no annotation is 'unannotated'."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranges: dict[tuple[Any, Any], list[tuple[float, float, str]]] = defaultdict(list)
    by_process: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") == "user_annotation" and not name.startswith("ProfilerStep#"):
            r = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), name)
            ranges[(e.get("pid"), e.get("tid"))].append(r)
            by_process[e.get("pid")].append(r)
    for table in (*ranges.values(), *by_process.values()):
        table.sort()
    from llmadapt.runtime.timeline import LAUNCH_CATEGORIES

    launches = {int(e["args"]["correlation"]): e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in (e.get("args") or {})}
    seconds: dict[str, float] = defaultdict(float)
    for a in activities:
        launch = launches.get(int(a["args"]["correlation"]))
        name = None
        if launch is not None:
            t = float(launch["ts"])
            name = (_innermost(ranges.get((launch.get("pid"), launch.get("tid")), []), t)
                    or _innermost(by_process.get(launch.get("pid"), []), t))
        seconds[_module_class(name)] += float(a.get("dur", 0.0)) / 1e6
    return [ClassTime(n, s) for n, s in sorted(seconds.items(), key=lambda kv: -kv[1])]


def _innermost(table: list[tuple[float, float, str]], t: float) -> str | None:
    """Of nested ranges sorted by start, the one that started last among those holding t."""
    i = bisect.bisect_right(table, (t, float("inf"), ""))
    while i > 0:
        i -= 1
        start, end, name = table[i]
        if start <= t <= end:
            return name
    return None


def _module_class(annotation: str | None) -> str:
    if annotation is None:
        return "unannotated"
    if annotation.startswith(_MODULE):
        return annotation[len(_MODULE):]
    if annotation.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    if annotation.startswith(("nccl:", "gloo:", "c10d::")) or annotation == "record_param_comms":
        return "communication"
    return annotation[:80]


@attrs.frozen
class RankTrace:
    """One trace file and what it says of its rank."""

    path: str
    breakdown: Breakdown


@attrs.frozen
class Straggler:
    """One rank among the others: its computation time, how far above the ranks' median, and the communication
    it waited for with nothing else running (a rank that computes longest waits least)."""

    rank: int
    compute_seconds: float
    over_median: float
    exposed_comm_seconds: float
    idle_seconds: float


@attrs.frozen
class TraceAnalysis:
    ranks: list[RankTrace]
    stragglers: list[Straggler]
    """Ranked, slowest first; empty unless the traces are two or more distinct ranks of one job."""
    note: str | None = None


def analyse_traces(paths: list[str | Path], *, include_last_step: bool = False) -> TraceAnalysis:
    """Each trace file's breakdown and, for distinct ranks of one job, the stragglers."""
    ranks = [RankTrace(str(f), trace_breakdown(read_trace(f), include_last_step=include_last_step))
             for f in trace_files(paths)]
    for r in ranks:  # a breakdown of nothing is no answer: the trace was of the CPU alone, or cut before its kernels
        if r.breakdown.error is not None:
            raise LlmadaptError(f"{r.path}: {r.breakdown.error}: nothing to break down on the kernel basis")
    good = [r.breakdown for r in ranks]
    note = None
    numbers = [b.rank for b in good]
    if len(set(numbers)) < len(numbers):
        note = "two traces name the same rank (runs of different jobs?): no straggler ranking"
        return TraceAnalysis(ranks, [], note)
    if len(good) < 2:
        return TraceAnalysis(ranks, [], note)
    median = statistics.median(b.compute_seconds for b in good)
    stragglers = [Straggler(b.rank, b.compute_seconds, b.compute_seconds / median - 1 if median else 0.0,
                            b.exposed_comm_seconds, b.idle_seconds)
                  for b in sorted(good, key=lambda b: -b.compute_seconds)]
    return TraceAnalysis(ranks, stragglers, note)


def render(result: TraceAnalysis) -> str:
    """Each rank's breakdown as `show` prints a run's, then the stragglers."""
    from llmadapt.analysis.breakdown_text import render_breakdown
    from llmadapt.texttable import text_table
    from llmadapt.contract.breakdowns import breakdown_summary

    lines: list[str] = []
    for r in result.ranks:
        b = r.breakdown
        lines.append(f"== {r.path}: rank {b.rank}" + (f", from step {b.step}" if b.step >= 0 else ""))
        if b.error:
            lines.append(f"   {b.error}")
            continue
        summary = breakdown_summary([attrs.asdict(b)], world=1)
        lines += [line for line in render_breakdown(attrs.asdict(summary))[1:]]
        lines.append("")
    if result.stragglers:
        lines += ["stragglers (slowest first: the other ranks wait for them in collectives)"]
        lines += text_table(["rank", "compute ms", "vs median", "exposed comm ms", "idle ms"],
                            [[str(s.rank), f"{s.compute_seconds * 1e3:.2f}", f"{s.over_median:+.1%}",
                              f"{s.exposed_comm_seconds * 1e3:.2f}", f"{s.idle_seconds * 1e3:.2f}"]
                             for s in result.stragglers])
    if result.note:
        lines.append(result.note)
    return "\n".join(lines).rstrip()
