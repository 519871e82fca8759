"""Every script in benchmarks/ at its smallest size, so that a change elsewhere cannot silently break one.

Each script runs in a subprocess, from a scratch folder, with its ``--smoke`` flag (its smallest size: seconds, not
minutes): it must end with exit status 0 and print its report; where it writes JSON, the JSON is parsed and its keys
checked. No figure is judged: at these sizes, on a shared machine, they mean little. A script that needs an adapter's
environment (or the real GPU traces) is skipped, saying why, where that is not there. gpu_check.py's smoke pass is
its CPU rehearsal, in tests/test_gpu_check.py. A new script needs an entry in SMOKE, or the first test fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt.launch.environments import HTA_ENVIRONMENT, EnvironmentNotReadyError, python_for
from llmadapt.testing import environments_unready

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TRACES = ROOT.parent / "shared" / "data" / "kineto-gpu"  # as benchmarks/hta_crosscheck.py finds them

# Each benchmark script: the test that runs its smoke pass (in this file, or FILE::TEST) and the flag that makes it
# small there.
SMOKE = {
    "cli_startup.py": ("test_cli_startup", "--smoke"),
    "compare_walk.py": ("test_compare_walk", "--smoke"),
    "overhead.py": ("test_overhead", "--smoke"),
    "profile_overhead.py": ("test_profile_overhead", "--smoke"),
    "loadgen.py": ("test_loadgen", "--smoke"),
    "load_sweep.py": ("test_load_sweep", "--smoke"),
    "vllm_crosscheck.py": ("test_vllm_crosscheck", "--smoke"),
    "foreign_results.py": ("test_foreign_results", "--smoke"),
    "model_loading.py": ("test_model_loading", "--smoke"),
    "repeat.py": ("test_repeat", "--smoke"),
    "tune_vs_grid.py": ("test_tune_vs_grid", "--smoke"),
    "hta_crosscheck.py": ("test_hta_crosscheck", "--smoke"),
    "independent_check.py": ("test_independent_check", "--smoke"),
    "verdicts.py": ("test_verdicts", "--smoke"),
    "store_scale.py": ("test_store_scale", "--smoke"),
    "memory_check.py": ("test_memory_check", "--smoke"),
    "gpu_check.py": ("tests/test_gpu_check.py::test_the_gpu_check_rehearses_every_step_on_cpu", "--rehearse"),
}


def test_every_benchmark_has_a_smoke_pass():
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    missing = [s for s in scripts if s not in SMOKE]
    assert not missing, (f"benchmarks without a smoke pass: {missing}: give each a smallest size (--smoke) and a test "
                         "in tests/test_benchmarks.py (SMOKE)")
    assert not [s for s in SMOKE if s not in scripts], "SMOKE names a script that is gone"
    for script, (test, flag) in SMOKE.items():
        assert f'"{flag}"' in (BENCHMARKS / script).read_text(), f"{script} has no {flag} option"
        where, _, name = test.rpartition("::")
        if where:
            source = (ROOT / where).read_text()
            assert f"def {name}(" in source and f"benchmarks/{script}" in source and f'"{flag}"' in source, (
                f"{test} does not run benchmarks/{script} {flag}")
        else:
            assert callable(globals().get(name)), f"no {name} in this file for {script}"


# -- running one ---------------------------------------------------------------------------------------------------
def bench(script: str, *args: str, cwd: Path, timeout: float = 600) -> str:
    """Run benchmarks/SCRIPT with ARGS in this interpreter, from ``cwd`` (temporary files there too); its stdout.
    Fails, with the end of its output, unless it exits 0."""
    scratch = cwd / "tmp"
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(scratch), "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, (f"{script} {' '.join(args)} exited {done.returncode}\n--- stdout\n"
                                  f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-4000:]}")
    return done.stdout


def has(data: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in data]
    assert not missing, f"missing {missing} in {sorted(data)}"


def unready(*adapters: str):
    why = environments_unready(*adapters)
    return pytest.mark.skipif(bool(why), reason=why or "")


def hta_unready() -> str | None:
    try:
        python_for(HTA_ENVIRONMENT)
    except EnvironmentNotReadyError as exc:
        return str(exc)
    if not sorted(TRACES.glob("*.json.gz")):
        return f"the real GPU traces are absent ({TRACES}: ../shared/data/kineto-gpu from the repository root)"
    return None


needs_torch_here = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")),
    reason="this interpreter lacks torch or transformers (the development environment has them: make setup)")


# -- the benchmarks ------------------------------------------------------------------------------------------------
def test_cli_startup(tmp_path):
    r = json.loads(bench("cli_startup.py", "--smoke", "--json", cwd=tmp_path))
    has(r, "floor", "import_llmadapt", "commands", "ok")
    assert r["repeat"] == 1 and set(r["commands"]) == {"--help", "adapters"}
    for row in r["commands"].values():
        has(row, "median_s", "over_floor_s", "loaded_heavy", "torch_loaded", "exit_codes")


@unready("torch")
def test_compare_walk(tmp_path):
    r = json.loads(bench("compare_walk.py", "--smoke", "--json", cwd=tmp_path))
    assert r["exit_code"] == 0
    # The orchestrator's way from the command line through launch and back: each of these ran.
    for module in ("cli/runs.py", "experiments/compare.py", "launch/runner.py", "launch/supervise.py",
                   "contract/readback.py", "analysis/comparison.py"):
        assert module in r["by_file"], f"{module} not in the walk: {sorted(r['by_file'])}"
    assert r["files"] == len(r["by_file"]) and r["returns"] == r["stays"] - r["files"] >= 0
    assert r["functions"] == sum(map(len, r["by_file"].values())) and r["launch_entries"] >= 1
    # What the import system calls is an import, not a step of the walk: the old paths' finder (consulted for every
    # import that fails, e.g. jsonschema's optional format checkers) is left out.
    assert "compat/__init__.py" not in r["by_file"]
    m = r["measures"]
    assert {k: v for k, v in m["all"].items()} == {k: v for k, v in r.items() if k in m["all"]}
    assert m["all"]["functions"] > m["followed"]["functions"] > m["followed, outside cli/"]["functions"] > 0
    assert m["all"]["files"] >= m["followed"]["files"] > m["followed, outside cli/"]["files"] > 0


@needs_torch_here
def test_overhead(tmp_path):
    r = json.loads(bench("overhead.py", "--smoke", "--device", "cpu", "--json", cwd=tmp_path))
    has(r, "llmadapt", "bare", "ratio_median", "ratio_paired", "round_ratios_median", "wall_per_run_s", "max_loss_diff")
    assert r["rounds"] == 1 and r["steps_per_run"] == 2 and r["llmadapt"]["count"] == r["bare"]["count"] == 2


@needs_torch_here
def test_profile_overhead(tmp_path):
    r = json.loads(bench("profile_overhead.py", "--smoke", "--json", cwd=tmp_path))
    has(r, "loop", "profile", "telemetry")
    for loop in r["loop"]:
        has(loop, "step_s", "steps", "fixed_us", "cpu_fixed_us", "between_us", "data_us", "inside_clock_us")
    assert [p["level"] for p in r["profile"]] == ["module", "operator"]
    has(r["telemetry"], "sample_us", "step_s_off", "ratio_default_0.5s", "ratio_0.05s")


def test_loadgen(tmp_path):
    """Against the fake server; with vllm bench (its closed loop) where vLLM's environment is built: that client
    is started in its environment as every other process is."""
    saved = tmp_path / "loadgen.json"
    text = bench("loadgen.py", "--smoke", "--save", str(saved), cwd=tmp_path)
    assert "closed loop" in text and "targets:" in text
    r = json.loads(saved.read_text())
    has(r, "closed_loop", "open_loop", "targets", "passes", "plan", "vllm_bench")
    assert r["plan"]["rounds"] == 1 and r["plan"]["requests"] == 20
    ran = {(p["mode"], p["client"]) for p in r["passes"]}
    assert {("closed", "llmadapt"), ("open", "llmadapt"), ("open", "timer only")} <= ran
    assert all(p["completed"] == 20 for p in r["passes"] if p["client"] == "llmadapt")
    if environments_unready("vllm") is None:
        assert r["vllm_bench"] == "ready" and ("closed", "vllm bench") in ran
        has(r["closed_loop"], "ratio", "ratio_per_round")


@unready("hf")
def test_load_sweep(tmp_path):
    r = json.loads(bench("load_sweep.py", "--smoke", "--json", cwd=tmp_path))
    has(r, "simulated", "real")
    for s in r["simulated"]:
        has(s, "shape", "capacity", "found", "probes", "scan")
    real = r["real"]
    assert real["engine"] == "hf" and [p["offered"] for p in real["sweep"]] == [4]
    has(real["sweep"][0], "achieved", "ttft_p99_ms", "tpot_p99_ms", "send_lag_p99_ms", "valid")
    has(real["sla"], "capacity", "fails_at", "boundary", "shape", "probes", "scan")
    assert real["sla"]["maximum"] == 2 and real["sla"]["probes"]
    # the text report, of the simulated part alone (a second)
    assert "probes against" in bench("load_sweep.py", "--smoke", "--no-engine", cwd=tmp_path)


@unready("vllm", "hf")
def test_foreign_results(tmp_path):
    """vllm bench serve's result file, as today's vllm environment writes it, beside llmadapt's run of the same
    stream, and `runs import` of it with that run as its workload: the import reads what the tool writes now."""
    from llmadapt.testing import environments_unready

    if environments_unready("vllm"):
        pytest.skip(environments_unready("vllm"))
    bench("foreign_results.py", "--smoke", "--out", str(tmp_path / "work"), cwd=tmp_path)
    (run_dir,) = (tmp_path / "work" / "runs").iterdir()
    done = subprocess.run([sys.executable, "-m", "llmadapt.cli", "runs", "import", str(tmp_path / "work" / "vllm-bench.json"),
                           "--workload", str(run_dir), "--tool-version", "smoke", "--root", str(tmp_path / "store"),
                           "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["imported"]) == 1


def test_vllm_crosscheck(tmp_path):
    """Both clients on one transformers-serve engine (vLLM's engine takes minutes to start on a CPU), the engine
    pinned to one CPU and the clients to the rest where there are two or more."""
    out = tmp_path / "crosscheck.json"
    pin = ["--pin"] if len(os.sched_getaffinity(0)) > 1 else []
    text = bench("vllm_crosscheck.py", "--smoke", "--engine", "hf", "--out", str(tmp_path / "work"), "--json",
                 str(out), *pin, cwd=tmp_path)
    assert "closed c=2" in text and "vllm bench" in text
    r = json.loads(out.read_text())
    if pin:  # the engine's process ran where it was put, apart from the clients
        cpus = sorted(os.sched_getaffinity(0))
        assert r["pinned"] == {"engine": cpus[:1], "clients": cpus[1:], "engine_process": cpus[:1]}, r["pinned"]
        assert f"the engine pinned to CPU {cpus[:1]}" in text
    has(r, "engine", "points", "requests", "work_dir", "sharegpt", "input_tokens", "output_tokens")
    (passes,) = r["points"].values()
    assert [p["client"] for p in passes] == ["llmadapt", "vllm bench"]
    for p in passes:
        has(p, "completed", "failed", "cpu_ms_per_request", "server", *("ttft", "tpot", "itl", "e2el"))
        assert p["completed"] == 4


@needs_torch_here
@unready("torch")
def test_model_loading(tmp_path):
    r = json.loads(bench("model_loading.py", "--smoke", "--json", cwd=tmp_path))
    has(r, "model", "parameters", "weights_bytes", "write", "load")
    assert r["model"]["hidden_size"] == 64 and r["model"]["num_layers"] == 1
    for how in ("whole", "streaming"):
        has(r["write"][how], "peak_rss_bytes", "seconds")
    torch = r["load"]["torch"]
    has(torch, "estimate", "step", "rank-00000", "rank-00001")
    assert torch["step"] == "ok"
    has(torch["rank-00000"], "setup_peak_rss_bytes", "setup_seconds", "first_step_seconds")


@unready("torch")
def test_repeat(tmp_path):
    (row,) = json.loads(bench("repeat.py", "torch", "--smoke", "--out", str(tmp_path / "runs"), "--json",
                              cwd=tmp_path))
    has(row, "config", "ok", "teardown", "failed", "reasons", "wall_s")
    assert row["times"] == 1 and row["ok"] + row["teardown"] + row["failed"] == 1
    assert row["failed"] == 0, row["reasons"]


@pytest.mark.skipif(bool(hta_unready()), reason=hta_unready() or "")
def test_hta_crosscheck(tmp_path):
    (row,) = json.loads(bench("hta_crosscheck.py", "--smoke", "--json", cwd=tmp_path))
    has(row, "trace", "llmadapt", "hta")
    for tool in ("llmadapt", "hta"):
        has(row[tool], "span_ms", "idle_ms", "compute_ms", "non_compute_ms", "overlap_pct", "computation_ms")
    table = bench("hta_crosscheck.py", "--smoke", cwd=tmp_path)
    assert table.startswith("| trace | tool |") and "| hta |" in table


@unready("torch")
def test_independent_check(tmp_path):
    out = tmp_path / "independent.json"
    text = bench("independent_check.py", "--smoke", "--json", str(out), cwd=tmp_path)
    assert re.search(r"^verdict ", text, re.M) and "not judged" in text
    r = json.loads(out.read_text())
    has(r, "classes", "within", "counts_per_run", "max_loss_difference", "step_seconds_median", "per_run")
    assert r["runs"] == 1 and len(r["profiled_steps"]) == 1 and r["classes"]
    has(r["classes"][0], "class", "llmadapt", "bare", "difference", "within", "count_llmadapt", "count_bare")


@unready("torch")
def test_verdicts(tmp_path):
    out = tmp_path / "verdicts.json"
    text = bench("verdicts.py", "--smoke", "--json", str(out), cwd=tmp_path)
    assert "calibration:" in text and "not judged (--smoke)" in text
    r = json.loads(out.read_text())
    has(r, "counts", "verdicts", "load")
    assert sorted(r["counts"]) == ["difference, loaded", "difference, quiet", "equal, loaded", "equal, quiet"]
    assert len(r["verdicts"]) == 4 and all(v["verdict"] for v in r["verdicts"])


@unready("torch")
def test_store_scale(tmp_path):
    r = json.loads(bench("store_scale.py", "--smoke", "--json", cwd=tmp_path))
    has(r, "index_s", "reopen_s", "query_one_s", "query_name_s", "query_field_s", "query_all_s", "rescan_s",
        "cli_list_s", "cli_list_all_s", "loadavg", "date")
    assert r["runs"] == 100 and r["repeat"] == 1
    assert r["cli_list_lines"] == 2 + 50 + 1 and r["cli_list_all_lines"] == 2 + 100 + 1  # head, rule; rows; count


@unready("torch")
def test_memory_check(tmp_path):
    out = tmp_path / "memory.json"
    text = bench("memory_check.py", "--smoke", "--json", str(out), cwd=tmp_path)
    assert "weights (modelled)" in text and "estimate GiB" in text
    r = json.loads(out.read_text())
    has(r, "shape", "keep_input", "weights_bytes", "results")
    assert len(r["results"]) == 2 and {x["recompute"] for x in r["results"]} == {True, False}
    has(r["results"][0], "peak_bytes", "peak_phase", "phases", "estimate_bytes", "rows")


@unready("torch")
def test_tune_vs_grid(tmp_path):
    out = tmp_path / "tune.json"
    text = bench("tune_vs_grid.py", "--smoke", "--json", str(out), cwd=tmp_path)
    assert "within the grid's noise in" in text
    r = json.loads(out.read_text())
    has(r, "repeats", "within_noise", "of", "median_probe_time_ratio")
    (row,) = r["repeats"]
    has(row, "grid_best", "tune_best", "within_noise", "grid_probe_s", "tune_probe_s", "probe_time_ratio")
    assert row["grid_best"] and row["tune_best"]


def test_tune_vs_grid_on_serving(tmp_path):
    """The serving arm on the reference server: the grid and the race over the same configurations, one load each."""
    if environments_unready("hf"):
        pytest.skip(environments_unready("hf"))
    out = tmp_path / "serving.json"
    text = bench("tune_vs_grid.py", "--serving", "--smoke", "--json", str(out), cwd=tmp_path)
    assert "within the grid's noise in" in text and "serving repeat 1/1" in text
    r = json.loads(out.read_text())
    (row,) = r["repeats"]
    has(row, "grid_best", "tune_best", "within_noise", "grid_probe_s", "tune_probe_s", "tune_searched", "candidates")
    assert row["candidates"] == 2 and row["tune_searched"] == 2


def test_tune_vs_grid_planted_case_finds_its_two_rows(tmp_path):
    """The planted space is two configurations (recomputation off and full); each repeat reports what became of both
    (found or not is a timing result: not asserted here)."""
    out = tmp_path / "planted.json"
    text = bench("tune_vs_grid.py", "--planted", "--smoke", "--json", str(out), cwd=tmp_path)
    assert "planted winner found in" in text
    r = json.loads(out.read_text())
    (row,) = r["planted"]
    assert len(row["outcomes"]) == 2 and sum("recompute=full" in label for label in row["outcomes"]) == 1
    full = next(outcome for label, outcome in row["outcomes"].items() if "recompute=full" in label)
    assert row["found"] == full.startswith("dropped")  # what it counts is what the race did
    assert r["found"] + r["wrong_winner_certain"] <= 1


def test_vllm_crosschecks_subset_is_the_entries_llmadapt_draws_within_the_filters(tmp_path):
    """--subset: both clients read one file holding exactly the entries llmadapt's planner sends (its seed's order,
    the length filters), each as its first human turn and that turn's answer."""
    from types import SimpleNamespace

    from llmadapt import Workload
    from llmadapt.models import train_tokenizer
    from llmadapt.runtime.requests import plan_requests

    spec = importlib.util.spec_from_file_location("vllm_crosscheck", ROOT / "benchmarks" / "vllm_crosscheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tok = train_tokenizer(512)
    words = "the cat sat on a mat and then it ran far away from home".split()
    entries = [{"conversations": [{"from": "human", "value": " ".join(words[:3 + i % 9])},
                                  {"from": "gpt", "value": " ".join(words[:2 + i % 13])},
                                  {"from": "human", "value": "more"}]} for i in range(40)]
    source = tmp_path / "all.json"
    source.write_text(json.dumps(entries))
    args = SimpleNamespace(subset=5, min_input_len=4, max_input_len=8, min_output_len=4, max_output_len=None)
    subset = module.write_subset(source, tmp_path / "subset.json", module.MODEL, tok, args)
    written = json.loads(subset.read_text())
    w = Workload.from_dict({"kind": "serve", "model": module.MODEL, "serve": {
        "requests": 5, "warmup_requests": 0,
        "source": {"kind": "sharegpt", "path": str(source), "min_input_len": 4, "max_input_len": 8}}})
    sent = sorted((p.prompt, p.output_tokens) for p in plan_requests(w, tok))
    assert sorted((e["conversations"][0]["value"], len(tok.encode(e["conversations"][1]["value"],
                                                                  add_special_tokens=False).ids))
                  for e in written) == sent
    assert all(len(e["conversations"]) == 2 for e in written)
