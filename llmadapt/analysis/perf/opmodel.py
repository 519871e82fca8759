"""Operators of one training step, with their shapes, FLOPs, bytes and kernel counts (no torch).

One inventory serves two purposes: ``llmadapt micro ops`` benchmarks these operators with
these shapes, and ``llmadapt estimate`` sums a roofline time over them. It follows the
reference adapter's implementation (transformers' Llama/Mixtral modules, eager or SDPA
attention, a cross-entropy on fp32 logits, torch's AdamW), per rank and per micro-batch.

Conventions (every figure per call of the operator, per rank):

- ``flops``: floating-point operations actually executed (hardware FLOPs): a GEMM
  [m,k]x[k,n] is 2mkn; eager and math-SDPA attention compute the full s x s score matrix,
  flash/efficient kernels skip masked blocks (half); backward of a GEMM is two GEMMs (one when
  the weight is frozen), flash backward recomputes the scores (2.5x forward).
- ``bytes``: bytes the implementation's kernels read and write, each kernel's operands once
  (GEMM: both inputs and the output; elementwise chains count every pass).
- ``launches``: operator calls (kernels, plus the view and cast calls that cost dispatcher
  time). On small shapes, per-call overhead dominates: the estimate multiplies these by a
  calibrated seconds-per-call.
"""

from __future__ import annotations

import math

import attrs

from llmadapt.spec import Workload

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


QUANT_BYTES = {"int8": 1.0 + 0.0, "nf4": 0.5 + 4 / 64, "fp4": 0.5 + 4 / 64}  # 4-bit codes + one fp32 absmax per 64


LORA_DIMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


MOE_LORA_DIMS = ("w1", "w2", "w3", "gate")  # Mixtral's experts (one LoRA per expert) and router, transformers 4 names


def moe_lora_shape(m, name: str) -> tuple[int, int, int, int]:
    """(adapters per layer, tokens each token sends through them, in, out) of a LoRA on Mixtral's experts or router."""
    h, i = m.hidden_size, m.intermediate_size
    if name == "gate":
        return 1, 1, h, m.num_experts
    return m.num_experts, m.experts_per_token, (i if name == "w2" else h), (h if name == "w2" else i)


@attrs.frozen
class Op:
    """One operator as the step runs it: per call, per rank."""

    name: str
    kind: str
    """gemm | attention | memory | optimizer"""
    count: int
    """Calls per micro-batch (or per step for phase 'step')."""
    shape: dict[str, int]
    fwd_flops: float
    fwd_bytes: float
    fwd_launches: int
    bwd_flops: float = 0.0
    bwd_bytes: float = 0.0
    bwd_launches: int = 0
    in_layer: bool = True
    """Part of a decoder layer: run again in the backward pass under full recomputation."""
    phase: str = "micro"
    """'micro': per micro-batch; 'step': once per optimizer step."""
    backend: str | None = None
    dtype: str = "fp32"


def gemm(name: str, m: int, k: int, n: int, *, e: int, count: int, trainable: bool = True,
         launches: tuple[int, int] = (1, 2), in_layer: bool = True, dtype: str = "fp32",
         weight_bytes: float | None = None) -> Op:
    """[m,k] x [k,n]; backward: dX = dY W^T always, dW = X^T dY when the weight trains."""
    f = 2.0 * m * k * n
    w = k * n * (e if weight_bytes is None else weight_bytes)
    b = e * (m * k + m * n) + w
    bwd_f = f * (2 if trainable else 1)
    bwd_b = (e * (m * n + m * k) + w) + (e * (m * k + m * n + k * n) if trainable else 0)
    return Op(name, "gemm", count, {"m": m, "k": k, "n": n}, f, b, launches[0], bwd_f, bwd_b,
              launches[1] if trainable else max(1, launches[1] - 1), in_layer, dtype=dtype)


def attention_ops(w: Workload, b: int, e: int, count: int, dtype: str) -> Op:
    m = w.model
    s, tp = w.train.seq_len if w.kind != "serve" else w.serve.input_len.mean, w.parallelism.tp
    heads, kv_heads, hd = m.num_heads // tp, m.num_kv_heads // tp, m.head_dim
    t = b * s
    qo = e * t * heads * hd * 2
    kv = e * t * kv_heads * hd * 2
    if w.optimizations.flash_attention:
        f = 4.0 * b * heads * s * s * hd / 2  # causal blocks skipped
        by = qo + kv + 4 * b * heads * s
        return Op("attention", "attention", count, {"b": b, "heads": heads, "kv_heads": kv_heads, "s": s, "d": hd},
                  f, by, 4, 2.5 * f, 2.5 * by, 4, backend="flash", dtype=dtype)
    f = 4.0 * b * heads * s * s * hd
    scores = b * heads * s * s
    # matmul out, x scale, + mask, softmax (fp32 out), cast back, matmul in
    by_scores = scores * (6 * e + 4 + (4 + e if e != 4 else 0))
    rep = 0 if kv_heads == heads else e * t * heads * hd * 2 * 2  # repeat_kv copies of k and v
    by = qo + kv + rep + by_scores
    return Op("attention", "attention", count, {"b": b, "heads": heads, "kv_heads": kv_heads, "s": s, "d": hd},
              f, by, 14, 2 * f, 2 * by, 14, backend="eager", dtype=dtype)


def lora_params_per_layer(w: Workload) -> int:
    """LoRA weights per decoder layer: r * (in + out) per targeted projection."""
    m, r = w.model, w.lora.rank
    if not r:
        return 0
    kv = m.num_kv_heads * m.head_dim
    dims = {"q_proj": (m.hidden_size, m.hidden_size), "k_proj": (m.hidden_size, kv), "v_proj": (m.hidden_size, kv),
            "o_proj": (m.hidden_size, m.hidden_size)}
    if not m.is_moe:
        dims.update({"gate_proj": (m.hidden_size, m.intermediate_size), "up_proj": (m.hidden_size, m.intermediate_size),
                     "down_proj": (m.intermediate_size, m.hidden_size)})
    moe = sum(n * r * (a + b) for n, _, a, b in (moe_lora_shape(m, t) for t in w.lora.target_modules
                                                 if m.is_moe and t in MOE_LORA_DIMS))
    return sum(r * (a + b) for name, (a, b) in dims.items() if name in w.lora.target_modules) + moe


def lora_targets(w: Workload) -> list[str]:
    m = w.model
    allowed = LORA_DIMS if not m.is_moe else LORA_DIMS[:4] + MOE_LORA_DIMS
    return [t for t in w.lora.target_modules if t in allowed]


def trainable_tensors(w: Workload) -> int:
    """Parameter tensors the optimizer updates (per rank, before ZeRO)."""
    m = w.model
    if w.lora.rank:
        return 2 * sum(moe_lora_shape(m, t)[0] if t in MOE_LORA_DIMS else 1 for t in lora_targets(w)) * m.num_layers
    per_layer = 9  # q, k, v, o, (gate, up, down | router, gate_up, down), 2 norms
    return per_layer * m.num_layers + 2 + (0 if m.tie_embeddings else 1)


def layer_ops(w: Workload, b: int) -> list[Op]:
    """The operators of one micro-batch of ``b`` samples per rank, forward and backward."""
    m, p = w.model, w.parallelism
    dtype = w.precision
    e = DTYPE_BYTES[dtype]
    s = w.train.seq_len if w.kind != "serve" else w.serve.input_len.mean
    t = b * s
    tp = p.tp
    layers = math.ceil(m.num_layers / p.pp)
    h, kv, i, v = m.hidden_size, m.num_kv_heads * m.head_dim // tp, m.intermediate_size // tp, m.vocab_size // tp
    hq = h // tp
    frozen = bool(w.lora.rank)
    quant = w.optimizations.quantization
    wb = QUANT_BYTES[quant] if quant != "none" else None
    ops: list[Op] = []
    ops.append(Op("embedding", "memory", 1, {"t": t, "h": h}, 0.0, e * t * h + 8 * t, 1,
                  0.0 if frozen else e * (2 * t * h + v * h), 0 if frozen else 3, in_layer=False, dtype=dtype))
    ops.append(Op("model_setup", "memory", 1, {"t": t}, 0.0, 4 * (s * s + 2 * s * m.head_dim), 25, 0.0, 0.0, 0,
                  in_layer=False, dtype=dtype))
    ops.append(Op("rmsnorm", "memory", 2 * layers, {"t": t, "h": h}, 4.0 * t * h, e * 2 * t * h + 4 * 2 * t * h, 8,
                  4.0 * t * h, e * 3 * t * h + 4 * 3 * t * h, 14, dtype=dtype))
    ops.append(gemm("qkv", t, h, hq + 2 * kv, e=e, count=layers, trainable=not frozen, launches=(9, 12), dtype=dtype,
                    weight_bytes=wb))
    ops.append(Op("rotary", "memory", layers, {"t": t, "q": hq, "kv": kv, "d": m.head_dim}, 6.0 * t * (hq + kv),
                  e * 8 * t * (hq + kv), 16, 6.0 * t * (hq + kv), e * 8 * t * (hq + kv), 16, dtype=dtype))
    ops.append(attention_ops(w, b, e, layers, dtype))
    ops.append(gemm("output", t, hq, h, e=e, count=layers, trainable=not frozen, launches=(3, 4), dtype=dtype,
                    weight_bytes=wb))
    ops.append(Op("residual", "memory", 2 * layers, {"t": t, "h": h}, 1.0 * t * h, e * 3 * t * h, 1,
                  1.0 * t * h, e * 3 * t * h, 1, dtype=dtype))
    if m.is_moe:
        ne, k = m.num_experts, m.experts_per_token
        routed = t * k
        ops.append(gemm("moe_router", t, h, ne, e=e, count=layers, trainable=not frozen, launches=(8, 8), dtype=dtype))
        hit = min(ne, routed)
        ops.append(Op("moe_dispatch", "memory", layers, {"t": t, "h": h, "experts": ne, "k": k},
                      2.0 * routed * h, e * 4 * routed * h + 8 * routed * (ne + 1) * 2, 6 + 7 * hit,
                      2.0 * routed * h, e * 4 * routed * h, 6 * hit, dtype=dtype))
        per_expert = max(1, routed // ne)
        ops.append(gemm("fc1", per_expert, h, 2 * i, e=e, count=layers * hit, trainable=not frozen, launches=(2, 3),
                        dtype=dtype, weight_bytes=wb))
        ops.append(Op("swiglu", "memory", layers * hit, {"t": per_expert, "i": i}, 5.0 * per_expert * i,
                      e * 5 * per_expert * i, 3, 5.0 * per_expert * i, e * 8 * per_expert * i, 5, dtype=dtype))
        ops.append(gemm("fc2", per_expert, i, h, e=e, count=layers * hit, trainable=not frozen, launches=(1, 2),
                        dtype=dtype, weight_bytes=wb))
    else:
        ops.append(gemm("fc1", t, h, 2 * i, e=e, count=layers, trainable=not frozen, launches=(2, 5), dtype=dtype,
                        weight_bytes=wb))
        ops.append(Op("swiglu", "memory", layers, {"t": t, "i": i}, 5.0 * t * i, e * 5 * t * i, 2,
                      5.0 * t * i, e * 8 * t * i, 4, dtype=dtype))
        ops.append(gemm("fc2", t, i, h, e=e, count=layers, trainable=not frozen, launches=(1, 2), dtype=dtype,
                        weight_bytes=wb))
    if frozen:
        r = w.lora.rank
        for target in lora_targets(w):
            # x @ A (r columns) then @ B, scaled and added: two thin GEMMs that train
            if target in MOE_LORA_DIMS:  # one adapter per expert: the routed copies of the tokens, the expert's shape
                n, k, a, o = moe_lora_shape(m, target)
                n = min(n, t * k)
                tok = t * k
                ops.append(Op(f"lora_{target}", "gemm", layers, {"t": tok, "in": a, "out": o, "r": r},
                              2.0 * tok * r * (a + o), e * (tok * (a + o) + 2 * tok * r + n * r * (a + o)), 5 * n,
                              4.0 * tok * r * (a + o), 2 * e * (tok * (a + o) + 2 * tok * r + n * r * (a + o)), 8 * n,
                              dtype=dtype))
                continue
            ops.append(Op(f"lora_{target}", "gemm", layers, {"t": t, "h": h, "r": r}, 4.0 * t * h * r,
                          e * (2 * t * h + 2 * t * r + 2 * h * r), 5, 8.0 * t * h * r,
                          e * (4 * t * h + 4 * t * r + 4 * h * r), 8, dtype=dtype))
    if quant != "none":
        per_layer = (h * (hq + 2 * kv) + hq * h + (3 * h * i * (m.experts_per_token if m.is_moe else 1)))
        ops.append(Op("dequantize", "memory", layers, {"params": per_layer}, 0.0, per_layer * (wb + e), 7,
                      0.0, per_layer * (wb + e), 7, dtype=dtype))
    ops.append(Op("rmsnorm", "memory", 1, {"t": t, "h": h}, 4.0 * t * h, e * 2 * t * h + 4 * 2 * t * h, 8,
                  4.0 * t * h, e * 3 * t * h + 4 * 3 * t * h, 14, in_layer=False, dtype=dtype))
    ops.append(gemm("lm_head", t, h, v, e=e, count=1, trainable=not frozen, launches=(1, 2), in_layer=False,
                    dtype=dtype))
    upcast = (e + 4) * t * v if e != 4 else 0
    ops.append(Op("cross_entropy", "memory", 1, {"t": t, "v": v}, 5.0 * t * v, upcast + 4 * 2 * t * v, 6,
                  2.0 * t * v, upcast + 4 * 4 * t * v, 6, in_layer=False, dtype=dtype))
    return ops


def step_ops(w: Workload, b: int, device_kind: str, trainable_params: float, master_weights: bool) -> list[Op]:
    """Once-per-step operators: gradient accumulation across micro-batches and the optimizer."""
    e = DTYPE_BYTES[w.precision]
    n_micro = w.per_rank_batch // b
    ops: list[Op] = []
    tensors = trainable_tensors(w)
    grad_e = 4 if (master_weights or w.lora.rank and w.optimizations.quantization != "none") else e
    if n_micro > 1:
        ops.append(Op("grad_accumulate", "memory", n_micro - 1, {"params": int(trainable_params)}, trainable_params,
                      3 * grad_e * trainable_params, tensors, in_layer=False, phase="step", dtype=w.precision))
    opt = w.train.optimizer
    state_e = 4 if master_weights else grad_e
    if opt == "sgd":
        by, fl, per_tensor = trainable_params * (2 * state_e + grad_e), 2 * trainable_params, 2
    else:  # adam/adamw: read p, g, m, v; write p, m, v (+ the low-precision copy with master weights)
        by = trainable_params * (7 * state_e + (2 * e + grad_e if master_weights else 0))
        fl, per_tensor = 12 * trainable_params, 10
    launches = per_tensor * tensors if device_kind == "cpu" else per_tensor * max(1, math.ceil(tensors / 32))
    if w.optimizations.offload == "none":
        ops.append(Op("optimizer", "optimizer", 1, {"params": int(trainable_params)}, fl, by, launches,
                      in_layer=False, phase="step", dtype=w.precision))
    return ops
