"""The TensorBoard sink (plugins/tensorboard): the event files it writes, read back with tensorboardX's own protocol
buffers (TFRecord framing undone here), for a run, a failing folder, a failing sink and a comparison. The same
checks as the MLflow sink's (tests/test_mlflow.py)."""

import json
import re
import struct
from pathlib import Path

import pytest

import llmadapt
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.launch.runner import run

pytest.importorskip("llmadapt_tensorboard", reason="pip install -e plugins/tensorboard")
from tensorboardX.proto import event_pb2  # noqa: E402 - after the skip

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


def tiny(*extra: str) -> llmadapt.Workload:
    return llmadapt.Workload.from_file(ROOT / "examples" / "tiny-llama.toml").with_overrides([f"train.steps={STEPS}",
                                                                                               *extra])


def events(logdir: Path) -> list:
    """Every event of every event file in a TensorBoard run folder (TFRecord: length (8 bytes), its CRC (4), the
    event, its CRC (4))."""
    found = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + n])
            found.append(event)
            pos += 12 + n + 4
    return found


def scalars(logdir: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """{tag: {step: (value, wall time)}}."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for e in events(logdir):
        for v in e.summary.value:
            if v.HasField("simple_value"):
                out.setdefault(v.tag, {})[e.step] = (v.simple_value, e.wall_time)
    return out


def texts(logdir: Path) -> dict[str, str]:
    """{tag: text} of the text summaries (Markdown; a code block's indentation removed)."""
    out = {}
    for e in events(logdir):
        for v in e.summary.value:
            if v.metadata.plugin_data.plugin_name == "text":
                text = v.tensor.string_val[0].decode()
                out[v.tag.removesuffix("/text_summary")] = "\n".join(line.removeprefix("    ") for line in text.splitlines())
    return out


def test_a_folder_that_cannot_be_written_costs_one_line_and_no_record(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LLMADAPT_TENSORBOARD_DIR", str(tmp_path / "a-file" / "tb"))
    events_seen: list[dict] = []
    result = run(tiny(), "torch", launcher="inline", out=tmp_path / "runs", progress=events_seen.append)
    assert result.ok
    warnings = [e["message"] for e in events_seen if e["type"] == "warning"]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert re.fullmatch(r"record sink of plugin 'tensorboard' failed to start: TensorBoard folder \S+/a-file/tb/\S+ "
                        r"cannot be written \(Not a directory\); the run is recorded locally only", warnings[0]), warnings
    steps = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "step"]
    assert len(steps) == result.summary.steps_completed and result.summary.measured_steps == STEPS


def test_a_run_becomes_a_tensorboard_run(tmp_path, monkeypatch):
    """Every step's loss and time as scalars stamped with when the step ended, the summary's figures, the settings,
    the tags and the report as text; the callback gets the same steps as they happen."""
    monkeypatch.setenv("LLMADAPT_TENSORBOARD_DIR", str(tmp_path / "tb"))
    seen: list[dict] = []
    result = run(tiny("name=tb-one"), "torch", launcher="inline", out=tmp_path / "runs", on_record=seen.append)
    assert result.ok
    s, logdir = result.summary, tmp_path / "tb" / result.run_dir.name
    assert [r["step"] for r in seen if r["type"] == "step"] == list(range(s.steps_completed))
    found = scalars(logdir)
    steps = list(range(s.steps_completed))
    for name in ("step_time_s", "loss", "grad_norm", "tokens_per_s", "samples_per_s", "memory_peak_bytes"):
        assert sorted(found[name]) == steps, name
    assert [found["loss"][i][0] for i in steps] == pytest.approx(result.losses, rel=1e-6)  # float32 in the file
    recorded = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "step"]
    assert [found["step_time_s"][r["step"]][0] for r in recorded] == pytest.approx([r["seconds"] for r in recorded],
                                                                                  rel=1e-6)
    # stamped with when each step ended on the run's clock (an inline run hands its records over at its end): the
    # wall times are as far apart as the steps' ends, to a microsecond (wall_time is a double)
    walls = [found["step_time_s"][r["step"]][1] for r in recorded]
    assert [w - walls[0] for w in walls] == pytest.approx([(r["end_ns"] - recorded[0]["end_ns"]) / 1e9
                                                           for r in recorded], abs=1e-6)
    assert found["summary.step_time_s.p50"][0][0] == pytest.approx(s.step_time_s.p50, rel=1e-6)
    assert found["summary.measured_steps"][0][0] == STEPS
    text = texts(logdir)
    assert "train.steps = 3" in text["llmadapt/workload"].splitlines()
    assert 'model.name = "tiny-llama"' in text["llmadapt/workload"].splitlines()
    tags = json.loads(text["llmadapt/tags"])
    assert tags["problem_hash"] == s.problem_hash and tags["status"] == "ok" and tags["adapter"] == "torch"
    assert json.loads(text["llmadapt/run"])["run_id"] == result.run_dir.name
    assert text["llmadapt/report"].startswith(f"run        {result.run_dir.name}  [ok]")


def test_a_sink_that_fails_during_the_run_loses_no_record(tmp_path, monkeypatch, run_with_a_failing_sink):
    """The sink raises on a record: it is dropped with one warning; the records stay on disk and reach on_record."""
    from llmadapt_tensorboard import TensorBoardSink

    monkeypatch.setenv("LLMADAPT_TENSORBOARD_DIR", str(tmp_path / "tb"))

    def refuse(self, record):
        raise OSError("No space left on device")

    monkeypatch.setattr(TensorBoardSink, "write", refuse)
    run_with_a_failing_sink(tiny(), "tensorboard", "No space left on device")


def test_a_comparison_from_the_command_line_puts_its_runs_side_by_side(tmp_path, compare_two_cells):
    """`llmadapt compare`: one folder for the comparison with its runs inside (TensorBoard draws them together),
    each with its row and parity delta, and the rows as comparison.json."""
    rows = compare_two_cells({"LLMADAPT_TENSORBOARD_DIR": str(tmp_path / "tb")}, STEPS)
    (folder,) = (tmp_path / "tb").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}-tiny-llama-pretrain-torch-dp1-mb4-threads_per_rank-0-torch-dp1-mb4-threads_per_r[\w-]*", folder.name), folder.name
    saved = json.loads((folder / "comparison.json").read_text())
    assert saved["status"] == "FINISHED" and [r["label"] for r in saved["rows"]] == [r["label"] for r in rows]
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == sorted(Path(r["run_dir"]).name for r in rows)
    for row in rows:
        logdir = folder / Path(row["run_dir"]).name
        assert texts(logdir)["llmadapt/row"] == row["label"]
        delta = scalars(logdir)["comparison/parity_delta"][0][0]
        assert delta == pytest.approx(row["metrics"]["parity_delta"], rel=1e-6, abs=1e-30)  # float32 in the file
        own = [r["step"] for r in read_jsonl(Path(row["run_dir"]) / "rank-00000.jsonl") if r["type"] == "step"]
        assert sorted(scalars(logdir)["loss"]) == own and len(own) > STEPS  # its own run's steps, warm-up included
