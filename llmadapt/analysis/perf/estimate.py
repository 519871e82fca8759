"""The analytical performance and cost model: memory per rank, FLOPs, step time, max batch, cost.

``estimate(workload, device)`` predicts, per rank: memory (weights, gradients, optimizer
states by ZeRO stage and offload, activations by recomputation and FlashAttention, LoRA and
quantization, KV cache for serving), FLOPs per step, step time and tokens/s from a roofline
over the operators of llmadapt.analysis.perf.opmodel, the largest micro-batch that fits, and the cost.

Time model. Each operator call takes ``max(F / (P * eta_compute), B / (W * eta_memory)) +
launches * op_overhead_s`` (P: the device's peak FLOP/s for the precision, W: its memory
bandwidth); a step is ``step_overhead_s + (micro-batches + pp - 1) x (forward + backward
[+ recomputed forward]) + gradient accumulation + optimizer + communication / eta_comm``.
The four efficiency factors are the model's only free parameters: defaults are stated, and
``calibrate`` fits them to micro-benchmarks or measured runs; ``validate`` measures the error.

Pure Python: no torch, no numpy.

Size: over 400 lines because the memory and time formulas refer to each other (activations, ZeRO
shards, overlap) and read best on one page; calibration and rendering live in their own modules.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs

from llmadapt.analysis.perf.opmodel import DTYPE_BYTES, QUANT_BYTES, layer_ops, lora_params_per_layer, step_ops
from llmadapt.contract.catalog import DeviceSpec, find_device
from llmadapt.contract.flops import CONVENTION, model_flops_per_token
from llmadapt.contract.perf import Estimate, MemoryEstimate
from llmadapt.errors import LlmadaptError, not_a_file
from llmadapt.host import state_dir
from llmadapt.spec import Workload

GIB = 2**30


# Defaults before calibration. GPU: typical large-GEMM efficiency (~60% of dense peak) and
# streaming efficiency (~70% of datasheet bandwidth), ~5 us per operator call (launch +
# dispatcher). CPU: measured peaks already include what the machine can do; small-op overhead
# of an eager PyTorch operator call is tens of microseconds.
DEFAULT_FACTORS = {
    "gpu": {"eta_compute": 0.6, "eta_memory": 0.7, "op_overhead_s": 5e-6, "step_overhead_s": 0.0, "eta_comm": 0.7},
    "cpu": {"eta_compute": 0.5, "eta_memory": 0.5, "op_overhead_s": 2e-5, "step_overhead_s": 0.0, "eta_comm": 0.5},
}


FACTOR_NAMES = ("eta_compute", "eta_memory", "op_overhead_s", "step_overhead_s", "eta_comm")


GPU_RUNTIME_OVERHEAD = 1.0 * GIB  # CUDA context + library workspaces (assumption; calibrate)


CPU_INTERCONNECT = 5e9  # bytes/s between ranks on one host via gloo, until measured (micro comm --save)


DDP_BUCKET_BYTES = 25 * 2**20


@attrs.frozen
class Factors:
    eta_compute: float
    eta_memory: float
    op_overhead_s: float
    step_overhead_s: float = 0.0
    eta_comm: float = 0.7
    runtime_overhead_bytes: float | None = None
    """Fitted from measured runs' peak memory (CPU: a worker's baseline RSS), when available."""
    source: str | None = None

    @classmethod
    def defaults(cls, kind: str) -> Factors:
        return cls(**DEFAULT_FACTORS[kind])

    def as_dict(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in FACTOR_NAMES}
        if self.runtime_overhead_bytes is not None:
            out["runtime_overhead_bytes"] = self.runtime_overhead_bytes
        return out


@attrs.frozen
class Options:
    """Estimate inputs beyond the workload and the device."""

    master_weights: bool | None = None
    """Mixed precision with fp32 master weights and fp32 Adam states (DeepSpeed/Megatron: 16 bytes per
    parameter). None: on when ZeRO is used with bf16/fp16, off otherwise (the reference adapter trains
    bf16 weights directly)."""
    runtime_overhead_bytes: float | None = None
    host_memory_bandwidth: float = 50e9
    """Host memory bandwidth for the CPU-side optimizer under offload (assumption)."""
    price_per_hour: float | None = None
    queries: float | None = None
    epochs: float = 1.0
    comm_overlap: float = 0.0
    """Fraction of gradient communication hidden behind the backward pass (0: none hidden)."""
    check_fit: bool = True
    """Raise when the workload does not fit at batch 1 (one clear line)."""


# -- calibration files ------------------------------------------------------------------------------
def calibration_path(device: str) -> Path:
    return state_dir() / "calibration" / f"{device}.json"


def load_factors(device: DeviceSpec, calibration: str | Path | None = None) -> Factors:
    """Factors for a device: from a calibration file (given, or the device's default one), else the defaults."""
    path = Path(calibration) if calibration else calibration_path(device.name)
    if calibration and not path.is_file():
        raise LlmadaptError(f"calibration file {path}: {not_a_file(path)}")
    if not path.is_file():
        return Factors.defaults(device.kind)
    try:
        data = json.loads(path.read_text())
        coef = {**DEFAULT_FACTORS[device.kind], **data["coefficients"], **data.get("fixed", {})}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise LlmadaptError(f"calibration file {path} is not a fit record: {exc}") from None
    return Factors(**{k: float(coef[k]) for k in FACTOR_NAMES},
                   runtime_overhead_bytes=coef.get("runtime_overhead_bytes"), source=str(path))


# -- parameters and memory --------------------------------------------------------------------------
@attrs.frozen
class Params:
    """Parameters held by one rank (before ZeRO sharding)."""

    total: float
    quantized: float
    """Linear weights stored quantized (QLoRA): attention's, the MLP's and the experts' matrices, the module classes
    llmadapt.adapter.quantization quantizes (a run's header says what it held); the rest of total stays unquantized."""
    trainable: float
    per_layer: float


def rank_params(w: Workload) -> Params:
    m, p = w.model, w.parallelism
    h, v = m.hidden_size, m.vocab_size
    kv = m.num_kv_heads * m.head_dim
    attention = 2 * h * h + 2 * h * kv
    expert = 3 * h * m.intermediate_size
    experts = (m.num_experts if m.is_moe else 1) * expert
    router = h * m.num_experts if m.is_moe else 0
    layers = math.ceil(m.num_layers / p.pp)
    linear = attention / p.tp + experts / (p.tp * (p.ep if m.is_moe else 1))
    per_layer = linear + router + 2 * h
    embed, head = h * v / p.tp, (0 if m.tie_embeddings else h * v / p.tp)
    edges = embed + head + h if p.pp == 1 else max(embed, head + h)
    total = layers * per_layer + edges
    quantized = layers * linear if w.optimizations.quantization != "none" else 0.0
    trainable = layers * lora_params_per_layer(w) / p.tp if w.lora.rank else total
    return Params(total=total, quantized=quantized, trainable=trainable, per_layer=per_layer)


def _master(w: Workload, options: Options) -> bool:
    if options.master_weights is not None:
        return options.master_weights
    return w.precision != "fp32" and w.optimizations.zero_stage > 0 and not w.lora.rank


# LoRA's target names for each group of linears that share an input (Llama's and Mixtral's, transformers 4 and 5)
_QKV, _OUT = ("q_proj", "k_proj", "v_proj"), ("o_proj",)
_UP, _DOWN = ("gate_proj", "up_proj", "w1", "w3", "gate_up_proj"), ("down_proj", "w2")
_EXPERTS = ("w1", "w2", "w3")


def layer_activation_bytes(w: Workload, b: int) -> float:
    """What one decoder layer saves for its backward pass, for a micro-batch of b samples (no recomputation)."""
    m, p, o = w.model, w.parallelism, w.optimizations
    e = DTYPE_BYTES[w.precision]
    t = b * w.train.seq_len
    tp = p.tp
    h, hq, kv, i = m.hidden_size, m.hidden_size / tp, m.num_kv_heads * m.head_dim / tp, m.intermediate_size / tp
    flash = o.flash_attention
    # Saved for backward in one decoder layer (transformers' Llama/Mixtral, no dropout):
    # layer input, two RMSNorm outputs and the residual sum (+ fp32 internals below fp32),
    # q, q after rotary, attention output; k, v, k after rotary; SwiGLU: gate, up, silu, product.
    full_h = t * h * (4 * e + (2 * 4 if e != 4 else 0))
    sharded = t * e * (3 * hq + 3 * kv + (2 * hq if (not flash and kv != hq) else 0))
    if m.is_moe:
        routed = t * m.experts_per_token
        # per routed token: the gathered input, the expert's output and the four SwiGLU tensors (transformers 5's
        # grouped_mm experts; 4.36's per-expert loop also keeps index_add_'s source, one more h: measured by
        # benchmarks/memory_check.py, 5% of a layer)
        mlp = t * m.num_experts * 4 * 2 + routed * e * (2 * h + 4 * i)
    else:
        mlp = 4 * t * i * e
    scores = _scores_bytes(w, b)
    # LoRA's r-wide intermediate, per target; an expert's adapter sees the routed copies of the tokens
    lora = sum(t * (m.experts_per_token if m.is_moe and name in _EXPERTS else 1) * w.lora.rank * e
               for name in w.lora.target_modules) if w.lora.rank else 0
    frozen = 0.0
    if w.lora.rank:
        # A frozen base keeps no input for its own weights' gradients: not the two RMSNorms' normalised inputs,
        # and a linear's input only where LoRA targets it (measured with autograd's saved-tensor hooks:
        # tests/test_estimate.py::test_the_activation_model_against_what_autograd_saves).
        targets = set(w.lora.target_modules)

        def frozen_input(names: tuple[str, ...]) -> bool:
            return "all-linear" not in targets and not targets & set(names)

        frozen = 2 * t * h * e  # the two RMSNorms' normalised inputs
        frozen += t * e * (h * frozen_input(_QKV) + hq * frozen_input(_OUT))
        if m.is_moe:  # the router's input (the MLP norm's output); each expert's gathered input and its product
            frozen += t * h * e * frozen_input(("gate",))
            frozen += t * m.experts_per_token * e * (h * frozen_input(_UP) + i * frozen_input(_DOWN))
        else:  # the MLP norm's output (gate's and up's input) and the product (down's input)
            frozen += t * e * (h * frozen_input(_UP) + i * frozen_input(_DOWN))
    return full_h + sharded + mlp + scores + lora - frozen


def _scores_bytes(w: Workload, b: int) -> float:
    """What attention keeps of its scores in one layer: the s x s probabilities (in fp32, and a copy in the
    working precision below it), or with FlashAttention only its per-row statistics."""
    e, s = DTYPE_BYTES[w.precision], w.train.seq_len
    heads = w.model.num_heads / w.parallelism.tp
    return b * heads * s * 4 if w.optimizations.flash_attention else b * heads * s * s * (4 + (e if e != 4 else 0))


def activation_bytes(w: Workload, b: int) -> float:
    """Activation memory of one micro-batch of b samples per rank, at the peak of its backward pass."""
    m, p, o = w.model, w.parallelism, w.optimizations
    e = DTYPE_BYTES[w.precision]
    t = b * w.train.seq_len
    h, v = m.hidden_size, m.vocab_size / p.tp
    layers = math.ceil(m.num_layers / p.pp)
    per_layer = layer_activation_bytes(w, b)
    scores = _scores_bytes(w, b)
    top = t * h * e * 3 + t * v * (e + (4 if e != 4 else 0) + 4)
    transient = max(t * v * 4, per_layer)  # gradient of the logits, or of one layer, while it is computed
    in_flight = min(p.pp, max(1, w.per_rank_batch // b)) if p.pp > 1 else 1
    if o.recompute == "full":
        saved = layers * t * h * e + per_layer
    elif o.recompute == "selective":
        saved = layers * (per_layer - scores) + scores
    else:
        saved = layers * per_layer
    return saved * in_flight + top + transient


def lora_step_bytes(w: Workload, b: int, trainable: float, grads: float) -> float:
    """Activations, adapter gradients and transients at a LoRA step's highest moment, for a micro-batch of b samples.

    With a frozen base the gradients are the adapters', freed after each optimizer step, and the peak is the highest of
    four moments, not the sum of their parts (benchmarks/memory_check.py measured each moment of transformers' step on
    fake tensors; for Mixtral-8x7B QLoRA with full recomputation, the sum activation_bytes counts put 0.60 GiB on each
    512-token sample where the step holds 0.32, and missed the optimizer step's peak at small batches):
    - the loss: each layer's saved tensors (only its input under full recomputation), the autocast's bf16 copies of
      fp32 adapters, the final norm's input (fp32) and output, and the fp32 logits three times (the upcast, the
      shifted copy, the log-probabilities);
    - the top layer's backward: the saved tensors, that layer's activations recomputed, the gradients flowing through
      it (the residual stream's in and out and the MLP input's, one MLP's or one expert's gradients, the dequantised
      copy of a 4-bit weight), and its adapters' gradients;
    - the bottom layer's backward: the same for one layer's saved tensors, with every adapter gradient allocated;
    - the optimizer step: the gradients and foreach Adam's temporary copy of them.
    """
    m, p, o = w.model, w.parallelism, w.optimizations
    e = DTYPE_BYTES[w.precision]
    t = b * w.train.seq_len
    h, i, v = m.hidden_size, m.intermediate_size / p.tp, m.vocab_size / p.tp
    layers = math.ceil(m.num_layers / p.pp)
    per_layer = layer_activation_bytes(w, b)
    scores = _scores_bytes(w, b)
    c = t * h * e
    keep, rerun = {"full": (c, per_layer), "selective": (per_layer - scores, scores),
                   "none": (per_layer, 0.0)}[o.recompute]
    in_flight = min(p.pp, max(1, w.per_rank_batch // b)) if p.pp > 1 else 1
    saved = layers * keep * in_flight
    fp32_adapters = o.quantization != "none" and e != 4
    cache = trainable * e if fp32_adapters else 0.0
    top = 3 * 4 * t * v + t * h * (e + 4)
    mlp_tokens = t * m.experts_per_token / m.num_experts if m.is_moe else t
    transient = 3 * c + (3 * i + 2 * h) * mlp_tokens * e + (h * i * e if o.quantization != "none" else 0.0)
    optimizer_temp = grads if w.train.optimizer != "sgd" else 0.0
    return max(saved + cache + top, saved + rerun + transient + grads / layers,
               keep * in_flight + rerun + transient + grads, grads + optimizer_temp)


def kv_cache_bytes_per_token(w: Workload) -> float:
    m = w.model
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * DTYPE_BYTES[w.precision] / w.parallelism.tp


def serve_sequences(w: Workload) -> int:
    s = w.serve
    if s.arrival.process == "closed":
        return s.arrival.concurrency
    return s.max_concurrency or s.arrival.concurrency


def serve_tokens_per_sequence(w: Workload) -> int:
    s = w.serve
    inp = s.input_len.mean if s.input_len.dist == "fixed" else s.input_len.high
    out = s.output_len.mean if s.output_len.dist == "fixed" else s.output_len.high
    return inp + out


def memory(w: Workload, device: DeviceSpec, b: int, options: Options = Options(),
           factors: Factors | None = None) -> MemoryEstimate:
    """Memory one rank needs at its peak, by part."""
    o, p = w.optimizations, w.parallelism
    e = DTYPE_BYTES[w.precision]
    params = rank_params(w)
    master = _master(w, options)
    dp = p.dp
    overhead = options.runtime_overhead_bytes
    if overhead is None and factors is not None:
        overhead = factors.runtime_overhead_bytes
    if overhead is None:
        overhead = device.runtime_overhead_bytes
    if overhead is None:
        overhead = GPU_RUNTIME_OVERHEAD if device.kind == "gpu" else 0.0
    quant = o.quantization
    if quant != "none":
        # bitsandbytes stores linear weights quantized; prepare_model_for_kbit_training upcasts the rest to fp32
        weights = params.quantized * QUANT_BYTES[quant] + (params.total - params.quantized) * 4
    else:
        weights = params.total * e
    host = 0.0
    if w.kind == "serve":
        kv = kv_cache_bytes_per_token(w) * serve_tokens_per_sequence(w) * serve_sequences(w)
        prefill = w.serve.input_len.high * (w.model.hidden_size + w.model.intermediate_size) * e * 4
        total = weights + kv + prefill + overhead
        return MemoryEstimate(weights_bytes=weights, gradients_bytes=0.0, optimizer_bytes=0.0,
                              activations_bytes=prefill, kv_cache_bytes=kv, runtime_overhead_bytes=overhead,
                              total_bytes=total, host_bytes=0.0, capacity_bytes=device.memory_bytes,
                              fits=None if device.memory_bytes is None else total <= device.memory_bytes)
    lora_e = 4 if (w.lora.rank and quant != "none") else e
    if w.lora.rank:
        weights += params.trainable * lora_e
    grad_e = lora_e if w.lora.rank else e
    grads = params.trainable * grad_e
    if w.train.optimizer == "sgd":
        opt = params.trainable * (4 if master else 0)
    else:
        opt = params.trainable * (12 if master else 2 * grad_e)
    if o.zero_stage >= 1:
        opt /= dp
    if o.zero_stage >= 2:
        grads /= dp
    if o.zero_stage == 3:
        working = 2 * params.per_layer * e  # the layers gathered around the one running
        weights = weights / dp + working
        if o.offload == "optimizer+params":
            host += weights - working
            weights = working
    if o.offload in ("optimizer", "optimizer+params"):
        host += opt
        opt = 0.0
    if w.lora.rank:  # the activations at the peak, net of the adapter gradients not yet allocated then
        acts = lora_step_bytes(w, b, params.trainable / (dp if o.zero_stage >= 2 else 1), grads) - grads
    else:
        acts = activation_bytes(w, b)
    total = weights + grads + opt + acts + overhead
    fits = None if device.memory_bytes is None else total <= device.memory_bytes
    return MemoryEstimate(weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=opt, activations_bytes=acts,
                          kv_cache_bytes=0.0, runtime_overhead_bytes=overhead, total_bytes=total, host_bytes=host,
                          capacity_bytes=device.memory_bytes, fits=fits)


def max_micro_batch(w: Workload, device: DeviceSpec, options: Options = Options(),
                    factors: Factors | None = None, limit: int = 1 << 20) -> int | None:
    """Largest per-rank micro-batch whose memory fits the device; 0 when batch 1 does not fit."""
    if device.memory_bytes is None:
        return None
    if w.kind == "serve":
        base = memory(w, device, 1, options, factors)
        free = device.memory_bytes - (base.total_bytes - base.kv_cache_bytes)
        per_seq = kv_cache_bytes_per_token(w) * serve_tokens_per_sequence(w)
        return max(0, int(free // per_seq)) if per_seq else None

    def fits(b: int) -> bool:
        return memory(w, device, b, options, factors).total_bytes <= device.memory_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# -- time -------------------------------------------------------------------------------------------
@attrs.frozen
class Features:
    """The step time's linear parts given a bound assignment: t = sum(feature x coefficient)."""

    compute_s_at_peak: float
    """Sum of F / P over compute-bound calls (seconds at 100% of peak)."""
    memory_s_at_peak: float
    launches: float
    comm_s_at_peak: float
    fixed_s: float
    """Parts not calibrated (offload transfers, host-side optimizer)."""

    def time(self, f: Factors) -> float:
        return (self.compute_s_at_peak / f.eta_compute + self.memory_s_at_peak / f.eta_memory
                + self.launches * f.op_overhead_s + f.step_overhead_s + self.comm_s_at_peak / f.eta_comm
                + self.fixed_s)


def _rates(w: Workload, device: DeviceSpec) -> tuple[float, float, float]:
    dtype = w.precision
    peak = device.peak(dtype)
    if peak is None:
        if device.kind == "cpu":
            raise LlmadaptError(f"device {device.name!r} has no measured {dtype} peak: run "
                                f"`llmadapt micro peak --save {device.name}` (it measures fp32 and bf16)")
        raise LlmadaptError(f"device {device.name!r} has no peak FLOP/s for {dtype} in the catalog")
    if device.memory_bandwidth is None:
        raise LlmadaptError(f"device {device.name!r} has no memory bandwidth in the catalog")
    bw = device.memory_bandwidth
    link = device.interconnect_bandwidth or (CPU_INTERCONNECT if device.kind == "cpu" else bw / 10)
    if device.shared_by_ranks and w.world_size > 1:
        peak, bw = peak / w.world_size, bw / w.world_size
    return peak, bw, link


def features(w: Workload, device: DeviceSpec, factors: Factors, b: int | None = None,
             options: Options = Options()) -> tuple[Features, dict[str, float]]:
    """The step's roofline sums (and a breakdown in seconds with these factors)."""
    b = b or w.micro_batch
    peak, bw, link = _rates(w, device)
    p, o = w.parallelism, w.optimizations
    n_micro = max(1, w.per_rank_batch // b)
    params = rank_params(w)
    master = _master(w, options)
    comp = mem = launches = 0.0
    parts = {"compute": 0.0, "memory": 0.0, "overhead": 0.0}

    def add(f: float, by: float, n: float, times: float) -> None:
        nonlocal comp, mem, launches
        tc, tm = f / (peak * factors.eta_compute), by / (bw * factors.eta_memory)
        if tc >= tm:
            comp += times * f / peak
            parts["compute"] += times * tc
        else:
            mem += times * by / bw
            parts["memory"] += times * tm
        launches += times * n
        parts["overhead"] += times * n * factors.op_overhead_s

    micro_runs = n_micro + p.pp - 1  # pipeline: the bubble costs pp - 1 micro-batch slots
    for op in layer_ops(w, b):
        add(op.fwd_flops, op.fwd_bytes, op.fwd_launches, op.count * micro_runs)
        add(op.bwd_flops, op.bwd_bytes, op.bwd_launches, op.count * micro_runs)
        rerun = o.recompute == "full" and op.in_layer or o.recompute == "selective" and op.kind == "attention"
        if rerun:
            add(op.fwd_flops, op.fwd_bytes, op.fwd_launches, op.count * micro_runs)
    for op in step_ops(w, b, device.kind, params.trainable / (p.dp if o.zero_stage >= 1 else 1), master):
        add(op.fwd_flops, op.fwd_bytes, op.fwd_launches, op.count)
    comm = 0.0
    e = DTYPE_BYTES[w.precision]
    grad_bytes = params.trainable * (4 if (w.lora.rank and o.quantization != "none") else e)
    if p.dp > 1:
        n = p.dp
        comm += 2 * (n - 1) / n * grad_bytes / link * (1 - options.comm_overlap)
        launches += math.ceil(grad_bytes / DDP_BUCKET_BYTES)
        if o.zero_stage == 3:  # parameters gathered for forward and backward, every micro-batch
            comm += 2 * n_micro * (n - 1) / n * params.total * e / link
    if p.tp > 1:  # two all-reduces of the activations per layer, forward and backward
        layers = math.ceil(w.model.num_layers / p.pp)
        act = b * w.train.seq_len * w.model.hidden_size * e
        comm += 4 * layers * micro_runs * 2 * (p.tp - 1) / p.tp * act / link
    fixed = 0.0
    if o.offload != "none":
        host_bw = device.host_bandwidth or 16e9
        moved = grad_bytes + params.trainable * e  # gradients down, updated weights back
        if o.offload == "optimizer+params":
            moved += 2 * n_micro * params.total * e / p.dp
        fixed += moved / host_bw
        fixed += params.trainable / (p.dp if o.zero_stage else 1) * 28 / options.host_memory_bandwidth
    parts["communication"] = comm / factors.eta_comm
    parts["offload"] = fixed
    parts["step_overhead"] = factors.step_overhead_s
    return Features(comp, mem, launches, comm, fixed), parts


def step_time(w: Workload, device: DeviceSpec, factors: Factors, b: int | None = None,
              options: Options = Options()) -> tuple[float, dict[str, float]]:
    feats, parts = features(w, device, factors, b, options)
    return feats.time(factors), parts


def _serve_times(w: Workload, device: DeviceSpec, factors: Factors, mem: MemoryEstimate) -> dict[str, float]:
    """Decode is memory-bound at small batch: each token reads every weight and the KV cache once."""
    peak, bw, _ = _rates(w, device)
    m = w.model
    from llmadapt.contract.flops import param_count

    active = param_count(m, active=True, embedding=False)
    seqs = serve_sequences(w)
    inp, out = w.serve.input_len.mean, w.serve.output_len.mean
    kv_read = kv_cache_bytes_per_token(w) * seqs * (inp + out / 2)
    decode_flops = 2 * active * seqs
    launches = 12 * m.num_layers + 10
    tpot = max(decode_flops / (peak * factors.eta_compute), (mem.weights_bytes + kv_read) / (bw * factors.eta_memory))
    tpot += launches * factors.op_overhead_s
    prefill_flops = 2 * active * inp + 4 * m.num_layers * m.hidden_size * inp * inp
    ttft = max(prefill_flops / (peak * factors.eta_compute), mem.weights_bytes / (bw * factors.eta_memory))
    ttft += launches * factors.op_overhead_s
    return {"sequences": float(seqs), "ttft_s": ttft, "tpot_s": tpot, "output_tokens_per_s": seqs / tpot,
            "e2el_s": ttft + tpot * max(0, out - 1)}


# -- the estimate -----------------------------------------------------------------------------------
def estimate(workload: Workload | str | Path, device: str | DeviceSpec, *, options: Options = Options(),
             calibration: str | Path | None = None, catalog: list[str | Path] | tuple = (),
             factors: Factors | None = None) -> Estimate:
    """Predict memory, FLOPs, step time, throughput, max batch and cost of a workload on a device."""
    w = workload if isinstance(workload, Workload) else Workload.from_file(workload)
    if w.model.family not in ("llama", "mixtral"):
        raise LlmadaptError(f"estimate models llama and mixtral layers only, not {w.model.family}'s (Mamba layers): "
                            "measure it (llmadapt run, maxbatch)")
    spec = device if isinstance(device, DeviceSpec) else find_device(device, extra=catalog)
    factors = factors or load_factors(spec, calibration)
    b = w.micro_batch
    mem = memory(w, spec, b, options, factors)
    maxb = max_micro_batch(w, spec, options, factors)
    if options.check_fit and maxb == 0:
        one = memory(w, spec, 1, options, factors)
        parts = ", ".join(f"{k} {getattr(one, k + '_bytes') / GIB:,.1f}" for k in
                          ("weights", "gradients", "optimizer", "activations", "kv_cache") if getattr(one, k + "_bytes"))
        raise LlmadaptError(f"{w.label} does not fit on {spec.name} at batch 1: it needs "
                            f"{one.total_bytes / GIB:,.1f} GiB per rank ({parts} GiB, runtime "
                            f"{one.runtime_overhead_bytes / GIB:,.1f} GiB) and the device has "
                            f"{spec.memory_bytes / GIB:,.1f} GiB")
    assumptions = [
        f"FLOPs: model FLOPs in the {CONVENTION} convention; step time from executed (hardware) FLOPs",
        "memory: decimal catalog capacity; activations counted as the tensors transformers' Llama/Mixtral "
        "layers save for backward, plus one layer's gradients in flight",
    ]
    if w.lora.rank:
        assumptions.append("LoRA: the peak is the step's highest moment (loss, top or bottom layer's backward, optimizer "
                           "step), as measured on fake tensors (benchmarks/memory_check.py)")
    if _master(w, options):
        assumptions.append("mixed precision with fp32 master weights and fp32 Adam states (16 bytes/parameter)")
    elif w.precision != "fp32":
        assumptions.append(f"weights, gradients and optimizer states in {w.precision} (as the reference adapter)")
    if w.optimizations.quantization != "none":
        assumptions.append("quantized: the attention, MLP and expert matrices (transformers 5's fused experts too), as "
                           "the run holds them (its trace's weights); router, embeddings, lm_head and norms upcast "
                           "to fp32 (prepare_model_for_kbit_training)")
    if spec.shared_by_ranks and w.world_size > 1:
        assumptions.append(f"{w.world_size} ranks share this device's cores and memory bandwidth (one host)")
    sources = {f: spec.source_of(f) for f in ("peak_flops", "memory_bandwidth", "memory_bytes",
                                               "interconnect_bandwidth", "price_per_hour")}
    price = options.price_per_hour if options.price_per_hour is not None else spec.price_per_hour
    if options.price_per_hour is not None:
        sources["price_per_hour"] = "given (--price)"
    world = w.world_size
    if w.kind == "serve":
        serving = _serve_times(w, spec, factors, mem)
        serving["max_sequences"] = float(maxb) if maxb is not None else -1.0
        per_hour = price * world if price is not None else None
        per_m = per_hour / 3600 / serving["output_tokens_per_s"] * 1e6 if per_hour else None
        return Estimate(
            workload_hash=w.content_hash, label=w.label, kind=w.kind, device=spec.name, device_kind=spec.kind,
            precision=w.precision, world_size=world, micro_batch=serve_sequences(w), memory=mem,
            model_flops_per_step=0.0, hardware_flops_per_step=0.0, step_time_s=serving["tpot_s"],
            time_breakdown_s={}, tokens_per_s=serving["output_tokens_per_s"], samples_per_s=None, mfu=None,
            max_micro_batch=maxb, price_per_hour=price, cost_per_step=None, cost_per_hour=per_hour,
            cost_per_million_tokens=per_m, run_cost=None, job=None, serving=serving, factors=factors.as_dict(),
            calibration=factors.source, sources=sources,
            assumptions=assumptions + ["serving: decode reads every weight and the KV cache once per token"])
    seconds, parts = step_time(w, spec, factors, b, options)
    tokens = w.train.global_batch * w.train.seq_len
    model_flops = model_flops_per_token(w.model, w.train.seq_len) * tokens
    hardware = 0.0
    for op in layer_ops(w, b):
        rerun = (w.optimizations.recompute == "full" and op.in_layer
                 or w.optimizations.recompute == "selective" and op.kind == "attention")
        hardware += op.count * (op.fwd_flops * (2 if rerun else 1) + op.bwd_flops)
    hardware *= max(1, w.per_rank_batch // b) * world  # per rank and micro-batch -> all ranks, whole step
    peak = spec.peak(w.precision)
    plain = w.optimizations.quantization == "none" and not w.lora.rank
    mfu = model_flops / seconds / (peak * (1 if spec.shared_by_ranks else world)) if (peak and plain) else None
    cost_step = price * (1 if spec.shared_by_ranks else world) * seconds / 3600 if price is not None else None
    per_hour = price * (1 if spec.shared_by_ranks else world) if price is not None else None
    job = None
    if options.queries:
        hours = options.queries * options.epochs / (w.train.global_batch / seconds) / 3600
        job = {"queries": float(options.queries), "epochs": float(options.epochs), "hours": hours,
               "cost": hours * per_hour if per_hour is not None else -1.0}
    return Estimate(
        workload_hash=w.content_hash, label=w.label, kind=w.kind, device=spec.name, device_kind=spec.kind,
        precision=w.precision, world_size=world, micro_batch=b, memory=mem, model_flops_per_step=model_flops,
        hardware_flops_per_step=hardware, step_time_s=seconds, time_breakdown_s=parts,
        tokens_per_s=tokens / seconds, samples_per_s=w.train.global_batch / seconds, mfu=mfu, max_micro_batch=maxb,
        price_per_hour=price, cost_per_step=cost_step, cost_per_hour=per_hour,
        cost_per_million_tokens=cost_step / tokens * 1e6 if cost_step is not None else None,
        run_cost=cost_step * w.train.total_steps if cost_step is not None else None, job=job, serving=None,
        factors=factors.as_dict(), calibration=factors.source, sources=sources, assumptions=assumptions)
