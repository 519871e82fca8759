"""Reading one run folder: its summary (rebuilt from the records when it is missing or damaged), the
text ``show`` prints, and ``export`` (JSON, CSV of requests, Chrome trace for Perfetto).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.launch.summary import load_records


def read_summary(run_dir: str | Path, needs: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The run's summary.json; for a run whose orchestrator never wrote one (killed, disk full), the summary
    the records on disk give, with a warning saying so. ``needs``: the keys the caller reads (default: what
    `show` prints); a summary without one of them counts as damaged."""
    path = RunDir(run_dir).summary_file
    problem = "incomplete run: no summary.json (its orchestrator did not finish)"
    if path.is_file():
        try:
            summary = json.loads(path.read_bytes())
            missing = [k for k in (needs or _SUMMARY_KEYS) if not isinstance(summary, dict) or k not in summary]
            if not missing:
                return summary
            problem = f"summary.json lacks {', '.join(missing[:4])}"
        except (json.JSONDecodeError, UnicodeDecodeError):
            problem = "summary.json is not JSON"
    if not RunDir(run_dir).launch_file.is_file():
        raise LlmadaptError(f"{run_dir} is not a run directory" +
                            (f" ({problem}, and no launch.json to rebuild it from)" if path.is_file() else
                             " (no summary.json, no launch.json)"))
    from llmadapt.contract.schema import to_json
    from llmadapt.launch.summary import summarise

    try:
        summary = to_json(summarise(run_dir, write=False))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise LlmadaptError(f"{run_dir}: {problem}, and its launch.json cannot be read ({exc})") from None
    summary["warnings"] = [f"{problem}; this summary is built from the records on disk",
                           *summary.get("warnings", [])]
    return summary


# What show, compare and parity read from a summary: one missing means the file is damaged.
_SUMMARY_KEYS = ("run_id", "status", "adapter", "framework", "framework_version", "launcher", "workload_hash",
                 "problem_hash", "world_size", "steps_completed", "measured_steps", "losses")


# -- show and export --------------------------------------------------------------------------
def show(run_dir: str | Path) -> dict[str, Any]:
    """The run's summary (as stored), for display or further processing."""
    return read_summary(run_dir)


def render_summary(s: dict[str, Any]) -> str:
    st, tok = s.get("step_time_s"), s.get("tokens_per_s")
    lines = [
        f"run        {s['run_id']}  [{s['status']}]",
        f"adapter    {s['adapter']} ({s['framework']} {s['framework_version']}), launcher {s['launcher']}, "
        f"world size {s['world_size']}",
        f"workload   {s['workload_hash'][:12]} (problem {s['problem_hash'][:12]})",
        f"device     {s['device']['kind']}: {s['device']['name']}" if s.get("device") else "device     -",
        f"steps      {s['steps_completed']} completed, {s['measured_steps']} measured",
    ]
    if st:
        lines.append(f"step time  p50 {st['p50']:.4f} s  p90 {st['p90']:.4f} s  mean {st['mean']:.4f} s "
                     f"(std {st['std']:.4f}, n={st['count']})")
    if tok:
        lines.append(f"throughput {tok['mean']:,.0f} tokens/s, {s['samples_per_s']['mean']:.2f} samples/s")
    if s.get("peak_memory_bytes"):
        lines.append(f"memory     peak {s['peak_memory_bytes'] / 2**20:,.0f} MiB ({s['memory_kind']}), per rank: "
                     + ", ".join("-" if m is None else f"{m / 2**20:,.0f}" for m in s["peak_memory_per_rank"]))
    if s.get("losses"):
        lines.append(f"loss       {s['losses'][0]:.4f} -> {s['losses'][-1]:.4f}")
    v = s.get("serving")
    if v:
        lines.append(f"requests   {v['completed']} completed, {v['failed']} failed "
                     + (f"({', '.join(f'{k}={n}' for k, n in sorted(v['failures_by_cause'].items()))})"
                        if v["failures_by_cause"] else "") + f" in {v['duration_s']:.2f} s")
        lines.append(f"throughput {v['request_throughput']:.2f} req/s, {v['output_throughput']:,.1f} output tok/s"
                     + (f", goodput {v['request_goodput']:.2f} req/s" if v["request_goodput"] is not None else ""))
        for metric in ("ttft", "tpot", "itl", "e2el"):
            st = v[f"{metric}_ms"]
            if st:
                lines.append(f"{metric.upper():<10} p50 {st['p50']:.1f} ms  p90 {st['p90']:.1f}  p99 {st['p99']:.1f}  "
                             f"mean {st['mean']:.1f} (n={st['count']})")
        lines.append(f"output     {'forced (ignore_eos)' if v['output_length_forced'] else 'not forced: lengths as the engine chose'}")
        lines.append(f"validity   {v['validity']}")
        if v.get("loop_lag_ms"):
            lag = v["loop_lag_ms"]
            line = (f"client     event-loop lag p50 {lag['p50']:.2f} ms  p99 {lag['p99']:.2f}  max {lag['max']:.1f}; "
                    f"CPU {v['client_cpu_s']:.2f} s ({v['client_cpu_ms_per_request']:.2f} ms per request)")
            if v.get("bunched_share") is not None:
                line += f"; bunched chunks {v['bunched_share']:.0%} (engine ITL {v['engine_itl_ms']:.2f} ms)"
            lines.append(line)
    if s.get("mfu") is not None:
        lines.append(f"mfu        {s['mfu']:.1%}")
    for failure in s.get("failures", []):
        where = f"rank {failure['rank']}" if failure.get("rank") is not None else "launcher"
        lines.append(f"failure    {failure['cause']} ({where}): {failure['message'][:300]}")
    for warning in s.get("warnings", []):
        lines.append(f"warning    {warning}")
    for name, secs in s.get("phase_means_s", {}).items():
        lines.append(f"phase      {name:<24} {secs:.4f} s")
    for p in s.get("patches", []):
        lines.append(f"patch      {p['framework']}: {p['name']} ({p['kind']}) - {p['description']}")
    for f in s.get("failures", []):
        where = f"rank {f['rank']}" if f.get("rank") is not None else "launcher"
        lines.append(f"failure    {f['cause']} ({where}, step {f.get('step')}): {f['message']}")
    if s.get("breakdown"):
        lines += ["", f"breakdown  mean per profiled step and rank ({s['profiled_steps']} profiled steps, left out of "
                      "the step statistics above)", render_breakdown(s["breakdown"])]
    if s.get("breakdown_operators"):
        lines += ["", render_breakdown(s["breakdown_operators"], operators=True)]
    return "\n".join(lines)


def render_breakdown(classes: list[dict[str, Any]], *, operators: bool = False) -> str:
    """A module (or operator) class table: time, share, forward and backward (or count and FLOPs)."""
    from llmadapt.analysis.table import text_table

    total = sum(c["seconds"] for c in classes) or 1.0
    if operators:
        head = ["operator class", "ms", "share", "count", "GFLOP"]
        rows = [[c["name"], f"{c['seconds'] * 1e3:.2f}", f"{c['seconds'] / total:.1%}", str(c["count"]),
                 f"{c['flops'] / 1e9:.3f}" if c.get("flops") else "-"] for c in classes]
    else:
        head = ["module class", "ms", "share", "forward ms", "backward ms"]
        rows = [[c["name"], f"{c['seconds'] * 1e3:.2f}", f"{c['seconds'] / total:.1%}",
                 f"{c['forward_seconds'] * 1e3:.2f}", f"{c['backward_seconds'] * 1e3:.2f}"] for c in classes]
    return "\n".join(text_table(head, rows))


EXPORT_FORMATS = ("json", "csv", "chrome-trace", "vllm-bench")


def export(run_dir: str | Path, fmt: str) -> str:
    run_dir = Path(run_dir)
    if fmt not in EXPORT_FORMATS:
        raise LlmadaptError(f"unknown export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    summary = read_summary(run_dir)
    records = load_records(run_dir)
    if fmt == "json":
        return json.dumps({"summary": summary, "records": records}, indent=2)
    if fmt == "vllm-bench":
        if not summary.get("serving"):
            raise LlmadaptError("vllm-bench export is for serving runs")
        from llmadapt.contract.stats import vllm_bench_keys

        return json.dumps(vllm_bench_keys(summary), indent=2)
    if fmt == "csv" and summary.get("serving"):
        return _requests_csv([r for r in records if r["type"] == "request"])
    steps = [r for r in records if r["type"] == "step"]
    if fmt == "csv":
        phase_names = sorted({f"{p['source']}:{p['name']}" for s in steps for p in s["phases"]})
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(["rank", "step", "warmup", "seconds", "tokens", "samples", "loss", "peak_memory_bytes",
                         *[f"phase_s[{n}]" for n in phase_names]])
        for s in sorted(steps, key=lambda s: (s["step"], s["rank"])):
            phases = {f"{p['source']}:{p['name']}": p["seconds"] for p in s["phases"]}
            mem = s["memory"] or {}
            peak = mem.get("peak_allocated_bytes") if mem.get("kind") == "cuda" else mem.get("peak_rss_bytes")
            writer.writerow([s["rank"], s["step"], s["warmup"], s["seconds"], s["tokens"], s["samples"], s["loss"],
                             peak, *[phases.get(n, "") for n in phase_names]])
        return buf.getvalue()
    return json.dumps(chrome_trace(records), indent=1)


def _requests_csv(requests: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["index", "warmup", "status", "error_cause", "input_tokens", "output_tokens", "send_lag_ms",
                     "ttft_ms", "e2el_ms", "chunks", "finish_reason"])
    for r in sorted(requests, key=lambda r: r["index"]):
        sent = r["sent_ns"]

        def ms(t):
            return "" if t is None or sent is None else f"{(t - sent) / 1e6:.3f}"

        lag = "" if sent is None else f"{(sent - r['scheduled_ns']) / 1e6:.3f}"
        writer.writerow([r["index"], r["warmup"], r["status"], r["error_cause"] or "", r["input_tokens"],
                         r["output_tokens"] if r["output_tokens"] is not None else "", lag, ms(r["first_token_ns"]),
                         ms(r["end_ns"]), len(r["chunk_ns"]), r["finish_reason"] or ""])
    return buf.getvalue()


def chrome_trace(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace events (Perfetto): one track per rank, steps and spans on wall-clock time."""
    anchors = {r["rank"]: (r["wall_anchor_ns"], r["mono_anchor_ns"], r["node"]) for r in records
               if r["type"] == "header"}
    events: list[dict[str, Any]] = []

    def us(rank: int, mono_ns: int) -> float:
        wall, mono, _ = anchors[rank]
        return (mono_ns - mono + wall) / 1000.0

    for rank, (_, _, node) in anchors.items():
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} ({node})"}})
    for r in records:
        if r["type"] != "step" or r["rank"] not in anchors:
            continue
        rank = r["rank"]
        args = {"loss": r["loss"], "tokens": r["tokens"], "warmup": r["warmup"],
                **{f"{p['source']}:{p['name']}_s": p["seconds"] for p in r["phases"]}}
        events.append({"ph": "X", "name": f"step {r['step']}", "cat": "step", "pid": rank, "tid": 0,
                       "ts": us(rank, r["start_ns"]), "dur": (r["end_ns"] - r["start_ns"]) / 1000.0, "args": args})
        for sp in r["spans"]:
            events.append({"ph": "X", "name": sp["name"], "cat": sp["source"], "pid": rank, "tid": 1,
                           "ts": us(rank, sp["start_ns"]), "dur": (sp["end_ns"] - sp["start_ns"]) / 1000.0})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
