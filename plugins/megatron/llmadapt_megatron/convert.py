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

CONVERT_VERSION = 1  # bump when the conversion changes: cached rank shards are named by it


# A rank's slice is copied out, so the whole tensor it came from can be freed: a rank holds its share.
def _rows(t, tp: int, rank: int):
    return t.chunk(tp, dim=0)[rank].clone() if tp > 1 else t


def _cols(t, tp: int, rank: int):
    return t.chunk(tp, dim=1)[rank].contiguous() if tp > 1 else t


def fused_qkv(q, k, v, num_heads: int, num_kv_heads: int, head_dim: int):
    """Megatron's grouped QKV weight [(G * (n + 2) * d), H] from HF's q [nh*d, H], k, v [G*d, H]."""
    import torch

    hidden = q.shape[1]
    n = num_heads // num_kv_heads
    q = q.reshape(num_kv_heads, n * head_dim, hidden)
    k = k.reshape(num_kv_heads, head_dim, hidden)
    v = v.reshape(num_kv_heads, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _expert(hf: dict[str, Any], prefix: str, e: int) -> tuple[Any, Any, Any]:
    """(gate, up, down) of expert ``e``, from either Mixtral layout transformers writes; only that expert is read
    from the classic layout (a rank of expert parallelism reads its experts only)."""
    base = f"{prefix}.block_sparse_moe.experts.{e}"
    if f"{base}.w1.weight" in hf:
        return hf[f"{base}.w1.weight"], hf[f"{base}.w3.weight"], hf[f"{base}.w2.weight"]
    fused = f"{prefix}.mlp.experts.gate_up_proj"
    if fused in hf:  # [E, 2I, H] (gate rows first, then up) and down [E, H, I]
        gate_up, down = hf[fused][e], hf[f"{prefix}.mlp.experts.down_proj"][e]
        inter = gate_up.shape[0] // 2
        return gate_up[:inter].clone(), gate_up[inter:].clone(), down.clone()
    raise KeyError(f"no Mixtral expert weights under {prefix!r} (looked for {base}.w1.weight and {fused})")


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
            per_rank = model.num_experts // ep
            for j in range(per_rank):
                gate, up, down = _expert(hf, src, ep_rank * per_rank + j)
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


def megatron_to_hf(slices: list[tuple[dict[str, int], dict[str, Any]]], model) -> dict[str, Any]:
    """The Hugging Face state dict (published Llama / Mixtral layout) from every rank's ``(where, weights)``:
    ``where`` is hf_to_megatron's keyword arguments for that rank, ``weights`` its megatron parameters by name.
    The inverse of hf_to_megatron; data-parallel copies of a slice are read once."""
    import torch

    first = slices[0][0]
    tp, pp, etp = first["tp"], first["pp"], first.get("etp") or first["tp"]
    dense: dict[tuple[int, int], dict[str, Any]] = {}
    experts: dict[tuple[int, int, int], dict[str, Any]] = {}
    for where, weights in slices:
        dense.setdefault((where["pp_rank"], where["tp_rank"]), weights)
        experts.setdefault((where["pp_rank"], where.get("ep_rank", 0), where.get("etp_rank", where["tp_rank"])),
                           weights)

    def rows(pp_rank: int, name: str):
        return torch.cat([dense[(pp_rank, r)][name] for r in range(tp)], dim=0)

    def cols(pp_rank: int, name: str):
        return torch.cat([dense[(pp_rank, r)][name] for r in range(tp)], dim=1)

    n, d, h = model.num_heads // model.num_kv_heads, model.head_dim, model.hidden_size
    per_stage = model.num_layers // pp
    ep = max(where.get("ep", 1) for where, _ in slices)
    out: dict[str, Any] = {"model.embed_tokens.weight": rows(0, "embedding.word_embeddings.weight")}
    for layer in range(model.num_layers):
        s, local = divmod(layer, per_stage)
        src, dst = f"decoder.layers.{local}", f"model.layers.{layer}"
        q, k, v = [], [], []
        for r in range(tp):
            qkv = dense[(s, r)][f"{src}.self_attention.linear_qkv.weight"].reshape(-1, (n + 2) * d, h)
            q.append(qkv[:, : n * d].reshape(-1, h))
            k.append(qkv[:, n * d: (n + 1) * d].reshape(-1, h))
            v.append(qkv[:, (n + 1) * d:].reshape(-1, h))
        out[f"{dst}.input_layernorm.weight"] = dense[(s, 0)][f"{src}.input_layernorm.weight"]
        for proj, parts in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            out[f"{dst}.self_attn.{proj}.weight"] = torch.cat(parts, dim=0)
        out[f"{dst}.self_attn.o_proj.weight"] = cols(s, f"{src}.self_attention.linear_proj.weight")
        out[f"{dst}.post_attention_layernorm.weight"] = dense[(s, 0)][f"{src}.pre_mlp_layernorm.weight"]
        if model.is_moe:
            out[f"{dst}.block_sparse_moe.gate.weight"] = dense[(s, 0)][f"{src}.mlp.router.weight"]
            per_rank = model.num_experts // ep
            for e in range(model.num_experts):
                base = f"{src}.mlp.experts.local_experts.{e % per_rank}"
                fc1 = [experts[(s, e // per_rank, r)][f"{base}.linear_fc1.weight"] for r in range(etp)]
                half = [t.shape[0] // 2 for t in fc1]
                name = f"{dst}.block_sparse_moe.experts.{e}"
                out[f"{name}.w1.weight"] = torch.cat([t[:m] for t, m in zip(fc1, half)], dim=0)
                out[f"{name}.w3.weight"] = torch.cat([t[m:] for t, m in zip(fc1, half)], dim=0)
                out[f"{name}.w2.weight"] = torch.cat(
                    [experts[(s, e // per_rank, r)][f"{base}.linear_fc2.weight"] for r in range(etp)], dim=1)
        else:
            fc1 = [dense[(s, r)][f"{src}.mlp.linear_fc1.weight"] for r in range(tp)]
            half = [t.shape[0] // 2 for t in fc1]
            out[f"{dst}.mlp.gate_proj.weight"] = torch.cat([t[:m] for t, m in zip(fc1, half)], dim=0)
            out[f"{dst}.mlp.up_proj.weight"] = torch.cat([t[m:] for t, m in zip(fc1, half)], dim=0)
            out[f"{dst}.mlp.down_proj.weight"] = cols(s, f"{src}.mlp.linear_fc2.weight")
    out["model.norm.weight"] = dense[(pp - 1, 0)]["decoder.final_layernorm.weight"]
    if not model.tie_embeddings:
        out["lm_head.weight"] = rows(pp - 1, "output_layer.weight")
    return out
