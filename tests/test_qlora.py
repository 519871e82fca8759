"""Quantized fine-tunes end to end: a QLoRA run (bitsandbytes 4-bit nf4 or fp4, or 8-bit base weights, LoRA on
top) is saved as a plain model folder, LoRA merged into the base weights dequantized to the dtype they were loaded
in; evaluation before and after reads that folder, and the hf engine serves it.

Tolerances. A 4-bit layer computes with its weight dequantized (bitsandbytes' CPU path: dequantize, then a plain
matmul), so the saved folder's forward pass is the trained model's up to float reassociation of the LoRA term
(B A x added before or after the matmul): logits within 1e-4. An 8-bit layer also quantizes its activations
(LLM.int8()), which the saved fp32 folder does not: logits within 5% of their spread. A saving bug (a weight left
quantized, LoRA not merged, the wrong scale) moves logits by far more than either: the test shows it by merging
without LoRA's update.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from llmadapt import Workload, run
from llmadapt.models import canonical_checkpoint
from llmadapt.testing import environments_unready

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QLORA = ["kind=finetune", "lora.rank=4", "lora.target_modules=[q_proj,v_proj,down_proj]", "train.steps=3",
         "train.warmup_steps=1", "train.lr=0.01", "telemetry.interval_s=0"]


def quantized_peft_model(quant: str, example: str = "tiny-llama.toml", targets=("q_proj", "v_proj", "down_proj"),
                         experts: bool = False):
    """The canonical tiny Llama (or another example's model) loaded as the reference adapter loads it for QLoRA,
    LoRA B made non-zero (as after training) so that merging matters. ``experts``: transformers 5's fused experts
    quantized too, as the adapters do (llmadapt.adapter.quantization)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    w = Workload.from_file(EXAMPLES / example)
    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_compute_dtype=torch.float32)
              if quant != "int8" else BitsAndBytesConfig(load_in_8bit=True))
    base = AutoModelForCausalLM.from_pretrained(str(canonical_checkpoint(w.model, w.seed)), dtype=torch.float32,
                                                quantization_config=config, device_map={"": "cpu"})
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    if experts:
        from llmadapt.adapter import quantization

        assert quantization.quantize_fused_experts(model, quant)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    # In training mode, as trained (bitsandbytes' CPU inference path repacks 4-bit weights in blocks this tiny
    # model's shapes do not divide into); dropout is 0 here, so the forward pass is the same.
    return model.train()


@pytest.mark.parametrize("quant, tolerance", [("nf4", 1e-4), ("fp4", 1e-4), ("int8", 0.05)])
def test_a_quantized_lora_model_saves_as_the_model_it_computes(quant, tolerance, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from llmadapt.adapter import weights

    model = quantized_peft_model(quant)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    weights.save_hf_model(model, tmp_path / "saved", write=True)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32).eval()
    assert not any(type(p).__name__ in ("Params4bit", "Int8Params") for p in saved.parameters())
    with torch.no_grad():
        served = saved(input_ids=ids).logits
    limit = tolerance if quant != "int8" else tolerance * float(trained.std())
    assert float((served - trained).abs().max()) <= limit

    # a save that lost LoRA's update (the bug a wrong merge makes) is caught by the same tolerance
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    weights.save_hf_model(model, tmp_path / "lost", write=True)
    lost = AutoModelForCausalLM.from_pretrained(str(tmp_path / "lost"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert float((lost(input_ids=ids).logits - trained).abs().max()) > limit


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "experts"])
def test_a_quantized_mixtral_saves_in_the_published_layout(experts, tmp_path):
    """transformers 5 holds Mixtral's experts fused in memory (mlp.experts.gate_up_proj) and publishes them as
    block_sparse_moe.experts.N.w1/w2/w3: a QLoRA save writes the published layout, which every loader and the
    model-folder check read, and computes what the quantized model computed (tolerance as for nf4 above); also with
    the fused experts quantized and LoRA on them and the router (study B's recipe): their updates merged."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmadapt.adapter import weights
    from llmadapt.modelfolder import shape_of

    model = (quantized_peft_model("nf4", "tiny-mixtral.toml", ("w1", "w2", "w3", "gate", "q_proj"), experts=True)
             if experts else quantized_peft_model("nf4", "tiny-mixtral.toml"))
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    weights.save_hf_model(model, tmp_path / "saved", write=True)
    names = set(weights.CheckpointWeights(tmp_path / "saved"))
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names, sorted(names)[:8]
    assert not any(".mlp.experts." in n for n in names)
    w = Workload.from_file(EXAMPLES / "tiny-mixtral.toml")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the core adds the tokenizer to a saved model
        shutil.copy(canonical_checkpoint(w.model, w.seed) / name, tmp_path / "saved" / name)
    shape_of(tmp_path / "saved")  # the pre-launch check: raises on a tensor the config implies and the folder lacks
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert float((saved(input_ids=ids).logits - trained).abs().max()) <= 1e-4


@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
def test_a_qlora_fine_tune_is_saved_evaluated_before_and_after_and_served(tmp_path):
    workload = Workload.from_file(EXAMPLES / "tiny-llama.toml").with_overrides(
        [*QLORA, "optimizations.quantization=nf4", "eval.examples=4", f"save.path={tmp_path / 'qlora'}",
         "profile.steps=[2]", "profile.level=operator"])
    result = run(workload, "torch", out=tmp_path / "runs", launcher="inline")
    assert result.ok, result.summary.failures
    # dequantising the 4-bit base is a class of its own in the breakdown, not 'other'. Its share is timing: a fifth
    # of this step on a quiet machine, 2% of one profiled step on two cores three jobs shared: present is what holds.
    operators = {o.name: o.seconds for o in result.summary.breakdown.operators}
    assert operators.get("dequantization", 0.0) > 0, operators
    assert operators.get("other", 0.0) <= 0.05 * sum(operators.values()), operators
    steps = [e.step for e in result.summary.evaluations]
    assert steps == [0, workload.train.total_steps]  # before and after
    assert all(e.loss is not None for e in result.summary.evaluations)
    assert result.summary.model_flops_per_token  # counted for QLoRA (frozen base: no weight gradients)
    serve = Workload.from_file(EXAMPLES / "serve-tiny.toml").with_overrides(
        [f"model.path={tmp_path / 'qlora'}", "serve.requests=4", "serve.warmup_requests=0", "serve.arrival.rate=4"])
    served = run(serve, "hf", out=tmp_path / "runs")
    assert served.ok, served.summary.failures
    assert served.summary.serving.completed == 4


EXPERTS_QLORA = ["kind=finetune", "lora.rank=4", 'lora.target_modules=["w1", "w2", "w3", "gate"]',
                 "optimizations.quantization=nf4", "train.steps=2", "train.warmup_steps=1", "train.lr=0.01",
                 "telemetry.interval_s=0"]


def expected_experts(workload) -> tuple[int, int]:
    """The tiny Mixtral's expert parameters (w1, w2, w3 of every expert of every layer) and their nf4 bytes: half a
    byte per parameter, an fp32 absmax per block of 64 and one 16-entry fp32 code table per tensor (two fused
    tensors per layer: gate_up_proj and down_proj)."""
    m = workload.model
    params = m.num_layers * m.num_experts * 3 * m.hidden_size * m.intermediate_size
    return params, params // 2 + params // 64 * 4 + 2 * m.num_layers * 16 * 4


def assert_experts_in_4_bit(result, workload) -> None:
    """The trace's header (and the summary) says the experts are held nf4, with their byte count; no class QLoRA
    quantizes holds float matrices."""
    from llmadapt.contract.jsonl import read_jsonl
    from llmadapt.contract.rundir import RunDir

    header = read_jsonl(RunDir(result.run_dir).rank_file(0))[0]
    rows = {(w["module_class"], w["format"]): w for w in header["weights"]}
    params, stored = expected_experts(workload)
    experts = rows[("moe.experts", "nf4")]
    assert (experts["params"], experts["stored_bytes"], experts["unquantized_bytes"]) == (params, stored, params * 4), rows
    assert not [k for k in rows if k[0].startswith(("attention.", "mlp", "moe.experts")) and k[1] != "nf4"], rows
    assert {(w.module_class, w.format) for w in result.summary.weights} == set(rows)


@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
def test_a_nf4_mixtral_holds_its_experts_in_4_bit(tmp_path):
    """transformers 5 fuses Mixtral's experts into 3-D parameters that bitsandbytes leaves alone: with nf4 they are
    quantized too (bitsandbytes' functional API), LoRA on them still trains, and the trace says what each module
    class holds; `show` prints it, the estimate counts the same parameters quantized, and the profiled step's module x
    operator table has the experts' dequantization."""
    from llmadapt.analysis.perf.estimate import rank_params
    from llmadapt.analysis.report import summary_text

    workload = Workload.from_file(EXAMPLES / "tiny-mixtral.toml").with_overrides(
        [*EXPERTS_QLORA, "profile.steps=[2]", "profile.level=operator"])
    result = run(workload, "torch", out=tmp_path, launcher="inline")
    assert result.ok, result.summary.failures
    assert_experts_in_4_bit(result, workload)
    # the experts' dequantization is theirs in the breakdown, as attention's is attention's
    cross = {c.name: c.seconds for c in result.summary.breakdown.module_operators}
    assert cross.get("moe.experts/dequantization", 0) > 0 and cross.get("attention.qkv/dequantization", 0) > 0, cross
    losses = result.summary.losses
    assert all(math.isfinite(x) for x in losses) and losses[0] != losses[-1]  # LoRA on the 4-bit experts trains
    # the estimate describes the model the run held: the same parameters quantized, the same in all
    params = rank_params(workload)
    assert params.quantized == sum(w.params for w in result.summary.weights if w.format == "nf4")
    assert params.total == sum(w.params for w in result.summary.weights)
    text = summary_text(json.loads((result.run_dir / "summary.json").read_text()))
    assert "weights    nf4: " in text and "moe.experts 4 (" in text, text


def test_a_quantization_that_leaves_a_class_unquantized_is_refused(monkeypatch):
    """Where a stack cannot quantize a part QLoRA quantizes (here: the fused experts, as bitsandbytes alone leaves
    them), the check before step 0 refuses the run naming the module class."""
    import torch

    from llmadapt.adapter import quantization

    model = quantized_peft_model("nf4", "tiny-mixtral.toml")
    monkeypatch.setattr(quantization, "quantize_fused_experts", lambda model, quant: {})
    with pytest.raises(RuntimeError, match=r"optimizations.quantization=nf4 does not cover .*moe\.experts: 4 weight "
                                           r"matrices stay fp32 \(e\.g\. .*layers\.0\.mlp\.experts\.gate_up_proj\)"):
        quantization.quantize_and_check(model, "nf4", torch.float32)

