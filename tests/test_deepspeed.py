"""The DeepSpeed adapter (plugins/deepspeed), run for real: the conformance suite, fp32 loss parity
with the reference adapter under every ZeRO stage with one and two data-parallel ranks, memory
techniques, LoRA and MoE, what DeepSpeed itself reports (engine timers, comms logger, FLOPs
profiler), and bad input.

Needs the adapter installed where pytest runs (`pip install -e plugins/deepspeed`) and its
environment built (`llmadapt env create deepspeed`, plus `torch` for the reference).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt import UnsupportedError
from llmadapt.analysis import loss_parity
from llmadapt.contract import read_jsonl
from llmadapt.launch import run
from llmadapt.plugins import adapters
from llmadapt.testing import AdapterConformance, standard_workloads

if "deepspeed" not in adapters():
    pytest.skip("the deepspeed adapter is not registered: `pip install -e plugins/deepspeed` "
                "(then `llmadapt env create deepspeed`)", allow_module_level=True)

from llmadapt_deepspeed.config import build_config  # noqa: E402  (installed with the adapter)
from llmadapt_deepspeed.plugin import cuda_visible  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = standard_workloads()["train"]  # tiny-llama, global batch 4, micro-batch 2, 1 warm-up + 3 steps
DP2 = ["parallelism.dp=2", "train.micro_batch=1"]  # two ranks, two micro-batches each: both scalings in play
SGD = ["train.optimizer=sgd", "train.lr=2.0"]  # Adam hides a constant gradient scale; SGD does not


class TestDeepSpeedAdapter(AdapterConformance):
    adapter = "deepspeed"

    @pytest.fixture(scope="class")
    @classmethod
    def train_run(cls, out):
        """The suite's standard run is the ZeRO-0, one-rank point of the matrix below: run it once."""
        return matrix_run(["optimizations.zero_stage=0"], out)


# -- helpers ------------------------------------------------------------------------------------
def ds(workload, out, **options):
    result = run(workload, "deepspeed", out=out, timeout=600, **options)
    assert result.ok, result.summary.failures
    return result


def records(result, rank=0):
    return read_jsonl(result.run_dir / f"rank-{rank:05d}.jsonl")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("deepspeed")


@pytest.fixture(scope="module")
def reference(out):
    """The reference adapter on the standard tiny workload (AdamW)."""
    result = run(TRAIN, "torch", out=out)
    assert result.ok, result.summary.failures
    return result


_runs: dict[tuple[str, ...], object] = {}


def matrix_run(sets, out):
    """One DeepSpeed run per ZeRO stage x dp, shared by the tests that read its trace."""
    key = tuple(sets)
    if key not in _runs:
        _runs[key] = ds(TRAIN.with_overrides(list(sets)), out)
    return _runs[key]


# -- loss parity ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dp", [1, 2], ids=["dp1", "dp2"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3], ids=lambda z: f"zero{z}")
def test_zero_stages_match_the_reference(reference, out, zero, dp):
    """fp32 losses under ZeRO 0-3 on one and two ranks match the reference adapter at every step."""
    sets = [f"optimizations.zero_stage={zero}"] + (DP2 if dp == 2 else [])
    result = matrix_run(sets, out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch", f"deepspeed zero={zero} dp={dp}"))


def test_gradient_scale_matches_under_sgd(out):
    """With SGD (scale-sensitive), ZeRO-3 over 2 ranks x 2 micro-batches still matches the reference:
    the loss handed to DeepSpeed undoes exactly its division by accumulation steps and ranks."""
    workload = TRAIN.with_overrides(SGD)
    reference = run(workload, "torch", out=out)
    result = ds(workload.with_overrides(["optimizations.zero_stage=3", *DP2]), out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch sgd", "deepspeed sgd zero=3 dp=2"))
    assert abs(reference.losses[-1] - reference.losses[0]) > 1e-2, "SGD must move the loss for this to test anything"


def test_offload_and_recompute_keep_the_loss(reference, out):
    """ZeRO-3 with optimizer and parameter offload to CPU and selective recomputation, on 2 ranks:
    the reference's fp32 losses (recomputation inside ZeRO-3's parameter gathering included)."""
    sets = ["optimizations.zero_stage=3", "optimizations.offload=optimizer+params",
            "optimizations.recompute=selective", *DP2]
    result = ds(TRAIN.with_overrides(sets), out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch", str(sets)))


PROBE = """
import json, sys, tempfile
from pathlib import Path
import torch
import deepspeed.runtime.activation_checkpointing.checkpointing as ck
from llmadapt.data import TokenData
from llmadapt.models import canonical_checkpoint
from llmadapt.runtime import WorkerContext
from llmadapt.spec import Workload
from llmadapt_deepspeed.trainer import DeepSpeedTrainer

calls = {"forward": 0, "backward": 0}
forward, backward = ck.CheckpointFunction.forward, ck.CheckpointFunction.backward
def counted(kind, fn):
    def wrapper(ctx, *args):
        calls[kind] += 1
        return fn(ctx, *args)
    return staticmethod(wrapper)
ck.CheckpointFunction.forward = counted("forward", forward)
ck.CheckpointFunction.backward = counted("backward", backward)

out, trainers = {}, []
for recompute in sys.argv[2:]:  # one engine per mode, in one process (its process group outlives them)
    w = Workload.from_dict(json.loads(sys.argv[1])).with_overrides([f"optimizations.recompute={recompute}"])
    ctx = WorkerContext(w, 0, 0, 1, torch.device("cpu"), canonical_checkpoint(w.model, w.seed), Path(tempfile.mkdtemp()))
    trainer = DeepSpeedTrainer(ctx)
    trainer.setup()
    trainers.append(trainer)
    data = TokenData(w)
    calls.update(forward=0, backward=0)
    first = trainer.step(data.step_batch(0, 0, 1)).loss
    counted = dict(calls)
    second = trainer.step(data.step_batch(1, 0, 1)).loss
    out[recompute] = {"calls": counted, "losses": [first, second]}
trainers[-1].teardown()
print("PROBE " + json.dumps(out))
"""


def test_recompute_runs_deepspeed_activation_checkpointing(tmp_path):
    """recompute=full and =selective go through DeepSpeed's checkpoint function (once per decoder layer
    per micro-batch in forward, recomputed once each in backward; recompute=none never calls it), and
    the losses after an optimizer step are those without recomputation."""
    from llmadapt.environments import python_for
    from llmadapt.plugins import get_adapter

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    workload = json.dumps(TRAIN.to_dict())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "LLMADAPT_DEVICE": "cpu"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    python = python_for(get_adapter("deepspeed").environment)
    done = subprocess.run([str(python), str(script), workload, "none", "full", "selective"], capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-4000:]
    found = json.loads(line[len("PROBE "):])
    expected = TRAIN.model.num_layers * 2  # layers x micro-batches
    assert found["none"]["calls"] == {"forward": 0, "backward": 0}
    assert found["full"]["calls"] == {"forward": expected, "backward": expected}
    assert found["selective"]["calls"] == {"forward": expected, "backward": expected}
    for mode in ("full", "selective"):
        report = loss_parity(found["none"]["losses"], found[mode]["losses"])
        assert report.ok, report.describe(("recompute=none", f"recompute={mode}"))


# -- precisions, LoRA, MoE --------------------------------------------------------------------------
def test_bf16_trains_near_fp32(reference, out):
    """bf16 (DeepSpeed's bf16 mode with fp32 master weights) under ZeRO-2 on 2 ranks runs near fp32's loss."""
    result = ds(TRAIN.with_overrides(["precision=bf16", "optimizations.zero_stage=2", *DP2]), out)
    assert all(math.isfinite(x) for x in result.losses)
    assert result.losses[0] == pytest.approx(reference.losses[0], rel=0.02)
    assert result.summary.problem_hash != reference.summary.problem_hash


def test_lora_is_the_same_under_every_layout(out):
    """LoRA fine-tuning: adapters drawn from the workload's seed, so ZeRO-3 + selective recomputation on
    2 ranks matches one rank without ZeRO; and the loss falls."""
    finetune = standard_workloads()["finetune"].with_overrides(["lora.rank=8"])
    one = ds(finetune, out)
    two = ds(finetune.with_overrides(["optimizations.zero_stage=3", "optimizations.recompute=selective",
                                      "parallelism.dp=2"]), out)
    report = loss_parity(one.losses, two.losses)
    assert report.ok, report.describe(("lora zero=0 dp=1", "lora zero=3 dp=2"))
    assert one.losses[-1] < one.losses[0]


def test_moe_matches_the_reference_with_expert_load(out):
    """HF Mixtral under ZeRO-3 + full recomputation on 2 ranks: the reference's losses and expert counts."""
    moe = standard_workloads()["moe"]
    reference = run(moe, "torch", out=out)
    assert reference.ok, reference.summary.failures
    result = ds(moe.with_overrides(["optimizations.zero_stage=3", "optimizations.recompute=full",
                                    "parallelism.dp=2"]), out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch moe", "deepspeed moe zero=3 dp=2"))
    mine = [s["expert_load"] for s in records(result) if s["type"] == "step"]
    theirs = [s["expert_load"] for s in records(reference) if s["type"] == "step"]
    assert mine[0] == theirs[0]  # same weights, same tokens: the same routing (later steps may differ by a tie)
    assert mine == [s["expert_load"] for s in records(result, rank=1) if s["type"] == "step"]  # global on every rank


# -- what DeepSpeed reports -------------------------------------------------------------------------
def test_trace_has_deepspeed_timers_flops_and_patches(out):
    """Every step carries DeepSpeed's engine timers; its FLOPs profiler totals come once, for the last
    warm-up step; the CPU patches are in the header."""
    result = matrix_run(["optimizations.zero_stage=0"], out)
    recs = records(result)
    header = recs[0]
    assert header["framework"] == "deepspeed" and header["framework_version"] == "0.19.8"
    patches = {p["name"]: p for p in header["patches"]}
    assert "comms-logger-per-op-latency" in patches
    assert ("skip-shm-comm-op" in patches) == (header["device"]["kind"] == "cpu")  # CPU patches only on CPU
    steps = [r for r in recs if r["type"] == "step"]
    for s in steps:
        timers = {p["name"]: p["seconds"] for p in s["phases"] if p["source"] == "deepspeed"}
        assert set(timers) == {"fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"}
        assert all(v >= 0 for v in timers.values()) and timers["fwd"] > 0 and timers["bwd"] > 0
    metrics = {r["name"]: r for r in recs if r["type"] == "metric"}
    assert {"forward_flops", "forward_macs", "forward_flops_per_token", "train_flops_per_token",
            "params"} <= set(metrics)
    assert all(m["source"] == "deepspeed" for m in metrics.values())
    flops = metrics["forward_flops"]
    assert flops["step"] == TRAIN.train.warmup_steps - 1 and flops["value"] > 0
    tokens = TRAIN.micro_batch * TRAIN.train.seq_len  # one micro-batch's forward
    assert metrics["forward_flops_per_token"]["value"] == pytest.approx(flops["value"] / tokens)
    assert metrics["params"]["value"] > 0
    assert result.summary.phase_means_s["deepspeed:fwd"] > 0


def test_trace_has_deepspeed_comm_records(out):
    """ZeRO-3 on 2 ranks: every rank logs DeepSpeed's all-gathers and reduce-scatters each step, with
    nccl-tests bandwidths; a whole-run aggregate follows the last step."""
    result = matrix_run(["optimizations.zero_stage=3", *DP2], out)
    for rank in (0, 1):
        comms = [r for r in records(result, rank) if r["type"] == "comm"]
        assert comms and all(c["source"] == "deepspeed" and c["rank"] == rank for c in comms)
        for step in range(TRAIN.train.total_steps):
            ops = {c["op"] for c in comms if c["step"] == step}
            assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= ops, (step, ops)
        for c in comms:
            assert c["count"] > 0 and c["total_seconds"] >= 0
            if c["algbw_gbps"] is not None and c["op"] == "all_gather_into_tensor":
                expected = c["message_bytes"] * c["count"] * 8 / c["total_seconds"] / 1e9
                assert c["algbw_gbps"] == pytest.approx(expected)
                assert c["busbw_gbps"] == pytest.approx(expected / 2)  # (n-1)/n with n=2
        run_total = [c for c in comms if c["step"] is None]
        assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= {c["op"] for c in run_total}
        per_step = sum(c["count"] for c in comms if c["step"] is not None and c["op"] == "reduce_scatter_tensor")
        assert per_step == sum(c["count"] for c in run_total if c["op"] == "reduce_scatter_tensor")
    # ZeRO-3's FLOPs profiler figures are left out (DeepSpeed counts its memory-efficient linear twice).
    assert not [r for r in records(result) if r["type"] == "metric" and r["name"] == "forward_flops"]


def test_data_parallel_all_reduce_is_logged(out):
    """ZeRO-0 on 2 ranks: DeepSpeed's gradient all-reduce is in each step's comm records."""
    result = matrix_run(["optimizations.zero_stage=0", *DP2], out)
    comms = [r for r in records(result, 1) if r["type"] == "comm" and r["step"] is not None]
    for step in range(TRAIN.train.total_steps):
        assert "all_reduce" in {c["op"] for c in comms if c["step"] == step}


# -- bad input --------------------------------------------------------------------------------------
def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], capture_output=True, text=True,
                          check=False, env=env)


def test_pipeline_parallel_is_refused_in_one_line(tmp_path):
    """pp=2 is refused before anything starts: exit 2, one line naming the field, no run directory."""
    done = cli("run", ROOT / "examples" / "tiny-llama.toml", "--adapter", "deepspeed", "--out", tmp_path / "runs",
               "--set", "parallelism.pp=2")
    assert done.returncode == 2
    assert done.stderr.startswith("error: adapter 'deepspeed' cannot run parallelism.pp=2: supported: 1"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_fp16_is_refused_on_cpu(tmp_path):
    """fp16 where no CUDA device will be used: refused before launch, naming the field and why."""
    env = {**os.environ, "LLMADAPT_DEVICE": "cpu"}
    done = cli("run", ROOT / "examples" / "tiny-llama.toml", "--adapter", "deepspeed", "--out", tmp_path / "runs",
               "--set", "precision=fp16", env=env)
    assert done.returncode == 2
    assert done.stderr.startswith("error: adapter 'deepspeed' cannot run precision='fp16': "
                                  "fp16 is not supported by DeepSpeed on CPU"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_cuda_visibility_follows_the_worker_rules(monkeypatch, tmp_path):
    """The orchestrator decides "CPU" as the worker will, without importing torch."""
    assert not cuda_visible({"LLMADAPT_DEVICE": "cpu"})
    assert not cuda_visible({"CUDA_VISIBLE_DEVICES": ""})
    assert not cuda_visible({"CUDA_VISIBLE_DEVICES": "-1"})
    monkeypatch.setenv("LLMADAPT_DEVICE", "cpu")
    with pytest.raises(UnsupportedError, match="precision='fp16'"):
        run(TRAIN.with_overrides(["precision=fp16"]), "deepspeed", out=tmp_path)
    assert not list(tmp_path.iterdir())


# -- the config the workload maps to (no DeepSpeed needed) --------------------------------------------
def test_config_batch_sizes_and_accumulation():
    config = build_config(TRAIN.with_overrides(DP2))
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (4, 1, 2)
    assert config["gradient_clipping"] == 0.0 and config["wall_clock_breakdown"] is True
    assert config["comms_logger"]["enabled"] and config["comms_logger"]["prof_all"]


def test_config_optimizers_are_torch_optimizers():
    adamw = build_config(TRAIN)["optimizer"]
    assert adamw["type"] == "AdamW" and adamw["params"]["torch_adam"] and adamw["params"]["adam_w_mode"]
    adam = build_config(TRAIN.with_overrides(["train.optimizer=adam"]))["optimizer"]
    assert adam["type"] == "Adam" and adam["params"]["adam_w_mode"] is False
    sgd = build_config(TRAIN.with_overrides(["train.optimizer=sgd", "optimizations.zero_stage=2"]))
    assert sgd["optimizer"]["type"] == "SGD" and sgd["zero_allow_untested_optimizer"]


def test_config_zero_offload_and_recompute():
    z3 = build_config(TRAIN.with_overrides(["optimizations.zero_stage=3", "optimizations.offload=optimizer+params",
                                            "optimizations.recompute=selective"]))
    zero = z3["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_param_persistence_threshold"] == 0
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert z3["zero_force_ds_cpu_optimizer"] is False
    assert z3["activation_checkpointing"]["partition_activations"] is False
    plain = build_config(TRAIN)
    assert plain["zero_optimization"] == {"stage": 0}
    assert "activation_checkpointing" not in plain and "zero_force_ds_cpu_optimizer" not in plain
    assert build_config(TRAIN.with_overrides(["precision=bf16"]))["bf16"]["enabled"] is True
