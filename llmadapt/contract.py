"""The metrics contract: record types, their JSON Schema, and JSONL reading and writing.

The single source of truth for field names and units. Units are in the names: seconds
(``*_s``/``seconds``), bytes (``*_bytes``), tokens, nanoseconds (``*_ns``, from the process's
monotonic clock; each header carries one wall-clock anchor per process to align ranks).

A trace is a run directory of JSONL files, one per rank (``rank-00000.jsonl``) plus
``launcher.jsonl`` for what the orchestrator saw, and ``summary.json``. Writers flush every
record, so a crash leaves every record made before it.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import attrs

from llmadapt.errors import ContractError

SCHEMA_VERSION = "1.2"  # 1.1: end records, summary warnings; 1.2: client_load records, client health in serving


@attrs.frozen
class Phase:
    """Time spent in one part of a step, as measured by `source` (llmadapt or the framework's own timer)."""

    name: str
    seconds: float
    source: str


@attrs.frozen
class Span:
    """An interval on this process's monotonic clock, for timelines (Chrome trace)."""

    name: str
    start_ns: int
    end_ns: int
    source: str = "llmadapt"


@attrs.frozen
class Memory:
    """Memory at the end of a step. On CUDA: torch.cuda peak stats; on CPU: process RSS (peak and current)."""

    kind: Literal["cuda", "cpu-rss"]
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    rss_bytes: int | None = None
    peak_rss_bytes: int | None = None


@attrs.frozen
class Patch:
    """A compatibility patch a run applied to its framework."""

    framework: str
    name: str
    description: str
    kind: Literal["cpu-equivalent", "shim", "fix"] = "cpu-equivalent"
    """'cpu-equivalent' provides a real CPU implementation; 'shim' fakes something (e.g. a type string);
    'fix' corrects a framework bug on every device."""


@attrs.frozen
class Device:
    kind: Literal["cpu", "cuda"]
    name: str
    count: int
    memory_bytes: int | None = None


@attrs.frozen
class Header:
    """First record of each rank's file: who ran what, where, with which software."""

    run_id: str
    rank: int
    local_rank: int
    world_size: int
    node: str
    role: str
    adapter: str
    adapter_version: str
    framework: str
    framework_version: str
    launcher: str
    workload_hash: str
    problem_hash: str
    workload: dict[str, Any]
    checkpoint_hash: str | None
    device: Device | None
    """The device the measured code ran on; None where the client cannot know (an attached server)."""
    software: dict[str, str]
    patches: list[Patch]
    start_time: str
    """ISO 8601 wall-clock time the process started measuring."""
    wall_anchor_ns: int
    """time.time_ns() read together with mono_anchor_ns: maps this process's monotonic clock to wall time."""
    mono_anchor_ns: int
    schema_version: str = SCHEMA_VERSION
    type: Literal["header"] = "header"


@attrs.frozen
class Step:
    """One global step on one rank (all its micro-batches and the optimizer step)."""

    rank: int
    step: int
    warmup: bool
    start_ns: int
    end_ns: int
    seconds: float
    tokens: int
    """Input tokens this rank processed in the step (padding excluded)."""
    samples: int
    loss: float | None
    """Loss of the whole global batch: mean over every loss-bearing token of all ranks."""
    phases: list[Phase] = attrs.Factory(list)
    memory: Memory | None = None
    expert_load: list[list[int]] | None = None
    """MoE: tokens routed to each expert, per layer ([layer][expert]), over the global batch."""
    spans: list[Span] = attrs.Factory(list)
    expert_near_ties: list[int] | None = None
    """MoE: per layer, tokens whose k-th and (k+1)-th router logits were within fp noise (llmadapt.moe):
    another stack may route these differently and be equally right."""
    type: Literal["step"] = "step"


@attrs.frozen
class Request:
    """One request as the load generator saw it (serving). Times are ns on the generator's monotonic clock."""

    index: int
    warmup: bool
    scheduled_ns: int
    """When the arrival process said to send it."""
    sent_ns: int | None
    """When it was actually sent (None: never sent); sent - scheduled is the generator's own lag."""
    first_token_ns: int | None
    """First chunk carrying content."""
    end_ns: int | None
    chunk_ns: list[int]
    """Arrival time of every content-bearing chunk."""
    chunk_tokens: list[int | None]
    """Tokens in each chunk where the protocol says (TGI: one event per token); None where it does not."""
    input_tokens: int
    """Prompt tokens by the canonical tokenizer."""
    output_tokens: int | None
    """Generated tokens: the engine's usage count where given, else the sum of known chunk counts."""
    requested_output_tokens: int
    output_forced: bool
    """True when the engine was asked to ignore EOS (output length forced)."""
    finish_reason: str | None
    status: Literal["ok", "error", "timeout", "cancelled"]
    error: str | None = None
    error_cause: str | None = None
    """http_429, http_4xx, http_5xx, in_band, malformed, connection, timeout, engine_dead, cancelled."""
    server_input_tokens: int | None = None
    type: Literal["request"] = "request"


@attrs.frozen
class ServerSample:
    """The engine's own metrics, scraped during the run (e.g. Prometheus /metrics), labelled by source."""

    t_ns: int
    source: str
    values: dict[str, float]
    type: Literal["server_sample"] = "server_sample"


@attrs.frozen
class Comm:
    """A framework's own record of one collective (e.g. DeepSpeed's comms logger), per rank.

    Bandwidths follow the nccl-tests conventions and unit: algbw = message bytes / time, busbw = algbw x
    the op's factor (all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; others 1),
    in GB/s (10^9 bytes/s), as nccl-tests prints them; computed by ``bandwidths`` for every source
    (DeepSpeed's own logger prints Gbit/s: 8 x these). For all-gather and reduce-scatter,
    message_bytes is the gathered (total) size.
    """

    rank: int
    op: str
    message_bytes: int
    count: int
    total_seconds: float
    source: str
    step: int | None = None
    """The step it was logged in; None for a whole-run aggregate."""
    algbw_gbytes_per_s: float | None = None
    """GB/s (10^9 bytes per second)."""
    busbw_gbytes_per_s: float | None = None
    """GB/s (10^9 bytes per second)."""
    type: Literal["comm"] = "comm"


# nccl-tests' bus-bandwidth factors by collective, under the names torch.distributed and DeepSpeed log.
_ALL_REDUCE = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce")
_N_MINUS_1 = ("all_gather", "all_gather_into_tensor", "allgather_fn", "all_gather_base", "reduce_scatter",
              "reduce_scatter_tensor", "reduce_scatter_fn", "reduce_scatter_base", "all_to_all", "all_to_all_single")


def bus_factor(op: str, world: int) -> float:
    if op in _ALL_REDUCE:
        return 2 * (world - 1) / world
    if op in _N_MINUS_1:
        return (world - 1) / world
    return 1.0  # broadcast and the rest


def bandwidths(op: str, message_bytes: float, count: int, seconds: float, world: int
               ) -> tuple[float | None, float | None]:
    """(algbw, busbw) in GB/s for ``count`` calls taking ``seconds`` in all: the one place they are computed."""
    if seconds <= 0 or message_bytes <= 0 or count <= 0:
        return None, None
    algbw = message_bytes * count / seconds / 1e9
    return algbw, algbw * bus_factor(op, world)


@attrs.frozen
class Metric:
    """A named figure a framework reports once (e.g. its FLOPs profiler's total), beside ours, never instead."""

    rank: int
    name: str
    value: float
    unit: str
    source: str
    step: int | None = None
    type: Literal["metric"] = "metric"


@attrs.frozen
class Failure:
    """Why a rank, a worker or the run stopped early. Written by the worker when it can, else by the launcher."""

    cause: Literal["error", "crash", "killed", "timeout", "oom", "interrupted", "unsupported"]
    message: str
    rank: int | None = None
    """None when the launcher saw it (not attributable to one rank)."""
    step: int | None = None
    exit_code: int | None = None
    time: str | None = None
    type: Literal["failure"] = "failure"


@attrs.frozen
class End:
    """A rank's last record: everything it measured was written before it.

    A run in which every rank wrote one is complete, whatever happens in the teardown after it (a rank
    that then dies is a warning in the summary, not a failed run)."""

    rank: int
    time: str
    type: Literal["end"] = "end"


@attrs.frozen
class Stats:
    """Statistics over the measured values of one metric."""

    count: int
    mean: float
    std: float
    min: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float


@attrs.frozen
class ClientLoad:
    """The load generator's own health over a serving run: how late its event loop woke, and its CPU.

    A sampler sleeps ``interval_ms`` at a time on the generator's event loop; a wake-up late by
    ``loop_lag_ms`` means every stream and every due send waited that long too.
    """

    interval_ms: float
    loop_lag_ms: Stats | None
    stalls: list[list[float]]
    """[seconds since the run started, lag ms, process CPU ms meanwhile, ms the loop's thread waited runnable for
    a CPU meanwhile (Linux; else null)] of each wake-up later than the validity limit (the first 200). CPU near
    the lag: a busy loop; run-queue wait near it: a starved process; neither: blocked in a system call."""
    cpu_s: float
    """The client process's CPU time (user + system, all threads) over the run."""
    wall_s: float
    requests_sent: int
    engine_itl_metric: str | None = None
    """The engine's inter-token latency histogram (Prometheus, seconds) among the server samples, if it has one."""
    sched_autogroup: bool | None = None
    """Linux schedules by session (autogroup) on the client's machine: an engine in another session then has a
    CPU share equal to this whole session's (None: not Linux)."""
    type: Literal["client_load"] = "client_load"


@attrs.frozen
class ServingStats:
    """Serving figures as the field defines them (see docs/contract.md); latencies in milliseconds."""

    completed: int
    failed: int
    failures_by_cause: dict[str, int]
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft_ms: Stats | None
    tpot_ms: Stats | None
    itl_ms: Stats | None
    e2el_ms: Stats | None
    send_lag_ms: Stats | None
    valid: bool
    """False when the generator fell behind its schedule (see validity)."""
    validity: str
    output_length_forced: bool
    total_input_tokens: int
    total_output_tokens: int
    loop_lag_ms: Stats | None = None
    """How late the client's event loop woke while the run was on (see ClientLoad); None in older traces."""
    client_cpu_s: float | None = None
    client_cpu_ms_per_request: float | None = None
    engine_itl_ms: float | None = None
    """The engine's own mean inter-token latency over the run, from its metrics (None without them)."""
    bunched_share: float | None = None
    """Share of inter-chunk gaps below a tenth of the engine's inter-token latency: chunks that reached the
    client together although the engine made them apart (None without the engine's figure)."""


@attrs.frozen
class Summary:
    """The run's aggregate, computed by the orchestrator from every rank's records."""

    run_id: str
    status: Literal["ok", "failed"]
    role: str
    adapter: str
    framework: str
    framework_version: str
    launcher: str
    workload_hash: str
    problem_hash: str
    world_size: int
    device: Device | None
    patches: list[Patch]
    steps_completed: int
    measured_steps: int
    losses: list[float | None]
    """Global-batch loss at every completed step (warm-up included), by step index."""
    step_time_s: Stats | None
    """Per step, the slowest rank's time."""
    tokens_per_s: Stats | None
    samples_per_s: Stats | None
    tokens_per_step: int | None
    peak_memory_bytes: int | None
    """Max over ranks of the peak (device allocated on CUDA, RSS on CPU)."""
    peak_memory_per_rank: list[int | None]
    memory_kind: str | None
    model_flops_per_token: float | None
    """PaLM convention (see llmadapt.flops)."""
    achieved_flops_per_s: float | None
    mfu: float | None
    """None where the device peak is unknown (e.g. CPUs) or the convention does not apply."""
    phase_means_s: dict[str, float]
    """Mean over measured steps and ranks, per 'source:name'."""
    failures: list[Failure]
    serving: ServingStats | None = None
    """Serving runs only: client-side latency, throughput and goodput."""
    warnings: list[str] = attrs.field(factory=list)
    """What cost no measurement but a reader must know, e.g. a rank that died in teardown after its last record."""
    schema_version: str = SCHEMA_VERSION
    type: Literal["summary"] = "summary"


# -- micro-benchmarks, the analytical model, Study B's fits, max batch search (issue 7) ----------
@attrs.frozen
class OpBench:
    """One operator micro-benchmark (``llmadapt micro ops`` / ``micro peak``): one shape, one direction, one dtype.

    ``flops`` and ``bytes`` are per call, from llmadapt.opmodel (hardware FLOPs; bytes the
    kernels read and write); achieved rates use the median time.
    """

    rank: int
    op: str
    direction: Literal["forward", "backward"]
    dtype: str
    shape: dict[str, int]
    flops: float
    bytes: float
    seconds: Stats | None
    """Per call, over the measured repeats (warm-up calls excluded); None when it did not run."""
    times_s: list[float]
    """Every measured call, raw."""
    flops_per_s: float | None = None
    bytes_per_s: float | None = None
    backend: str | None = None
    """Attention: the SDPA backend (math, flash, efficient, cudnn) or 'eager' (transformers' matmul-softmax-matmul)."""
    launches: int | None = None
    """Operator calls one call of this benchmark makes (kernels, casts, views): fits the per-call overhead."""
    status: Literal["ok", "unsupported", "error"] = "ok"
    note: str | None = None
    source: str = "llmadapt.micro"
    type: Literal["op_bench"] = "op_bench"


@attrs.frozen
class MemoryEstimate:
    """Memory per rank by the analytical model, in bytes."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    kv_cache_bytes: float
    runtime_overhead_bytes: float
    total_bytes: float
    """What one rank's device must hold at the peak."""
    host_bytes: float
    """Offloaded to host memory (ZeRO-Offload), not counted in total_bytes."""
    capacity_bytes: float | None
    fits: bool | None


@attrs.frozen
class Estimate:
    """A prediction by the analytical model for one workload on one device (``llmadapt estimate``)."""

    workload_hash: str
    label: str
    kind: str
    device: str
    device_kind: str
    precision: str
    world_size: int
    micro_batch: int
    memory: MemoryEstimate
    model_flops_per_step: float
    """PaLM convention (llmadapt.flops), all ranks."""
    hardware_flops_per_step: float
    """Executed FLOPs (recomputation and causal-skip included), all ranks."""
    step_time_s: float | None
    time_breakdown_s: dict[str, float]
    """Seconds per step by part: compute-bound ops, memory-bound ops, per-call overhead, optimizer, communication."""
    tokens_per_s: float | None
    samples_per_s: float | None
    mfu: float | None
    max_micro_batch: int | None
    """Largest per-rank micro-batch whose memory fits the device (None when the capacity is unknown)."""
    price_per_hour: float | None
    """Per device."""
    cost_per_step: float | None
    cost_per_hour: float | None
    """All devices of the run."""
    cost_per_million_tokens: float | None
    run_cost: float | None
    """The workload's steps (warm-up included)."""
    job: dict[str, float] | None
    """queries x epochs at the predicted samples/s: hours and cost (Study B's cost model)."""
    serving: dict[str, float] | None
    factors: dict[str, float]
    calibration: str | None
    """Where the efficiency factors came from (a calibration file), None for the defaults."""
    sources: dict[str, str]
    """Source and date of each device figure used."""
    assumptions: list[str]
    type: Literal["estimate"] = "estimate"


@attrs.frozen
class FitPoint:
    label: str
    x: dict[str, float]
    measured: float
    predicted: float


@attrs.frozen
class Fit:
    """A fitted model: the roofline's efficiency factors (calibration) or Study B's Eq. 1 / Eq. 2."""

    model: Literal["roofline", "studyb-eq1", "studyb-eq2"]
    coefficients: dict[str, float]
    """Fitted values."""
    fixed: dict[str, float]
    """Values held fixed (given, not fitted)."""
    points: list[FitPoint]
    rmse: float | None
    mape: float | None
    """In-sample: the error on the points the fit was made from."""
    source: str
    """What it was fitted on (run directories, a micro-benchmark run, supplied data)."""
    device: str | None = None
    unit: str = ""
    note: str = ""
    type: Literal["fit"] = "fit"


@attrs.frozen
class ValidationRow:
    run: str
    label: str
    measured_step_s: float
    predicted_step_s: float
    error: float
    """(predicted - measured) / measured."""
    measured_peak_memory_bytes: int | None = None
    predicted_memory_bytes: float | None = None
    memory_error: float | None = None


@attrs.frozen
class Validation:
    """Predictions against measured runs (``llmadapt estimate --validate``)."""

    device: str
    statistic: str
    """Which measured step time: p50, mean or min over measured steps (min: the least disturbed step on a shared
    machine)."""
    calibration: str | None
    rows: list[ValidationRow]
    mape: float
    """Mean absolute percentage error of the step time, as a fraction (0.1 = 10%)."""
    max_abs_error: float
    memory_mape: float | None = None
    type: Literal["validation"] = "validation"


@attrs.frozen
class Probe:
    """One probe of the max batch search: a real run at one per-rank batch, in its own worker."""

    batch: int
    outcome: Literal["fits", "oom", "error", "crash", "killed", "timeout", "interrupted", "unsupported"]
    """fits: every step completed; oom: out of memory; anything else is not counted as out of memory."""
    run_dir: str
    message: str | None
    steps_completed: int
    peak_memory_bytes: int | None
    step_time_s: float | None
    samples_per_s: float | None
    memory_limit_bytes: int | None
    memory_limit_kind: str | None
    """'RLIMIT_AS' when a per-worker address-space cap made running out of memory real (CPU)."""
    seconds: float
    type: Literal["probe"] = "probe"


@attrs.frozen
class MaxBatch:
    """The result of a max batch search (``llmadapt maxbatch``)."""

    workload_hash: str
    label: str
    adapter: str
    status: Literal["ok", "failed"]
    max_batch: int | None
    """Largest per-rank batch that completed its steps; None when none did."""
    first_failing: int | None
    """Smallest batch that ran out of memory; None when the search stopped at max_tried."""
    max_tried: int
    probes: int
    seq_len: int
    sparsity: float
    """Active experts / experts (1.0 for dense models): Study B's Eq. 1 input."""
    memory_limit_bytes: int | None
    memory_limit_kind: str | None
    capacity_bytes: int | None
    """The memory the search ran against: the cap when one was set, else the device's memory."""
    message: str
    type: Literal["maxbatch"] = "maxbatch"


RECORD_TYPES: dict[str, type] = {
    "header": Header, "step": Step, "request": Request, "server_sample": ServerSample, "client_load": ClientLoad,
    "comm": Comm,
    "metric": Metric, "failure": Failure, "end": End, "summary": Summary,
    "op_bench": OpBench, "estimate": Estimate, "fit": Fit, "validation": Validation, "probe": Probe,
    "maxbatch": MaxBatch,
}


def to_json(record: Any) -> dict[str, Any]:
    return attrs.asdict(record)


# -- JSON Schema, generated from the record types ---------------------------------------------
def _schema_for(hint: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if attrs.has(hint):
        name = hint.__name__
        if name not in defs:
            defs[name] = {}  # placeholder against recursion
            hints = typing.get_type_hints(hint)
            props, required = {}, []
            for field in attrs.fields(hint):
                props[field.name] = _schema_for(hints[field.name], defs)
                doc = _field_docs(hint).get(field.name)
                if doc:
                    props[field.name]["description"] = doc
                if field.default is attrs.NOTHING:
                    required.append(field.name)
            defs[name] = {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            }
            if hint.__doc__:
                defs[name]["description"] = " ".join(hint.__doc__.split())
        return {"$ref": f"#/$defs/{name}"}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_for(a, defs) for a in typing.get_args(hint)]}
    if origin is Literal:
        values = list(typing.get_args(hint))
        return {"const": values[0]} if len(values) == 1 else {"enum": values}
    if origin is list:
        return {"type": "array", "items": _schema_for(typing.get_args(hint)[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema_for(typing.get_args(hint)[1], defs)}
    simple = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
    if hint in simple:
        return {"type": simple[hint]}
    if hint is Any:
        return {}
    raise TypeError(f"no JSON Schema mapping for {hint!r}")


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after a field), read from the source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs, body = {}, tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def json_schema() -> dict[str, Any]:
    """The JSON Schema of one trace record (any type), from the record classes above."""
    defs: dict[str, Any] = {}
    refs = [_schema_for(cls, defs) for cls in RECORD_TYPES.values()]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://llmadapt.dev/schema/record-{SCHEMA_VERSION}.json",
        "title": f"llmadapt trace record, schema {SCHEMA_VERSION}",
        "oneOf": refs,
        "$defs": defs,
    }


_validator = None


def validate(record: dict[str, Any]) -> dict[str, Any]:
    """Check one record against the schema; raise ContractError naming the first problem."""
    global _validator
    if _validator is None:
        import jsonschema

        _validator = jsonschema.Draft202012Validator(json_schema())
    kind = record.get("type") if isinstance(record, dict) else None
    if kind not in RECORD_TYPES:
        raise ContractError(f"record has unknown type {kind!r}; known: {', '.join(RECORD_TYPES)}")
    sub = {"$ref": f"#/$defs/{RECORD_TYPES[kind].__name__}", "$defs": _validator.schema["$defs"]}
    error = next(iter(_validator.evolve(schema=sub).iter_errors(record)), None)
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(record)"
        raise ContractError(f"{kind} record, field {where}: {error.message}")
    if record.get("schema_version", SCHEMA_VERSION).split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise ContractError(f"schema version {record['schema_version']} is not readable by {SCHEMA_VERSION}")
    return record


# Fields renamed since schema 1.0, as (record type, old name, new name); older traces read as if new.
_RENAMED = (("comm", "algbw_gbps", "algbw_gbytes_per_s"), ("comm", "busbw_gbps", "busbw_gbytes_per_s"))


def upgrade(record: Any) -> Any:
    """A record of an older 1.x schema in today's field names (same values: those fields were GB/s already)."""
    if isinstance(record, dict):
        for kind, old, new in _RENAMED:
            if record.get("type") == kind and old in record:
                record[new] = record.pop(old)
    return record


# -- JSONL ----------------------------------------------------------------------------------
class JsonlWriter:
    """Appends one JSON object per line and flushes each, so nothing written is lost on a crash."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: Any) -> None:
        data = record if isinstance(record, dict) else to_json(record)
        self._file.write(json.dumps(data, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | Path, *, check: bool = True) -> list[dict[str, Any]]:
    """Read and (by default) validate every record. A torn last line (killed mid-write) is skipped."""
    records = []
    # Bytes, not text: a file with binary garbage is named by its line below, not a UnicodeDecodeError.
    lines = Path(path).read_bytes().decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the writer was killed mid-line; everything before it stands
            raise ContractError(f"{path}:{number}: not valid JSON") from None
        record = upgrade(record)
        if check:
            try:
                validate(record)
            except ContractError as exc:
                raise ContractError(f"{path}:{number}: {exc}") from None
        records.append(record)
    return records
