"""Model FLOPs per token in the PaLM convention, and MFU.

Convention (stated in every summary that uses it): training FLOPs per token =
6 * N + 12 * L * H * Q * T, where N counts every parameter that takes part in a matmul per
token except the input embedding lookup (the output projection is counted, as torchtitan
does), for MoE only the active experts (top-k) plus the router; L layers, H query heads,
Q head dim, T the context each token attends over. GQA shrinks N (smaller K/V projections) but not the attention
term, whose score and value products run over all H query heads. The attention term is the
non-causal one (PaLM), so it overstates causal attention work by about 2x. Forward is 1/3,
backward 2/3. Recomputation is not counted in MFU's model FLOPs; HFU's hardware FLOPs count it.

T in a run's summary: each token attends within its own sample, so T is the mean over the run's tokens of the
length of the sample each token belongs to, sum(L^2) / sum(L) over the measured steps' samples (the step records'
sample_length_squares over their tokens). That is train.seq_len for full-length rows (synthetic data); for a
padded row it counts its real tokens, and for a packed row each sample's own length, not the row's: the scores a
mask removes or padding fills are not model work (a dense masked kernel still runs them).

Jamba (a hybrid of attention and Mamba layers): N counts each layer as it is (attention or Mamba mixer, MoE block
or dense MLP); the attention term runs over its attention layers only; each Mamba layer adds its selective scan,
which no parameter stands for: 9 FLOPs per token, inner channel and state in the forward (discretising A and B,
B times x, the state update's multiply and add, the output's product with C: mamba_ssm's own count,
9 * B * L * D * N), 27 with the backward. The Mamba mixer's parameters (in_proj, the depthwise conv1d, x_proj,
dt_proj, out_proj; A_log, D, its biases and norms, as the norms of every layer are) are in N.

LoRA (``training_flops``): the frozen base computes no weight gradients, so each of its N parameters costs 4
FLOPs per token (forward, and the gradient with respect to its input), not 6; the adapters (r * (in + out)
parameters per target matrix) cost 6. A quantized base is counted as the dense math it stands for, at the
workload's precision: dequantising it is overhead, not model work.
"""

from __future__ import annotations

from llmadapt.spec import ModelSpec
from llmadapt.spec.model import MAMBA_D_CONV, MAMBA_D_STATE

CONVENTION = "palm: 6*N(active, non-embedding, output projection counted) + 12*L*H*Q*T (+ 27*I*S per Mamba layer)"
SCAN_FLOPS = 9
"""Forward FLOPs of the selective scan per token, inner channel and state (mamba_ssm's count)."""


def _mixer_params(model: ModelSpec, mixer: str) -> int:
    h = model.hidden_size
    if mixer == "attention":
        return 2 * h * model.num_heads * model.head_dim + 2 * h * model.num_kv_heads * model.head_dim  # q, o; k, v
    inner, rank, state = model.mamba_inner, model.mamba_dt_rank, MAMBA_D_STATE
    return (h * 2 * inner + inner * MAMBA_D_CONV + inner  # in_proj; depthwise conv1d and its bias
            + inner * (rank + 2 * state) + rank * inner + inner  # x_proj; dt_proj and its bias
            + inner * h + inner * state + inner + rank + 2 * state)  # out_proj; A_log, D; dt, B and C norms


def _mlp_params(model: ModelSpec, moe: bool, active: bool) -> int:
    expert = 3 * model.hidden_size * model.intermediate_size  # SwiGLU: gate, up, down
    if not moe:
        return expert
    experts = model.experts_per_token if active else model.num_experts
    return experts * expert + model.hidden_size * model.num_experts  # + router


def layer_params(model: ModelSpec, *, active: bool, layer: int = 0) -> int:
    """Parameters of one layer (``layer``: which, where they differ: a jamba's)."""
    mixer, moe = model.layer_kinds[layer]
    return _mixer_params(model, mixer) + _mlp_params(model, moe, active) + 2 * model.hidden_size  # two RMSNorms


def param_count(model: ModelSpec, *, active: bool = False, embedding: bool = True) -> int:
    """Parameters of the model; `active` counts only top-k experts; `embedding` includes the input embedding."""
    h, v = model.hidden_size, model.vocab_size
    body = sum(layer_params(model, active=active, layer=n) for n in range(model.num_layers)) + h  # + final norm
    output = 0 if model.tie_embeddings else h * v
    return body + output + (h * v if embedding else 0)


def attention_flops(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token of the attention layers' score and value products (PaLM's 12*L*H*Q*T)."""
    layers = sum(mixer == "attention" for mixer, _ in model.layer_kinds)
    return float(12 * layers * model.num_heads * model.head_dim * seq_len)


def scan_flops(model: ModelSpec) -> float:
    """Training FLOPs per token of the Mamba layers' selective scans (forward and backward: 3 x SCAN_FLOPS)."""
    layers = sum(mixer == "mamba" for mixer, _ in model.layer_kinds)
    return float(3 * SCAN_FLOPS * layers * model.mamba_inner * MAMBA_D_STATE) if layers else 0.0


def _matmul_params(model: ModelSpec) -> int:
    n = param_count(model, active=True, embedding=False)
    if model.tie_embeddings:
        n += model.hidden_size * model.vocab_size  # tied: the output matmul still runs
    return n


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM convention (and Jamba's scan: module docstring)."""
    return float(6 * _matmul_params(model) + attention_flops(model, seq_len) + scan_flops(model))


_TARGET_SHAPES = {  # (in, out) of each LoRA target matrix, by its transformers name
    "q_proj": lambda m: (m.hidden_size, m.num_heads * m.head_dim),
    "k_proj": lambda m: (m.hidden_size, m.num_kv_heads * m.head_dim),
    "v_proj": lambda m: (m.hidden_size, m.num_kv_heads * m.head_dim),
    "o_proj": lambda m: (m.num_heads * m.head_dim, m.hidden_size),
    "gate_proj": lambda m: (m.hidden_size, m.intermediate_size),
    "up_proj": lambda m: (m.hidden_size, m.intermediate_size),
    "down_proj": lambda m: (m.intermediate_size, m.hidden_size),
    # jamba's Mamba mixers
    "in_proj": lambda m: (m.hidden_size, 2 * m.mamba_inner),
    "x_proj": lambda m: (m.mamba_inner, m.mamba_dt_rank + 2 * MAMBA_D_STATE),  # dt, B and C
    "dt_proj": lambda m: (m.mamba_dt_rank, m.mamba_inner),
    "out_proj": lambda m: (m.mamba_inner, m.hidden_size),
}
_TARGET_MIXER = {"q_proj": "attention", "k_proj": "attention", "v_proj": "attention", "o_proj": "attention",
                 "in_proj": "mamba", "x_proj": "mamba", "dt_proj": "mamba", "out_proj": "mamba"}
"""Which layers hold a target (the MLP's, every layer: LoRA targets them on dense models only)."""


def _lora_params(workload) -> int:
    m, rank = workload.model, workload.lora.rank
    kinds = [mixer for mixer, _ in m.layer_kinds]
    return sum(rank * sum(_TARGET_SHAPES[t](m)) * sum(_TARGET_MIXER.get(t, k) == k for k in kinds)
               for t in workload.lora.target_modules if t in _TARGET_SHAPES)


def training_flops(workload, context: float | None = None) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token of a training or fine-tuning workload: model FLOPs for MFU (PaLM's
    convention; for LoRA, the frozen base without weight gradients plus the adapters), hardware FLOPs for HFU
    (model FLOPs plus the forward that recomputation runs again: all of it for 'full', attention's score and
    value products for 'selective'). ``context``: the attention term's T (module docstring), default seq_len."""
    m, seq = workload.model, context or workload.train.seq_len
    full = model_flops_per_token(m, seq)
    attention = attention_flops(m, seq)
    if workload.lora.rank:
        n, adapters, scan = _matmul_params(m), _lora_params(workload), scan_flops(m)
        model = 4 * n + 6 * adapters + attention + scan  # the scan's input gradient: its backward stays whole
        forward = 2 * n + 2 * adapters + (attention + scan) / 3
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
