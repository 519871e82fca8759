"""``parity``: run two cells of one problem through ``llmadapt.launch.runner`` and check their losses agree step by
step (``llmadapt.analysis.paritycheck`` reads the verdict).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from llmadapt.experiments.cells import Cell, as_cells, plan
from llmadapt.analysis.paritycheck import PARITY_ATOL, PARITY_RTOL, ParityReport, loss_parity
from llmadapt.errors import LlmadaptError, TraceMismatchError
from llmadapt.launch.runner import run
from llmadapt.spec import Workload, problem_difference


def parity(workload: Workload | str | Path, adapters: list[str] | None = None, *,
           cells: list[Cell | str] | None = None, rtol: float = PARITY_RTOL, atol: float = PARITY_ATOL,
           **run_options: Any) -> ParityReport:
    """Run two cells of one problem (fp32) and check their loss trajectories agree at every step.

    The cells may be two adapters, or any two adapters and layouts (``cells``: "torch:parallelism.dp=2",
    "megatron:parallelism.tp=2"): what must be equal is the problem (model, data, steps, optimizer,
    precision: the problem hash), never the layout. Two different problems are refused, naming the fields.
    """
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    planned = plan(workload, as_cells(adapters, cells), distinct=False, refuse_unsupported=True)
    if len(planned) != 2:
        raise LlmadaptError(f"parity compares exactly two cells, got {len(planned)}: "
                            f"{', '.join(str(p.cell) for p in planned)}")
    a, b = planned
    for p in planned:
        if p.workload.precision != "fp32":
            raise LlmadaptError(f"parity needs precision fp32 (got {p.workload.precision} in {p.layout}): lower "
                                "precisions are not expected to agree step by step")
    names = (a.layout, b.layout) if a.layout != b.layout else (str(a.cell), str(b.cell))
    if a.workload.problem_hash != b.workload.problem_hash:
        raise TraceMismatchError(f"parity: {names[0]} and {names[1]} are different problems, their losses not "
                                 f"comparable: {'; '.join(problem_difference(a.workload, b.workload))}")
    results = [run(p.workload, p.cell.adapter, **run_options) for p in planned]
    for r in results:
        if not r.ok:
            f = r.summary.failures[0] if r.summary.failures else None
            what = f"parity: the {r.summary.adapter} run {r.summary.status}"  # 'failed' or 'diverged'
            raise LlmadaptError(f"{what} ({f.cause}: {f.message}) - see {r.run_dir}" if f else
                                f"{what}{' (' + r.summary.warnings[0] + ')' if r.summary.warnings else ''} - see "
                                f"{r.run_dir}")
    report = loss_parity(results[0].losses, results[1].losses, rtol=rtol, atol=atol)
    return attrs.evolve(report, names=names)
