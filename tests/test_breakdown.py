"""Where a step's time goes (workload.profile): torch.profiler on chosen steps, one module and operator taxonomy
on every stack, collectives with their bandwidth and overlap, GEMM FLOPs against the model's formula, telemetry
and expert imbalance. The profiled runs are real (torch, DeepSpeed ZeRO-3, Megatron-core tp=2, ColossalAI ZeRO-2,
on gloo)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt import Workload, compare
from llmadapt.adapter.breakdown import MODULE_CLASSES, hf_module_class, layer_index, operator_class, split_module
from llmadapt.analysis.report import export, render_summary
from llmadapt.contract.breakdowns import expert_imbalance, imbalance
from llmadapt.contract.flops import param_count
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.schema import validate
from llmadapt.errors import LlmadaptError, WorkloadError
from llmadapt.runtime.timeline import analyse
from llmadapt.testing import environments_unready

ROOT = Path(__file__).resolve().parents[1]
# Steps big enough that operators, not the per-step Python of a 2-layer model, fill most of the step.
PROFILED = ["train.seq_len=256", "train.global_batch=16", "train.micro_batch=8", "train.warmup_steps=2",
            "train.steps=2", "profile.steps=[3]", "profile.level=operator"]
STACKS = ["torch", "deepspeed:parallelism.dp=2,optimizations.zero_stage=3", "megatron:parallelism.tp=2",
          "colossalai:parallelism.dp=2,optimizations.zero_stage=2"]
# Study A's parts, on every stack (eager attention: scores, softmax, weighted sum apart)
NAMED = {"embedding", "attention.qkv", "attention.rotary", "attention.qk", "attention.softmax", "attention.av",
         "attention.out", "norm", "model", "lm_head", "loss", "optimizer"}


def workload(name: str, *extra: str) -> Workload:
    return Workload.from_file(ROOT / "examples" / f"{name}.toml").with_overrides([*PROFILED, *extra])


def records_of(run_dir: Path, rank: int = 0) -> list[dict]:
    records = read_jsonl(Path(run_dir) / f"rank-{rank:05d}.jsonl")
    for r in records:
        validate(r)
    return records


THREE = ["train.steps=4", "profile.steps=[3,4,5]"]  # one measured step (2), three profiled


def assert_attributed(records: list[dict], where: object = "") -> None:
    """Every profiled step's classes add up to it, and each class's forward, backward and outside time to it; at
    most 5% of its operator time is in operator class 'other'; the best of its three profiled steps has at least
    95% in named module classes ('other' and 'unclassified' are not named). A stall of the machine (a
    neighbour taking the core) lands in 'other' while the thread waits between operators: the time the thread
    waited for a core (its run delay, which the record carries) is not the taxonomy's to name and is taken off
    'other'. Not every stall shows as a wait for a core (what else it was is not examined: a sibling
    hyperthread's load and a descheduled GIL holder would not show): on a loaded CI machine two of three steps
    of Megatron-core pp2 kept 7% in 'other' beyond their waits, which the median failed on. A class the
    taxonomy misses is in every step, busy or not, so the best step still shows it: classes summed to 2x the
    step (torch recompute=full) and Megatron-core's nested backward (22% 'other') fail in every step. A gap near
    the bound itself is not caught on a loaded machine: with the pipeline's P2P timing removed, pp2's last stage
    kept 5-20% in 'other' a step, and one step in three hid it behind a long wait for a core (median and best
    alike passed under load; it was found on a quiet machine)."""
    named = []
    for b in (r for r in records if r["type"] == "breakdown"):
        assert b.get("error") is None, (where, b["step"], b["error"])  # profiling itself failed on this step
        if b["operators"]:  # a framework's own machinery has a class named for what it does, not 'other'
            ops = sum(c["seconds"] for c in b["operators"])
            other_ops = sum(c["seconds"] for c in b["operators"] if c["name"] == "other")
            assert other_ops <= 0.05 * ops, (where, b["step"], b["other_operators"])
        total = sum(c["seconds"] for c in b["modules"])
        # Every event's own time on the step's threads is counted once (1e-6 relative: float sums)
        assert total == pytest.approx(b["step_seconds"], rel=1e-6), where
        # Each class's time is its forward, its backward and what ran outside both (the optimizer, waits, the
        # adapter's code), none negative (1e-6 of the step: float sums); a loss is forward work wherever it runs
        for c in b["modules"]:
            rest = c["seconds"] - c["forward_seconds"] - c["backward_seconds"]
            assert min(c["forward_seconds"], c["backward_seconds"], rest) >= -1e-6 * total, (where, b["step"], c)
            if c["name"] == "loss":
                assert c["forward_seconds"] > 0 and rest <= 1e-6 * total, (where, b["step"], c)
        # the thread's waits for a core lie inside the step's range: at most its length (the scheduler's clock and
        # the profiler's differ by a little: 2% and 1 ms of slack, reached when a loaded machine starves the step)
        assert b["descheduled_seconds"] is not None, (where, b["step"], b["step_seconds"], b["error"])
        assert 0 <= b["descheduled_seconds"] <= 1.02 * b["step_seconds"] + 1e-3, where
        # a part of the model no class names ('unclassified') is as unnamed as 'other'
        other = sum(c["seconds"] for c in b["modules"] if c["name"] in ("other", "unclassified"))
        named.append((1 - max(other - b["descheduled_seconds"], 0.0) / total, b["step"], b["other"][:3],
                      b["descheduled_seconds"]))
    assert len(named) == 3 and max(named)[0] >= 0.95, (where, named)


# -- what is refused before anything starts ----------------------------------------------------
@pytest.mark.parametrize(("setting", "message"), [
    ("profile.steps=[1]", "step 1 is not a measured step: measured steps are 2..3"),
    ("profile.steps=[9]", "step 9 is not a measured step"),
    ("profile.steps=[3,3]", "names a step twice"),
    ("profile.level=kernel", "allowed: module, operator, full"),
    ("telemetry.interval_s=-1", "must be >= 0.0"),
])
def test_bad_profile_settings_are_one_line_before_anything_starts(tmp_path, setting, message):
    with pytest.raises(WorkloadError, match=message.replace(".", r"\.")):
        workload("tiny-llama", setting)
    done = subprocess.run([sys.executable, "-m", "llmadapt.cli", "run", str(ROOT / "examples" / "tiny-llama.toml"),
                           "--out", str(tmp_path), *[a for s in [*PROFILED[:-2], setting] for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())


def test_profiling_a_serve_workload_is_refused():
    with pytest.raises(WorkloadError, match="profiling is for train and finetune workloads"):
        Workload.from_dict({"kind": "serve", "serve": {"url": "http://127.0.0.1:1"}, "profile": {"steps": [0]}})


# -- the taxonomy and the arithmetic, without a run ---------------------------------------------
def test_the_taxonomy_names_transformers_modules_and_operators():
    assert hf_module_class("model.layers.0.self_attn.q_proj", "Linear") == "attention.qkv"
    assert hf_module_class("module.model.layers.1.self_attn", "LlamaAttention") == "attention.core"  # DeepSpeed
    assert hf_module_class("model.layers.0.block_sparse_moe.gate", "Linear") == "moe.router"  # transformers 4.x
    assert hf_module_class("model.layers.0.mlp.gate", "MixtralTopKRouter") == "moe.router"  # transformers 5.x
    assert hf_module_class("model.layers.0.mlp", "MixtralSparseMoeBlock") == "moe.dispatch"
    assert hf_module_class("model.layers.0.block_sparse_moe.experts.3", "MixtralBlockSparseTop2MLP") == "moe.experts"
    assert hf_module_class("model.layers.0.block_sparse_moe.experts.3.w1", "Linear") == "moe.experts"
    assert hf_module_class("model.layers.0.mlp", "LlamaMLP") == "mlp"
    assert hf_module_class("model.layers.0.mlp.gate_proj", "Linear") == "mlp.gate"  # the MLP's, not a router
    assert [hf_module_class(f"model.layers.0.mlp.{n}", "Linear") for n in ("up_proj", "down_proj", "act_fn")] == [
        "mlp.up", "mlp.down", None]  # the activation is the MLP's own code (split_module)
    assert hf_module_class("model.layers.0.mlp.experts.gate_up_proj", "Linear") == "moe.experts"
    assert hf_module_class("model.layers.0", "LlamaDecoderLayer") == "model"  # residual adds, the block's glue
    assert hf_module_class("", "LlamaForCausalLM") == "model" and hf_module_class("lm_head", "Linear") == "lm_head"
    assert hf_module_class("", "DistributedDataParallel") == "communication"
    assert layer_index("module.model.layers.12") == 12 and layer_index("model.layers.1.mlp") is None
    assert [operator_class(n) for n in ("aten::mm", "aten::addmm", "aten::_softmax", "aten::copy_",
                                        "aten::native_layer_norm", "c10d::allreduce_", "gloo:all_gather",
                                        "aten::_foreach_mul_", "aten::silu")] == [
        "gemm", "gemm", "softmax", "memory", "normalization", "all_reduce", "all_gather", "optimizer",
        "elementwise"]
    # the frameworks' own machinery, each named for what it does
    assert [operator_class(n) for n in (
        "torch::autograd::AccumulateGrad", "PreBackwardFunctionForModuleBackward", "PostBackwardFunctionModule",
        "MulBackward0", "torch::autograd::CopySlices", "LinearWithGradAccumulationAndAsyncCommunicationBackward",
        "_ReduceFromModelParallelRegion", "LinearFunctionForZeroStage3", "ProfilerStep#3")] == [
        "gradient_accumulation", "parameter_hooks", "parameter_hooks", "autograd", "autograd", "autograd",
        "framework_function", "framework_function", "other"]
    # a quantized base (bitsandbytes' ops on the CPU basis): dequantising the weights is a class of its own
    assert [operator_class(n) for n in (
        "bitsandbytes::dequantize_4bit", "bitsandbytes::int8_mm_dequant", "bitsandbytes::int8_vectorwise_quant",
        "bitsandbytes::gemm_4bit", "bitsandbytes::int8_linear_matmul", "bitsandbytes::optimizer_update_8bit")] == [
        "dequantization", "dequantization", "dequantization", "gemm", "gemm", "other"]


def test_a_new_family_is_classified_by_its_structure_or_shown_unclassified():
    """A model no classifier knows by name: its state-space mixer (A_log, D, a causal conv1d), its experts (a list
    of identical MLPs beside a router of one row per expert), its embedding, norm and vocabulary projection land
    in named classes by their structure; a part with weights that nothing names is 'unclassified', shown with its
    time instead of hidden in the block around it. Transformers' Jamba, Llama and Mixtral modules as they are."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from llmadapt.adapter.structure import module_classes

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d, self.in_proj = nn.Conv1d(8, 8, 4, groups=8), nn.Linear(8, 16)
            self.A_log, self.D = nn.Parameter(torch.zeros(8, 4)), nn.Parameter(torch.ones(8))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.route, self.bank = nn.Linear(8, 4, bias=False), nn.ModuleList(Mlp() for _ in range(4))

    class Scale(nn.Module):  # a norm by its weights: one 1-D scale
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.ffn, self.scale, self.novel = Mixer(), Moe(), Scale(), Mlp()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.layers, self.out = nn.Embedding(32, 8), nn.ModuleList([Block(), Block()]), nn.Linear(8, 32)

    classes = module_classes(Net(), hf_module_class)
    assert {n: classes[n] for n in ("", "tok", "layers", "layers.0", "layers.0.mix", "layers.0.mix.conv1d",
                                    "layers.0.mix.in_proj", "layers.0.ffn", "layers.0.ffn.route",
                                    "layers.0.ffn.bank.2", "layers.0.ffn.bank.2.fc1", "layers.1.scale",
                                    "layers.1.novel", "layers.1.novel.fc1", "out")} == {
        "": "unclassified", "tok": "embedding", "layers": None, "layers.0": "model", "layers.0.mix": "mixer",
        "layers.0.mix.conv1d": None, "layers.0.mix.in_proj": None, "layers.0.ffn": "moe.dispatch",
        "layers.0.ffn.route": "moe.router", "layers.0.ffn.bank.2": "moe.experts", "layers.0.ffn.bank.2.fc1": None,
        "layers.1.scale": "norm", "layers.1.novel": "unclassified", "layers.1.novel.fc1": None, "out": "lm_head"}
    # DeepSpeed ZeRO-3 leaves each rank an empty shard of every weight (its shape in ds_shape): the same classes
    net = Net()
    for p in net.parameters():
        p.ds_shape, p.data = tuple(p.shape), torch.empty(0)
    assert module_classes(net, hf_module_class) == classes
    # the model's own code (a root the stack names 'model') leaves its known parts as they were
    named = module_classes(Net(), lambda n, t: "model" if n == "" else hf_module_class(n, t))
    assert named[""] == "model" and named["layers.1.novel"] == "unclassified"
    # transformers' families: by name where the taxonomy knows them, Jamba's Mamba mixer and router by structure
    transformers = pytest.importorskip("transformers")
    jamba = transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=0, mamba_d_state=4, mamba_dt_rank=2))
    classes = module_classes(jamba, hf_module_class)
    assert (classes["model.layers.0.mamba"], classes["model.layers.0.feed_forward.router"],
            classes["model.layers.0.feed_forward.experts"], classes["model.layers.1.self_attn"]) == (
        "mixer", "moe.router", "moe.experts", "attention.core")
    assert "unclassified" not in classes.values()
    for family in ("Llama", "Mixtral"):
        config = getattr(transformers, f"{family}Config")(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                            num_hidden_layers=2, num_attention_heads=2)
        model = getattr(transformers, f"{family}ForCausalLM")(config)
        assert module_classes(model, hf_module_class) == {  # structure adds nothing the names did not say
            n: None if type(m).__name__ == "ModuleList" else hf_module_class(n, type(m).__name__)
            for n, m in model.named_modules()}, family


def test_study_a_splits_attention_mlp_and_moe_by_what_each_call_ran():
    """split_module on the operator sequences each stack's modules run (read from their profiles)."""
    # eager attention (transformers, Megatron-core's core_attention): scores, mask, softmax, dropout, weighted sum
    eager = [("aten::transpose", None), ("aten::matmul", None), ("aten::mul", None), ("aten::add", None),
             ("aten::softmax", None), ("aten::dropout", None), ("aten::matmul", None), ("aten::contiguous", None)]
    assert split_module("attention.core", eager) == [
        "attention.core", "attention.qk", "attention.softmax", "attention.softmax", "attention.softmax",
        "attention.softmax", "attention.av", "attention.core"]
    megatron = [("aten::empty", None), ("aten::baddbmm", None), ("aten::masked_fill_", None), ("aten::softmax", None),
                ("aten::bmm", None)]
    assert split_module("attention.core", megatron) == [
        "attention.core", "attention.qk", "attention.softmax", "attention.softmax", "attention.av"]
    fused = [("aten::transpose", None), ("aten::scaled_dot_product_attention", None)]
    assert split_module("attention.core", fused) == ["attention.core", "attention.fused"]
    # an MLP's own code: act_fn(gate) * up; ZeRO-3's hooks keep the module's class
    mlp = [("llmadapt::module::mlp.gate", "mlp.gate"), ("aten::silu", None), ("llmadapt::module::mlp.up", "mlp.up"),
           ("aten::mul", None), ("PreForwardFunction", None), ("llmadapt::module::mlp.down", "mlp.down")]
    assert split_module("mlp", mlp) == [None, "mlp.activation", None, "mlp.activation", "mlp", None]
    # transformers 4.x: the sparse block routes (softmax, top-k), dispatches, calls each expert, weights, sums
    expert = ("llmadapt::module::moe.experts", "moe.experts")
    block = [("llmadapt::module::moe.router", "moe.router"), ("aten::softmax", None), ("aten::topk", None),
             ("aten::one_hot", None), ("aten::where", None), ("aten::index", None), expert, ("aten::mul", None),
             ("aten::index_add_", None), ("aten::where", None), ("aten::index", None), expert, ("aten::mul", None),
             ("aten::index_add_", None), ("aten::reshape", None)]
    assert split_module("moe.dispatch", block) == [
        None, "moe.router", "moe.router", "moe.dispatch", "moe.dispatch", "moe.dispatch", None, "moe.combine",
        "moe.combine", "moe.dispatch", "moe.dispatch", None, "moe.combine", "moe.combine", "moe.combine"]
    # transformers 5.x: the experts module gathers, runs each expert's two GEMMs, weights and sums itself
    experts = [("aten::zeros_like", None), ("aten::one_hot", None), ("aten::where", None), ("aten::index", None),
               ("aten::linear", None), ("aten::chunk", None), ("llmadapt::module::moe.experts", "moe.experts"),
               ("aten::mul", None), ("aten::linear", None), ("aten::mul", None), ("aten::index_add_", None)]
    assert split_module("moe.experts", experts) == [
        "moe.dispatch", "moe.dispatch", "moe.dispatch", "moe.dispatch", "moe.experts", "moe.experts", None,
        "moe.experts", "moe.experts", "moe.combine", "moe.combine"]
    # one expert's own code (no gather, no sum): all of it the expert's
    assert split_module("moe.experts", [expert, ("aten::mul", None), expert]) == [None, "moe.experts", None]
    # Megatron-core's MoELayer: router, the dispatcher's permute, experts, unpermute
    layer = [("llmadapt::module::moe.router", "moe.router"), ("aten::argsort", None), ("aten::index_select", None),
             expert, ("aten::zeros", None), ("aten::scatter_add", None)]
    assert split_module("moe.dispatch", layer) == [None, "moe.dispatch", "moe.dispatch", None, "moe.combine",
                                                   "moe.combine"]
    # a loss is 'loss' wherever it runs
    assert split_module("model", [("aten::add", None), ("aten::cross_entropy_loss", None)]) == ["model", "loss"]


def _x(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op", **args) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat, "args": args}


def test_the_timeline_follows_hta_definitions_on_a_cpu_trace():
    """Compute, communication, their overlap and idle time on a hand-made CPU timeline whose answer is known:
    step 0-100 us; operators 0-30 and 50-70 on the step's thread, where 60-70 is spent waiting in a collective;
    gloo's all-reduce 20-65 on its own thread (1000 floats), a broadcast 80-90 (10 int64); a barrier before the
    step (the ranks starting it together) is not one of its collectives."""
    trace = {"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": [
        _x("ProfilerStep#3", 0, 100, cat="user_annotation"),
        _x("aten::mm", 0, 30), _x("aten::add", 50, 20), _x("c10d::allreduce_", 60, 10),
        _x("gloo:all_reduce", 20, 45, tid=7, cat="user_annotation", **{"Input Dims": [[10, 100]],
                                                                         "Input type": ["float"]}),
        _x("gloo:broadcast", 80, 10, tid=7, cat="user_annotation", **{"Input Dims": [[10]],
                                                                        "Input type": ["long int"]}),
        _x("gloo:barrier", -20, 10, tid=7, cat="user_annotation"),  # before the step: not the step's
    ]}
    t = analyse(trace, world=2)
    assert t["compute_seconds"] == pytest.approx(40e-6)  # 0-30 and 50-60: the wait is not compute
    assert t["comm_seconds"] == pytest.approx(55e-6)  # 20-65 and 80-90
    assert t["overlapped_comm_seconds"] == pytest.approx(20e-6)  # 20-30 and 50-60
    assert t["idle_seconds"] == pytest.approx(100e-6 - 75e-6)  # neither: 65-80 and 90-100
    reduce, bcast = t["collectives"]
    assert (reduce.kind, reduce.count, reduce.bytes, reduce.algorithm) == ("all_reduce", 1, 4000, "ring")
    # nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n for all-reduce (n=2: x1)
    assert reduce.algbw_gbytes_per_s == pytest.approx(4000 / 45e-6 / 1e9)
    assert reduce.busbw_gbytes_per_s == pytest.approx(reduce.algbw_gbytes_per_s)
    assert (bcast.kind, bcast.bytes) == ("broadcast", 80)


def test_the_timeline_reads_nccl_kernels_on_a_gpu_trace():
    """On a GPU the same definitions apply to kernels: NCCL's name gives the algorithm, its arguments (copied from
    record_param_comms by PyTorch) the message; an all-gather of 1 Mi bf16 elements per rank on 4 ranks."""
    trace = {"traceEvents": [
        _x("ProfilerStep#5", 0, 1000, cat="user_annotation"),
        _x("ampere_sgemm_128x64_nn", 100, 400, tid=7, cat="kernel", stream=7, correlation=1),
        _x("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 300, 400, tid=13,
           cat="kernel", **{"In msg nelems": 2**20, "Out msg nelems": 2**22, "dtype": "BFloat16",
                            "Group size": 4, "Collective name": "_allgather_base", "stream": 13, "correlation": 2}),
    ]}
    t = analyse(trace, world=8)
    (gather,) = t["collectives"]
    assert (gather.kind, gather.backend, gather.algorithm, gather.bytes) == ("all_gather", "nccl", "RING_LL", 2**23)
    assert gather.busbw_gbytes_per_s == pytest.approx(2**23 / 400e-6 / 1e9 * 3 / 4)  # (n-1)/n with the group's n
    assert t["overlapped_comm_seconds"] == pytest.approx(200e-6)
    assert t["idle_seconds"] == pytest.approx(1000e-6 - 600e-6)
    # the operator classes are the kernels' own, on the step's window
    assert [(o.name, o.seconds, o.count) for o in t["operators"]] == [
        ("gemm", pytest.approx(400e-6), 1), ("all_gather", pytest.approx(400e-6), 1)]
    assert [(k.name, k.seconds) for k in t["kernel_types"]] == [
        ("computation", pytest.approx(200e-6)), ("computation+communication", pytest.approx(200e-6)),
        ("communication", pytest.approx(200e-6))]


def test_expert_imbalance_statistics():
    """CV with the population std, max over mean, idle experts; per layer mean and worst over steps."""
    cv, ratio, idle = imbalance([4, 0, 2, 2])
    assert cv == pytest.approx(2**0.5 / 2) and ratio == 2.0 and idle == 1
    assert imbalance([3, 3, 3, 3])[:2] == (0.0, 1.0) and imbalance([0, 0]) is None
    (layer0, layer1) = expert_imbalance([[[4, 0, 2, 2], [1, 1, 1, 1]], [[2, 2, 2, 2], [4, 0, 0, 0]]])
    assert layer0.cv == pytest.approx(2**0.5 / 4) and layer0.cv_max == pytest.approx(2**0.5 / 2)
    assert (layer1.max_over_mean, layer1.max_over_mean_max, layer1.idle_experts, layer1.idle_experts_max) == (
        2.5, 4.0, 1.5, 3)


# -- real runs -----------------------------------------------------------------------------------
@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
def test_a_profiled_step_is_marked_left_out_of_statistics_and_attributed(tmp_path):
    """torch: the profiled step is marked and not measured; its breakdown accounts for the step's time, at least
    95% of it in named classes, per layer too; GEMM FLOPs from the profiler match the model's formula; telemetry
    samples CPU and memory and says what a CPU cannot give."""
    from llmadapt import run

    result = run(workload("tiny-llama", "telemetry.interval_s=0.02", *THREE), "torch", out=tmp_path)
    assert result.ok, result.summary.failures
    records = records_of(result.run_dir)
    steps = [r for r in records if r["type"] == "step"]
    assert [s["step"] for s in steps if s["profiled"]] == [3, 4, 5]
    assert result.summary.measured_steps == 1  # step 2; steps 3-5 were profiled
    assert_attributed(records)
    b = next(r for r in records if r["type"] == "breakdown")
    assert b["error"] is None and b["step"] == 3 and b["basis"] == "cpu"
    classes = {c["name"]: c for c in b["modules"]}
    total = sum(c["seconds"] for c in b["modules"])
    # The profiled step is the core's step, a few % apart: the core reads its clock inside the profiler's step
    # range, which opens just before and closes just after.
    assert b["step_seconds"] == pytest.approx(steps[3]["seconds"], rel=0.05)
    assert NAMED | {"mlp.gate", "mlp.up", "mlp.activation", "mlp.down"} <= set(classes) <= set(MODULE_CLASSES)
    assert [layer["layer"] for layer in b["layers"]] == [0, 1]
    assert all(layer["forward_seconds"] > 0 and layer["backward_seconds"] > 0 for layer in b["layers"])
    # Module x operator: every operator's time is in one 'module/operator' cell, so the matrix adds up to the
    # operator classes; eager attention's scores and weighted sum are GEMMs, its softmax stage holds the softmax
    cross = {c["name"]: c["seconds"] for c in b["module_operators"]}
    for op in b["operators"]:
        assert sum(v for k, v in cross.items() if k.rsplit("/", 1)[1] == op["name"]) == pytest.approx(
            op["seconds"], rel=1e-6), op["name"]
    assert cross["attention.softmax/softmax"] > 0 and cross["mlp.gate/gemm"] > 0 and cross["optimizer/optimizer"] > 0
    assert cross["attention.qk/gemm"] > 0 and cross["attention.av/gemm"] > 0 and "attention.qk/softmax" not in cross
    # One rank, no collective: all the step is compute or idle (Python between operators).
    assert b["collectives"] == [] and b["comm_seconds"] == 0
    assert b["compute_seconds"] + b["idle_seconds"] == pytest.approx(b["step_seconds"], rel=0.01)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    gemm = next(o for o in summary["breakdown"]["operators"] if o["name"] == "gemm")
    model = summary["model_flops_per_token"] * summary["tokens_per_step"]
    # The reference's attention is eager (matmuls the profiler counts): 6N + attention holds to rounding of
    # the formula's terms; 1%, where a missed backward GEMM would be a third off.
    assert gemm["flops"] == pytest.approx(model, rel=0.01)
    assert summary["breakdown"]["gemm_flops_per_s"] == pytest.approx(gemm["flops"] / gemm["seconds"])

    samples = [r for r in records if r["type"] == "telemetry"]
    assert len(samples) >= 2 and samples[0]["source"] == "procfs"
    assert all(s["rss_bytes"] > 0 and s["cpu_percent"] >= 0 for s in samples)
    assert all(s["gpu_util_percent"] is None and s["power_w"] is None and s["energy_j"] is None for s in samples)
    assert "not measured on a CPU run" in samples[0]["unavailable"][0] and samples[1]["unavailable"] == []
    t = summary["telemetry"]
    assert t["energy_j"] is None and t["joules_per_token"] is None and t["peak_rss_bytes_per_rank"][0] > 0
    text = render_summary(summary)
    for line in ("module class", "operator class", "GEMM achieved", "telemetry", "not measured GPU utilisation"):
        assert line in text, line
    # the printed forward, backward and outside columns add up to each class's ms (0.02 ms: four values rounded
    # to 0.01 ms); the loss the adapter computes on the logits is forward work, none of it outside
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("module class"))
    assert lines[head].split()[-6:] == ["forward", "ms", "backward", "ms", "outside", "ms"], lines[head]
    rows = {}
    for line in lines[head + 2:]:  # under the header and its rule
        cells = line.split()
        if len(cells) != 6 or cells[0] not in MODULE_CLASSES:
            break
        rows[cells[0]] = [float(cells[1]), *map(float, cells[3:])]
    assert set(rows) == set(classes)
    for name, (ms, forward, backward, outside) in rows.items():
        assert forward + backward + outside == pytest.approx(ms, abs=0.02), (name, rows[name])
    assert rows["loss"][1] > 0 and rows["loss"][3] == pytest.approx(0, abs=0.01), rows["loss"]

    rows = list(csv.DictReader(io.StringIO(export(result.run_dir, "breakdown-csv"))))
    assert {r["table"] for r in rows} == {"module", "operator", "module_operator", "layer", "timeline"}
    assert sum(float(r["seconds"]) for r in rows if r["table"] == "module" and r["step"] == "3") == \
        pytest.approx(total)
    with pytest.raises(LlmadaptError, match="no breakdown in this run"):
        export(run(workload("tiny-llama", "profile.steps=[]"), "torch", out=tmp_path).run_dir, "breakdown-csv")


@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
def test_profiled_steps_count_in_statistics_when_asked(tmp_path):
    from llmadapt import run

    result = run(workload("tiny-llama", "profile.in_statistics=true", "telemetry.interval_s=0"), "torch",
                 out=tmp_path)
    assert result.ok and result.summary.measured_steps == 2
    assert not [r for r in records_of(result.run_dir) if r["type"] == "telemetry"]  # interval 0: no sampler


@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
@pytest.mark.parametrize("where", ["start", "fold"])
def test_a_profiler_failure_is_recorded_and_the_run_stands(tmp_path, monkeypatch, where):
    """Profiling that fails as it starts or as it reads its events: the step runs and is recorded, the breakdown
    record says what failed, the run is ok and its statistics are those of an unprofiled run."""
    import torch.profiler

    from llmadapt import run
    from llmadapt.runtime import profile

    def broken(*args, **kwargs):
        raise RuntimeError("profiler broke")

    monkeypatch.setattr(torch.profiler, "profile", broken) if where == "start" else \
        monkeypatch.setattr(profile, "fold", broken)
    result = run(workload("tiny-llama"), "torch", out=tmp_path, launcher="inline")
    assert result.ok and result.summary.steps_completed == 4 and result.summary.measured_steps == 1
    (b,) = [r for r in records_of(result.run_dir) if r["type"] == "breakdown"]
    assert b["error"] == "RuntimeError: profiler broke" and b["modules"] == []
    assert result.summary.breakdown.errors == ["rank 0, step 3: RuntimeError: profiler broke"]
    assert "profiling failed rank 0, step 3" in render_summary(json.loads((result.run_dir / "summary.json").read_text()))


@pytest.fixture(scope="module")
def dp2_full(tmp_path_factory):
    """torch dp=2, three steps profiled at level full."""
    from llmadapt import run

    unready = environments_unready("torch")
    if unready:
        pytest.skip(unready)
    return run(workload("tiny-llama", "parallelism.dp=2", "profile.level=full", *THREE), "torch",
               out=tmp_path_factory.mktemp("dp2"))


def test_data_parallel_collectives_overlap_and_traces_hta_reads(dp2_full):
    """torch dp=2 at level full: DDP's gradient all-reduce with its bytes and bus bandwidth, the step accounted for
    as compute + exposed communication + idle, one Kineto trace per rank in one folder per step (the rank in
    distributedInfo, the step as ProfilerStep#N, as Holistic Trace Analysis reads them), merged into the
    run's Chrome trace."""
    result = dp2_full
    assert result.ok, result.summary.failures
    for rank in (0, 1):
        records = records_of(result.run_dir, rank)
        assert_attributed(records, rank)  # the backend's threads are not the step's: no double counting
        b = next(r for r in records if r["type"] == "breakdown")
        reduce = next(c for c in b["collectives"] if c["kind"] == "all_reduce")
        assert reduce["bytes"] > 0 and reduce["busbw_gbytes_per_s"] > 0 and reduce["backend"] == "gloo"
        exposed = b["comm_seconds"] - b["overlapped_comm_seconds"]
        assert b["compute_seconds"] + exposed + b["idle_seconds"] == pytest.approx(b["step_seconds"], rel=0.01)
        trace = json.loads((result.run_dir / b["trace"]).read_text())
        assert b["trace"] == f"profile/step-3/rank-{rank}.json"
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        assert [e["name"] for e in trace["traceEvents"] if e["name"].startswith("ProfilerStep")] == ["ProfilerStep#3"]
    # DDP all-reduces every fp32 gradient once, in buckets; the reference adds the loss (one float64): the bytes
    # are exactly those, whatever the buckets (a dtype or shape read wrong would miss them)
    w = workload("tiny-llama")
    summary = json.loads((result.run_dir / "summary.json").read_text())
    (reduce,) = [c for c in summary["breakdown"]["collectives"] if c["kind"] == "all_reduce"]
    assert reduce["bytes"] == 4 * param_count(w.model) + 8
    chrome = json.loads(export(result.run_dir, "chrome-trace"))["traceEvents"]
    marks = {e["pid"]: e for e in chrome if e["name"] == "ProfilerStep#3"}
    steps = {e["pid"]: e for e in chrome if e["name"] == "step 3"}
    assert set(marks) == set(steps) == {0, 1}
    assert all(marks[r]["ts"] == pytest.approx(steps[r]["ts"]) for r in (0, 1))


def test_hta_loads_the_traces_of_every_rank(dp2_full):
    """Holistic Trace Analysis 0.5.0, in its own environment, loads the level-full traces unchanged: both ranks
    (from distributedInfo), the profiled step as its iteration; on a CPU it says its analyses have no kernels."""
    from llmadapt.experiments.hta import NO_KERNELS, hta_analysis, render
    from llmadapt.errors import EnvironmentNotReadyError
    from llmadapt.launch.environments import HTA_ENVIRONMENT, python_for

    try:
        python_for(HTA_ENVIRONMENT)
    except EnvironmentNotReadyError as exc:
        pytest.skip(str(exc))
    result = hta_analysis(dp2_full.run_dir, step=4)
    assert (result["step"], result["ranks"], result["iterations"]) == (4, [0, 1], {"0": [4], "1": [4]})
    assert result["note"] == NO_KERNELS and "temporal_breakdown" not in result
    assert render(result).startswith("HTA 0.5.0 on step 4: ranks 0, 1")
    with pytest.raises(LlmadaptError, match="no traces of step 9; traced steps: 3, 4, 5"):
        hta_analysis(dp2_full.run_dir, step=9)


@pytest.mark.skipif(bool(environments_unready("torch", "deepspeed", "megatron", "colossalai")),
                    reason=environments_unready("torch", "deepspeed", "megatron", "colossalai") or "")
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-mixtral"])
def test_every_stack_breaks_its_step_into_the_same_classes(tmp_path, model):
    """One taxonomy on four stacks, each stack's classifier on its real module tree: the same named classes
    wherever the stack runs that module, at least 95% of every rank's profiled step in a named class, the classes
    adding up to the step, GEMM FLOPs (summed over ranks) within 1% of the model's formula; MoE runs report each
    layer's expert imbalance, and `compare --breakdown` sets the stacks side by side."""
    stacks = STACKS if model == "tiny-llama" else [
        "torch", "deepspeed:parallelism.dp=2", "megatron:parallelism.dp=2,parallelism.ep=2",
        "colossalai:parallelism.dp=2"]
    table = compare(workload(model, *THREE), cells=stacks, out=tmp_path)
    assert [r.status for r in table.rows] == ["ok"] * 4, table.table()
    moe = {"moe.router", "moe.experts", "moe.dispatch", "moe.combine"}
    for row in table.rows:
        summary = json.loads((Path(row.run_dir) / "summary.json").read_text())
        names = {c["name"] for c in summary["breakdown"]["modules"]}
        # Megatron-core's linear_fc1 is the gate and up projections in one GEMM
        mlp = {"mlp.activation", "mlp.down"} | ({"mlp.gate_up"} if row.adapter == "megatron" else {"mlp.gate", "mlp.up"})
        expected = NAMED | (moe if model == "tiny-mixtral" else mlp)
        assert expected <= names <= set(MODULE_CLASSES), (row.cell, expected - names)
        # Backward operators find the module whose forward made them: every class with weights has backward time
        # (a custom autograd Function mapped to the wrong forward operator left Megatron's qkv at zero)
        backward = {c["name"]: c["backward_seconds"] for c in summary["breakdown"]["modules"]}
        weighted = {"attention.qkv", "attention.out", "lm_head"} | (
            {"moe.experts", "moe.router"} if model == "tiny-mixtral" else {"mlp.down"})
        assert all(backward[c] > 0 for c in weighted), (row.cell, backward)
        for rank in range(summary["world_size"]):
            assert_attributed(records_of(row.run_dir, rank), (row.cell, rank))
        gemm = next(o for o in summary["breakdown"]["operators"] if o["name"] == "gemm")
        # dp ranks split the tokens, tp ranks the matrices: over all ranks, every GEMM of the step once
        all_ranks = gemm["flops"] * summary["world_size"]
        assert all_ranks == pytest.approx(summary["model_flops_per_token"] * summary["tokens_per_step"], rel=0.01), \
            row.cell
        if model == "tiny-mixtral":
            layers = summary["expert_imbalance"]
            assert [x["layer"] for x in layers] == [0, 1] and all(x["max_over_mean"] >= 1 for x in layers)
            assert row.metrics["expert_max_over_mean"] >= 1
        else:
            assert summary["expert_imbalance"] is None
    side = table.breakdown_table()
    assert all(r.label in side.splitlines()[0] for r in table.rows)
    assert "attention.softmax" in side and "profiled step ms" in side
