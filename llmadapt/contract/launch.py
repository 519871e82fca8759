"""The launch request: what a run was asked to do, written to its folder as launch.json before any worker starts,
and read back as attributes by the workers, the summary and every tool that reads run folders.

One record for every kind of run: a workload (training, fine-tuning, serving, offline serving) and a micro-benchmark
suite. Fields a kind does not use stay at their defaults; a launch.json written before the record existed (schema
1.8 and older) reads with its missing fields defaulted. The run's header (``run_header``) is filled from it here, so
that every process names the run, its adapter and its launcher alike.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import attrs

from llmadapt.contract.records import SCHEMA_VERSION, Device, Header, ModelSource, Patch, Topology
from llmadapt.errors import ContractError


@attrs.frozen
class NodeLayout:
    """A run across machines under torchrun: how it was laid out, and which nodes took part."""

    nnodes: int | None = None
    nproc_per_node: int | None = None
    rendezvous: str | None = None
    """'static' (a master address and port) or 'c10d' (a rendezvous endpoint)."""
    seen: list[dict[str, Any]] | None = None
    """Every node that reported, with its ranks (node_rank, node, ranks); set once the run ends."""


@attrs.frozen
class SlurmJob:
    """A run submitted as a Slurm batch job."""

    nnodes: int
    ntasks_per_node: int
    script: str
    """The batch script's name in the run folder."""
    node_dir: str
    """The folder each node writes its records to (nodes need not share a disk)."""
    output: str
    """Slurm's output file (%j: the job id)."""
    job_id: str | None = None
    """Set once sbatch accepted the job."""


@attrs.frozen
class LaunchRequest:
    """What a run was asked to do (launch.json): the workload, adapter and launcher, written before any worker."""

    run_id: str
    launcher: str
    """'inline', 'subprocess', 'torchrun', 'slurm', an adapter's own; serving: 'attach', 'subprocess', 'offline'."""
    world_size: int = 1
    kind: Literal["workload", "micro"] = "workload"
    """'micro': a micro-benchmark suite (``suite`` and ``spec``), not a workload."""
    role: str = ""
    """The workload's kind ('train', 'finetune', 'serve'); 'micro-SUITE' for a micro-benchmark."""
    adapter: str = ""
    adapter_version: str = ""
    framework: str = ""
    worker_class: str | None = None
    """'module:Class' of the adapter's role class, imported by the worker (training and fine-tuning)."""
    workload: dict[str, Any] = attrs.Factory(dict)
    """The resolved workload (Workload.to_dict)."""
    workload_hash: str = ""
    problem_hash: str = ""
    fault: dict[str, Any] | None = None
    """Fault injection for tests (llmadapt.launch.settings.FAULT_KINDS)."""
    memory_limit_bytes: int | None = None
    python: str | None = None
    """The interpreter of the adapter's environment; None inline or attached."""
    command: list[str] | None = None
    """The worker command line of an adapter's own launcher."""
    nodes: NodeLayout | None = None
    slurm: SlurmJob | None = None
    checkpoint: str | None = None
    """Offline serving: the checkpoint folder the engine loads."""
    checkpoint_hash: str | None = None
    offline_class: str | None = None
    """Offline serving: 'module:Class' of the adapter's offline engine."""
    suite: str | None = None
    """Micro-benchmarks: 'ops', 'peak' or 'comm'."""
    spec: dict[str, Any] | None = None
    """Micro-benchmarks: what to measure and how (llmadapt.experiments.micro)."""
    created: float | None = None
    """Wall-clock time (Unix seconds) the request was made."""
    schema_version: str = SCHEMA_VERSION
    type: Literal["launch"] = "launch"

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> LaunchRequest:
        """A launch.json read back; fields it lacks (an older or hand-made file) take their defaults (run id and
        launcher: empty), unknown ones are left."""
        if not isinstance(data, dict):
            raise ContractError(f"launch.json holds a {type(data).__name__}, not a launch request (a JSON object)")
        known = {f.name for f in attrs.fields(cls)}
        fields = {"run_id": "", "launcher": "", **{k: v for k, v in data.items() if k in known}}
        if isinstance(fields.get("nodes"), dict):
            fields["nodes"] = _nested(NodeLayout, fields["nodes"])
        if isinstance(fields.get("slurm"), dict):
            fields["slurm"] = _nested(SlurmJob, fields["slurm"])
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ContractError(f"launch.json: {exc}") from None


def _nested(cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in attrs.fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in known})
    except TypeError as exc:
        raise ContractError(f"launch.json: {cls.__name__}: {exc}") from None


def new_run_id(*parts: str) -> str:
    """Every run id and run-like folder name: TIME-PARTS-XXXX (four hex digits against two in one second)."""
    import secrets

    return "-".join([time.strftime("%Y%m%d-%H%M%S"), *parts, secrets.token_hex(2)])


def run_header(launch: LaunchRequest, *, framework_version: str, device: Device | None, software: dict[str, str],
               patches: list[Patch], rank: int = 0, local_rank: int = 0, world_size: int = 1,
               workload: Any = None, checkpoint_hash: str | None = None, topology: Topology | None = None,
               notes: list[str] | None = None, model_source: ModelSource | None = None,
               weights: list[Any] | None = None, engine_weights: str | None = None) -> Header:
    """The header of a process that starts measuring now, for the run ``launch`` asked for. ``workload``: the
    Workload this process resolved (its hashes and form are the header's); without it, the request's."""
    if workload is not None:
        hashes = {"workload_hash": workload.content_hash, "problem_hash": workload.problem_hash,
                  "workload": workload.to_dict()}
    else:
        hashes = {"workload_hash": launch.workload_hash, "problem_hash": launch.problem_hash,
                  "workload": launch.workload}
    return Header.starting_now(
        run_id=launch.run_id, rank=rank, local_rank=local_rank, world_size=world_size, role=launch.role,
        adapter=launch.adapter, adapter_version=launch.adapter_version, framework=launch.framework,
        framework_version=framework_version, launcher=launch.launcher, checkpoint_hash=checkpoint_hash,
        device=device, software=software, patches=patches, topology=topology, notes=list(notes or []),
        model_source=model_source, weights=list(weights or []), engine_weights=engine_weights,
        **hashes)
