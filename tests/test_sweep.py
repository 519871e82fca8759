"""Sweeps (llmadapt.experiments.sweep): a grid with stable cell ids and a state per cell, run locally, resumed,
failed cells retried. The Slurm job array, with a cancelled job resumed, is in tests/test_slurm.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt.experiments import sweep as sweeps
from llmadapt.errors import LlmadaptError
from llmadapt.testing import environments_unready

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GRID = f'''workload = "{EXAMPLES / 'tiny-llama.toml'}"
adapters = ["torch"]
set = ["train.steps=2", "train.warmup_steps=0", "telemetry.interval_s=0"]
retries = 1
[matrix]
"optimizations.recompute" = ["none", "full"]
'''


def test_a_sweep_expands_to_cells_with_stable_ids(tmp_path):
    (tmp_path / "grid.toml").write_text(GRID)
    one = sweeps.load(tmp_path / "grid.toml", tmp_path / "runs")
    two = sweeps.load(tmp_path / "grid.toml", tmp_path / "elsewhere")
    assert [c.id for c in one.cells] == [c.id for c in two.cells] and len(one.cells) == 2
    assert one.folder.name == two.folder.name
    described = json.loads((one.folder / "sweep.json").read_text())
    assert [c["id"] for c in described["cells"]] == [c.id for c in one.cells]
    (tmp_path / "repeated.toml").write_text(GRID.replace("retries = 1", "retries = 1\nrepeat = 2"))
    repeated = sweeps.load(tmp_path / "repeated.toml", tmp_path / "runs")
    assert len(repeated.cells) == 4 and len({c.id for c in repeated.cells}) == 4
    assert {c.id for c in one.cells} < {c.id for c in repeated.cells}  # the first repeat is the same cell


def test_sweep_cells_are_titled_by_what_sets_them_apart(tmp_path):
    (tmp_path / "grid.toml").write_text(f'''workload = "{EXAMPLES / 'tiny-mixtral.toml'}"
adapters = ["torch"]
[matrix]
"train.global_batch" = [2, 4]
"model.experts_per_token" = [2, 4]
''')
    titles = [c.title for c in sweeps.load(tmp_path / "grid.toml", tmp_path / "runs").cells]
    assert titles == [f"torch dp1 experts_per_token={e} global_batch={b}" for b in (2, 4) for e in (2, 4)]


@pytest.mark.parametrize("text, message", [
    ('adapters = ["torch"]\n', "'workload' must name a workload file"),
    ('colour = "red"\n' + GRID, "unknown key 'colour'"),
    (GRID.replace("retries = 1", "retries = -1"), "'retries' must be a whole number >= 0"),
    ("repeat = 0\n" + GRID, "'repeat' must be a whole number >= 1"),
    (GRID.replace('"optimizations.recompute"', '"optimizations.colour"'), "unknown field"),
    (GRID.replace('adapters = ["torch"]', 'adapters = ["nope"]'), "unknown adapter 'nope'"),
    ("workload = [", "could not be parsed"),
])
def test_a_sweep_file_whose_cells_cannot_all_be_built_is_one_line(text, message, tmp_path):
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(LlmadaptError, match=message) as caught:
        sweeps.load(tmp_path / "bad.toml", tmp_path / "runs")
    assert "\n" not in str(caught.value)
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "sweep", "run", str(tmp_path / "bad.toml"),
                          "--out", str(tmp_path / "cli")], capture_output=True, text=True)
    assert out.returncode == 2 and message.split("'")[0] in out.stderr and not (tmp_path / "cli").exists()


def test_failed_cells_are_retried_then_stay_failed_and_done_cells_are_skipped(tmp_path, monkeypatch):
    """The run itself replaced: the first cell fails every time, the second fails once, then succeeds."""
    import importlib

    run_module = importlib.import_module("llmadapt.launch.runner")

    (tmp_path / "grid.toml").write_text(GRID)
    sweep = sweeps.load(tmp_path / "grid.toml", tmp_path / "runs")
    calls: list[str] = []

    class Summary:
        def __init__(self, ok):
            self.failures = [] if ok else [type("F", (), {"message": "injected"})()]

    class Result:
        def __init__(self, run_dir, ok):
            self.run_dir, self.ok, self.summary = run_dir, ok, Summary(ok)

    def fake_run(workload, adapter, **options):
        calls.append(workload.optimizations.recompute)
        folder = tmp_path / "runs" / f"fake-{len(calls)}"
        folder.mkdir(parents=True)
        ok = workload.optimizations.recompute == "full" and calls.count("full") > 1
        (folder / "launch.json").write_text(json.dumps({"workload_hash": workload.content_hash,
                                                        "adapter_version": "0", "workload": workload.to_dict()}))
        return Result(folder, ok)

    monkeypatch.setattr(run_module, "run", fake_run)
    sweep.run()
    assert calls == ["none", "none", "full", "full"]  # 1 + retries attempts at most
    states = {c.planned.variant: st for c, _, st in sweep.status()}
    assert states["recompute=none"]["status"] == "failed" and len(states["recompute=none"]["attempts"]) == 2
    assert states["recompute=full"]["status"] == "done" and len(states["recompute=full"]["attempts"]) == 2
    assert [a["status"] for a in states["recompute=full"]["attempts"]] == ["failed", "ok"]
    sweep.run()  # the failed cell is not retried again (its retries are spent)
    assert calls == ["none", "none", "full", "full", "full"]  # the done cell's fake run is not an ok run: rerun
    assert [s for _, s, _ in sweep.status()][0] == "failed"


def test_an_attempt_stopped_or_killed_mid_cell_stays_among_its_attempts_marked(tmp_path, monkeypatch):
    """The run itself replaced: an attempt whose folder exists when a stop signal ends it, or when its process is
    killed (the cell's state as the kill leaves it), is listed in the cell's attempts, marked interrupted, not
    left beside them; it does not count against the retries; the next attempt follows it."""
    import importlib

    run_module = importlib.import_module("llmadapt.launch.runner")
    (tmp_path / "grid.toml").write_text(GRID)
    sweep = sweeps.load(tmp_path / "grid.toml", tmp_path / "runs")
    cell = sweep.cells[0]
    seen: list[dict] = []

    def stopped_run(workload, adapter, **options):
        folder = Path(options.get("out", "runs")) / (options.get("run_id") or "stopped")
        folder.mkdir(parents=True)
        seen.append(json.loads(sweep.state_file(cell).read_text()))  # what a SIGKILL here would leave
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run", stopped_run)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_cell(cell, out=tmp_path / "runs")
    (folder,) = [p for p in (tmp_path / "runs").iterdir() if p != sweep.folder]  # the one run folder it made
    state = sweep.state(cell)
    assert state["status"] == "pending"
    assert [(a["run_dir"], a["status"]) for a in state["attempts"]] == [(str(folder), "interrupted")]
    assert [s for c, s, _ in sweep.status() if c is cell] == ["pending"]

    # killed instead (SIGKILL: no handler ran): the state the kill left lists the folder, running, by a dead pid
    assert [(a["run_dir"], a["status"]) for a in seen[0]["attempts"]] == [(str(folder), "running")]
    sweep._write_state(cell, {**seen[0], "pid": 2**22 + 1, "node": sweeps.node_name()})
    assert [s for c, s, _ in sweep.status() if c is cell] == ["pending"]  # not running, not a spent retry
    monkeypatch.setattr(run_module, "run", lambda *a, **o: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        sweep.run_cell(cell, out=tmp_path / "runs")  # the next attempt: stopped before its folder was made
    assert [(a["run_dir"], a["status"]) for a in sweep.state(cell)["attempts"]] == [(str(folder), "interrupted")]


def test_a_local_sweep_runs_resumes_and_reports(tmp_path):
    if environments_unready("torch"):
        pytest.skip(environments_unready("torch"))
    (tmp_path / "grid.toml").write_text(GRID)
    cli = [sys.executable, "-m", "llmadapt.cli", "sweep"]
    out = subprocess.run([*cli, "run", str(tmp_path / "grid.toml"), "--out", str(tmp_path / "runs"), "--json"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    first = json.loads(out.stdout)
    assert first["counts"]["done"] == 2 and all(c["run_dir"] for c in first["cells"])
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    again = subprocess.run([*cli, "run", str(tmp_path / "grid.toml"), "--out", str(tmp_path / "runs"), "--json"],
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "done already" in again.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == runs  # nothing ran again
    assert json.loads(again.stdout)["cells"] == first["cells"]
    status = subprocess.run([*cli, "status", str(tmp_path / "grid.toml"), "--out", str(tmp_path / "runs")],
                            capture_output=True, text=True)
    assert "2 cells: 0 pending, 0 running, 2 done, 0 failed" in status.stdout
    # the cells' runs are ordinary runs: the store lists them
    listing = subprocess.run([sys.executable, "-m", "llmadapt.cli", "runs", "--root", str(tmp_path / "runs"),
                              "--json"], capture_output=True, text=True)
    assert len(json.loads(listing.stdout)) == 2


def test_each_cell_can_find_its_maximum_batch(tmp_path):
    """Study B's table from one sweep: after each cell's run, its largest per-rank batch, probed for real in
    isolated workers (here capped at 4: the tiny model fits every batch up to it)."""
    if environments_unready("torch"):
        pytest.skip(environments_unready("torch"))
    (tmp_path / "grid.toml").write_text(GRID.replace('"optimizations.recompute" = ["none", "full"]',
                                                     '"optimizations.recompute" = ["none"]')
                                        + "[maxbatch]\nmax_batch = 4\nmemory_limit = \"6G\"\n")
    sweep = sweeps.load(tmp_path / "grid.toml", tmp_path / "runs")
    assert sweep.maxbatch == {"max_batch": 4, "memory_limit_bytes": 6 << 30}
    sweep.run()
    (cell, status, state), = sweep.status()
    found = state["attempts"][-1]["maxbatch"]
    assert status == "done" and found["max_batch"] == 4 and found["status"] == "ok"
    assert Path(found["search_dir"]).is_dir()
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "sweep", "status", str(tmp_path / "grid.toml"),
                          "--out", str(tmp_path / "runs")], capture_output=True, text=True)
    assert "max batch" in out.stdout.splitlines()[0]
    (tmp_path / "bad.toml").write_text(GRID + "[maxbatch]\nmemory = 3\n")
    with pytest.raises(LlmadaptError, match="unknown maxbatch key 'memory'"):
        sweeps.load(tmp_path / "bad.toml", tmp_path / "runs")


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_compare_saves_its_grid_as_a_sweep_file(suffix, tmp_path):
    """compare --save-sweep: the same cells, with the same workloads, as the comparison would run; not run."""
    from llmadapt.experiments.cells import as_cells, plan
    from llmadapt.analysis.comparison import parse_matrix
    from llmadapt.spec import Workload

    matrix = ["optimizations.zero_stage,optimizations.offload=0,none;2,optimizer", "optimizations.recompute=none,full"]
    target = tmp_path / f"saved{suffix}"
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "compare", str(EXAMPLES / "deepspeed-techniques.toml"),
                          "--adapters", "deepspeed", "--cell", "torch:parallelism.dp=2", "--set", "train.steps=3",
                          *[a for m in matrix for a in ("--matrix", m)], "--save-sweep", str(target), "--out",
                          str(tmp_path / "runs")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "runs").exists()  # nothing ran
    sweep = sweeps.load(target, tmp_path / "runs", create=False)
    w = Workload.from_file(EXAMPLES / "deepspeed-techniques.toml").with_overrides(["train.steps=3"])
    expected = plan(w, as_cells(["deepspeed"], ["torch:parallelism.dp=2"]), parse_matrix(matrix))
    assert [c.planned.workload.content_hash for c in sweep.cells] == [p.workload.content_hash for p in expected
                                                                       if not p.unsupported]
    again = subprocess.run([sys.executable, "-m", "llmadapt.cli", "compare", str(EXAMPLES / "tiny-llama.toml"),
                            "--adapters", "torch", "--save-sweep", str(target)], capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr
