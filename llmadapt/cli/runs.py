"""Commands that run workloads: run, compare, parity. Each command's options are registered beside its handler
(``register_<command>``, found by cli/main.py's table of commands), as in every group of cli/."""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from typing import Any

from llmadapt.cli.common import (add_command, attach_arg, attach_settings, cells_progress, emit, name_list, printable,
                                 repeat_arg, run_options, stall_arg, workload_args, workload_of)
from llmadapt.errors import LlmadaptError


def cmd_run(args) -> int:
    import attrs

    from llmadapt.analysis.report import render_summary
    from llmadapt.contract.rundir import RunDir
    from llmadapt.launch.runner import run

    workload = workload_of(args)
    adapter = args.adapter or ("hf" if workload.kind == "serve" else "torch")  # each kind's documented default
    result = run(workload, adapter, **run_options(args), **_node_options(args))
    summary = attrs.asdict(result.summary)
    launch = RunDir(result.run_dir).read_launch()
    nodes = launch.nodes.seen if launch.nodes else None
    where = "".join(f"\nnode {n['node_rank']:<6} {n['node']}, ranks {', '.join(map(str, n['ranks']))}"
                    for n in nodes or [])
    saved = launch.workload.save.path if launch.workload else None
    if saved and result.ok:
        where += f"\nsaved      {saved} (a Hugging Face model folder: serve it with --set model.path={saved})"
    emit(args, {"run_dir": str(result.run_dir), "summary": summary, "saved": saved if result.ok else None},
          render_summary(summary) + where + f"\ntrace      {result.run_dir}" + _requests_line(result.summary))
    return 0 if result.ok else 1


def _requests_line(summary) -> str:
    """A serving run with failed or truncated requests says how many on its last line, and what that made it
    (serve.max_failed_share decides between 'ok' and 'degraded': docs/serving.md)."""
    from llmadapt.contract.stats import failed_requests

    v = summary.serving
    if v is None or not v.failed:
        return ""
    return f"\n{summary.status:<10} {failed_requests(v)}" + ("" if summary.status == "ok" else " (exit 1; "
                                                            "serve.max_failed_share sets how many may fail)")


def _has_result(row) -> bool:
    """A comparison's row has a result unless its runs failed: a serving run that is 'degraded' (some requests
    failed) is reported in its row, not an error of the comparison."""
    from llmadapt.analysis.report import read_summary

    if row.status in ("ok", "unsupported"):
        return True
    try:
        return bool(row.run_dirs) and all(read_summary(d).get("status") == "degraded" for d in row.run_dirs)
    except Exception:  # a run without a readable summary has no result
        return False


def _node_options(args) -> dict[str, Any]:
    """Multi-node torchrun or Slurm settings from the `run` options; only what was given."""
    if args.launcher == "slurm":
        from llmadapt.launch.slurm import SlurmSettings

        return {"slurm": SlurmSettings(
            nnodes=args.nnodes, ntasks_per_node=args.nproc_per_node, partition=args.partition, time=args.time,
            options=tuple(args.sbatch_option or ()), collect_addr=args.collect_addr, master_port=args.master_port)}
    if args.nnodes == 1 and not (args.master_addr or args.rdzv_endpoint or args.nproc_per_node):
        return {}
    from llmadapt.launch.settings import NodeSettings

    return {"nodes": NodeSettings(
        nnodes=args.nnodes, node_rank=args.node_rank, nproc_per_node=args.nproc_per_node,
        master_addr=args.master_addr, master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint,
        local_addr=args.local_addr, ifname=args.ifname, collect_port=args.collect_port)}


def cmd_compare(args) -> int:
    import attrs

    from llmadapt.analysis.comparison import compare_stored, parse_matrix
    from llmadapt.experiments.compare import compare

    args.repeat = repeat_arg(args.repeat)

    if args.report:  # before the runs: a report that cannot be written is found now, not after them
        from llmadapt.analysis.htmlreport import check_output

        check_output(args.report)
    if args.columns is not None:  # a misspelt column is found now too
        from llmadapt.analysis.comparison import column_keys

        column_keys(args.columns)

    if args.runs is not None:
        given = [flag for flag, on in (("a workload file", args.workload), ("--adapters", args.adapters),
                                       ("--attach", args.attach),
                                       ("--cell", args.cell), ("--matrix", args.matrix), ("--reuse", args.reuse),
                                       ("--repeat", args.repeat != 1), ("--settle", args.settle is not None),
                                       ("--seed", args.seed is not None)) if on]
        if given:
            raise LlmadaptError(f"compare --runs reads stored runs: it takes no {', '.join(given)}")
        comparison = compare_stored(args.runs, root=args.out)
        if args.baseline is not None:
            if not any(args.baseline in (r.cell, r.label) for r in comparison.rows):
                raise LlmadaptError(f"baseline {args.baseline!r} names no row of these runs; their rows: "
                                    + ", ".join(r.label for r in comparison.rows))
            comparison = attrs.evolve(comparison, baseline=args.baseline)
    else:
        if args.workload is None:
            raise LlmadaptError("name a workload file to run, or --runs QUERY to compare stored runs")

        names = _adapter_names(args)
        named = names + [c.partition(":")[0] for c in args.cell or []]
        workload = workload_of(args).with_overrides(attach_settings(args.attach, named), source="--set")
        if args.save_sweep:
            return _save_sweep(args, names)
        with cells_progress(args) as on_cell:
            comparison = compare(workload, names, cells=args.cell,
                                 matrix=parse_matrix(args.matrix or []), refuse_unsupported=args.refuse_unsupported,
                                 repeat=args.repeat, reuse=args.reuse, baseline=args.baseline, settle=args.settle,
                                 max_rounds=args.max_rounds, seed=args.seed, on_cell=on_cell,
                                 log=None if on_cell else lambda m: print(m, file=sys.stderr, flush=True),
                                 **run_options(args))
    shown = _printable_rows(comparison)
    # A terminal narrower than the table gets the columns read most; a file or pipe gets every column
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() and not args.json else None
    text = shown.table(columns=args.columns, width=width)
    if args.breakdown:
        text += "\n\n" + shown.breakdown_table()
    data = comparison.to_dict()
    if args.report:
        from llmadapt.analysis.htmlreport import report

        folders = [d for r in comparison.rows for d in r.run_dirs]
        if folders:
            data["report"] = str(report(folders, args.report, baseline=comparison.baseline))
            text += f"\nreport: {data['report']}"
    emit(args, data, text)
    if comparison.saved and not getattr(args, "json", False):  # beside the table, not in it (as progress is)
        print(f"table      {printable(comparison.saved)}", file=sys.stderr)
    return 0 if all(_has_result(r) for r in comparison.rows) else 1


def _printable_rows(comparison):
    """The comparison with its rows' labels, notes and machines escaped for the console (a label holding a newline
    would split its row); the JSON keeps them as they are."""
    import attrs

    def safe(text):
        return printable(text) if isinstance(text, str) else text

    rows = [attrs.evolve(r, label=safe(r.label), note=safe(r.note), machine=safe(r.machine), variant=safe(r.variant))
            for r in comparison.rows]
    return attrs.evolve(comparison, rows=rows, baseline=safe(comparison.baseline))


def _save_sweep(args, names: list[str]) -> int:
    """compare --save-sweep FILE: this comparison as a sweep file (checked by expanding it), not run."""
    import os
    from pathlib import Path

    from llmadapt.experiments import sweep as sweeps
    from llmadapt.analysis.comparison import parse_matrix

    if args.attach or args.reuse or args.report or args.breakdown or args.repeat == "auto":
        raise LlmadaptError("--save-sweep writes the comparison's cells only: not with --attach, --reuse, --report, "
                            "--breakdown or --repeat auto (a sweep runs each cell a fixed number of times)")
    target = Path(args.save_sweep)
    if target.exists():
        raise LlmadaptError(f"--save-sweep {target}: exists; name a new file")
    workload = os.path.relpath(Path(args.workload).resolve(), target.resolve().parent)
    data = {"workload": workload, "adapters": names, "cells": args.cell or [], "set": args.set or [],
            "repeat": args.repeat if args.repeat != 1 else None,
            "matrix": {k: [list(v) if isinstance(v, tuple) else v for v in values]
                       for k, values in parse_matrix(args.matrix or []).items()}}
    sweeps.write(target, data)
    try:
        sweep = sweeps.load(target, args.out, create=False)
    except LlmadaptError:
        target.unlink()
        raise
    emit(args, {"sweep": str(target), "cells": len(sweep.cells)},
         f"wrote {target}: {len(sweep.cells)} cells; run it with: llmadapt sweep run {target}")
    return 0


def cmd_parity(args) -> int:
    import attrs

    from llmadapt.experiments.cells import as_cells
    from llmadapt.experiments.parity import parity

    _tolerances(args)
    if args.runs is not None:
        if args.workload or args.adapters or args.cell:
            raise LlmadaptError("parity --runs checks two stored runs: it takes no workload file, --adapters or --cell")
        from llmadapt.analysis.paritycheck import parity_of_stored

        report = parity_of_stored(args.runs, root=args.out, rtol=args.rtol, atol=args.atol)
        emit(args, attrs.asdict(report), report.describe())
        return 0 if report.ok else 1
    if args.workload is None:
        raise LlmadaptError("name a workload file to run, or --runs QUERY to check two stored runs")
    cells = as_cells(_adapter_names(args, distinct=False), args.cell)
    report = parity(workload_of(args), cells=cells, rtol=args.rtol, atol=args.atol, **run_options(args))
    emit(args, attrs.asdict(report), report.describe())
    return 0 if report.ok else 1


def _tolerances(args) -> None:
    """--rtol and --atol checked (a finite number >= 0) before anything runs; the parity defaults where not given."""
    for name in ("rtol", "atol"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise LlmadaptError(f"--{name}: got {value!r}; must be a finite number >= 0")
    from llmadapt.analysis.paritycheck import PARITY_ATOL, PARITY_RTOL

    args.rtol = PARITY_RTOL if args.rtol is None else args.rtol
    args.atol = PARITY_ATOL if args.atol is None else args.atol


def _adapter_names(args, distinct: bool = True) -> list[str]:
    if args.adapters is None and not args.cell:
        raise LlmadaptError("name what to run: --adapters torch,deepspeed, or cells such as "
                            "--cell 'megatron:parallelism.tp=2' (repeat)")
    return name_list(args.adapters, distinct=distinct) if args.adapters is not None else []


# -- registration: each command's options, in the order its --help lists them ----------------------------------
def _cells_args(p: argparse.ArgumentParser, adapters_help: str) -> None:
    p.add_argument("--adapters", help=adapters_help)
    p.add_argument("--cell", action="append", metavar="ADAPTER[:PATH=VALUE,...]",
                   help="one adapter in a layout of its own, e.g. 'megatron:parallelism.tp=2' or "
                        "'deepspeed:parallelism.dp=2,optimizations.zero_stage=3' (repeat)")


def _optional_workload(p: argparse.ArgumentParser) -> None:
    """The workload file is not needed where --runs reads stored runs instead."""
    for action in p._actions:
        if action.dest == "workload":
            action.nargs, action.help = "?", "workload file (.toml, .yaml, .json); none with --runs"


def register_run(sub) -> None:
    p = add_command(sub, "run", cmd_run, "run a workload on one adapter")
    workload_args(p)
    stall_arg(p)
    p.add_argument("--adapter", default=None, help="adapter name (default: torch; hf for a serve workload)")
    g = p.add_argument_group("several nodes (torchrun: the same command on every node, changing --node-rank; "
                             "slurm: one command, one job); see docs/distributed.md")
    g.add_argument("--nnodes", "--nodes", type=int, default=1, help="number of nodes (default: 1)")
    g.add_argument("--nproc-per-node", "--ntasks-per-node", type=int, default=None,
                   help="ranks per node (default: world size / nnodes)")
    g.add_argument("--node-rank", type=int, default=0, help="torchrun: this node's rank; node 0 gathers the records")
    g.add_argument("--master-addr", help="torchrun: node 0's address, reachable from every node (static rendezvous)")
    g.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0 (default: 29500)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="torchrun: c10d rendezvous on node 0 instead")
    g.add_argument("--local-addr", help="torchrun: this node's address as the others reach it")
    g.add_argument("--ifname", help="torchrun: network interface for gloo/NCCL (GLOO_SOCKET_IFNAME)")
    g.add_argument("--collect-port", type=int, help="torchrun: port on node 0 for records (default: rendezvous+1)")
    g.add_argument("--partition", help="slurm: partition")
    g.add_argument("--time", help="slurm: time limit, e.g. 30 or 1:00:00")
    g.add_argument("--sbatch-option", action="append", metavar="OPTION",
                   help="slurm: another sbatch option, e.g. --sbatch-option=--account=abc (repeat)")
    g.add_argument("--collect-addr", help="slurm: this machine's address as the compute nodes reach it")


def register_compare(sub) -> None:
    p = add_command(sub, "compare", cmd_compare, "run a workload on several adapters and option variants, or compare "
                    "stored runs (--runs); one table")
    workload_args(p)
    stall_arg(p)
    _optional_workload(p)
    _cells_args(p, "comma-separated adapter names, e.g. torch,deepspeed (one cell each)")
    p.add_argument("--matrix", action="append", metavar="PATH=V1,V2",
                   help="option variants, e.g. optimizations.recompute=none,full (repeat for a grid); a cell "
                        "the adapter cannot run is shown as not supported and not run")
    p.add_argument("--refuse-unsupported", action="store_true",
                   help="refuse a comparison that has a cell its adapter cannot run (a --cell or a matrix "
                        "variant), instead of skipping that cell")
    p.add_argument("--breakdown", action="store_true",
                   help="also set the runs' step breakdowns side by side per class (needs profile.steps)")
    p.add_argument("--repeat", default=1, metavar="N|auto",
                   help="runs per cell: rows show medians with 95%% bootstrap intervals over them (default 1); auto: "
                        "rounds until the verdict tells every two adjacent rows apart, up to --max-rounds")
    p.add_argument("--reuse", action="store_true",
                   help="count runs already in --out of the same workload, adapter version and machine, instead "
                        "of running them again")
    p.add_argument("--settle", type=float, metavar="SHARE",
                   help="after --repeat rounds, add rounds until every row's 95%% interval is narrower than SHARE of "
                        "its median (0.05: 5%%), up to --max-rounds; the rows that never settle are named")
    p.add_argument("--max-rounds", type=int, default=10, metavar="N",
                   help="the most rounds --settle or --repeat auto runs (default 10)")
    p.add_argument("--seed", type=int, metavar="N",
                   help="the seed of the rounds' shuffled order (default: drawn, and printed under the table)")
    p.add_argument("--columns", metavar="LIST", type=lambda v: [c for c in v.split(",") if c.strip()],
                   help="the metric columns to show, by key or title, comma-separated, e.g. 'step p50 s,tokens/s' "
                        "(default: all; on a narrow terminal the least read are left out, saying which)")
    p.add_argument("--baseline", metavar="CELL",
                   help="the row the others are set against: a cell as given (torch, 'megatron:parallelism.tp=2') "
                        "or a row's label (default: each problem's first row)")
    p.add_argument("--runs", metavar="QUERY",
                   help="compare stored runs in --out instead of running: key=value terms, e.g. "
                        "'adapter=torch since=2026-12-01' ('' for all)")
    p.add_argument("--report", metavar="FILE", help="also write the comparison's HTML report (llmadapt report)")
    p.add_argument("--save-sweep", metavar="FILE",
                   help="write this comparison as a sweep file (.toml, .yaml, .json) instead of running it "
                        "(llmadapt sweep run FILE: resumable, Slurm job arrays)")

    attach_arg(p)


def register_parity(sub) -> None:
    p = add_command(sub, "parity", cmd_parity, "check two adapters' fp32 loss trajectories agree at every step")
    workload_args(p)
    stall_arg(p)
    _optional_workload(p)
    p.add_argument("--runs", metavar="QUERY", help="check two runs already stored in --out instead of running")
    _cells_args(p, "two comma-separated adapter names")
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--atol", type=float, default=None)
