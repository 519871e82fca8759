"""Reading runs: the comparison table and its verdicts (comparison), loss and expert-load parity (paritycheck),
report (show, export, Chrome traces), the run store, and perf/ (the analytical model, device catalog use, reading
micro-benchmark and max-batch results, study B). Nothing here starts a run: llmadapt.experiments plans and
launches them.

``compare`` and ``parity`` moved to llmadapt.experiments; their names here still work, with a DeprecationWarning,
until 0.3.
"""

from __future__ import annotations

from llmadapt.analysis.comparison import Comparison, Row, matrix_variants, parse_matrix
from llmadapt.analysis.paritycheck import (
    PARITY_ATOL,
    PARITY_RTOL,
    ExpertLoadReport,
    ParityReport,
    expert_load_parity,
    loss_parity,
    parity_of_runs,
)
from llmadapt.analysis.report import EXPORT_FORMATS, chrome_trace, export, read_summary, render_summary, show
from llmadapt.analysis.verdict import ScalingPoint, Slower, Verdict

__all__ = [
    "EXPORT_FORMATS", "PARITY_ATOL", "PARITY_RTOL", "Comparison", "ExpertLoadReport", "ParityReport", "Row",
    "ScalingPoint", "Slower", "Verdict",
    "chrome_trace", "expert_load_parity", "export", "loss_parity", "matrix_variants", "parity_of_runs",
    "parse_matrix", "read_summary", "render_summary", "show",
]

def __getattr__(name: str):
    """``compare`` and ``parity``, deprecated here (they launch runs): imported from llmadapt.experiments, with a
    DeprecationWarning that names the new path. Both go in 0.3."""
    if name == "compare":
        from llmadapt.experiments.compare import compare as moved
    elif name == "parity":
        from llmadapt.experiments.parity import parity as moved
    else:
        raise AttributeError(f"module 'llmadapt.analysis' has no attribute {name!r}")
    import warnings

    warnings.warn(f"llmadapt.analysis.{name} is deprecated and will be removed in 0.3: use llmadapt.experiments.{name}",
                  DeprecationWarning, stacklevel=2)
    return moved
