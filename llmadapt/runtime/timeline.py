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

import re
from collections import defaultdict
from typing import Any, Iterable

from llmadapt.adapter.breakdown import collective_kind
from llmadapt.contract.records import Collective, bandwidths

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
    args = event.get("args", {})
    if "In msg nelems" in args:  # NCCL kernels (from record_param_comms)
        size = _DTYPE_BYTES.get(str(args.get("dtype", "")).lower())
        nelems = max(int(args.get("In msg nelems") or 0), int(args.get("Out msg nelems") or 0))
        return nelems * size if size and nelems else None
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types or not isinstance(dims[0], list):
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
    ``Breakdown`` from ``collectives`` to ``idle_seconds``, in seconds."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if str(e.get("name", "")).startswith(STEP_MARK)]
    if not steps:
        return {}
    step = _span(steps[0])
    on_gpu = any(e.get("cat") == "kernel" for e in events)
    group = (trace.get("distributedInfo") or {}).get("world_size") or world

    comm_events: list[tuple[str, str, dict[str, Any]]] = []  # (kind, backend, event)
    compute: list[Interval] = []
    waiting: list[Interval] = []
    step_threads = {steps[0].get("tid")} | {e.get("tid") for e in events if str(e.get("name", "")).startswith(_BACKWARD)}
    for e in events:
        name, cat = str(e.get("name", "")), e.get("cat")
        if on_gpu:
            if cat != "kernel":
                continue
            if "nccl" in name.lower():
                kind = _nccl_kind(name, e.get("args", {}))
                comm_events.append((kind, "nccl", e))
            else:
                compute.append(_span(e))
            continue
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
    overlapped = length(intersect(comm_u, compute_u))
    # (kind, backend, group size) -> [count, seconds, bytes, every call sized, algorithm]
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
    step_us = step[1] - step[0]
    busy = length(union([*compute_u, *comm_u]))
    return {
        "collectives": collectives,
        "comm_seconds": length(comm_u) / 1e6,
        "overlapped_comm_seconds": overlapped / 1e6,
        "compute_seconds": length(compute_u) / 1e6,
        "idle_seconds": max(step_us - busy, 0.0) / 1e6,
    }


_NCCL_KINDS = (("allreduce", "all_reduce"), ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
               ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("sendrecv", "send_recv"),
               ("send", "send_recv"), ("recv", "send_recv"))


def _nccl_kind(name: str, args: dict[str, Any]) -> str:
    """A collective kind from an NCCL kernel's name (ncclDevKernel_AllReduce_Sum_f32_RING_LL) or, for the generic
    kernel, the 'Collective name' argument that PyTorch copies onto it."""
    for text in (str(args.get("Collective name", "")), name):
        low = text.lower().replace("_", "")
        for key, kind in _NCCL_KINDS:
            if key in low:
                return kind
    return "other_collective"
