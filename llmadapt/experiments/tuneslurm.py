"""A round of ``tune``'s probes as one Slurm job array, through the sweep machinery (``llmadapt.experiments.sweep``):
the round is written as a sweep file in the tune's folder (the workload as given, one cell per candidate, the probe's
steps as a setting), submitted with ``run_on_slurm`` and waited for; its cells' files say which run folder each
probe made. The sweep is named by what it probes (each candidate and which of its runs this is), so a tune resumed
after an interruption finds the same sweep, and the sweep runs only the cells not done.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from llmadapt.errors import LlmadaptError
from llmadapt.spec import Workload

WORKLOAD = "workload.json"
"""The workload as given, in the tune's folder: what each round's sweep file names."""


def probe_array(folder: Path, workload: Workload, probes: list[tuple[Any, int]], *, probe_steps: int | None,
                out: str | Path, sbatch: list[str], run_options: dict[str, Any],
                log: Callable[[str], None]) -> tuple[list[tuple[Any, str, dict[str, Any], float]], list[str]]:
    """Run PROBES ((candidate, which run of it, from 1)) as one job array; returns each finished probe as
    (candidate, run folder, summary, wall seconds) in the order given, and the labels of those that did not finish
    (the array cancelled, or a task lost with its node)."""
    from llmadapt.analysis.report import read_summary
    from llmadapt.experiments import sweep as sweeps

    given = folder / WORKLOAD
    if not given.is_file():
        given.write_text(json.dumps(workload.to_dict(), indent=1) + "\n")
    name = "probes-" + hashlib.sha256(json.dumps([[c.key, n] for c, n in probes]).encode()).hexdigest()[:10]
    sweep_file = folder / f"{name}.json"
    if not sweep_file.is_file():
        sweeps.write(sweep_file, {"name": name, "workload": WORKLOAD, "cells": [c.cell for c, _ in probes],
                                  "set": [f"train.steps={probe_steps}"] if probe_steps is not None else []})
    sweep = sweeps.load(sweep_file, out)
    by_hash = {cell.planned.workload.content_hash: cell for cell in sweep.cells}
    cells = []
    for c, _ in probes:  # the sweep's cell must run the candidate's workload exactly
        w = c.workload if probe_steps is None else c.workload.with_overrides([f"train.steps={probe_steps}"])
        if w.content_hash not in by_hash:
            raise LlmadaptError(f"tune over Slurm: the sweep {sweep_file} has no cell running {c.label}'s workload")
        cells.append(by_hash[w.content_hash])
    log(f"{len(probes)} probe(s) as one Slurm job array: {', '.join(c.label for c, _ in probes)}")
    sweeps.run_on_slurm(sweep, sbatch, log=log, timeout=None, run_args=_run_args(run_options))
    status = {cell.id: (s, state) for cell, s, state in sweep.status(sweeps.slurm_machine())}
    finished, missing = [], []
    for (c, _), cell in zip(probes, cells):
        s, state = status[cell.id]
        attempt = (state.get("attempts") or [{}])[-1]
        run_dir = attempt.get("run_dir")
        if s not in ("done", "failed") or not run_dir:
            missing.append(c.label)
            continue
        try:
            summary = read_summary(Path(run_dir))
        except (LlmadaptError, OSError, ValueError) as exc:  # a task that failed before its run wrote a summary
            summary = {"status": "failed", "failures": [{"cause": "slurm", "message": attempt.get("failure")
                                                         or f"no summary: {exc}"}]}
        finished.append((c, run_dir, summary, _wall(attempt)))
    return finished, missing


def _run_args(run_options: dict[str, Any]) -> list[str]:
    """The probe's run options as `llmadapt sweep run` takes them in each array task."""
    args = []
    if run_options.get("timeout") is not None:
        args += ["--timeout", str(run_options["timeout"])]
    if run_options.get("stall_timeout") is not None:
        args += ["--stall-timeout", str(run_options["stall_timeout"])]
    if run_options.get("launcher", "auto") != "auto":
        args += ["--launcher", str(run_options["launcher"])]
    return args


def _wall(attempt: dict[str, Any]) -> float:
    """The probe's seconds, from its attempt's start and end as the array task recorded them."""
    try:
        start = datetime.datetime.fromisoformat(attempt["started"])
        end = datetime.datetime.fromisoformat(attempt["ended"])
    except (KeyError, TypeError, ValueError):
        return 0.0
    return max(0.0, (end - start).total_seconds())
