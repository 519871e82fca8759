"""Statistics and cross-rank aggregation: how every number in a summary is computed.

Rules: a step's time is the slowest rank's; tokens and samples are summed over ranks (and divided
by tp * pp, since the model-parallel ranks of one replica see the same tokens); memory
is the max over ranks plus each rank's own; the loss is the global-batch loss (identical on
every rank, taken from the lowest rank that reported it). Warm-up steps are excluded from
statistics but kept in the loss trajectory.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

from llmadapt.contract import Device, Failure, Patch, Stats, Summary
from llmadapt.flops import model_flops_per_token, mfu, peak_flops
from llmadapt.spec import Workload


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def describe(values: Iterable[float]) -> Stats | None:
    """count, mean, std (sample, n-1), min, p50, p90, p95, p99, max; None for no values."""
    data = sorted(float(v) for v in values)
    if not data:
        return None
    n = len(data)
    mean = sum(data) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in data) / (n - 1)) if n > 1 else 0.0
    p = {q: percentile(data, q) for q in (50, 90, 95, 99)}
    return Stats(count=n, mean=mean, std=std, min=data[0], p50=p[50], p90=p[90], p95=p[95], p99=p[99], max=data[-1])


def aggregate(run_id: str, records: list[dict[str, Any]], launch: dict[str, Any]) -> Summary:
    """Build the run summary from every record of every rank (plus the launcher's failures)."""
    headers = {r["rank"]: r for r in records if r["type"] == "header"}
    failures = [Failure(**r) for r in records if r["type"] == "failure"]
    steps_by_index: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in records:
        if r["type"] == "step":
            steps_by_index[r["step"]][r["rank"]] = r

    workload = Workload.from_dict(launch["workload"])
    if workload.kind == "serve":
        return _aggregate_serve(run_id, records, launch, workload, headers, failures)
    world = workload.world_size
    model_parallel = workload.parallelism.tp * workload.parallelism.pp
    # A step counts as completed when every rank finished it.
    complete = sorted(i for i, by_rank in steps_by_index.items() if len(by_rank) == world)
    losses: list[float | None] = []
    times, tokens_s, samples_s, tokens_per_step = [], [], [], None
    phase_sums: dict[str, list[float]] = defaultdict(list)
    for i in complete:
        by_rank = steps_by_index[i]
        loss = next((by_rank[r]["loss"] for r in sorted(by_rank) if by_rank[r]["loss"] is not None), None)
        losses.append(loss)
        if by_rank[min(by_rank)]["warmup"]:
            continue
        seconds = max(s["seconds"] for s in by_rank.values())
        # Every rank reports its data-parallel share; the tp*pp ranks of one replica share the same tokens.
        tokens = sum(s["tokens"] for s in by_rank.values()) // model_parallel
        samples = sum(s["samples"] for s in by_rank.values()) // model_parallel
        times.append(seconds)
        tokens_s.append(tokens / seconds)
        samples_s.append(samples / seconds)
        tokens_per_step = tokens
        for s in by_rank.values():
            for ph in s["phases"]:
                phase_sums[f"{ph['source']}:{ph['name']}"].append(ph["seconds"])

    peaks_by_rank: dict[int, list[int]] = defaultdict(list)
    memory_kind = None
    for r in records:
        if r["type"] == "step" and r["memory"]:
            memory_kind = r["memory"]["kind"]
            if (peak := _peak(r["memory"])) is not None:
                peaks_by_rank[r["rank"]].append(peak)
    per_rank_peak = [max(peaks_by_rank[rank]) if peaks_by_rank[rank] else None for rank in range(world)]
    known_peaks = [p for p in per_rank_peak if p is not None]

    head = headers.get(0) or (next(iter(headers.values())) if headers else None)
    device = Device(**head["device"]) if head else None
    fpt = model_flops_per_token(workload.model, workload.train.seq_len)
    tok_stats = describe(tokens_s)
    achieved = fpt * tok_stats.mean if tok_stats else None
    peak = peak_flops(device.name, workload.precision) if device else None
    # MFU is meaningless for quantized or LoRA runs under the 6N convention: leave it out.
    plain = workload.optimizations.quantization == "none" and not workload.lora.rank
    run_mfu = mfu(fpt, tok_stats.mean, peak, world) if (tok_stats and plain) else None

    # Every rank wrote its last record: the run is complete, and whatever the launcher saw go wrong after
    # that (a rank dying in teardown, a timeout while the ranks exited) is a warning, not a lost run.
    ended = {r["rank"] for r in records if r["type"] == "end"}
    warnings = []
    if len(ended) == world and len(complete) == workload.train.total_steps:
        warnings = [f"after every rank wrote its last record: {f.message} (nothing measured was lost)"
                    for f in failures]
        failures = []
    status = "ok" if not failures and len(complete) == workload.train.total_steps else "failed"
    if status == "failed" and not failures:
        failures.append(Failure(cause="crash", message="the run ended before every step completed"))
    return Summary(
        run_id=run_id,
        status=status,
        role=launch["role"],
        adapter=launch["adapter"],
        framework=head["framework"] if head else launch.get("framework", ""),
        framework_version=head["framework_version"] if head else "",
        launcher=launch["launcher"],
        workload_hash=workload.content_hash,
        problem_hash=workload.problem_hash,
        world_size=world,
        device=device,
        patches=_patches(headers.values()),
        steps_completed=len(complete),
        measured_steps=len(times),
        losses=losses,
        step_time_s=describe(times),
        tokens_per_s=tok_stats,
        samples_per_s=describe(samples_s),
        tokens_per_step=tokens_per_step,
        peak_memory_bytes=max(known_peaks) if known_peaks else None,
        peak_memory_per_rank=per_rank_peak,
        memory_kind=memory_kind,
        model_flops_per_token=fpt,
        achieved_flops_per_s=achieved,
        mfu=run_mfu,
        phase_means_s={k: sum(v) / len(v) for k, v in sorted(phase_sums.items())},
        failures=failures,
        warnings=warnings,
    )


def _peak(memory: dict[str, Any]) -> int | None:
    return memory["peak_allocated_bytes"] if memory["kind"] == "cuda" else memory["peak_rss_bytes"]


def _patches(headers: Iterable[dict[str, Any]]) -> list[Patch]:
    seen, out = set(), []
    for h in headers:
        for p in h["patches"]:
            key = (p["framework"], p["name"])
            if key not in seen:
                seen.add(key)
                out.append(Patch(**p))
    return out


def _aggregate_serve(run_id, records, launch, workload, headers, failures) -> Summary:
    from llmadapt.serving import serving_stats

    serving = serving_stats(records, workload)
    head = headers.get(0)
    if serving.failures_by_cause.get("engine_dead"):
        failures.append(Failure(cause="crash", message="the engine died during the run: "
                                f"{serving.failures_by_cause['engine_dead']} requests failed because of it"))
    status = "ok" if not failures and serving.completed else "failed"
    return Summary(
        run_id=run_id, status=status, role="serve", adapter=launch["adapter"],
        framework=head["framework"] if head else launch.get("framework", ""),
        framework_version=head["framework_version"] if head else "", launcher=launch["launcher"],
        workload_hash=workload.content_hash, problem_hash=workload.problem_hash, world_size=1,
        device=Device(**head["device"]) if head and head["device"] else None,
        patches=_patches(headers.values()), steps_completed=0, measured_steps=0, losses=[], step_time_s=None,
        tokens_per_s=None, samples_per_s=None, tokens_per_step=None, peak_memory_bytes=None,
        peak_memory_per_rank=[], memory_kind=None, model_flops_per_token=None, achieved_flops_per_s=None, mfu=None,
        phase_means_s={}, failures=failures, serving=serving,
    )
