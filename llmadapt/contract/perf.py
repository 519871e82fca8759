"""Records of the performance tools (estimate, calibration, validation, max-batch search, operator
benchmarks): written by ``llmadapt estimate``, ``maxbatch`` and ``micro``, validated by the same schema.
"""

from __future__ import annotations

from typing import Literal

import attrs

from llmadapt.contract.records import Stats


# -- micro-benchmarks, the analytical model, Study B's fits, max batch search (issue 7) ----------
@attrs.frozen
class OpBench:
    """One operator micro-benchmark (``llmadapt micro ops`` / ``micro peak``): one shape, one direction, one dtype.

    ``flops`` and ``bytes`` are per call, from llmadapt.analysis.perf.opmodel (hardware FLOPs; bytes the
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
    """PaLM convention (llmadapt.contract.flops), all ranks."""
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
