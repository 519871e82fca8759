"""The MLflow sink (plugins/mlflow) against a real tracking server: ``mlflow server`` from the 'mlflow'
environment (llmadapt env create mlflow), on 127.0.0.1 with an SQLite backend store and an artifact folder under
the test's temporary folder, read back over HTTP with MlflowClient. The server starts with the module and boots
while the tests that need none run."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

import llmadapt
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.host import free_port
from llmadapt.launch.environments import MLFLOW_ENVIRONMENT, EnvironmentNotReadyError, python_for
from llmadapt.launch.runner import run

pytest.importorskip("llmadapt_mlflow", reason="pip install -e plugins/mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402 - after the skip

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


def _server_python() -> Path | None:
    try:
        return python_for(MLFLOW_ENVIRONMENT)
    except EnvironmentNotReadyError:
        return None


def tiny(*extra: str) -> llmadapt.Workload:
    return llmadapt.Workload.from_file(ROOT / "examples" / "tiny-llama.toml").with_overrides([f"train.steps={STEPS}",
                                                                                               *extra])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Started when the module's first test asks for it; `uri()` waits until it answers."""
    python = _server_python()
    if python is None:
        pytest.skip("environment 'mlflow' has not been built: llmadapt env create mlflow (needs the network once)")
    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen(
        [str(python), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", str(folder / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def uri(timeout: float = 180) -> str:
        import requests

        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, (folder / "server.log").read_text()[-3000:]
            try:
                if requests.get(url + "/health", timeout=2).ok:
                    return url
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise AssertionError("mlflow server did not answer in time:\n" + (folder / "server.log").read_text()[-3000:])

    yield uri
    os.killpg(proc.pid, 9)  # the server and its uvicorn worker; nothing of theirs is kept
    proc.wait()
    log.close()


def test_a_server_that_answers_nothing_costs_one_line_and_no_record(server, tmp_path, monkeypatch):
    """A closed port: the run is made and recorded as always; the console gets one warning line."""
    closed = free_port()  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed}")
    events: list[dict] = []
    started = time.monotonic()
    result = run(tiny(), "torch", launcher="inline", out=tmp_path / "runs", progress=events.append)
    assert result.ok and time.monotonic() - started < 60
    warnings = [e["message"] for e in events if e["type"] == "warning"]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert re.fullmatch(rf"record sink of plugin 'mlflow' failed to start: MLflow tracking server "
                        rf"http://127\.0\.0\.1:{closed} answers nothing \(connection refused\); the run is recorded "
                        r"locally only", warnings[0]), warnings[0]
    steps = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "step"]
    assert len(steps) == result.summary.steps_completed and result.summary.measured_steps == STEPS
    assert json.loads((result.run_dir / "summary.json").read_text())["status"] == "ok"


def test_a_run_becomes_an_mlflow_run(server, tmp_path, monkeypatch):
    uri = server()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "one-run")
    events: list[dict] = []
    result = run(tiny("name=mlflow-one"), "torch", launcher="inline", out=tmp_path / "runs", progress=events.append)
    assert result.ok and [e for e in events if e["type"] == "warning"] == []

    client = MlflowClient(uri)  # over HTTP, as any reader would
    experiment = client.get_experiment_by_name("one-run")
    (found,) = client.search_runs([experiment.experiment_id])
    rid, s = found.info.run_id, result.summary
    assert found.info.status == "FINISHED" and found.info.run_name == "mlflow-one"
    params = found.data.params
    assert params["train.steps"] == str(STEPS) and params["model.name"] == "tiny-llama"
    assert params["train.lr"] == "0.003" and params["kind"] == "train"
    # every step (warm-up included): step time, loss, tokens/s; the losses as recorded
    for name in ("step_time_s", "loss", "tokens_per_s"):
        history = client.get_metric_history(rid, name)
        assert sorted(m.step for m in history) == list(range(s.steps_completed)), name
    losses = {m.step: m.value for m in client.get_metric_history(rid, "loss")}
    assert [losses[i] for i in range(s.steps_completed)] == pytest.approx(result.losses)
    assert found.data.metrics["summary.step_time_s.p50"] == pytest.approx(s.step_time_s.p50)
    assert found.data.metrics["summary.measured_steps"] == STEPS
    tags = found.data.tags
    assert tags["llmadapt.problem_hash"] == s.problem_hash and tags["llmadapt.workload_hash"] == s.workload_hash
    assert tags["llmadapt.adapter"] == "torch" and tags["llmadapt.status"] == "ok"
    assert tags["llmadapt.run_id"] == result.run_dir.name
    assert {a.path for a in client.list_artifacts(rid)} == {"run", "report.txt"}
    local = {p.name for p in result.run_dir.iterdir() if p.is_file()}
    assert {a.path for a in client.list_artifacts(rid, "run")} == {f"run/{n}" for n in local}
    copy = Path(client.download_artifacts(rid, "run/rank-00000.jsonl", str(tmp_path / "down")))
    assert copy.read_bytes() == (result.run_dir / "rank-00000.jsonl").read_bytes()
    report = Path(client.download_artifacts(rid, "report.txt", str(tmp_path / "down"))).read_text()
    assert report.startswith(f"run        {result.run_dir.name}  [ok]")


def test_a_sink_that_fails_during_the_run_loses_no_record(server, monkeypatch, run_with_a_failing_sink):
    """The server refuses the metrics: the sink is dropped with one warning; the records stay on disk and still
    reach on_record."""
    from llmadapt_mlflow import MlflowSink

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server())

    def refuse(self):
        raise ConnectionError("the server went away")

    monkeypatch.setattr(MlflowSink, "flush", refuse)
    run_with_a_failing_sink(tiny(), "mlflow", "the server went away")


def test_a_comparison_is_a_parent_run_with_its_cells_as_children(server, tmp_path, monkeypatch):
    """The Python block of docs/runs.md's MLflow section, as written, in a folder with examples/."""
    text = (ROOT / "docs" / "runs.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text[text.index("### MLflow"):], re.DOTALL)[:1]
    uri = server()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "comparison")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "docs/runs.md", "exec"), scope)
    parent, comparison = scope["parent"], scope["comparison"]
    assert parent and [r.status for r in comparison.rows] == ["ok", "ok"]

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("comparison")
    runs = client.search_runs([experiment.experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    assert len(runs) == 3 and len(children) == 2
    assert client.get_run(parent).info.status == "FINISHED"
    assert sorted(r.data.params["train.lr"] for r in children) == ["0.003", "0.01"]
    assert {r.data.tags["llmadapt.run_id"] for r in children} == {Path(d).name for row in comparison.rows
                                                                  for d in row.run_dirs}


def test_a_comparison_from_the_command_line_is_a_parent_run_with_parity_deltas(server, tmp_path, compare_two_cells):
    """`llmadapt compare` with a tracking URI and no parent of the user's: the comparison is the parent run (named
    for its cells), its runs the children, each tagged with its row and its parity delta (the second layout of
    one problem against the first), the rows as the artifact comparison.json."""
    uri = server()
    rows = compare_two_cells({"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "cli-compare"}, STEPS)

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("cli-compare")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("llmadapt.parent") == "true"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 3 and len(children) == 2 and parent.info.status == "FINISHED"
    assert parent.info.run_name.startswith("tiny-llama-pretrain: ")
    by_run = {r.data.tags["llmadapt.run_id"]: r.data.tags for r in children}
    for row in rows:
        tags = by_run[Path(row["run_dir"]).name]
        assert tags["llmadapt.row"] == row["label"]
        assert float(tags["llmadapt.parity_delta"]) == pytest.approx(row["metrics"]["parity_delta"], rel=1e-3, abs=1e-15)
    saved = Path(client.download_artifacts(parent.info.run_id, "comparison.json", str(tmp_path / "down")))
    assert [r["label"] for r in json.loads(saved.read_text())["rows"]] == [r["label"] for r in rows]
    # the HTML report of the comparison's runs: one table row per run, named by its run id
    html = Path(client.download_artifacts(parent.info.run_id, "report.html", str(tmp_path / "down"))).read_text()
    assert html.startswith("<!DOCTYPE html>") and all(Path(r["run_dir"]).name in html for r in rows)
