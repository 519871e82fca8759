"""The DeepSpeed adapter (plugins/deepspeed), run for real: the conformance suite, fp32 loss parity
with the reference adapter under every ZeRO stage with one and two data-parallel ranks, memory
techniques, DeepSpeedCPUAdam, LoRA and QLoRA, MoE, DeepSpeed's own launcher, what DeepSpeed itself
reports (engine timers, comms logger, FLOPs profiler), and bad input.

Runs are expensive (a launch costs ~20 s, mostly imports), so they are shared: every launched run
is made once per workload (`shared_run`, keyed by the workload's content hash) and read by every
test that needs it, the conformance suite's included. Configurations that only need a loss
trajectory on one rank run as engines one after another in one process (`engines`).

The DeepSpeedCPUAdam tests compile DeepSpeed's C++ CPU Adam op with gcc on first use (measured on
2 shared cores: 270 s at load average ~4.5, 607 s at ~8) into llmadapt's state folder
(`$LLMADAPT_HOME/torch-extensions/...`): once per machine, or per CI run without a cached state folder.

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
from llmadapt.adapter.plugins import adapters, get_adapter
from llmadapt.analysis.paritycheck import expert_load_parity, loss_parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.launch.runner import RunResult, run
from llmadapt.testing import AdapterConformance, standard_workloads

if "deepspeed" not in adapters():
    pytest.skip("the deepspeed adapter is not registered: `pip install -e plugins/deepspeed` "
                "(then `llmadapt env create deepspeed`)", allow_module_level=True)

from llmadapt_deepspeed import plugin as ds_plugin  # noqa: E402  (installed with the adapter)
from llmadapt_deepspeed.config import build_config  # noqa: E402
from llmadapt_deepspeed.launcher import deepspeed_launch_command  # noqa: E402
from llmadapt_deepspeed.plugin import cuda_visible  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = standard_workloads()
TRAIN = WORKLOADS["train"]  # tiny-llama, global batch 4, micro-batch 2, 1 warm-up + 3 steps
DP2 = ["parallelism.dp=2", "train.micro_batch=1"]  # two ranks, two micro-batches each: both scalings in play
SGD = ["train.optimizer=sgd", "train.lr=2.0"]  # Adam hides a constant gradient scale; SGD does not
MOE = WORKLOADS["moe"].with_overrides(["optimizations.zero_stage=3", "optimizations.recompute=full",
                                       "parallelism.dp=2"])
LORA = WORKLOADS["finetune"].with_overrides(["lora.rank=8"])
QLORA = LORA.with_overrides(["optimizations.quantization=nf4"])
MOE_QLORA = WORKLOADS["moe"].with_overrides(["kind=finetune", "lora.rank=4", "optimizations.quantization=nf4",
                                             'lora.target_modules=["w1", "w2", "w3", "gate"]', "train.lr=0.01"])
CPU_ADAM_OFFLOAD = TRAIN.with_overrides(["train.optimizer_impl=cpu_adam", "optimizations.zero_stage=2",
                                         "optimizations.offload=optimizer", *DP2])


# -- shared runs ----------------------------------------------------------------------------------
_runs: dict[tuple[str, str, str], RunResult] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The module's run folder (module-scoped fixtures use it: inside the conformance class `out` is the class's)."""
    return tmp_path_factory.mktemp("deepspeed")


@pytest.fixture(scope="module")
def out(workdir):
    return workdir


def shared_run(workload, out, adapter="deepspeed", launcher="auto") -> RunResult:
    """One run per (adapter, workload content, launcher), shared by every test that reads it; must succeed."""
    key = (adapter, workload.content_hash, launcher)
    if key not in _runs:
        result = run(workload, adapter, out=out, timeout=1200, launcher=launcher)
        assert result.ok, result.summary.failures
        _runs[key] = result
    return _runs[key]


def records(result, rank=0):
    return read_jsonl(result.run_dir / f"rank-{rank:05d}.jsonl")


def metrics(result, rank=0):
    return {r["name"]: r for r in records(result, rank) if r["type"] == "metric"}


@pytest.fixture(scope="module")
def reference(workdir):
    """The reference adapter on the standard tiny workload (AdamW)."""
    return shared_run(TRAIN, workdir, adapter="torch")


class TestDeepSpeedAdapter(AdapterConformance):
    adapter = "deepspeed"

    @pytest.fixture(scope="class")
    @classmethod
    def train_run(cls, out):
        """The suite's standard run is the ZeRO-0, one-rank point of the matrix below: run it once."""
        return shared_run(TRAIN, out)

    def _run(self, name, out, **options):
        """Runs without fault injection are shared with the module's tests: the suite's dp=2 run is the
        ZeRO-0 dp=2 matrix cell, and its MoE run is the MoE test's (ZeRO-3 + full recomputation on 2 ranks;
        its expert counts are global, as the suite checks)."""
        if options:
            return super()._run(name, out, **options)
        return shared_run(MOE if name == "moe" else WORKLOADS[name], out)

    def test_fp32_loss_matches_reference(self, train_run, reference):
        """On the canonical checkpoint and data, the fp32 loss trajectory matches the reference adapter
        (the suite's check, on the module's shared reference run)."""
        report = loss_parity(reference.losses, train_run.losses)
        assert report.ok, report.describe((self.reference, self.adapter))


# -- engines in one process -------------------------------------------------------------------------
ENGINES = """
import json, sys, tempfile
from pathlib import Path
import torch
import deepspeed.runtime.activation_checkpointing.checkpointing as ck
from llmadapt.runtime.data import TokenData
from llmadapt.models import canonical_checkpoint
from llmadapt.adapter import WorkerContext
from llmadapt.spec import Workload
from llmadapt_deepspeed.trainer import DeepSpeedFineTuner, DeepSpeedTrainer

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
for label, spec in json.loads(sys.argv[1]):  # one engine after another (the first one's process group serves all)
    w = Workload.from_dict(spec)
    checkpoint = canonical_checkpoint(w.model, w.seed)
    ctx = WorkerContext(w, 0, 0, 1, torch.device("cpu"), checkpoint, Path(tempfile.mkdtemp()))
    trainer = (DeepSpeedFineTuner if w.kind == "finetune" else DeepSpeedTrainer)(ctx)
    trainer.setup()
    trainers.append(trainer)
    tokenizer = None
    if w.data.source == "jsonl":
        from transformers import PreTrainedTokenizerFast
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(checkpoint))
    data = TokenData(w, tokenizer)
    losses, first_step_calls = [], None
    for step in range(w.train.total_steps):
        calls.update(forward=0, backward=0)
        losses.append(trainer.step(data.step_batch(step, 0, 1)).loss)
        first_step_calls = first_step_calls or dict(calls)
    out[label] = {"calls": first_step_calls, "losses": losses,
                  "optimizer": type(trainer.engine.basic_optimizer).__name__}
trainers[0].teardown()
print("ENGINES " + json.dumps(out))
"""

# label -> workload; ZeRO-3 last: it swaps torch's F.linear for DeepSpeed's for the rest of the process.
ONE_PROCESS = {
    "recompute=none": TRAIN,
    "recompute=full": TRAIN.with_overrides(["optimizations.recompute=full"]),
    "recompute=selective": TRAIN.with_overrides(["optimizations.recompute=selective"]),
    "cpu_adam, no offload": TRAIN.with_overrides(["train.optimizer_impl=cpu_adam"]),
    "lora zero=0": LORA,
    "zero=1": TRAIN.with_overrides(["optimizations.zero_stage=1"]),
    "zero=2": TRAIN.with_overrides(["optimizations.zero_stage=2"]),
    "zero=3": TRAIN.with_overrides(["optimizations.zero_stage=3"]),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Every ONE_PROCESS configuration on one rank, as DeepSpeed engines built one after another in one process
    of the adapter's environment, counting DeepSpeed checkpoint calls in each one's first step."""
    from llmadapt.launch.environments import process_env, python_for

    script = tmp_path_factory.mktemp("engines") / "engines.py"
    script.write_text(ENGINES)
    plan = json.dumps([[label, w.to_dict()] for label, w in ONE_PROCESS.items()])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "LLMADAPT_DEVICE": "cpu"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    environment = get_adapter("deepspeed").environment
    python = python_for(environment)
    done = subprocess.run([str(python), str(script), plan], capture_output=True, text=True,
                          env=process_env(environment, env), timeout=1800,
                          check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("ENGINES ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(line[len("ENGINES "):])


# -- loss parity ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dp", [1, 2], ids=["dp1", "dp2"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3], ids=lambda z: f"zero{z}")
def test_zero_stages_match_the_reference(reference, engines, out, zero, dp):
    """fp32 losses under ZeRO 0-3 on one and two ranks match the reference adapter at every step (ZeRO 1-3
    on one rank: engines in one process; the others launched)."""
    if dp == 1 and zero > 0:
        losses = engines[f"zero={zero}"]["losses"]
    else:
        losses = shared_run(TRAIN.with_overrides([f"optimizations.zero_stage={zero}"] + (DP2 if dp == 2 else [])),
                            out).losses
    report = loss_parity(reference.losses, losses)
    assert report.ok, report.describe(("torch", f"deepspeed zero={zero} dp={dp}"))


def test_gradient_scale_matches_under_sgd(out):
    """With SGD (scale-sensitive), ZeRO-3 over 2 ranks x 2 micro-batches still matches the reference:
    the loss handed to DeepSpeed undoes exactly its division by accumulation steps and ranks."""
    workload = TRAIN.with_overrides(SGD)
    reference = shared_run(workload, out, adapter="torch")
    result = shared_run(workload.with_overrides(["optimizations.zero_stage=3", *DP2]), out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch sgd", "deepspeed sgd zero=3 dp=2"))
    assert abs(reference.losses[-1] - reference.losses[0]) > 1e-2, "SGD must move the loss for this to test anything"


def test_offload_and_recompute_keep_the_loss(reference, out):
    """ZeRO-3 with optimizer and parameter offload to CPU and selective recomputation, on 2 ranks, with
    torch's AdamW: the reference's fp32 losses (recomputation inside ZeRO-3's parameter gathering included)."""
    sets = ["optimizations.zero_stage=3", "optimizations.offload=optimizer+params",
            "optimizations.recompute=selective", *DP2]
    result = shared_run(TRAIN.with_overrides(sets), out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch", str(sets)))
    (name,) = [n for n in metrics(result) if n.startswith("optimizer:")]
    assert name == "optimizer:torch.optim.adamw.AdamW"  # offload kept torch's optimizer, as configured


def test_recompute_runs_deepspeed_activation_checkpointing(engines):
    """recompute=full and =selective go through DeepSpeed's checkpoint function (once per decoder layer
    per micro-batch in forward, recomputed once each in backward; recompute=none never calls it), and
    the losses after optimizer steps are those without recomputation."""
    expected = TRAIN.model.num_layers * 2  # layers x micro-batches
    assert engines["recompute=none"]["calls"] == {"forward": 0, "backward": 0}
    assert engines["recompute=full"]["calls"] == {"forward": expected, "backward": expected}
    assert engines["recompute=selective"]["calls"] == {"forward": expected, "backward": expected}
    for mode in ("full", "selective"):
        report = loss_parity(engines["recompute=none"]["losses"], engines[f"recompute={mode}"]["losses"])
        assert report.ok, report.describe(("recompute=none", f"recompute={mode}"))


# -- DeepSpeedCPUAdam -------------------------------------------------------------------------------
def test_cpu_adam_offload_matches_torch_adam(reference, out):
    """ZeRO-2 + optimizer offload on 2 ranks with optimizer_impl=cpu_adam is DeepSpeed's own ZeRO-Offload:
    DeepSpeedCPUAdam (C++, compiled on first use) updates each rank's half of the parameters. Its fp32
    losses match the reference's torch AdamW within the parity tolerance (measured: max |delta| 2.4e-7),
    and the trace says which optimizer ran, over how many elements, and what loading the op cost."""
    result = shared_run(CPU_ADAM_OFFLOAD, out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch AdamW", "DeepSpeedCPUAdam zero=2 offload dp=2"))
    params = metrics(shared_run(TRAIN, out))["params"]["value"]  # the whole model, from the FLOPs profiler
    for rank in (0, 1):
        found = metrics(result, rank)
        assert found["optimizer:deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"]["value"] == params / 2
        assert found["cpu_adam_op_load_seconds"]["value"] > 0
        assert not [n for n in found if n.startswith("optimizer:") and "DeepSpeedCPUAdam" not in n]


def test_cpu_adam_without_offload_matches_torch_adam(reference, engines):
    """Without offload DeepSpeed's config would build FusedAdam: the adapter hands DeepSpeedCPUAdam to the
    engine itself (parameters live in host memory on CPU). Same losses as torch AdamW within the tolerance."""
    found = engines["cpu_adam, no offload"]
    assert found["optimizer"] == "DeepSpeedCPUAdam"
    assert engines["recompute=none"]["optimizer"] == "AdamW"
    report = loss_parity(reference.losses, found["losses"])
    assert report.ok, report.describe(("torch AdamW", "DeepSpeedCPUAdam zero=0"))


# -- precisions, LoRA, QLoRA, MoE -------------------------------------------------------------------
def test_bf16_trains_near_fp32(reference, out):
    """bf16 (DeepSpeed's bf16 mode with fp32 master weights) under ZeRO-2 on 2 ranks runs near fp32's loss."""
    result = shared_run(TRAIN.with_overrides(["precision=bf16", "optimizations.zero_stage=2", *DP2]), out)
    assert all(math.isfinite(x) for x in result.losses)
    assert result.losses[0] == pytest.approx(reference.losses[0], rel=0.02)
    assert result.summary.problem_hash != reference.summary.problem_hash


def test_lora_is_the_same_under_every_layout(engines, out):
    """LoRA fine-tuning: adapters drawn from the workload's seed, so ZeRO-3 + selective recomputation on
    2 ranks matches one rank without ZeRO; and the loss falls."""
    one = engines["lora zero=0"]["losses"]
    two = shared_run(LORA.with_overrides(["optimizations.zero_stage=3", "optimizations.recompute=selective",
                                          "parallelism.dp=2"]), out)
    report = loss_parity(one, two.losses)
    assert report.ok, report.describe(("lora zero=0 dp=1", "lora zero=3 dp=2"))
    assert one[-1] < one[0]


def test_qlora_matches_the_reference(out):
    """QLoRA (bitsandbytes nf4 base weights + LoRA) under ZeRO-3 on 2 ranks: the reference adapter's
    fp32 losses (measured: max |delta| 5.1e-7); the base weights really are 4-bit."""
    reference = shared_run(QLORA, out, adapter="torch")
    result = shared_run(QLORA.with_overrides(["optimizations.zero_stage=3", "parallelism.dp=2"]), out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch qlora", "deepspeed qlora zero=3 dp=2"))
    header = records(result)[0]
    assert header["workload"]["optimizations"]["quantization"] == "nf4"
    assert header["software"]["bitsandbytes"]


def test_qlora_on_the_experts_and_router_matches_the_reference(out):
    """Study B's recipe on the tiny Mixtral: nf4 base, LoRA on the experts' w1/w2/w3 and the router (peft maps
    transformers 4's names onto transformers 5's fused experts), ZeRO-2 on 2 ranks against the reference, fp32
    within the default tolerance; the adapters train (the loss moves away from attention-only LoRA's: measured
    8.7e-4 apart at the last step)."""
    moe_qlora = MOE_QLORA
    reference = shared_run(moe_qlora, out, adapter="torch")
    result = shared_run(moe_qlora.with_overrides(["optimizations.zero_stage=2", *DP2]), out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch", "deepspeed zero=2 dp=2"))
    attention = shared_run(moe_qlora.with_overrides(['lora.target_modules=["q_proj", "v_proj"]']), out,
                           adapter="torch")
    assert attention.losses[0] == reference.losses[0]  # B starts at zero: the same model at step 0
    assert abs(attention.losses[-1] - reference.losses[-1]) > 1e-4


def test_qlora_holds_the_experts_in_4_bit_on_both_stacks(out):
    """nf4 quantizes transformers 5's fused experts too (bitsandbytes leaves 3-D parameters alone): each stack's
    trace says what it held per module class, the experts nf4 with their bytes (half a byte per parameter, an fp32
    absmax per block of 64, a 16-entry fp32 code table per tensor), and both stacks held the same model. Under
    ZeRO-3 too (which partitions parameters: the quantized experts are held apart from them), with the reference's
    losses (fp32, the default tolerance)."""
    m = MOE_QLORA.model
    params = m.num_layers * m.num_experts * 3 * m.hidden_size * m.intermediate_size
    reference = shared_run(MOE_QLORA, out, adapter="torch")
    zero3 = shared_run(MOE_QLORA.with_overrides(["optimizations.zero_stage=3", "optimizations.recompute=full",
                                                 "parallelism.dp=2"]), out)
    report = loss_parity(reference.losses, zero3.losses)
    assert report.ok, report.describe(("torch", "deepspeed zero=3 dp=2"))
    held = []
    for result in (reference, shared_run(MOE_QLORA.with_overrides(["optimizations.zero_stage=2", *DP2]), out), zero3):
        rows = {(w["module_class"], w["format"]): w for w in records(result)[0]["weights"]}
        experts = rows[("moe.experts", "nf4")]
        assert (experts["params"], experts["stored_bytes"]) == (params, params // 2 + params // 64 * 4 + 2 * m.num_layers * 64)
        assert not [k for k in rows if k[0].startswith(("attention.", "mlp", "moe.experts")) and k[1] != "nf4"], rows
        held.append({k: (w["params"], w["stored_bytes"]) for k, w in rows.items() if k[1] == "nf4"})
    assert held[0] == held[1] == held[2]


def test_moe_matches_the_reference_with_expert_load(out):
    """HF Mixtral under ZeRO-3 + full recomputation on 2 ranks: the reference's losses and expert counts."""
    reference = shared_run(WORKLOADS["moe"], out, adapter="torch")
    result = shared_run(MOE, out)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch moe", "deepspeed moe zero=3 dp=2"))
    mine = [s["expert_load"] for s in records(result) if s["type"] == "step"]
    loads = expert_load_parity(records(reference), records(result))  # exact but for near-ties (llmadapt.moe)
    assert loads.ok, loads.describe(("torch moe", "deepspeed moe zero=3 dp=2"))
    assert mine == [s["expert_load"] for s in records(result, rank=1) if s["type"] == "step"]  # global on every rank


# -- DeepSpeed's own launcher -------------------------------------------------------------------------
def test_deepspeed_launcher_matches_torchrun(out):
    """Two ranks started by DeepSpeed's launcher (`deepspeed.launcher.runner` with a localhost hostfile, no
    ssh, no --local_rank) give the torchrun run's losses; each rank found its place from the launcher's
    environment and the trace says which launcher ran."""
    workload = TRAIN.with_overrides(DP2)
    torchrun = shared_run(workload, out)
    launched = shared_run(workload, out, launcher="deepspeed")
    report = loss_parity(torchrun.losses, launched.losses)
    assert report.ok, report.describe(("torchrun", "deepspeed launcher"))
    headers = [records(launched, rank)[0] for rank in (0, 1)]
    assert [(h["rank"], h["local_rank"], h["world_size"]) for h in headers] == [(0, 0, 2), (1, 1, 2)]
    assert {h["launcher"] for h in headers} == {"deepspeed"} and launched.summary.launcher == "deepspeed"
    assert (launched.run_dir / "hostfile").read_text() == "localhost slots=2\n"
    # The command, CPU pinning included, is in the trace's launch.json.
    assert json.loads((launched.run_dir / "launch.json").read_text())["command"][:3] == [
        "env", "LLMADAPT_DEVICE=cpu", "DS_ACCELERATOR=cpu"]
    log = (launched.run_dir / "worker.log").read_text(errors="replace")
    assert "deepspeed.launcher.launch" in log and "--local_rank" not in log


def test_the_deepspeed_launcher_belongs_to_the_adapter(tmp_path):
    """`--launcher deepspeed` is the adapter's: other adapters refuse it before anything is written."""
    assert "deepspeed" in get_adapter("deepspeed").launchers
    with pytest.raises(Exception, match=r"unknown launcher 'deepspeed' for adapter 'torch'"):
        run(TRAIN, "torch", out=tmp_path, launcher="deepspeed")
    assert list(tmp_path.iterdir()) == []


def test_deepspeed_launch_command_shape(tmp_path):
    """The launcher command: a hostfile of N local slots, loopback rendezvous on the given port, the worker
    module with the run directory as its only argument; pinned to CPU when asked."""
    cmd = deepspeed_launch_command("/env/bin/python", tmp_path, 2, 29555)
    assert cmd[:3] == ["env", "LLMADAPT_DEVICE=cpu", "DS_ACCELERATOR=cpu"]
    assert cmd[3:5] == ["/env/bin/python", "-m"] and cmd[5] == "deepspeed.launcher.runner"
    assert {f"--hostfile={tmp_path / 'hostfile'}", "--no_ssh_check", "--master_addr=127.0.0.1",
            "--master_port=29555", "--no_local_rank", "--module"} <= set(cmd)
    assert cmd[-2:] == ["llmadapt.runtime", str(tmp_path)]
    assert (tmp_path / "hostfile").read_text() == "localhost slots=2\n"
    other = deepspeed_launch_command("/env/bin/python", tmp_path, 4, 1, cpu=False, module="llmadapt.runtime.microbench")
    assert other[0] == "/env/bin/python" and other[-2] == "llmadapt.runtime.microbench"
    with pytest.raises(ValueError, match="world must be >= 1"):
        deepspeed_launch_command("/env/bin/python", tmp_path, 0, 1)


# -- what DeepSpeed reports -------------------------------------------------------------------------
def test_trace_has_deepspeed_timers_flops_and_patches(out):
    """Every step carries DeepSpeed's engine timers; its FLOPs profiler totals come once, for the last
    warm-up step; the optimizer DeepSpeed built is named; the CPU patches are in the header."""
    result = shared_run(TRAIN, out)
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
    found = metrics(result)
    assert {"forward_flops", "forward_macs", "forward_flops_per_token", "train_flops_per_token",
            "params"} <= set(found)
    ours = {"setup_seconds", "setup_peak_rss_bytes", "load_seconds", "load_peak_rss_bytes"}  # llmadapt's, every run
    assert ours <= set(found) and all(m["source"] == "deepspeed" for name, m in found.items() if name not in ours)
    flops = found["forward_flops"]
    assert flops["step"] == TRAIN.train.warmup_steps - 1 and flops["value"] > 0
    tokens = TRAIN.micro_batch * TRAIN.train.seq_len  # one micro-batch's forward
    assert found["forward_flops_per_token"]["value"] == pytest.approx(flops["value"] / tokens)
    assert found["params"]["value"] > 0
    # torch's AdamW by default (optimizer_impl=torch), over every parameter on one rank; nothing compiled.
    assert found["optimizer:torch.optim.adamw.AdamW"]["value"] == found["params"]["value"]
    assert found["optimizer:torch.optim.adamw.AdamW"]["step"] == 0 and "cpu_adam_op_load_seconds" not in found
    assert result.summary.phase_means_s["deepspeed:fwd"] > 0


def test_trace_has_deepspeed_comm_records(out):
    """ZeRO-3 on 2 ranks: every rank logs DeepSpeed's all-gathers and reduce-scatters each step, with
    nccl-tests bandwidths; a whole-run aggregate follows the last step."""
    result = shared_run(TRAIN.with_overrides(["optimizations.zero_stage=3", *DP2]), out)
    for rank in (0, 1):
        comms = [r for r in records(result, rank) if r["type"] == "comm"]
        assert comms and all(c["source"] == "deepspeed" and c["rank"] == rank for c in comms)
        for step in range(TRAIN.train.total_steps):
            ops = {c["op"] for c in comms if c["step"] == step}
            assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= ops, (step, ops)
        for c in comms:
            assert c["count"] > 0 and c["total_seconds"] >= 0
            if c["algbw_gbytes_per_s"] is not None and c["op"] == "all_gather_into_tensor":
                expected = c["message_bytes"] * c["count"] / c["total_seconds"] / 1e9  # GB/s, as nccl-tests
                assert c["algbw_gbytes_per_s"] == pytest.approx(expected)
                assert c["busbw_gbytes_per_s"] == pytest.approx(expected / 2)  # (n-1)/n with n=2
        run_total = [c for c in comms if c["step"] is None]
        assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= {c["op"] for c in run_total}
        per_step = sum(c["count"] for c in comms if c["step"] is not None and c["op"] == "reduce_scatter_tensor")
        assert per_step == sum(c["count"] for c in run_total if c["op"] == "reduce_scatter_tensor")
    # ZeRO-3's FLOPs profiler figures are left out (DeepSpeed counts its memory-efficient linear twice).
    assert not [r for r in records(result) if r["type"] == "metric" and r["name"] == "forward_flops"]


def test_data_parallel_all_reduce_is_logged(out):
    """ZeRO-0 on 2 ranks: DeepSpeed's gradient all-reduce is in each step's comm records."""
    result = shared_run(TRAIN.with_overrides(DP2), out)
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


@pytest.mark.parametrize(("adapter", "sets", "message"), [
    ("torch", ["train.optimizer_impl=cpu_adam"],
     "error: adapter 'torch' cannot run train.optimizer_impl='cpu_adam': supported: torch"),
    ("deepspeed", ["train.optimizer_impl=cpu_adam", "train.optimizer=sgd"],
     "error: workload field 'train.optimizer_impl': got 'cpu_adam'; cpu_adam needs train.optimizer adam or adamw"),
    ("deepspeed", ["kind=finetune", "lora.rank=8", "optimizations.quantization=int8"],
     "error: adapter 'deepspeed' cannot run optimizations.quantization='int8': supported: none, nf4"),
], ids=["cpu_adam-on-torch", "cpu_adam-sgd", "int8-qlora"])
def test_bad_optimizer_and_quantization_choices_are_refused_in_one_line(tmp_path, adapter, sets, message):
    """DeepSpeedCPUAdam on an adapter without it, CPU Adam for SGD, and 8-bit QLoRA (not exercised here, so
    not declared): refused before launch in one line naming the field."""
    done = cli("run", ROOT / "examples" / "tiny-llama.toml", "--adapter", adapter, "--out", tmp_path / "runs",
               *[x for s in sets for x in ("--set", s)])
    assert done.returncode == 2
    assert done.stderr.startswith(message), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_cuda_visibility_follows_the_worker_rules(monkeypatch, tmp_path):
    """The orchestrator decides "CPU" as the worker will, without importing torch."""
    assert not cuda_visible({"LLMADAPT_DEVICE": "cpu"})
    assert not cuda_visible({"CUDA_VISIBLE_DEVICES": ""})
    assert not cuda_visible({"CUDA_VISIBLE_DEVICES": "-1"})
    monkeypatch.setenv("LLMADAPT_DEVICE", "cpu")
    with pytest.raises(UnsupportedError, match="precision='fp16'"):
        run(TRAIN.with_overrides(["precision=fp16"]), "deepspeed", out=tmp_path)
    assert not list(tmp_path.iterdir())


def test_cpu_adam_without_offload_is_refused_on_cuda(monkeypatch):
    """On a CUDA device DeepSpeedCPUAdam needs the optimizer offloaded (it updates host memory): refused
    before launch; with offload, or on CPU, it is accepted."""
    workload = TRAIN.with_overrides(["train.optimizer_impl=cpu_adam"])
    monkeypatch.setattr(ds_plugin, "cuda_visible", lambda environ=None: True)
    assert ds_plugin.check(workload) == [("train.optimizer_impl", "cpu_adam", ds_plugin.CPU_ADAM_ON_CUDA)]
    assert ds_plugin.check(CPU_ADAM_OFFLOAD) == []
    monkeypatch.setattr(ds_plugin, "cuda_visible", lambda environ=None: False)
    assert ds_plugin.check(workload) == []


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


def test_config_cpu_adam():
    """cpu_adam with offload: DeepSpeed's own choice (no torch_adam, no forced torch optimizer); without
    offload: no config optimizer (the adapter hands DeepSpeedCPUAdam to the engine)."""
    offload = build_config(CPU_ADAM_OFFLOAD)
    assert offload["optimizer"]["type"] == "AdamW" and "torch_adam" not in offload["optimizer"]["params"]
    assert "zero_force_ds_cpu_optimizer" not in offload
    assert "optimizer" not in build_config(TRAIN.with_overrides(["train.optimizer_impl=cpu_adam"]))


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
