"""The reference server `hf` (transformers serve, continuous batching) driven for real."""

import os
import signal
import uuid
from pathlib import Path

import pytest

from llmadapt import Workload, run
from llmadapt.contract.jsonl import read_jsonl

pytest.importorskip("aiohttp")


def workload(**serve):
    base = {"requests": 6, "warmup_requests": 1, "input_len": {"dist": "uniform", "low": 4, "high": 24},
            "output_len": {"mean": 6}, "arrival": {"process": "closed", "concurrency": 2}, "request_timeout_s": 120.0}
    base.update(serve)
    return Workload.from_dict({"kind": "serve", "model": {"preset": "tiny-llama"}, "serve": base})


MARK = "LLMADAPT_TEST_HF_MARK"


def engine_pids(mark: str) -> list[int]:
    """Live `transformers serve` processes started under ``MARK=mark``: only this test's (other tests, on other
    workers, start engines of their own; CI once found one of those)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
                env = (p / "environ").read_bytes().split(b"\0")
                state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if any(c.endswith(b"/transformers") for c in cmd) and b"serve" in cmd and \
                    f"{MARK}={mark}".encode() in env and state != "Z":
                pids.append(int(p.name))
    return pids


def test_hf_server_serves_the_canonical_model(tmp_path, monkeypatch):
    """Every request completes; the engine counts exactly the prompt tokens the generator built; no process is left."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)  # the engine inherits it
    result = run(workload(), "hf", out=tmp_path, timeout=600)
    assert result.ok, (result.summary.failures, (result.run_dir / "engine.log").read_text()[-2000:])
    s = result.summary.serving
    assert s.completed == 6 and s.failed == 0
    assert not s.output_length_forced  # transformers serve has no ignore_eos: recorded, not faked
    requests = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "request"]
    assert all(r["server_input_tokens"] == r["input_tokens"] for r in requests)
    assert all(1 <= r["output_tokens"] <= 6 for r in requests)
    assert engine_pids(mark) == []
    # what ran beside the run: the engine (its own process group) counted as the run's own CPU, not as another
    # process's, so the machine's quiet is judged; the engine's work is far more CPU than the client's
    (window,) = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "interference"]
    client = s.client_cpu_s
    assert window["machine_busy_cpu_s"] is not None and window["own_cpu_s"] > client > 0, (window, client)
    assert result.summary.interference is not None


def test_engine_killed_mid_run_is_reported(tmp_path):
    """The engine dies after a few requests: the rest fail as engine_dead, the run is failed, the summary written."""
    killed, run_dirs, groups = [], [], []

    def progress(record):
        if record.get("type") == "start":
            run_dirs.append(Path(record["run_dir"]))
        if record.get("type") == "request" and not record["warmup"] and not killed:
            pid = int((run_dirs[0] / "engine.pid").read_text())
            # its own process group, in our session (llmadapt.serving.engine_popen_options says why)
            groups.append((os.getpgid(pid) == pid, os.getsid(pid) == os.getsid(0)))
            os.killpg(pid, signal.SIGKILL)  # the engine's whole process group
            killed.append(pid)

    w = workload(requests=8, arrival={"process": "constant", "rate": 2.0})
    result = run(w, "hf", out=tmp_path, timeout=600, progress=progress)
    s = result.summary.serving
    assert killed and s.completed >= 1 and s.failed >= 1
    assert groups == [(True, True)]
    assert "engine_dead" in s.failures_by_cause
    assert result.summary.status == "failed"
    # how the engine ended, once: its exit status, the signal named
    (ended,) = [f for f in result.summary.failures if "engine" in f.message]
    assert (ended.cause, ended.exit_code) == ("killed", -signal.SIGKILL), ended
    assert "the engine was killed by SIGKILL (signal 9) during this load point" in ended.message


def test_an_engine_dead_before_any_request_completed_is_failed_not_valid(tmp_path):
    """The engine crashes (SIGSEGV) once warmed up: every measured request fails. The failure records the signal,
    the run is failed, and nothing reads valid: its serving figures, its compare row."""
    from llmadapt.analysis.comparison import row_metrics

    run_dirs, killed = [], []

    def progress(record):
        if record.get("type") == "start":
            run_dirs.append(Path(record["run_dir"]))
        if record.get("type") == "request" and record["warmup"] and not killed:
            pid = int((run_dirs[0] / "engine.pid").read_text())
            os.kill(pid, signal.SIGSEGV)  # as a crash in native code ends it
            killed.append(pid)

    # one request at a time: the warm-up's record comes before the first measured request is sent
    w = workload(requests=4, arrival={"process": "closed", "concurrency": 1})
    result = run(w, "hf", out=tmp_path, timeout=600, progress=progress)
    s = result.summary.serving
    assert killed and (s.completed, s.failed) == (0, 4), s
    assert not s.valid and "no measured request completed (4 of 4 failed)" in s.validity, s.validity
    assert result.summary.status == "failed"
    (ended,) = [f for f in result.summary.failures if "engine" in f.message]
    assert (ended.cause, ended.exit_code) == ("killed", -signal.SIGSEGV), ended
    assert "was killed by SIGSEGV (signal 11)" in ended.message
    assert row_metrics(result.summary, None)["valid"] == "NO"


SLOW_TO_DIE = """
import subprocess, sys, time
# A child that ignores SIGTERM and holds memory: after SIGKILL it takes a moment to tear its pages down,
# the window in which a stop that only waited for the engine itself returned with the child still there.
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "hold = b'x' * (256 << 20); print('held', flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
assert child.stdout.readline() == b"held\\n"
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("attempt", range(3))
def test_stop_returns_when_nothing_of_the_engine_group_is_left(tmp_path, attempt):
    """The hf server's stop: SIGTERM to the engine, SIGKILL to what is left of its group, and it returns only
    when /proc shows no live process of that group (CI once found an engine child alive right after a run)."""
    import subprocess
    import sys

    from llmadapt.adapter import engine_popen_options, group_members
    from llmadapt.reference import serve as hf_serve

    server = hf_serve.HFServer.__new__(hf_serve.HFServer)
    server.log = open(tmp_path / "engine.log", "wb")
    server.proc = subprocess.Popen([sys.executable, "-c", SLOW_TO_DIE], stdout=subprocess.PIPE,
                                   **engine_popen_options())
    assert server.proc.stdout.readline() == b"ready\n"
    pgid = server.proc.pid
    assert len(group_members(pgid)) == 2
    server.stop()
    assert group_members(pgid) == []
    assert server.log.closed
