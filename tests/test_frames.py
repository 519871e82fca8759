"""Runs as DataFrames (llmadapt.analysis.frames, RunStore.steps/..., Comparison.to_frame) and Parquet files, on
real runs: tiny-llama on two data-parallel ranks with a profiled step and telemetry, a comparison of two
micro-batch sizes (inline, 3 steps), and a serving run against the fake OpenAI server; each frame is checked
against the records the runs wrote."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmadapt import Workload, run
from llmadapt.analysis import frames
from llmadapt.experiments.compare import compare
from llmadapt.analysis.store import RunStore
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.host import free_port
from llmadapt.testing import environments_unready

pd = pytest.importorskip("pandas", reason="frames need pandas (the report extra)")
pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (the report extra)")
pytestmark = pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).parent
TINY = ["train.steps=3", "train.warmup_steps=1", "train.seq_len=32", "train.global_batch=8"]


def tiny(*extra: str) -> Workload:
    return Workload.from_file(ROOT / "examples" / "tiny-llama.toml").with_overrides([*TINY, *extra])


def records(run_dir, kind: str) -> list[dict]:
    return [r for p in RunDir(run_dir).rank_files() for r in read_jsonl(p) if r["type"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs of this file, all under one store root: (root, dp2 run dir, comparison, serving run dir)."""
    out = tmp_path_factory.mktemp("runs")
    dp2 = run(tiny("parallelism.dp=2", "profile.steps=[2]", "profile.level=operator", "telemetry.interval_s=0.01",
                   "name=frames-dp2"), "torch", out=out)
    assert dp2.ok, dp2.summary.failures
    comparison = compare(tiny("telemetry.interval_s=0", "name=frames-mb"), ["torch"],
                         matrix={"train.micro_batch": [2, 4]}, launcher="inline", out=out)
    assert [r.status for r in comparison.rows] == ["ok", "ok"]
    served = _serving_run(out) if _has_openai() else None
    return out, dp2.run_dir, comparison, served


def _has_openai() -> bool:
    try:
        import llmadapt_openai  # noqa: F401
    except ImportError:
        return False
    return True


def _serving_run(out: Path) -> Path:
    port = free_port()
    server = subprocess.Popen([sys.executable, str(HERE / "fake_openai.py"), str(port), "--first-ms", "20",
                               "--token-ms", "5"])
    try:
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        w = Workload.from_dict({"kind": "serve", "name": "frames-serve", "model": {"preset": "tiny-llama"}, "serve": {
            "url": f"http://127.0.0.1:{port}", "requests": 8, "warmup_requests": 1, "input_len": {"mean": 16},
            "output_len": {"mean": 6}, "arrival": {"process": "constant", "rate": 40.0}, "request_timeout_s": 5.0}})
        result = run(w, "openai", out=out)
        assert result.ok, result.summary.failures
        return result.run_dir
    finally:
        server.kill()
        server.wait()


def test_steps_are_every_rank_and_step_with_units_in_the_names(runs):
    _, dp2, _, _ = runs
    steps = frames.steps(dp2)
    written = records(dp2, "step")
    assert len(steps) == len(written) == 2 * 4 and sorted(set(steps["rank"])) == [0, 1]
    assert list(steps.columns[:8]) == [*frames.IDENTITY, "step"]
    assert {"step_time_s", "tokens_per_s", "samples_per_s", "peak_rss_bytes", "run_delay_s", "phase_forward_s",
            "phase_backward_s", "phase_optimizer_s", "start_utc"} <= set(steps.columns)
    assert set(steps["label"]) == {"torch dp2"} and set(steps["workload"]) == {"frames-dp2"}
    by_key = steps.set_index(["rank", "step"])
    for r in written:
        row = by_key.loc[(r["rank"], r["step"])]
        assert row["step_time_s"] == r["seconds"] and row["tokens"] == r["tokens"] and row["loss"] == r["loss"]
        assert row["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert row["warmup"] == r["warmup"] and row["profiled"] == r["profiled"]
        assert row["phase_forward_s"] == sum(p["seconds"] for p in r["phases"] if p["name"] == "forward")
    assert steps[steps.profiled]["step"].tolist() == [2, 2]
    for _, rank in steps.groupby("rank"):  # wall-clock times from each rank's own anchors: in step order
        assert rank.sort_values("step")["start_utc"].is_monotonic_increasing


def test_breakdown_is_a_row_per_class_rank_and_profiled_step(runs):
    _, dp2, _, _ = runs
    classes = frames.breakdown(dp2)
    written = records(dp2, "breakdown")
    assert len(written) == 2
    keys = ("modules", "operators", "module_operators", "kernel_types", "layers", "collectives")
    assert len(classes) == sum(len(b[k]) for b in written for k in keys)
    assert {"module", "operator", "module_operator", "layer", "collective"} <= set(classes["kind"])
    for b in written:
        mine = classes[(classes["rank"] == b["rank"]) & (classes["step"] == b["step"])]
        modules = mine[mine.kind == "module"]
        assert modules.set_index("name")["time_s"].to_dict() == {c["name"]: c["seconds"] for c in b["modules"]}
        assert modules["share_of_step"].sum() == pytest.approx(sum(c["seconds"] for c in b["modules"])
                                                               / b["step_seconds"])
        collectives = mine[mine.kind == "collective"]
        assert sorted(collectives["name"]) == sorted(c["kind"] for c in b["collectives"])
        assert collectives["bytes"].tolist() == [c["bytes"] for c in b["collectives"]]
        layers = mine[mine.kind == "layer"].set_index("name")
        for layer in b["layers"]:
            assert layers.loc[f"layer {layer['layer']}", "forward_s"] == layer["forward_seconds"]


def test_telemetry_is_a_row_per_sample_with_the_step_it_was_taken_in(runs):
    _, dp2, _, _ = runs
    samples = frames.telemetry(dp2)
    written = records(dp2, "telemetry")
    assert len(samples) == len(written) and sorted(set(samples["rank"])) == [0, 1]
    assert {"cpu_percent", "rss_bytes", "gpu_util_percent", "power_w", "energy_j", "time_utc"} <= set(samples.columns)
    assert samples["gpu_util_percent"].isna().all()  # a CPU run: not measured, never a zero
    steps = {(r["rank"], r["step"]): (r["start_ns"], r["end_ns"]) for r in records(dp2, "step")}
    placed = samples.dropna(subset=["step"])
    assert len(placed) > 0
    for _, s in placed.iterrows():
        start, end = steps[(s["rank"], s["step"])]
        assert start <= s["time_ns"] <= end
    for _, s in samples[samples["step"].isna()].iterrows():  # between steps: inside none of its rank's
        assert not any(start <= s["time_ns"] <= end for (rank, _), (start, end) in steps.items() if rank == s["rank"])


def test_requests_are_a_row_per_request_with_the_summarys_latencies(runs):
    _, _, _, served = runs
    if served is None:
        pytest.skip("the openai adapter package is not installed (pip install -e plugins/openai)")
    reqs = frames.requests(served)
    written = records(served, "request")
    assert len(reqs) == len(written) == 9 and reqs["warmup"].sum() == 1 and set(reqs["rank"]) == {0}
    assert {"ttft_ms", "tpot_ms", "itl_mean_ms", "e2el_ms", "send_lag_ms", "input_tokens", "output_tokens"} <= set(
        reqs.columns)
    for r in written:
        row = reqs.set_index("request").loc[r["index"]]
        assert row["ttft_ms"] == pytest.approx((r["first_token_ns"] - r["sent_ns"]) / 1e6)
        assert row["e2el_ms"] == pytest.approx((r["end_ns"] - r["sent_ns"]) / 1e6)
        assert row["chunks"] == len(r["chunk_ns"])
    serving = json.loads(RunDir(served).summary_file.read_text())["serving"]
    measured = reqs[~reqs.warmup & (reqs.status == "ok")]
    assert measured["ttft_ms"].median() == pytest.approx(serving["ttft_ms"]["p50"])
    assert measured["e2el_ms"].max() == pytest.approx(serving["e2el_ms"]["max"])
    assert measured["tpot_ms"].mean() == pytest.approx(serving["tpot_ms"]["mean"])


def test_a_comparison_and_a_store_query_give_the_same_frames(runs):
    root, dp2, comparison, served = runs
    table = comparison.to_frame()
    assert table["label"].tolist() == [r.label for r in comparison.rows] == ["torch dp1 mb2", "torch dp1 mb4"]
    assert {"step_p50_s", "tokens_per_s", "step_p50_s_low", "step_p50_s_high"} <= set(table.columns)
    assert table["step_p50_s"].tolist() == [r.metrics["step_p50_s"] for r in comparison.rows]
    steps = comparison.to_frame("steps")
    assert steps.groupby("label").size().to_dict() == {r.label: len(records(r.run_dir, "step"))
                                                      for r in comparison.rows}
    with RunStore(root) as store:
        stored = store.steps("workload=frames-mb")
        every = store.steps()  # the serving run, which has no steps, adds no rows
        assert len(store.breakdown()) == len(frames.breakdown(dp2))
        if served is not None:
            assert len(store.requests("kind=serve")) == len(records(served, "request"))
    order = ["run_id", "rank", "step"]
    pd.testing.assert_frame_equal(stored.sort_values(order).reset_index(drop=True),
                                  steps.sort_values(order).reset_index(drop=True))
    assert len(every) == len(steps) + len(frames.steps(dp2))


@pytest.mark.parametrize("name", list(frames.FRAMES))
def test_each_frame_round_trips_through_parquet(runs, name, tmp_path):
    root, dp2, _, served = runs
    source = served if name == "requests" else dp2
    if source is None:
        pytest.skip("no serving run (the openai adapter package is not installed)")
    frame = frames.frame(name, source)
    schema = {"steps": frames.STEP_COLUMNS, "requests": frames.REQUEST_COLUMNS, "breakdown": frames.BREAKDOWN_COLUMNS,
              "telemetry": frames.TELEMETRY_COLUMNS}[name]
    # Every column has its type, even one no record filled (a CPU run's GPU figures, a collective's algorithm):
    # frames of different runs concatenate, and their Parquet files share one schema.
    assert {c: str(frame[c].dtype) for c in schema} == schema
    back = pd.read_parquet(frames.to_parquet(frame, tmp_path / f"{name}.parquet"))
    pd.testing.assert_frame_equal(back, frame)
    with RunStore(root) as store:
        path = store.to_parquet(tmp_path / "stored.parquet", f"run={Path(source).name}", frame=name)
    pd.testing.assert_frame_equal(pd.read_parquet(path), frame)


def test_frames_of_runs_without_their_records_are_one_line(runs, tmp_path):
    root, dp2, comparison, served = runs
    unprofiled = comparison.rows[0].run_dir
    cases = [(frames.requests, dp2, r"no request records in .*: it is a training run"),
             (frames.breakdown, unprofiled, r"no breakdown records in .*: it profiled no step \(set profile.steps"),
             (frames.telemetry, unprofiled, r"no telemetry samples in .*: its sampler was off \(telemetry.interval_s"),
             (frames.steps, tmp_path, r"is not a run folder \(no launch.json\)"),
             (frames.steps, [], r"step records: no runs given"),
             (frames.steps, 42, r"cannot read runs from a int")]
    if served is not None:
        cases.append((frames.steps, served, r"no step records in .*: it is a serving run"))
    for function, source, message in cases:
        with pytest.raises(LlmadaptError, match=message) as caught:
            function(source)
        assert "\n" not in str(caught.value)
    with pytest.raises(LlmadaptError, match=r"no request records in .*\(and 1 more run\(s\) without them\)"):
        comparison.to_frame("requests")
    with pytest.raises(LlmadaptError, match="unknown frame 'step'; frames: steps, requests, breakdown, telemetry"):
        comparison.to_frame("step")
    with RunStore(root) as store, pytest.raises(LlmadaptError, match="no stored run in .* matches adapter=nothing"):
        store.steps("adapter=nothing")
    with pytest.raises(LlmadaptError, match="is a folder, expected a Parquet file"):
        frames.to_parquet(frames.steps(dp2), tmp_path)


def test_without_pandas_or_pyarrow_a_frame_is_one_line_naming_what_to_install(runs, monkeypatch, tmp_path):
    _, dp2, comparison, _ = runs
    frame = frames.steps(dp2)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(LlmadaptError, match=r"^Parquet needs pyarrow: pip install 'llmadapt\[report\]'"):
        frames.to_parquet(frame, tmp_path / "steps.parquet")
    monkeypatch.setitem(sys.modules, "pandas", None)
    for make in (lambda: frames.steps(dp2), comparison.to_frame, lambda: comparison.to_frame("steps")):
        with pytest.raises(LlmadaptError, match=r"^a DataFrame needs pandas: pip install 'llmadapt\[report\]'"):
            make()


def test_the_documented_notebook_example_runs_as_written(tmp_path):
    """Every `<!-- runnable -->` Python block of docs/dataframes.md, in a folder holding a copy of examples/."""
    text = (ROOT / "docs" / "dataframes.md").read_text()
    blocks = re.findall(r"<!-- runnable[^>]*-->\n```python\n(.*?)```", text, re.DOTALL)
    assert blocks, "docs/dataframes.md has no runnable Python block"
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for body in blocks:
        done = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert pd.read_parquet(tmp_path / "steps.parquet")["label"].nunique() == 2
    assert (tmp_path / "breakdown.parquet").is_file()


def test_the_command_line_writes_a_frame_to_parquet(runs, tmp_path):
    """`llmadapt runs QUERY --parquet FILE --frame steps`: the same frame as the store's, from the command line."""
    root, dp2, _, _ = runs
    out = tmp_path / "steps.parquet"
    done = subprocess.run([sys.executable, "-m", "llmadapt.cli", "runs", f"run={Path(dp2).name}", "--root", str(root),
                           "--parquet", str(out), "--frame", "steps"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stderr and "(steps of 1 runs)" in done.stderr
    pd.testing.assert_frame_equal(pd.read_parquet(out), frames.steps(dp2))
