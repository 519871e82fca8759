"""The summary's view of what a run saw inside its steps: the profiled steps' breakdown, MoE expert imbalance,
the telemetry samples and the interference beside the measured steps, each aggregated from the records of every
rank (called by ``stats.aggregate``).
"""

from __future__ import annotations

import statistics

import math
from collections import defaultdict
from typing import Any

from llmadapt.contract.records import (
    BreakdownSummary,
    ClassTime,
    Collective,
    ExpertImbalance,
    InterferenceSummary,
    LayerTime,
    TelemetrySummary,
    bandwidths,
)


def breakdown_summary(records: list[dict[str, Any]], world: int) -> BreakdownSummary | None:
    """Mean over every profiled (rank, step) of each class, layer, collective and timeline figure."""
    errors = [f"rank {r['rank']}, step {r['step']}: {r['error']}" for r in records if r.get("error")]
    good = [r for r in records if not r.get("error")]
    if not good:
        return None if not errors else BreakdownSummary(
            level=records[0]["level"], basis=records[0]["basis"], profiled_steps=0, step_seconds=0.0, modules=[],
            layers=[], operators=[], collectives=[], comm_seconds=0.0, overlapped_comm_seconds=0.0,
            compute_seconds=0.0, idle_seconds=0.0, gemm_flops_per_s=None, errors=errors)
    n = len(good)

    def classes(key: str) -> list[ClassTime]:
        sums: dict[str, list[float]] = {}
        for r in good:
            for c in r.get(key, []):
                s = sums.setdefault(c["name"], [0.0, 0.0, 0.0, 0, 0.0])
                s[0] += c["seconds"]
                s[1] += c["forward_seconds"]
                s[2] += c["backward_seconds"]
                s[3] += c["count"]
                s[4] += c["flops"] or 0.0
        return [ClassTime(name, s[0] / n, s[1] / n, s[2] / n, round(s[3] / n), s[4] / n or None)
                for name, s in sums.items()]

    layers: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in good:
        for layer in r["layers"]:
            layers[layer["layer"]][0] += layer["forward_seconds"] / n
            layers[layer["layer"]][1] += layer["backward_seconds"] / n
    colls: dict[tuple[str, int], list[Any]] = {}
    for r in good:
        for c in r.get("collectives", []):
            group = c.get("group_size") or world
            s = colls.setdefault((c["kind"], group), [0, 0.0, 0, True, c.get("backend", ""), c.get("algorithm")])
            s[0] += c["count"]
            s[1] += c["seconds"]
            s[2] += c["bytes"] or 0
            s[3] = s[3] and c["bytes"] is not None
    collectives = []
    for (kind, group), (count, seconds, total, sized, backend, algorithm) in sorted(colls.items(),
                                                                                  key=lambda kv: -kv[1][1]):
        algbw, busbw = bandwidths(kind, total / count, count, seconds, group) if sized and total else (None, None)
        collectives.append(Collective(kind, round(count / n), seconds / n, round(total / n) if sized else None,
                                      algbw, busbw, backend, algorithm, group))
    operators = classes("operators")
    gemm = next((o for o in operators if o.name == "gemm"), None)

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in good) / n

    return BreakdownSummary(
        level=good[0]["level"], basis=good[0]["basis"], profiled_steps=len({r["step"] for r in good}),
        step_seconds=mean("step_seconds"), modules=classes("modules"),
        layers=[LayerTime(i, *layers[i]) for i in sorted(layers)], operators=operators, collectives=collectives,
        comm_seconds=mean("comm_seconds"), overlapped_comm_seconds=mean("overlapped_comm_seconds"),
        compute_seconds=mean("compute_seconds"), idle_seconds=mean("idle_seconds"),
        gemm_flops_per_s=gemm.flops / gemm.seconds if gemm and gemm.flops and gemm.seconds else None,
        errors=errors, memory_seconds=mean("memory_seconds"), kernel_types=classes("kernel_types"),
        module_operators=classes("module_operators"),
    )


def imbalance(load: list[int]) -> tuple[float, float, int] | None:
    """(coefficient of variation, max over mean, experts with no token) of one layer's tokens per expert; None
    when no token was routed. The CV uses the population std: the experts are all there are, not a sample."""
    if not load or sum(load) == 0:
        return None
    mean = sum(load) / len(load)
    std = math.sqrt(sum((x - mean) ** 2 for x in load) / len(load))
    return std / mean, max(load) / mean, sum(1 for x in load if x == 0)


def expert_imbalance(steps: list[list[list[int]]]) -> list[ExpertImbalance] | None:
    """Per layer, mean and worst over the given steps' expert loads ([step][layer][expert])."""
    per_layer: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for load in steps:
        for layer, counts in enumerate(load or []):
            figures = imbalance(counts)
            if figures is not None:
                per_layer[layer].append(figures)
    if not per_layer:
        return None
    out = []
    for layer in sorted(per_layer):
        cv, ratio, idle = zip(*per_layer[layer])
        out.append(ExpertImbalance(layer=layer, cv=sum(cv) / len(cv), cv_max=max(cv),
                                   max_over_mean=sum(ratio) / len(ratio), max_over_mean_max=max(ratio),
                                   idle_experts=sum(idle) / len(idle), idle_experts_max=max(idle)))
    return out


def telemetry_summary(records: list[dict[str, Any]], world: int, interval_s: float, energy: list[float],
                      measured_tokens: int) -> TelemetrySummary | None:
    """Per rank means of the telemetry samples; energy of the measured steps (the worker's NVML readings at their
    start and end, summed over ranks) and joules per token."""
    samples = [r for r in records if r["type"] == "telemetry"]
    if not samples:
        return None
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in samples:
        by_rank[r["rank"]].append(r)

    def per_rank(key: str, how) -> list[Any]:
        out = []
        for rank in range(world):
            values = [r[key] for r in by_rank.get(rank, []) if r.get(key) is not None]
            out.append(how(values) if values else None)
        return out

    def avg(values: list[float]) -> float:
        return sum(values) / len(values)

    energy_j = sum(energy) if energy and len(energy) == world else None
    unavailable = list(dict.fromkeys(u for r in samples for u in r.get("unavailable", [])))
    if energy_j is None and not any("energy" in u for u in unavailable):
        unavailable.append("energy: no rank read the GPU's energy counter over the measured steps")
    return TelemetrySummary(
        source=samples[0]["source"], samples=len(samples), interval_s=interval_s,
        cpu_percent_per_rank=per_rank("cpu_percent", avg), peak_rss_bytes_per_rank=per_rank("rss_bytes", max),
        gpu_util_percent_per_rank=per_rank("gpu_util_percent", avg), power_w_per_rank=per_rank("power_w", avg),
        energy_j=energy_j,
        joules_per_token=energy_j / measured_tokens if energy_j is not None and measured_tokens else None,
        unavailable=unavailable,
    )


SHORTEST_JUDGED_S = 0.5
"""A window shorter than this is not judged for other processes' CPU: /proc/stat counts in clock ticks (10 ms)."""
OTHER_CORES_LIMIT = 0.25
"""Other processes keeping a quarter of a core busy on average disturb a measurement."""
STEAL_LIMIT = 0.02
"""A hypervisor taking 2% of the CPU disturbs a measurement (judged, like other processes' CPU, on windows of half
a second or more, and on five ticks or more: one 10 ms tick of a short window is already a few percent)."""


def interference_summary(found: list[dict[str, Any]], step_waits: list[float] = ()) -> InterferenceSummary | None:
    """Quiet or disturbed, from every rank's interference record: other processes' CPU (per node, the machine's
    busy CPU time less its ranks'), steal, and on a GPU other processes and throttled clocks; each cause found is
    one line with its measure. The ranks' waits for a core are reported beside, not judged: a run with more
    threads than cores makes them itself, as are ``step_waits`` (each measured step's share its training thread
    waited, every rank's). Not judged (quiet None) where no window was long enough to count."""
    if not found:
        return None
    causes: list[str] = []
    other_cores, judged = None, False
    nodes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in found:
        nodes[r["node"]].append(r)
    for rs in nodes.values():
        busy = [r["machine_busy_cpu_s"] for r in rs]
        own = [r["own_cpu_s"] for r in rs]
        window = max(r["window_s"] for r in rs)
        if None in busy or None in own or window <= 0:
            continue
        other = max(0.0, max(busy) - sum(own)) / window
        other_cores = max(other_cores or 0.0, other)
        judged = judged or window >= SHORTEST_JUDGED_S
        if window >= SHORTEST_JUDGED_S and other >= OTHER_CORES_LIMIT:
            causes.append(f"other processes kept {other:.2f} of {rs[0]['cores']} cores busy")
    # each thread waits at most the window: a share of thread-time. Before 1.16 the record did not say how many
    # threads it summed (its 'threads' counts torch's intra-op pool only): capped at 1 there
    delays = [min(1.0, r["run_delay_s"] / (r["window_s"] * max(1, r.get("run_delay_threads") or r["threads"] or 1)))
              for r in found if r["run_delay_s"] is not None and r["window_s"] > 0]
    delay_share = max(delays) if delays else None
    steals = [r["steal_s"] / (r["window_s"] * (r["cores"] or 1)) for r in found
              if r["steal_s"] is not None and r["window_s"] >= SHORTEST_JUDGED_S and r["steal_s"] >= 0.05]
    steal_share = max(steals) if steals else None
    if steal_share is not None and steal_share >= STEAL_LIMIT:
        causes.append(f"the hypervisor gave {steal_share:.0%} of the CPU to other guests (steal)")
    gpu_others = [r["gpu_other_processes"] for r in found if r.get("gpu_other_processes") is not None]
    if gpu_others and max(gpu_others):
        causes.append(f"{max(gpu_others)} other process(es) on a rank's GPU")
    throttled = sorted({reason for r in found for reason in r.get("gpu_throttle_reasons") or []})
    if throttled:
        causes.append(f"GPU clocks held down: {', '.join(throttled)}")
    loads = [r for r in found if r["load_start"] is not None]
    return InterferenceSummary(
        quiet=not causes if judged or causes else None, causes=causes, other_cpu_cores=other_cores, run_delay_share=delay_share,
        steal_share=steal_share, load_start=max((r["load_start"] for r in loads), default=None),
        load_end=max((r["load_end"] for r in loads), default=None),
        gpu_other_processes=max(gpu_others) if gpu_others else None, gpu_throttle_reasons=throttled,
        step_wait_share_median=statistics.median(step_waits) if step_waits else None,
        step_wait_share_max=max(step_waits) if step_waits else None)
