"""The shipped examples load and run as shown."""

import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt import Workload

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "examples").glob("*.toml")) + sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_workload_files_load(path):
    """Every example workload file is valid and passes the reference adapter's checks."""
    from llmadapt.plugins import check_supported, get_adapter

    workload = Workload.from_file(path)
    check_supported(get_adapter("hf" if workload.kind == "serve" else "torch"), workload)


def test_python_example_runs(tmp_path):
    """examples/compare_from_python.py runs from a fresh folder and writes its CSV."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_from_python.py")], cwd=tmp_path,
                         capture_output=True, text=True, check=False, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "recompute=full,micro_batch=4" in out.stdout
    assert (tmp_path / "runs" / "first-run.csv").read_text().startswith("rank,step,warmup")
