"""Command line for micro-benchmarks, the analytical model, Study B's model and the max batch search.

Each command's options are registered beside its handler (``register_<command>``, found by cli/main.py's table of
commands; a subcommand's by a function of its own), as in every group of cli/. Each command is one Python call and
takes ``--json``; table-like results also take ``--csv FILE``, and ``--record FILE`` appends the contract record
(estimate, fit, validation) to a JSONL file.

Size: over 400 lines because each perf command (micro, estimate, devices, maxbatch, studyb) keeps its
arguments and their help text beside its handler.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from llmadapt.cli.common import add_command, emit, workload_of
from llmadapt.errors import LlmadaptError, not_a_file


def _write(path: str | None, text: str) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        print(f"wrote {path}", file=sys.stderr)


def _record(path: str | None, record) -> None:
    if path:
        from llmadapt.contract.jsonl import JsonlWriter
        from llmadapt.contract.schema import to_json, validate

        validate(to_json(record))
        with JsonlWriter(path) as w:
            w.write(record)
        print(f"appended a {record.type} record to {path}", file=sys.stderr)


def _csv_text(head: list[str], rows: list[list[Any]]) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(head)
    w.writerows(rows)
    return buf.getvalue()


def _log(args):
    return None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))


def _micro_progress(record: dict[str, Any]) -> None:
    if record.get("type") == "start":
        print(f"micro {record['suite']} ({record['world_size']} rank(s)) -> {record['run_dir']}", file=sys.stderr,
              flush=True)
    elif record.get("type") == "op_bench" and record.get("seconds"):
        print(f"  {record['op']:<14} {record['direction']:<8} {record.get('backend') or '':<9} "
              f"{record['seconds']['p50'] * 1e6:,.1f} us", file=sys.stderr, flush=True)
    elif record.get("type") == "comm":
        print(f"  {record['op']:<14} {record['message_bytes']:>12,} B  busbw {record['busbw_gbytes_per_s']:.3f} GB/s",
              file=sys.stderr, flush=True)
    elif record.get("type") == "failure":
        print(f"  failure: {record['cause']}: {record['message']}", file=sys.stderr, flush=True)


# -- micro ------------------------------------------------------------------------------------------
def _timing(args) -> dict[str, float]:
    t: dict[str, float] = {}
    if args.repeats is not None:
        t["repeats"] = args.repeats
    if args.min_time is not None:
        t["min_time_s"] = args.min_time
    return t


def _finish_micro(args, result) -> int:
    from llmadapt.experiments.micro import save_measured_device

    if getattr(args, "save", None):
        path = save_measured_device(args.save, result, price_per_hour=getattr(args, "price", None),
                                    path=getattr(args, "catalog_file", None))
        print(f"saved device {args.save!r} to {path}", file=sys.stderr)
    _write(args.csv, result.csv())
    emit(args, result.to_dict(), result.table())
    return 0 if result.status == "ok" else 1


def cmd_micro_ops(args) -> int:
    from llmadapt.experiments.micro import micro_ops

    ops = [o.strip() for o in args.ops.split(",")] if args.ops else None
    result = micro_ops(workload_of(args, runs_adapters=False), dtype=args.dtype, ops=ops, backward=not args.forward_only,
                       peak=not args.no_peak, timing=_timing(args), out=args.out, timeout=args.timeout,
                       progress=None if args.json else _micro_progress)
    return _finish_micro(args, result)


def cmd_micro_peak(args) -> int:
    from llmadapt.experiments.micro import micro_peak, parse_size

    dtypes = [d.strip() for d in args.dtypes.split(",")] if args.dtypes else None
    sizes = [int(s) for s in args.gemm_sizes.split(",")] if args.gemm_sizes else None
    result = micro_peak(dtypes=dtypes, timing=_timing(args), gemm_sizes=sizes,
                        copy_bytes=parse_size(args.copy_size) if args.copy_size else None, out=args.out,
                        timeout=args.timeout, progress=None if args.json else _micro_progress)
    return _finish_micro(args, result)


def cmd_micro_comm(args) -> int:
    from llmadapt.experiments.micro import micro_comm, parse_sizes

    ops = [o.strip() for o in args.ops.split(",")] if args.ops else None
    result = micro_comm(ranks=args.ranks, ops=ops, sizes=parse_sizes(args.sizes) if args.sizes else None,
                        iters=args.iters, out=args.out, timeout=args.timeout,
                        progress=None if args.json else _micro_progress)
    return _finish_micro(args, result)


def cmd_micro_show(args) -> int:
    from llmadapt.analysis.perf.micro import read_micro

    result = read_micro(args.run)
    _write(args.csv, result.csv())
    emit(args, result.to_dict(), result.table())
    return 0


# -- estimate ---------------------------------------------------------------------------------------
def _options(args):
    from llmadapt.analysis.perf.estimate import Options
    from llmadapt.experiments.micro import parse_size

    master = None if args.master_weights == "auto" else args.master_weights == "on"
    return Options(master_weights=master, price_per_hour=args.price, queries=args.queries, epochs=args.epochs,
                   runtime_overhead_bytes=parse_size(args.runtime_memory) if args.runtime_memory else None)


def cmd_estimate(args) -> int:
    import attrs

    from llmadapt.analysis.perf import calibration, render
    from llmadapt.analysis.perf.estimate import estimate
    from llmadapt.contract.schema import to_json

    catalog = args.catalog or []
    if sum(bool(x) for x in (args.calibrate, args.validate, args.workload)) != 1:
        raise LlmadaptError("give a WORKLOAD to estimate, or --calibrate DIR..., or --validate RUN...")
    if args.calibrate:
        dirs = args.calibrate
        micro = [_is_micro(d) for d in dirs]
        if any(micro) and not all(micro):
            raise LlmadaptError("--calibrate takes either measured runs or micro-benchmark runs, not both")
        if all(micro):
            fit = calibration.calibrate_from_micro(dirs, args.device, catalog=catalog)
        else:
            fit = calibration.calibrate_from_runs(dirs, args.device, statistic=args.statistic, catalog=catalog,
                                          options=_options(args), best_of_repeats=args.best_of_repeats)
        path = calibration.save_calibration(fit, args.save)
        _record(args.record, fit)
        _write(args.csv, _csv_text(*render.csv_rows(fit)))
        emit(args, {"calibration": str(path), "fit": to_json(fit)},
              render.render_fit(fit) + f"\nsaved      {path} (used by estimate/validate for {fit.device})")
        return 0
    if args.validate:
        v = calibration.validate(args.validate, args.device, calibration=args.calibration, statistic=args.statistic,
                         catalog=catalog, options=_options(args), best_of_repeats=args.best_of_repeats)
        _record(args.record, v)
        _write(args.csv, _csv_text(*render.csv_rows(v)))
        emit(args, attrs.asdict(v), render.render_validation(v))
        return 0
    if not args.device:
        raise LlmadaptError("--device NAME is needed (the catalog: `llmadapt devices`)")
    e = estimate(workload_of(args, runs_adapters=False), args.device, options=_options(args), calibration=args.calibration,
                     catalog=catalog)
    _record(args.record, e)
    _write(args.csv, _csv_text(*render.csv_rows(e)))
    emit(args, to_json(e), render.render(e))
    return 0


def _is_micro(d: str) -> bool:
    from llmadapt.contract.rundir import RunDir

    p = RunDir(d).launch_file
    if not p.is_file():
        raise LlmadaptError(f"{d} is not a run directory (no launch.json)")
    return RunDir(d).read_launch().kind == "micro"


def cmd_devices(args) -> int:
    from llmadapt.contract.catalog import load_catalog

    cat = load_catalog(args.catalog or [])
    rows = [d.to_dict() for d in cat.values()]
    lines = [f"{'name':<14} {'kind':<4} {'memory GB':>9} {'bw GB/s':>8} {'bf16 TFLOP/s':>12} {'fp32 TFLOP/s':>12} "
             f"{'$/h':>6}  origin"]
    for d in cat.values():
        def tf(k):
            v = d.peak(k)
            return f"{v / 1e12:,.3f}" if v else "-"
        lines.append(f"{d.name:<14} {d.kind:<4} {(d.memory_bytes or 0) / 1e9:>9,.1f} "
                     f"{(d.memory_bandwidth or 0) / 1e9:>8,.1f} {tf('bf16'):>12} {tf('fp32'):>12} "
                     f"{'-' if d.price_per_hour is None else format(d.price_per_hour, '.2f'):>6}  {d.origin}")
    emit(args, rows, "\n".join(lines))
    return 0


# -- maxbatch ---------------------------------------------------------------------------------------
def cmd_maxbatch(args) -> int:
    from llmadapt.experiments.maxbatch import maxbatch
    from llmadapt.experiments.micro import parse_size

    result = maxbatch(workload_of(args), args.adapter,
                      memory_limit_bytes=parse_size(args.memory_limit) if args.memory_limit else None,
                      start=args.start, max_batch=args.max_batch, steps=args.steps, warmup_steps=args.warmup_steps,
                      out=args.out, timeout=args.timeout, launcher=args.launcher, log=_log(args))
    _write(args.csv, result.csv())
    emit(args, result.to_dict(), result.table())
    return 0 if result.ok else 1


# -- Study B ----------------------------------------------------------------------------------------
def cmd_studyb_fit_throughput(args) -> int:
    from llmadapt.analysis.perf import studyb

    points: list[tuple[float, float, float]] = []
    if args.reference:
        points += studyb.REFERENCE_POINTS
    for item in args.inputs:
        if Path(item).is_dir():
            points += studyb.throughput_points_from_runs([item])
        else:
            points += [(p["batch"], p["sparsity"], p["throughput"])
                       for p in studyb.read_points(item, ("batch", "sparsity", "throughput"))]
    source = ", ".join((["Study B's published points (Mixtral, A40)"] if args.reference else []) + list(args.inputs)) or "no data"
    fit = studyb.fit_throughput(points, args.c3, source=source)
    return _finish_fit(args, fit)


def cmd_studyb_fit_maxbatch(args) -> int:
    from llmadapt.analysis.perf import studyb

    points: list[dict[str, float]] = []
    for item in args.inputs:
        if Path(item).is_dir():
            points += studyb.maxbatch_points([item])
        else:
            points += studyb.read_points(item, ("gpu_mem_gb", "max_batch", "seq_len", "sparsity"))
    fit = studyb.fit_max_batch(points, c1=args.c1, model_mem_gb=args.model_mem,
                               source=", ".join(args.inputs) or "no data")
    return _finish_fit(args, fit)


def _finish_fit(args, fit) -> int:
    from llmadapt.analysis.perf.render import csv_rows, render_fit
    from llmadapt.contract.schema import to_json

    _record(args.record, fit)
    _write(args.csv, _csv_text(*csv_rows(fit)))
    extra = f"\nRMSE {fit.rmse:.4f} {fit.unit}" + (f" ({fit.note})" if fit.note else "")
    emit(args, to_json(fit), render_fit(fit) + extra)
    return 0


def cmd_studyb_cost(args) -> int:
    from llmadapt.analysis.perf import studyb
    from llmadapt.contract.catalog import find_device

    if (args.throughput is None) == (args.fit is None):
        raise LlmadaptError("give the throughput: --throughput Q (queries/s), or --fit FILE with --batch "
                            "(and --sparsity) to take it from a fitted Eq. 2")
    if args.throughput is not None:
        q = args.throughput
    else:
        fit = _read_fit(args.fit, "studyb-eq2")
        if fit is None:
            raise LlmadaptError(f"{args.fit} is not an Eq. 2 fit record (llmadapt studyb fit-throughput --record)")
        if args.batch is None:
            raise LlmadaptError("--fit needs --batch (e.g. the max batch from Eq. 1 or llmadapt maxbatch)")
        c = {**fit["coefficients"], **fit["fixed"]}
        q = studyb.throughput(args.batch, args.sparsity, c["C4"], c["C2"], c["C3"])
    if (args.price is None) == (args.device is None):
        raise LlmadaptError("give the price: --price DOLLARS_PER_HOUR or --device NAME (from the catalog)")
    if args.price is not None:
        price, source = args.price, "given"
    else:
        dev = find_device(args.device, extra=args.catalog or [])
        if dev.price_per_hour is None:
            raise LlmadaptError(f"device {dev.name!r} has no price in the catalog: pass --price")
        price, source = dev.price_per_hour, dev.source_of("price_per_hour")
    dollars = studyb.cost(args.queries, args.epochs, q, price)
    hours = args.queries * args.epochs / q / 3600
    data = {"queries": args.queries, "epochs": args.epochs, "queries_per_s": q, "hours": hours,
            "price_per_hour": price, "price_source": source, "cost": dollars}
    emit(args, data, f"{args.queries:,.0f} queries x {args.epochs:g} epochs at {q:.4g} queries/s = {hours:.2f} h "
                      f"x ${price:.2f}/h ({source}) = ${dollars:.2f}")
    return 0


def _read_fit(path: str, model: str) -> dict | None:
    """A fit record from a JSON file, or the last one of that model in a JSONL file."""
    p = Path(path)
    if not p.is_file():
        raise LlmadaptError(f"{path}: {not_a_file(path)}")
    text = p.read_text()
    try:
        records = [json.loads(text)]
    except json.JSONDecodeError:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    found = [r for r in records if isinstance(r, dict) and r.get("type") == "fit" and r.get("model") == model]
    return found[-1] if found else None


def cmd_studyb_reproduce(args) -> int:
    from llmadapt.analysis.perf import studyb
    from llmadapt.contract.schema import to_json

    r = studyb.reproduce()
    fit = r["eq2_fit"]
    c = fit.coefficients
    lines = [f"Eq. 2 on Study B's Mixtral/A40 data, C3 = {fit.fixed['C3']}: C4 = {c['C4']:.4f}, C2 = {c['C2']:.4f}, "
             f"RMSE = {fit.rmse:.4f} queries/s (seeds: C4 = 0.3169, C2 = 0.2808, RMSE = 0.0547)"]
    for mem, v in r["eq1_projections"].items():
        lines.append(f"Eq. 1 (C0 62, C1 0.89, model 23.35 GB, seq 512, sparsity 0.25) at {mem}: "
                     f"{v['continuous']:.2f} -> floor {v['floor']}, round {v['round']}")
    for row in r["table_iv"]:
        lines.append(f"Table IV {row['gpu']:<10} batch {row['max_batch']:>2}  {row['queries_per_s']:.2f} q/s  "
                     f"${row['price_per_hour']:.2f}/h  15,000 queries x 10 epochs -> ${row['cost']:.2f} "
                     f"(table: ${row['table_cost']:.1f})")
    data = {**r, "eq2_fit": to_json(fit)}
    emit(args, data, "\n".join(lines))
    return 0


# -- registration: each command's options, in the order its --help lists them ----------------------------------
def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="workload file (.toml, .yaml, .json)")
    p.add_argument("--set", action="append", metavar="PATH=VALUE", help="override a field, e.g. train.seq_len=128")


def _out_args(p: argparse.ArgumentParser, default_out: str = "runs") -> None:
    p.add_argument("--out", default=default_out, help=f"folder for the run directory (default: ./{default_out})")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the worker is stopped")
    p.add_argument("--csv", metavar="FILE", help="also write the results as CSV")


def _timing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=None, help="measured calls per benchmark (at least)")
    p.add_argument("--min-time", type=float, default=None, help="seconds of measured calls per benchmark (at least)")


def register_micro(sub) -> None:
    micro = sub.add_parser("micro", help="micro-benchmarks: operators, device peaks, collectives",
                           description="micro-benchmarks in the reference adapter's environment")
    msub = micro.add_subparsers(dest="micro_command", required=True, metavar="SUITE")
    for register in (_register_micro_ops, _register_micro_peak, _register_micro_comm, _register_micro_show):
        register(msub)


def _register_micro_ops(msub) -> None:
    p = add_command(msub, "ops", cmd_micro_ops, "operators with a workload's shapes, forward and backward, on the "
                                                "measured roofline")
    _workload_args(p)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="default: the workload's precision")
    p.add_argument("--ops", help="comma-separated subset of: qkv, output, fc1, fc2, lm_head, attention, rmsnorm, "
                                 "rotary, swiglu, moe_router, moe_dispatch, cross_entropy")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--no-peak", action="store_true", help="skip measuring the device's peaks first")
    p.add_argument("--save", metavar="NAME", help="save the measured peaks as device NAME in the user catalog")
    p.add_argument("--price", type=float, help="price per hour to save with --save")
    p.add_argument("--catalog-file", help="catalog file --save writes (default: $LLMADAPT_HOME/devices.toml)")
    _timing_args(p)
    _out_args(p)


def _register_micro_peak(msub) -> None:
    p = add_command(msub, "peak", cmd_micro_peak, "measure the device's peaks: GEMM FLOP/s per dtype, memory "
                                                  "bandwidth")
    p.add_argument("--dtypes", help="comma-separated (default: fp32,bf16 on CPU; fp32,tf32,bf16,fp16 on GPU)")
    p.add_argument("--gemm-sizes", help="comma-separated square GEMM sizes (default: 256,512,1024 CPU; "
                                        "2048,4096,8192 GPU)")
    p.add_argument("--copy-size", help="buffer for the bandwidth copy (default: 128M CPU, 2G GPU)")
    p.add_argument("--save", metavar="NAME", help="save as device NAME in the user catalog (CPUs: how they are "
                                                  "described)")
    p.add_argument("--price", type=float, help="price per hour to save with --save")
    p.add_argument("--catalog-file", help="catalog file --save writes (default: $LLMADAPT_HOME/devices.toml)")
    _timing_args(p)
    _out_args(p)


def _register_micro_comm(msub) -> None:
    p = add_command(msub, "comm", cmd_micro_comm, "collectives over message sizes across ranks (gloo on CPU, NCCL on "
                                                  "GPU): algbw and busbw, nccl-tests conventions")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ops", help="comma-separated subset of: all_reduce, all_gather, reduce_scatter, all_to_all, "
                                 "broadcast")
    p.add_argument("--sizes", help="message sizes: '1K..16M' (x4 steps; '1K..16M:x2'), or '1K,1M' (default 1K..16M)")
    p.add_argument("--iters", type=int, default=5, help="measured iterations per size")
    p.add_argument("--save", metavar="NAME", help="save the best all_reduce busbw as device NAME's interconnect")
    p.add_argument("--catalog-file", help="catalog file --save writes (default: $LLMADAPT_HOME/devices.toml)")
    _out_args(p)


def _register_micro_show(msub) -> None:
    p = add_command(msub, "show", cmd_micro_show, "show a micro-benchmark run (rebuilt from its records)")
    p.add_argument("run", help="micro-benchmark run directory")
    p.add_argument("--csv", metavar="FILE", help="also write the results as CSV")


def register_estimate(sub) -> None:
    p = add_command(sub, "estimate", cmd_estimate, "analytical model: memory, FLOPs, step time, max batch and cost of "
                                                   "a workload on a device; --calibrate, --validate")
    p.add_argument("workload", nargs="?", help="workload file (.toml, .yaml, .json)")
    p.add_argument("--set", action="append", metavar="PATH=VALUE", help="override a field")
    p.add_argument("--device", help="device name or alias from the catalog (`llmadapt devices`)")
    p.add_argument("--catalog", action="append", metavar="FILE", help="extra device catalog file (repeatable)")
    p.add_argument("--calibration", metavar="FILE", help="efficiency factors from --calibrate (default: the device's "
                                                         "saved calibration, else the defaults)")
    p.add_argument("--calibrate", nargs="+", metavar="DIR", help="fit the efficiency factors to measured runs or "
                                                                 "micro ops runs")
    p.add_argument("--save", metavar="FILE", help="where --calibrate writes (default: "
                                                  "$LLMADAPT_HOME/calibration/DEVICE.json)")
    p.add_argument("--validate", nargs="+", metavar="RUN", help="compare predictions with measured runs: error per "
                                                                "run and MAPE")
    p.add_argument("--statistic", choices=["p50", "mean", "min"], default="p50",
                   help="measured step time to use (min: the least disturbed step, for a shared machine)")
    p.add_argument("--best-of-repeats", action="store_true",
                   help="runs of one workload count once, by the least disturbed (lowest statistic) of them")
    p.add_argument("--price", type=float, help="price per device-hour (overrides the catalog)")
    p.add_argument("--queries", type=float, help="fine-tuning job: queries (samples) per epoch")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--master-weights", choices=["auto", "on", "off"], default="auto",
                   help="fp32 master weights and Adam states (16 bytes/param); auto: on with ZeRO and bf16/fp16")
    p.add_argument("--runtime-memory", metavar="SIZE", help="memory the runtime takes before the model (default: "
                                                            "calibration, catalog, else 1G on GPU)")
    p.add_argument("--csv", metavar="FILE", help="also write the result as CSV")
    p.add_argument("--record", metavar="FILE", help="append the contract record to this JSONL file")


def register_devices(sub) -> None:
    p = add_command(sub, "devices", cmd_devices, "list the device catalog (shipped and user entries)")
    p.add_argument("--catalog", action="append", metavar="FILE", help="extra device catalog file (repeatable)")


def register_maxbatch(sub) -> None:
    p = add_command(sub, "maxbatch", cmd_maxbatch, "largest per-rank batch that fits, by real probes in isolated "
                                                   "workers (grow, then bisect)")
    _workload_args(p)
    p.add_argument("--adapter", default="torch")
    p.add_argument("--memory-limit", metavar="SIZE", help="per-worker address-space cap (RLIMIT_AS), e.g. 2G: "
                                                          "required on CPU")
    p.add_argument("--start", type=int, default=1, help="first batch probed (default 1)")
    p.add_argument("--max-batch", type=int, default=1024, help="largest batch probed (default 1024)")
    p.add_argument("--steps", type=int, default=2, help="steps each probe runs (default 2)")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--launcher", default="auto", choices=["auto", "subprocess", "torchrun"])
    _out_args(p)


def register_studyb(sub) -> None:
    studyb = sub.add_parser("studyb", help="Study B's model: Eq. 1 (max batch), Eq. 2 (throughput), cost",
                            description="Study B (arXiv 2408.04693): fit Eq. 1 and Eq. 2, cost a fine-tuning job")
    ssub = studyb.add_subparsers(dest="studyb_command", required=True, metavar="ACTION")
    for register in (_register_studyb_fit_throughput, _register_studyb_fit_maxbatch, _register_studyb_cost):
        register(ssub)
    add_command(ssub, "reproduce", cmd_studyb_reproduce, "reproduce Study B (arXiv 2408.04693): the Eq. 2 fit, Eq. 1 "
                                                         "projections, Table IV")


def _register_studyb_fit_throughput(ssub) -> None:
    p = add_command(ssub, "fit-throughput", cmd_studyb_fit_throughput, "fit Eq. 2 (C4, C2; C3 fixed) to a "
                                                                       "batch-size sweep")
    p.add_argument("inputs", nargs="*", help="run directories, or CSV/JSON files with batch,sparsity,throughput")
    p.add_argument("--reference", action="store_true", help="include Study B's published Mixtral/A40 points (arXiv "
                                                            "2408.04693)")
    p.add_argument("--c3", type=float, default=1.8, help="MoE attenuation (1.8 Mixtral, 2.5 BlackMamba)")
    p.add_argument("--csv", metavar="FILE")
    p.add_argument("--record", metavar="FILE", help="append the fit record to this JSONL file")


def _register_studyb_fit_maxbatch(ssub) -> None:
    p = add_command(ssub, "fit-maxbatch", cmd_studyb_fit_maxbatch, "fit Eq. 1 (C0; C1 and model memory when the data "
                                                                   "allow) to measured max batch sizes")
    p.add_argument("inputs", nargs="*", help="maxbatch result directories, or CSV/JSON files with "
                                             "gpu_mem_gb,max_batch,seq_len,sparsity[,model_mem_gb]")
    p.add_argument("--c1", type=float, help="MoE coefficient, when the data have one sparsity (Mixtral: 0.89)")
    p.add_argument("--model-mem", type=float, help="model memory in GB (fitted when omitted and the data span "
                                                   "several memory sizes)")
    p.add_argument("--csv", metavar="FILE")
    p.add_argument("--record", metavar="FILE", help="append the fit record to this JSONL file")


def _register_studyb_cost(ssub) -> None:
    p = add_command(ssub, "cost", cmd_studyb_cost, "cost of a fine-tuning job: queries x epochs / throughput x price")
    p.add_argument("--queries", type=float, required=True)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--throughput", type=float, help="queries/s")
    p.add_argument("--fit", help="an Eq. 2 fit record (JSON) to take the throughput from, with --batch")
    p.add_argument("--batch", type=float)
    p.add_argument("--sparsity", type=float, default=0.25)
    p.add_argument("--device", help="take the price from the catalog")
    p.add_argument("--catalog", action="append", metavar="FILE")
    p.add_argument("--price", type=float, help="price per GPU-hour")
