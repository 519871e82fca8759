"""Hardware telemetry sampled in the background of a training rank (workload.telemetry).

A daemon thread wakes every ``interval_s``, reads this process's CPU time and resident memory (procfs) and, on a
GPU, the rank's device through NVML (nvidia-ml-py): utilisation, memory, power and the energy counter. Samples
wait in memory until the loop writes them after a step, so the records file has one writer. A field its source
cannot measure here stays None, and ``unavailable`` says why: on a CPU there is no NVML device, and nothing is
written as a zero that was not measured.

Cost: one sample is a few /proc reads and, on GPU, four NVML calls (microseconds each); the thread holds the
interpreter lock for that long once per interval (benchmarks/profile_overhead.py measures it).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from llmadapt.contract.records import Telemetry


def _rss_bytes() -> int | None:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _Nvml:
    """The rank's GPU through NVML; ``error`` says why not where it cannot be used."""

    def __init__(self, device_index: int) -> None:
        self.handle: Any = None
        self.error: str | None = None
        self.energy_start_mj: int | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            # NVML numbers devices as the driver does; CUDA_VISIBLE_DEVICES renumbers them for CUDA.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
            index = device_index
            if visible[0] and device_index < len(visible) and visible[device_index].strip().isdigit():
                index = int(visible[device_index])
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # noqa: BLE001 - no NVML is a fact to record, not a failure
            self.error = f"NVML unavailable ({type(exc).__name__}: {exc})"[:200]
            return
        try:
            self.energy_start_mj = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:  # noqa: BLE001 - older GPUs have no energy counter (Volta and later do)
            self.energy_start_mj = None

    def energy_j(self) -> float | None:
        if self.handle is None or self.energy_start_mj is None:
            return None
        try:
            return (self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) - self.energy_start_mj) / 1e3
        except Exception:  # noqa: BLE001
            return None

    def sample(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        nvml, h = self.nvml, self.handle
        for key, read in (
            ("util", lambda: nvml.nvmlDeviceGetUtilizationRates(h)),
            ("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(h)),
            ("power", lambda: nvml.nvmlDeviceGetPowerUsage(h)),
        ):
            try:
                out[key] = read()
            except Exception:  # noqa: BLE001 - one missing reading leaves the others
                out[key] = None
        util, memory, power = out["util"], out["memory"], out["power"]
        return {
            "gpu_util_percent": float(util.gpu) if util is not None else None,
            "gpu_memory_util_percent": float(util.memory) if util is not None else None,
            "gpu_memory_used_bytes": int(memory.used) if memory is not None else None,
            "power_w": power / 1e3 if power is not None else None,  # NVML gives milliwatts
            "energy_j": self.energy_j(),
        }


class Sampler:
    """Background samples of one rank; ``drain`` hands over what was sampled since the last call."""

    def __init__(self, rank: int, interval_s: float, cuda_index: int | None) -> None:
        self.rank, self.interval_s = rank, interval_s
        self._samples: list[Telemetry] = []
        self._sampled = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._nvml = _Nvml(cuda_index) if cuda_index is not None else None
        self.source = "procfs+nvml" if self._nvml is not None and self._nvml.handle is not None else "procfs"
        self.unavailable = self._unavailable()
        self._last = (time.monotonic_ns(), time.process_time_ns())
        self._thread = threading.Thread(target=self._run, name="llmadapt-telemetry", daemon=True)

    def _unavailable(self) -> list[str]:
        if self._nvml is None:
            return ["GPU utilisation, GPU memory, power and energy: not measured on a CPU run (NVML reads NVIDIA "
                    "GPUs only; CPU package power needs RAPL, which this process does not read)"]
        if self._nvml.handle is None:
            return [f"GPU utilisation, GPU memory, power and energy: {self._nvml.error}"]
        if self._nvml.energy_start_mj is None:
            return ["energy: this GPU has no NVML energy counter"]
        return []

    def start(self) -> Sampler:
        if self.interval_s > 0:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> Telemetry:
        now, cpu = time.monotonic_ns(), time.process_time_ns()
        last_now, last_cpu = self._last
        self._last = (now, cpu)
        fields: dict[str, Any] = {
            "cpu_percent": 100.0 * (cpu - last_cpu) / (now - last_now) if now > last_now else None,
            "rss_bytes": _rss_bytes(),
        }
        if self._nvml is not None and self._nvml.handle is not None:
            fields.update(self._nvml.sample())
        with self._lock:
            first = not self._sampled
            self._sampled = True
            record = Telemetry(rank=self.rank, time_ns=now, source=self.source,
                               unavailable=self.unavailable if first else [], **fields)
            self._samples.append(record)
        return record

    def energy_j(self) -> float | None:
        """The GPU's energy since the sampler started, read now; None without an NVML energy counter."""
        return self._nvml.energy_j() if self._nvml is not None else None

    def drain(self) -> list[Telemetry]:
        """The samples taken since the last drain. Called between every two steps: with none waiting (most
        steps) it takes no lock; a sample appended just after the check is drained next time."""
        if not self._samples:
            return []
        with self._lock:
            out, self._samples = self._samples, []
        return out

    def stop(self) -> list[Telemetry]:
        """Stop sampling, take a last sample (a run shorter than the interval has one too); the samples not
        drained yet."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.interval_s > 0:
            self.sample()
        return self.drain()
