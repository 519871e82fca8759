"""Statistics and cross-rank aggregation: how every number in a summary is computed.

Rules: a step's time is the slowest rank's; tokens and samples are summed over ranks (and divided
by tp * pp, since the model-parallel ranks of one replica see the same tokens); memory
is the max over ranks plus each rank's own; the loss is the global-batch loss (identical on
every rank, taken from the lowest rank that reported it). Warm-up steps are excluded from
statistics but kept in the loss trajectory.

It is over 400 lines because every figure of a summary, training and serving, is defined here: one file to read
for how any number llmadapt reports was computed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

import attrs

from llmadapt.contract.flops import mfu, peak_flops, training_flops
from llmadapt.contract.breakdowns import (
    breakdown_summary,
    expert_imbalance,
    interference_summary,
    telemetry_summary,
)
from llmadapt.contract.launch import LaunchRequest, structure
from llmadapt.contract.records import (
    Device,
    Evaluation,
    Failure,
    Patch,
    Quality,
    Stats,
    Summary,
    WeightClass,
    Topology,
)
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


def aggregate(run_id: str, records: list[dict[str, Any]], launch: LaunchRequest, *, over: bool = True) -> Summary:
    """Build the run summary from every record of every rank (plus the launcher's failures). ``over``: the run
    is over (its orchestrator is summarising it); False for a run read while it may still go on, whose steps not
    completed yet are no crash: its failures are then only those recorded."""
    headers = {r["rank"]: r for r in records if r["type"] == "header"}
    failures = [Failure(**r) for r in records if r["type"] == "failure"]
    steps_by_index: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in records:
        if r["type"] == "step":
            steps_by_index[r["step"]][r["rank"]] = r

    workload = launch.require_workload()
    if workload.kind == "serve":
        return _aggregate_serve(run_id, records, launch, workload, headers, failures)
    world = workload.world_size
    # A step counts as completed when every rank finished it.
    complete = sorted(i for i, by_rank in steps_by_index.items() if len(by_rank) == world)
    steps = _training_steps(steps_by_index, complete, workload)
    per_rank_peak, memory_kind = _memory_peaks(records, world)
    known_peaks = [p for p in per_rank_peak if p is not None]

    head = headers.get(0) or (next(iter(headers.values())) if headers else None)
    device = Device(**head["device"]) if head else None
    fpt, hardware_fpt = training_flops(workload, steps.squares / steps.squared_tokens if steps.squared_tokens
                                       else None)
    tok_stats = describe(steps.tokens_s)
    achieved = fpt * tok_stats.mean if tok_stats else None
    peak = peak_flops(device.name, workload.precision) if device else None
    run_mfu = mfu(fpt, tok_stats.mean, peak, world) if tok_stats else None
    run_hfu = mfu(hardware_fpt, tok_stats.mean, peak, world) if tok_stats else None
    status, failures, warnings = _training_status(records, failures, complete, steps, workload, over)
    losses, grad_norms, times = steps.losses, steps.grad_norms, steps.times
    return Summary(
        run_id=run_id,
        status=status,
        role=launch.role,
        adapter=launch.adapter,
        framework=head["framework"] if head else launch.framework,
        framework_version=head["framework_version"] if head else "",
        launcher=launch.launcher,
        workload_hash=workload.content_hash,
        problem_hash=workload.problem_hash,
        world_size=world,
        device=device,
        patches=_patches(headers.values()),
        steps_completed=len(complete),
        measured_steps=len(times),
        losses=losses,
        grad_norms=grad_norms if any(n is not None for n in grad_norms) else None,
        step_time_s=describe(times),
        tokens_per_s=tok_stats,
        samples_per_s=describe(steps.samples_s),
        tokens_per_step=steps.tokens_per_step,
        peak_memory_bytes=max(known_peaks) if known_peaks else None,
        peak_memory_per_rank=per_rank_peak,
        memory_kind=memory_kind,
        model_flops_per_token=fpt,
        achieved_flops_per_s=achieved,
        mfu=run_mfu,
        hardware_flops_per_token=hardware_fpt,
        hfu=run_hfu,
        phase_means_s={k: sum(v) / len(v) for k, v in sorted(steps.phase_sums.items())},
        failures=failures,
        warnings=warnings,
        breakdown=breakdown_summary([r for r in records if r["type"] == "breakdown"], world),
        expert_imbalance=expert_imbalance(steps.expert_loads),
        telemetry=telemetry_summary(
            records, world, workload.telemetry.interval_s,
            [r["value"] for r in records if r["type"] == "metric" and r["name"] == "energy_measured_steps"],
            steps.window_tokens),
        evaluations=_evaluations(records),
        interference=interference_summary([r for r in records if r["type"] == "interference"], steps.step_waits),
        notes=_notes(headers.values()),
        weights=[WeightClass(**w) for w in head.get("weights", [])] if head else [],
        topology=_topology(headers),
    )


@attrs.define
class _Steps:
    """What a training run's completed steps say: each one's loss and gradient norm, and over the measured ones
    (after warm-up, profiled ones left out unless asked) times, rates and phases."""

    losses: list[float | None] = attrs.Factory(list)
    grad_norms: list[float | None] = attrs.Factory(list)
    times: list[float] = attrs.Factory(list)
    tokens_s: list[float] = attrs.Factory(list)
    samples_s: list[float] = attrs.Factory(list)
    tokens_per_step: int | None = None
    window_tokens: int = 0
    """Over every step after warm-up, profiled ones too; so are expert_loads."""
    expert_loads: list[Any] = attrs.Factory(list)
    step_waits: list[float] = attrs.Factory(list)
    squares: int = 0
    """The attention term's context (llmadapt.contract.flops), over measured steps; with squared_tokens."""
    squared_tokens: int = 0
    phase_sums: dict[str, list[float]] = attrs.Factory(lambda: defaultdict(list))


def _training_steps(steps_by_index: dict[int, dict[int, dict]], complete: list[int], workload: Workload) -> _Steps:
    """The completed steps (every rank's record of each), read as the summary counts them."""
    model_parallel = workload.parallelism.tp * workload.parallelism.pp
    out = _Steps()
    for i in complete:
        by_rank = steps_by_index[i]
        out.losses.append(next((by_rank[r]["loss"] for r in sorted(by_rank) if by_rank[r]["loss"] is not None), None))
        out.grad_norms.append(next((by_rank[r]["grad_norm"] for r in sorted(by_rank)
                                    if by_rank[r].get("grad_norm") is not None), None))
        if by_rank[min(by_rank)]["warmup"]:
            continue
        # Every rank reports its data-parallel share; the tp*pp ranks of one replica share the same tokens.
        tokens = sum(s["tokens"] for s in by_rank.values()) // model_parallel
        out.window_tokens += tokens
        out.expert_loads.append(by_rank[min(by_rank)].get("expert_load"))
        if any(s.get("profiled") for s in by_rank.values()) and not workload.profile.in_statistics:
            continue  # profiled steps are slower by the profiler's cost: not measured unless asked
        # a share of the step, capped: the delay is read just outside the step's clock (InterferenceSummary)
        out.step_waits += [min(1.0, s["run_delay_s"] / s["seconds"]) for s in by_rank.values()
                           if s.get("run_delay_s") is not None and s["seconds"] > 0]
        seconds = max(s["seconds"] for s in by_rank.values())
        samples = sum(s["samples"] for s in by_rank.values()) // model_parallel
        if all(s.get("sample_length_squares") for s in by_rank.values()):  # the ratio: tp x pp copies cancel
            out.squares += sum(s["sample_length_squares"] for s in by_rank.values())
            out.squared_tokens += sum(s["tokens"] for s in by_rank.values())
        out.times.append(seconds)
        out.tokens_s.append(tokens / seconds)
        out.samples_s.append(samples / seconds)
        out.tokens_per_step = tokens
        for s in by_rank.values():
            for ph in s["phases"]:
                out.phase_sums[f"{ph['source']}:{ph['name']}"].append(ph["seconds"])
    return out


def _memory_peaks(records: list[dict[str, Any]], world: int) -> tuple[list[int | None], str | None]:
    """(each rank's peak memory over its steps, the kind of memory measured)."""
    peaks_by_rank: dict[int, list[int]] = defaultdict(list)
    memory_kind = None
    for r in records:
        if r["type"] == "step" and r["memory"]:
            memory_kind = r["memory"]["kind"]
            if (peak := _peak(r["memory"])) is not None:
                peaks_by_rank[r["rank"]].append(peak)
    return [max(peaks_by_rank[rank]) if peaks_by_rank[rank] else None for rank in range(world)], memory_kind


def _training_status(records: list[dict[str, Any]], failures: list[Failure], complete: list[int], steps: _Steps,
                     workload: Workload, over: bool) -> tuple[str, list[Failure], list[str]]:
    """(status, failures, warnings) of a training run."""
    world = workload.world_size
    # Every rank wrote its last record: the run is complete, and whatever the launcher saw go wrong after
    # that (a rank dying in teardown, a timeout while the ranks exited) is a warning, not a lost run.
    ended = {r["rank"] for r in records if r["type"] == "end"}
    warnings = []
    if len(ended) == world and len(complete) == workload.train.total_steps:
        warnings = [f"after every rank wrote its last record: {f.message} (nothing measured was lost)"
                    for f in failures]
        failures = []
    status = "ok" if not failures and len(complete) == workload.train.total_steps else "failed"
    if status == "failed" and not failures and over:
        failures.append(Failure(cause="crash", message="the run ended before every step completed"))
    nonfinite = [i for i, loss in zip(complete, steps.losses) if loss is not None and not math.isfinite(loss)]
    bad_norms = [i for i, norm in zip(complete, steps.grad_norms) if norm is not None and not math.isfinite(norm)]
    if any(f.cause == "diverged" for f in failures):
        status = "diverged"
    elif nonfinite or bad_norms:  # train.on_nonfinite = "continue": every step ran, and still not a number
        status = "diverged"  # a failure like the one a stopped run records: the summary's failures say why
        failures.append(Failure(cause="diverged", step=min(nonfinite + bad_norms), message="; ".join(
            f"the {what} was not finite at {len(at)} step(s), the first at step {at[0]}"
            for what, at in (("loss", nonfinite), ("gradient norm", bad_norms)) if at)))
    return status, failures, warnings


def _last(records: list[dict[str, Any]], kind: str, cls: type):
    found = [r for r in records if r["type"] == kind]
    return structure(cls, found[-1], kind) if found else None


def _evaluations(records: list[dict[str, Any]]) -> list[Evaluation] | None:
    found = sorted((r for r in records if r["type"] == "evaluation"), key=lambda r: r["step"])
    return [structure(Evaluation, r, "evaluation") for r in found] or None


def _peak(memory: dict[str, Any]) -> int | None:
    return memory["peak_allocated_bytes"] if memory["kind"] == "cuda" else memory["peak_rss_bytes"]


def _notes(headers: Iterable[dict[str, Any]]) -> list[str]:
    """Every header's notes, once each, in order."""
    return list(dict.fromkeys(note for h in headers for note in h.get("notes", [])))


def _topology(headers: dict[int, dict[str, Any]]) -> Topology | None:
    """Rank 0's topology (the lowest rank's where rank 0 wrote no header), as its header recorded it."""
    found = [headers[r].get("topology") for r in sorted(headers) if headers[r].get("topology")]
    return structure(Topology, found[0], "topology") if found else None


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
    from llmadapt.contract.stats import serving_stats

    serving = serving_stats(records, workload)
    head = headers.get(0)
    # the orchestrator's record of the engine's end (its exit status) says it already; this one when it could not
    if serving.failures_by_cause.get("engine_dead") and not any(f.exit_code is not None for f in failures):
        failures.append(Failure(cause="crash", message="the engine died during the run: "
                                f"{serving.failures_by_cause['engine_dead']} requests failed because of it"))
    status = "ok" if not failures and serving.completed else "failed"
    warnings = []
    if status == "ok" and serving.failed:
        status, line = failed_requests_verdict(serving, workload.serve.max_failed_share)
        warnings.append(line)
    return Summary(
        run_id=run_id, status=status, role="serve", adapter=launch.adapter,
        framework=head["framework"] if head else launch.framework,
        framework_version=head["framework_version"] if head else "", launcher=launch.launcher,
        workload_hash=workload.content_hash, problem_hash=workload.problem_hash, world_size=1,
        device=Device(**head["device"]) if head and head["device"] else None,
        patches=_patches(headers.values()), steps_completed=0, measured_steps=0, losses=[], step_time_s=None,
        tokens_per_s=None, samples_per_s=None, tokens_per_step=None, peak_memory_bytes=None,
        peak_memory_per_rank=[], memory_kind=None, model_flops_per_token=None, achieved_flops_per_s=None, mfu=None,
        phase_means_s={}, failures=failures, serving=serving, warnings=warnings,
        interference=interference_summary([r for r in records if r["type"] == "interference"]),
        breakdown=breakdown_summary([r for r in records if r["type"] == "breakdown"], 1),  # the engine's own steps
        notes=_notes(headers.values()),  # e.g. the reference server run under the profiler launcher
        topology=_topology(headers),
        quality=_last(records, "quality", Quality),
        engine_weights=head.get("engine_weights") if head else None,
    )


def failed_requests(serving) -> str:
    """'4 of 6 requests failed (2 of them truncated)': the measured requests that did not complete, one phrase."""
    total, truncated = serving.completed + serving.failed, serving.failures_by_cause.get("truncated", 0)
    if truncated == serving.failed:
        return f"{truncated} of {total} requests truncated"
    return f"{serving.failed} of {total} requests failed" + (f" ({truncated} of them truncated)" if truncated else "")


def failed_requests_verdict(serving, max_share: float) -> tuple[str, str]:
    """('ok', 'degraded' or 'failed', the warning that says why): a serving run whose share of failed or truncated
    requests is above serve.max_failed_share is degraded (default 0: any failed request); one where none completed
    is failed, whatever the share allowed."""
    share = serving.failed / (serving.completed + serving.failed)
    if not serving.completed:
        return "failed", f"{failed_requests(serving)}: none completed (the run failed)"
    degraded = share > max_share
    return ("degraded" if degraded else "ok"), (
        f"{failed_requests(serving)}: {share:.0%} {'>' if degraded else '<='} serve.max_failed_share {max_share:g}"
        + (" (the run is degraded)" if degraded else ""))


LAG_P99_LIMIT_MS = 10.0  # a run whose p99 send lag (or event-loop lag) exceeds this did not deliver its load


BUNCHED_GAP = 0.1  # an inter-chunk gap below this fraction of the engine's inter-token latency is a bunched arrival


BUNCHED_LIMIT = 0.2  # a run with more bunched gaps than this share measured its own client, not the engine


# -- statistics ---------------------------------------------------------------------------------
def serving_stats(records: list[dict[str, Any]], workload: Workload):
    """Client-side serving figures from request records (measured requests only)."""
    from llmadapt.contract.records import ServingStats, Stats
    from llmadapt.contract.stats import describe

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
    offline = workload.serve.mode == "offline"  # one call for all: request times only where the engine gave them
    timed = [r for r in ok if r["first_token_ns"] is not None] if offline else ok
    ttft = [(r["first_token_ns"] - r["sent_ns"]) * ms for r in timed]
    e2el = [(r["end_ns"] - r["sent_ns"]) * ms for r in timed]
    tpot = [((r["end_ns"] - r["first_token_ns"]) * ms) / (r["output_tokens"] - 1)
            for r in timed if r["output_tokens"] and r["output_tokens"] > 1]
    itl = [(b - a) * ms for r in timed for a, b in zip(r["chunk_ns"], r["chunk_ns"][1:])]
    counted = [r for r in timed if r["output_tokens"] and r["chunk_ns"]]
    tokens_per_chunk = (sum(r["output_tokens"] for r in counted) / sum(len(r["chunk_ns"]) for r in counted)
                        if counted else None)
    lags = [(r["sent_ns"] - r["scheduled_ns"]) * ms for r in sent]
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)
    in_tokens = sum(r["input_tokens"] for r in ok)
    slo = workload.serve.slo
    goodput = None
    if any(v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms)) and duration and not offline:
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
    elif offline:
        valid, why = True, ("offline: the whole request set handed to the engine's offline API at once; " + (
            "TTFT from the call (the wait for a request's batch and its prefill) and TPOT from the times the engine "
            "gave its tokens, ITL where it gave every token's" if timed else "throughput only (the engine's API gives no request's times)"))
    elif workload.serve.arrival.process == "closed":
        valid, why = True, "closed loop: requests are sent as slots free up (no schedule to fall behind)"
    else:
        valid, why = True, "the generator met its schedule (p99 send lag within %.0f ms)" % LAG_P99_LIMIT_MS
    if not reqs:
        valid, why = False, "no measured request was sent"
    elif not ok:  # nothing measured the engine: every figure is of failures
        valid, why = False, f"no measured request completed ({len(failed)} of {len(reqs)} failed)"
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
        tokens_per_chunk=tokens_per_chunk, stream_prefix_share=client.get("stream_prefix_share") if client else None,
        engine_prefix_cache_hit_share=_engine_counter_share(records, (client or {}).get("prefix_cache_metrics")),
        **_output_lengths(ok),
    )


def _output_lengths(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """The output-length distribution of completed requests, and how they ended: at the cap (finish reason
    'length', or as many tokens as asked where the engine gives no reason) or before it (end-of-sequence)."""
    counted = [r for r in ok if r["output_tokens"] is not None]
    capped = [r["finish_reason"] == "length" if r.get("finish_reason") is not None
              else r["output_tokens"] >= r.get("requested_output_tokens", r["output_tokens"]) for r in counted]
    return {"output_tokens": describe([r["output_tokens"] for r in counted]),
            "stopped_at_eos_share": capped.count(False) / len(capped) if capped else None,
            "hit_cap_share": capped.count(True) / len(capped) if capped else None}


def _stall_cause(client: dict[str, Any]) -> str:
    """What the loop's thread did during its stalls, when one thing explains most of them."""
    stalls = client.get("stalls") or []
    lagged = sum(s[1] for s in stalls)
    queued = sum(s[3] for s in stalls if len(s) > 3 and s[3] is not None)
    busy = sum(s[2] for s in stalls)
    # the thread's wait and the process's CPU are read over each stalled sleep (its interval and its lag), not over
    # the lag alone: their share is of that wall time, and the process's CPU counts all its threads
    slept = lagged + len(stalls) * float(client.get("interval_ms") or 0.0)
    if not lagged:
        return ""
    if queued > lagged / 2:
        hint = (" (Linux autogroup is on: an engine started in another session, e.g. another terminal, has a CPU "
                "share equal to this whole session's; start it from this one, see docs/serving.md)"
                if client.get("sched_autogroup") else "")
        return (f"; its thread waited runnable for a CPU {queued:.0f} of the {slept:.0f} ms those late wake-ups "
                f"took: starved by other processes{hint}")
    if busy > lagged / 2:
        return (f"; the client used {busy:.0f} ms of CPU (all its threads) over the {slept:.0f} ms those late "
                "wake-ups took: work on the event loop")
    return f"; it neither ran nor waited for a CPU most of those {lagged:.0f} ms: blocked in a system call"


def _engine_counter_share(records: list[dict[str, Any]], counters: list[str] | None) -> float | None:
    """An engine's counter over another (e.g. prefix-cache hits over lookups) between its first and last sample."""
    samples = [r["values"] for r in records if r["type"] == "server_sample"]
    if not counters or len(samples) < 2:
        return None

    def total(values: dict[str, float], name: str) -> float:
        return sum(v for k, v in values.items() if k.partition("{")[0] == name)

    part, whole = ((total(samples[-1], name) - total(samples[0], name)) for name in counters)
    return part / whole if whole > 0 else None


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
