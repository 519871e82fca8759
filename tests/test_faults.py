"""Every way a run can be ended from outside: what is kept, what is said, and that nothing of it is left.

The orchestrator runs as the CLI in its own session (as a scheduler starts it), so that signals reach it
alone. After each test no process whose command line names the run folder may be alive.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

from llmadapt import run
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.testing import environments_unready, interruptible, standard_workloads

pytestmark = pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny-llama.toml"
LONG = ["--set", "train.steps=100000"]  # ends only when it is ended
HANG_GUARD_S = 240  # bounds every wait below: a test that would hang fails instead


def cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmadapt.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=interruptible,
                            **kwargs)


def run_dir_of(out: Path) -> Path:
    (found,) = [p for p in out.iterdir() if p.is_dir()]
    return found


def steps_in(run_dir: Path, rank: int = 0) -> int:
    path = run_dir / f"rank-{rank:05d}.jsonl"
    return sum(1 for r in read_jsonl(path, check=False) if r["type"] == "step") if path.is_file() else 0


def wait_for_steps(out: Path, proc: subprocess.Popen, n: int, ranks: int = 1) -> Path:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        dirs = [p for p in out.iterdir() if p.is_dir()] if out.is_dir() else []
        if dirs and all(steps_in(dirs[0], r) >= n for r in range(ranks)):
            return dirs[0]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {n} steps within {HANG_GUARD_S} s: {proc.communicate()}")


def leftovers(run_dir: Path) -> list[str]:
    """Processes still alive whose command line names the run folder (the launcher and every rank do)."""
    found = []
    needle = str(run_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {command[:200]}")
    return found


def wait_until_gone(run_dir: Path, limit: float) -> list[str]:
    deadline = time.monotonic() + limit
    while (left := leftovers(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the orchestrator did not end by itself: {err[-2000:]}")
    return proc.returncode, out, err


@pytest.mark.parametrize("sig, code, dp", [
    (signal.SIGTERM, 143, 1), (signal.SIGTERM, 143, 2), (signal.SIGINT, 130, 2),
])
def test_a_signalled_orchestrator_stops_its_workers_and_keeps_a_summary(tmp_path, sig, code, dp):
    """SIGTERM (a scheduler's cancel) is handled as Ctrl-C is: workers stopped, partial summary, non-zero exit."""
    proc = cli("run", str(EXAMPLE), "--adapter", "torch", "--set", f"parallelism.dp={dp}", *LONG,
               "--out", str(tmp_path))
    run_dir = wait_for_steps(tmp_path, proc, 3, ranks=dp)
    os.kill(proc.pid, sig)
    returncode, _, err = finish(proc)
    assert returncode == code, err[-2000:]
    assert leftovers(run_dir) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_completed"] >= 3
    causes = {(f["cause"], f["rank"]) for f in summary["failures"]}
    assert ("interrupted", None) in causes
    if sig == signal.SIGTERM:
        assert any("SIGTERM" in f["message"] for f in summary["failures"] if f["rank"] is None)
        assert "terminated (SIGTERM)" in err


@pytest.mark.parametrize("dp", [1, 2])
def test_a_killed_orchestrator_leaves_no_orphans_and_its_folder_can_be_shown(tmp_path, dp):
    """SIGKILL of the orchestrator: the ranks notice and exit; `show` reads the folder that has no summary."""
    proc = cli("run", str(EXAMPLE), "--adapter", "torch", "--set", f"parallelism.dp={dp}", *LONG,
               "--out", str(tmp_path))
    run_dir = wait_for_steps(tmp_path, proc, 3, ranks=dp)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    # The ranks stop within their grace period (llmadapt.runtime.lifecycle.ORPHAN_GRACE_S) plus torchrun's exit.
    assert wait_until_gone(run_dir, 60) == []
    assert not (run_dir / "summary.json").exists()
    failures = [r for r in read_jsonl(run_dir / "rank-00000.jsonl") if r["type"] == "failure"]
    assert failures and "orchestrator" in failures[0]["message"]
    shown = subprocess.run([sys.executable, "-m", "llmadapt.cli", "show", str(run_dir)], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "incomplete run" in shown.stdout and "steps      " in shown.stdout


SERVE = EXAMPLE.parent / "serve-tiny.toml"
OFFLINE = ["--set", "serve.mode=offline", "--set", "serve.requests=2000", "--set", "serve.warmup_requests=1",
           "--set", "serve.output_len.dist=uniform", "--set", "serve.output_len.low=64",
           "--set", "serve.output_len.high=192"]
"""An offline run of the reference adapter (transformers' generate) still generating when it is ended: a few
thousand requests, long outputs, one generate call per output length."""


def offline_engine_started(out: Path, proc: subprocess.Popen) -> Path:
    """The offline run's folder once its worker wrote the header (its engine loaded, about to generate)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        dirs = [p for p in out.iterdir() if p.is_dir()] if out.is_dir() else []
        rank = dirs[0] / "rank-00000.jsonl" if dirs else None
        if rank and rank.is_file() and any(r["type"] == "header" for r in read_jsonl(rank, check=False)):
            return dirs[0]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no offline header within {HANG_GUARD_S} s: {proc.communicate()}")


def test_a_signalled_offline_run_stops_its_worker_with_a_record(tmp_path):
    """SIGTERM to the orchestrator of an offline run: it stops the worker, which writes why (killed, exit 143)
    before it exits; the summary says the run was interrupted, and nothing is left running."""
    if environments_unready("hf"):
        pytest.skip(environments_unready("hf"))
    proc = cli("run", str(SERVE), "--adapter", "hf", *OFFLINE, "--out", str(tmp_path))
    run_dir = offline_engine_started(tmp_path, proc)
    os.kill(proc.pid, signal.SIGTERM)
    returncode, _, err = finish(proc)
    assert returncode == 143, err[-2000:]
    assert wait_until_gone(run_dir, 30) == []
    (failure,) = [r for r in read_jsonl(run_dir / "rank-00000.jsonl") if r["type"] == "failure"]
    assert (failure["cause"], failure["exit_code"]) == ("killed", 143), failure
    assert failure["message"].startswith("stopped by signal SIGTERM"), failure
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert ("interrupted", None) in {(f["cause"], f["rank"]) for f in summary["failures"]}


def test_a_killed_orchestrator_leaves_no_offline_worker(tmp_path):
    """SIGKILL of the orchestrator of an offline run: its worker notices (the orphan watch), writes why and exits."""
    if environments_unready("hf"):
        pytest.skip(environments_unready("hf"))
    proc = cli("run", str(SERVE), "--adapter", "hf", *OFFLINE, "--out", str(tmp_path))
    run_dir = offline_engine_started(tmp_path, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    # Within its grace period (llmadapt.runtime.lifecycle.ORPHAN_GRACE_S) at the latest.
    assert wait_until_gone(run_dir, 30) == []
    (failure,) = [r for r in read_jsonl(run_dir / "rank-00000.jsonl") if r["type"] == "failure"]
    assert failure["cause"] == "killed" and "orchestrator" in failure["message"], failure
    assert not (run_dir / "summary.json").exists()


def test_a_rank_killed_by_a_signal_is_named_with_the_signal(tmp_path):
    w = standard_workloads()["train-dp2"]
    result = run(w, "torch", out=tmp_path, fault={"kind": "kill", "step": 2, "rank": 1}, timeout=180)
    assert not result.ok and result.summary.steps_completed == 2
    (mine,) = [f for f in result.summary.failures if f.rank == 1]
    assert mine.cause == "killed" and "SIGKILL" in mine.message and mine.exit_code == -9
    assert leftovers(result.run_dir) == []


def test_a_killed_rank_is_the_first_failure_told_then_its_peers(tmp_path):
    """Rank 1 of 2 SIGKILLed at step 5: its death, with its pid and step, is the first failure on the console (the
    progress events) and in the summary; rank 0's failure (a gloo error, or its stop) comes after it."""
    from llmadapt.analysis.report import render_summary

    w = standard_workloads()["train-dp2"].with_overrides(["train.steps=8"])
    told: list[dict] = []
    result = run(w, "torch", out=tmp_path, fault={"kind": "kill", "step": 5, "rank": 1}, timeout=180,
                 progress=told.append)
    assert not result.ok and result.summary.steps_completed == 5
    lines = [f"rank {r['rank']}: {r['message']}" for r in told if r.get("type") == "failure"]
    assert len(lines) >= 2, lines
    assert re.match(r"rank 1: rank 1 \(pid \d+\) was killed by SIGKILL \(signal 9\) at step 5\b", lines[0]), lines
    assert lines[1].startswith("rank 0: "), lines
    first, second = result.summary.failures[:2]
    assert (first.rank, first.cause, first.step) == (1, "killed", 5) and second.rank == 0
    shown = [x for x in render_summary(attrs.asdict(result.summary)).splitlines() if x.startswith("failure")]
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL \(signal 9\) at step 5", shown[0]), shown
    assert leftovers(result.run_dir) == []


def test_a_frozen_rank_times_out_and_nothing_outlives_the_run(tmp_path):
    """SIGSTOP of one rank: only SIGKILL reaches it, and torchrun started it in a session of its own. Rank 0 waits
    in the step's all-reduce, so the stall timeout ends the run; the run's own timeout is only a cap."""
    w = standard_workloads()["train-dp2"].with_overrides(["train.steps=1000"])
    result = run(w, "torch", out=tmp_path, fault={"kind": "stop", "step": 2, "rank": 1}, timeout=HANG_GUARD_S,
                 stall_timeout=10)
    assert not result.ok
    (stall,) = [f for f in result.summary.failures if f.cause == "timeout"]
    assert stall.message.startswith("no progress for 10 s after step 1 (the stall timeout)"), stall.message
    assert result.summary.steps_completed == 2
    assert leftovers(result.run_dir) == []


def test_a_hang_before_the_first_step_is_left_to_the_runs_timeout(tmp_path):
    """Start-up is unbounded by the stall timeout (imports and compilation take what they take): a hang in the
    first step is ended by the run's timeout, whatever the stall timeout says."""
    w = standard_workloads()["train"]
    result = run(w, "torch", out=tmp_path, fault={"kind": "hang", "step": 0}, timeout=20, stall_timeout=1)
    assert [(f.cause, f.message) for f in result.summary.failures if f.rank is None] == [
        ("timeout", "the run exceeded its timeout of 20 s")]
    assert result.summary.steps_completed == 0
    assert leftovers(result.run_dir) == []


def test_the_stall_watch_counts_from_the_first_step_to_the_last(tmp_path, monkeypatch):
    """StallWatch on a rank file written by hand, on a clock the test moves: nothing before the first step, a
    failure once a gap reaches the limit, an evaluation counting as progress, nothing after the last step."""
    from llmadapt.launch import supervise

    now = [100.0]
    monkeypatch.setattr(supervise.time, "monotonic", lambda: now[0])
    rank_file = tmp_path / "rank-00000.jsonl"
    rank_file.write_text('{"type": "header"}\n')
    watch = supervise.StallWatch(5.0, rank_file, last_step=3)

    def write(record: dict, after_s: float) -> None:
        now[0] += after_s
        with open(rank_file, "a") as f:
            f.write(json.dumps(record) + "\n")
        watch.check()  # supervise polls every 0.1 s: a record is seen when it is written

    now[0] += 60
    assert watch.check() is None  # start-up: the run's timeout's
    write({"type": "step", "step": 0}, 1)
    write({"type": "telemetry"}, 4.5)  # a background sampler's record is not progress
    assert watch.check() is None
    now[0] += 0.6
    failure = watch.check()
    assert failure is not None and (failure.cause, failure.step) == ("timeout", 1)
    assert failure.message.startswith("no progress for 5 s after step 0")
    write({"type": "evaluation", "step": 0}, 0)
    assert watch.check() is None
    write({"type": "step", "step": 3}, 4.9)
    now[0] += 3600
    assert watch.check() is None  # after the last step: the final evaluation and the save are the run timeout's


def test_a_rank_that_dies_after_its_last_record_is_a_warning_not_a_failure(tmp_path):
    """Every rank wrote its end record, then rank 1 was SIGKILLed in teardown: the run stands, and says so."""
    w = standard_workloads()["train-dp2"]
    result = run(w, "torch", out=tmp_path, fault={"kind": "kill", "step": "teardown", "rank": 1}, timeout=180)
    assert result.ok, result.summary.failures
    assert result.summary.steps_completed == w.train.total_steps
    assert any("rank 1" in m and "SIGKILL" in m for m in result.summary.warnings), result.summary.warnings
    shown = subprocess.run([sys.executable, "-m", "llmadapt.cli", "show", str(result.run_dir)],
                           capture_output=True, text=True, timeout=60)
    assert "warning    after every rank wrote its last record" in shown.stdout
    assert leftovers(result.run_dir) == []


def test_two_runs_into_one_folder_at_once_keep_apart(tmp_path):
    procs = [cli("run", str(EXAMPLE), "--adapter", "torch", "--set", "train.steps=3", "--set", "train.warmup_steps=1",
                 "--out", str(tmp_path)) for _ in range(2)]
    for proc in procs:
        code, _, err = finish(proc)
        assert code == 0, err[-2000:]
    dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(dirs) == 2
    for d in dirs:
        assert json.loads((d / "summary.json").read_text())["status"] == "ok"
        assert leftovers(d) == []


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_full_disk_is_one_line_and_keeps_what_was_written(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = disk / "runs"
        out.mkdir()
        (disk / "filler").write_bytes(b"\0" * (1024 * 1024 - 48 * 1024))  # leaves about 48 KiB
        proc = cli("run", str(EXAMPLE), "--adapter", "torch", *LONG, "--out", str(out))
        code, _, err = finish(proc)
        assert code == 4, err[-2000:]  # an I/O error (errors.ExitCode.IO), not bad input (2)
        assert "Traceback" not in err
        (line,) = [x for x in err.splitlines() if x.startswith("error:")]
        assert "No space left on device" in line
        run_dir = run_dir_of(out)
        assert steps_in(run_dir) >= 1  # what was written before the disk filled is readable
        shown = subprocess.run([sys.executable, "-m", "llmadapt.cli", "show", str(run_dir)], capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "incomplete run" in shown.stdout
        assert leftovers(run_dir) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_a_summary_the_disk_refuses_is_an_io_error_not_bad_input(tmp_path):
    """No room for summary.json (/dev/full answers every write with ENOSPC): the machine's failure, exit code 4."""
    from llmadapt.errors import exit_code_of
    from llmadapt.contract.readback import summarise

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    w = standard_workloads()["train"].with_overrides(["train.steps=1", "train.warmup_steps=0"])
    result = run(w, "torch", out=tmp_path, timeout=180)
    summary = result.run_dir / "summary.json"
    summary.unlink()
    summary.symlink_to("/dev/full")
    with pytest.raises(Exception, match="could not write .*summary.json: No space left on device") as caught:
        summarise(result.run_dir)
    assert getattr(caught.value, "exit_code", None) == 4 and exit_code_of(caught.value) == 4
    (tmp_path / "file").touch()
    proc = subprocess.run([sys.executable, "-m", "llmadapt.cli", "run", str(EXAMPLE), "--out", str(tmp_path / "file"),
                           "--set", "train.steps=1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]  # --out naming a file is bad input
    assert "cannot write the run directory" in proc.stderr


def test_an_oom_fault_without_a_memory_cap_is_refused_before_anything_starts(tmp_path):
    """Without an address-space cap the injected OOM would grow until the kernel's OOM killer picks a process."""
    from llmadapt.errors import LlmadaptError

    with pytest.raises(LlmadaptError, match="fault 'oom' needs a memory limit"):
        run(standard_workloads()["train"], "torch", out=tmp_path / "runs", fault={"kind": "oom", "step": 1})
    assert not (tmp_path / "runs").exists()
