"""The shipped examples load and run as shown."""

import re
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
    from llmadapt.adapter.plugins import check_supported, get_adapter
    from llmadapt.spec.loading import PackageDataError, resolve_package_path

    for name in re.findall(r'"(package:[\w.-]+)"', path.read_text()):
        try:
            resolve_package_path(name)
        except PackageDataError as exc:
            pytest.skip(f"{path.name} names {name}: {exc}")
    workload = Workload.from_file(path)
    check_supported(get_adapter("hf" if workload.kind == "serve" else "torch"), workload)


def test_python_example_runs(tmp_path):
    """examples/compare_from_python.py runs from a fresh folder and writes its CSV."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_from_python.py")], cwd=tmp_path,
                         capture_output=True, text=True, check=False, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch dp1 recompute=full mb4" in out.stdout  # each row labelled by its layout
    assert (tmp_path / "runs" / "first-run.csv").read_text().startswith("rank,step,warmup")


def test_deepspeed_techniques_command_expands_to_study_a_grid():
    """examples/deepspeed-techniques.toml documents one `llmadapt compare` command; its --matrix expands to
    study A's cells (baseline, Z2, Z3, Z2O, Z3O, each without and with R), every one a valid workload, and the
    DeepSpeed adapter (when installed) accepts each."""
    import shlex

    from llmadapt.adapter.plugins import adapters, check_supported, get_adapter
    from llmadapt.analysis.comparison import matrix_variants, parse_matrix
    from llmadapt.cli.main import build_parser

    path = ROOT / "examples" / "deepspeed-techniques.toml"
    (line,) = [x[2:] for x in path.read_text().splitlines() if x.startswith("# llmadapt compare ")]
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert (args.command, args.adapters) == ("compare", "deepspeed")
    assert args.workload == "examples/deepspeed-techniques.toml"
    variants = matrix_variants(Workload.from_file(path), parse_matrix(args.matrix))
    cells = {(w.optimizations.zero_stage, w.optimizations.offload, w.optimizations.recompute, w.train.optimizer_impl)
             for _, w in variants}
    expected = {(0, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "optimizer+params")}
    assert cells == {(z, o, r, "cpu_adam" if o != "none" else "torch") for z, o in expected for r in ("none", "full")}
    assert len(variants) == 10 and len({label for label, _ in variants}) == 10
    assert variants[0][0] == "zero_stage=0,offload=none,optimizer_impl=torch,recompute=none"
    assert len({w.problem_hash for _, w in variants}) == 1  # one problem: the parity column compares every cell
    if "deepspeed" in adapters():
        for _, w in variants:
            check_supported(get_adapter("deepspeed"), w)


def test_zipped_matrix_axes():
    """--matrix 'a,b=1,x;2,y' sets several fields together per variant (zipped), crossed with other axes;
    a variant with the wrong number of values is one clear error."""
    from llmadapt.analysis.comparison import matrix_variants, parse_matrix
    from llmadapt.errors import LlmadaptError

    matrix = parse_matrix(["optimizations.zero_stage,optimizations.offload=1,optimizer;3,optimizer+params",
                           "parallelism.dp=1,2"])
    assert matrix == {"optimizations.zero_stage,optimizations.offload": [(1, "optimizer"), (3, "optimizer+params")],
                      "parallelism.dp": [1, 2]}
    variants = matrix_variants(Workload(), matrix)
    assert [label for label, _ in variants] == [
        "zero_stage=1,offload=optimizer,dp=1", "zero_stage=1,offload=optimizer,dp=2",
        "zero_stage=3,offload=optimizer+params,dp=1", "zero_stage=3,offload=optimizer+params,dp=2"]
    assert variants[2][1].optimizations.offload == "optimizer+params" and variants[3][1].parallelism.dp == 2
    with pytest.raises(LlmadaptError, match=r"variant '3' has 1 values for 2 paths"):
        parse_matrix(["optimizations.zero_stage,optimizations.offload=1,optimizer;3"])
