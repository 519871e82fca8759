"""Comparisons where each stack runs in its own layout: settings for one adapter ([adapters.NAME], --set
NAME:path=value), explicit cells, grids that mark what an adapter cannot run, and parity across stacks and
layouts by problem hash. The cross-stack runs are real (torch, ColossalAI, Megatron-core on gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt import Workload
from llmadapt.analysis.labels import layout_label
from llmadapt.experiments.cells import Cell, plan, same_threads
from llmadapt.analysis.paritycheck import PARITY_ATOL, PARITY_RTOL, parity_of_runs
from llmadapt.experiments.parity import parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.launch import LaunchRequest
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, TraceMismatchError, UnsupportedError
from llmadapt.spec import problem_difference
from llmadapt.testing import environments_unready

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama.toml"
SMALL = ["train.steps=2", "train.warmup_steps=1", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=1"]
# SGD with a large step: Adam normalises a constant gradient scale away, SGD carries it into the losses
SGD = ["train.optimizer=sgd", "train.lr=2.0"]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], capture_output=True, text=True,
                          check=False, timeout=1800)


def small() -> Workload:
    return Workload.from_file(EXAMPLE).with_overrides(SMALL)


# -- settings for one adapter ----------------------------------------------------------------------
def test_a_file_section_and_set_for_one_adapter_wait_for_it_and_record_their_source(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text(EXAMPLE.read_text() + "\n[adapters.megatron]\nparallelism.tp = 2\n"
                    "\n[adapters.deepspeed]\noptimizations.zero_stage = 3\nparallelism.dp = 2\n")
    w = Workload.from_file(path)
    assert w.adapters == {"megatron": {"parallelism.tp": 2},
                          "deepspeed": {"optimizations.zero_stage": 3, "parallelism.dp": 2}}
    assert w.parallelism.tp == 1 and w.content_hash == Workload.from_file(EXAMPLE).content_hash  # nothing applied yet

    w = w.with_overrides(["megatron:parallelism.pp=2", "train.steps=3", "deepspeed:train.lr=1e-3"], source="--set")
    megatron = w.for_adapter("megatron")
    assert (megatron.parallelism.tp, megatron.parallelism.pp, megatron.adapters) == (2, 2, {})
    assert megatron.sources["parallelism.tp"] == "file [adapters.megatron]"
    assert megatron.sources["parallelism.pp"] == "--set megatron:"
    assert megatron.sources["train.steps"] == "--set" and megatron.sources["train.lr"] == "file"
    deepspeed = w.for_adapter("deepspeed")
    assert (deepspeed.optimizations.zero_stage, deepspeed.parallelism.dp, deepspeed.train.lr) == (3, 2, 1e-3)
    torch = w.for_adapter("torch")
    assert torch.parallelism.tp == 1 and torch.train.steps == 3 and not any(":" in k for k in torch.sources)
    # layouts are not the problem: megatron's and torch's workloads pose one problem, deepspeed's another (lr)
    assert megatron.problem_hash == torch.problem_hash != deepspeed.problem_hash
    assert problem_difference(torch, deepspeed) == ["train.lr (0.003 vs 0.001)"]
    # a setting one side leaves at its default is that default, not a difference of its own
    serve = Workload.from_file(EXAMPLE.parent / "serve-tiny.toml")
    assert problem_difference(serve, serve.with_overrides(["serve.engine.max_batched_tokens=256"])) == [
        "serve.engine.max_batched_tokens (None vs 256)"]
    # the last setting of a field wins: one for all after one for megatron replaces it
    assert w.with_overrides(["parallelism.tp=1"]).for_adapter("megatron").parallelism.tp == 1
    assert w.with_overrides(["parallelism.tp=1", "megatron:parallelism.tp=2"]).for_adapter("megatron").parallelism.tp == 2


@pytest.mark.parametrize("setting, message", [
    ("megatron:parallelism.tq=2", "workload field 'megatron:parallelism.tq': got 2; unknown field; known here: dp, ep"),
    (":train.steps=2", "workload field '--set': got ':train.steps=2'; use path=value, e.g. train.steps=5, or "
                       "adapter:path=value"),
    ("megatron:adapters=1", "workload field 'megatron:adapters': got 1; is not a field to set"),
])
def test_a_malformed_setting_for_one_adapter_is_refused_where_it_is_given(setting, message):
    with pytest.raises(LlmadaptError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        small().with_overrides([setting], source="--set")


def test_a_wrong_value_for_one_adapter_is_named_with_its_adapter():
    w = small().with_overrides(["megatron:parallelism.tp=abc"], source="--set")
    with pytest.raises(LlmadaptError, match="^workload field 'megatron:parallelism.tp': got 'abc'; must be an integer"):
        w.for_adapter("megatron")


# -- cells and plans -------------------------------------------------------------------------------
def test_cells_parse_with_list_values_and_print_back():
    cell = Cell.parse("torch:lora.target_modules=[q_proj,v_proj],lora.rank=4")
    assert cell == Cell("torch", ("lora.target_modules=[q_proj,v_proj]", "lora.rank=4"))
    assert str(cell) == "torch:lora.target_modules=[q_proj,v_proj],lora.rank=4"
    assert Cell.parse("deepspeed") == Cell("deepspeed")
    for bad in ("", "torch:", "torch:train.steps", "=x"):
        with pytest.raises(LlmadaptError, match="use ADAPTER or ADAPTER:path=value"):
            Cell.parse(bad)


def test_layout_labels_name_every_setting_that_is_not_the_default():
    w = small().with_overrides(["parallelism.dp=2", "optimizations.zero_stage=3", "optimizations.offload=optimizer",
                                "optimizations.recompute=full"])
    assert layout_label("deepspeed", w) == "deepspeed dp2 zero3 offload=optimizer recompute=full mb1"
    assert layout_label("megatron", small().with_overrides(["parallelism.tp=2", "train.micro_batch=4"])) == "megatron tp2"


def test_cells_of_one_comparison_get_the_same_threads_per_rank(monkeypatch):
    """On four cores a 1-rank cell would get four threads and a 2-rank cell two each: both get two, and say
    nothing in their labels; a cell that sets its own keeps it, and then the labels name each cell's count."""
    import llmadapt.launch.supervise as supervise

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(supervise.os, "sched_getaffinity", lambda pid: set(range(4)))
    grid = plan(small(), [Cell("torch")], {"parallelism.dp": [1, 2]})
    cells, line = same_threads(grid)
    assert [p.workload.parallelism.threads_per_rank for p in cells] == [2, 2]
    assert [p.layout for p in cells] == [p.layout for p in grid] and "threads per rank: 2" in line
    assert cells[0].workload.sources["parallelism.threads_per_rank"] == "comparison"
    # the same default everywhere: nothing to set
    same = plan(small(), [Cell("torch"), Cell.parse("torch:train.lr=0.01")])
    assert same_threads(same) == (same, None)
    mixed, _ = same_threads(plan(small(), [Cell("torch"), Cell.parse("torch:parallelism.dp=2,parallelism.threads_per_rank=1")]))
    assert [p.layout for p in mixed] == ["torch dp1 mb1 thr4", "torch dp2 mb1 thr1"]


def test_a_grid_plans_what_an_adapter_cannot_run_as_unsupported_and_refuses_it_on_request():
    cells = [Cell("torch"), Cell("colossalai")]
    planned = plan(small(), cells, {"optimizations.zero_stage": [0, 2]})
    assert [(p.layout, p.unsupported) for p in planned] == [
        ("torch dp1 mb1", None),
        ("torch dp1 zero2 mb1", "adapter 'torch' cannot run optimizations.zero_stage=2: supported: 0"),
        ("colossalai dp1 mb1", None), ("colossalai dp1 zero2 mb1", None)]
    with pytest.raises(UnsupportedError, match=r"^cell torch \[zero_stage=2\]: adapter 'torch' cannot run"):
        plan(small(), cells, {"optimizations.zero_stage": [0, 2]}, refuse_unsupported=True)
    # an explicit cell its adapter cannot run is skipped as a matrix cell is, and refused alike on request
    explicit = [Cell("colossalai"), Cell("torch", ("optimizations.zero_stage=2",))]
    assert [p.unsupported is not None for p in plan(small(), explicit)] == [False, True]
    with pytest.raises(UnsupportedError, match=r"^cell torch:optimizations.zero_stage=2: adapter 'torch' cannot run"):
        plan(small(), explicit, refuse_unsupported=True)
    # where no cell can run, nothing would: an error naming the first reason
    with pytest.raises(UnsupportedError, match=r"^cell torch:optimizations.zero_stage=2: adapter 'torch' cannot run"):
        plan(small(), [Cell("torch", ("optimizations.zero_stage=2",))])


@pytest.mark.parametrize("args, message", [
    (["--adapters", "torch", "--set", "megatorn:parallelism.tp=2"],
     "error: setting megatorn:parallelism.tp (--set megatorn:) is for adapter 'megatorn', which is not registered"),
    (["--adapters", "torch,deepspeed", "--set", "megatron:parallelism.tp=2"],
     "error: setting megatron:parallelism.tp (--set megatron:) is for adapter 'megatron', which is not in this "
     "comparison (torch, deepspeed)"),
    (["--cell", "torch:parallelism.dp=3"],
     "error: cell torch:parallelism.dp=3: workload field 'train.global_batch': got 8; must be divisible by "
     "parallelism.dp=3"),
    (["--cell", "megatron:parallelism.tp=3"],
     "error: cell megatron:parallelism.tp=3: workload field 'parallelism.tp': got 3; must divide model.num_heads=4"),
    (["--cell", "megatron:parallelism.tq=2"],
     "error: cell megatron:parallelism.tq=2: workload field 'parallelism.tq': got 2; unknown field"),
    (["--cell", "torch:optimizations.zero_stage=2"],
     "error: cell torch:optimizations.zero_stage=2: adapter 'torch' cannot run optimizations.zero_stage=2"),
    (["--adapters", "torch", "--matrix", "optimizations.zero_stage=0,2", "--refuse-unsupported"],
     "error: cell torch [zero_stage=2]: adapter 'torch' cannot run optimizations.zero_stage=2: supported: 0"),
    (["--cell", "torch", "--cell", "torch:train.steps=8"], "error: cells torch and torch:train.steps=8 run the same "
                                                           "workload on torch: give each once"),
    ([], "error: name what to run: --adapters torch,deepspeed, or cells such as --cell"),
    (["--adapters", "torch", "--matrix", "parallelism.dp=1,2", "--baseline", "megatron"],
     "error: baseline 'megatron' names no cell of this comparison; its cells: torch"),
    (["--adapters", "torch", "--repeat", "0"], "error: repeat must be a whole number >= 1, got 0"),
])
def test_bad_cells_and_settings_are_one_line_before_anything_starts(tmp_path, args, message):
    out = cli("compare", EXAMPLE, *args, "--out", tmp_path / "runs")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(message), line
    assert not (tmp_path / "runs").exists()


def test_run_refuses_a_setting_for_another_adapter_and_parity_two_problems(tmp_path):
    out = cli("run", EXAMPLE, "--set", "deepspeed:train.steps=1", "--out", tmp_path / "runs")
    assert out.returncode == 2 and out.stderr.strip() == ("error: setting deepspeed:train.steps (--set deepspeed:) is "
                                                          "for adapter 'deepspeed', which is not in this run (torch)")
    out = cli("parity", EXAMPLE, "--cell", "torch:parallelism.dp=2", "--cell", "megatron:train.lr=0.01",
              "--out", tmp_path / "runs")
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: parity: torch dp2 and megatron dp1 mb4 are different problems, their losses not comparable: "
        "train.lr (0.003 vs 0.01)")
    assert not (tmp_path / "runs").exists()


def test_parity_of_finished_runs_of_different_problems_names_the_fields(tmp_path):
    """Two run folders of different problems: refused in one line naming what differs (from launch.json)."""
    folders = []
    for i, lr in enumerate((0.003, 0.01)):
        w = small().with_overrides([f"train.lr={lr}"])
        folder = RunDir(tmp_path / f"run{i}")
        folder.path.mkdir()
        folder.write_launch(LaunchRequest(run_id=f"run{i}", launcher="inline", workload=w))
        folder.write_summary({"problem_hash": w.problem_hash, "losses": [6.0, 5.9]})
        folders.append(folder.path)
    with pytest.raises(TraceMismatchError, match=r"ran different problems \(train.lr \(0.003 vs 0.01\)\)"):
        parity_of_runs(*folders)


def test_labels_name_every_field_that_differs_between_the_rows():
    """A grid over batch and sparsity on an MoE model: six rows, six labels, each naming its batch and its experts
    per token in their shortest form; a quantized row says so; sweep titles follow the same labels."""
    from llmadapt.analysis.labels import distinct_labels
    from llmadapt.analysis.comparison import parse_matrix

    mixtral = Workload.from_file(ROOT / "examples" / "tiny-mixtral.toml")
    matrix = parse_matrix(["train.global_batch=2,4,8", "model.experts_per_token=2,4"])
    planned, _ = same_threads(plan(mixtral, [Cell("torch")], matrix))
    titles = [p.title for p in planned]
    assert len(set(titles)) == 6, titles
    for p in planned:
        assert p.title == (f"torch dp1 experts_per_token={p.workload.model.experts_per_token} "
                           f"global_batch={p.workload.train.global_batch}")
    lora = Workload.from_file(ROOT / "examples" / "finetune-lora.yaml")
    nf4 = lora.with_overrides(["optimizations.quantization=nf4"])
    assert layout_label("torch", nf4) == "torch dp1 quantization=nf4"
    # another model is named once, by its preset; two fields ending alike are told apart by their section
    llama = Workload.from_file(EXAMPLE).with_overrides([f"train.steps={mixtral.train.steps}",
                                                        f"train.warmup_steps={mixtral.train.warmup_steps}"])
    assert distinct_labels([("torch", llama), ("torch", mixtral)]) == ["torch model=tiny-llama",
                                                                      "torch model=tiny-mixtral"]
    # where each saves its model is not what a row measures: not in the label
    saved = [lora.with_overrides([f"save.path=runs/{name}"]) for name in ("a", "b")]
    assert distinct_labels([("torch", saved[0]), ("deepspeed", saved[1])]) == ["torch", "deepspeed"]
    serve = Workload.from_file(ROOT / "examples" / "serve-tiny.toml")
    longer = serve.with_overrides(["serve.input_len.mean=64", "serve.output_len.mean=64"])
    assert distinct_labels([("vllm", serve), ("vllm", longer), ("vllm", None)]) == [
        f"vllm input_len.mean={serve.serve.input_len.mean} output_len.mean={serve.serve.output_len.mean}",
        "vllm input_len.mean=64 output_len.mean=64", "vllm"]


# -- real runs -------------------------------------------------------------------------------------
def test_a_grid_shows_and_skips_what_an_adapter_cannot_run(tmp_path):
    """torch and plain across recompute none/full: plain declares no recompute, so that cell is shown as not
    supported with the reason, not run and not a failure; the command succeeds."""
    sets = [a for s in SMALL for a in ("--set", s)]
    out = cli("compare", EXAMPLE, *sets, "--adapters", "torch,plain", "--matrix", "optimizations.recompute=none,full",
              "--out", tmp_path / "runs", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [(r["label"], r["status"]) for r in data["rows"]] == [
        ("torch dp1 mb1", "ok"), ("torch dp1 recompute=full mb1", "ok"), ("plain dp1 mb1", "ok"),
        ("plain dp1 recompute=full mb1", "unsupported")]
    skipped = data["rows"][3]
    assert skipped["run_dir"] is None and "adapter 'plain' cannot run optimizations.recompute='full'" in skipped["note"]
    assert data["counts"] == {"cells": 4, "ok": 3, "failed": 0, "unsupported": 1}
    assert len([p for p in (tmp_path / "runs").iterdir() if p.is_dir()]) == 3  # the unsupported cell never started
    assert "not supported, not run (1 of 4 cells):" in out.stderr  # said before the first run
    assert out.stderr.index("not supported, not run") < out.stderr.index("[1/3]")
    assert all(r["metrics"]["parity_delta"] <= PARITY_ATOL + PARITY_RTOL * 7 for r in data["rows"][:3])


@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
def test_an_explicit_cell_its_adapter_cannot_run_is_skipped_and_counted_as_a_matrix_cell_is(tmp_path):
    sets = [a for s in SMALL for a in ("--set", s)]
    out = cli("compare", EXAMPLE, *sets, "--cell", "torch", "--cell", "torch:optimizations.zero_stage=2",
              "--out", tmp_path / "runs", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [r["status"] for r in data["rows"]] == ["ok", "unsupported"]
    assert "1 not supported (not run)" in json.loads(Path(data["saved"]).read_text())["table"]
    refused = cli("compare", EXAMPLE, *sets, "--cell", "torch", "--cell", "torch:optimizations.zero_stage=2",
                  "--refuse-unsupported", "--out", tmp_path / "refused")
    assert refused.returncode == 2 and "cannot run optimizations.zero_stage=2" in refused.stderr
    assert not (tmp_path / "refused").exists()


NOT_READY = environments_unready("torch", "colossalai", "megatron") or ""
needs_envs = pytest.mark.skipif(bool(NOT_READY), reason=NOT_READY)


@needs_envs
def test_three_stacks_each_in_its_own_layout_in_one_comparison(tmp_path):
    """One `compare`: Megatron-core tp=2 from the file's [adapters.megatron], torch dp=2 and ColossalAI ZeRO-2
    dp=2 as cells; one problem, three rows, each within the fp32 parity tolerance of the first; every header
    records its final workload and where each setting came from."""
    path = tmp_path / "w.toml"
    path.write_text(EXAMPLE.read_text() + "\n[adapters.megatron]\nparallelism.tp = 2\n")
    sets = [a for s in SMALL + SGD for a in ("--set", s)]
    out = cli("compare", path, *sets, "--adapters", "megatron", "--cell", "torch:parallelism.dp=2",
              "--cell", "colossalai:parallelism.dp=2,optimizations.zero_stage=2", "--out", tmp_path / "runs")
    assert out.returncode == 0, out.stderr[-3000:]
    head, _, *body = out.stdout.splitlines()
    rows = body[:3]
    assert [r.split()[:5] for r in rows] == [["P1", "megatron", "tp2", "mb1", "ok"], ["P1", "torch", "dp2", "mb1", "ok"],
                                             ["P1", "colossalai", "dp2", "zero2", "mb1"]]
    assert body[3].startswith("3 cells: 3 ok, 0 failed, 0 not supported")
    runs = {}
    for folder in (p for p in (tmp_path / "runs").iterdir() if p.is_dir()):  # besides compare-*.json
        h = read_jsonl(folder / "rank-00000.jsonl")[0]
        runs[h["adapter"]] = (folder, h)
    assert runs["megatron"][1]["workload"]["parallelism"]["tp"] == 2
    assert runs["megatron"][1]["workload"]["sources"]["parallelism.tp"] == "file [adapters.megatron]"
    ca = runs["colossalai"][1]["workload"]
    assert (ca["optimizations"]["zero_stage"], ca["parallelism"]["dp"]) == (2, 2)
    assert ca["sources"]["optimizations.zero_stage"] == "cell" and ca["sources"]["train.optimizer"] == "--set"
    assert len({h["problem_hash"] for _, h in runs.values()}) == 1
    # parity of torch dp=2 against ColossalAI ZeRO-2 and against Megatron-core tp=2, from the finished runs
    for other in ("colossalai", "megatron"):
        report = parity_of_runs(runs["torch"][0], runs[other][0])
        assert report.ok, report.describe(("torch dp2", other))
    assert float(rows[2].split()[-1]) <= 1e-4  # the table's parity delta against the first row


@needs_envs
def test_parity_command_across_stacks_and_layouts(tmp_path):
    """`parity` of torch dp=2 against Megatron-core tp=2: two layouts, two stacks, one problem; SGD so that a
    wrong gradient scale shows in the losses (it would move them by 1e-2 or more, the tolerance is 1e-4 rel)."""
    w = small().with_overrides(SGD)
    report = parity(w, cells=["torch:parallelism.dp=2", "megatron:parallelism.tp=2"], out=tmp_path)
    assert report.ok, report.describe()
    assert report.names == ("torch dp2 mb1", "megatron tp2 mb1") and report.steps == 3
    assert abs(report.reference[-1] - report.reference[0]) > 1e-2  # SGD moved the loss: the scale is tested


@needs_envs
def test_repeats_run_in_shuffled_rounds_and_the_stopping_rule_names_what_never_settled(tmp_path):
    """Two cells, two rounds plus a third the stopping rule adds (an interval within 1e-9 of its median is never
    reached): every cell runs once per round before any runs again, each round's order drawn from the recorded
    seed; every row is over its three runs, with one statistic for every column (the median over runs)."""
    from llmadapt import compare
    from llmadapt.analysis.comparison import from_json_summary

    logged: list[str] = []
    table = compare(small(), ["torch"], matrix={"optimizations.recompute": ["none", "full"]}, repeat=2,
                    settle=1e-9, max_rounds=3, seed=11, out=tmp_path, log=logged.append)
    runs = [line for line in logged if line.startswith("[")]
    assert [line.rsplit("(round ", 1)[1] for line in runs] == ["1)", "1)", "2)", "2)", "3)", "3)"]
    for r in range(3):  # each round holds both cells
        assert {line.split("] ", 1)[1].split(" (round")[0] for line in runs[2 * r:2 * r + 2]} == {
            row.label for row in table.rows}
    assert any(line.endswith("in an order shuffled with seed 11") for line in logged)
    assert table.seed == 11 and table.unsettled == [row.label for row in table.rows]
    text = table.table()
    assert "never settled within 0%: " in text and "shuffled with seed 11" in text
    for row in table.rows:
        assert len(row.run_dirs) == 3 and row.estimates["step_p50_s"].what == "runs"
        p90s = sorted(from_json_summary(json.loads((Path(d) / "summary.json").read_text())).step_time_s.p90
                      for d in row.run_dirs)
        assert row.metrics["step_p90_s"] == p90s[1]  # the median run's p90, not the first run's
    with pytest.raises(LlmadaptError, match="settle is a share of the median between 0 and 1"):
        compare(small(), ["torch"], settle=5, out=tmp_path)
    with pytest.raises(LlmadaptError, match="max rounds must be a whole number >= 3"):
        compare(small(), ["torch"], repeat=3, settle=0.05, max_rounds=2, out=tmp_path)
