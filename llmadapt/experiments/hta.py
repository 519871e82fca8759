"""Holistic Trace Analysis (HTA) on a profiled run's traces: the reading of them people know, beside llmadapt's.

A run profiled at level full keeps each profiled step's Kineto trace per rank, one folder per step
(``profile/step-N/rank-R.json``), as HTA reads them: the rank from the trace's ``distributedInfo``, the step
from its ``ProfilerStep#N`` range. ``hta_analysis`` runs HTA 0.5.0 in an environment of its own (``llmadapt env
create hta``: pandas and plotly stay out of the core and of the adapters' environments) and returns what it
finds: the ranks and iterations it loaded and, where the traces hold GPU kernels, its temporal breakdown (idle,
compute, non-compute time), its communication-computation overlap and its kernel-type breakdown (memory kernels
included). ``hta_of_traces`` does the same for trace files of any job. HTA reads GPU
kernels only: on a CPU run it loads the traces and says there is nothing for its analyses (llmadapt's own
breakdown applies the same definitions to CPU spans: docs/breakdown.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError

NO_KERNELS = ("no GPU kernels in these traces: HTA's temporal breakdown, overlap and kernel breakdown read GPU "
              "kernels only (llmadapt's breakdown applies their definitions to CPU spans)")


def profiled_steps(run_dir: str | Path) -> list[int]:
    """The steps whose traces the run kept (level full)."""
    folder = RunDir(run_dir).profile_dir
    steps = [int(p.name.removeprefix("step-")) for p in folder.glob("step-*") if p.name[5:].isdigit()]
    return sorted(steps)


def hta_analysis(run_dir: str | Path, step: int | None = None, *, timeout: float = 600) -> dict[str, Any]:
    """HTA's reading of one profiled step's traces (default: the first the run kept)."""
    if not RunDir(run_dir).launch_file.is_file():
        raise LlmadaptError(f"{run_dir} is not a run directory (no launch.json)")
    steps = profiled_steps(run_dir)
    if not steps:
        raise LlmadaptError(f"{run_dir}: no profiler traces (profile the run with profile.level = \"full\")")
    if step is None:
        step = steps[0]
    elif step not in steps:
        raise LlmadaptError(f"{run_dir}: no traces of step {step}; traced steps: {', '.join(map(str, steps))}")
    (result,) = _run_hta([RunDir(run_dir).profile_step(step)], timeout)
    return {"step": step, **result}


def hta_of_traces(files: list[str | Path], *, timeout: float = 600) -> list[dict[str, Any]]:
    """HTA's reading of each trace file on its own (a folder of one: HTA takes a folder and one file per rank,
    and traces of different jobs may name the same rank), in one HTA process."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="llmadapt-hta-") as scratch:
        folders = []
        for i, f in enumerate(map(Path, files)):
            folder = Path(scratch) / str(i)
            folder.mkdir()
            (folder / f.name).symlink_to(f.resolve())
            folders.append(folder)
        return _run_hta(folders, timeout)


def _run_hta(folders: list[Path], timeout: float) -> list[dict[str, Any]]:
    from llmadapt.launch.environments import HTA_ENVIRONMENT, process_env, python_for

    done = subprocess.run([str(python_for(HTA_ENVIRONMENT)), "-m", "llmadapt.experiments.hta", *map(str, folders)],
                          capture_output=True, text=True, timeout=timeout, env=process_env(HTA_ENVIRONMENT))
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or len(lines) < len(folders):
        where = folders[0] if len(folders) == 1 else f"{len(folders)} folders"
        raise LlmadaptError(f"HTA failed on {where}: {(done.stderr.strip().splitlines() or ['no output'])[-1][:300]}")
    return [json.loads(line) for line in lines[-len(folders):]]


def render(result: dict[str, Any]) -> str:
    lines = [f"HTA {result['hta_version']} on step {result['step']}: ranks {', '.join(map(str, result['ranks']))}; "
             "iterations " + "; ".join(f"rank {r}: {', '.join(map(str, its))}"
                                      for r, its in result["iterations"].items())]
    if result.get("note"):
        lines.append(result["note"])
    for title in ("temporal_breakdown", "comm_comp_overlap", "kernel_type_breakdown"):
        for row in result.get(title) or []:
            lines.append(f"{title:<22} " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in row.items()))
    return "\n".join(lines)


# -- inside the hta environment -------------------------------------------------------------------
def _analyse(folder: str) -> dict[str, Any]:
    import contextlib
    import io
    import logging
    from importlib import metadata

    logging.disable(logging.CRITICAL)  # HTA logs every file it parses
    with contextlib.redirect_stdout(io.StringIO()):
        from hta.trace_analysis import TraceAnalysis

        analysis = TraceAnalysis(trace_dir=folder)
    ranks = sorted(int(r) for r in analysis.t.traces)
    frames = {r: analysis.t.get_trace(r) for r in ranks}
    out: dict[str, Any] = {
        "hta_version": metadata.version("holistictraceanalysis"),
        "ranks": ranks,
        "iterations": {str(r): sorted(int(i) for i in frames[r]["iteration"].unique() if i >= 0) for r in ranks},
    }
    if not any((frames[r]["stream"] >= 0).any() for r in ranks):  # CPU events carry stream -1
        out["note"] = NO_KERNELS
        return out

    def records(frame) -> list[dict[str, Any]]:
        return json.loads(frame.to_json(orient="records"))

    with contextlib.redirect_stdout(io.StringIO()):
        out["temporal_breakdown"] = records(analysis.get_temporal_breakdown(visualize=False))
        out["comm_comp_overlap"] = records(analysis.get_comm_comp_overlap(visualize=False))
        kernel_types = analysis.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)[0]
        out["kernel_type_breakdown"] = records(kernel_types)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(_analyse(arg)), flush=True)
