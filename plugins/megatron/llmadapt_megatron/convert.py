"""Canonical Hugging Face checkpoint (Llama / Mixtral, safetensors) -> megatron-core GPTModel weights.

Pure tensor bookkeeping, no megatron import, so it is testable on its own. The layout megatron's
local layer spec expects:

- ``linear_qkv``: for each query group g (= key/value head g), the rows of that group's query
  heads, then its key head, then its value head: ``[q(g, 0) .. q(g, n-1), k(g), v(g)]`` with
  ``n = num_heads / num_kv_heads``. That is also Hugging Face's grouping (``repeat_kv`` gives
  query head i the key/value head ``i // n``). Tensor parallelism splits whole groups: rank r
  keeps groups ``r*G/tp .. (r+1)*G/tp - 1``.
- ``linear_fc1`` (SwiGLU): ``cat(gate, up)`` per rank: rank r holds its slice of gate followed
  by its slice of up, so ``silu(first half) * second half`` is local.
- Row-parallel layers (``linear_proj``, ``linear_fc2``) split the input dimension; column-parallel
  ones, the vocabulary-parallel embedding and output layer split the output dimension.
- Pipeline stage s holds global layers ``s*L/pp .. (s+1)*L/pp - 1`` as local ``decoder.layers.0..``;
  the first stage holds the embedding, the last the final norm and the output layer (with tied
  embeddings and pp > 1 the last stage keeps its own copy of the embedding, which megatron keeps
  equal by all-reducing the two gradients over its embedding group).
- Expert parallelism: rank e of ep holds experts ``e*E/ep ..`` as ``local_experts.0..``; expert tensor
  parallelism slices each expert's fc1/fc2 like the dense MLP's.
"""

from __future__ import annotations

from typing import Any


def _rows(t, tp: int, rank: int):
    return t.chunk(tp, dim=0)[rank] if tp > 1 else t


def _cols(t, tp: int, rank: int):
    return t.chunk(tp, dim=1)[rank] if tp > 1 else t


def fused_qkv(q, k, v, num_heads: int, num_kv_heads: int, head_dim: int):
    """Megatron's grouped QKV weight [(G * (n + 2) * d), H] from HF's q [nh*d, H], k, v [G*d, H]."""
    import torch

    hidden = q.shape[1]
    n = num_heads // num_kv_heads
    q = q.reshape(num_kv_heads, n * head_dim, hidden)
    k = k.reshape(num_kv_heads, head_dim, hidden)
    v = v.reshape(num_kv_heads, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _expert_tensors(hf: dict[str, Any], prefix: str, num_experts: int) -> list[tuple[Any, Any, Any]]:
    """(gate, up, down) per expert, from either Mixtral layout transformers writes."""
    out = []
    classic = f"{prefix}.block_sparse_moe.experts.0.w1.weight"
    if classic in hf:
        for e in range(num_experts):
            base = f"{prefix}.block_sparse_moe.experts.{e}"
            out.append((hf[f"{base}.w1.weight"], hf[f"{base}.w3.weight"], hf[f"{base}.w2.weight"]))
        return out
    fused = f"{prefix}.mlp.experts.gate_up_proj"
    if fused in hf:  # [E, 2I, H] (gate rows first, then up) and down [E, H, I]
        gate_up, down = hf[fused], hf[f"{prefix}.mlp.experts.down_proj"]
        inter = gate_up.shape[1] // 2
        for e in range(num_experts):
            out.append((gate_up[e, :inter], gate_up[e, inter:], down[e]))
        return out
    raise KeyError(f"no Mixtral expert weights under {prefix!r} (looked for {classic} and {fused})")


def _router(hf: dict[str, Any], prefix: str):
    for key in (f"{prefix}.block_sparse_moe.gate.weight", f"{prefix}.mlp.gate.weight"):
        if key in hf:
            return hf[key]
    raise KeyError(f"no router weight under {prefix!r}")


def hf_to_megatron(hf: dict[str, Any], model, *, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0,
                   ep: int = 1, ep_rank: int = 0, etp: int | None = None, etp_rank: int | None = None) -> dict[str, Any]:
    """This rank's megatron parameters by name, from the HF state dict ``hf``; ``model`` is the ModelSpec.

    ``etp``/``etp_rank``: expert tensor parallelism (megatron's default: the tensor-parallel size)."""
    etp = tp if etp is None else etp
    etp_rank = tp_rank if etp_rank is None else etp_rank
    out: dict[str, Any] = {}
    per_stage = model.num_layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = _rows(hf["model.embed_tokens.weight"], tp, tp_rank)
    for local in range(per_stage):
        layer = pp_rank * per_stage + local
        src, dst = f"model.layers.{layer}", f"decoder.layers.{local}"
        a = f"{src}.self_attn"
        qkv = fused_qkv(hf[f"{a}.q_proj.weight"], hf[f"{a}.k_proj.weight"], hf[f"{a}.v_proj.weight"],
                        model.num_heads, model.num_kv_heads, model.head_dim)
        out[f"{dst}.self_attention.linear_qkv.weight"] = _rows(qkv, tp, tp_rank)
        out[f"{dst}.self_attention.linear_proj.weight"] = _cols(hf[f"{a}.o_proj.weight"], tp, tp_rank)
        out[f"{dst}.input_layernorm.weight"] = hf[f"{src}.input_layernorm.weight"]
        out[f"{dst}.pre_mlp_layernorm.weight"] = hf[f"{src}.post_attention_layernorm.weight"]
        if model.is_moe:
            import torch

            out[f"{dst}.mlp.router.weight"] = _router(hf, src)
            experts = _expert_tensors(hf, src, model.num_experts)
            per_rank = model.num_experts // ep
            for j in range(per_rank):
                gate, up, down = experts[ep_rank * per_rank + j]
                e = f"{dst}.mlp.experts.local_experts.{j}"
                out[f"{e}.linear_fc1.weight"] = torch.cat([_rows(gate, etp, etp_rank), _rows(up, etp, etp_rank)], dim=0)
                out[f"{e}.linear_fc2.weight"] = _cols(down, etp, etp_rank)
        else:
            import torch

            m = f"{src}.mlp"
            out[f"{dst}.mlp.linear_fc1.weight"] = torch.cat(
                [_rows(hf[f"{m}.gate_proj.weight"], tp, tp_rank), _rows(hf[f"{m}.up_proj.weight"], tp, tp_rank)], dim=0)
            out[f"{dst}.mlp.linear_fc2.weight"] = _cols(hf[f"{m}.down_proj.weight"], tp, tp_rank)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not (model.tie_embeddings and pp == 1):  # tied on one stage: the output layer reuses the embedding
            head = hf["lm_head.weight"] if "lm_head.weight" in hf else hf["model.embed_tokens.weight"]
            out["output_layer.weight"] = _rows(head, tp, tp_rank)
    return out


def load_into(module, weights: dict[str, Any]) -> None:
    """Copy ``weights`` into the module's parameters (cast to their dtype); every parameter must be covered."""
    import torch

    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise RuntimeError(f"checkpoint conversion does not match the megatron model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if tuple(w.shape) != tuple(p.shape):
                raise RuntimeError(f"{name}: converted shape {tuple(w.shape)} != model shape {tuple(p.shape)}")
            p.copy_(w.to(dtype=p.dtype, device=p.device))
