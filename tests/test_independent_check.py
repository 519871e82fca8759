"""The analysis of benchmarks/independent_check.py (the bare side of the check of llmadapt's operator classes) on
hand-written profiler events: it counts what llmadapt's fold counts, by fold's rules, and nothing else. No timing
here: the benchmark itself measures."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("independent_check", ROOT / "benchmarks" / "independent_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# One profiled step: (id, name, thread, start_us, end_us, self_us, parent id). Thread 1 runs the step (forward,
# backward, optimizer); thread 3 is an autograd engine's thread (it runs a backward node); thread 2 runs no part of
# the step (a backend's worker, say); one event on thread 1 ends after the step's range.
EVENTS = [
    (1, "ProfilerStep#2", 1, 0, 100, 10, None),
    (2, "aten::mm", 1, 10, 30, 20, 1),
    (3, "aten::view", 1, 30, 32, 2, 1),
    (4, "autograd::engine::evaluate_function: MmBackward0", 1, 40, 60, 2, 1),
    (5, "MmBackward0", 1, 41, 59, 3, 4),
    (6, "aten::mm", 1, 42, 58, 13, 5),
    (7, "Optimizer.step#AdamW.step", 1, 60, 90, 5, 1),
    (8, "aten::mul_", 1, 61, 65, 4, 7),
    (9, "aten::lerp_", 1, 66, 67, 1, 7),
    (10, "Optimizer.zero_grad#AdamW.zero_grad", 1, 91, 92, 1, 1),
    (11, "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 3, 45, 50, 1, None),
    (12, "torch::autograd::AccumulateGrad", 3, 45, 50, 2, 11),
    (13, "aten::add", 2, 20, 30, 7, None),
    (14, "aten::add", 1, 95, 120, 6, 1),
]


def as_dicts(events):
    keys = ("id", "name", "thread", "start_us", "end_us", "self_us", "parent")
    return [dict(zip(keys, e)) for e in events]


def test_the_bare_analysis_counts_operators_by_folds_rules(check):
    got = {cls: (round(t * 1e6, 6), n) for cls, (t, n) in check.bare_operators(as_dicts(EVENTS)).items()}
    # the step's range and the engine's wrapper are no operators; thread 2 and the event past the step do not count
    assert got == {"gemm": (33, 2), "memory": (2, 1), "autograd": (3, 1), "gradient_accumulation": (2, 1),
                   "optimizer": (11, 4)}  # the optimizer's ranges, their own time and all inside them
    by_name = {cls: round(t * 1e6, 6) for cls, (t, _) in
               check.bare_operators(as_dicts(EVENTS), optimizer_ranges=False).items()}
    assert by_name["optimizer"] == 1 and by_name["elementwise"] == 4 and by_name["framework_function"] == 6


def test_the_bare_analysis_equals_llmadapts_fold_on_the_same_events(check):
    pytest.importorskip("torch")
    from llmadapt.runtime.profile import fold

    objects = {}
    for id_, name, thread, start, end, self_us, parent in EVENTS:
        objects[id_] = SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end),
                                       self_cpu_time_total=self_us, sequence_nr=-1, cpu_children=[], flops=0,
                                       cpu_parent=None)
    for id_, *_, parent in EVENTS:
        if parent is not None:
            objects[id_].cpu_parent = objects[parent]
            objects[parent].cpu_children.append(objects[id_])
    record = fold(list(objects.values()), rank=0, step=2, level="operator", basis="cpu")
    folded = {o.name: (round(o.seconds * 1e6, 6), o.count) for o in record.operators}
    bare = {cls: (round(t * 1e6, 6), n) for cls, (t, n) in check.bare_operators(as_dicts(EVENTS)).items()}
    assert folded == bare


def test_compare_takes_medians_and_judges_each_class(check):
    llmadapt = [{"gemm": 40.0, "memory": 60.0}, {"gemm": 42.0, "memory": 58.0}, {"gemm": 50.0, "memory": 50.0}]
    bare = [{"gemm": 35.0, "memory": 60.0, "other": 5.0}, {"gemm": 36.0, "memory": 62.0},
            {"gemm": 30.0, "memory": 70.0}]
    rows = {r["class"]: r for r in check.compare(llmadapt, bare, tolerance=5.0)}
    assert rows["gemm"]["llmadapt"] == 42.0 and rows["gemm"]["bare"] == 35.0 and not rows["gemm"]["within"]
    assert rows["memory"]["difference"] == -4.0 and rows["memory"]["within"]
    assert rows["other"]["bare"] == 0.0 and rows["other"]["llmadapt"] == 0.0  # a class one run saw: median of 0, 0, 5
    assert check.shares({"gemm": 1.0, "memory": 3.0}) == {"gemm": 25.0, "memory": 75.0}


def test_the_check_stops_when_the_sides_did_different_work(check):
    """Equal operator counts per class in every round is the check's precondition: a difference stops it before
    any share is compared, naming each class, both counts and the round."""
    with pytest.raises(SystemExit, match=r"^the two sides did not do the same work: operator counts differ for "
                                         r"reduction \(llmadapt 3, bare 0, round 2\); no share is compared$"):
        check.same_work([{"gemm": 4}, {"gemm": 4, "reduction": 3}], [{"gemm": 4}, {"gemm": 4}])
    check.same_work([{"gemm": 4, "memory": 2}], [{"gemm": 4.0, "memory": 2}])  # the same work: nothing raised


def test_the_bare_step_does_the_reference_adapters_work(check, tmp_path):
    """The bare loop (run as the check runs it: this file with --bare) and the reference adapter's step, each
    profiled as llmadapt profiles a step, run as many operators of each class on the same workload: the bare side
    does all the adapter does each step (the gradient norm included), so the check compares the same work."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import json
    import subprocess
    import sys

    from torch.profiler import ProfilerActivity, profile, record_function

    from llmadapt.adapter import WorkerContext
    from llmadapt.reference.trainer import TorchTrainer
    from llmadapt.runtime.data import TokenData

    args = SimpleNamespace(workload=str(ROOT / "examples" / "tiny-llama.toml"), profiled_steps=1,
                           set=["train.seq_len=16", "train.global_batch=4", "train.micro_batch=2"])
    w = check.workload_for(args)
    spec = check.bare_spec(w, 1)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "independent_check.py"), "--bare",
                    str(tmp_path / "spec.json"), str(tmp_path / "bare.json")], check=True, timeout=600)
    [bare_step] = json.loads((tmp_path / "bare.json").read_text())["steps"]
    bare = {cls: n for cls, (_, n) in check.bare_operators(bare_step["events"]).items()}

    ctx = WorkerContext(w, 0, 0, 1, torch.device("cpu"), spec["checkpoint"], tmp_path)
    trainer = TorchTrainer(ctx)
    trainer.setup()
    data = TokenData(w)
    for step in range(w.train.total_steps):
        batch = data.step_batch(step, 0, 1)  # made before the profiler starts, as the worker makes it
        if step != bare_step["step"]:
            trainer.step(batch)
            continue
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
            with record_function(f"ProfilerStep#{step}"):
                trainer.step(batch)
    events = [{"id": e.id, "name": e.name, "thread": e.thread, "start_us": e.time_range.start,
               "end_us": e.time_range.end, "self_us": e.self_cpu_time_total,
               "parent": e.cpu_parent.id if e.cpu_parent is not None else None} for e in prof.events()]
    adapter = {cls: n for cls, (_, n) in check.bare_operators(events).items()}
    assert adapter == bare, names_that_differ(events, bare_step["events"])


def names_that_differ(a_events, b_events):
    from collections import Counter

    a, b = Counter(e["name"] for e in a_events), Counter(e["name"] for e in b_events)
    return {n: (a[n], b[n]) for n in a | b if a[n] != b[n]}
