"""Reading one run folder: its summary (rebuilt from the records when it is missing or damaged), the
text ``show`` prints, and ``export`` (JSON, CSV of requests, Chrome trace for Perfetto).

It is over 400 lines because ``show``'s text renders every part of a summary, and the exports read the same records.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from llmadapt.analysis.breakdown_text import weights_lines
from llmadapt.analysis.topology import topology_line
from llmadapt.analysis.verdict import quality_line
from llmadapt.contract.rundir import RunDir
from llmadapt.contract.schema import to_json, upgrade, validate
from llmadapt.errors import ContractError, LlmadaptError
from llmadapt.contract.readback import load_records


def read_summary(run_dir: str | Path, needs: tuple[str, ...] | None = None, *, running=None) -> dict[str, Any]:
    """The run's summary.json; else (none yet, or damaged) the records' summary, its status runstatus's (running:
    does a process work in the folder, None: look), with a warning. ``needs``: the keys the caller reads (default:
    what `show` prints); a summary without one of them counts as damaged."""
    path = RunDir(run_dir).summary_file
    problem = "incomplete run: no summary.json (its orchestrator did not finish)"
    if path.is_file():
        try:
            summary = json.loads(path.read_bytes())
            missing = [k for k in (needs or _SUMMARY_KEYS) if not isinstance(summary, dict) or k not in summary]
            if not missing:  # the whole summary: each field of the type it is read as, or damaged
                return summary if needs else validate(upgrade(summary))
            problem = f"summary.json lacks {', '.join(missing[:4])}"
        except (json.JSONDecodeError, UnicodeDecodeError, ContractError) as exc:
            problem = "summary.json is " + (f"damaged ({exc})" if isinstance(exc, ContractError) else "not JSON")
    if not RunDir(run_dir).launch_file.is_file():
        raise LlmadaptError(f"{run_dir} is not a run directory" +
                            (f" ({problem}, and no launch.json to rebuild it from)" if path.is_file() else
                             " (no summary.json, no launch.json)"))
    from llmadapt.analysis.runstatus import settle_status
    from llmadapt.contract.readback import summarise

    try:
        summary = to_json(summarise(run_dir, write=False, over=path.is_file()))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise LlmadaptError(f"{run_dir}: {problem}, and its launch.json cannot be read ({exc})") from None
    return settle_status(summary, run_dir, problem, damaged=path.is_file(), running=running)


# What show, compare and parity read from a summary: one missing means the file is damaged.
_SUMMARY_KEYS = ("run_id", "status", "adapter", "framework", "framework_version", "launcher", "workload_hash",
                 "problem_hash", "world_size", "steps_completed", "measured_steps", "losses")


# -- show and export --------------------------------------------------------------------------
def show(run_dir: str | Path) -> dict[str, Any]:
    """The run's summary (as stored), for display or further processing."""
    return read_summary(run_dir)


def summary_text(summary: dict[str, Any]) -> str:
    """What ``llmadapt show`` prints, for a tracking tool to keep; a summary it cannot render comes as JSON."""
    try:
        return render_summary(summary) + "\n"
    except (KeyError, TypeError, ValueError) as exc:
        return f"(llmadapt show could not render this summary: {exc!r})\n" + json.dumps(summary, indent=1) + "\n"


def render_summary(s: dict[str, Any]) -> str:
    st, tok = s.get("step_time_s"), s.get("tokens_per_s")
    device = f"device     {s['device']['kind']}: {s['device']['name']}" if s.get("device") else "device     -"
    if s.get("role") == "serve" or (s.get("serving") and not s.get("steps_completed")):
        # a serving run has an engine and requests, no steps (and a device only where the engine reported one)
        lines = [f"run        {s['run_id']}  [{s['status']}]",
                 f"engine     {s['adapter']} ({s['framework']} {s['framework_version']}), launcher {s['launcher']}",
                 f"workload   {s['workload_hash'][:12]} (problem {s['problem_hash'][:12]})"]
        lines += [device] if s.get("device") else []
    else:
        lines = [
            f"run        {s['run_id']}  [{s['status']}]",
            f"adapter    {s['adapter']} ({s['framework']} {s['framework_version']}), launcher {s['launcher']}, "
            f"world size {s['world_size']}",
            f"workload   {s['workload_hash'][:12]} (problem {s['problem_hash'][:12]})",
            device,
            f"steps      {s['steps_completed']} completed, {s['measured_steps']} measured",
        ]
    lines += weights_lines(s.get("weights") or [])
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
        per_chunk = v.get("tokens_per_chunk")
        lines.append(f"output     {'forced (ignore_eos)' if v['output_length_forced'] else 'not forced: lengths as the engine chose'}"
                     + (f"; {per_chunk:.2f} tokens per chunk: ITL is per chunk, not per token"
                        if per_chunk and per_chunk > 1.01 else ""))
        if not v["output_length_forced"] and v.get("output_tokens"):
            n = v["output_tokens"]
            lines.append(f"out tokens p50 {n['p50']:.0f}  p90 {n['p90']:.0f}  mean {n['mean']:.1f}  max {n['max']:.0f} "
                         f"per request; {v['stopped_at_eos_share']:.0%} stopped at end-of-sequence, "
                         f"{v['hit_cap_share']:.0%} at the cap (the length asked)")
        lines.append(f"validity   {v['validity']}")
        shared, hits = v.get("stream_prefix_share"), v.get("engine_prefix_cache_hit_share")
        if shared or hits:  # a stream with shared prefixes, or an engine that found some
            lines.append("prefixes   " + (f"{shared:.1%} of the prompt tokens repeat an earlier prompt's start"
                                          if shared is not None else "the stream's shared share not known")
                         + (f"; the engine's prefix cache found {hits:.1%}" if hits is not None else
                            "; the engine reports no prefix-cache counters"))
        if v.get("loop_lag_ms"):
            lag = v["loop_lag_ms"]
            line = (f"client     event-loop lag p50 {lag['p50']:.2f} ms  p99 {lag['p99']:.2f}  max {lag['max']:.1f}; "
                    f"CPU {v['client_cpu_s']:.2f} s ({v['client_cpu_ms_per_request']:.2f} ms per request)")
            if v.get("bunched_share") is not None:
                line += f"; bunched chunks {v['bunched_share']:.0%} (engine ITL {v['engine_itl_ms']:.2f} ms)"
            lines.append(line)
    lines += [f"weights    {s['engine_weights']}"] if s.get("engine_weights") else []
    lines += [quality_line(s["quality"])] if s.get("quality") else []
    lines += [topology_line(s["topology"])] if s.get("topology") else []
    if s.get("interference"):
        lines.append(machine_line(s["interference"], "requests" if s.get("serving") else "steps"))
    if s.get("mfu") is not None:
        hfu = f", hfu {s['hfu']:.1%} (recomputation counted)" if s.get("hfu") and s["hfu"] != s["mfu"] else ""
        lines.append(f"mfu        {s['mfu']:.1%}{hfu}")
    for failure in s.get("failures", []):
        where = f"rank {failure['rank']}" if failure.get("rank") is not None else "launcher"
        if failure.get("step") is not None:
            where += f", step {failure['step']}"
        lines.append(f"failure    {failure['cause']} ({where}): {failure['message'][:300]}")
    lines += [f"warning    {warning}" for warning in s.get("warnings", [])]
    step_mean = (s.get("step_time_s") or {}).get("mean")
    for name, secs in s.get("phase_means_s", {}).items():
        share = f"  {secs / step_mean:6.1%} of the step" if step_mean else ""
        lines.append(f"phase      {name:<24} {secs:.4f} s{share}")
    for p in s.get("patches", []):
        lines.append(f"patch      {p['framework']}: {p['name']} ({p['kind']}) - {p['description']}")
    lines += [f"note       {note}" for note in s.get("notes", [])]
    if s.get("expert_imbalance"):
        lines += ["", "experts    load per MoE layer over the steps after warm-up (CV: std/mean of tokens per expert)",
                  render_imbalance(s["expert_imbalance"])]
    if s.get("evaluations"):
        lines += ["", *render_evaluations(s["evaluations"])]
    if s.get("telemetry"):
        lines += render_telemetry(s["telemetry"])
    if s.get("breakdown"):
        from llmadapt.analysis.breakdown_text import render_breakdown

        lines += ["", *render_breakdown(s["breakdown"], engine=s.get("role") == "serve")]
    return "\n".join(lines)


def machine_line(i: dict[str, Any], what: str = "steps") -> str:
    """'machine    quiet ...' or 'machine    DISTURBED: <cause>; ...', with what was measured."""
    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)
    steps = (f" (the training thread's, of a step: median {i['step_wait_share_median']:.1%}, worst "
             f"{i['step_wait_share_max']:.1%})" if i.get("step_wait_share_max") is not None else "")
    measured = (f"load {num(i['load_start'], '.2f')} -> {num(i['load_end'], '.2f')}, other processes "
                f"{num(i['other_cpu_cores'], '.2f')} cores, waits for a core {num(i['run_delay_share'], '.1%')} of "
                f"the threads' time{steps}")
    if i["quiet"] is None and i["other_cpu_cores"] is None and what == "requests":
        return ("machine    not judged: the engine's CPU is not known (an engine attached by URL, or one whose "
                f"process group was not recorded), so other processes' CPU cannot be told from it ({measured})")
    if i["quiet"] is None:
        return f"machine    not judged: the measured {what} took under half a second ({measured})"
    if i["quiet"]:
        return f"machine    quiet during the measured {what} ({measured})"
    return f"machine    DISTURBED during the measured {what}: {'; '.join(i['causes'])} ({measured})"


def render_imbalance(layers: list[dict[str, Any]]) -> str:
    from llmadapt.texttable import text_table

    head = ["layer", "CV mean", "CV max", "max/mean", "max/mean worst", "idle experts", "idle worst"]
    rows = [[str(x["layer"]), f"{x['cv']:.3f}", f"{x['cv_max']:.3f}", f"{x['max_over_mean']:.2f}",
             f"{x['max_over_mean_max']:.2f}", f"{x['idle_experts']:.2f}", str(x["idle_experts_max"])] for x in layers]
    return "\n".join(text_table(head, rows))


def render_evaluations(points: list[dict[str, Any]]) -> list[str]:
    """The held-out figures at each evaluation; for MoE models, each layer's expert load before and after."""
    from llmadapt.texttable import text_table
    from llmadapt.contract.breakdowns import imbalance

    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"evaluation {points[0]['examples']} held-out examples, {points[0]['tokens']} scored tokens "
             "(step 0: before training)"]
    if points[0].get("split"):
        counts = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in (points[0].get("split_counts") or {}).items())
        lines.append(f"split      {points[0]['split']}" + (f" ({counts})" if counts else ""))
    head = ["step", "loss", "perplexity", "token acc", "exact match", "choice acc", "seconds"]
    rows = [[str(e["step"]), f"{e['loss']:.4f}", f"{e['perplexity']:.3g}", f"{e['token_accuracy']:.3f}",
             fmt(e.get("exact_match"), ".3f"), fmt(e.get("choice_accuracy"), ".3f"), f"{e['seconds']:.2f}"]
            for e in points]
    lines += text_table(head, rows)
    first, last = points[0], points[-1]
    if first.get("expert_load") and last.get("expert_load") and last is not first:
        lines += ["", f"experts    share of routed tokens per expert on the held-out examples, step {first['step']} "
                  f"-> step {last['step']} (CV: std/mean of tokens per expert)"]
        rows = []
        for layer, (before, after) in enumerate(zip(first["expert_load"], last["expert_load"])):
            shares = [f"{b / max(sum(before), 1):.2f}->{a / max(sum(after), 1):.2f}" for b, a in zip(before, after)]
            cvs = [imbalance(x) for x in (before, after)]
            rows.append([str(layer), *(fmt(c[0] if c else None, ".3f") for c in cvs), "  ".join(shares)])
        lines += text_table(["layer", "CV before", "CV after", "share per expert"], rows)
    return lines


def render_telemetry(t: dict[str, Any]) -> list[str]:
    def per_rank(values, fmt) -> str:
        return ", ".join("-" if v is None else format(v, fmt) for v in values)

    lines = [f"telemetry  {t['samples']} samples every {t['interval_s']:g} s ({t['source']}): CPU % of one core per "
             f"rank {per_rank(t['cpu_percent_per_rank'], '.0f')}; peak RSS MiB "
             + per_rank([None if b is None else b / 2**20 for b in t["peak_rss_bytes_per_rank"]], ",.0f")]
    if any(v is not None for v in t["gpu_util_percent_per_rank"]):
        lines.append(f"gpu        utilisation % per rank {per_rank(t['gpu_util_percent_per_rank'], '.0f')}; power W "
                     f"{per_rank(t['power_w_per_rank'], '.0f')}")
    if t.get("energy_j") is not None:
        lines.append(f"energy     {t['energy_j']:,.1f} J over the measured steps, "
                     + (f"{t['joules_per_token']:.4g} J per token" if t.get("joules_per_token") else "no tokens"))
    lines += [f"not measured {u}" for u in t.get("unavailable", [])]
    return lines


EXPORT_FORMATS = ("json", "csv", "breakdown-csv", "evaluation-csv", "chrome-trace", "vllm-bench")


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
    if fmt == "breakdown-csv":
        return _breakdown_csv([r for r in records if r["type"] == "breakdown"])
    if fmt == "evaluation-csv":
        return _evaluation_csv([r for r in records if r["type"] == "evaluation"])
    steps = [r for r in records if r["type"] == "step"]
    if fmt == "csv":
        return _steps_csv(steps)
    return json.dumps(chrome_trace(records, run_dir), indent=1)


def _steps_csv(steps: list[dict[str, Any]]) -> str:
    """One row per rank and step; MoE runs add each layer's expert imbalance (CV, max/mean, idle experts)."""
    from llmadapt.contract.breakdowns import imbalance

    phase_names = sorted({f"{p['source']}:{p['name']}" for s in steps for p in s["phases"]})
    layers = max((len(s["expert_load"] or []) for s in steps), default=0)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["rank", "step", "warmup", "profiled", "seconds", "tokens", "samples", "loss", "peak_memory_bytes",
                     *[f"phase_s[{n}]" for n in phase_names],
                     *[f"expert_{k}[{i}]" for i in range(layers) for k in ("cv", "max_over_mean", "idle")]])
    for s in sorted(steps, key=lambda s: (s["step"], s["rank"])):
        phases = {f"{p['source']}:{p['name']}": p["seconds"] for p in s["phases"]}
        mem = s["memory"] or {}
        peak = mem.get("peak_allocated_bytes") if mem.get("kind") == "cuda" else mem.get("peak_rss_bytes")
        experts = []
        for i in range(layers):
            load = (s["expert_load"] or [])[i] if i < len(s["expert_load"] or []) else None
            figures = imbalance(load) if load else None
            experts += ["", "", ""] if figures is None else [f"{figures[0]:.6g}", f"{figures[1]:.6g}", figures[2]]
        writer.writerow([s["rank"], s["step"], s["warmup"], s.get("profiled", False), s["seconds"], s["tokens"],
                         s["samples"], s["loss"], peak, *[phases.get(n, "") for n in phase_names], *experts])
    return buf.getvalue()


def _evaluation_csv(points: list[dict[str, Any]]) -> str:
    """One row per evaluation; MoE models add one row per layer and expert with its tokens on the held-out
    examples (long form: the before/after shift in routing is a pivot away)."""
    if not points:
        raise LlmadaptError("no evaluation in this run: set eval.examples (docs/workloads.md)")
    buf = io.StringIO()
    writer = csv.writer(buf)
    figures = ["examples", "tokens", "loss", "perplexity", "token_accuracy", "exact_match", "choice_accuracy",
               "seconds"]
    writer.writerow(["step", "table", *figures, "layer", "expert", "expert_tokens", "near_ties"])
    for e in sorted(points, key=lambda e: e["step"]):
        writer.writerow([e["step"], "evaluation", *("" if e.get(k) is None else e[k] for k in figures), "", "", "", ""])
        ties = e.get("expert_near_ties") or []
        for layer, counts in enumerate(e.get("expert_load") or []):
            for expert, tokens in enumerate(counts):
                writer.writerow([e["step"], "expert_load", *[""] * len(figures), layer, expert, tokens,
                                 ties[layer] if layer < len(ties) else ""])
    return buf.getvalue()


def _breakdown_csv(breakdowns: list[dict[str, Any]]) -> str:
    """Every profiled (rank, step) in long form: one row per module class, operator class, layer, collective and
    timeline figure."""
    if not breakdowns:
        raise LlmadaptError("no breakdown in this run: profile steps with profile.steps (docs/breakdown.md)")
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["rank", "step", "table", "name", "seconds", "forward_seconds", "backward_seconds", "count",
                     "flops", "bytes", "busbw_gbytes_per_s", "algorithm"])
    for b in sorted(breakdowns, key=lambda b: (b["step"], b["rank"])):
        head = [b["rank"], b["step"]]
        if b.get("error"):
            writer.writerow([*head, "error", b["error"], "", "", "", "", "", "", "", ""])
            continue
        for table, key in (("module", "modules"), ("operator", "operators"), ("module_operator", "module_operators")):
            for c in b.get(key, []):
                writer.writerow([*head, table, c["name"], c["seconds"], c["forward_seconds"], c["backward_seconds"],
                                 c["count"], c["flops"] if c["flops"] is not None else "", "", "", ""])
        for x in b["layers"]:
            writer.writerow([*head, "layer", x["layer"], x["forward_seconds"] + x["backward_seconds"],
                             x["forward_seconds"], x["backward_seconds"], "", "", "", "", ""])
        for c in b["collectives"]:
            writer.writerow([*head, "collective", c["kind"], c["seconds"], "", "", c["count"], "",
                             "" if c["bytes"] is None else c["bytes"],
                             "" if c["busbw_gbytes_per_s"] is None else c["busbw_gbytes_per_s"], c["algorithm"] or ""])
        for name in ("step_seconds", "compute_seconds", "comm_seconds", "overlapped_comm_seconds", "idle_seconds"):
            writer.writerow([*head, "timeline", name.removesuffix("_seconds"), b[name], "", "", "", "", "", "", ""])
    return buf.getvalue()


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


def chrome_trace(records: list[dict[str, Any]], run_dir: Path | None = None) -> dict[str, Any]:
    """Chrome trace events (Perfetto): one process per rank, steps and spans on wall-clock time; with the run
    folder, the profiler's timelines of profiled steps (level full) merged in, each placed so that its
    ProfilerStep#N range starts where the core's clock started that step."""
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
    if run_dir is not None:
        starts = {(r["rank"], r["step"]): r["start_ns"] for r in records if r["type"] == "step"}
        for b in (r for r in records if r["type"] == "breakdown" and r.get("trace") and r["rank"] in anchors):
            key = (b["rank"], b["step"])
            path = Path(run_dir) / b["trace"]
            if key not in starts or not path.is_file():
                continue
            events += _profiler_events(json.loads(path.read_text()), b["rank"], us(b["rank"], starts[key]))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _profiler_events(trace: dict[str, Any], rank: int, step_start_us: float) -> list[dict[str, Any]]:
    """A Kineto trace's complete events as rank RANK's, shifted onto the run's wall clock."""
    timed = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    mark = next((e for e in timed if str(e.get("name", "")).startswith("ProfilerStep#")), None)
    if mark is None:
        return []
    shift = step_start_us - float(mark["ts"])
    return [{"ph": "X", "name": e["name"], "cat": f"profiler:{e.get('cat', '')}", "pid": rank,
             "tid": f"profiler {e.get('tid')}", "ts": float(e["ts"]) + shift, "dur": e.get("dur", 0),
             "args": e.get("args", {})} for e in timed]
