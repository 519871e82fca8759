"""The launch request: what a run was asked to do, written to its folder as launch.json before any worker starts,
and read back as attributes by the workers, the summary and every tool that reads run folders.

One record for every kind of run: a workload (training, fine-tuning, serving, offline serving) and a micro-benchmark
suite. Fields a kind does not use stay at their defaults; a launch.json written before the record existed (schema
1.8 and older) reads with its missing fields defaulted. The run's header (``run_header``) is filled from it here, so
that every process names the run, its adapter and its launcher alike.

Typed all the way down: the workload is a ``Workload``, the fault a ``Fault``, a micro-benchmark's spec a
``MicroSpec``. One converter turns the record into JSON and back: ``unstructure`` (attrs' own ``asdict``) and
``structure`` (a walk of the attrs classes' field types, with one hook, the workload's own checked builder). The
same ``structure`` rebuilds the trace records that are read back as their classes (a summary, a quality record, a
topology): one reader of the contract's JSON, whose errors name the field.
Why not cattrs: it is not a dependency of the core nor of the adapters' environments, where the workers read this
record, and the walk needs only attrs classes, optionals, lists and string-keyed dicts (about 30 lines).
"""

from __future__ import annotations

import datetime
import json
import time
import types
import typing
from typing import Any, Literal

import attrs

from llmadapt.contract.records import SCHEMA_VERSION, Device, Header, ModelSource, Patch, RequestSource, Topology
from llmadapt.errors import ContractError, WorkloadError
from llmadapt.spec import Workload


@attrs.frozen
class Fault:
    """Fault injection for tests (llmadapt.launch.settings.FAULT_KINDS): ``kind`` at ``step`` of ``rank``."""

    kind: str
    step: int | str | None = None
    """A step index, or 'teardown': after the rank's last record."""
    rank: int = 0
    seconds: float | None = None
    """'slow': added to every step of every rank."""


@attrs.frozen
class OpCost:
    """What one direction of an operator costs, from llmadapt.analysis.perf.opmodel."""

    flops: float = 0.0
    bytes: float = 0.0
    launches: int | None = None
    """Operator calls the micro-benchmark's implementation makes."""


@attrs.frozen
class OpSpec:
    """One operator to time: its shape, dtype, directions and the cost each direction is expected to have."""

    op: str
    kind: str
    """'gemm', 'attention' or 'memory'."""
    dtype: str
    shape: dict[str, int]
    cost: dict[str, OpCost] = attrs.Factory(dict)
    """'forward', 'backward' -> its cost."""
    directions: list[str] = attrs.Factory(lambda: ["forward"])
    backend: str | None = None
    """Attention only: 'eager', 'math', 'flash', 'efficient', 'cudnn'."""
    trainable: bool = True
    """GEMMs: whether the weight takes a gradient (not under LoRA)."""
    extra: dict[str, Any] = attrs.Factory(dict)
    """The router's top-k ('k')."""


@attrs.frozen
class Timing:
    """How each measurement is repeated: warm-up calls, then at least ``repeats`` calls and ``min_time_s``,
    stopping at ``max_time_s``."""

    warmup: int = 2
    repeats: int = 10
    min_time_s: float = 0.05
    max_time_s: float = 2.0


@attrs.frozen
class PeakSpec:
    """The device's peaks: best GEMM FLOP/s per dtype over square sizes, and the copy bandwidth of a buffer."""

    dtypes: list[str] | None = None
    """None: every dtype the device has."""
    gemm_sizes_cpu: list[int] = attrs.Factory(lambda: [256, 512, 1024])
    gemm_sizes_gpu: list[int] = attrs.Factory(lambda: [2048, 4096, 8192])
    copy_bytes_cpu: int = 128 << 20
    copy_bytes_gpu: int = 2 << 30


@attrs.frozen
class CommSpec:
    """Collectives over message sizes."""

    ops: list[str]
    sizes: list[int]
    iters: int = 5
    warmup: int = 2


@attrs.frozen
class MicroSpec:
    """What a micro-benchmark suite measures and how (llmadapt.experiments.micro)."""

    timing: Timing = attrs.Factory(Timing)
    ops: list[OpSpec] = attrs.Factory(list)
    peak: PeakSpec | None = None
    comm: CommSpec | None = None


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
    workload: Workload | None = attrs.field(default=None, converter=lambda v: _typed(Workload, v))
    """The resolved workload; None for a micro-benchmark without one. Given as a dict (as before it was typed), it
    is built here."""
    workload_hash: str = ""
    problem_hash: str = ""
    fault: Fault | None = attrs.field(default=None, converter=lambda v: _typed(Fault, v))
    """Fault injection for tests."""
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
    spec: MicroSpec | None = attrs.field(default=None, converter=lambda v: _typed(MicroSpec, v))
    """Micro-benchmarks: what to measure and how."""
    created: float | None = None
    """Wall-clock time (Unix seconds) the request was made."""
    schema_version: str = SCHEMA_VERSION
    type: Literal["launch"] = "launch"

    def to_json(self) -> dict[str, Any]:
        return unstructure(self)

    def require_workload(self) -> Workload:
        """The workload the run ran; a ContractError where the record names none (a micro-benchmark's, or a
        hand-made or damaged launch.json): what a reader of workload runs calls."""
        if self.workload is None:
            raise ContractError(f"the launch record names no workload (kind {self.kind!r}, run id {self.run_id!r})")
        return self.workload

    @classmethod
    def from_json(cls, data: Any) -> LaunchRequest:
        """A launch.json read back; fields it lacks (an older or hand-made file) take their defaults (run id and
        launcher: empty), unknown ones are left."""
        if not isinstance(data, dict):
            raise ContractError(f"launch.json holds a {type(data).__name__}, not a launch request (a JSON object)")
        return structure(cls, {"run_id": "", "launcher": "", **data})


def unstructure(value: Any) -> Any:
    """A launch request, or any of its parts, as plain JSON data (the Workload as ``Workload.to_dict`` has it)."""
    return attrs.asdict(value) if attrs.has(type(value)) else value


def structure(cls: Any, data: Any, where: str = "launch") -> Any:
    """``cls`` (an attrs class of the contract, or a type hint over them) from plain data: nested records built,
    unknown keys left (a newer file), missing ones defaulted; a workload is built and checked by the workload's own
    builder. Anything else wrong is one ContractError naming the field (``where``)."""
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        return structure(next(a for a in args if a is not type(None)), data, where)
    if cls is Workload:
        return _workload(data, where)
    if origin is list and isinstance(data, list):
        return [structure(args[0], v, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin is dict and isinstance(data, dict):
        return {k: structure(args[1], v, f"{where}.{k}") for k, v in data.items()}
    if not attrs.has(cls):
        return data
    if not isinstance(data, dict):
        raise ContractError(f"{where}: expected a JSON object for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in attrs.fields(cls)}
    fields = {k: structure(hints[k], v, f"{where}.{k}") for k, v in data.items() if k in known}
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ContractError(f"{where}: {exc}") from None


def _typed(cls: type, value: Any) -> Any:
    """A field given as plain data (a dict, as code written before the record was typed passes it), built."""
    return structure(cls, value, cls.__name__.lower()) if isinstance(value, dict) else value


def _workload(data: Any, where: str) -> Workload | None:
    """The hook for the workload: its own checked builder, once per distinct workload (runs of one workload,
    repeats or a sweep's cells, share it: building one is most of what reading a launch.json costs)."""
    if data == {}:  # written before the record was typed: a micro-benchmark with no workload
        return None
    key = json.dumps(data, sort_keys=True, default=str)
    if key not in _WORKLOADS:
        try:
            workload = Workload.from_dict(data)
        except WorkloadError as exc:
            raise ContractError(f"{where}: {exc}") from None
        if len(_WORKLOADS) >= 256:
            _WORKLOADS.clear()
        _WORKLOADS[key] = workload
    return _WORKLOADS[key]


_WORKLOADS: dict[str, Workload] = {}
"""Workloads read, by their JSON text (a Workload is frozen: sharing one is safe)."""


def new_run_id(*parts: str, when: datetime.datetime | None = None, unique: str | None = None) -> str:
    """Every run id and run-like folder name: TIME-PARTS-XXXX (four hex digits against two in one second).
    ``when``: a UTC time other than now (an imported result's); ``unique``: the last part instead of random digits
    (a content hash: the same result imported twice is the same run)."""
    import secrets

    stamp = when.strftime("%Y%m%d-%H%M%S") if when is not None else time.strftime("%Y%m%d-%H%M%S")
    return "-".join([stamp, *parts, unique or secrets.token_hex(2)])


def run_header(launch: LaunchRequest, *, framework_version: str, device: Device | None, software: dict[str, str],
               patches: list[Patch], rank: int = 0, local_rank: int = 0, world_size: int = 1,
               workload: Any = None, checkpoint_hash: str | None = None, topology: Topology | None = None,
               notes: list[str] | None = None, model_source: ModelSource | None = None,
               weights: list[Any] | None = None, started: datetime.datetime | None = None,
               request_source: RequestSource | None = None, engine_weights: str | None = None) -> Header:
    """The header of a process that starts measuring now, for the run ``launch`` asked for. ``workload``: the
    Workload this process resolved (its hashes and form are the header's); without it, the request's. ``started``:
    a measurement that began at that (UTC) time elsewhere, on a machine not known (an imported result's)."""
    if workload is not None:
        hashes = {"workload_hash": workload.content_hash, "problem_hash": workload.problem_hash,
                  "workload": workload.to_dict()}
    else:
        hashes = {"workload_hash": launch.workload_hash, "problem_hash": launch.problem_hash,
                  "workload": unstructure(launch.workload) or {}}
    fields = dict(
        run_id=launch.run_id, rank=rank, local_rank=local_rank, world_size=world_size, role=launch.role,
        adapter=launch.adapter, adapter_version=launch.adapter_version, framework=launch.framework,
        framework_version=framework_version, launcher=launch.launcher, checkpoint_hash=checkpoint_hash,
        device=device, software=software, patches=patches, topology=topology, notes=list(notes or []),
        model_source=model_source, weights=list(weights or []), request_source=request_source,
        engine_weights=engine_weights, **hashes)
    if started is None:
        return Header.starting_now(**fields)
    return Header(**fields, node="", start_time=started.isoformat(), wall_anchor_ns=round(started.timestamp() * 1e9),
                  mono_anchor_ns=0)
