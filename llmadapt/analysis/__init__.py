"""Reading runs: compare (tables across stacks and layouts), parity (is the comparison fair), report (show,
export, Chrome traces), and perf/ (the analytical model, device catalog use, micro-benchmarks, study B).
"""

from __future__ import annotations

from llmadapt.analysis.compare import Comparison, Row, compare, matrix_variants, parse_matrix
from llmadapt.analysis.parity import (
    PARITY_ATOL,
    PARITY_RTOL,
    ExpertLoadReport,
    ParityReport,
    expert_load_parity,
    loss_parity,
    parity,
    parity_of_runs,
)
from llmadapt.analysis.report import EXPORT_FORMATS, chrome_trace, export, read_summary, render_summary, show

__all__ = [
    "EXPORT_FORMATS", "PARITY_ATOL", "PARITY_RTOL", "Comparison", "ExpertLoadReport", "ParityReport", "Row",
    "chrome_trace", "compare", "expert_load_parity", "export", "loss_parity", "matrix_variants", "parity",
    "parity_of_runs", "parse_matrix", "read_summary", "render_summary", "show",
]
