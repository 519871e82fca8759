"""How commands end and what they print, on one real run copied into the states a run folder can be in: one
table of exit codes for every command (a full disk is an I/O error, not bad input), a closed pipe on stdout ends
quietly, the run store tells running, incomplete, damaged and finished runs apart, paths are named for what
they are, and names from the outside world reach the console escaped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmadapt.errors import (EnvironmentNotReadyError, ExitCode, LlmadaptError, StorageError, Terminated,
                             exit_code_of)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama.toml"
SMALL = ["train.steps=2", "train.warmup_steps=1", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
         "telemetry.interval_s=0"]


def cli(*args, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs}
    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], text=True, timeout=300, env=env,
                          **streams)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One real run (torch, inline, two steps): the others are copies of it in other states."""
    pytest.importorskip("torch")
    from llmadapt import Workload, run

    result = run(Workload.from_file(EXAMPLE).with_overrides(SMALL), "torch", launcher="inline",
                 out=tmp_path_factory.mktemp("finished"))
    assert result.ok
    return result.run_dir


def copy_run(source: Path, root: Path, name: str, *, workload_name: str | None = None) -> Path:
    """The run copied under ROOT/NAME as a run of its own (its id NAME; its workload renamed if asked)."""
    target = root / name
    shutil.copytree(source, target)
    launch = json.loads((target / "launch.json").read_text())
    launch["run_id"] = name
    if workload_name is not None:
        launch["workload"]["name"] = workload_name
    (target / "launch.json").write_text(json.dumps(launch))
    summary = json.loads((target / "summary.json").read_text())
    (target / "summary.json").write_text(json.dumps({**summary, "run_id": name}))
    rank = target / "rank-00000.jsonl"
    lines = rank.read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "run_id": name})
    rank.write_text("\n".join(lines) + "\n")
    return target


def one_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    return line


# -- exit codes -----------------------------------------------------------------------------------------
def test_one_table_of_exit_codes_documented_and_used():
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0, "RUN_FAILED": 1, "BAD_INPUT": 2, "ENVIRONMENT": 3, "IO": 4, "INTERRUPTED": 130, "CLOSED_PIPE": 141,
        "TERMINATED": 143}
    docs = (ROOT / "docs" / "runs.md").read_text()
    table = docs[docs.index("## Exit codes"):]
    assert all(f"\n| {int(c)} |" in table for c in ExitCode)

    def raised_from(error: BaseException, cause: BaseException) -> BaseException:
        try:
            try:
                raise cause
            except BaseException:
                raise error from None  # as the code base raises its one-line errors
        except BaseException as exc:  # noqa: BLE001
            return exc

    assert exit_code_of(LlmadaptError("bad")) == 2
    assert exit_code_of(EnvironmentNotReadyError("not built")) == 3
    assert exit_code_of(StorageError("full")) == 4
    assert exit_code_of(OSError(28, "No space left on device", "/x")) == 4
    assert exit_code_of(PermissionError(13, "Permission denied", "/x")) == 4
    assert exit_code_of(FileNotFoundError(2, "No such file or directory", "/x")) == 2
    assert exit_code_of(raised_from(LlmadaptError("cannot write /x"), OSError(28, "No space left on device"))) == 4
    assert exit_code_of(raised_from(LlmadaptError("cannot read /x"), FileNotFoundError(2, "nope"))) == 2
    assert exit_code_of(KeyboardInterrupt()) == 130 and exit_code_of(Terminated("SIGTERM")) == 143


def test_an_environment_not_built_exits_3(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMADAPT_PYTHON_")}
    out = cli("run", EXAMPLE, "--adapter", "torch", "--launcher", "subprocess", "--out", tmp_path / "runs",
              env={**env, "LLMADAPT_HOME": str(tmp_path / "home")})
    assert out.returncode == 3 and "has not been built" in one_line(out), (out.returncode, out.stderr)
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux): a device that is always full")
def test_a_full_disk_is_an_io_error_naming_the_path(finished, tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does: exit 4, the path named, one line."""
    out = cli("export", finished, "--format", "json", "-o", "/dev/full")
    assert out.returncode == 4 and "/dev/full: No space left on device" in one_line(out), out.stderr
    with open("/dev/full", "w") as full:
        out = cli("schema", stdout=full)
    assert out.returncode == 4, out.stderr
    assert one_line(out) == "error: cannot write to standard output: No space left on device"
    root = tmp_path / "runs"
    copy_run(finished, root, "a-run")
    out = cli("runs", "--root", root, "--parquet", "/dev/full")
    assert out.returncode == 4 and "cannot write /dev/full" in one_line(out), out.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_run_that_fills_the_disk_ends_with_the_io_code(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (disk / "runs").mkdir()
        (disk / "filler").write_bytes(b"\0" * (1024 * 1024 - 48 * 1024))  # leaves about 48 KiB
        out = cli("run", EXAMPLE, "--adapter", "torch", "--launcher", "inline", "--out", disk / "runs",
                  *[a for s in SMALL if not s.startswith("train.steps") for a in ("--set", s)], "--set",
                  "train.steps=400")
        (line,) = [x for x in out.stderr.splitlines() if x.startswith("error:")]
        assert out.returncode == 4 and "No space left on device" in line and str(disk / "runs") in line, out.stderr
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def test_a_closed_pipe_ends_quietly(finished, tmp_path):
    """`llmadapt runs --json | head -1`: the reader goes away before the command writes; no traceback."""
    root = tmp_path / "runs"
    for n in range(3):
        copy_run(finished, root, f"run-{n}")
    for args in (["runs", "--json", "--root", root], ["schema"]):
        proc = subprocess.Popen([sys.executable, "-m", "llmadapt.cli", *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        proc.stdout.close()  # before the interpreter has even started: its first write meets a closed pipe
        stderr = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == ExitCode.CLOSED_PIPE and stderr == "", stderr


# -- the run store ----------------------------------------------------------------------------------------
def test_the_store_tells_running_incomplete_damaged_and_finished_runs_apart(finished, tmp_path):
    root = tmp_path / "runs"
    copy_run(finished, root, "finished")
    (copy_run(finished, root, "damaged") / "summary.json").write_text("{not json")
    (copy_run(finished, root, "incomplete") / "summary.json").unlink()
    running = copy_run(finished, root, "running")
    (running / "summary.json").unlink()
    records = (running / "rank-00000.jsonl").read_text().splitlines()
    last_step = max(i for i, line in enumerate(records) if json.loads(line)["type"] == "step")
    (running / "rank-00000.jsonl").write_text("\n".join(records[:last_step]) + "\n")  # mid-run: a step to go
    worker = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'a'); print('open', "
                               "flush=True); time.sleep(300)", str(running / "rank-00000.jsonl")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "open"  # a process holds a file of the run open: it is on
        out = cli("runs", "--root", root, "--json")
        assert out.returncode == 0, out.stderr
        assert {r["run_id"]: r["status"] for r in json.loads(out.stdout)} == {
            "finished": "ok", "damaged": "damaged", "incomplete": "incomplete", "running": "running"}
        text = cli("runs", "--root", root)
        (warning,) = [line for line in text.stderr.splitlines() if line.startswith("warning:")]
        assert "run damaged" in warning and "is damaged: summary.json is not JSON" in warning, text.stderr
        assert "running" in text.stdout and "4 run(s) matching" in text.stdout
        assert json.loads(cli("runs", "status=running", "--root", root, "--json").stdout)[0]["run_id"] == "running"
        # show says what runs says, of every one of them: one notion of a run's status
        for name, status in {"running": "running", "finished": "ok", "damaged": "damaged",
                             "incomplete": "incomplete"}.items():
            shown = cli("show", root / name, "--json")
            assert shown.returncode == 0 and json.loads(shown.stdout)["status"] == status, (name, shown.stdout[:300])
        shown = cli("show", running).stdout
        assert shown.startswith("run        running  [running]") and "failure" not in shown, shown
        assert "warning    running: no summary.json yet" in shown
    finally:
        worker.kill()
        worker.wait()
    out = cli("runs", "--root", root, "--json")  # its process gone, with no summary: incomplete
    assert {r["run_id"]: r["status"] for r in json.loads(out.stdout)}["running"] == "incomplete"


def test_import_makes_a_store_root_that_does_not_exist_yet(finished, tmp_path):
    new = tmp_path / "new" / "store"
    out = cli("runs", "import", finished, "--root", new)
    assert out.returncode == 0 and "1 run(s) imported" in out.stdout, out.stderr
    assert (new / finished.name / "summary.json").is_file()
    (tmp_path / "notes").mkdir()
    out = cli("runs", "import", tmp_path / "notes", "--root", tmp_path / "other")
    assert out.returncode == 2 and "is not a run folder" in one_line(out)
    assert not (tmp_path / "other").exists()  # a refused import leaves no store behind


# -- paths ------------------------------------------------------------------------------------------------
def test_sweep_index_out_of_range_is_refused_before_anything_is_written(tmp_path):
    sweep = tmp_path / "one.toml"
    sweep.write_text(f'workload = "{EXAMPLE}"\nadapters = ["torch"]\n')
    out = cli("sweep", "run", sweep, "--index", "99", "--out", tmp_path / "out")
    assert out.returncode == 2 and one_line(out) == "error: --index 99: the sweep has cells 0 to 0"
    assert not (tmp_path / "out").exists()


def test_a_folder_given_as_a_file_is_called_a_folder(tmp_path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for args, message in ((["run", folder], "is a folder, expected a workload file"),
                          (["run", EXAMPLE, "--set", "data.source=jsonl", "--set", f"data.path={folder}"],
                           "is a folder, expected a file"),
                          (["sweep", "run", folder], "is a folder, expected a file")):
        out = cli(*args, "--out", tmp_path / "runs")
        assert out.returncode == 2 and message in one_line(out) and str(folder) in out.stderr, out.stderr


def test_report_output_is_checked_before_anything_is_drawn(finished, tmp_path, monkeypatch):
    from llmadapt.analysis import htmlreport

    def drawn(*args, **kwargs):
        raise AssertionError("the report was drawn before its output was checked")

    monkeypatch.setattr(htmlreport, "build", drawn)
    with pytest.raises(LlmadaptError, match=f"report -o {tmp_path}: is a folder, expected a file"):
        htmlreport.report([finished], tmp_path)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(LlmadaptError, match="a-file is a file, not a folder"):
        htmlreport.report([finished], tmp_path / "a-file" / "report.html")
    out = cli("report", finished, "-o", tmp_path)
    assert out.returncode == 2 and f"report -o {tmp_path}: is a folder" in one_line(out)


# -- text from the outside world ------------------------------------------------------------------------
def test_printable_escapes_controls_and_bidirectional_overrides():
    from llmadapt.cli.common import printable, printable_lines

    assert printable("a\nb\rc\td\x1b[31me\x85f\u202eg\u2066h") == "a\\nb\\rc\\td\\x1b[31me\\x85f\\u202eg\\u2066h"
    assert printable("ordinary name, ünïcode ✓") == "ordinary name, ünïcode ✓"
    assert printable_lines("one\u202e\ntwo") == "one\\u202e\ntwo"


def test_names_with_control_characters_reach_the_console_escaped(finished, tmp_path):
    root = tmp_path / "runs"
    copy_run(finished, root, "evil\n\u202erun", workload_name="tag\nline\u202e")
    out = cli("runs", "--root", root)
    assert out.returncode == 0, out.stderr
    assert "\u202e" not in out.stdout and "evil\\n\\u202erun" in out.stdout and "tag\\nline\\u202e" in out.stdout
    assert len(out.stdout.splitlines()) == 4  # heading, rule, the run, the count: the newline split no row
    (row,) = json.loads(cli("runs", "--root", root, "--json").stdout)  # JSON keeps the name as it is
    assert row["run_id"] == "evil\n\u202erun" and row["name"] == "tag\nline\u202e"
    out = cli("show", tmp_path / "no\nsuch\u202erun")
    assert out.returncode == 2 and "\u202e" not in out.stderr and "no\\nsuch\\u202erun" in one_line(out)
