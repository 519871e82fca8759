"""Model FLOPs per token in the PaLM convention, and MFU.

Convention (stated in every summary that uses it): training FLOPs per token =
6 * N + 12 * L * H * Q * T, where N counts every parameter that takes part in a matmul per
token except the input embedding lookup (the output projection is counted, as torchtitan
does), for MoE only the active experts (top-k) plus the router; L layers, H query heads,
Q head dim, T sequence length. GQA shrinks N (smaller K/V projections) but not the attention
term, whose score and value products run over all H query heads. The attention term is the
non-causal one (PaLM), so it overstates causal attention work by about 2x. Forward is 1/3,
backward 2/3. Recomputation is not counted in MFU's model FLOPs; HFU's hardware FLOPs count it.

LoRA (``training_flops``): the frozen base computes no weight gradients, so each of its N parameters costs 4
FLOPs per token (forward, and the gradient with respect to its input), not 6; the adapters (r * (in + out)
parameters per target matrix) cost 6. A quantized base is counted as the dense math it stands for, at the
workload's precision: dequantising it is overhead, not model work.
"""

from __future__ import annotations

from llmadapt.spec import ModelSpec

CONVENTION = "palm: 6*N(active, non-embedding, output projection counted) + 12*L*H*Q*T"


def layer_params(model: ModelSpec, *, active: bool) -> int:
    h, kv_dim = model.hidden_size, model.num_kv_heads * model.head_dim
    attention = 2 * h * h + 2 * h * kv_dim  # q and o projections; k and v (GQA)
    expert = 3 * h * model.intermediate_size  # SwiGLU: gate, up, down
    if model.is_moe:
        experts = model.experts_per_token if active else model.num_experts
        mlp = experts * expert + h * model.num_experts  # + router
    else:
        mlp = expert
    return attention + mlp + 2 * h  # two RMSNorm weights


def param_count(model: ModelSpec, *, active: bool = False, embedding: bool = True) -> int:
    """Parameters of the model; `active` counts only top-k experts; `embedding` includes the input embedding."""
    h, v = model.hidden_size, model.vocab_size
    body = model.num_layers * layer_params(model, active=active) + h  # + final norm
    output = 0 if model.tie_embeddings else h * v
    return body + output + (h * v if embedding else 0)


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM convention."""
    n = param_count(model, active=True, embedding=False)
    if model.tie_embeddings:
        n += model.hidden_size * model.vocab_size  # tied: the output matmul still runs
    attention = 12 * model.num_layers * model.num_heads * model.head_dim * seq_len
    return float(6 * n + attention)


_TARGET_SHAPES = {  # (in, out) of each LoRA target matrix, by its transformers name
    "q_proj": lambda m: (m.hidden_size, m.num_heads * m.head_dim),
    "k_proj": lambda m: (m.hidden_size, m.num_kv_heads * m.head_dim),
    "v_proj": lambda m: (m.hidden_size, m.num_kv_heads * m.head_dim),
    "o_proj": lambda m: (m.num_heads * m.head_dim, m.hidden_size),
    "gate_proj": lambda m: (m.hidden_size, m.intermediate_size),
    "up_proj": lambda m: (m.hidden_size, m.intermediate_size),
    "down_proj": lambda m: (m.intermediate_size, m.hidden_size),
}


def training_flops(workload) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token of a training or fine-tuning workload: model FLOPs for MFU (PaLM's
    convention; for LoRA, the frozen base without weight gradients plus the adapters), hardware FLOPs for HFU
    (model FLOPs plus the forward that recomputation runs again: all of it for 'full', attention's score and
    value products for 'selective')."""
    m, seq = workload.model, workload.train.seq_len
    full = model_flops_per_token(m, seq)
    attention = 12 * m.num_layers * m.num_heads * m.head_dim * seq
    if workload.lora.rank:
        n = (full - attention) / 6  # the matmul parameters of the base
        adapters = sum(workload.lora.rank * sum(_TARGET_SHAPES[t](m)) for t in workload.lora.target_modules
                       if t in _TARGET_SHAPES) * m.num_layers
        model = 4 * n + 6 * adapters + attention
        forward = 2 * n + 2 * adapters + attention / 3
    else:
        model, forward = full, full / 3
    recompute = workload.optimizations.recompute
    extra = forward if recompute == "full" else attention / 3 if recompute == "selective" else 0.0
    return float(model), float(model + extra)


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak dense FLOP/s of one device for a precision, from the device catalog (llmadapt.contract.catalog: every
    accelerator it lists, shipped or the user's), or None when unknown. CPUs get none: their peak is a
    measurement (``micro peak``), not a datasheet figure, and MFU against it would read as a GPU's."""
    import re

    from llmadapt.contract.catalog import device_for_reported, load_catalog

    catalog = {n: d for n, d in load_catalog().items() if d.kind != "cpu"}
    spec = device_for_reported(device_name, catalog)
    if spec is None:
        # A reported name holds the catalog's name or an alias ("NVIDIA A100-SXM4-40GB" holds "A100"), not
        # followed by a digit ("A40" is not "A4000"); the longest such name wins.
        def norm(text: str) -> str:
            return re.sub(r"[^0-9A-Z]", "", text.upper())

        reported = norm(device_name)
        best = 0
        for d in catalog.values():
            for name in (d.name, *d.aliases):
                key = norm(name)
                if len(key) > best and re.search(re.escape(key) + r"(?!\d)", reported):
                    spec, best = d, len(key)
    return spec.peak(precision) if spec is not None else None


def mfu(flops_per_token: float, tokens_per_s: float, peak_per_device: float | None, devices: int) -> float | None:
    if not peak_per_device or devices < 1:
        return None
    return flops_per_token * tokens_per_s / (peak_per_device * devices)
