"""The colossalai adapter (plugins/colossalai), run for real on ColossalAI 0.5.0 over gloo: the
conformance suite, loss parity with the reference adapter under every Booster plugin it maps to,
expert parallelism with per-layer, per-expert counts, LoRA, the CPU patches and phase times in
the trace, and refusals before launch.

Needs the adapter registered where pytest runs (``pip install -e plugins/colossalai``) and, for
the runs, its environment and the reference's (``llmadapt env create colossalai`` and ``llmadapt
env create torch``; ``make envs`` builds both). The refusal and mapping tests need neither.

Each configuration runs once and is asserted on several counts (parity, plugin, patches, phases),
because every ColossalAI run pays 15-40 s of imports on a small CPU.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt.adapter.plugins import get_adapter
from llmadapt.analysis.paritycheck import loss_parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.errors import UnknownAdapterError, UnsupportedError
from llmadapt.launch.runner import run
from llmadapt.testing import AdapterConformance, environments_unready, standard_workloads

try:
    INFO = get_adapter("colossalai")
except UnknownAdapterError:  # pragma: no cover - depends on what is installed
    pytest.skip("the colossalai adapter is not registered: pip install -e plugins/colossalai", allow_module_level=True)

from llmadapt_colossalai.plugin import booster_plugin  # noqa: E402  (after the registration check)

ROOT = Path(__file__).resolve().parents[1]
TRAIN = standard_workloads()["train"]  # tiny-llama, global batch 4, micro-batch 2, 1 warm-up + 3 steps, AdamW
MOE = standard_workloads()["moe"]  # tiny-mixtral, 1 warm-up + 2 steps
FINETUNE = standard_workloads()["finetune"]  # instruction data (JSONL)
DP2 = ["parallelism.dp=2", "train.micro_batch=1"]  # two ranks, two micro-batches each: both scalings in play
SGD = ["train.optimizer=sgd", "train.lr=2.0"]  # Adam hides a constant gradient scale; SGD does not


NOT_READY = environments_unready("colossalai", "torch") or ""
needs_env = pytest.mark.skipif(bool(NOT_READY), reason=NOT_READY)


@needs_env
class TestColossalAIAdapter(AdapterConformance):
    adapter = "colossalai"
    # A run imports ColossalAI and shardformer before its first step: 15-40 s on 2 loaded cores.
    startup_timeout_s = 60.0


# -- shared runs ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("colossalai")


@pytest.fixture(scope="module")
def reference(workdir):
    """The reference adapter's run of a workload, each workload run once for the whole module."""
    done = {}

    def get(workload):
        if workload.content_hash not in done:
            result = run(workload, "torch", out=workdir)
            assert result.ok, result.summary.failures
            done[workload.content_hash] = result
        return done[workload.content_hash]

    return get


def colossalai(workload, workdir):
    result = run(workload, "colossalai", out=workdir, timeout=900)
    assert result.ok, result.summary.failures
    return result


def records(result, rank=0):
    return read_jsonl(result.run_dir / f"rank-{rank:05d}.jsonl")


def header(result, rank=0):
    return next(r for r in records(result, rank) if r["type"] == "header")


def steps(result, rank=0):
    return [r for r in records(result, rank) if r["type"] == "step"]


# -- parity under every Booster plugin ------------------------------------------------------------
# Layout -> (optimizer, layout overrides, Booster plugin it maps to, CPU patches its trace header must carry).
# TorchDDPPlugin on 1 and 2 ranks (AdamW) is the conformance suite's train and train-dp2 runs.
# SGD everywhere else, so a wrong loss scale in any plugin shows (Adam would hide it), except
# under TorchFSDPPlugin, which re-creates the optimizer and so is where the AdamW path is special.
# pp 2 runs with dp 2: the 1F1B criterion's scale by micro-batches and by data-parallel ranks.
ZERO_PATCHES = {"zero-sanity-check-cpu", "cpu-accelerator-streams"}
LAYOUTS = {
    "zero1-dp2": (SGD, ["optimizations.zero_stage=1", *DP2], "LowLevelZeroPlugin", ZERO_PATCHES),
    "zero2-dp2": (SGD, ["optimizations.zero_stage=2", *DP2], "LowLevelZeroPlugin", ZERO_PATCHES),
    "zero3-dp2-adamw": ([], ["optimizations.zero_stage=3", *DP2], "TorchFSDPPlugin", {"fsdp-device-id-cpu"}),
    "tp2": (SGD, ["parallelism.tp=2"], "HybridParallelPlugin", {"cpu-accelerator-rng"}),
    "pp2-dp2": (SGD, ["parallelism.pp=2", *DP2], "HybridParallelPlugin", {"is-hccl-available-stub"}),
    "tp2-pp2": (SGD, ["parallelism.tp=2", "parallelism.pp=2"], "HybridParallelPlugin",
                {"cpu-accelerator-rng", "is-hccl-available-stub"}),
    # tied embeddings: the checkpoint holds the matrix once (no lm_head.weight); the last stage's lm_head must be
    # loaded from the embedding, and its gradient summed with the first stage's
    "pp2-tied": ([*SGD, "model.tie_embeddings=true"], ["parallelism.pp=2"], "HybridParallelPlugin",
                 {"is-hccl-available-stub"}),
}


@needs_env
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_reference(layout, reference, workdir):
    """One run per layout: the fp32 losses match the reference's (one rank, same optimizer) at every step, within
    the default tolerance; the header names ColossalAI and exactly the CPU patches this plugin needs; every step
    carries the core's timing and the adapter's phase times, labelled by their source."""
    optimizer, sets, plugin, patches = LAYOUTS[layout]
    problem = TRAIN.with_overrides(optimizer)
    workload = problem.with_overrides(sets)
    assert booster_plugin(workload) == plugin
    expected = reference(problem)
    if optimizer:
        assert abs(expected.losses[-1] - expected.losses[0]) > 1e-2, "SGD must move the loss to test the scale"
    result = colossalai(workload, workdir)

    report = loss_parity(expected.losses, result.losses)
    assert report.ok, report.describe(("torch", f"colossalai {layout}"))

    for rank in range(workload.world_size):
        h = header(result, rank)
        assert (h["framework"], h["framework_version"]) == ("colossalai", "0.5.0")
        assert {p["name"] for p in h["patches"]} == (patches if h["device"]["kind"] == "cpu" else set())
        assert all(p["framework"] == "colossalai" and p["kind"] == "cpu-equivalent" for p in h["patches"])
    pipeline = workload.parallelism.pp > 1
    phases = {"forward_backward", "optimizer"} if pipeline else {"forward", "backward", "optimizer"}
    for step in steps(result, workload.world_size - 1):  # under pp the last stage holds the loss
        assert step["seconds"] > 0
        recorded = {(p["name"], p["source"]) for p in step["phases"]}
        assert {(name, "llmadapt") for name in phases} <= recorded, recorded  # the core adds its own ('data')
        assert all(p["source"] and p["seconds"] >= 0 for p in step["phases"])
        assert step["spans"], "the adapter's spans feed the timeline"


# -- MoE: MoeHybridParallelPlugin, expert parallel ------------------------------------------------
@needs_env
def test_expert_parallel_bf16_zero1(reference, workdir):
    """ep=2 over dp=2 (ZeRO-1 in bf16: what ColossalAI needs for ep > 1; ep 1 is the conformance suite's MoE run)
    trains near the fp32 reference, and every rank reports the same global load each step: per layer, per expert,
    tokens x top-k in all."""
    workload = MOE.with_overrides(["parallelism.dp=2", "parallelism.ep=2", "optimizations.zero_stage=1",
                                   "precision=bf16"])
    assert booster_plugin(workload) == "MoeHybridParallelPlugin"
    expected = reference(MOE)
    result = colossalai(workload, workdir)
    assert all(math.isfinite(x) for x in result.losses)
    assert len(result.losses) == len(expected.losses)
    for ours, theirs in zip(result.losses, expected.losses):
        assert ours == pytest.approx(theirs, rel=2e-3)  # bf16 compute vs fp32: close, not equal
    loads = [[s["expert_load"] for s in steps(result, rank)] for rank in (0, 1)]
    assert loads[0] == loads[1]
    assert len(loads[0]) == MOE.train.total_steps
    tokens = MOE.train.global_batch * MOE.train.seq_len
    for load in loads[0]:
        assert len(load) == MOE.model.num_layers
        assert all(len(layer) == MOE.model.num_experts for layer in load)
        assert all(sum(layer) == tokens * MOE.model.experts_per_token for layer in load)
    assert {p["name"] for p in header(result)["patches"]} == ZERO_PATCHES  # its MoE ZeRO optimizer


# -- LoRA -------------------------------------------------------------------------------------------
@needs_env
def test_lora_finetune_on_two_ranks(workdir):
    """LoRA (peft through booster.enable_lora) on TorchDDPPlugin over 2 ranks, on instruction data: the loss falls,
    and the run needs no patch (TorchDDPPlugin runs on CPU as it is; the core reads the tokenizer)."""
    workload = FINETUNE.with_overrides(["lora.rank=8", "parallelism.dp=2"])
    assert booster_plugin(workload) == "TorchDDPPlugin"
    result = colossalai(workload, workdir)
    assert result.losses[-1] < result.losses[0]
    h = header(result)
    assert h["role"] == "finetune" and h["patches"] == []


# -- refusals before launch (no environment needed) ---------------------------------------------------
def cli(*args):
    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], capture_output=True, text=True,
                          check=False)


def test_expert_parallel_without_zero_is_refused_in_one_line(tmp_path):
    """ep=2 without ZeRO-1 + bf16 is refused before anything starts: exit 2, one line naming the field and why."""
    done = cli("run", ROOT / "examples" / "tiny-mixtral.toml", "--adapter", "colossalai", "--out", tmp_path / "runs",
               "--set", "parallelism.dp=2", "--set", "parallelism.ep=2")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: adapter 'colossalai' cannot run parallelism.ep=2: expert parallelism needs "
                                  "optimizations.zero_stage=1 and precision=bf16"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("sets, field, reason", [
    (["parallelism.tp=2", "optimizations.zero_stage=1"], "optimizations.zero_stage=1", "rejects fp32"),
    (["optimizations.zero_stage=3", "optimizations.offload=optimizer+params"], "optimizations.offload",
     "GeminiPlugin"),
    (["optimizations.flash_attention=true"], "optimizations.flash_attention=True", "supported: false"),
    (["parallelism.pp=2", "train.micro_batch=4"], "train.micro_batch=4", "at least 2 micro-batches"),
    (["precision=fp16"], "precision='fp16'", "supported: fp32, bf16"),
], ids=["zero-fp32-tp", "gemini-offload", "flash", "pp-microbatches", "fp16"])
def test_what_cannot_run_is_refused_before_launch(tmp_path, sets, field, reason):
    """Each rule names the field and ColossalAI's reason in one line; nothing is written."""
    with pytest.raises(UnsupportedError, match=rf"adapter 'colossalai' cannot run {field}.*{reason}"):
        run(TRAIN.with_overrides(sets), "colossalai", out=tmp_path)
    assert not list(tmp_path.iterdir())


def test_lora_outside_torch_ddp_is_refused(tmp_path):
    finetune = FINETUNE.with_overrides(["lora.rank=8", "optimizations.zero_stage=2", "parallelism.dp=2"])
    with pytest.raises(UnsupportedError, match=r"lora\.rank=8.*LowLevelZeroPlugin does not support LoRA"):
        run(finetune, "colossalai", out=tmp_path)


def test_workloads_map_to_booster_plugins():
    assert booster_plugin(TRAIN) == "TorchDDPPlugin"
    assert booster_plugin(TRAIN.with_overrides(DP2)) == "TorchDDPPlugin"
    assert booster_plugin(TRAIN.with_overrides(["optimizations.zero_stage=1"])) == "LowLevelZeroPlugin"
    assert booster_plugin(TRAIN.with_overrides(["optimizations.zero_stage=2"])) == "LowLevelZeroPlugin"
    assert booster_plugin(TRAIN.with_overrides(["optimizations.zero_stage=3"])) == "TorchFSDPPlugin"
    assert booster_plugin(TRAIN.with_overrides(["parallelism.tp=2"])) == "HybridParallelPlugin"
    assert booster_plugin(TRAIN.with_overrides(["parallelism.pp=2"])) == "HybridParallelPlugin"
    assert booster_plugin(MOE) == "MoeHybridParallelPlugin"
    assert booster_plugin(MOE.with_overrides(["parallelism.dp=2", "parallelism.ep=2"])) == "MoeHybridParallelPlugin"
