"""How quiet the machine was while a rank measured its steps: what else ran beside the run, and what that cost it.

A rank reads a snapshot as its first measured step starts and another after its last: the machine's CPU time
outside idle and its steal (``/proc/stat``), this process's CPU time, the time its threads were runnable but
waiting for a core (each thread's run delay, ``/proc/self/task/*/schedstat``), the load average, and on a GPU
what NVML says of the device (other processes on it, clock throttle reasons, temperature, power cap). The
difference is one ``Interference`` record; the summary sets the ranks' side by side
(``llmadapt.contract.breakdowns.interference_summary``) and says quiet or disturbed, with the measured cause. Two
snapshots a run, never one a step: the loop's own cost stays what it was. Linux only; elsewhere the record says
what it could not read.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import attrs

from llmadapt.adapter.context import group_stats
from llmadapt.contract.records import Interference

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# NVML's clock throttle reasons (nvmlClocksThrottleReason*, now nvmlClocksEventReason*) that slow the device
# down; idle (0x1) and the clocks an administrator set (0x2, 0x100) are settings, not interference.
_THROTTLE = {0x4: "power cap", 0x8: "hardware slowdown", 0x10: "sync boost", 0x20: "software thermal",
             0x40: "hardware thermal", 0x80: "hardware power brake"}


def snapshot(gpu_index: int | None = None, nvml=None) -> dict[str, Any]:
    """What one rank reads at either end of its measured steps (fields None where not readable here)."""
    snap: dict[str, Any] = {"time": time.monotonic(), "load": _loadavg(), "own_cpu_s": _own_cpu()}
    snap["busy_s"], snap["steal_s"] = _machine_cpu()
    snap["run_delay_s"] = _run_delay()  # {thread id: seconds}
    if gpu_index is not None:
        snap["gpu"] = _gpu(gpu_index, nvml)
    return snap


def interference(rank: int, start: dict[str, Any], end: dict[str, Any], node: str) -> Interference:
    """The record of one rank's measured window, from its two snapshots."""
    def delta(key: str) -> float | None:
        a, b = start.get(key), end.get(key)
        return None if a is None or b is None else b - a

    delays = _delay_over(start.get("run_delay_s"), end.get("run_delay_s"))
    gpu_start, gpu_end = start.get("gpu") or {}, end.get("gpu") or {}
    reasons = sorted(set(gpu_start.get("throttle", [])) | set(gpu_end.get("throttle", [])))
    return Interference(
        rank=rank, node=node, window_s=end["time"] - start["time"], cores=_cores(),
        threads=_threads(), load_start=start["load"], load_end=end["load"], machine_busy_cpu_s=delta("busy_s"),
        own_cpu_s=delta("own_cpu_s"), run_delay_s=None if delays is None else sum(delays.values()),
        run_delay_threads=None if delays is None else len(delays), steal_s=delta("steal_s"),
        gpu_other_processes=max(gpu_start.get("others", 0), gpu_end.get("others", 0)) if gpu_end else None,
        gpu_throttle_reasons=reasons if gpu_end else None,
        gpu_temperature_c=gpu_end.get("temperature_c"), gpu_power_limit_w=gpu_end.get("power_limit_w"),
        gpu_sm_clock_mhz=gpu_end.get("sm_clock_mhz"),
    )


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system  # this process, every thread (its children are other processes: counted as such)


def _machine_cpu() -> tuple[float | None, float | None]:
    """Seconds of CPU time the machine spent outside idle and iowait, and stolen by the hypervisor (all cores)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None, None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / _TICK, steal / _TICK


def _run_delay() -> dict[str, float] | None:
    """How long each of this process's threads has spent runnable but waiting for a core (schedstat's run delay)."""
    found: dict[str, float] = {}
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            found[task.name] = int((task / "schedstat").read_text().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended between listing and reading
    return found or None


def _delay_over(start: dict[str, float] | None, end: dict[str, float] | None) -> dict[str, float] | None:
    """Each thread alive at the window's end with its wait for a core within the window (a thread started
    meanwhile: all of its wait). Each is at most the window, so their sum is at most the window times their
    count: the denominator of its share (a thread that ended meanwhile is in neither)."""
    if start is None or end is None:
        return None
    return {tid: max(0.0, seconds - start.get(tid, 0.0)) for tid, seconds in end.items()}


def group_cpu_s(pgid: int | None) -> float | None:
    """CPU time of a process group's live members and their reaped children (a serving engine started in its
    own group), from /proc; None where not known."""
    if pgid is None:
        return None
    members = group_stats(pgid).values()
    total = sum(int(v) for fields in members if len(fields) > 14 for v in fields[11:15])
    found = any(len(fields) > 14 for fields in members)
    return total / _TICK if found else None


def serving_window(start: dict[str, Any], end: dict[str, Any], engine_start: float | None,
                   engine_end: float | None, node: str) -> Interference:
    """The interference record of a serving run: the client's window, with the engine's CPU counted as the run's
    own. An engine whose CPU cannot be read (attached by URL, or its process gone) leaves other processes' CPU
    unjudged: it may be the engine itself."""
    record = interference(0, start, end, node)
    if engine_start is None or engine_end is None or record.own_cpu_s is None:
        return attrs.evolve(record, machine_busy_cpu_s=None)
    return attrs.evolve(record, own_cpu_s=record.own_cpu_s + max(0.0, engine_end - engine_start))


class StepDelay:
    """This thread's run delay in nanoseconds, read twice a step (before and after the clock): the file is opened
    once and re-read in place, a few microseconds a read. ``read()`` is None where Linux's schedstat is absent."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def read(self) -> int | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def thread_run_delay() -> float | None:
    """How long this thread has waited for a core so far (Linux schedstat's run delay); None elsewhere."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def _threads() -> int | None:
    try:
        import torch

        return torch.get_num_threads()
    except Exception:  # noqa: BLE001 - a process without torch
        return None


def _gpu(index: int, nvml=None) -> dict[str, Any]:
    """NVML on the rank's device: other processes' count, throttle reasons, temperature, power cap, SM clock.
    ``nvml`` stands in for pynvml in tests. What cannot be read is left out."""
    out: dict[str, Any] = {}
    try:
        if nvml is None:
            import pynvml as nvml

            nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no NVML: the record says None
        return out
    readers = {
        "others": lambda: sum(1 for p in [*nvml.nvmlDeviceGetComputeRunningProcesses(handle),
                                          *nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)]
                              if p.pid != os.getpid()),
        "throttle": lambda: [name for bit, name in _THROTTLE.items()
                             if nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle) & bit],
        "temperature_c": lambda: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        "power_limit_w": lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,
        "sm_clock_mhz": lambda: float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
    }
    for key, read in readers.items():
        try:
            out[key] = read()
        except Exception:  # noqa: BLE001 - one field NVML does not support on this device
            continue
    return out
