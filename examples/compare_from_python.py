"""Embed llmadapt: a small technique grid from Python, printed as a table and saved as CSV.

    python examples/compare_from_python.py
"""

from pathlib import Path

import llmadapt

here = Path(__file__).parent
workload = llmadapt.Workload.from_file(here / "tiny-llama.toml").with_overrides(["train.steps=4"])

comparison = llmadapt.compare(
    workload,
    adapters=["torch"],
    matrix={"optimizations.recompute": ["none", "full"], "train.micro_batch": [2, 4]},
    out="runs",
    log=print,
)
print(comparison.table())

# Every row points at its trace; any run can be exported for other tools.
from llmadapt.analysis.report import export

first = comparison.rows[0].run_dir
Path("runs/first-run.csv").write_text(export(first, "csv"))
print(f"\nper-step CSV of {first} written to runs/first-run.csv")
