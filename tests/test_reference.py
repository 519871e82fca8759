"""The reference adapter's features, run for real on the tiny presets."""

import json

import pytest

from llmadapt import run
from llmadapt.analysis.paritycheck import expert_load_parity, loss_parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.testing import standard_workloads

pytest.importorskip("torch")

BASE = standard_workloads()["train"]


def inline(workload, tmp_path, **options):
    return run(workload, "torch", launcher="inline", out=tmp_path, **options)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return inline(BASE, tmp_path_factory.mktemp("baseline"))


@pytest.mark.parametrize("sets", [
    ["optimizations.recompute=full"],
    ["train.micro_batch=1"],
    ["optimizations.flash_attention=true"],
])
def test_layout_and_memory_techniques_keep_the_loss(baseline, tmp_path, sets):
    """Recomputation, gradient accumulation and the flash SDPA kernel leave fp32 losses unchanged."""
    result = inline(BASE.with_overrides(sets), tmp_path)
    assert result.ok, result.summary.failures
    report = loss_parity(baseline.losses, result.losses)
    assert report.ok, report.describe(("baseline", str(sets)))


def test_bf16_trains(baseline, tmp_path):
    """bf16 runs, and its loss stays near fp32's (not equal: that is the point of fp32 parity)."""
    result = inline(BASE.with_overrides(["precision=bf16"]), tmp_path)
    assert result.ok, result.summary.failures
    assert result.losses[0] == pytest.approx(baseline.losses[0], rel=0.02)
    assert result.summary.problem_hash != baseline.summary.problem_hash


def test_lora_trains_only_adapters(tmp_path):
    """LoRA fine-tuning on instruction data runs and its loss falls."""
    w = standard_workloads()["finetune"].with_overrides(["lora.rank=8", "train.steps=4"])
    result = inline(w, tmp_path)
    assert result.ok, result.summary.failures
    assert result.losses[-1] < result.losses[0]


def test_qlora_nf4_trains_on_cpu(tmp_path):
    """QLoRA: nf4 base weights (bitsandbytes) with LoRA adapters train; MFU is left out."""
    w = standard_workloads()["finetune"].with_overrides(["lora.rank=8", "optimizations.quantization=nf4",
                                                         "precision=bf16", "train.steps=4"])
    result = inline(w, tmp_path)
    assert result.ok, result.summary.failures
    assert result.losses[-1] < result.losses[0]
    assert result.summary.mfu is None


def test_moe_expert_load_is_not_double_counted_under_recomputation(tmp_path):
    """With full recomputation the router runs twice per step, but each token is counted once per layer."""
    w = standard_workloads()["moe"].with_overrides(["optimizations.recompute=full"])
    result = inline(w, tmp_path)
    assert result.ok, result.summary.failures
    steps = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "step"]
    per_layer = w.train.global_batch * w.train.seq_len * w.model.experts_per_token
    assert all(sum(layer) == per_layer for s in steps for layer in s["expert_load"])


def test_moe_data_parallel_reports_global_expert_load(tmp_path):
    """Under dp=2 the expert counts are summed over ranks (all-reduced) and equal dp=1's."""
    w = standard_workloads()["moe"]
    one = run(w, "torch", out=tmp_path)
    two = run(w.with_overrides(["parallelism.dp=2"]), "torch", out=tmp_path)
    assert one.ok and two.ok, (one.summary.failures, two.summary.failures)
    loads = expert_load_parity(*(read_jsonl(x.run_dir / "rank-00000.jsonl") for x in (one, two)))
    assert loads.ok, loads.describe(("dp=1", "dp=2"))  # exact but for near-ties (llmadapt.moe)
    assert loss_parity(one.losses, two.losses).ok


def test_out_of_memory_is_recorded_as_oom(tmp_path):
    """Under an address-space cap, a worker that runs out of memory leaves its steps and an 'oom' failure."""
    result = run(BASE, "torch", out=tmp_path, fault={"kind": "oom", "step": 1}, memory_limit_bytes=12 << 30)
    assert not result.ok
    assert result.summary.steps_completed == 1
    (failure,) = result.summary.failures
    assert (failure.cause, failure.step) == ("oom", 1)


def test_rank_failure_under_torchrun_stops_the_other_rank(tmp_path):
    """Rank 1 fails at step 2: both ranks' earlier steps are kept, the failure names rank 1."""
    w = standard_workloads()["train-dp2"]
    result = run(w, "torch", out=tmp_path, fault={"kind": "error", "step": 2, "rank": 1}, timeout=120)
    assert not result.ok
    assert result.summary.steps_completed == 2
    failures = {(f.rank, f.cause) for f in result.summary.failures}
    assert (1, "error") in failures
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"


def test_inline_refuses_several_ranks(tmp_path):
    """The inline launcher runs one rank; asking it for two is one clear error before anything is written."""
    from llmadapt import LlmadaptError

    with pytest.raises(LlmadaptError, match="launcher 'inline' runs one rank, but the workload needs world size 2"):
        run(standard_workloads()["train-dp2"], "torch", launcher="inline", out=tmp_path)
    assert not any(tmp_path.iterdir())


def test_environment_not_built_is_one_line(tmp_path, monkeypatch):
    """With no environment built, `run` says which command builds it; nothing is written."""
    from llmadapt import EnvironmentNotReadyError

    monkeypatch.setenv("LLMADAPT_HOME", str(tmp_path / "empty-state"))
    with pytest.raises(EnvironmentNotReadyError, match=r"environment 'torch' has not been built: run `llmadapt env "
                                                      r"create torch` \(or set LLMADAPT_PYTHON_TORCH\)"):
        run(BASE, "torch", out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()



def test_inline_runs_from_a_worker_thread_and_ignores_the_callers_place(tmp_path, monkeypatch):
    """Embedding: inline works off the main thread and runs one rank even inside a torchrun-started caller."""
    import threading

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    results = []
    thread = threading.Thread(target=lambda: results.append(inline(BASE.with_overrides(["train.steps=1"]),
                                                                   tmp_path)))
    thread.start()
    thread.join()
    (result,) = results
    assert result.ok, result.summary.failures
    assert result.summary.device.kind == "cpu"
    assert [p.name for p in result.run_dir.glob("rank-*.jsonl")] == ["rank-00000.jsonl"]
