"""Model FLOPs per token in the PaLM convention, and MFU.

Convention (stated in every summary that uses it): training FLOPs per token =
6 * N + 12 * L * H * Q * T, where N counts every parameter that takes part in a matmul per
token except the input embedding lookup (the output projection is counted, as torchtitan
does), for MoE only the active experts (top-k) plus the router; L layers, H query heads,
Q head dim, T sequence length. GQA shrinks N (smaller K/V projections) but not the attention
term, whose score and value products run over all H query heads. The attention term is the
non-causal one (PaLM), so it overstates causal attention work by about 2x. Forward is 1/3,
backward 2/3. Recomputation is not counted (that would be hardware FLOPs, HFU).
"""

from __future__ import annotations

from .spec import ModelSpec

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


# Dense peak FLOP/s per device (no sparsity), from the vendors' datasheets. The full catalog
# with sources and prices belongs to the analytical model; this is enough for MFU.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA A100 SXM datasheet (2020): 312 TFLOPS bf16/fp16 tensor, 156 tf32, 19.5 fp32.
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "A800": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    # NVIDIA H100 SXM datasheet (2023): 989.4 TFLOPS bf16/fp16 dense, 67 fp32.
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 67e12},
    # NVIDIA H200 SXM datasheet (2024): same compute as H100 SXM.
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 67e12},
}


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of one device for a precision, or None when unknown (CPUs: measure instead)."""
    for key, peaks in PEAK_FLOPS.items():
        if key in device_name.upper():
            return peaks.get(precision)
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak_per_device: float | None, devices: int) -> float | None:
    if not peak_per_device or devices < 1:
        return None
    return flops_per_token * tokens_per_s / (peak_per_device * devices)
