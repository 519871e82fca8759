"""llmadapt sweep run | status: a comparison's grid that survives interruptions and runs as a Slurm job array."""

from __future__ import annotations

import sys

from llmadapt.cli.common import emit
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
        options = {"launcher": args.launcher, "out": args.out, "timeout": args.timeout}
        if args.index is not None:
            sweep.run_cell(sweep.cells[args.index], log=log, **options)
        elif args.slurm:
            sweeps.run_on_slurm(sweep, list(args.sbatch_option or []), log=log, timeout=args.timeout)
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
