"""Serving at several loads: load-sweep (a latency-against-load table per engine) and sla (the highest load that
meets service-level objectives, per engine). Both start each engine once, or attach to it (--attach). Each
command's options are registered beside its handler (``register_<command>``, found by cli/main.py's table of
commands), as in every group of cli/."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmadapt.cli.common import add_command, attach_arg, attach_settings, emit, name_list, workload_args, workload_of
from llmadapt.errors import LlmadaptError


def _engines(args) -> list[tuple[Any, Any]]:
    """(adapter info, workload) per engine configuration: each adapter on each combination of --engine-matrix,
    every one checked before any engine starts (an engine setting an adapter does not take is one line)."""
    from llmadapt.adapter.plugins import get_adapter
    from llmadapt.analysis.labels import matrix_settings
    from llmadapt.analysis.comparison import parse_matrix
    from llmadapt.experiments.loadsweep import prepared

    if not args.adapters:
        raise LlmadaptError("name the engines: --adapters hf,vllm")
    names = name_list(args.adapters, distinct=True)
    workload = workload_of(args).with_overrides(attach_settings(args.attach, names), source="--set")
    matrix = parse_matrix(args.engine_matrix or [])
    axes = {axis: [path.strip() for path in axis.split(",")] for axis in matrix}
    for key in (path for paths in axes.values() for path in paths):
        if not key.startswith("serve.engine."):
            raise LlmadaptError(f"--engine-matrix {key!r}: only engine settings vary here (serve.engine.max_sequences, "
                                "serve.engine.prefix_caching, ...); the load is --rates or --concurrencies")
    takes = {n: set(get_adapter(n).supports.engine) for n in names}

    def taken_by(axis: str, name: str) -> bool:
        return all(path.removeprefix("serve.engine.") in takes[name] for path in axes[axis])

    out = []
    for name in names:
        # with several engines, an axis that one does not take varies on the others only (one taken by none is
        # refused below, in one line)
        dropped = [a for a in matrix if not taken_by(a, name) and any(taken_by(a, n) for n in names)]
        if dropped:
            print(f"{name} takes no {', '.join(dropped)}: varied on the other engines only", file=sys.stderr)
        mine = {a: v for a, v in matrix.items() if a not in dropped}
        out += [prepared(workload.with_overrides(sets, source="--engine-matrix"), name)
                for _, sets in matrix_settings(mine)]
    return out


def _refuse_beyond_requests(engines, kind: str, load: float, what: str) -> None:
    """More users in a closed loop than a probe's requests is the same load as one per request (all in flight at
    once): refused in one line before any engine starts."""
    from llmadapt.experiments.loadsweep import within_requests

    for _, workload in engines:  # an adapter's own --set may give it other requests
        if within_requests(workload, kind, load)[1]:
            requests = workload.serve.requests
            raise LlmadaptError(f"{what}: above serve.requests ({requests}) a closed loop has every request in flight "
                                f"at once, the same load as {requests}: keep it at most {requests} or raise "
                                "serve.requests")


def config_label(info, workload) -> str:
    """An engine configuration's name in tables: the adapter and the engine settings it was given."""
    return f"{info.name} {workload.serve.engine.label()}".strip()


def _progress(record: dict[str, Any]) -> None:
    if record.get("type") == "start":
        print(f"  {record['adapter']}: {record['label']} -> {record['run_dir']}", file=sys.stderr, flush=True)
    elif record.get("type") == "note":  # resuming an interrupted series, or where an interrupted one is
        print(f"  {record['text']}", file=sys.stderr, flush=True)


def cmd_load_sweep(args) -> int:
    from llmadapt.experiments.loadsweep import load_sweep, parse_loads

    if (args.rates is None) == (args.concurrencies is None):
        raise LlmadaptError("give the loads: --rates 1,2,4 (requests/s) or --concurrencies 1,2,4 (one of the two)")
    loads = parse_loads(args.rates, "rate") if args.rates is not None else parse_loads(args.concurrencies,
                                                                                        "concurrency")
    if args.repeat < 1:
        raise LlmadaptError(f"--repeat {args.repeat}: at least 1")
    from llmadapt.experiments.loadsweep import BEHIND_REMEDY

    latency = _pareto_metric(args.pareto)
    engines = _engines(args)
    _refuse_beyond_requests(engines, loads.kind, max(loads.values), f"--concurrencies {args.concurrencies}")
    data = []
    for info, workload in engines:
        config = config_label(info, workload)
        print(f"{config}: load sweep ({loads.kind})", file=sys.stderr, flush=True)
        folder, points = load_sweep(workload, info, loads, args.out, repeat=args.repeat, timeout=args.timeout,
                                    progress=_progress)
        data.append({"adapter": info.name, "config": config, "engine": workload.serve.engine.given(),
                     "folder": str(folder), "points": [p.to_dict() for p in points]})
    statuses = [_point_status(p) for c in data for p in c["points"]]
    _mark_frontier([p for c in data for p in c["points"]], latency)
    text = sweep_text(data, latency, args.repeat)
    if statuses and all(s == "client behind" for s in statuses):
        text += "\nevery point: client behind (exit 1): " + BEHIND_REMEDY
    elif "client behind" in statuses:
        text += "\nclient behind: " + BEHIND_REMEDY
    invalid = [s for s in statuses if s in ("FAILED", "client behind")]
    if invalid:
        text += f"\n{len(invalid)} of {len(statuses)} points have no valid result (exit 1)"
    emit(args, data, text)
    return 1 if invalid or not statuses else 0


def sweep_text(data: list[dict[str, Any]], latency: str, repeat: int = 1) -> str:
    """The sweep's table, one row per point of each engine configuration, with the points on the throughput-latency
    frontier (each point's 'frontier', output tokens/s against ``latency``: _mark_frontier) marked and listed."""
    from llmadapt.analysis.comparison import format_value
    from llmadapt.experiments.loadsweep import Load
    from llmadapt.texttable import text_table

    points = [(c["config"], p) for c in data for p in c["points"]]
    frontier = sorted((p for _, p in points if p["frontier"]), key=lambda p: p[latency])
    rows = [[config, str(Load(p["kind"], p["load"])) + (f" #{p['repeat'] + 1}" if repeat > 1 else ""),
             *(format_value(p.get(k), fmt) for k, _, fmt in _SWEEP_COLUMNS), "*" if p["frontier"] else "",
             _point_status(p)] for config, p in points]
    head = ["engine", "load", *(title for _, title, _ in _SWEEP_COLUMNS), "frontier", "status"]
    text = "\n".join(text_table(head, rows))
    text += ("\nlatencies in ms; TPOT is vLLM's (AIPerf calls it ITL); ITL here is the gap between chunks; send lag: "
             "how late the load generator sent, p99")
    if len(points) > 1:
        configs = {id(p): config for config, p in points}
        text += (f"\nfrontier (*): output tok/s against {latency.replace('_', ' ')}, the points no other beats on both: "
                 + ("; ".join(f"{configs[id(p)]} at {p['load']:g} ({p['output_throughput']:,.1f} tok/s, "
                              f"{p[latency]:.1f} ms)" for p in frontier) or "none (no valid point)"))
    return text


def _pareto_metric(text: str) -> str:
    """--pareto e2el_p99 -> the point figure 'e2el_p99_ms'; one line for a name that is none."""
    from llmadapt.experiments.loadsweep import METRICS, QUANTILES

    name = text.removesuffix("_ms")
    if name not in {f"{m}_{q}" for m in METRICS for q in QUANTILES}:
        raise LlmadaptError(f"--pareto {text!r}: a latency percentile such as e2el_p99 or ttft_p90 (metrics "
                            f"{', '.join(METRICS)}; quantiles {', '.join(QUANTILES)})")
    return f"{name}_ms"


def _mark_frontier(points: list[dict[str, Any]], latency: str) -> None:
    """Sets each point's 'frontier': output throughput against ``latency``, only valid points counting."""
    from llmadapt.analysis.pareto import on_frontier

    usable = [_point_status(p) == "ok" for p in points]
    marks = on_frontier([(p.get(latency), p.get("output_throughput")) if ok else (None, None)
                         for p, ok in zip(points, usable)])
    for p, mark in zip(points, marks):
        p["frontier"] = mark


def _point_status(f: dict[str, Any]) -> str:
    """A load point's row: ok; 'N failed' (its requests that failed or were truncated: a result, reported); FAILED
    (the run failed: no result); client behind (the load generator fell behind: it measured the client, no result)."""
    if f.get("status") not in ("ok", "degraded"):
        return "FAILED"
    if not f.get("valid"):
        return "client behind"
    if f.get("failed"):
        return f"{f['failed']} failed" + (f" ({f['truncated']} truncated)" if f.get("truncated") else "")
    return "ok"


_SWEEP_COLUMNS = [("request_throughput", "req/s", ".2f"), ("output_throughput", "out tok/s", ",.1f"),
                  ("ttft_p50_ms", "TTFT p50", ".1f"), ("ttft_p99_ms", "TTFT p99", ".1f"),
                  ("tpot_p50_ms", "TPOT p50", ".1f"), ("tpot_p99_ms", "TPOT p99", ".1f"),
                  ("itl_p99_ms", "ITL p99", ".1f"), ("e2el_p99_ms", "E2EL p99", ".1f"), ("goodput", "goodput", ".2f"),
                  ("send_lag_p99_ms", "send lag", ".2f")]


def cmd_sla(args) -> int:
    import attrs

    from llmadapt.texttable import text_table
    from llmadapt.experiments.loadsweep import Objective, sla_search

    if not args.slo:
        raise LlmadaptError("give at least one objective: --slo ttft_p99_ms<=500 (repeat for more)")
    objectives = [Objective.parse(text) for text in args.slo]
    kind = args.over
    start = args.start if args.start is not None else 1.0
    maximum = args.max if args.max is not None else (256.0 if kind == "concurrency" else 1024.0)
    if not start > 0 or maximum < start or (kind == "concurrency" and (start != int(start) or maximum != int(maximum))):
        raise LlmadaptError(f"--start {start:g} --max {maximum:g}: needs 0 < start <= max"
                            + (", whole numbers for concurrency" if kind == "concurrency" else ""))
    if not 0 < args.resolution < 1:
        raise LlmadaptError(f"--resolution {args.resolution:g}: a fraction in (0, 1), e.g. 0.1 for 10%")
    if args.repeats < 1:
        raise LlmadaptError(f"--repeats {args.repeats}: at least 1")
    engines = _engines(args)
    _refuse_beyond_requests(engines, kind, start, f"--start {start:g}")  # a --max above it: the search stops there
    results, lines, rows = [], [], []
    for info, workload in engines:
        config = config_label(info, workload)
        print(f"{config}: SLA search over {kind} ({', '.join(map(str, objectives))})", file=sys.stderr, flush=True)
        folder, r = sla_search(workload, info, objectives, kind, args.out, start=start, maximum=maximum,
                               resolution=args.resolution, repeats=args.repeats, timeout=args.timeout,
                               progress=_progress)
        results.append({"config": config, "folder": str(folder), **attrs.asdict(r)})
        unit = "req/s" if kind == "rate" else "in flight"
        rows.append([config, "-" if r.capacity is None else f"{r.capacity:g} {unit}",
                     "-" if r.above is None else f"{r.above:g}", "-" if r.boundary is None else f"{r.boundary:.3g}",
                     r.shape or "-", r.passes_at_capacity, str(len(r.probes)),
                     "-" if r.scan_probes is None else str(r.scan_probes), r.note])
        lines += ["", f"{config}: probes in order (search history: {folder / 'sla.json'})"]
        lines += text_table(["#", "phase", "load", "margin", "met", "deciding figure"],
                            [[str(i + 1), p.phase, f"{p.load:g}", f"{p.margin:+.2f}", "yes" if p.passed else "no",
                              p.why] for i, p in enumerate(r.probes)])
    head = ["engine", "capacity", "fails at", "boundary (fit)", "boundary", "passes", "probes", "scan would", "note"]
    text = "\n".join([*text_table(head, rows), *lines])
    text += ("\ncapacity: the highest load whose every probe met every objective; fails at: the lowest load above "
             "it that did not; boundary: where an isotonic fit of the margin crosses zero; margin: the worst "
             "(limit - value) / limit")
    emit(args, results, text)
    return 0 if all(r["capacity"] is not None for r in results) else 1


# -- registration: each command's options, in the order its --help lists them ----------------------------------
def _serving_args(p: argparse.ArgumentParser) -> None:
    workload_args(p)
    p.add_argument("--adapters", required=True, help="comma-separated serving adapters, e.g. hf,vllm")
    attach_arg(p)
    p.add_argument("--engine-matrix", action="append", metavar="serve.engine.NAME=V1,V2",
                   help="engine settings to vary (repeat to cross them): each combination on each adapter is an "
                        "engine started fresh and measured at every load, e.g. serve.engine.max_sequences=2,8")


def register_load_sweep(sub) -> None:
    p = add_command(sub, "load-sweep", cmd_load_sweep, "serve at several loads against each engine (started once): "
                    "a latency-against-load table; each point is a run of its own")
    _serving_args(p)
    p.add_argument("--rates", metavar="R1,R2,...|geometric:START:FACTOR[:MAX]",
                   help="request rates (requests/s, the workload's arrival process), increasing; geometric steps "
                        "continue until the engine saturates or MAX")
    p.add_argument("--concurrencies", metavar="C1,C2,...|geometric:START:FACTOR[:MAX]",
                   help="closed-loop concurrencies instead of rates")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="runs per load (default 1)")
    p.add_argument("--pareto", default="e2el_p99", metavar="METRIC_QUANTILE",
                   help="the latency the throughput frontier is drawn against (default e2el_p99; e.g. ttft_p99, "
                        "tpot_p50): points no other beats on output tok/s and that latency at once are marked *")


def register_sla(sub) -> None:
    p = add_command(sub, "sla", cmd_sla, "find each engine's highest load that meets service-level objectives "
                    "(exponential probe, bisection, repeats at the answer)")
    _serving_args(p)
    p.add_argument("--slo", action="append", metavar="METRIC_QUANTILE_ms<=LIMIT",
                   help="an objective, e.g. ttft_p99_ms<=500 or tpot_p99_ms<=50 (repeat); metrics ttft, tpot, itl, "
                        "e2el; quantiles p50, p90, p99, mean")
    p.add_argument("--over", choices=["rate", "concurrency"], default="rate",
                   help="search over request rate (default) or concurrency")
    p.add_argument("--start", type=float, default=None, help="first load probed (default 1)")
    p.add_argument("--max", type=float, default=None,
                   help="highest load probed (default 1024 req/s, 256 in flight; in flight, at most serve.requests)")
    p.add_argument("--resolution", type=float, default=0.1,
                   help="stop bisecting when the bracket is this fraction wide (default 0.1; concurrency: 1)")
    p.add_argument("--repeats", type=int, default=2, help="probes at the answer, all of which must pass (default 2)")
