"""The launcher of kind "import": another tool's serving result (read by llmadapt.contract.foreign) written as a
serving run folder, beside the runs llmadapt starts. A file with per-request times becomes request records, and the
summary is computed from them by llmadapt's own definitions (contract.stats); an aggregate-only file becomes a
summary-only run holding the figures as the file reports them. Either way every figure the file reports is kept as a
``metric`` record whose source is the tool, and the summary's ``measured_by`` names the tool and its version.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path

import attrs

from llmadapt.contract.foreign import AS_FILE_STATES, SUMMARY_ONLY, TOOLS, Measured, Sent, check_against, \
    facts_line, stated_facts, workload_from_file
from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.launch import LaunchRequest, new_run_id, run_header
from llmadapt.contract.records import End, Metric, Request, ServingStats, Stats, Summary
from llmadapt.contract.rundir import RunDir
from llmadapt.contract.schema import to_json
from llmadapt.spec import Workload


def write_run(m: Measured, parent: Path, workload: Workload | None = None) -> Path:
    """The measured result as a serving run folder under ``parent``, named by its run id (made here); returns it.
    The run id is the benchmark's time, the tool and the file's content hash: the same file imports as the same
    run."""
    if workload is not None:
        check_against(m, workload)
        problem_hash, marked = workload.problem_hash, None
    else:
        workload = workload_from_file(m)
        facts = json.dumps({AS_FILE_STATES: stated_facts(m)}, sort_keys=True, default=str)
        problem_hash, marked = hashlib.sha256(facts.encode()).hexdigest(), AS_FILE_STATES
    digest = hashlib.sha256(m.path.read_bytes()).hexdigest()[:8]
    when = dt.datetime.fromtimestamp(m.created or m.path.stat().st_mtime, dt.timezone.utc)
    run_id = new_run_id(m.tool, when=when, unique=digest)
    launch = LaunchRequest(run_id=run_id, launcher="import", role="serve", adapter=m.tool,
                           adapter_version=m.version or "", framework=TOOLS[m.tool], workload=workload,
                           workload_hash=workload.content_hash, problem_hash=problem_hash, created=when.timestamp())
    folder = Path(parent) / run_id
    folder.mkdir(parents=True)
    rundir = RunDir(folder)
    rundir.write_launch(launch)
    header = run_header(launch, framework_version=m.version or "", device=None,
                        software={m.tool: m.version or "not stated"}, patches=[], started=when)
    forced = workload.serve.ignore_eos if marked is None else False
    with JsonlWriter(rundir.rank_file(0)) as w:
        w.write(header)
        origin = min((s.start_s for s in m.sent or []), default=0.0)
        for i, s in enumerate(m.sent or []):
            w.write(_request(i, s, forced, workload.serve.output_len.mean, origin))
        for name, (value, unit) in m.reported.items():
            w.write(Metric(rank=0, name=name, value=value, unit=unit, source=m.measured_by))
        w.write(End(rank=0, time=when.isoformat()))
    summary = _summary(m, folder, launch, workload, problem_hash, marked)
    rundir.write_summary(to_json(summary))
    return folder


def _ns(seconds: float, origin: float) -> int:
    """Seconds on the tool's clock as nanoseconds from the first request's start (records hold integers; from the
    start, so that Unix times keep their microseconds: 1.8e18 ns would not)."""
    return round((seconds - origin) * 1e9)


def _request(index: int, s: Sent, forced: bool, asked: int, origin: float) -> Request:
    ok = s.error is None
    return Request(index=index, warmup=False, scheduled_ns=_ns(s.start_s, origin), sent_ns=_ns(s.start_s, origin),
                   first_token_ns=_ns(s.start_s + s.ttft_s, origin) if ok else None,
                   end_ns=_ns(s.end_s, origin) if ok else _ns(s.start_s, origin),
                   chunk_ns=[_ns(c, origin) for c in s.chunk_s] if ok else [],
                   chunk_tokens=[None] * len(s.chunk_s) if ok else [], input_tokens=s.input_tokens,
                   output_tokens=s.output_tokens, requested_output_tokens=asked, output_forced=forced,
                   finish_reason=None, status="ok" if ok else "error", error=s.error[:300] if s.error else None)


def _summary(m: Measured, folder: Path, launch: LaunchRequest, workload: Workload, problem_hash: str,
             marked: str | None) -> Summary:
    validity = (f"not judged: measured by {m.measured_by}, whose client's send lag and health are not in its file; "
                f"imported from {m.path.name}")
    warnings = [f"imported: measured by {m.measured_by}, not llmadapt's load generator"
                + (f" (problem {AS_FILE_STATES}: {facts_line(m)})" if marked else "")]
    if m.sent is not None:
        from llmadapt.contract.readback import summarise

        summary = summarise(folder, write=False)
        serving = attrs.evolve(summary.serving, send_lag_ms=None, valid=summary.serving.completed > 0,
                               validity=validity,
                               tokens_per_chunk=summary.serving.tokens_per_chunk if m.per_chunk else None,
                               itl_ms=summary.serving.itl_ms if m.per_chunk else None)
        if not m.per_chunk:
            warnings.append(f"{TOOLS[m.tool]} keeps each request's first and last token times, not every chunk's: "
                            "no ITL")
    else:
        serving = _serving_from_figures(m, workload, f"{SUMMARY_ONLY}; {validity}")
        warnings.append(f"summary only: {m.path.name} holds aggregate figures, no request's times")
        summary = Summary(
            run_id=launch.run_id, status="ok", role="serve", adapter=m.tool, framework=TOOLS[m.tool],
            framework_version=m.version or "", launcher="import", workload_hash=workload.content_hash,
            problem_hash=problem_hash, world_size=1, device=None, patches=[], steps_completed=0, measured_steps=0,
            losses=[], step_time_s=None, tokens_per_s=None, samples_per_s=None, tokens_per_step=None,
            peak_memory_bytes=None, peak_memory_per_rank=[], memory_kind=None, model_flops_per_token=None,
            achieved_flops_per_s=None, mfu=None, phase_means_s={}, failures=[])
    status = summary.status
    if m.failed and status == "ok":
        from llmadapt.contract.stats import failed_requests_verdict

        status, line = failed_requests_verdict(serving, workload.serve.max_failed_share)
        warnings.append(line)
    return attrs.evolve(summary, serving=serving, status=status, problem_hash=problem_hash,
                        warnings=warnings + [w for w in summary.warnings if w not in warnings],
                        measured_by=m.measured_by)


def _serving_from_figures(m: Measured, workload: Workload, validity: str) -> ServingStats:
    """A summary-only run's serving figures, as the file reports them (a statistic it leaves out stays None)."""
    r = {k: v for k, (v, _) in m.reported.items()}
    duration = r.get("duration", 0.0)

    def stats(metric: str) -> Stats | None:
        p50 = r.get(f"median_{metric}_ms", r.get(f"p50_{metric}_ms"))
        if p50 is None:
            return None
        return Stats(count=int(r.get(f"count_{metric}", m.completed)), mean=r.get(f"mean_{metric}_ms"), std=r.get(f"std_{metric}_ms"),
                     min=r.get(f"min_{metric}_ms"), p50=p50, p90=r.get(f"p90_{metric}_ms"),
                     p95=r.get(f"p95_{metric}_ms"), p99=r.get(f"p99_{metric}_ms"), max=r.get(f"max_{metric}_ms"))

    return ServingStats(
        completed=m.completed, failed=m.failed, failures_by_cause={"error": m.failed} if m.failed else {},
        duration_s=duration, request_throughput=r.get("request_throughput", m.completed / duration if duration else 0.0),
        output_throughput=r.get("output_throughput", 0.0), total_token_throughput=r.get("total_token_throughput", 0.0),
        request_goodput=r.get("request_goodput"), ttft_ms=stats("ttft"), tpot_ms=stats("tpot"), itl_ms=stats("itl"),
        e2el_ms=stats("e2el"), send_lag_ms=None, valid=m.completed > 0, validity=validity,
        output_length_forced=workload.serve.ignore_eos, total_input_tokens=int(r.get("total_input_tokens", 0)),
        total_output_tokens=int(r.get("total_output_tokens", 0)))


