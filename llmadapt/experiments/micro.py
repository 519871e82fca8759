"""Micro-benchmarks: operators with a workload's shapes, device peaks, collectives (orchestrator side).

Each suite is a worker of kind ``micro``, started through launch (``llmadapt.launch.runner.run_micro``) in the
core's tools environment (the orchestrator never imports torch): one process for ``ops`` and ``peak``,
torchrun with N ranks (gloo on CPU, NCCL on GPU, 127.0.0.1, a free port) for ``comm``. The worker streams contract records to ``RUN_DIR/rank-NNNNN.jsonl``:

- ``op_bench`` per operator, direction and backend (time statistics, raw times, FLOPs, bytes);
- ``metric`` for each measured peak (``peak.flops_per_s.<dtype>``, ``peak.memory_bytes_per_s``);
- ``comm`` per collective and message size (algbw and busbw with the nccl-tests factors);
- ``failure`` when something stops the worker.

``llmadapt.analysis.perf.micro.read_micro(run_dir)`` rebuilds the result (and the roofline position of every
operator) from those records; ``micro.json`` is a convenience copy.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.analysis.perf.micro import MicroResult, read_micro
from llmadapt.analysis.perf.opmodel import DTYPE_BYTES, Op, attention_ops, layer_ops
from llmadapt.contract.catalog import save_device, today
from llmadapt.contract.launch import CommSpec, MicroSpec, OpCost, OpSpec, PeakSpec, Timing
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.launch.runner import run_micro
from llmadapt.spec import Workload

OPS = ("qkv", "output", "fc1", "fc2", "lm_head", "attention", "rmsnorm", "rotary", "swiglu", "moe_router",
       "moe_dispatch", "cross_entropy")


ATTENTION_BACKENDS = ("eager", "math", "flash", "efficient", "cudnn")


COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


DEFAULT_SIZES = tuple(1 << k for k in range(10, 25, 2))  # 1 KiB .. 16 MiB, x4


# operator calls each micro implementation makes (forward, backward): fits the per-call overhead
MICRO_LAUNCHES = {"gemm": (1, 2), "moe_router": (7, 6), "rmsnorm": (7, 10), "rotary": (12, 12), "swiglu": (2, 4),
                  "cross_entropy": (3, 4), "eager": (10, 10), "sdpa": (1, 1)}


# -- operator specs from a workload -----------------------------------------------------------------
def _cost(op: Op, micro: tuple[int, int], extra_flops: float = 0.0, extra_bytes: float = 0.0) -> dict[str, OpCost]:
    return {"forward": OpCost(op.fwd_flops + extra_flops, op.fwd_bytes + extra_bytes, micro[0]),
            "backward": OpCost(op.bwd_flops + extra_flops, op.bwd_bytes + extra_bytes, micro[1])}


def op_specs(workload: Workload, *, dtype: str | None = None, ops: tuple[str, ...] | list[str] | None = None,
             backward: bool = True, backends: tuple[str, ...] = ATTENTION_BACKENDS) -> list[OpSpec]:
    """The operators of one micro-batch of the workload, with shapes, FLOPs and bytes from llmadapt.analysis.perf.opmodel."""
    w = workload
    if dtype and dtype != w.precision:
        if dtype not in DTYPE_BYTES:
            raise LlmadaptError(f"dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
        w = w.with_overrides([f"precision={dtype}"])
    wanted = list(ops or OPS)
    unknown = [o for o in wanted if o not in OPS]
    if unknown:
        raise LlmadaptError(f"unknown operator {unknown[0]!r}; known: {', '.join(OPS)}")
    m = w.model
    b, s = w.micro_batch, w.train.seq_len
    t = b * s
    e = DTYPE_BYTES[w.precision]
    model_ops: dict[str, Op] = {}
    for op in layer_ops(w, b):
        model_ops.setdefault(op.name, op)
    trainable = not w.lora.rank
    directions = ["forward", "backward"] if backward else ["forward"]
    specs: list[OpSpec] = []

    def add(name: str, kind: str, shape: dict[str, int], cost: dict[str, OpCost], **extra: Any) -> None:
        specs.append(OpSpec(op=name, kind=kind, dtype=w.precision, shape=shape, cost=cost, directions=directions,
                            **extra))

    for name in wanted:
        if name in ("moe_router", "moe_dispatch") and not m.is_moe:
            continue
        op = model_ops.get(name)
        if name in ("qkv", "output", "fc1", "fc2", "lm_head"):
            add(name, "gemm", dict(op.shape), _cost(op, MICRO_LAUNCHES["gemm"] if trainable else (1, 1)),
                trainable=trainable)
        elif name == "moe_router":
            # + fp32 softmax, top-k and renormalisation over t x experts
            cost = _cost(op, MICRO_LAUNCHES["moe_router"], 5.0 * t * m.num_experts, 4.0 * t * m.num_experts * 4)
            add(name, "gemm", dict(op.shape), cost, extra={"k": m.experts_per_token}, trainable=trainable)
        elif name == "attention":
            for backend in backends:
                flash = backend not in ("eager", "math")
                variant = w.with_overrides([f"optimizations.flash_attention={'true' if flash else 'false'}"])
                a = attention_ops(variant, b, e, 1, w.precision)
                add(name, "attention", {"b": b, "heads": m.num_heads, "kv_heads": m.num_kv_heads, "s": s,
                                        "d": m.head_dim}, _cost(a, MICRO_LAUNCHES["eager" if backend == "eager"
                                                                                  else "sdpa"]), backend=backend)
        elif name == "rotary":
            add(name, "memory", {"b": b, "s": s, "heads": m.num_heads, "kv_heads": m.num_kv_heads, "d": m.head_dim},
                _cost(op, MICRO_LAUNCHES["rotary"]))
        elif name == "moe_dispatch":
            hit = min(m.num_experts, t * m.experts_per_token)
            add(name, "memory", {"t": t, "h": m.hidden_size, "experts": m.num_experts, "k": m.experts_per_token},
                _cost(op, (4 + 5 * hit, 4 * hit)))
        else:  # rmsnorm, swiglu, cross_entropy
            shape = dict(op.shape)
            if name == "swiglu" and m.is_moe:
                shape = {"t": t * m.experts_per_token // m.num_experts or 1, "i": m.intermediate_size}
            add(name, "memory", shape, _cost(op, MICRO_LAUNCHES[name]))
    return specs


# -- running a suite ------------------------------------------------------------------------------
def _start(suite: str, spec: MicroSpec, out: str | Path, world: int = 1, timeout: float | None = None,
           progress: Callable[[dict[str, Any]], None] | None = None, workload: Workload | None = None) -> MicroResult:
    """The suite run through launch (a worker of kind micro), read back, and kept as micro.json beside its
    records."""
    run_dir = run_micro(suite, spec, workload, world=world, out=out, timeout=timeout, progress=progress)
    result = read_micro(run_dir)
    RunDir(run_dir).micro_file.write_text(json.dumps(result.to_dict(), indent=2))
    return result


def micro_ops(workload: Workload | str | Path, *, dtype: str | None = None, ops: list[str] | None = None,
              backward: bool = True, peak: bool | dict[str, Any] = True, timing: dict[str, float] | None = None,
              out: str | Path = "runs", timeout: float | None = None,
              progress: Callable[[dict[str, Any]], None] | None = None) -> MicroResult:
    """Benchmark the workload's operators (forward and backward) and place each on the measured roofline."""
    w = workload if isinstance(workload, Workload) else Workload.from_file(workload)
    if w.kind == "serve":
        raise LlmadaptError("micro ops takes a training or fine-tuning workload (its shapes come from train.seq_len "
                            "and the micro-batch)")
    specs = op_specs(w, dtype=dtype, ops=ops, backward=backward)
    if not specs:
        raise LlmadaptError(f"none of the operators {', '.join(ops or [])} exists in this model")
    peak_spec = None
    if peak:  # the peaks of the dtype the operators run in (True), or given options (a dict)
        peak_spec = attrs.evolve(PeakSpec(), **{"dtypes": [specs[0].dtype], **(peak if isinstance(peak, dict) else {})})
    spec = MicroSpec(ops=specs, timing=attrs.evolve(Timing(), **(timing or {})), peak=peak_spec)
    return _start("ops", spec, out, 1, timeout, progress, w)


def micro_peak(*, dtypes: list[str] | None = None, timing: dict[str, float] | None = None,
               gemm_sizes: list[int] | None = None, copy_bytes: int | None = None, out: str | Path = "runs",
               timeout: float | None = None, progress=None) -> MicroResult:
    """Measure the device's peaks: best GEMM FLOP/s per dtype, memory bandwidth (copy)."""
    for d in dtypes or []:
        if d not in ("fp32", "tf32", "bf16", "fp16"):
            raise LlmadaptError(f"dtype {d!r}: use fp32, tf32, bf16 or fp16")
    peak = PeakSpec(dtypes=dtypes)
    if gemm_sizes:
        peak = attrs.evolve(peak, gemm_sizes_cpu=list(gemm_sizes), gemm_sizes_gpu=list(gemm_sizes))
    if copy_bytes:
        peak = attrs.evolve(peak, copy_bytes_cpu=int(copy_bytes), copy_bytes_gpu=int(copy_bytes))
    spec = MicroSpec(peak=peak, timing=attrs.evolve(Timing(), **(timing or {})))
    return _start("peak", spec, out, 1, timeout, progress)


def micro_comm(*, ranks: int = 2, ops: list[str] | None = None, sizes: list[int] | None = None, iters: int = 5,
               warmup: int = 2, out: str | Path = "runs", timeout: float | None = None, progress=None) -> MicroResult:
    """Collectives over message sizes across ``ranks`` processes (gloo on CPU, NCCL on GPU)."""
    if ranks < 2:
        raise LlmadaptError(f"--ranks {ranks}: collectives need at least 2 ranks")
    wanted = list(ops or COMM_OPS)
    unknown = [o for o in wanted if o not in COMM_OPS]
    if unknown:
        raise LlmadaptError(f"unknown collective {unknown[0]!r}; known: {', '.join(COMM_OPS)}")
    if iters < 1:
        raise LlmadaptError("--iters must be >= 1")
    spec = MicroSpec(comm=CommSpec(ops=wanted, sizes=list(sizes or DEFAULT_SIZES), iters=iters, warmup=warmup))
    return _start("comm", spec, out, ranks, timeout, progress)


def parse_size(text: str) -> int:
    """'4K', '16MiB', '1G', '2.5GiB', '1048576' -> bytes (binary multiples)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in "KMGT" else t
    try:
        value = float(number)
    except ValueError:
        raise LlmadaptError(f"size {text!r}: use a number of bytes, optionally with K, M, G (binary), e.g. 16M")
    if value <= 0:
        raise LlmadaptError(f"size {text!r} must be positive")
    return int(value * mult)


def parse_sizes(text: str) -> list[int]:
    """'1K..16M' (x4 steps, or '1K..16M:x2'), or a comma list '1K,64K,1M'."""
    if ".." in text:
        span, _, step = text.partition(":")
        lo, _, hi = span.partition("..")
        factor = int(step.lstrip("xX")) if step else 4
        if factor < 2:
            raise LlmadaptError(f"sizes {text!r}: the step must be x2 or more")
        a, b = parse_size(lo), parse_size(hi)
        out = []
        while a <= b:
            out.append(a)
            a *= factor
        return out
    return [parse_size(s) for s in text.split(",") if s.strip()]


# -- describing a device by measurement -----------------------------------------------------------------
def save_measured_device(name: str, result: MicroResult, *, price_per_hour: float | None = None,
                         path: str | Path | None = None) -> Path:
    """Write (or update) a catalog entry from measured peaks (micro peak/ops) or bandwidth (micro comm)."""
    if result.status != "ok":
        raise LlmadaptError(f"{result.run_dir}: the measurement failed; nothing saved")
    host = socket.gethostname()
    src = {"ref": f"measured by llmadapt micro {result.suite} on {host} ({result.run_dir})", "date": today()}
    fields: dict[str, Any] = {"sources": {}}
    if result.suite == "comm":
        busbw = [c["busbw_gbytes_per_s"] for c in result.comm if c["op"] == "all_reduce"]
        if not busbw:
            raise LlmadaptError(f"{result.run_dir} measured no all_reduce: nothing to save as the interconnect")
        fields["interconnect"] = f"measured all_reduce busbw ({result.world_size} ranks)"
        fields["interconnect_bandwidth"] = max(busbw) * 1e9
        fields["sources"]["interconnect_bandwidth"] = src
    else:
        flops = {k.removeprefix("flops_per_s."): v for k, v in result.peaks.items() if k.startswith("flops_per_s.")}
        if not flops or "memory_bytes_per_s" not in result.peaks:
            raise LlmadaptError(f"{result.run_dir} has no measured peaks (run `llmadapt micro peak`)")
        kind = "cpu" if result.device_kind == "cpu" else "gpu"
        fields.update(kind=kind, description=f"{result.device_name} (measured)", measured=True,
                      match=[result.device_name] if result.device_name else [], peak_flops=flops,
                      memory_bandwidth=result.peaks["memory_bytes_per_s"], shared_by_ranks=kind == "cpu")
        if result.device_memory_bytes:
            fields["memory_bytes"] = float(result.device_memory_bytes)
            fields["sources"]["memory_bytes"] = {"ref": f"reported by the device on {host}", "date": today()}
        fields["sources"]["peak_flops"] = fields["sources"]["memory_bandwidth"] = src
    if price_per_hour is not None:
        fields["price_per_hour"] = price_per_hour
        fields["sources"]["price_per_hour"] = {"ref": "given by the user (--price)", "date": today()}
    return save_device(name, fields, path)


__all__ = ["MicroResult", "micro_ops", "micro_peak", "micro_comm", "read_micro", "op_specs", "save_measured_device",
           "parse_size", "parse_sizes"]
