"""Interference: every training run records what ran beside it while it measured its steps, and `show` says quiet
or disturbed with the measured cause. The burner test starts a real competing process; the GPU branch reads a
fake NVML faithful to pynvml's names (no GPU here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmadapt import Workload
from llmadapt.analysis.report import machine_line
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.schema import validate
from llmadapt.contract.breakdowns import interference_summary
from llmadapt.runtime.interference import _gpu, interference, snapshot
from llmadapt.testing import environments_unready

ROOT = Path(__file__).resolve().parents[1]
TINY = Workload.from_file(ROOT / "examples" / "tiny-llama.toml")


def record(rank=0, node="a", window=2.0, busy=2.2, own=2.0, delay=0.01, threads=1, cores=2, steal=0.0,
           delay_threads=None, **gpu):
    return {"rank": rank, "node": node, "window_s": window, "cores": cores, "threads": threads, "load_start": 0.5,
            "load_end": 0.6, "machine_busy_cpu_s": busy, "own_cpu_s": own, "run_delay_s": delay, "steal_s": steal,
            "gpu_other_processes": gpu.get("others"), "gpu_throttle_reasons": gpu.get("throttle"),
            "run_delay_threads": delay_threads, "type": "interference"}


def test_quiet_and_each_cause_of_disturbance_with_its_measure():
    quiet = interference_summary([record(rank=0, own=1.0), record(rank=1, own=1.1)])  # 0.1 s over 2 s: 0.05 cores
    assert quiet.quiet and quiet.causes == [] and quiet.other_cpu_cores == pytest.approx(0.05)
    assert machine_line(_as_dict(quiet)).startswith("machine    quiet during the measured steps (load 0.50 -> 0.60")
    # two ranks on one node: the machine's busy time less both ranks' is the others'
    busy = interference_summary([record(rank=0, busy=4.0, own=1.0), record(rank=1, busy=4.0, own=1.0)])
    assert not busy.quiet and busy.causes == ["other processes kept 1.00 of 2 cores busy"]
    # waits for a core are reported, not judged: a run with more threads than cores makes them itself
    waits = interference_summary([record(delay=0.3, threads=2)])  # 0.3 s over 2 s x 2 threads
    assert waits.quiet and waits.run_delay_share == pytest.approx(0.075)
    assert interference_summary([record(steal=0.2)]).causes == ["the hypervisor gave 5% of the CPU to other guests (steal)"]
    assert interference_summary([record(window=0.2, steal=0.01)]).quiet is None  # one tick of a short window
    gpu = interference_summary([record(others=1, throttle=["hardware thermal", "power cap"])])
    assert gpu.causes == ["1 other process(es) on a rank's GPU", "GPU clocks held down: hardware thermal, power cap"]
    # a window too short for /proc/stat's ticks is not judged on other processes' CPU
    short = interference_summary([record(window=0.1, busy=0.3, own=0.1)])
    assert short.quiet is None and machine_line(_as_dict(short)).startswith("machine    not judged")
    assert interference_summary([]) is None


def _as_dict(summary) -> dict:
    import attrs

    return attrs.asdict(summary)


def test_a_snapshot_pair_makes_a_valid_record_with_this_process_counted():
    start = snapshot()
    cpu = time.thread_time()
    # 0.2 s of this thread's CPU (however long a busy machine takes): the wall window is at least that, while the
    # process's CPU may be more (other threads of the test worker), counted in 10 ms ticks: the difference of two
    # tick counts can come out a tick short (0.19), and 19 ticks read as 0.18999999999999773 (a float difference)
    while time.thread_time() - cpu < 0.2:
        pass
    r = interference(3, start, snapshot(), "here")
    from llmadapt.contract.schema import to_json

    data = to_json(r)
    validate(data)
    assert data["rank"] == 3 and data["window_s"] >= 0.2 and data["own_cpu_s"] >= 0.19 - 1e-9
    assert data["run_delay_s"] is not None and data["machine_busy_cpu_s"] >= data["own_cpu_s"] - 0.05


class FakeNvml:
    """pynvml's calls the GPU branch makes, for one GPU that another process shares and that runs hot."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return f"gpu{index}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=os.getpid()), SimpleNamespace(pid=999999)]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return []

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return 0x1 | 0x40  # idle (not interference) and hardware thermal slowdown

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 87

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700000  # mW

    def nvmlDeviceGetClockInfo(self, handle, clock):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # a field the device cannot give is left out


def test_the_gpu_branch_reads_other_processes_throttling_and_limits_from_nvml():
    gpu = _gpu(0, FakeNvml())
    assert gpu == {"others": 1, "throttle": ["hardware thermal"], "temperature_c": 87.0, "power_limit_w": 700.0}
    r = interference(0, {**snapshot(), "gpu": gpu}, {**snapshot(), "gpu": gpu}, "here")
    assert (r.gpu_other_processes, r.gpu_throttle_reasons, r.gpu_sm_clock_mhz) == (1, ["hardware thermal"], None)


@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
def test_a_competing_process_started_beside_a_run_shows_in_its_record(tmp_path):
    """A CPU burner on every core for the length of the run (bounded in time): the summary says disturbed, naming
    other processes' CPU with its measure, and `show` prints it."""
    from llmadapt import run
    from llmadapt.analysis.report import render_summary

    burn = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass\n"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(os.cpu_count() or 1)]
    try:
        result = run(TINY.with_overrides(["train.steps=30", "train.seq_len=128"]), "torch", out=tmp_path)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert result.ok
    records = read_jsonl(result.run_dir / "rank-00000.jsonl")
    found = [r for r in records if r["type"] == "interference"]
    assert len(found) == 1 and found[0]["window_s"] >= 0.5
    summary = json.loads((result.run_dir / "summary.json").read_text())
    i = summary["interference"]
    assert not i["quiet"] and any(c.startswith("other processes kept") for c in i["causes"]), i
    assert "machine    DISTURBED during the measured steps: other processes kept" in render_summary(summary)
    # every measured step says how long its thread waited for a core; with a burner on every core, some waited
    steps = [r for r in records if r["type"] == "step" and not r["warmup"]]
    assert all(0 <= r["run_delay_s"] <= r["seconds"] + 0.01 for r in steps), [r["run_delay_s"] for r in steps]
    assert any(r["run_delay_s"] > 0 for r in steps)
    shares = sorted(r["run_delay_s"] / r["seconds"] for r in steps)
    assert i["step_wait_share_max"] == pytest.approx(shares[-1])  # the summary is the records' (one rank)
    assert "of a step: median" in render_summary(summary)


def test_step_waits_are_summarised_beside_the_windows_not_judged():
    """A step's wait for a core is reported (median and worst share), never a cause by itself: a run with more
    threads than cores makes its own waits."""
    s = interference_summary([record()], [0.01, 0.5, 0.02])
    assert (s.step_wait_share_median, s.step_wait_share_max) == (0.02, 0.5)
    assert s.quiet and s.causes == []
    assert interference_summary([record()]).step_wait_share_max is None  # older runs: no step figures


def test_a_wait_for_a_core_is_a_share_of_thread_time_never_above_its_whole():
    """Several threads together can wait for a core longer than the window's wall time: four threads waiting
    1.25 s each of a 2 s window are 5 s, 62.5% of their thread-time (not 250% of one intra-op thread's). The record
    counts the threads its wait sums, each thread's wait taken over the window alone; a record before schema 1.13
    does not say how many it summed, and its share is capped at the whole."""
    base = {"time": 0.0, "load": 0.5, "own_cpu_s": 0.0, "busy_s": 0.0, "steal_s": 0.0}
    start = {**base, "run_delay_s": {"1": 0.5, "2": 1.0, "9": 3.0}}  # thread 9 ends during the window
    end = {**base, "time": 2.0, "run_delay_s": {"1": 1.75, "2": 2.25, "3": 1.25, "4": 1.25}}  # 3 and 4 start in it
    r = interference(0, start, end, "here")
    assert (r.run_delay_s, r.run_delay_threads) == (pytest.approx(5.0), 4)
    import attrs

    s = interference_summary([attrs.asdict(r)])
    assert s.run_delay_share == pytest.approx(5.0 / (2.0 * 4))  # exact: float sums of quarters
    assert "waits for a core 62.5% of the threads' time" in machine_line(_as_dict(s))
    assert interference_summary([record(delay=5.0, threads=1)]).run_delay_share == 1.0  # before 1.13: capped
