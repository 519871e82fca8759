"""The megatron adapter's checkpoint conversion (plugins/megatron/llmadapt_megatron/convert.py), in process.

Pure tensor bookkeeping, checked without megatron: the fused QKV rows follow megatron's per-group
layout with Hugging Face's GQA grouping, tensor-parallel slices reassemble the whole weights,
pipeline stages and expert-parallel ranks partition the layers and experts. (That the result
computes the reference's loss is proven end to end by tests/test_megatron.py.)
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
convert = pytest.importorskip("llmadapt_megatron.convert")

from llmadapt.spec import MODEL_PRESETS, ModelSpec  # noqa: E402


def _spec(name: str, **changes) -> ModelSpec:
    return ModelSpec(name=name, **{**MODEL_PRESETS[name], **changes})


def _fake_hf(spec: ModelSpec) -> dict:
    """Random tensors with the canonical checkpoint's names and shapes."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    hf = {"model.embed_tokens.weight": r(spec.vocab_size, h), "lm_head.weight": r(spec.vocab_size, h),
          "model.norm.weight": r(h)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}"
        hf.update({
            f"{p}.self_attn.q_proj.weight": r(spec.num_heads * d, h),
            f"{p}.self_attn.k_proj.weight": r(spec.num_kv_heads * d, h),
            f"{p}.self_attn.v_proj.weight": r(spec.num_kv_heads * d, h),
            f"{p}.self_attn.o_proj.weight": r(h, spec.num_heads * d),
            f"{p}.input_layernorm.weight": r(h), f"{p}.post_attention_layernorm.weight": r(h),
        })
        if spec.is_moe:
            hf[f"{p}.block_sparse_moe.gate.weight"] = r(spec.num_experts, h)
            for e in range(spec.num_experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                hf.update({f"{q}.w1.weight": r(i, h), f"{q}.w3.weight": r(i, h), f"{q}.w2.weight": r(h, i)})
        else:
            hf.update({f"{p}.mlp.gate_proj.weight": r(i, h), f"{p}.mlp.up_proj.weight": r(i, h),
                       f"{p}.mlp.down_proj.weight": r(h, i)})
    return hf


def test_fused_qkv_follows_gqa_groups():
    """Group g holds the query heads HF pairs with key/value head g (repeat_kv), then k(g), then v(g)."""
    spec = _spec("tiny-llama")  # 4 heads, 2 kv heads, head_dim 16
    hf = _fake_hf(spec)
    a = "model.layers.0.self_attn"
    q, k, v = (hf[f"{a}.{n}_proj.weight"] for n in "qkv")
    d, n = spec.head_dim, spec.num_heads // spec.num_kv_heads
    qkv = convert.fused_qkv(q, k, v, spec.num_heads, spec.num_kv_heads, d)
    assert qkv.shape == ((spec.num_heads + 2 * spec.num_kv_heads) * d, spec.hidden_size)
    per_group = (n + 2) * d
    for g in range(spec.num_kv_heads):
        block = qkv[g * per_group:(g + 1) * per_group]
        assert torch.equal(block[: n * d], q[g * n * d:(g + 1) * n * d])
        assert torch.equal(block[n * d: (n + 1) * d], k[g * d:(g + 1) * d])
        assert torch.equal(block[(n + 1) * d:], v[g * d:(g + 1) * d])


def test_tensor_parallel_slices_reassemble():
    spec = _spec("tiny-llama")
    hf = _fake_hf(spec)
    whole = convert.hf_to_megatron(hf, spec)
    parts = [convert.hf_to_megatron(hf, spec, tp=2, tp_rank=r) for r in range(2)]
    assert set(parts[0]) == set(whole)
    for name, w in whole.items():
        if name.endswith("layernorm.weight"):
            assert all(torch.equal(p[name], w) for p in parts)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert torch.equal(torch.cat([p[name] for p in parts], dim=1), w)
        elif name.endswith("linear_fc1.weight"):  # per rank: its gate slice, then its up slice
            inter = spec.intermediate_size
            gate = torch.cat([p[name][: inter // 2] for p in parts])
            up = torch.cat([p[name][inter // 2:] for p in parts])
            assert torch.equal(torch.cat([gate, up]), w)
        else:  # qkv (whole groups), embedding, output layer: rows
            assert torch.equal(torch.cat([p[name] for p in parts]), w)


def test_pipeline_stages_and_expert_ranks_partition_the_model():
    spec = _spec("tiny-mixtral")
    hf = _fake_hf(spec)
    first = convert.hf_to_megatron(hf, spec, pp=2, pp_rank=0, ep=2, ep_rank=0)
    last = convert.hf_to_megatron(hf, spec, pp=2, pp_rank=1, ep=2, ep_rank=1)
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "decoder.final_layernorm.weight" in last
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"])
    # ep rank 1 holds experts 2 and 3 as local experts 0 and 1; fc1 = cat(w1, w3), fc2 = w2
    local = last["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    e3 = "model.layers.1.block_sparse_moe.experts.3"
    assert torch.equal(local, torch.cat([hf[f"{e3}.w1.weight"], hf[f"{e3}.w3.weight"]]))
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in last
    assert torch.equal(last["decoder.layers.0.mlp.router.weight"], hf["model.layers.1.block_sparse_moe.gate.weight"])


def test_tied_embeddings_on_one_stage_have_no_output_layer():
    spec = _spec("tiny-llama", tie_embeddings=True)
    hf = _fake_hf(spec)
    del hf["lm_head.weight"]  # transformers does not save a tied head
    assert "output_layer.weight" not in convert.hf_to_megatron(hf, spec)
    last = convert.hf_to_megatron(hf, spec, pp=2, pp_rank=1)
    assert torch.equal(last["output_layer.weight"], hf["model.embed_tokens.weight"])


def test_load_into_refuses_a_mismatch():
    module = torch.nn.Linear(4, 3, bias=False)
    convert.load_into(module, {"weight": torch.ones(3, 4)})
    assert torch.equal(module.weight.detach(), torch.ones(3, 4))
    with pytest.raises(RuntimeError, match="missing"):
        convert.load_into(module, {})
    with pytest.raises(RuntimeError, match="shape"):
        convert.load_into(module, {"weight": torch.ones(4, 3)})


@pytest.mark.parametrize("family, layout", [
    ("llama", dict(tp=2, pp=2)), ("llama", dict(tp=1, pp=1)), ("mixtral", dict(tp=2, pp=1, ep=2)),
    ("mixtral", dict(tp=1, pp=2, ep=2)),
])
def test_every_rank_slice_converts_back_to_the_same_checkpoint(family, layout):
    """hf_to_megatron on every rank of a layout, then megatron_to_hf over all of them: the Hugging Face state
    dict comes back bit for bit (pure slicing and concatenation: exact)."""
    import torch

    from llmadapt.models import init_tensor, tensor_plan
    from llmadapt.spec import MODEL_PRESETS, ModelSpec
    from llmadapt_megatron.convert import hf_to_megatron, megatron_to_hf

    model = ModelSpec(**MODEL_PRESETS[f"tiny-{family}"])
    hf = {name: init_tensor(name, shape, 0, None) for name, shape in tensor_plan(model)}
    tp, pp, ep = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
    slices = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                where = dict(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=ep_rank, etp=tp,
                             etp_rank=tp_rank)
                slices.append((where, hf_to_megatron(hf, model, **where)))
    back = megatron_to_hf(slices, model)
    assert set(back) == set(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
