"""Several machines under torchrun: node 0 runs its ranks and gathers every node's records and reports;
the other nodes run theirs as agents of node 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import attrs

from llmadapt.adapter.declaration import EnvironmentSpec
from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.launch import LaunchRequest, NodeLayout, structure
from llmadapt.contract.records import Failure, Summary
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.host import local_hostname_is_loopback, node_name
from llmadapt.launch.collect import AgentLink, Collector
from llmadapt.launch.settings import NodeSettings, warn
from llmadapt.contract.readback import RunResult
from llmadapt.launch.supervise import interrupt_text, supervise, worker_command, worker_env
from llmadapt.spec import Workload

GATHER_GRACE_S = 30.0  # how long node 0 waits for the other nodes' last records and reports


def warn_loopback(nodes: NodeSettings, progress) -> None:
    """The multi-node trap: a hostname that resolves to loopback makes gloo and torchrun advertise 127.x."""
    found = local_hostname_is_loopback()
    missing = [flag for flag, value in (("--ifname", nodes.ifname),
                                        ("--local-addr", nodes.local_addr if nodes.rdzv_endpoint else "n/a"))
               if not value]
    if found and missing:
        name, addr = found
        warn(f"this host's name {name!r} resolves to {addr}, a loopback address: the other nodes cannot reach "
              f"sockets advertised under it (gloo, NCCL, torchrun); set {' and '.join(missing)} "
              "or map the hostname to a routable address", progress)


def _node_env(per_node: int, nodes: NodeSettings, collect: str, environment: EnvironmentSpec) -> dict[str, str]:
    env = worker_env(per_node, environment)
    env["LLMADAPT_COLLECT"] = collect
    if nodes.ifname:
        env.update(GLOO_SOCKET_IFNAME=nodes.ifname, NCCL_SOCKET_IFNAME=nodes.ifname)
    return env


def run_node_zero(python, environment: EnvironmentSpec, nodes: NodeSettings, per_node: int, run_dir: Path,
                   collector: Collector, timeout, memory_limit_bytes, progress,
                   stalled: Callable[[], Failure | None] = lambda: None) -> list[Failure]:
    """Node 0: its own ranks (records kept in node-0/, streamed like everyone's), watching the other nodes and
    ``stalled`` (the run's StallWatch)."""
    node_dir = RunDir(run_dir).node(0).path
    node_dir.mkdir()
    RunDir(node_dir).launch_file.write_text(RunDir(run_dir).launch_file.read_text())
    host, port = nodes.collect_address()
    return supervise(worker_command("torchrun", python, node_dir, per_node=per_node, nodes=nodes),
                      env=_node_env(per_node, nodes, f"{host}:{port}", environment), log=RunDir(node_dir).worker_log,
                      tail=RunDir(run_dir).rank_file(0), timeout=timeout, memory_limit_bytes=memory_limit_bytes,
                      progress=progress,
                      should_stop=lambda: next(iter(collector.node_failures().values()), None) or stalled())


def run_node_agent(workload: Workload, python, environment: EnvironmentSpec, nodes: NodeSettings, per_node: int,
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
    node_dir = RunDir(Path(out) / launch.run_id).node(nodes.node_rank).path
    node_dir.mkdir(parents=True, exist_ok=False)
    RunDir(node_dir).write_launch(launch)
    if progress:
        progress({"type": "start", "run_dir": str(node_dir), "adapter": launch.adapter, "label": workload.label,
                  "world_size": launch.world_size, "launcher": f"torchrun, node {nodes.node_rank}"})
    failures: list[Failure] = []
    interrupted = False

    def stopped() -> Failure | None:
        reason = link.stop_reason
        return Failure(cause="killed", message=f"node {nodes.node_rank}: stopped: {reason}") if reason else None

    try:
        failures = supervise(worker_command("torchrun", python, node_dir, per_node=per_node, nodes=nodes),
                              env=_node_env(per_node, nodes, f"{host}:{port}", environment), log=RunDir(node_dir).worker_log,
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
        with JsonlWriter(RunDir(node_dir).launcher_file) as w:
            for f in failures:
                w.write(f)
    if interrupted:
        raise KeyboardInterrupt
    if link.summary is None:
        raise LlmadaptError(f"node {nodes.node_rank}: node 0 sent no summary ({link.stop_reason or 'no answer'}); "
                            f"this node's records are in {node_dir}")
    RunDir(node_dir).write_summary(link.summary)
    RunDir(node_dir).write_launch(_with_nodes_seen(launch, link.nodes))
    return RunResult(run_dir=node_dir, summary=structure(Summary, link.summary, "summary"))


def gather(collector: Collector, run_dir: Path, failures: list[Failure], progress) -> None:
    """Wait for the other nodes' last records and reports; record which nodes failed; list every node."""
    if failures:
        collector.stop_nodes(failures[0].message)
    if not collector.wait(GATHER_GRACE_S):
        warn(f"some nodes did not report within {GATHER_GRACE_S:g} s; their records may be incomplete", progress)
    known = {f.message for f in failures}
    failures += [f for f in collector.node_failures().values() if f.message not in known]
    RunDir(run_dir).write_launch(_with_nodes_seen(RunDir(run_dir).read_launch(), collector.nodes()))


def _with_nodes_seen(launch: LaunchRequest, seen: list[dict]) -> LaunchRequest:
    return attrs.evolve(launch, nodes=attrs.evolve(launch.nodes or NodeLayout(), seen=seen))
