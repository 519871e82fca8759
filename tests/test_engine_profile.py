"""A serving engine's own profile (serve.profile): its Kineto trace read per engine step into the breakdown's
classes (llmadapt.runtime.engine_profile), on a trace written here with known times, then for real on vLLM and on
the reference server (transformers serve under llmadapt.reference.profiled_serve)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt import adapters
from llmadapt.runtime.engine_profile import engine_steps, op_class, read_trace, step_shape
from llmadapt.testing import environments_unready

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def x(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


def test_each_engine_step_is_its_range_and_what_follows_it_in_classes_that_add_up():
    """Two engine steps (us): a prefill step 0-100 whose range holds a linear layer (mm inside it) and attention,
    sampling after its range; a decode step 200-240; the 100 us between them with nothing running is not counted."""
    trace = {"traceEvents": [
        x("execute_context_1(16)_generation_0(0)", 0, 100, "user_annotation"),
        x("aten::linear", 10, 40), x("aten::mm", 15, 30),  # linear's own 10, mm 30
        x("vllm::unified_attention_with_output", 60, 20), x("_C::cpu_attention_with_kv_cache", 62, 15),
        x("_C::fused_gumbel_argmax", 105, 5),  # after the range, before the next step: step 0's sampling
        x("execute_context_0(0)_generation_1(1)", 200, 40, "user_annotation"),
        x("_C::onednn_mm", 210, 10),
        x("_C::some_engine_thing", 250, 2),  # unclaimed: 'other', named
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999, "pid": 1, "tid": 2},  # another thread
    ]}
    first, second = engine_steps(trace)
    assert step_shape(trace) == [(1, 16, 0, 0), (0, 0, 1, 1)]
    classes = {c.name: c.seconds * 1e6 for c in first.operators}
    # range 100 less linear 40 less attention 20 = the engine's own 40; the attention op 5 + its kernel 15
    assert classes == pytest.approx({"python": 40, "gemm": 10 + 30, "attention": 5 + 15, "sampling": 5})
    assert first.step_seconds * 1e6 == pytest.approx(105)  # its range and what ran after it, not the idle gap
    assert first.idle_seconds * 1e6 == pytest.approx(40) and first.compute_seconds * 1e6 == pytest.approx(65)
    second_classes = {c.name: c.seconds * 1e6 for c in second.operators}
    assert second_classes == pytest.approx({"python": 30, "gemm": 10, "other": 2})
    assert [c.name for c in second.other_operators] == ["_C::some_engine_thing"]
    assert sum(second_classes.values()) == pytest.approx(second.step_seconds * 1e6)


def test_the_reference_servers_steps_and_its_named_calls():
    """The reference server's step name, and an llmadapt::call::<class> range (its scheduling, its sampling) that
    takes its whole time, the operators inside it included, as its class; the classes still add up to the step."""
    trace = {"traceEvents": [
        x("continuous_batching_prefill_1(12)_decode_2(2)", 0, 100, "user_annotation"),
        x("aten::linear", 10, 40), x("aten::mm", 10, 30),  # starts with its parent: still inside it
        x("llmadapt::call::sampling", 70, 20, "user_annotation"), x("aten::argmax", 70, 8), x("aten::copy_", 80, 4),
        x("continuous_batching::update_batch", 110, 10, "user_annotation"), x("aten::select", 112, 2),
        x("llmadapt::call::scheduler", 130, 30, "user_annotation"), x("aten::copy_", 140, 5),
        x("continuous_batching_prefill_0(0)_decode_3(3)", 300, 10, "user_annotation"),
    ]}
    first, _ = engine_steps(trace)
    assert step_shape(trace) == [(1, 12, 2, 2), (0, 0, 3, 3)]
    classes = {c.name: c.seconds * 1e6 for c in first.operators}
    # the step's own 100 - 40 - 20 = 40 and update_batch's own 8: python (its select: memory); the argmax and
    # the copies are their ranges'
    assert classes == pytest.approx({"python": 40 + 8, "gemm": 40, "sampling": 20, "scheduler": 30, "memory": 2})
    assert sum(classes.values()) == pytest.approx(first.step_seconds * 1e6)
    assert first.step_seconds * 1e6 == pytest.approx(140)  # the gaps between the ranges are no one's


def test_the_engines_own_operators_by_what_they_do():
    assert [op_class(n) for n in ("_C::onednn_mm", "vllm::unified_attention_with_output", "vllm::unified_kv_cache_update",
                                  "_C::fused_gumbel_argmax", "_C::get_scheduler_metadata", "aten::mm", "aten::add",
                                  "_C::rms_norm")] == [
        "gemm", "attention", "memory", "sampling", "scheduler", "gemm", "elementwise", "normalization"]


def cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=900)


def test_an_engine_that_cannot_profile_is_refused_in_one_line(tmp_path):
    for argv, message in ((["--adapter", "llamacpp"], "adapter 'llamacpp' cannot run serve.profile=True: this engine "
                                                      "gives no profile of its own (vllm and hf do)"),
                          (["--adapter", "vllm", "--set", "serve.mode=offline"],
                           "the engine's profile is of its server (serve.mode = 'online')")):
        done = cli("run", EXAMPLES / "serve-tiny.toml", "--set", "serve.profile=true", "--out", tmp_path / "runs",
                   *argv)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()


def test_vllm_profiles_its_own_steps(tmp_path):
    """vLLM started with its torch profiler, asked to profile the run: one breakdown record per engine step, as
    many as the trace in the run folder has, classes adding up to each step; `show` prints them."""
    if "vllm" not in adapters() or environments_unready("vllm"):
        pytest.skip(environments_unready("vllm") or "the vllm adapter is not installed")
    done = cli("run", EXAMPLES / "serve-tiny.toml", "--adapter", "vllm", "--set", "model.hidden_size=128",
               "--set", "serve.requests=6", "--set", "serve.warmup_requests=1", "--set", "serve.output_len.mean=8",
               "--set", "serve.profile=true", "--out", tmp_path / "runs", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(json.loads(done.stdout)["run_dir"])
    (trace,) = (run_dir / "engine-profile").glob("rank0.*.pt.trace.json.gz")
    shapes = step_shape(read_trace(trace))
    records = [json.loads(line) for line in (run_dir / "rank-00000.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "breakdown"]
    assert len(steps) == len(shapes) > 0 and [s["step"] for s in steps] == list(range(len(shapes)))
    assert sum(s[1] for s in shapes) >= 6 * 2  # every request's prompt was prefilled in some step
    for s in steps:
        assert sum(c["seconds"] for c in s["operators"]) == pytest.approx(s["step_seconds"], rel=1e-9)
    summary = json.loads((run_dir / "summary.json").read_text())
    classes = {c["name"] for c in summary["breakdown"]["operators"]}
    assert {"gemm", "attention", "python", "sampling"} <= classes
    assert summary["breakdown"]["profiled_steps"] == len(shapes)
    shown = cli("show", run_dir)
    assert f"mean per engine step over {len(shapes)} step(s)" in shown.stdout


def test_the_reference_server_profiles_its_own_steps(tmp_path):
    """transformers serve under the profiler launcher, asked to profile the run: its trace in the run folder, one
    breakdown record per continuous-batching step, classes adding up to each step; the run's notes say the server
    ran under the launcher; `show` prints the steps and the note."""
    if environments_unready("hf"):
        pytest.skip(environments_unready("hf"))
    done = cli("run", EXAMPLES / "serve-tiny.toml", "--adapter", "hf", "--set", "serve.requests=4",
               "--set", "serve.warmup_requests=1", "--set", "serve.output_len.mean=4",
               "--set", "serve.profile=true", "--out", tmp_path / "runs", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(json.loads(done.stdout)["run_dir"])
    (trace,) = (run_dir / "engine-profile").glob("hf.*.pt.trace.json.gz")
    shapes = step_shape(read_trace(trace))
    records = [json.loads(line) for line in (run_dir / "rank-00000.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "breakdown"]
    assert len(steps) == len(shapes) > 0 and [s["step"] for s in steps] == list(range(len(shapes)))
    assert sum(s[0] for s in shapes) >= 4 and sum(s[1] for s in shapes) >= 4 * 8  # every prompt was prefilled
    assert any(s[2] for s in shapes)  # and decoded
    for s in steps:
        assert sum(c["seconds"] for c in s["operators"]) == pytest.approx(s["step_seconds"], rel=1e-9)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["serving"]["completed"] == 4
    classes = {c["name"] for c in summary["breakdown"]["operators"]}
    assert {"gemm", "attention", "python", "sampling", "scheduler"} <= classes
    assert summary["breakdown"]["profiled_steps"] == len(shapes)
    assert any("profiler launcher" in note for note in summary["notes"])
    shown = cli("show", run_dir)
    assert f"mean per engine step over {len(shapes)} step(s)" in shown.stdout and "profiler launcher" in shown.stdout
