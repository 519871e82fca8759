"""Communication and computation on one rank's profiled timeline (a Kineto trace, as torch.profiler exports it):
each collective kind's time, bytes and bus bandwidth, and how much communication overlapped computation.

The definitions are Holistic Trace Analysis's (docs/breakdown.md): computation is the union of compute spans,
communication the union of collective spans, the overlap the time both ran over the communication time, idle
the step's time with neither. HTA reads GPU kernels only; here the same definitions apply to what a CPU run
has: gloo's collectives run on its own worker threads (spans ``gloo:all_reduce`` with their input shapes),
computation is the operators of the threads that run the step, less the time those threads sat in a collective
or a wait. On GPU, both come from kernels: NCCL's (whose names carry the algorithm and whose arguments carry
the message size) and every other kernel.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from typing import Any, Iterable

from llmadapt.adapter.breakdown import collective_kind, kernel_class, nccl_kernel_kind
from llmadapt.contract.records import ClassTime, Collective, bandwidths

STEP_MARK = "ProfilerStep#"
"""torch.profiler's own name for a step's range (HTA finds iterations by it)."""
_BACKWARD = "autograd::engine::evaluate_function"

# Bytes per element by the names the profiler gives dtypes (Input type) and NCCL's arguments (dtype).
_DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::half": 2, "c10::bfloat16": 2, "half": 2, "bfloat16": 2, "int": 4,
    "long int": 8, "long": 8, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "float32": 4,
    "float16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1,
}
_NCCL_ALGORITHM = re.compile(r"_(RING|TREE|COLLNET_DIRECT|COLLNET_CHAIN|NVLS_TREE|NVLS|PAT)_(LL128|LL|SIMPLE)",
                             re.IGNORECASE)

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Both unions (sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a less b (both unions)."""
    out = []
    for start, end in a:
        cut = start
        for bs, be in b:
            if be <= cut or bs >= end:
                continue
            if bs > cut:
                out.append((cut, bs))
            cut = max(cut, be)
        if cut < end:
            out.append((cut, end))
    return out


def _span(event: dict[str, Any]) -> Interval:
    return float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))


def _message_bytes(event: dict[str, Any], kind: str, world: int) -> int | None:
    """nccl-tests' message size: the larger of input and output (all-gather: gathered, reduce-scatter: input)."""
    args = event.get("args") or {}
    if "In msg nelems" in args:  # NCCL kernels (from record_param_comms)
        size = _DTYPE_BYTES.get(str(args.get("dtype", "")).lower())
        nelems = max(int(args.get("In msg nelems") or 0), int(args.get("Out msg nelems") or 0))
        return nelems * size if size and nelems else None
    dims, types = args.get("Input Dims"), args.get("Input type")
    # a flat shape of the first input; a tensor list's shapes (nested lists) or anything else: size unknown
    if not (isinstance(dims, list) and isinstance(types, list) and dims and types and isinstance(dims[0], list)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in dims[0])):
        return None
    size = _DTYPE_BYTES.get(str(types[0]).lower())
    if size is None:
        return None
    nelems = 1
    for d in dims[0]:
        nelems *= int(d)
    if kind == "all_gather":  # gloo's span carries this rank's input; the message is the gathered output
        nelems *= world
    return nelems * size


def _algorithm(name: str, backend: str, kind: str) -> str | None:
    if backend == "nccl":
        m = _NCCL_ALGORITHM.search(name)
        return f"{m.group(1).upper()}_{m.group(2).upper()}" if m else None
    if backend == "gloo" and kind == "all_reduce":
        return "ring"  # gloo's allreduce without an algorithm option runs its ring
    return None


def analyse(trace: dict[str, Any], world: int) -> dict[str, Any]:
    """Collectives and the temporal breakdown of the one step in TRACE (see the module docstring): the fields of
    ``Breakdown`` from ``collectives`` to ``idle_seconds``, in seconds. A trace with GPU activity is read on the
    kernel basis (``device_breakdown``, the step's range as its window), with its kernel classes as operators."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if str(e.get("name", "")).startswith(STEP_MARK)]
    if not steps:
        return {}
    step = _span(steps[0])
    if any(e.get("cat") in DEVICE_CATEGORIES for e in events):
        return device_breakdown(trace, world, window=step)
    group = (trace.get("distributedInfo") or {}).get("world_size") or world

    comm_events: list[tuple[str, str, dict[str, Any]]] = []  # (kind, backend, event)
    compute: list[Interval] = []
    waiting: list[Interval] = []
    step_threads = {steps[0].get("tid")} | {e.get("tid") for e in events if str(e.get("name", "")).startswith(_BACKWARD)}
    for e in events:
        name, cat = str(e.get("name", "")), e.get("cat")
        if name.startswith("gloo:"):
            comm_events.append((collective_kind(name) or "other_collective", "gloo", e))
        elif cat == "cpu_op" and e.get("tid") in step_threads:
            if collective_kind(name) or "wait" in name.lower() or name == "record_param_comms":
                waiting.append(_span(e))
            else:
                compute.append(_span(e))

    clip = [step]
    # the step's collectives: the ranks' synchronisation before its range is not one of them
    comm_events = [(k, b, e) for k, b, e in comm_events if step[0] <= float(e["ts"]) <= step[1]]
    compute_u = intersect(subtract(union(compute), union(waiting)), clip)
    comm_u = intersect(union(_span(e) for _, _, e in comm_events), clip)
    busy = length(union([*compute_u, *comm_u]))
    return {
        "collectives": _collectives(comm_events, group),
        "comm_seconds": length(comm_u) / 1e6,
        "overlapped_comm_seconds": length(intersect(comm_u, compute_u)) / 1e6,
        "compute_seconds": length(compute_u) / 1e6,
        "idle_seconds": max(step[1] - step[0] - busy, 0.0) / 1e6,
    }


def _collectives(comm_events: list[tuple[str, str, dict[str, Any]]], group: int) -> list[Collective]:
    """Each (kind, backend, group size): count, time, bytes, bandwidths, algorithm."""
    per_kind: dict[tuple[str, str, int], list[Any]] = defaultdict(lambda: [0, 0.0, 0, True, None])
    for kind, backend, e in comm_events:
        size_of_group = int((e.get("args") or {}).get("Group size") or group)  # NCCL's say; gloo's: the world
        entry = per_kind[(kind, backend, size_of_group)]
        entry[0] += 1
        entry[1] += float(e.get("dur", 0.0)) / 1e6
        size = _message_bytes(e, kind, size_of_group)
        entry[2] += size or 0
        entry[3] = entry[3] and size is not None
        entry[4] = entry[4] or _algorithm(name=str(e.get("name", "")), backend=backend, kind=kind)
    collectives = []
    for (kind, backend, n), (count, seconds, total, sized, algorithm) in sorted(per_kind.items(),
                                                                            key=lambda kv: -kv[1][1]):
        total_bytes = total if sized and total else None
        algbw, busbw = bandwidths(kind, total_bytes / count, count, seconds, n) if total_bytes else (None, None)
        collectives.append(Collective(kind=kind, count=count, seconds=seconds, bytes=total_bytes,
                                      algbw_gbytes_per_s=algbw, busbw_gbytes_per_s=busbw, backend=backend,
                                      algorithm=algorithm, group_size=n))
    return collectives


# -- the GPU's kernel basis ---------------------------------------------------------------------------------
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""Kineto's categories of work a GPU does: what Holistic Trace Analysis counts as GPU kernels (stream >= 0)."""
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
"""Kineto's categories of the host calls that launch GPU work (their correlation ids name the work)."""
_HTA_COMM = re.compile(r"^nccl.*Kernel")
_HTA_MEMORY = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_HTA_NOT_COMPUTE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
KERNEL_TYPES = ("computation", "communication", "memory", "other")


def kernel_type(name: str) -> str:
    """Holistic Trace Analysis's kernel type (hta.utils.utils.get_kernel_type, 0.5.0), its regular expressions
    as they are: communication (an NCCL kernel), memory (a copy or set), computation (every other kernel whose
    name has no 'Memcpy' or 'Sync' in it), other. The temporal breakdown and the overlap are built on it."""
    if _HTA_COMM.match(name):
        return "communication"
    if _HTA_MEMORY.match(name):
        return "memory"
    return "other" if _HTA_NOT_COMPUTE.match(name) else "computation"


def device_activities(trace: dict[str, Any], *, include_last_step: bool = False) -> list[dict[str, Any]]:
    """The GPU activities of a trace (kernels, copies, sets with a stream and a correlation id), selected as HTA
    selects them: where the trace holds two or more ``ProfilerStep`` ranges, only what was launched before the
    last one started (the profiler may stop inside the last step), unless ``include_last_step``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    activities = [e for e in events if e.get("cat") in DEVICE_CATEGORIES
                  and int((e.get("args") or {}).get("stream", -1)) >= 0
                  and int((e.get("args") or {}).get("correlation", -1)) >= 0]
    starts = [float(e["ts"]) for e in events if str(e.get("name", "")).startswith(STEP_MARK)]
    if include_last_step or len(starts) < 2:
        return activities
    last = max(starts)
    launched = {int(e["args"]["correlation"]): float(e["ts"]) for e in events
                if e.get("cat") not in DEVICE_CATEGORIES and "correlation" in (e.get("args") or {})}
    return [e for e in activities if launched.get(int(e["args"]["correlation"]), last) < last]


def device_breakdown(trace: dict[str, Any], world: int, *, window: Interval | None = None,
                     include_last_step: bool = False, activities: list[dict[str, Any]] | None = None
                     ) -> dict[str, Any]:
    """The kernel basis of one rank's trace: every GPU activity's time by operator class (``kernel_class``), the
    collectives from NCCL's kernels, and the temporal breakdown with HTA's definitions (``kernel_type``):
    computation is the union of computation kernels, communication of NCCL kernels, memory of copies and sets;
    overlap is computation during communication; idle is the window with no activity at all. The window is the
    given one (a profiled step's range) or, as HTA's, from the first activity's start to the last one's end.
    Returns the fields of ``Breakdown`` from ``step_seconds`` on (no modules: those come from the profiler's
    events, or from annotations for a trace llmadapt did not record). ``activities``: device_activities's
    answer, where the caller has it already."""
    if activities is None:
        activities = device_activities(trace, include_last_step=include_last_step)
    if not activities:
        return {}
    spans = [_span(e) for e in activities]
    if window is None:
        window = (min(a for a, _ in spans), max(b for _, b in spans))
    clip = [window]
    group = (trace.get("distributedInfo") or {}).get("world_size") or world
    by_type: dict[str, list[Interval]] = defaultdict(list)
    classes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    comm_events = []
    for e, span in zip(activities, spans):
        name = str(e.get("name", ""))
        by_type[kernel_type(name)].append(span)
        cls = kernel_class(name, e.get("cat", "kernel"))
        classes[cls][0] += max(min(span[1], window[1]) - max(span[0], window[0]), 0.0) / 1e6
        classes[cls][1] += 1
        if "nccl" in name.lower():
            comm_events.append((nccl_kernel_kind(name, str((e.get("args") or {}).get("Collective name", ""))),
                                "nccl", e))
    unions = {t: intersect(union(by_type[t]), clip) for t in KERNEL_TYPES}
    compute_u, comm_u = unions["computation"], unions["communication"]
    busy = union([i for t in KERNEL_TYPES for i in unions[t]])
    return {
        "step_seconds": (window[1] - window[0]) / 1e6,
        "operators": [ClassTime(name, seconds, count=count)
                      for name, (seconds, count) in sorted(classes.items(), key=lambda kv: -kv[1][0])],
        "collectives": _collectives(comm_events, group),
        "comm_seconds": length(comm_u) / 1e6,
        "overlapped_comm_seconds": length(intersect(comm_u, compute_u)) / 1e6,
        "compute_seconds": length(compute_u) / 1e6,
        "memory_seconds": length(unions["memory"]) / 1e6,
        "idle_seconds": max(window[1] - window[0] - length(busy), 0.0) / 1e6,
        "kernel_types": _partition(unions, ("computation", "communication", "memory")),
    }


def _partition(unions: dict[str, list[Interval]], types: tuple[str, ...]) -> list[ClassTime]:
    """The time during which exactly each combination of TYPES ran ('computation+communication': both and no
    memory activity), as HTA's kernel-type breakdown splits it; combinations that never ran are left out."""
    edges = sorted({t for name in types for span in unions[name] for t in span})
    out: dict[str, float] = defaultdict(float)
    for a, b in zip(edges, edges[1:]):
        mid = (a + b) / 2
        running = [name for name in types if any(s <= mid < e for s, e in _around(unions[name], mid))]
        if running:
            out["+".join(running)] += (b - a) / 1e6
    return [ClassTime(name, seconds) for name, seconds in sorted(out.items(), key=lambda kv: -kv[1])]


def _around(intervals: list[Interval], t: float) -> list[Interval]:
    """The interval of a sorted union that could hold t (at most one)."""
    i = bisect.bisect_right(intervals, (t, float("inf"))) - 1
    return [intervals[i]] if i >= 0 else []
