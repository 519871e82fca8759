"""The megatron adapter (plugins/megatron): the conformance suite, loss parity with the reference
adapter across tensor, pipeline, data and expert parallel layouts, refusals before launch, and
the CPU compatibility patches recorded in every trace header.

Needs the adapter installed (``pip install -e plugins/megatron``) and its environment and the
reference's built (``llmadapt env create megatron``, ``llmadapt env create torch``); the module
is skipped when the adapter is not registered. Every run is real: megatron-core 0.16.1 on gloo.
"""

from __future__ import annotations

import pytest

from llmadapt.adapter.plugins import get_adapter
from llmadapt.analysis.paritycheck import expert_load_parity, loss_parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.errors import UnknownAdapterError, UnsupportedError
from llmadapt.launch.runner import run
from llmadapt.testing import AdapterConformance, standard_workloads

try:
    INFO = get_adapter("megatron")
except UnknownAdapterError:  # pragma: no cover - depends on what is installed
    pytest.skip("the megatron adapter is not registered: pip install -e plugins/megatron", allow_module_level=True)


class TestMegatronAdapter(AdapterConformance):
    adapter = "megatron"


# Layouts checked against the reference (fp32, tiny-llama, the conformance training workload).
# Each also exercises one more feature, so every one of them runs without adding runs.
LAYOUTS = {
    "tp2": ["parallelism.tp=2"],
    "pp2-recompute-full": ["parallelism.pp=2", "optimizations.recompute=full"],
    "dp2-zero1-recompute-selective": ["parallelism.dp=2", "train.micro_batch=1", "optimizations.zero_stage=1",
                                      "optimizations.recompute=selective"],
    "tp2-pp2": ["parallelism.tp=2", "parallelism.pp=2"],  # 4 processes
}

# Patches every CPU run records, and the shim only a distributed-optimizer or bf16 run needs.
CPU_PATCHES = {"device-map", "backward-in-mode", "synchronize-noop", "rng-tracker-cpu"}
SHIM = "cuda-type-strings"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron")


@pytest.fixture(scope="module")
def reference(workdir):
    """The reference adapter's fp32 losses on the training workload (layout does not change them)."""
    result = run(standard_workloads()["train"], "torch", out=workdir)
    assert result.ok, result.summary.failures
    return result.losses


@pytest.fixture(scope="module")
def layout_runs(workdir):
    cache = {}

    def get(name):
        if name not in cache:
            workload = standard_workloads()["train"].with_overrides(LAYOUTS[name])
            cache[name] = run(workload, "megatron", out=workdir, timeout=600)
        return cache[name]

    return get


def _header(result, rank=0):
    return next(r for r in read_jsonl(result.run_dir / f"rank-{rank:05d}.jsonl") if r["type"] == "header")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp32_loss_matches_reference(layout, layout_runs, reference):
    """Every layout reproduces the reference's fp32 loss at every step (default tolerance: pp needs no looser one)."""
    result = layout_runs(layout)
    assert result.ok, result.summary.failures
    assert result.summary.world_size == standard_workloads()["train"].with_overrides(LAYOUTS[layout]).world_size
    report = loss_parity(reference, result.losses)
    assert report.ok, report.describe(("torch", f"megatron {layout}"))


def test_pipeline_reports_megatron_timers(layout_runs):
    """megatron's own timers come back as phases with source 'megatron': compute, pipeline p2p, optimizer."""
    result = layout_runs("pp2-recompute-full")
    assert result.ok, result.summary.failures
    names = {k for k in result.summary.phase_means_s if k.startswith("megatron:")}
    for name in ("forward-compute", "backward-compute", "forward-send", "backward-recv", "all-grads-sync",
                 "optimizer"):
        assert f"megatron:{name}" in names, sorted(names)
    steps = [r for r in read_jsonl(result.run_dir / "rank-00001.jsonl") if r["type"] == "step"]
    assert all(ph["seconds"] >= 0 for s in steps for ph in s["phases"])


def test_cpu_patches_are_recorded_in_every_header(layout_runs):
    """Every rank's header lists the CPU patches it ran with; the type-string shim is labelled 'shim' and
    appears only where the distributed optimizer needs it."""
    zero1 = layout_runs("dp2-zero1-recompute-selective")
    plain = layout_runs("tp2")
    for result in (zero1, plain):
        assert result.ok, result.summary.failures
        for rank in range(result.summary.world_size):
            patches = {p["name"]: p for p in _header(result, rank)["patches"]}
            assert CPU_PATCHES <= set(patches), sorted(patches)
            assert all(p["framework"] == "megatron-core" and p["description"] for p in patches.values())
            assert all(patches[name]["kind"] == "cpu-equivalent" for name in CPU_PATCHES)
    zero1_patches = {p.name: p for p in zero1.summary.patches}
    assert zero1_patches[SHIM].kind == "shim"
    assert SHIM not in {p.name for p in plain.summary.patches}


def test_moe_expert_parallel_matches_reference(workdir):
    """MoE with experts split over two ranks (ep=2): same losses and the same per-layer expert loads as the reference."""
    workload = standard_workloads()["moe"]
    reference = run(workload, "torch", out=workdir)
    layout = workload.with_overrides(["parallelism.dp=2", "parallelism.ep=2"])
    result = run(layout, "megatron", out=workdir, timeout=600)
    assert reference.ok and result.ok, (reference.summary.failures, result.summary.failures)
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.describe(("torch", "megatron ep=2"))

    # Exact where the routers' choices are clear; near-ties (logits within fp32 noise) may go either way.
    loads = expert_load_parity(read_jsonl(reference.run_dir / "rank-00000.jsonl"),
                               read_jsonl(result.run_dir / "rank-00000.jsonl"))
    assert loads.ok, loads.describe(("torch", "megatron ep=2"))
    assert "moe-te-gemm-none" in {p.name for p in result.summary.patches}


@pytest.mark.parametrize("overrides, field", [
    (["parallelism.tp=2"], "parallelism.tp"),  # on the MoE workload: needs sequence parallelism
    (["parallelism.pp=2", "model.num_layers=3"], "parallelism.pp"),  # unequal stages
    (["optimizations.zero_stage=2"], "optimizations.zero_stage"),
    (["precision=fp16"], "precision"),
    (["parallelism.tp=2", "model.vocab_size=509"], "parallelism.tp"),  # vocabulary not divisible
])
def test_bad_input_fails_before_launch(overrides, field, workdir):
    """What megatron cannot run here is refused at once, naming the field, and no run directory is made."""
    name = "moe" if overrides == ["parallelism.tp=2"] else "train"
    workload = standard_workloads()[name].with_overrides(overrides)
    before = set(workdir.iterdir())
    with pytest.raises(UnsupportedError, match=rf"adapter 'megatron' cannot run {field.replace('.', '[.]')}="):
        run(workload, "megatron", out=workdir)
    assert set(workdir.iterdir()) == before


def test_lora_is_refused_with_a_clear_message(workdir):
    """Only full fine-tuning: a LoRA workload is refused before launch, naming lora.rank and the stacks that run
    LoRA (Megatron-core has none of its own; NeMo's PEFT is outside it)."""
    workload = standard_workloads()["finetune"].with_overrides(["lora.rank=8"])
    with pytest.raises(UnsupportedError, match=r"cannot run lora\.rank=8: supported: 0 \(no LoRA\); "
                                               r"(\w+ or )*deepspeed( or \w+)* can$"):
        run(workload, "megatron", out=workdir)


def test_check_lists_every_problem():
    """The adapter's own rules, without launching anything: one (field, value, allowed) per problem."""
    workload = standard_workloads()["moe"].with_overrides(["parallelism.tp=2", "parallelism.pp=2",
                                                          "model.num_layers=3"])
    problems = INFO.check(workload)
    fields = [field for field, _, _ in problems]
    assert fields.count("parallelism.tp") == 1 and "parallelism.pp" in fields
    assert all(isinstance(allowed, str) and allowed for _, _, allowed in problems)
    assert INFO.check(standard_workloads()["train"].with_overrides(["parallelism.tp=2", "parallelism.pp=2"])) == []


def test_declaration():
    """Pinned environment with megatron-core 0.16.1 and this package; the roles and features declared."""
    requirements = dict(r.split("==") for r in INFO.environment.requirements)
    assert requirements["megatron-core"] == "0.16.1" and requirements["torch"] == "2.13.0"
    assert INFO.framework == "megatron-core" and set(INFO.roles) == {"train", "finetune"}
    s = INFO.supports
    assert s.dp and s.tp and s.pp and s.ep and s.moe and not s.lora
    assert s.zero_stages == (0, 1) and set(s.recompute) == {"none", "selective", "full"}


def test_pipeline_stage_failure_names_the_stage(tmp_path):
    """A pipeline stage that dies: the other is stopped, earlier steps are kept, the failure names the stage."""
    from llmadapt.testing import standard_workloads

    w = standard_workloads()["train"].with_overrides(["parallelism.pp=2"])
    result = run(w, "megatron", out=tmp_path, fault={"kind": "error", "step": 2, "rank": 1}, timeout=600)
    assert not result.ok
    assert result.summary.steps_completed == 2
    failure = next(f for f in result.summary.failures if f.rank == 1)
    assert failure.cause == "error" and failure.message.startswith("[pipeline stage 1/2, tensor rank 0/1")
