"""llmadapt sweep run | status: a comparison's grid that survives interruptions and runs as a Slurm job array. Its
options are registered beside its handler (``register_sweep``, found by cli/main.py's table of commands), as in
every group of cli/."""

from __future__ import annotations

import sys

from llmadapt.cli.common import add_command, emit, stall_arg
from llmadapt.errors import LlmadaptError


def cmd_sweep(args) -> int:
    from llmadapt.experiments import sweep as sweeps

    if args.action == "status" and args.index is not None:
        raise LlmadaptError("sweep status takes no --index")
    # --index checked against the cells before the sweep's state is written
    sweep = sweeps.load(args.sweep, args.out, args.set, index=args.index)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.action == "run":
        options = {"launcher": args.launcher, "out": args.out, "timeout": args.timeout,
                   "stall_timeout": args.stall_timeout}
        if args.index is not None:
            sweep.run_cell(sweep.cells[args.index], log=log, **options)
        elif args.slurm:
            sweeps.run_on_slurm(sweep, list(args.sbatch_option or []), log=log, timeout=args.timeout,
                                run_args=["--stall-timeout", str(args.stall_timeout)] if args.stall_timeout else [])
        else:
            sweep.run(log=log, **options)
    rows = sweep.status(sweeps.slurm_machine() if args.slurm else None)  # cells run by array tasks: the cluster's
    data = {"folder": str(sweep.folder), "cells": [
        {"index": i, "id": c.id, "title": c.title, "status": status,
         "attempts": len(state.get("attempts", [])),
         "run_dir": (state.get("attempts") or [{}])[-1].get("run_dir"),
         "max_batch": ((state.get("attempts") or [{}])[-1].get("maxbatch") or {}).get("max_batch")}
        for i, (c, status, state) in enumerate(rows)]}
    from llmadapt.texttable import text_table

    counts = {s: sum(1 for _, status, _ in rows if status == s) for s in sweeps.STATES}
    head = ["#", "cell", "id", "status", "attempts", *(["max batch"] if sweep.maxbatch is not None else []), "run"]
    text = "\n".join([*text_table(head, [[str(d["index"]), d["title"], d["id"], d["status"], str(d["attempts"]),
                                          *([str(d["max_batch"] or "-")] if sweep.maxbatch is not None else []),
                                          d["run_dir"] or "-"] for d in data["cells"]]),
                      f"{len(rows)} cells: " + ", ".join(f"{n} {s}" for s, n in counts.items()),
                      f"sweep state: {sweep.folder}"])
    emit(args, {**data, "counts": counts}, text)
    if args.action == "status":
        return 0
    if args.index is not None:
        return 0 if rows[args.index][1] == "done" else 1
    return 0 if counts["done"] == len(rows) else 1


def register_sweep(sub) -> None:
    p = add_command(sub, "sweep", cmd_sweep, "run a sweep file's cells (resuming: finished cells are skipped, failed "
                    "ones retried), locally or as a Slurm job array; or show their status")
    p.add_argument("action", choices=["run", "status"])
    p.add_argument("sweep", help="sweep file (.toml, .yaml, .json): workload, adapters/cells, set, matrix, repeat, "
                                 "retries")
    p.add_argument("--set", action="append", metavar="[ADAPTER:]PATH=VALUE", help="override a workload field")
    p.add_argument("--out", default="runs", help="folder for run directories and the sweep's state (default: ./runs)")
    p.add_argument("--launcher", default="auto", metavar="LAUNCHER", help="for each cell's run (default: auto)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (with --slurm: for the whole array)")
    stall_arg(p)
    p.add_argument("--index", type=int, default=None, help="run only cell I (what each Slurm array task does)")
    p.add_argument("--slurm", action="store_true", help="submit the cells not done as one Slurm job array and wait")
    p.add_argument("--sbatch-option", action="append", metavar="OPTION",
                   help="an sbatch option for the array, e.g. --partition=gpu (repeat)")
