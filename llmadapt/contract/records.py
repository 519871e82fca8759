"""The trace records: what a run writes, one frozen attrs class per record type.

The single source of truth for field names and units. Units are in the names: seconds
(``*_s``/``seconds``), bytes (``*_bytes``), tokens, nanoseconds (``*_ns``, from the process's
monotonic clock; each header carries one wall-clock anchor per process to align ranks).

A trace is a run directory of JSONL files, one per rank (``rank-00000.jsonl``) plus
``launcher.jsonl`` for what the orchestrator saw, and ``summary.json``. Writers flush every
record, so a crash leaves every record made before it.

It is over 400 lines because every record type of the contract lives here, each with its field docs: one
file to read for the whole schema.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import attrs

from llmadapt.host import node_name, utc_now

SCHEMA_VERSION = "1.20"  # 1.1: end records, summary warnings; 1.2: client_load records, client health in serving;
# 1.3: breakdown and telemetry records, profiled steps, the summary's breakdown, expert imbalance and telemetry;
# 1.4: evaluation records and the summary's evaluations; 1.5: serving's tokens_per_chunk;
# 1.6: the breakdown's memory_seconds, kernel_types (GPU kernel basis) and other_operators; the summary's
# hardware_flops_per_token and hfu; the header's topology; the breakdown's module_operators;
# 1.7: interference records and the summary's interference; the topology's threads;
# 1.8: the 'diverged' status and failure cause; the step's run_delay_s and the interference summary's step
# waits; serving's 'degraded' status and the request's 'truncated'; 1.9: the launch record (launch.json, typed:
# llmadapt.contract.launch); 1.10: the step's grad_norm and the summary's grad_norms; 1.11: the summary's
# measured_by (serving runs imported from other tools' result files), the header's and the summary's notes, the
# client load's prefix_cache_metrics and stream_prefix_share, the serving stats' stream_prefix_share and
# engine_prefix_cache_hit_share; 1.12: the step's sample_length_squares (the attention term's context); 1.13: the
# header's model_source (a GGUF model's file hash, tensor types, dequantized); 1.14: the header's and the summary's
# weights (per module class: stored format, count and bytes); 1.15: the summary's topology (rank 0's); 1.16: the interference
# record's run_delay_threads; 1.17: the header's request_source (a request-stream file: its sha256, what was read of
# it); 1.18: the serving stats' output_tokens, stopped_at_eos_share and hit_cap_share; 1.19: the evaluation's split
# and split_counts; 1.20: quality records (serve.quality) and the summary's quality; the header's and the summary's
# engine_weights


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
class ModelSource:
    """Where a run's weights came from when they were converted for it: a GGUF file, dequantized to a model
    folder that every stack loaded (llmadapt.models.gguf_checkpoint)."""

    format: Literal["gguf"]
    file: str
    """The source file's name."""
    sha256: str
    """The source file's sha256 (all 64 hex digits; model.checksum is its first 20)."""
    tensor_types: dict[str, int]
    """The types its tensors are stored in (ggml's names: 'Q4_1', 'Q8_0', 'F32', ...) -> how many tensors."""
    file_type: str | None
    """The file type its header declares (llama.cpp's: 'MOSTLY_Q4_1'), as written."""
    dequantized_to: str | None
    """The dtype the weights were dequantized to for the run ('float32'); None where they were not."""
    converted_hash: str | None = None
    """The content hash of the model folder the file was converted to (what the stacks loaded)."""


@attrs.frozen
class RequestSource:
    """The request-stream file a serving run read (serve.source.path of a ShareGPT source): the file as given, and
    the file read, which is a completed copy where the given one was cut short (llmadapt.streamfiles)."""

    format: Literal["sharegpt"]
    file: str
    """The given file's name."""
    sha256: str
    """The given file's sha256 (all 64 hex digits)."""
    bytes: int
    """The given file's size."""
    conversations: int
    """The conversations read (all of a complete file; the complete ones of a file cut short)."""
    bytes_dropped: int
    """The bytes of the given file left out: 0 for a complete file; the partial conversation at the end of one cut
    short."""
    path_used: str
    """The file read: the given one, or its completed copy in the state folder (what another tool should read)."""


@attrs.frozen
class Device:
    kind: Literal["cpu", "cuda"]
    name: str
    count: int
    memory_bytes: int | None = None


@attrs.frozen
class GpuLink:
    """How this rank's GPU reaches one other GPU of the machine, as NVML reports it."""

    peer: int
    """The other GPU's index (NVML's, on this machine)."""
    path: str
    """NVML's common ancestor: 'same board', 'one PCIe switch', 'several PCIe switches', 'PCIe host bridge',
    'same NUMA node', 'across NUMA nodes (SMP interconnect)'."""
    nvlink: bool | None
    """Whether peer-to-peer runs over NVLink (NVML's P2P NVLink capability); None where NVML cannot say."""
    p2p: str | None
    """Peer-to-peer read status: 'ok', or why not ('chipset not supported', 'disabled by NCCL_P2P_DISABLE', ...)."""


@attrs.frozen
class Topology:
    """Where a rank ran and how its devices are connected (what study A compares as NVLink against PCIe), and the
    communication settings that change the path a collective takes."""

    interconnect: str
    """'nvlink', 'pcie' (GPUs reach each other over PCIe only), 'single gpu', or 'cpu' (no device links)."""
    numa_nodes: int | None = None
    """NUMA nodes of the machine (Linux's /sys/devices/system/node)."""
    cpus: list[int] | None = None
    """The cores this rank may run on (its affinity)."""
    threads: dict[str, int] = attrs.Factory(dict)
    """The rank's CPU threads: torch's intra-op pool ('intra_op', which OpenMP and MKL follow) and its inter-op
    pool ('inter_op'), as the run started."""
    nvlinks_active: int | None = None
    """This GPU's NVLink links that are up."""
    gpu_links: list[GpuLink] = attrs.Factory(list)
    settings: dict[str, str] = attrs.Factory(dict)
    """The environment variables that steer communication, as set for this rank (NCCL_*, GLOO_*, CUDA_VISIBLE_DEVICES
    and the like); P2P turned off by the workload (parallelism.p2p = false) shows as NCCL_P2P_DISABLE=1."""


@attrs.frozen
class WeightClass:
    """The weights of one module class held in one storage format, as the model ran (QLoRA's quantized matrices and
    the weights kept in a float dtype): what a reader needs to know which parts a quantized run quantized."""

    module_class: str
    """The breakdown's module class (llmadapt.adapter.breakdown): 'attention.qkv', 'moe.experts', 'embedding', ..."""
    format: str
    """'nf4', 'fp4', 'int8' (bitsandbytes), or the float dtype held: 'bf16', 'fp16', 'fp32'."""
    tensors: int
    params: int
    """Parameters (elements) of the weights, unquantized."""
    stored_bytes: int
    """Bytes the weights take as stored, quantization state (scales, code tables) included."""
    unquantized_bytes: int
    """Bytes the same weights take unquantized: a quantized weight at the dtype it was loaded in, a float weight as
    held (equal to stored_bytes)."""


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
    topology: Topology | None = None
    """How the rank's device connects to the others (training workers); None where not measured."""
    notes: list[str] = attrs.field(factory=list)
    """What the adapter saw of how the framework ran that a reader of the figures must know and no patch stands
    for, one line each: e.g. a model's slow path, where its fused kernels are not installed."""
    model_source: ModelSource | None = None
    """The file the weights were converted from (a GGUF: its hash, quantization, dequantized); None for a model
    folder or a preset's canonical checkpoint, which the stacks load as they are."""
    weights: list[WeightClass] = attrs.field(factory=list)
    """Training workers whose adapter reports it: the model's weights per module class and storage format, after
    loading (before LoRA); empty where not reported."""
    request_source: RequestSource | None = None
    """Serving runs that read a ShareGPT file: its hash and what of it was read; None otherwise."""
    engine_weights: str | None = None
    """Serving: the weights the engine ran, as it says: precision, quantization type and where they came from
    ('GGUF Q4_1 as shipped (model.gguf)', 'GGUF Q8_0 written from the fp32 folder', 'fp32'); None before 1.20."""
    schema_version: str = SCHEMA_VERSION
    type: Literal["header"] = "header"

    @classmethod
    def starting_now(cls, **fields: Any) -> Header:
        """The header of a process that starts measuring now: its start time and clock anchors read here,
        together, and its node named as every record names it."""
        wall, mono = time.time_ns(), time.monotonic_ns()
        fields.setdefault("node", node_name())
        return cls(**fields, start_time=utc_now(), wall_anchor_ns=wall, mono_anchor_ns=mono)


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
    """MoE: per layer, tokens whose k-th and (k+1)-th router logits were within fp noise (llmadapt.adapter.moe):
    another stack may route these differently and be equally right."""
    profiled: bool = False
    """Run under the profiler (workload.profile.steps): slower by the profiler's cost, left out of step statistics."""
    run_delay_s: float | None = None
    """Of the step, the time the rank's training thread was runnable but waiting for a core (Linux's schedstat
    run delay, read before and after the clock); None where not known."""
    grad_norm: float | None = None
    """Global L2 norm of the gradients the optimizer step received (every rank's shard, the framework's own
    reduction); None where the adapter does not report one."""
    sample_length_squares: int | None = None
    """Sum over this rank's samples of their real length squared: each token attends within its own sample, so
    sample_length_squares / tokens is the context the FLOP count's attention term takes (llmadapt.contract.flops);
    None in records written before 1.12."""
    type: Literal["step"] = "step"


@attrs.frozen
class ClassTime:
    """Time of one module or operator class within a profiled step (seconds on the breakdown's basis)."""

    name: str
    seconds: float
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    count: int = 0
    """Operators counted into it."""
    flops: float | None = None
    """Operator classes: FLOPs the profiler computed from shapes (it counts mm, addmm, bmm, baddbmm, mul, add)."""


@attrs.frozen
class LayerTime:
    """One transformer block's forward and backward time within a profiled step."""

    layer: int
    forward_seconds: float
    backward_seconds: float


@attrs.frozen
class Collective:
    """One kind of collective within a profiled step on one rank, as the communication backend ran it.

    ``seconds`` sums the backend's own spans (gloo's worker threads on CPU, NCCL kernels on GPU): the time the
    collectives took, overlapped with computation or not. Bytes follow nccl-tests: the larger of the input and
    output message (all-gather: the gathered size; reduce-scatter: the input), bandwidths from ``bandwidths``."""

    kind: str
    """all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send_recv or other_collective."""
    count: int
    seconds: float
    bytes: int | None = None
    """Message bytes summed over the calls; None where the profiler gave no shapes (level module)."""
    algbw_gbytes_per_s: float | None = None
    busbw_gbytes_per_s: float | None = None
    backend: str = ""
    """gloo or nccl."""
    algorithm: str | None = None
    """As the backend names it: NCCL's kernel names carry it (RING_LL, TREE_SIMPLE); gloo's all-reduce is its
    ring; None where nothing says."""
    group_size: int | None = None
    """The ranks of the collective's group (the n of the bus-bandwidth factor): NCCL's arguments say it; for
    gloo, whose spans do not, the world size."""


@attrs.frozen
class Breakdown:
    """Where one profiled step's time went on one rank (workload.profile; docs/breakdown.md), by module class
    (llmadapt.adapter.breakdown.MODULE_CLASSES), by layer, by collective and, at level operator or full, by
    operator class.

    On the CPU basis the module classes add up to the step: the time of the threads that run the step (the
    loop's and the autograd engine's); the communication backend's own threads are in ``collectives`` and the
    overlap fields. Their definitions are Holistic Trace Analysis's: ``compute_seconds + exposed_comm_seconds +
    idle_seconds`` is the step; the overlap is the share of communication time during which computation ran."""

    rank: int
    step: int
    level: str
    basis: str
    """'cpu': self CPU time of every profiled operator and range; 'device': GPU kernel time of what each launched."""
    step_seconds: float
    """The profiled step's wall time, as the profiler saw it (the step record has the core's clock)."""
    modules: list[ClassTime] = attrs.Factory(list)
    layers: list[LayerTime] = attrs.Factory(list)
    operators: list[ClassTime] = attrs.Factory(list)
    other: list[ClassTime] = attrs.Factory(list)
    """What 'other' holds: the profiled events with most time no class claims (at most 8; "the step's own code
    between operators (ProfilerStep*)" is the own time of the core's range around the step: the adapter's Python
    between operators, the profiler's own cost there, and waits for a core, which ``descheduled_seconds`` bounds)."""
    other_operators: list[ClassTime] = attrs.Factory(list)
    """What the operator class 'other' holds: the events with most time no operator class claims (at most 8)."""
    module_operators: list[ClassTime] = attrs.Factory(list)
    """Level operator or full: each module class's time by operator class, named 'module/operator'
    ('attention.softmax/softmax', 'moe.experts/gemm'); on a GPU by the class of the operator that launched the
    kernels."""
    collectives: list[Collective] = attrs.Factory(list)
    comm_seconds: float = 0.0
    """Wall time during which at least one collective ran (the union of their spans)."""
    overlapped_comm_seconds: float = 0.0
    """Of comm_seconds, the time during which computation ran too (hidden communication)."""
    compute_seconds: float = 0.0
    """Wall time during which computation ran (the union of compute operators' spans, or kernels' on GPU)."""
    idle_seconds: float = 0.0
    """The step's time with no activity: Python, waits, launch gaps (on GPU: no kernel, copy or set running)."""
    memory_seconds: float = 0.0
    """On GPU: wall time during which a copy or a set ran (memcpy, memset); 0 on CPU, where copies are operators."""
    kernel_types: list[ClassTime] = attrs.Factory(list)
    """On GPU: the step's busy time split as Holistic Trace Analysis's kernel-type breakdown splits it, by which
    of computation, communication and memory ran ('computation+communication': both, no copy)."""
    descheduled_seconds: float | None = None
    """Of the step, the time its thread waited for a core (Linux's run delay, /proc/thread-self/schedstat): on a
    busy machine the profiler counts it in whatever the thread was in, mostly 'other'. None where not known."""
    trace: str | None = None
    """Level full: the profiler's timeline of this step and rank (Kineto JSON), relative to the run folder; one
    folder per step holds every rank's, as Holistic Trace Analysis reads them."""
    error: str | None = None
    """Profiling failed (the step and the run stand): what went wrong."""
    source: str = "torch.profiler"
    type: Literal["breakdown"] = "breakdown"

    @property
    def exposed_comm_seconds(self) -> float:
        return self.comm_seconds - self.overlapped_comm_seconds


@attrs.frozen
class Telemetry:
    """One background sample of the hardware a rank runs on (llmadapt.runtime.telemetry). A field is None where
    its source cannot measure it here (no NVML device on a CPU run): never a zero that was not measured."""

    rank: int
    time_ns: int
    """This process's monotonic clock."""
    source: str
    """'procfs' (this process: CPU and memory), or 'procfs+nvml' (also the rank's GPU through NVML)."""
    cpu_percent: float | None = None
    """This process's CPU time over the interval since the previous sample, in percent of one core."""
    rss_bytes: int | None = None
    gpu_util_percent: float | None = None
    """NVML: share of the interval during which a kernel ran on the GPU."""
    gpu_memory_util_percent: float | None = None
    """NVML: share of the interval during which device memory was read or written."""
    gpu_memory_used_bytes: int | None = None
    power_w: float | None = None
    energy_j: float | None = None
    """The GPU's energy since the sampler started (NVML's total energy counter)."""
    unavailable: list[str] = attrs.Factory(list)
    """The first sample of a rank: what its sources cannot measure here, and why."""
    type: Literal["telemetry"] = "telemetry"


@attrs.frozen
class Interference:
    """What ran beside one rank while it measured its steps (llmadapt.runtime.interference): read as its first
    measured step started and after its last. A field is None where this machine cannot say."""

    rank: int
    node: str
    window_s: float
    """From the first measured step's start to the last one's end (profiled steps included), this rank's clock."""
    cores: int | None
    """The cores this rank may run on."""
    threads: int | None
    """The rank's intra-op threads (torch, OpenMP)."""
    load_start: float | None
    load_end: float | None
    """The machine's one-minute load average."""
    machine_busy_cpu_s: float | None
    """CPU time the whole machine spent outside idle over the window, every process (/proc/stat)."""
    own_cpu_s: float | None
    """This rank's process's CPU time over the window."""
    run_delay_s: float | None
    """Time this rank's threads were runnable but waiting for a core, summed over its threads (schedstat): over
    several threads it can exceed the window."""
    steal_s: float | None
    """CPU time a hypervisor gave to other guests (a VM's steal)."""
    gpu_other_processes: int | None = None
    """Other processes with a context on this rank's GPU (NVML)."""
    gpu_throttle_reasons: list[str] | None = None
    """Why NVML says the GPU ran below its clocks at either end (power cap, thermal, hardware slowdown, ...)."""
    gpu_temperature_c: float | None = None
    gpu_power_limit_w: float | None = None
    gpu_sm_clock_mhz: float | None = None
    run_delay_threads: int | None = None
    """How many threads ``run_delay_s`` sums (those alive at the window's end), each waiting at most the window:
    the share of thread-time spent waiting is run_delay_s over window_s times this. None in records before 1.16."""
    type: Literal["interference"] = "interference"


@attrs.frozen
class InterferenceSummary:
    """Whether the machine was quiet during the measured steps, and if not, what disturbed them."""

    quiet: bool | None
    """None: not judged (every measured window too short to count other processes' CPU, nothing else found)."""
    causes: list[str]
    """One line per cause found, with its measure ('other processes used 1.4 of 2 cores'); empty when quiet."""
    other_cpu_cores: float | None
    """Cores other processes kept busy on average over the window (the machine's busy CPU time less the ranks'),
    the largest over nodes."""
    run_delay_share: float | None
    """The largest share of a rank's thread-time spent waiting for a core: run delay over window x the threads it
    sums (at most 1). Reported, not judged: other processes raise it, and so does a run with more threads than
    cores."""
    steal_share: float | None
    load_start: float | None
    load_end: float | None
    gpu_other_processes: int | None = None
    gpu_throttle_reasons: list[str] = attrs.Factory(list)
    step_wait_share_median: float | None = None
    """Per measured step, the share of it the rank's training thread waited for a core (the step's run_delay_s over
    its seconds, at most 1: the delay is read just outside the step's clock, which keeps the reads out of the
    step's time, so a wait between a read and the clock counts in the delay, not in the step): the median and the
    largest over every rank's steps. Reported, not judged."""
    step_wait_share_max: float | None = None


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
    status: Literal["ok", "error", "timeout", "cancelled", "truncated"]
    """'truncated': the stream ended without the engine's end marker (OpenAI-style: a finish reason, and
    ``data: [DONE]`` where the protocol always sends it; TGI: its last event), so the response may be cut short;
    out of goodput like any failure."""
    error: str | None = None
    error_cause: str | None = None
    """http_429, http_4xx, http_5xx, in_band, malformed, truncated, connection, timeout, engine_dead, cancelled."""
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
class Evaluation:
    """The model as trained after ``step`` steps (0: before training) on the held-out examples (workload.eval),
    written by rank 0. Computed by llmadapt's own code on the trained weights the stack saved
    (llmadapt.runtime.evaluation): the same tokens, order and arithmetic whatever the stack."""

    rank: int
    step: int
    examples: int
    tokens: int
    """Scored tokens: the answers' (with their end-of-sequence token), or every token of synthetic samples."""
    loss: float
    """Mean negative log-likelihood per scored token (nats)."""
    perplexity: float
    token_accuracy: float
    """Share of scored tokens that are the model's most likely next token given the true tokens before them."""
    exact_match: float | None
    """Share of examples whose whole answer is that: what greedy decoding would generate, up to its end token.
    None for synthetic data (no answers)."""
    choice_accuracy: float | None
    """Multiple choice (examples with ``choices``): share where the right choice has the highest log-likelihood."""
    seconds: float
    """Gathering and writing the trained model, loading it and the forward passes."""
    expert_load: list[list[int]] | None = None
    """MoE models: tokens per expert per layer over the examples' real tokens (padding left out)."""
    expert_near_ties: list[int] | None = None
    """Per layer, tokens routed by a near-tie (llmadapt.adapter.moe): where two stacks' loads may differ."""
    split: str | None = None
    """How the held-out examples were chosen (the file's last rows, eval.path, or eval.share's content-hash rule);
    None for synthetic data."""
    split_counts: dict[str, int] | None = None
    """The split's counts: train, held_out, evaluated; for conversations also without_exchange (no human/gpt
    exchange to train on) and held_out_too_long (held out, but no answer token within train.seq_len)."""
    type: Literal["evaluation"] = "evaluation"


@attrs.frozen
class Quality:
    """Quality beside speed (serve.quality; llmadapt.runtime.quality): after the measured requests, fixed held-out
    texts sent to the engine greedily, scored against transformers' fp32 decoding of the same checkpoint (the
    reference). Log-probability figures come from the engine's top-k log-probabilities (None where it returns
    none): the mass outside its top-k is lumped into one bucket, so ``kl_mean`` is a lower bound of the true KL."""

    texts: int
    reference: str
    """What the engine was scored against ('transformers 5.0.0 fp32')."""
    identical: int
    """Greedy responses identical to the reference's (texts compared without U+FFFD)."""
    identical_share: float
    first_divergence_median: float | None
    """Of the responses that differ: the median index of the first token (the reference tokenizer's tokens of
    the two texts) where they part; None when none differ."""
    output_tokens_mean: float | None
    """The engine's greedy responses' tokens (its usage), mean; the engine may stop at end-of-sequence."""
    reference_output_tokens_mean: float
    positions: int = 0
    """Held-out text positions scored with log-probabilities (0 where the engine returned none)."""
    top_logprobs: int = 0
    same_top_share: float | None = None
    """Share of positions whose most likely next token is the reference's."""
    kl_mean: float | None = None
    """Mean KL(reference || engine) per position (nats), over the engine's top-k tokens plus one bucket for the
    rest: a lower bound of the full KL."""
    perplexity: float | None = None
    """The engine's perplexity of the held-out texts (its log-probability of each true next token)."""
    reference_perplexity: float | None = None
    note: str | None = None
    """Why a figure is missing (an engine that returns no log-probabilities, texts it tokenized differently)."""
    seconds: float = 0.0
    gate_min_share: float = 0.99
    gate_output_tolerance: float = 0.10
    """The gate the run was asked to judge by (serve.quality.min_share, output_tolerance; analysis.verdict)."""
    type: Literal["quality"] = "quality"


@attrs.frozen
class Failure:
    """Why a rank, a worker or the run stopped early. Written by the worker when it can, else by the launcher."""

    cause: Literal["error", "crash", "killed", "timeout", "oom", "interrupted", "unsupported", "diverged"]
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
    prefix_cache_metrics: list[str] | None = None
    """The engine's prefix-cache counters among the server samples, [tokens found, tokens looked up], if it has them."""
    stream_prefix_share: float | None = None
    """Of the measured requests' prompt tokens, the share that repeats the start of an earlier prompt of the stream:
    what a prefix cache of unlimited size, reusing any number of tokens, would find."""
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
    """True when the client measured correctly and at least one measured request completed; False when the
    generator fell behind its schedule, or every request failed (see validity)."""
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
    tokens_per_chunk: float | None = None
    """Output tokens over streamed chunks, for responses whose token count is known: above 1, the engine sent
    several tokens in a chunk, so ITL there is per chunk, not per token (None: no such response)."""
    stream_prefix_share: float | None = None
    """Of the measured prompts' tokens, the share that repeats the start of an earlier prompt (ClientLoad's)."""
    engine_prefix_cache_hit_share: float | None = None
    """The engine's prefix-cache hits over its lookups, in tokens, between the first and last scrape of the run
    (vLLM's prefix_cache_hits / prefix_cache_queries; None: the engine reports none). It finds whole KV blocks only,
    so it stays below stream_prefix_share."""
    output_tokens: Stats | None = None
    """Output tokens per completed request (None in older traces). Forced (output_length_forced), they are the
    lengths asked; otherwise the lengths the engine chose, each at most the one asked (the cap)."""
    stopped_at_eos_share: float | None = None
    """Of the completed requests whose end is known, the share that ended before the cap: at end-of-sequence (or a
    stop the engine applies); None where no end is known."""
    hit_cap_share: float | None = None
    """Of the same requests, the share that ended at the cap (max_tokens: the length asked). The two add to 1."""


@attrs.frozen
class BreakdownSummary:
    """The profiled steps of a run: each figure is the mean over profiled steps and ranks (Breakdown's fields)."""

    level: str
    basis: str
    profiled_steps: int
    step_seconds: float
    modules: list[ClassTime]
    layers: list[LayerTime]
    operators: list[ClassTime]
    collectives: list[Collective]
    comm_seconds: float
    overlapped_comm_seconds: float
    compute_seconds: float
    idle_seconds: float
    gemm_flops_per_s: float | None
    """GEMM FLOPs (from the profiler's shapes) over GEMM time, per rank: set it against `llmadapt micro peak`."""
    errors: list[str] = attrs.Factory(list)
    """Profiling failures (rank, step: what), each leaving its step and the run intact."""
    memory_seconds: float = 0.0
    kernel_types: list[ClassTime] = attrs.Factory(list)
    module_operators: list[ClassTime] = attrs.Factory(list)


@attrs.frozen
class ExpertImbalance:
    """How unevenly one MoE layer's router spread tokens over its experts: per measured step, the coefficient of
    variation (population std over mean of tokens per expert: 0 is perfectly even), the most loaded expert over the
    mean, and the experts that received no token; here their mean and worst over the steps."""

    layer: int
    cv: float
    cv_max: float
    max_over_mean: float
    max_over_mean_max: float
    idle_experts: float
    idle_experts_max: int


@attrs.frozen
class TelemetrySummary:
    """The background samples of a run, per rank, and the energy of its measured steps where a GPU reports it."""

    source: str
    samples: int
    interval_s: float
    cpu_percent_per_rank: list[float | None]
    """Mean over the samples, in percent of one core."""
    peak_rss_bytes_per_rank: list[int | None]
    gpu_util_percent_per_rank: list[float | None]
    power_w_per_rank: list[float | None]
    energy_j: float | None
    """Over the measured steps (profiled ones included), summed over ranks."""
    joules_per_token: float | None
    unavailable: list[str] = attrs.Factory(list)
    """What could not be measured here, and why (e.g. no NVML device on a CPU run)."""


@attrs.frozen
class Summary:
    """The run's aggregate, computed by the orchestrator from every rank's records."""

    run_id: str
    status: Literal["ok", "failed", "diverged", "degraded"]
    """'diverged': a loss or gradient norm was NaN or infinite (the failures name the first step and rank).
    'degraded' (serving): the run measured, but a larger share of its requests failed or were truncated than
    serve.max_failed_share allows (default 0: any)."""
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
    """PaLM convention (see llmadapt.contract.flops)."""
    achieved_flops_per_s: float | None
    mfu: float | None
    """None where the device peak is unknown (e.g. CPUs). LoRA counts the frozen base without weight gradients; a
    quantized base counts as the dense math at the workload's precision (llmadapt.contract.flops)."""
    phase_means_s: dict[str, float]
    """Mean over measured steps and ranks, per 'source:name'."""
    failures: list[Failure]
    serving: ServingStats | None = None
    """Serving runs only: client-side latency, throughput and goodput."""
    warnings: list[str] = attrs.field(factory=list)
    """What cost no measurement but a reader must know, e.g. a rank that died in teardown after its last record."""
    breakdown: BreakdownSummary | None = None
    """Profiled runs (workload.profile): where the profiled steps' time went."""
    expert_imbalance: list[ExpertImbalance] | None = None
    """MoE runs: per layer, how unevenly the router spread tokens over the experts in the measured steps."""
    telemetry: TelemetrySummary | None = None
    """What the background sampler saw (workload.telemetry)."""
    evaluations: list[Evaluation] | None = None
    """Runs with workload.eval: the held-out figures before training, every eval.every steps and after, by step."""
    hardware_flops_per_token: float | None = None
    """model_flops_per_token plus the forward that recomputation runs again (llmadapt.contract.flops)."""
    hfu: float | None = None
    """Hardware FLOPs utilisation: MFU with recomputation counted; None where MFU is."""
    interference: InterferenceSummary | None = None
    """Training runs: whether the machine was quiet while the steps were measured, and what disturbed them."""
    grad_norms: list[float | None] | None = None
    """Training runs whose adapter reports it: the global gradient norm at every completed step, by step index."""
    measured_by: str | None = None
    """The tool that measured the run where it was not llmadapt ('vllm bench serve 0.32.0', 'AIPerf 0.13.0'): a
    serving result imported from that tool's file (llmadapt.contract.foreign); None: measured by llmadapt."""
    notes: list[str] = attrs.field(factory=list)
    """Every rank header's notes, once each (e.g. a model's slow path)."""
    weights: list[WeightClass] = attrs.field(factory=list)
    """Rank 0's header's weights: per module class, the format the model held them in (quantized or not)."""
    topology: Topology | None = None
    """Rank 0's topology (its header's): the interconnect, NUMA nodes, cores and threads, communication settings;
    each rank's own is in its header. None before schema 1.15, or where no header recorded one."""
    quality: Quality | None = None
    """Serving runs with serve.quality: the held-out texts' figures against the fp32 reference."""
    engine_weights: str | None = None
    """Serving: rank 0's header's engine_weights (precision, quantization type, where the weights came from)."""
    schema_version: str = SCHEMA_VERSION
    type: Literal["summary"] = "summary"
