"""Multi-run commands ended by SIGTERM (a scheduler's cancel) or Ctrl-C: the table of the runs that ended is on disk,
readable and marked partial, the console says where it is, and the next run picks up what is there.

compare and sweep run as the CLI in a session of their own (as a scheduler starts them), stopped once their first run
has ended (the second run's folder exists); maxbatch with a stub probe interrupted at its third probe.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmadapt.testing import environments_unready, interruptible

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama.toml"
SHORT = ["--set", "train.steps=2", "--set", "train.warmup_steps=0", "--set", "telemetry.interval_s=0"]
HANG_GUARD_S = 240

needs_torch = pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmadapt.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=interruptible)


def run_folders(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.is_dir() and (p / "launch.json").is_file()) if out.is_dir() else []


def terminate_in_second_run(proc: subprocess.Popen, out: Path) -> tuple[int, str]:
    """SIGTERM once the second run has started (the first has ended and been counted); the exit code and stderr."""
    deadline = time.monotonic() + HANG_GUARD_S
    while len(run_folders(out)) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no second run started: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"did not end after SIGTERM: {proc.communicate()[1][-3000:]}") from None
    return proc.returncode, err


@needs_torch
def test_an_interrupted_compare_leaves_its_partial_table_and_reuse_resumes_it(tmp_path):
    out = tmp_path / "runs"
    grid = ["compare", EXAMPLE, "--adapters", "torch", "--matrix", "optimizations.recompute=none,full", *SHORT,
            "--out", out]
    code, err = terminate_in_second_run(cli(*grid), out)
    assert code == 143, err[-3000:]
    (saved,) = out.glob("compare-*.json")
    assert f"the partial comparison (1 run(s), 1 not made) is in {saved}" in err, err[-3000:]
    table = json.loads(saved.read_text())
    assert table["partial"] is True and table["interrupted"] == "terminated by SIGTERM"
    assert [r["label"] for r in table["rows"]] == ["torch dp1 mb4"] and table["rows"][0]["status"] == "ok"
    assert table["pending"] == ["torch dp1 recompute=full mb4"]
    assert "partial: 1 run(s) not made" in table["table"]
    first = table["rows"][0]["run_dir"]

    before = run_folders(out)
    again = subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, grid), "--reuse", "--json"],
                           capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"1 run(s) reused from {out}: {Path(first).name}" in again.stderr
    assert len(run_folders(out)) == len(before) + 1  # only the run the interruption stopped is made again
    done = json.loads(again.stdout)
    assert done["partial"] is False and done["rows"][0]["run_dir"] == first
    assert json.loads(Path(done["saved"]).read_text())["counts"]["ok"] == 2


@needs_torch
def test_an_interrupted_sweep_leaves_its_partial_results_and_resumes(tmp_path):
    out = tmp_path / "runs"
    (tmp_path / "grid.toml").write_text(f'''workload = "{EXAMPLE}"
adapters = ["torch"]
set = ["train.steps=2", "train.warmup_steps=0", "telemetry.interval_s=0"]
[matrix]
"optimizations.recompute" = ["none", "full"]
''')
    code, err = terminate_in_second_run(cli("sweep", "run", tmp_path / "grid.toml", "--out", out), out)
    assert code == 143, err[-3000:]
    (results,) = out.glob("sweep-*/results.json")
    assert f"the sweep's results so far (1 of 2 cells done) are in {results}" in err, err[-3000:]
    data = json.loads(results.read_text())
    assert data["partial"] is True and data["interrupted"] == "terminated by SIGTERM"
    assert [c["status"] for c in data["cells"]] == ["done", "pending"]
    assert data["cells"][0]["run_dir"] and "1 done" in data["table"]
    # the attempt the signal stopped is the second cell's, marked, not a folder beside its attempts
    (stopped,) = [str(p) for p in run_folders(out) if str(p) != data["cells"][0]["run_dir"]]
    assert data["cells"][1]["run_dir"] == stopped and data["cells"][1]["attempts"] == 1
    (state,) = [json.loads(p.read_text()) for p in out.glob("sweep-*/cells/*.json")
                if json.loads(p.read_text())["id"] == data["cells"][1]["id"]]
    assert [(a["run_dir"], a["status"], a["failure"]) for a in state["attempts"]] == [
        (stopped, "interrupted", "terminated by SIGTERM")]

    again = subprocess.run([sys.executable, "-m", "llmadapt.cli", "sweep", "run", str(tmp_path / "grid.toml"),
                            "--out", str(out)], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "done already" in again.stderr
    final = json.loads(results.read_text())
    assert final["partial"] is False and [c["status"] for c in final["cells"]] == ["done", "done"]
    assert final["cells"][0]["run_dir"] == data["cells"][0]["run_dir"]


def test_an_interrupted_maxbatch_ends_its_file_with_a_partial_result(tmp_path):
    from llmadapt import Workload
    from llmadapt.analysis.perf.maxbatch import read_maxbatch
    from llmadapt.experiments.maxbatch import maxbatch
    from llmadapt.contract.perf import Probe
    from llmadapt.errors import Terminated

    def probe(w, b, where):
        if b == 4:
            raise Terminated("terminated by SIGTERM")
        return Probe(batch=b, outcome="fits", run_dir="", message=None, steps_completed=2, peak_memory_bytes=None,
                     step_time_s=None, samples_per_s=None, memory_limit_bytes=1 << 30, memory_limit_kind="RLIMIT_AS",
                     seconds=0.0)

    said: list[str] = []
    with pytest.raises(Terminated):
        maxbatch(Workload.from_file(EXAMPLE), memory_limit_bytes=1 << 30, out=tmp_path, probe=probe, log=said.append)
    (search,) = tmp_path.iterdir()
    found = read_maxbatch(search)
    assert [p.batch for p in found.probes] == [1, 2]
    assert found.result.status == "failed" and found.result.max_batch == 2
    assert found.result.message.startswith("partial: the search was interrupted (terminated by SIGTERM) after 2 "
                                           "probe(s); max batch >= 2 per rank so far")
    assert said[-1].endswith(f"is in {search / 'probes.jsonl'}; the same command again (same --out) resumes it")


def test_an_interrupted_maxbatch_resumes_without_probing_a_batch_twice(tmp_path):
    """The same search again goes on in the interrupted one's folder: the batches probed are not probed again, and
    it ends where an uninterrupted search does; a search with other settings leaves it as it is."""
    from llmadapt import Workload
    from llmadapt.analysis.perf.maxbatch import read_maxbatch
    from llmadapt.experiments.maxbatch import maxbatch
    from llmadapt.contract.perf import Probe
    from llmadapt.errors import Terminated

    probed: list[int] = []
    stop_at: list[int] = [8]

    def probe(w, b, where):  # fits up to batch 20
        if b in stop_at:
            stop_at.clear()
            raise Terminated("terminated by SIGTERM")
        probed.append(b)
        return Probe(batch=b, outcome="fits" if b <= 20 else "oom", run_dir="", message=None, steps_completed=2,
                     peak_memory_bytes=None, step_time_s=None, samples_per_s=None, memory_limit_bytes=1 << 30,
                     memory_limit_kind="RLIMIT_AS", seconds=0.0)

    w, said = Workload.from_file(EXAMPLE), []

    def search(**options):
        return maxbatch(w, memory_limit_bytes=1 << 30, out=tmp_path, probe=probe, log=said.append, **options)

    with pytest.raises(Terminated):
        search()
    (folder,) = tmp_path.iterdir()
    other = search(steps=3).search_dir
    assert other != folder and f"{folder}: an interrupted search with another steps: left as it is" in said
    probed.clear()
    found = search()
    assert found.search_dir == folder and f"resuming {folder}: 3 probe(s) made there are not made again" in said
    assert probed == [8, 16, 32, 24, 20, 22, 21]  # 1, 2 and 4 were probed before the interruption
    assert found.result.status == "ok" and found.result.max_batch == 20 and found.result.probes == 10
    assert [p.batch for p in read_maxbatch(folder).probes] == [1, 2, 4, *probed]
