"""The command line, run as a user runs it."""

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama.toml"
SMALL = ["--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set", "train.seq_len=32",
         "--set", "train.global_batch=4", "--set", "train.micro_batch=2"]


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, check=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "optimizations.zero_stage=5"], "error: workload field 'optimizations.zero_stage': got 5; "
                                                  "allowed: 0, 1, 2, 3"),
        (["--set", "parallelism.tp=2"], "error: adapter 'torch' cannot run parallelism.tp=2: supported: 1"),
        (["--adapter", "nope"], "error: unknown adapter 'nope'; registered adapters:"),
        (["--set", "data.source=jsonl", "--set", "data.path=missing.jsonl"],
         "error: workload field 'data.path': got 'missing.jsonl'; no such file"),
        (["--timeout", "0"], "error: --timeout: got '0.0'; must be a number of seconds > 0"),
        (["--timeout", "-5"], "error: --timeout: got '-5.0'; must be a number of seconds > 0"),
        (["--timeout", "nan"], "error: --timeout: got 'nan'; must be a number of seconds > 0"),
        (["--stall-timeout", "0"], "error: --stall-timeout: got '0.0'; must be a number of seconds > 0"),
        (["--stall-timeout", "inf"], "error: --stall-timeout: got 'inf'; must be a number of seconds > 0"),
        (["--stall-timeout", "5", "--set", "kind=serve"],
         "error: --stall-timeout watches a training run's steps; a serving run bounds each request"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, args, message):
    """Bad input exits 2 with one line on stderr, before any process starts or any file is written."""
    out = cli("run", EXAMPLE, "--out", tmp_path / "runs", *args)
    assert out.returncode == 2
    assert out.stderr.startswith(message), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_missing_workload_file(tmp_path):
    """A workload file that does not exist is named."""
    out = cli("run", tmp_path / "nope.toml")
    assert out.returncode == 2 and "no such workload file" in out.stderr


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    result = cli("run", EXAMPLE, *SMALL, "--out", out, "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["summary"]["status"] == "ok"
    assert "step    0" in result.stderr  # progress while it runs
    return Path(data["run_dir"])


def test_show_prints_the_summary(run_dir):
    """`show` renders what was measured; `--json` gives the stored summary."""
    text = cli("show", run_dir)
    assert text.returncode == 0 and "step time  p50" in text.stdout and "[ok]" in text.stdout
    data = json.loads(cli("show", run_dir, "--json").stdout)
    assert data == json.loads((run_dir / "summary.json").read_text())


def test_export_csv_has_one_row_per_rank_step(run_dir):
    """CSV export: one row per rank and step, with phase columns."""
    rows = list(csv.DictReader(io.StringIO(cli("export", run_dir, "--format", "csv").stdout)))
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert "phase_s[llmadapt:forward]" in rows[0]


def test_export_chrome_trace_places_steps_on_wall_clock(run_dir, tmp_path):
    """Chrome trace export: a complete event per step, in microseconds since the epoch."""
    target = tmp_path / "trace.json"
    assert cli("export", run_dir, "--format", "chrome-trace", "-o", target).returncode == 0
    events = [e for e in json.loads(target.read_text())["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in events if e["cat"] == "step"]
    assert [e["name"] for e in steps] == ["step 0", "step 1", "step 2"]
    assert steps[0]["ts"] > 1.7e15 and steps[1]["ts"] >= steps[0]["ts"] + steps[0]["dur"]
    # the adapter's spans (forward/backward per micro-batch, optimizer) nest inside their step
    inner = [e for e in events if e["cat"] == "llmadapt" and steps[1]["ts"] <= e["ts"] <= steps[1]["ts"] + steps[1]["dur"]]
    assert [e["name"] for e in inner] == ["forward 0", "backward 0", "forward 1", "backward 1", "optimizer"]


def test_export_json_holds_every_record(run_dir):
    data = json.loads(cli("export", run_dir, "--format", "json").stdout)
    assert {r["type"] for r in data["records"]} == {"header", "metric", "step", "telemetry", "interference", "end"}
    # the worker's own metrics: what building the model cost (the reference adapter marks when it is loaded)
    setup = {r["name"]: r for r in data["records"] if r["type"] == "metric"}
    assert set(setup) == {"setup_seconds", "setup_peak_rss_bytes", "load_seconds", "load_peak_rss_bytes"}
    assert 0 < setup["load_seconds"]["value"] <= setup["setup_seconds"]["value"]
    assert 0 < setup["load_peak_rss_bytes"]["value"] <= setup["setup_peak_rss_bytes"]["value"]


def test_compare_matrix_gives_one_row_per_variant(tmp_path):
    """`compare --matrix` runs every variant and prints one table with the parity delta."""
    out = cli("compare", EXAMPLE, *SMALL, "--adapters", "torch", "--matrix", "train.micro_batch=1,2", "--out", tmp_path,
              "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [r["variant"] for r in rows] == ["micro_batch=1", "micro_batch=2"]
    assert rows[1]["metrics"]["parity_delta"] < 1e-4
    text = cli("compare", EXAMPLE, *SMALL, "--adapters", "torch", "--matrix", "train.micro_batch=1,2",
               "--out", tmp_path).stdout
    head, _, *body = text.splitlines()
    assert head.split()[:3] == ["problem", "run", "status"] and head.rstrip().endswith("parity delta")
    rows, footer = body[:2], body[2]
    assert all(row.startswith("P1 ") and " ok " in row for row in rows)  # one problem: micro-batch is layout
    assert [row.split()[1:4] for row in rows] == [["torch", "dp1", "mb1"], ["torch", "dp1", "mb2"]]
    assert float(rows[1].split()[-1]) < 1e-4  # the text table shows the same parity delta as the JSON
    assert footer.startswith("2 cells: 2 ok, 0 failed, 0 not supported (not run)")


def test_parity_command_passes_and_fails(tmp_path):
    """`parity` exits 0 when trajectories agree; a tolerance of zero against bf16-free noise still passes for
    identical runs, and a mismatched precision is refused."""
    ok = cli("parity", EXAMPLE, *SMALL, "--adapters", "torch,torch", "--out", tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("parity ok: torch matches torch at all 3 steps")
    refused = cli("parity", EXAMPLE, *SMALL, "--set", "precision=bf16", "--adapters", "torch,torch")
    assert refused.returncode == 2 and "parity needs precision fp32" in refused.stderr


def _one_error_line(out):
    """The one line that says what is wrong (argparse's own errors come after its usage block, as usual)."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    if lines[0].startswith("usage:"):
        return lines[-1]
    (line,) = lines
    return line


@pytest.mark.parametrize("args, message", [
    (["compare", EXAMPLE], "error: name what to run: --adapters torch,deepspeed, or cells such as --cell"),
    (["compare", EXAMPLE, "--adapters", ","], "error: --adapters ',' names no adapter"),
    (["compare", EXAMPLE, "--adapters", "torch,torch"], "error: --adapters names 'torch' twice"),
    (["parity", EXAMPLE, "--adapters", "torch,plain", "--rtol", "nan"], "error: --rtol: got nan"),
    (["parity", EXAMPLE, "--adapters", "torch,plain", "--atol", "-1"], "error: --atol: got -1.0"),
])
def test_bad_options_are_one_line_and_start_nothing(tmp_path, args, message):
    out = cli(*args, "--out", tmp_path / "runs")
    assert message in _one_error_line(out)
    assert not (tmp_path / "runs").exists()


def test_two_export_formats_and_an_unwritable_output_are_one_line(run_dir, tmp_path):
    assert "--format given twice" in _one_error_line(cli("export", run_dir, "--format", "json", "--format", "csv"))
    line = _one_error_line(cli("export", run_dir, "--format", "csv", "-o", tmp_path / "no" / "such" / "dir.csv"))
    assert line.startswith("error: cannot write") and "No such file or directory" in line


def _copy(run_dir, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(run_dir, target)
    return target


@pytest.mark.parametrize("damage, warning", [
    (lambda d: (d / "summary.json").write_text("{not json"), "summary.json is not JSON"),
    (lambda d: (d / "summary.json").write_text('{"run_id": "x"}'), "summary.json lacks status"),
    (lambda d: (d / "summary.json").unlink(), "incomplete run: no summary.json"),
    (lambda d: (d / "rank-00000.jsonl").open("ab").write(b'{"type": "step", "ra'), None),  # torn last line
])
def test_a_damaged_summary_or_a_torn_record_is_shown_from_the_records(run_dir, tmp_path, damage, warning):
    copy = _copy(run_dir, tmp_path)
    damage(copy)
    out = cli("show", copy)
    assert out.returncode == 0, out.stderr
    assert "steps      3 completed" in out.stdout
    if warning:
        assert f"warning    {warning}" in out.stdout


def test_binary_garbage_in_a_records_file_is_one_line_naming_the_line(run_dir, tmp_path):
    copy = _copy(run_dir, tmp_path)
    (copy / "summary.json").unlink()
    with (copy / "rank-00000.jsonl").open("r+b") as f:
        lines = f.read().split(b"\n")
        lines[1] = b"\x00\xff\xfe garbage \x81"
        f.seek(0)
        f.write(b"\n".join(lines))
        f.truncate()
    for args in (["show", copy], ["export", copy, "--format", "json"]):
        line = _one_error_line(cli(*args))
        assert "rank-00000.jsonl:2: not valid JSON" in line


def test_the_progress_estimates_time_left_from_the_runs_done():
    """After the first run, the time left is the runs left at the mean time of a run so far; before, unknown."""
    from llmadapt.cli.common import _runs_left_column, time_left

    assert time_left(10.0, 0, 4) == "-:--:--" and time_left(None, 1, 4) == "-:--:--"
    assert time_left(300.0, 1, 4) == "0:15:00"  # three more runs of five minutes
    assert time_left(4000.0, 2, 3) == "0:33:20" and time_left(10.0, 3, 3) == "0:00:00"
    from types import SimpleNamespace

    assert _runs_left_column().render(SimpleNamespace(elapsed=60.0, completed=2, total=5)).plain == "0:01:30"


def test_help_imports_no_command_layer():
    """`llmadapt --help` builds the parser only: neither analysis, launch nor runtime is imported (nor the
    contract's records), so the help prints fast."""
    code = ("import sys\nfrom llmadapt.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('llmadapt'))), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = out.stderr.split()
    assert "llmadapt.cli.main" in loaded and "usage: llmadapt" in out.stdout
    heavy = [m for m in loaded if m.split(".")[1:2] in (["analysis"], ["launch"], ["runtime"])
             or m == "llmadapt.contract.records"]
    assert heavy == []


def test_the_lazy_package_still_reaches_its_submodules_as_attributes():
    """`import llmadapt; llmadapt.spec.Workload` worked when the package imported its modules eagerly, and scripts
    rely on it (benchmarks/loadgen.py did): a submodule is imported on first attribute access; a name that is
    neither a public name nor a submodule is an AttributeError."""
    code = ("import llmadapt\nassert llmadapt.spec.ServeSpec().send_spin_ms >= 0\nassert llmadapt.runtime.__name__\n"
            "try:\n    llmadapt.no_such_thing\nexcept AttributeError:\n    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr


@pytest.mark.parametrize(("args", "guess"), [
    (["compre", "x.toml"], "invalid choice: 'compre' (did you mean 'compare'?) (choose from"),
    (["env", "lst"], "invalid choice: 'lst' (did you mean 'list'?)"),
    (["run", EXAMPLE, "--adapter", "trch"], "error: unknown adapter 'trch' (did you mean 'torch'?); registered"),
    (["run", EXAMPLE, "--set", "train.stesp=3"], "unknown field (did you mean 'steps'?); known here:"),
    (["run", EXAMPLE, "--set", "model.preset=tiny-lama"], "unknown preset (did you mean 'tiny-llama'?); known presets:"),
])
def test_a_typo_gets_did_you_mean(tmp_path, args, guess):
    """A mistyped command, adapter, field or preset: the one-line error names the close valid name."""
    out = cli(*args, "--out", tmp_path / "runs") if args[0] == "run" else cli(*args)
    assert out.returncode == 2 and guess in out.stderr.strip().splitlines()[-1], out.stderr
    assert not (tmp_path / "runs").exists()


def test_a_mistyped_field_in_a_file_gets_did_you_mean(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text('[model]\npreset = "tiny-llama"\n[train]\nsteeps = 2\n')
    out = cli("run", path, "--out", tmp_path / "runs")
    assert out.returncode == 2 and "unknown field (did you mean 'steps'?)" in out.stderr, out.stderr


@pytest.mark.parametrize(("workload", "adapter"), [("serve-tiny.toml", "hf"), ("tiny-llama.toml", "torch")])
def test_run_without_adapter_takes_the_kinds_default(monkeypatch, capsys, tmp_path, workload, adapter):
    """`llmadapt run` without --adapter: hf for a serve workload (the documented default for serving), torch
    for training."""
    import importlib

    from llmadapt.cli import main
    from llmadapt.errors import LlmadaptError

    def run(workload, name, **options):
        raise LlmadaptError(f"would run on {name}")

    monkeypatch.setattr(importlib.import_module("llmadapt.launch.runner"), "run", run)
    with pytest.raises(SystemExit):
        main(["run", str(ROOT / "examples" / workload), "--out", str(tmp_path)])
    assert capsys.readouterr().err.strip() == f"error: would run on {adapter}"


def test_env_list_says_building_while_another_process_builds(tmp_path, monkeypatch):
    """An environment whose build lock another process holds (``env create`` builds under it) is listed as
    'building', not 'missing'; released, it is 'missing' again."""
    import fcntl
    import os

    from llmadapt.launch.environments import HTA_ENVIRONMENT, env_dir

    monkeypatch.setenv("LLMADAPT_HOME", str(tmp_path))
    target = env_dir(HTA_ENVIRONMENT)
    target.parent.mkdir(parents=True, exist_ok=True)

    def listed() -> str:
        out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "env", "list", "--json"], capture_output=True,
                             text=True, check=True, env={**os.environ, "LLMADAPT_HOME": str(tmp_path)})
        return {r["environment"]: r["status"] for r in json.loads(out.stdout)}[HTA_ENVIRONMENT.name]

    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert listed() == "building"
    assert listed() == "missing"


def test_show_of_a_serving_run_has_its_own_header():
    """A serving run's summary names its engine, with no `device -` or `steps 0 completed` lines."""
    from llmadapt.analysis.report import render_summary

    serving = {"completed": 2, "failed": 0, "failures_by_cause": {}, "duration_s": 1.0, "request_throughput": 2.0,
               "output_throughput": 20.0, "request_goodput": None, "ttft_ms": None, "tpot_ms": None, "itl_ms": None,
               "e2el_ms": None, "output_length_forced": True, "validity": "valid", "tokens_per_chunk": 1.0}
    summary = {"run_id": "r1", "status": "ok", "role": "serve", "adapter": "hf", "framework": "transformers-serve",
               "framework_version": "5.19.0", "launcher": "subprocess", "world_size": 1, "workload_hash": "a" * 64,
               "problem_hash": "b" * 64, "device": None, "steps_completed": 0, "measured_steps": 0,
               "step_time_s": None, "tokens_per_s": None, "serving": serving}
    lines = render_summary(summary).splitlines()
    assert lines[1] == "engine     hf (transformers-serve 5.19.0), launcher subprocess"
    assert not any(line.startswith(("device", "steps", "adapter")) for line in lines)
    assert any(line.startswith("requests   2 completed") for line in lines)


def test_help_ends_with_examples():
    out = cli("--help")
    assert out.returncode == 0 and "\nexamples:\n  llmadapt adapters" in out.stdout
    assert "llmadapt compare examples/tiny-llama.toml --adapters torch" in out.stdout


@pytest.mark.parametrize("name", ["report.html", "figures/a.png", "schema.json", "trace.json", "runs.parquet"])
def test_the_documented_commands_outputs_are_ignored(name):
    """What the README's commands write in the checkout (report -o report.html, --figures figures/, schema >
    schema.json, export -o trace.json, runs --parquet runs.parquet) is ignored by git."""
    import shutil

    if not shutil.which("git") or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT, check=False)
    assert out.returncode == 0, f"{name} is not ignored"
