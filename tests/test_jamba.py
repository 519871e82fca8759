"""The jamba family (transformers' JambaForCausalLM, attention and Mamba layers with MoE blocks): its presets and
their checks, its canonical checkpoint against transformers' model, its FLOP count against a hand count, the
reference adapter and DeepSpeed ZeRO-2/3 on two ranks in fp32 parity with expert load per MoE layer, the slow
path named in the trace, and the stacks that cannot run it refused in one line before launch.

Three launches (~15 s each on 2 cores: the Mamba layers run transformers' sequential PyTorch scan here).
"""

from __future__ import annotations

import pytest

from llmadapt import MODEL_PRESETS, UnsupportedError, WorkloadError
from llmadapt.adapter.plugins import adapters, check_supported, get_adapter
from llmadapt.contract.flops import model_flops_per_token, param_count
from llmadapt.spec import ModelSpec, Workload

JAMBA = Workload.from_dict({
    "kind": "train", "name": "jamba", "model": {"preset": "tiny-jamba"},
    "train": {"seq_len": 32, "global_batch": 4, "steps": 2, "warmup_steps": 1, "lr": 0.003},
})


def preset(name):
    return ModelSpec(name=name, **MODEL_PRESETS[name])


# -- the spec -------------------------------------------------------------------------------------------
def test_tiny_jamba_has_every_kind_of_layer():
    """Jamba's pattern in four layers: Mamba layers with a dense MLP and with an MoE block, an attention layer."""
    assert preset("tiny-jamba").layer_kinds == [("mamba", False), ("mamba", True), ("attention", False),
                                                ("mamba", True)]
    released = preset("jamba-v0.1").layer_kinds
    assert [n for n, (mixer, _) in enumerate(released) if mixer == "attention"] == [4, 12, 20, 28]
    assert [n for n, (_, moe) in enumerate(released) if moe] == list(range(1, 32, 2))


def test_jamba_v01_parameters_match_the_release():
    """ai21labs/Jamba-v0.1: 51.6B parameters, 12B active (its model card: 52B, 12B active)."""
    m = preset("jamba-v0.1")
    assert param_count(m) == 51_570_323_328
    assert param_count(m, active=True) == 12_110_311_296


@pytest.mark.parametrize(("model", "message"), [
    ({"family": "jamba", "num_experts": 4},
     "workload field 'model.attn_layer_period': got None; family 'jamba' needs its layer layout"),
    ({"preset": "tiny-jamba", "attn_layer_offset": 4},
     "workload field 'model.attn_layer_offset': got 4; must be < attn_layer_period=4"),
    ({"preset": "tiny-jamba", "num_experts": 0},
     "workload field 'model.num_experts': got 0; family 'jamba' needs num_experts >= 2"),
    ({"preset": "tiny-llama", "attn_layer_period": 2},
     "workload field 'model.attn_layer_period': got 2; only for family 'jamba'"),
])
def test_bad_jamba_shapes_are_refused_in_one_line(model, message):
    with pytest.raises(WorkloadError) as err:
        Workload.from_dict({"kind": "train", "model": model})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_family_leaves_older_hashes_alone():
    """The jamba layout fields are left out of every hash where unset: the llama and mixtral checkpoints and
    problems keep the identities they had before jamba (values from the commit before it)."""
    from llmadapt.spec.model import checkpoint_key

    llama = Workload.from_dict({"kind": "train", "model": {"preset": "tiny-llama"}})
    mixtral = Workload.from_dict({"kind": "train", "model": {"preset": "tiny-mixtral"}})
    assert checkpoint_key(llama.model, 0) == "b9c6d44cb39fc50adec8"
    assert checkpoint_key(mixtral.model, 0) == "c570ee8b28bb8674c4d2"
    assert llama.problem_hash.startswith("1d852f3b4f5b") and mixtral.problem_hash.startswith("be572aea6922")


# -- the FLOP count -------------------------------------------------------------------------------------
def test_tiny_jamba_flops_per_token_by_hand():
    """6N (every layer as it is) + attention over the attention layer only + 27 x inner x state per Mamba layer."""
    h, kv, ffn, vocab, heads, head_dim, t = 64, 2 * 16, 128, 512, 4, 16, 32
    inner, rank, state, conv, experts, top_k = 128, 4, 16, 4, 4, 2
    attention = 2 * h * h + 2 * h * kv
    mamba = (h * 2 * inner + inner * conv + inner  # in_proj; depthwise conv1d + bias
             + inner * (rank + 2 * state) + rank * inner + inner  # x_proj (dt, B, C); dt_proj + bias
             + inner * h + inner * state + inner + rank + 2 * state)  # out_proj; A_log, D; dt/B/C norms
    dense, moe = 3 * h * ffn, top_k * 3 * h * ffn + h * experts  # active experts + router
    norms = 2 * h
    n = (mamba + dense) + (mamba + moe) + (attention + dense) + (mamba + moe) + 4 * norms + h + h * vocab
    scan = 3 * 9 * inner * state * 3  # three Mamba layers, forward 9 and backward 18 per channel and state
    assert n == param_count(preset("tiny-jamba"), active=True, embedding=False) == 291_628
    assert model_flops_per_token(preset("tiny-jamba"), t) == 6 * n + 12 * 1 * heads * head_dim * t + scan
    assert scan == 165_888


def test_the_parameter_count_is_transformers_own():
    """Total and active counts against the model transformers builds from the canonical checkpoint's config."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmadapt.models import canonical_checkpoint

    folder = canonical_checkpoint(JAMBA.model, JAMBA.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == param_count(JAMBA.model)


# -- the checkpoint -------------------------------------------------------------------------------------
def test_checkpoint_loads_into_transformers_jamba_without_gaps():
    """Every tensor the plan writes is one JambaForCausalLM expects (no missing, unexpected or mismatched keys),
    its Mamba parameters as transformers initialises them, and the untrained loss is near ln(vocab); Mamba
    layers that lost their skip connection (D = 0) move the loss beyond the parity tolerance."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from llmadapt.analysis.paritycheck import PARITY_ATOL, PARITY_RTOL
    from llmadapt.models import canonical_checkpoint

    folder = canonical_checkpoint(JAMBA.model, JAMBA.seed)
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "JambaForCausalLM"
    assert info["missing_keys"] == info["unexpected_keys"] == set() and not info["mismatched_keys"]
    mixer = model.model.layers[0].mamba
    assert torch.equal(mixer.A_log[5], torch.log(torch.arange(1, 17, dtype=torch.float32)))
    assert torch.equal(mixer.D, torch.ones(128)) and not mixer.dt_proj.bias.any() and not mixer.conv1d.bias.any()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(input_ids=tokens, labels=tokens).loss.item()
        assert abs(loss - 6.238) < 0.1  # ln 512: a sane untrained model
        for n in (0, 1, 3):
            model.model.layers[n].mamba.D.zero_()
        broken = model(input_ids=tokens, labels=tokens).loss.item()
    assert abs(broken - loss) > PARITY_ATOL + PARITY_RTOL * loss, (loss, broken)


# -- refusals before launch ------------------------------------------------------------------------------
@pytest.mark.parametrize(("adapter", "sets"), [
    ("megatron", []),
    ("megatron", ["kind=finetune", "lora.rank=8"]),  # megatron-core runs no LoRA: the family line comes first
    ("colossalai", []),
])
def test_stacks_without_jamba_refuse_it_in_one_line(adapter, sets):
    if adapter not in adapters():
        pytest.skip(f"the {adapter} adapter is not registered")
    with pytest.raises(UnsupportedError) as err:
        check_supported(get_adapter(adapter), JAMBA.with_overrides(sets))
    assert str(err.value).startswith(f"adapter {adapter!r} cannot run model.family='jamba': this adapter does not "
                                     "run jamba models; use deepspeed or torch")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("adapter", ["vllm", "llamacpp", "hf"])
def test_serving_engines_refuse_jamba_in_one_line(adapter):
    """No serving adapter declares jamba (none was run with it): refused, saying so."""
    if adapter not in adapters():
        pytest.skip(f"the {adapter} adapter is not registered")
    serve = Workload.from_dict({"kind": "serve", "model": {"preset": "tiny-jamba"}})
    with pytest.raises(UnsupportedError, match=rf"^adapter '{adapter}' cannot run model.family='jamba': this adapter "
                                               r"does not run jamba models; no installed adapter runs this: "
                                               r"[\w, -]+ refuse model.family='jamba'( \(and \d more\))?$"):
        check_supported(get_adapter(adapter), serve)


@pytest.mark.parametrize("adapter", ["torch", "deepspeed"])
def test_quantized_jamba_is_refused_naming_no_stack_that_refuses_it_too(adapter):
    """Neither stack that runs jamba quantizes it: each refuses, and says no adapter runs it rather than naming
    the other (which would refuse it in turn)."""
    if adapter not in adapters():
        pytest.skip(f"the {adapter} adapter is not registered")
    other = "deepspeed" if adapter == "torch" else "torch"
    with pytest.raises(UnsupportedError) as err:
        check_supported(get_adapter(adapter), JAMBA.with_overrides(["kind=finetune", "lora.rank=8",
                                                                    "optimizations.quantization=nf4"]))
    message = str(err.value)
    assert message.startswith(f"adapter {adapter!r} cannot run optimizations.quantization='nf4': none for jamba")
    assert f"{other} can" not in message and " can" not in message.split("; ", 1)[1]
    assert "no installed adapter runs this: " in message
    assert f"{other} refuses optimizations.quantization='nf4'" in message


def test_estimate_refuses_jamba():
    from llmadapt import LlmadaptError
    from llmadapt.analysis.perf.estimate import estimate

    with pytest.raises(LlmadaptError, match="estimate models llama and mixtral layers only, not jamba's"):
        estimate(JAMBA, "A100-80GB")


# -- runs: the reference, DeepSpeed ZeRO-2 and ZeRO-3 on two ranks ----------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from llmadapt.launch.runner import run

    out = tmp_path_factory.mktemp("jamba")
    if "deepspeed" not in adapters():
        pytest.skip("the deepspeed adapter is not registered")
    layouts = {"torch": ("torch", []),
               "zero2": ("deepspeed", ["optimizations.zero_stage=2", "parallelism.dp=2", "train.micro_batch=1"]),
               "zero3": ("deepspeed", ["optimizations.zero_stage=3", "parallelism.dp=2", "train.micro_batch=1"])}
    results = {}
    for label, (adapter, sets) in layouts.items():
        result = run(JAMBA.with_overrides(sets), adapter, out=out, timeout=900)
        assert result.ok, result.summary.failures
        results[label] = result
    return results


def _records(result, rank=0):
    from llmadapt.contract.jsonl import read_jsonl

    return read_jsonl(result.run_dir / f"rank-{rank:05d}.jsonl")


@pytest.mark.parametrize("layout", ["zero2", "zero3"])
def test_deepspeed_matches_the_reference_with_expert_load(runs, layout):
    """fp32 losses agree at every step within llmadapt's parity tolerance (rtol 1e-4, atol 1e-5: reduction order
    over two ranks and ZeRO's flat buffers moves the loss by ~1e-7, a wrong layer by >1e-2, see the checkpoint
    test); the expert load of both MoE layers agrees but for near-ties, and is global on every rank."""
    from llmadapt.analysis.paritycheck import expert_load_parity, loss_parity

    reference, result = runs["torch"], runs[layout]
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch", f"deepspeed {layout} dp2"))
    loads = expert_load_parity(_records(reference), _records(result))
    assert loads.ok, loads.describe(("torch", f"deepspeed {layout} dp2"))
    steps = [r for r in _records(result) if r["type"] == "step"]
    assert [len(s["expert_load"]) for s in steps] == [2] * 3  # the two MoE layers (1 and 3)
    assert all(sum(layer) == 4 * 32 * 2 for s in steps for layer in s["expert_load"])  # every token, top-2
    assert [s["expert_load"] for s in steps] == [r["expert_load"] for r in _records(result, rank=1)
                                                 if r["type"] == "step"]


def test_the_trace_names_the_slow_path(runs):
    """Without mamba_ssm and causal_conv1d, every run's header and summary say which functions ran transformers'
    PyTorch reference, and `show` prints it."""
    from llmadapt.analysis.report import render_summary, show

    for result in runs.values():
        header = _records(result)[0]
        assert header["notes"] == result.summary.notes
        (note,) = result.summary.notes
        assert note.startswith("slow path: transformers' JambaMambaMixer runs its PyTorch reference for "
                               "mamba_selective_scan, causal_conv1d_fn (causal_conv1d, mamba_ssm not installed)")
    assert f"note       {note}" in render_summary(show(runs["zero3"].run_dir)).splitlines()


@pytest.mark.parametrize("adapter, sets", [
    ("torch", []), ("deepspeed", ["optimizations.zero_stage=2", "parallelism.dp=2", "train.micro_batch=1"])])
def test_the_breakdown_names_the_mamba_mixer_and_adds_up(adapter, sets, tmp_path):
    """Jamba's Mamba mixers have a class of their own ('mixer', by their structure: A_log, D, a causal conv1d),
    with forward and backward time; the router is 'moe.router'; nothing is 'unclassified'; and every rank's step
    meets the bound of every other stack's (test_breakdown.assert_attributed: named classes at least 95%, each
    class's forward, backward and outside adding up to it). Before, the mixers' 93% of the step sat in 'model'."""
    from test_breakdown import assert_attributed

    from llmadapt.launch.runner import run
    from llmadapt.testing import environments_unready

    reason = environments_unready(adapter) or (None if adapter in adapters() else f"{adapter} is not registered")
    if reason:
        pytest.skip(reason)
    result = run(JAMBA.with_overrides([*sets, "train.steps=4", "profile.steps=[2,3,4]", "profile.level=operator"]),
                 adapter, out=tmp_path, timeout=900)
    assert result.ok, result.summary.failures
    for rank in range(result.summary.world_size):
        records = _records(result, rank)
        assert_attributed(records, (adapter, rank))
        for b in (r for r in records if r["type"] == "breakdown"):
            classes = {c["name"]: c for c in b["modules"]}
            assert "unclassified" not in classes, classes["unclassified"]
            mixer = classes["mixer"]
            assert mixer["forward_seconds"] > 0 and mixer["backward_seconds"] > 0, mixer
            assert classes["moe.router"]["seconds"] > 0 and classes["moe.experts"]["seconds"] > 0
            # the mixers run three of four layers: they, not the blocks' glue, hold the larger share
            assert mixer["seconds"] > classes["model"]["seconds"], (mixer, classes["model"])
