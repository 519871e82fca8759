"""Model FLOPs per token (PaLM convention) against hand counts."""

import pytest

from llmadapt import MODEL_PRESETS
from llmadapt.contract.flops import mfu, model_flops_per_token, param_count, peak_flops
from llmadapt.spec import ModelSpec


def preset(name):
    return ModelSpec(name=name, **MODEL_PRESETS[name])


def test_llama2_7b_parameter_count_matches_the_published_total():
    """6,738,415,616 parameters, as the released checkpoint has."""
    assert param_count(preset("llama2-7b")) == 6_738_415_616


def test_mixtral_total_and_active_parameters():
    """46.7B total; 12.75B active non-embedding (2 of 8 experts, router included)."""
    m = preset("mixtral-8x7b")
    assert param_count(m) == 46_702_792_704
    # by hand, per layer: attention 2*4096^2 + 2*4096*1024, two experts 2*3*4096*14336,
    # router 4096*8, norms 2*4096; times 32 layers; + final norm + output projection 4096*32000
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 2 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096
    assert param_count(m, active=True, embedding=False) == 32 * layer + 4096 + 4096 * 32000


def test_tiny_llama_flops_per_token_by_hand():
    """GQA shrinks K/V projections; SwiGLU has three matrices; attention term over all query heads."""
    h, kv, ffn, layers, heads, head_dim, vocab, t = 64, 2 * 16, 176, 2, 4, 16, 512, 64
    n = layers * (2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h) + h + h * vocab
    assert model_flops_per_token(preset("tiny-llama"), t) == 6 * n + 12 * layers * heads * head_dim * t == 849_792


def test_llama2_70b_flops_per_token():
    """70B at 4096 tokens: 6N + 12*L*H*Q*T with N the non-embedding count."""
    m = preset("llama2-70b")
    n = param_count(m, embedding=False)
    assert model_flops_per_token(m, 4096) == 6 * n + 12 * 80 * 64 * 128 * 4096
    assert n == pytest.approx(68.7e9, rel=0.01)


def test_mfu_needs_a_known_peak():
    """MFU on an H100 in bf16 uses 989.4 TFLOP/s; unknown devices (CPUs) give None."""
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("AMD EPYC", "fp32") is None
    assert mfu(1e9, 1000.0, 1e13, 1) == pytest.approx(0.1)
    assert mfu(1e9, 1000.0, None, 1) is None


@pytest.mark.parametrize("reported, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
    ("NVIDIA A40", "bf16", 149.7e12),                 # not among the four the old table knew
    ("NVIDIA GeForce RTX 4090", "fp16", None),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5e12),
    # every name torch reports for the H100/H200/A100 variants, each with its own datasheet's dense peak
    ("NVIDIA H200", "bf16", 989.4e12),
    ("NVIDIA H200 NVL", "bf16", 835.5e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 NVL", "fp8", 1670.5e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100 80GB PCIe", "tf32", 156e12),
    ("NVIDIA A100-PCIE-40GB", "bf16", 312e12),
    ("nvidia  a100_sxm4-80gb", "bf16", 312e12),        # normalised: case, '-', '_' and spaces
    ("NVIDIA RTX A4000", "bf16", None),               # "A40" followed by digits is another device
    ("AMD EPYC 7B13", "fp32", None),                  # CPUs: measured, never a datasheet MFU
])
def test_mfu_peaks_come_from_the_device_catalog(reported, precision, peak):
    """The device a run reports is found by the catalog's names and aliases, normalised; never by a guess."""
    from llmadapt.contract.catalog import load_catalog

    if reported.endswith("4090"):
        peak = load_catalog()["RTX4090"].peak(precision)
        assert peak
    assert peak_flops(reported, precision) == peak


def test_each_gpu_variant_is_its_own_entry():
    """PCIe, SXM and NVL parts differ in memory and bandwidth: each reported name finds its own entry."""
    from llmadapt.contract.catalog import device_for_reported, find_device

    names = {r: device_for_reported(r).name for r in (
        "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
        "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB")}
    assert len(set(names.values())) == len(names), names
    assert device_for_reported("NVIDIA H100 PCIe").memory_bandwidth == 2.0e12
    assert device_for_reported("NVIDIA A100 80GB PCIe").memory_bandwidth == 1.935e12
    assert find_device("h100-nvl").memory_bytes == 94e9 and find_device("A100 PCIe 40GB").name == "A100-PCIe-40GB"


def test_lora_quantized_and_recomputed_runs_have_their_flops():
    """LoRA: the frozen base costs 4 FLOPs per parameter and token (no weight gradients), the adapters 6; a
    quantized base is the dense math it stands for; HFU adds the forward that recomputation runs again."""
    from pathlib import Path

    from llmadapt import Workload
    from llmadapt.contract.flops import training_flops

    w = Workload.from_file(Path(__file__).resolve().parents[1] / "examples" / "tiny-llama.toml")
    m, t = w.model, w.train.seq_len
    full = model_flops_per_token(m, t)
    attention = 12 * m.num_layers * m.num_heads * m.head_dim * t
    n = param_count(m, active=True, embedding=False)
    assert training_flops(w) == (full, full)  # no recomputation: hardware = model
    assert training_flops(w.with_overrides(["optimizations.recompute=full"])) == (full, full * 4 / 3)
    lora = w.with_overrides(["kind=finetune", "lora.rank=8", "lora.target_modules=[q_proj,v_proj]"])
    q = m.hidden_size + m.num_heads * m.head_dim
    v = m.hidden_size + m.num_kv_heads * m.head_dim
    adapters = 8 * (q + v) * m.num_layers
    assert training_flops(lora)[0] == pytest.approx(4 * n + 6 * adapters + attention)
    quantized = lora.with_overrides(["optimizations.quantization=nf4"])
    assert training_flops(quantized) == training_flops(lora)
