"""The options of a launch, checked before anything starts: launchers, multi-node settings, run ids, and
the fault injection used by tests.
"""

from __future__ import annotations

import time
from pathlib import Path

import attrs

from llmadapt.contract.launch import Fault, LaunchRequest, new_run_id, structure, unstructure
from llmadapt.contract.stream import parse_address
from llmadapt.errors import LlmadaptError, UnsupportedError
from llmadapt.host import gpu_visible
from llmadapt.spec import Workload

LAUNCHERS = ("auto", "inline", "subprocess", "torchrun", "slurm")


@attrs.frozen
class NodeSettings:
    """This node's part in a multi-node torchrun run; the names are torchrun's.

    Run the same ``llmadapt run`` on every node, changing only ``node_rank``. Node 0 gathers
    every node's records into its run directory and hosts the rendezvous.
    """

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int | None = None
    """Ranks on each node; default: the workload's world size / nnodes."""
    master_addr: str | None = None
    """Node 0's address, reachable from every node (static rendezvous)."""
    master_port: int = 29500
    rdzv_endpoint: str | None = None
    """HOST:PORT of torchrun's elastic c10d rendezvous, on node 0, instead of the static one."""
    local_addr: str | None = None
    """This node's address as the other nodes reach it (torchrun --local-addr)."""
    ifname: str | None = None
    """Network interface for gloo's and NCCL's sockets (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)."""
    collect_port: int | None = None
    """Port on node 0 where the records are gathered; default: the rendezvous port + 1."""
    join_timeout: float = 300.0
    """Seconds a node waits for node 0 to answer."""

    def procs_per_node(self, world: int) -> int:
        """Ranks per node, after checking the layout; one clear error if it does not fit the workload."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise LlmadaptError(f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes}, "
                                f"got {self.node_rank}")
        per_node = self.nproc_per_node or world // self.nnodes
        if per_node < 1 or per_node * self.nnodes != world:
            raise LlmadaptError(f"{self.nnodes} nodes x {per_node} ranks per node = {self.nnodes * per_node} ranks, "
                                f"but the workload's world size is {world}: choose --nnodes and --nproc-per-node "
                                "to match")
        if self.nnodes > 1 and not (self.master_addr or self.rdzv_endpoint):
            raise LlmadaptError("several nodes need node 0's address: set --master-addr (static rendezvous) "
                                "or --rdzv-endpoint HOST:PORT (c10d)")
        if self.rdzv_endpoint:
            parse_address(self.rdzv_endpoint)
        return per_node

    def rendezvous(self) -> tuple[str, int]:
        """Node 0's (address, port) for the rendezvous; the records are gathered on the next port."""
        if self.rdzv_endpoint:
            return parse_address(self.rdzv_endpoint)
        return self.master_addr or "127.0.0.1", self.master_port

    def collect_address(self) -> tuple[str, int]:
        host, port = self.rendezvous()
        return host, self.collect_port or port + 1


def launch_request(workload: Workload, info, launcher: str, python: Path | None, run_id: str | None = None,
                   **more) -> LaunchRequest:
    """A workload run's launch.json, made here for every launcher; ``more``: the launcher's own fields (fault,
    memory limit, nodes). A serving run is one client process, whatever the engine's layout."""
    return LaunchRequest(
        run_id=run_id or new_run_id(info.name, workload.content_hash[:8]), launcher=launcher,
        world_size=1 if workload.kind == "serve" else workload.world_size, role=workload.kind, adapter=info.name,
        adapter_version=info.version, framework=info.framework, worker_class=info.roles.get(workload.kind),
        workload=workload, workload_hash=workload.content_hash, problem_hash=workload.problem_hash,
        python=str(python) if python else None, created=time.time(), **more)


FAULT_KINDS = ("error", "exit", "kill", "hang", "stop", "oom", "slow")
"""Fault injection for tests: each at one step of one rank; 'slow' adds ``seconds`` to every step of every rank,
inside the step's clock (a regression to find)."""


def check_run_options(fault, timeout, memory_limit_bytes, stall_timeout=None, kind: str = "train") -> Fault | None:
    """The run's own options, before anything starts: one line naming what is wrong. Returns the fault (given as a
    dict or a Fault) as the launch record holds it."""
    import math

    for name, seconds in (("--timeout", timeout), ("--stall-timeout", stall_timeout)):
        if seconds is not None and not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise LlmadaptError(f"{name}: got {str(seconds)[:40]!r}; must be a number of seconds > 0")
    if stall_timeout is not None and kind == "serve":
        raise LlmadaptError("--stall-timeout watches a training run's steps; a serving run bounds each request with "
                            "serve.request_timeout_s and the engine's start with --timeout")
    if memory_limit_bytes is not None and not (isinstance(memory_limit_bytes, int) and memory_limit_bytes > 0):
        raise LlmadaptError(f"memory limit: got {str(memory_limit_bytes)[:40]!r}; must be a number of bytes > 0")
    if fault is None:
        return None
    if isinstance(fault, Fault):
        fault = unstructure(fault)
    if not isinstance(fault, dict) or fault.get("kind") not in FAULT_KINDS:
        raise LlmadaptError(f"fault: got {str(fault)[:80]!r}; needs 'kind', one of {', '.join(FAULT_KINDS)}")
    if fault["kind"] == "slow" and not (isinstance(fault.get("seconds"), (int, float)) and fault["seconds"] > 0):
        raise LlmadaptError(f"fault 'slow' needs 'seconds' > 0, got {str(fault.get('seconds'))[:40]!r}")
    if fault["kind"] == "oom" and not memory_limit_bytes:
        # Without a cap the worker allocates until the kernel's OOM killer picks a process, maybe not ours.
        raise LlmadaptError("fault 'oom' needs a memory limit (memory_limit_bytes / --memory-limit): without one "
                            "it grows until the kernel's out-of-memory killer ends some process on the machine")
    return structure(Fault, fault, "fault")


def check_adapter_settings(workload: Workload, names: list[str], *, scope: str = "run") -> None:
    """Settings for one adapter, before anything starts: each names a registered adapter, and one given on the
    command line or in Python (not a file's [adapters.NAME] section, which may serve other comparisons) names
    an adapter of this run or comparison."""
    from llmadapt.adapter.plugins import adapters

    registered = adapters()
    for name, settings in workload.adapters.items():
        path = next(iter(settings))
        source = workload.sources.get(f"{name}:{path}", "")
        if name not in registered:
            raise LlmadaptError(f"setting {name}:{path} ({source or 'per-adapter'}) is for adapter {name!r}, which "
                                f"is not registered; registered adapters: {', '.join(registered)}")
        if name not in names and not source.startswith("file"):
            where = (f"this {scope} ({', '.join(dict.fromkeys(names))})"
                     if names else "this command, which runs no adapter")
            raise LlmadaptError(f"setting {name}:{path} ({source}) is for adapter {name!r}, which is not in {where}")


def warn(message: str, progress) -> None:
    if progress:
        progress({"type": "warning", "message": message})
    else:
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)


def resolve(workload: Workload, adapter: str):
    """(the adapter's AdapterInfo, the workload as that adapter runs it: its own settings applied), checked as a
    run is before anything starts: an unknown adapter, settings for adapters not run, what it cannot do."""
    from llmadapt.adapter.plugins import check_supported, get_adapter

    info = get_adapter(adapter)
    check_adapter_settings(workload, [adapter])
    workload = workload.for_adapter(adapter)
    check_supported(info, workload)
    if not workload.parallelism.p2p:
        if workload.kind == "serve":
            raise UnsupportedError("parallelism.p2p=false is for training stacks on NCCL; a serving engine "
                                   "chooses its own transport")
        if not gpu_visible():
            raise UnsupportedError("parallelism.p2p=false turns off NCCL's peer-to-peer path between GPUs; no GPU "
                                   "is visible here, and gloo on a CPU has no such path: nothing would change")
    return info, workload
