"""The orchestrator: check, make the run directory, start workers, supervise them, summarise.

Launchers: ``inline`` (in this process, for embedding and debugging; one rank), ``subprocess``
(one rank in the adapter's environment), ``torchrun`` (several ranks on this machine: gloo on
CPU, NCCL on GPU, 127.0.0.1 and a free port; or several machines, with ``NodeSettings``: the
same ``llmadapt run`` on every node, node 0 gathers the records), ``slurm`` (a batch job, see
llmadapt.slurm). ``auto`` picks subprocess or torchrun by world size. Workers run in their own
process group; whatever happens (crash, kill, timeout, Ctrl-C) the group is gone afterwards,
and the records made before plus a failure record remain. Across nodes, records are streamed
to the orchestrator as they are written (llmadapt.collect), so no shared disk is needed.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import time
import types
import typing
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt import lifecycle
from llmadapt import slurm as slurm_
from llmadapt.collect import AgentLink, Collector, local_hostname_is_loopback, node_name, parse_address
from llmadapt.contract import Failure, JsonlWriter, Summary, read_jsonl, to_json
from llmadapt.environments import process_env, python_for
from llmadapt.errors import LlmadaptError, Terminated
from llmadapt.interfaces import EnvironmentSpec
from llmadapt.plugins import check_supported, get_adapter
from llmadapt.prepare import ensure_checkpoint
from llmadapt.slurm import SlurmSettings
from llmadapt.spec import Workload
from llmadapt.stats import aggregate

LAUNCHERS = ("auto", "inline", "subprocess", "torchrun", "slurm")
KILL_GRACE_S = 10.0
GATHER_GRACE_S = 30.0  # how long node 0 waits for the other nodes' last records and reports


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


def worker_command(launcher: str, python: Path | str, worker_dir: Path | str, *, per_node: int = 1,
                   nodes: NodeSettings | None = None, module: str = "llmadapt.worker") -> list[str]:
    """The command that starts one node's workers: the one place that maps a launcher to a command line.

    ``module`` is what each rank runs: the worker, or the micro-benchmarks (llmadapt.microbench)."""
    worker = ["-m", module, str(worker_dir)]
    if launcher == "subprocess":
        return [str(python), *worker]
    nodes = nodes or NodeSettings()
    if launcher == "slurm":  # inside the batch script: one task per rank, on every node
        return ["srun", "--kill-on-bad-exit=1", f"--nodes={nodes.nnodes}", f"--ntasks-per-node={per_node}",
                str(python), *worker]
    if launcher == "torchrun":
        cmd = [str(python), "-m", "torch.distributed.run", f"--nnodes={nodes.nnodes}",
               f"--nproc-per-node={per_node}", "--max-restarts=0"]
        if nodes.rdzv_endpoint:
            # is_host named explicitly: torchrun would guess it from the hostname, which may resolve to loopback.
            cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.rdzv_endpoint}",
                    f"--rdzv-id=llmadapt-{nodes.rendezvous()[1]}",
                    f"--rdzv-conf=is_host={int(nodes.node_rank == 0)}"]
        elif nodes.nnodes == 1 and nodes.master_addr is None:
            cmd += ["--rdzv-backend=static", "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        else:
            master_addr, master_port = nodes.rendezvous()
            cmd += ["--rdzv-backend=static", f"--node-rank={nodes.node_rank}", f"--master-addr={master_addr}",
                    f"--master-port={master_port}"]
        if nodes.local_addr:
            cmd.append(f"--local-addr={nodes.local_addr}")
        return cmd + worker
    raise LlmadaptError(f"launcher {launcher!r} has no worker command")


@attrs.frozen
class RunResult:
    run_dir: Path
    summary: Summary

    @property
    def ok(self) -> bool:
        return self.summary.status == "ok"

    @property
    def losses(self) -> list[float | None]:
        return self.summary.losses


def make_run_id(adapter: str, workload: Workload) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{adapter}-{workload.content_hash[:8]}-{secrets.token_hex(2)}"


def free_port() -> int:
    """A free TCP port for a process we start next (an engine, a rendezvous store).

    Not the kernel's ``bind(0)``: that port comes from the ephemeral range and, once released, is handed out
    again to the next ``bind(0)`` or outgoing connection, so another server could take it in the seconds
    before our engine binds it, and our health check would then be answered by a stranger. A random port
    below the ephemeral range is not reissued that way.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def run(
    workload: Workload | str | Path,
    adapter: str = "torch",
    *,
    launcher: str = "auto",
    out: str | Path = "runs",
    run_id: str | None = None,
    timeout: float | None = None,
    fault: dict[str, Any] | None = None,
    memory_limit_bytes: int | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    nodes: NodeSettings | None = None,
    slurm: SlurmSettings | None = None,
) -> RunResult:
    """Run one workload on one adapter; returns when the workers are gone, with the summary.

    ``progress`` receives a ``{"type": "start", ...}`` event once the run directory exists,
    then rank 0's records as they are written (and ``warning``, ``node`` and ``slurm`` events).

    ``nodes``: several machines under torchrun, the same call on each (see NodeSettings);
    on node 0 it returns the run's result, on the others a copy of node 0's summary.
    ``slurm``: the layout and options of the Slurm job (``launcher="slurm"``).

    A failed run is a result (``summary.status == 'failed'`` with its failures), not an
    exception. Exceptions are for bad input, raised before any process starts.
    """
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    info = get_adapter(adapter)
    check_supported(info, workload)
    if launcher not in LAUNCHERS and launcher not in info.launchers:
        known = ", ".join([*LAUNCHERS, *info.launchers])
        raise LlmadaptError(f"unknown launcher {launcher!r} for adapter {adapter!r}; known: {known}")
    _check_run_options(fault, timeout, memory_limit_bytes)
    world = workload.world_size
    if workload.kind == "serve":
        return _run_serve(workload, info, out, run_id, timeout, progress)
    nodes = nodes or NodeSettings()
    if launcher == "auto":
        launcher = "slurm" if slurm else "torchrun" if world > 1 or nodes.nnodes > 1 else "subprocess"
    if launcher in ("inline", "subprocess") and world > 1:
        raise LlmadaptError(f"launcher {launcher!r} runs one rank, but the workload needs world size {world}: "
                            "use --launcher torchrun (or auto)")
    if nodes.nnodes > 1 and launcher != "torchrun":
        raise LlmadaptError(f"--nnodes {nodes.nnodes} needs --launcher torchrun (or auto), not {launcher!r}")
    # Every check before anything is written or submitted.
    if launcher == "slurm":
        slurm = slurm or SlurmSettings()
        per_node = slurm.tasks_per_node(world)
        slurm_.require_slurm()
    else:
        per_node = nodes.procs_per_node(world)
    python = None if launcher == "inline" else python_for(info.environment)
    if python is not None:
        ensure_checkpoint(workload, info.environment)
    multinode = launcher == "torchrun" and nodes.nnodes > 1
    if multinode:
        _warn_loopback(nodes, progress)
    if multinode and nodes.node_rank > 0:
        return _run_node_agent(workload, python, info.environment, nodes, per_node, out, timeout, memory_limit_bytes,
                               progress)

    launch = {
        "run_id": run_id or make_run_id(adapter, workload), "adapter": adapter, "adapter_version": info.version,
        "framework": info.framework,
        "role": workload.kind, "worker_class": info.roles[workload.kind],
        "launcher": launcher, "world_size": world, "workload": workload.to_dict(),
        "workload_hash": workload.content_hash, "fault": fault, "memory_limit_bytes": memory_limit_bytes,
        "python": str(python) if python else None, "created": time.time(),
    }
    # Other nodes' records arrive here. Bound before anything is written, so a taken port fails cleanly.
    collector = None
    if launcher == "slurm":
        collector = Collector(("0.0.0.0", 0))
    elif multinode:
        collector = Collector(("0.0.0.0", nodes.collect_address()[1]))
        launch["nodes"] = {"nnodes": nodes.nnodes, "nproc_per_node": per_node,
                           "rendezvous": "c10d" if nodes.rdzv_endpoint else "static"}
    try:  # the collector's socket is closed on every way out, an early error included
        return _run_launched(workload, info, launcher, launch, python, per_node, nodes, collector, out, timeout,
                             memory_limit_bytes, progress, slurm)
    finally:
        if collector:
            collector.close()


def _run_launched(workload, info, launcher, launch, python, per_node, nodes, collector, out, timeout,
                  memory_limit_bytes, progress, slurm) -> RunResult:
    """From the checked request to the summary: the run directory, the workers, their supervision."""
    world, multinode, run_id = workload.world_size, collector is not None and launcher == "torchrun", launch["run_id"]
    job = _slurm_job(slurm, launch, python, info.environment, per_node, collector, progress) if launcher == "slurm" else None
    run_dir = Path(out) / run_id
    adapter_cmd = None
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
        if launcher in info.launchers:  # the adapter's own launcher; its command goes into the trace
            adapter_cmd = info.launchers[launcher](python, run_dir, world, free_port())
            launch["command"] = adapter_cmd
        (run_dir / "launch.json").write_text(json.dumps(launch, indent=2))
    except OSError as exc:  # before any worker: nothing measured yet, nothing lost
        raise LlmadaptError(f"cannot write the run directory {run_dir}: {exc.strerror or exc}") from None
    if progress:
        progress({"type": "start", "run_dir": str(run_dir), "adapter": info.name, "label": workload.label,
                  "world_size": world, "launcher": launcher})

    failures: list[Failure] = []
    interrupted: KeyboardInterrupt | None = None
    if collector:
        collector.start(run_dir, launch, nodes.nnodes if multinode else 1)
    try:
        if launcher == "inline":
            from llmadapt.runtime import Place, run_worker

            # The worker records its own failures; an interrupt is re-raised once the summary is written.
            if run_worker(run_dir, Place(0, 0, 1, 0, "inline")) == 130:
                interrupted = KeyboardInterrupt()
        elif launcher == "slurm":
            failures += _run_slurm_job(job, run_dir, timeout, memory_limit_bytes, progress)
        elif multinode:
            failures += _run_node_zero(python, info.environment, nodes, per_node, run_dir, collector, timeout, memory_limit_bytes,
                                       progress)
        else:
            cmd = adapter_cmd or worker_command(launcher, python, run_dir, per_node=world)
            failures += _supervise(cmd, env=_worker_env(world, info.environment), log=run_dir / "worker.log",
                                   tail=run_dir / "rank-00000.jsonl", timeout=timeout,
                                   memory_limit_bytes=memory_limit_bytes, progress=progress)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM from a scheduler (llmadapt.errors.Terminated)
        interrupted = exc
        failures.append(Failure(cause="interrupted", message=f"{interrupt_text(exc)} in the orchestrator"))
    finally:
        if collector:
            _gather(collector, run_dir, failures, progress)

    summary = summarise(run_dir, failures)
    if collector:
        collector.send_summary(to_json(summary))
    if interrupted is not None:
        raise interrupted
    return RunResult(run_dir=run_dir, summary=summary)


def interrupt_text(exc: BaseException) -> str:
    """How an interrupt is named in failure records: which signal stopped the orchestrator."""
    return str(exc) if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"


FAULT_KINDS = ("error", "exit", "kill", "hang", "stop", "oom")


def _check_run_options(fault, timeout, memory_limit_bytes) -> None:
    """The run's own options, before anything starts: one line naming what is wrong."""
    import math

    if timeout is not None and not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise LlmadaptError(f"--timeout: got {str(timeout)[:40]!r}; must be a number of seconds > 0")
    if memory_limit_bytes is not None and not (isinstance(memory_limit_bytes, int) and memory_limit_bytes > 0):
        raise LlmadaptError(f"memory limit: got {str(memory_limit_bytes)[:40]!r}; must be a number of bytes > 0")
    if fault is None:
        return
    if not isinstance(fault, dict) or fault.get("kind") not in FAULT_KINDS:
        raise LlmadaptError(f"fault: got {str(fault)[:80]!r}; needs 'kind', one of {', '.join(FAULT_KINDS)}")
    if fault["kind"] == "oom" and not memory_limit_bytes:
        # Without a cap the worker allocates until the kernel's OOM killer picks a process, maybe not ours.
        raise LlmadaptError("fault 'oom' needs a memory limit (memory_limit_bytes / --memory-limit): without one "
                            "it grows until the kernel's out-of-memory killer ends some process on the machine")


def _warn_loopback(nodes: NodeSettings, progress) -> None:
    """The multi-node trap: a hostname that resolves to loopback makes gloo and torchrun advertise 127.x."""
    found = local_hostname_is_loopback()
    missing = [flag for flag, value in (("--ifname", nodes.ifname),
                                        ("--local-addr", nodes.local_addr if nodes.rdzv_endpoint else "n/a"))
               if not value]
    if found and missing:
        name, addr = found
        _warn(f"this host's name {name!r} resolves to {addr}, a loopback address: the other nodes cannot reach "
              f"sockets advertised under it (gloo, NCCL, torchrun); set {' and '.join(missing)} "
              "or map the hostname to a routable address", progress)


def _warn(message: str, progress) -> None:
    if progress:
        progress({"type": "warning", "message": message})
    else:
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _node_env(per_node: int, nodes: NodeSettings, collect: str, environment: EnvironmentSpec) -> dict[str, str]:
    env = _worker_env(per_node, environment)
    env["LLMADAPT_COLLECT"] = collect
    if nodes.ifname:
        env.update(GLOO_SOCKET_IFNAME=nodes.ifname, NCCL_SOCKET_IFNAME=nodes.ifname)
    return env


def _run_node_zero(python, environment: EnvironmentSpec, nodes: NodeSettings, per_node: int, run_dir: Path,
                   collector: Collector, timeout, memory_limit_bytes, progress) -> list[Failure]:
    """Node 0: its own ranks (records kept in node-0/, streamed like everyone's), watching the other nodes."""
    node_dir = run_dir / "node-0"
    node_dir.mkdir()
    (node_dir / "launch.json").write_text((run_dir / "launch.json").read_text())
    host, port = nodes.collect_address()
    return _supervise(worker_command("torchrun", python, node_dir, per_node=per_node, nodes=nodes),
                      env=_node_env(per_node, nodes, f"{host}:{port}", environment), log=node_dir / "worker.log",
                      tail=run_dir / "rank-00000.jsonl", timeout=timeout, memory_limit_bytes=memory_limit_bytes,
                      progress=progress, should_stop=lambda: next(iter(collector.node_failures().values()), None))


def _run_node_agent(workload: Workload, python, environment: EnvironmentSpec, nodes: NodeSettings, per_node: int,
                    out, timeout, memory_limit_bytes, progress) -> RunResult:
    """Nodes 1..N-1: join node 0, run this node's ranks, report how they ended, return node 0's summary.

    Everything this node writes goes to OUT/RUN_ID/node-K/, so that nodes sharing a disk (and an
    --out folder) never write into node 0's run directory.
    """
    host, port = nodes.collect_address()
    if progress:
        progress({"type": "node", "message": f"node {nodes.node_rank}: joining node 0 at {host}:{port}"})
    link = AgentLink((host, port), {"node_rank": nodes.node_rank, "node": node_name(), "nnodes": nodes.nnodes,
                                    "workload_hash": workload.content_hash}, nodes.join_timeout)
    launch = link.launch
    node_dir = Path(out) / launch["run_id"] / f"node-{nodes.node_rank}"
    node_dir.mkdir(parents=True, exist_ok=False)
    (node_dir / "launch.json").write_text(json.dumps(launch, indent=2))
    if progress:
        progress({"type": "start", "run_dir": str(node_dir), "adapter": launch["adapter"], "label": workload.label,
                  "world_size": launch["world_size"], "launcher": f"torchrun, node {nodes.node_rank}"})
    failures: list[Failure] = []
    interrupted = False

    def stopped() -> Failure | None:
        reason = link.stop_reason
        return Failure(cause="killed", message=f"node {nodes.node_rank}: stopped: {reason}") if reason else None

    try:
        failures = _supervise(worker_command("torchrun", python, node_dir, per_node=per_node, nodes=nodes),
                              env=_node_env(per_node, nodes, f"{host}:{port}", environment), log=node_dir / "worker.log",
                              tail=None, timeout=timeout, memory_limit_bytes=memory_limit_bytes, progress=progress,
                              should_stop=stopped)
    except KeyboardInterrupt as exc:
        interrupted = True
        failures.append(Failure(cause="interrupted", message=f"node {nodes.node_rank}: {interrupt_text(exc)}"))
    link.report(1 if failures else 0, failures)
    # Node 0 may still be finishing its own ranks: wait for its summary, or for its connection to drop.
    link.done.wait(timeout)
    link.close()
    if failures:
        with JsonlWriter(node_dir / "launcher.jsonl") as w:
            for f in failures:
                w.write(f)
    if interrupted:
        raise KeyboardInterrupt
    if link.summary is None:
        raise LlmadaptError(f"node {nodes.node_rank}: node 0 sent no summary ({link.stop_reason or 'no answer'}); "
                            f"this node's records are in {node_dir}")
    (node_dir / "summary.json").write_text(json.dumps(link.summary, indent=2))
    launch.setdefault("nodes", {})["seen"] = link.nodes
    (node_dir / "launch.json").write_text(json.dumps(launch, indent=2))
    return RunResult(run_dir=node_dir, summary=_structure(Summary, link.summary))


# Variables the batch script sets itself, so that a resubmitted script behaves the same.
_JOB_VARS = ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM",
             "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "LLMADAPT_DEVICE", "LLMADAPT_HOME", "PYTHONPATH")


def _slurm_job(settings: SlurmSettings, launch: dict[str, Any], python, environment: EnvironmentSpec, per_node: int,
               collector: Collector, progress) -> dict[str, Any]:
    """The batch script for this run, checked by Slurm (sbatch --test-only) before anything is written."""
    addr = settings.collect_addr
    if addr is None:
        addr = socket.gethostbyname(socket.gethostname())
        if addr.startswith("127."):
            _warn(f"this host's name resolves to {addr}: compute nodes on other machines cannot send records "
                  "there; set --collect-addr to this machine's address on the cluster network", progress)
    run_id = launch["run_id"]
    output = settings.output or f"{settings.node_dir}/llmadapt-{run_id}-%j.out"
    submit_env = _worker_env(per_node, environment)
    if "OMP_NUM_THREADS" not in os.environ:
        submit_env.pop("OMP_NUM_THREADS")  # this machine's core count says nothing about the nodes': the script picks
    env = {k: v for k, v in submit_env.items() if k in _JOB_VARS}
    env.update(LLMADAPT_COLLECT=f"{addr}:{collector.port}", LLMADAPT_LAUNCH=json.dumps(launch))
    worker_dir = f"{settings.node_dir}/llmadapt-{run_id}"
    script = slurm_.batch_script(settings, run_id=run_id, per_node=per_node, output=output, env=env,
                                 command=worker_command("slurm", python, worker_dir, per_node=per_node,
                                                        nodes=NodeSettings(nnodes=settings.nnodes)))
    if not slurm_.in_allocation():
        slurm_.check(script, submit_env)
    launch["slurm"] = {"nnodes": settings.nnodes, "ntasks_per_node": per_node, "script": "job.sbatch",
                       "node_dir": worker_dir, "output": output, "job_id": None}
    return {"script": script, "env": submit_env, "output": output}


def _run_slurm_job(job: dict[str, Any], run_dir: Path, timeout, memory_limit_bytes, progress) -> list[Failure]:
    script = run_dir / "job.sbatch"
    script.write_text(job["script"])
    tail = run_dir / "rank-00000.jsonl"
    if slurm_.in_allocation():  # inside salloc/sbatch: run the script here, its srun uses the allocation
        return _supervise(["bash", str(script)], env=job["env"], log=run_dir / "slurm.out", tail=tail,
                          timeout=timeout, memory_limit_bytes=memory_limit_bytes, progress=progress)
    job_id = slurm_.submit(script, job["env"])
    launch = json.loads((run_dir / "launch.json").read_text())
    launch["slurm"]["job_id"] = job_id
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=2))
    output = Path(job["output"].replace("%j", job_id))
    tailer = _Tail(tail, progress)
    try:
        return slurm_.follow(job_id, timeout=timeout, output=output, progress=progress, on_poll=tailer.poll)
    finally:
        tailer.poll()
        if output.is_file():  # readable here when the first node is this host, or on a shared disk
            (run_dir / "slurm.out").write_bytes(output.read_bytes())


def _gather(collector: Collector, run_dir: Path, failures: list[Failure], progress) -> None:
    """Wait for the other nodes' last records and reports; record which nodes failed; list every node."""
    if failures:
        collector.stop_nodes(failures[0].message)
    if not collector.wait(GATHER_GRACE_S):
        _warn(f"some nodes did not report within {GATHER_GRACE_S:g} s; their records may be incomplete", progress)
    known = {f.message for f in failures}
    failures += [f for f in collector.node_failures().values() if f.message not in known]
    launch = json.loads((run_dir / "launch.json").read_text())
    launch.setdefault("nodes", {})["seen"] = collector.nodes()
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=2))


def _structure(hint: Any, value: Any) -> Any:
    """An attrs instance from its JSON form (nested attrs classes, lists, optionals): node 0's summary."""
    if value is None:
        return None
    if attrs.has(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{k: _structure(hints[k], v) for k, v in value.items() if k in hints})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return [_structure(args[0], v) for v in value]
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if attrs.has(arg) and isinstance(value, dict):
                return _structure(arg, value)
    return value


def _run_serve(workload: Workload, info, out, run_id, timeout, progress) -> RunResult:
    from llmadapt.serving import run_serve

    attach = workload.serve.url is not None
    if not attach and info.environment is None:
        raise LlmadaptError(f"adapter {info.name!r} only attaches to a running engine: set serve.url")
    python = None if attach else python_for(info.environment)  # fails before anything is written
    launcher = "attach" if attach else "subprocess"
    run_id = run_id or make_run_id(info.name, workload)
    run_dir = Path(out) / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    launch = {
        "run_id": run_id, "adapter": info.name, "framework": info.framework, "role": "serve", "launcher": launcher,
        "world_size": 1, "workload": workload.to_dict(), "workload_hash": workload.content_hash,
        "python": str(python) if python else None, "created": time.time(),
    }
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=2))
    if progress:
        progress({"type": "start", "run_dir": str(run_dir), "adapter": info.name, "label": workload.label,
                  "world_size": 1, "launcher": launcher})
    failures: list[Failure] = []
    try:
        failures = run_serve(workload, info, run_id, run_dir, launcher, python, timeout, progress)
    except KeyboardInterrupt as exc:
        summarise(run_dir, [Failure(cause="interrupted", message=f"{interrupt_text(exc)} in the orchestrator")])
        raise
    return RunResult(run_dir=run_dir, summary=summarise(run_dir, failures))


def write_launcher_failures(run_dir: Path, failures: list[Failure]) -> None:
    """Append what the orchestrator saw go wrong (timeout, interrupt, exit codes) to launcher.jsonl."""
    if failures:
        with JsonlWriter(run_dir / "launcher.jsonl") as w:
            for f in failures:
                w.write(f)


def summarise(run_dir: str | Path, launcher_failures: list[Failure] = (), *, write: bool = True) -> Summary:
    """(Re)build the run's summary from the records on disk plus ``launcher_failures``.

    ``write``: append the launcher failures to launcher.jsonl and write summary.json. A disk that
    refuses them (full, read-only) is one clear error; every record already written stays readable.
    """
    run_dir = Path(run_dir)
    launch = json.loads((run_dir / "launch.json").read_text())
    rank_records, launcher_records = load_records(run_dir, split=True)
    launcher_records += [to_json(f) for f in launcher_failures]
    summary = aggregate(launch["run_id"], rank_records + _launcher_view(rank_records, launcher_records), launch)
    if write:
        target = run_dir / "launcher.jsonl"
        try:
            write_launcher_failures(run_dir, list(launcher_failures))
            target = run_dir / "summary.json"
            target.write_text(json.dumps(to_json(summary), indent=2))
        except OSError as exc:
            raise LlmadaptError(f"could not write {target}: {exc.strerror or exc}; every record written before is "
                                f"kept in {run_dir} (`llmadapt show {run_dir}` reads them)") from None
    return summary


def _launcher_view(rank_records: list[dict[str, Any]], launcher_records: list[dict[str, Any]]) -> list[dict]:
    """The launcher's failures that add something to what the ranks recorded themselves.

    A rank's own failure record says more than torchrun's "rank 1 exited with code 1", and a bare
    "worker exited / killed" says less than either; a timeout, an interrupt, a node or Slurm's reason stay.
    """
    failed_ranks = {r["rank"] for r in rank_records if r["type"] == "failure"}
    return [r for r in launcher_records
            if not (r["type"] == "failure" and (r["rank"] in failed_ranks or (
                failed_ranks and r["rank"] is None and r["cause"] in ("crash", "killed")
                and r["message"].startswith(_EXIT_PREFIXES))))]


def load_records(run_dir: Path, *, split: bool = False):
    """Every record of the run: the ranks' files, then launcher.jsonl (``split``: as two lists)."""
    ranks: list[dict[str, Any]] = []
    for path in sorted(Path(run_dir).glob("rank-*.jsonl")):
        ranks += read_jsonl(path)
    path = Path(run_dir) / "launcher.jsonl"
    launcher = read_jsonl(path) if path.is_file() else []
    return (ranks, launcher) if split else ranks + launcher


def _worker_env(world: int, environment: EnvironmentSpec) -> dict[str, str]:
    """What every worker process starts with; PYTHONPATH names our sources (environments.process_env)."""
    env = process_env(environment)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LLMADAPT_COLLECT",
                "LLMADAPT_LAUNCH"):
        env.pop(var, None)  # an orchestrator running under torchrun must not leak its own place
    env.update(lifecycle.orchestrator_env(node_name()))  # workers end themselves if this process dies
    return env


def _supervise(cmd, *, env, log: Path, tail: Path | None, timeout, memory_limit_bytes, progress,
               should_stop: Callable[[], Failure | None] = lambda: None) -> list[Failure]:
    """Run one process group to its end; stop it on timeout, or when ``should_stop`` names a failure elsewhere."""
    preexec = None
    if memory_limit_bytes:
        def preexec() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))

    token = secrets.token_hex(8)
    env = {**env, lifecycle.RUN_TOKEN_VAR: token}
    log_file = open(log, "wb")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, preexec_fn=preexec)
    deadline = None if timeout is None else time.monotonic() + timeout
    tailer = _Tail(tail, progress if tail else None)
    failures: list[Failure] = []
    try:
        while proc.poll() is None:
            tailer.poll()
            if deadline is not None and time.monotonic() > deadline:
                _stop_group(proc)
                failures.append(Failure(cause="timeout", message=f"the run exceeded its timeout of {timeout:g} s"))
                break
            if (elsewhere := should_stop()) is not None:
                _stop_group(proc)
                failures.append(elsewhere)
                break
            time.sleep(0.1)
    except BaseException:
        _stop_group(proc)
        raise
    finally:
        _kill_group(proc)
        kill_tagged(token)
        log_file.close()
    tailer.poll()
    code = proc.returncode
    if code and not failures:
        failures += _exit_failures(code, log)
    return failures


_EXIT_PREFIXES = ("worker killed by", "worker exited with code")
# torchrun's report of each failed rank (torch.distributed.elastic's ChildFailedError, the same since 1.9).
_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)",
                            re.MULTILINE)


def _exit_failures(code: int, log: Path) -> list[Failure]:
    """What a non-zero exit of the launched process says: per rank where torchrun names them, else one line."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    ranks: dict[int, Failure] = {}
    for rank, exit_code, pid in _TORCHRUN_RANK.findall(text):
        rank, exit_code = int(rank), int(exit_code)
        if rank in ranks:
            continue
        if exit_code < 0:
            ranks[rank] = Failure(cause="killed", rank=rank, exit_code=exit_code,
                                  message=f"rank {rank} (pid {pid}) was killed by {_signal_name(-exit_code)}"
                                          f"{_kill_hint(-exit_code)}, without a failure record")
        else:
            ranks[rank] = Failure(cause="crash", rank=rank, exit_code=exit_code,
                                  message=f"rank {rank} (pid {pid}) exited with code {exit_code} without a "
                                          "failure record")
    if ranks:
        return [ranks[r] for r in sorted(ranks)]
    if code < 0:
        return [Failure(cause="killed", message=f"worker killed by {_signal_name(-code)}{_kill_hint(-code)}",
                        exit_code=code)]
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1][:300] if lines else "no output"
    return [Failure(cause="crash", message=f"worker exited with code {code} without a failure record; "
                                           f"last output: {last}", exit_code=code)]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _kill_hint(number: int) -> str:
    return " (the kernel's out-of-memory killer or an external kill)" if number == signal.SIGKILL else ""


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the whole group (workers record why they stop), then SIGKILL after a grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def kill_tagged(token: str) -> int:
    """SIGKILL every process whose environment carries this launch's token; returns how many were found.

    The process group is not enough: torchrun starts each rank in a session of its own, so a rank that
    outlives torchrun (stopped with SIGSTOP, or deaf to SIGTERM inside a collective) is in no group of
    ours. Every process a launch starts inherits the token, whatever its session or parent.
    """
    needle = f"{lifecycle.RUN_TOKEN_VAR}={token}".encode() + b"\0"
    found = 0
    for _ in range(5):  # a process may fork while we look: look again until nothing is left
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if needle in (entry / "environ").read_bytes() + b"\0":
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        found += len(pids)
        time.sleep(0.05)
    return found


class _Tail:
    """Follows rank 0's records as they are flushed, for progress reports."""

    def __init__(self, path: Path, callback) -> None:
        self.path, self.callback, self.offset, self.partial = path, callback, 0, b""

    def poll(self) -> None:
        if self.callback is None or not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        data = self.partial + chunk
        lines = data.split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if line.strip():
                try:
                    self.callback(json.loads(line))
                except json.JSONDecodeError:
                    pass
