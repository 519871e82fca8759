"""Every example workload under the faults a user meets (issue 34): a wrong path, a damaged model folder, a
truncated stream and a SIGTERM mid-way each leave readable records (or, refused before launch, nothing at all)
and an honest status and exit code (docs/runs.md, "Exit codes").

The examples are found by glob, so a new one is covered without a change here: every *.toml, *.yaml, *.yml and
*.json in examples/ and examples/sweeps/. Which of them are workloads: a file whose top level is a table without
a ``workload`` key. A sweep file names its workload with that key (llmadapt.experiments.sweep.load); it is not run
here, and its workload must be one of the examples covered (test_every_sweep_names_a_covered_workload).

Everything goes through the CLI (``python -m llmadapt.cli``) in a subprocess, so the exit codes are the real ones.
Wrong paths and damaged folders are refused before launch, so they cost a second each; the truncated stream is
the fake OpenAI server's (tests/fake_openai.py, --cycle ok,truncated); the SIGTERM runs, the costly part, are
one per kind and adapter (SIGTERM_SET), at the smallest sizes.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from llmadapt import Workload
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.spec import read_document
from llmadapt.testing import interruptible

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PATTERNS = ("*.toml", "*.yaml", "*.yml", "*.json")
MARK = "LLMADAPT_EXAMPLES_FAULTS_MARK"
HANG_GUARD_S = 240  # bounds every wait: a run that would hang fails instead


# -- the examples ---------------------------------------------------------------------------------------------
def example_files() -> list[Path]:
    folders = (EXAMPLES, EXAMPLES / "sweeps")
    return sorted({p for folder in folders for pattern in PATTERNS for p in folder.glob(pattern)})


def is_sweep(path: Path) -> bool:
    try:
        data = read_document(path)
    except ValueError:
        return False  # unreadable: taken as a workload, so that its tests fail and say why
    return isinstance(data, dict) and isinstance(data.get("workload"), str)


def is_workload(path: Path) -> bool:
    try:
        data = read_document(path)
    except ValueError:
        return True
    return isinstance(data, dict) and not is_sweep(path)


WORKLOADS = [p for p in example_files() if is_workload(p)]
SWEEPS = [p for p in example_files() if is_sweep(p)]


def name(path: Path) -> str:
    return str(path.relative_to(EXAMPLES))


@functools.cache  # read once per process: the tests' parameters need each example several times at collection
def load(path: Path) -> Workload:
    return Workload.from_file(path)


def documented_adapter(path: Path, workload: Workload) -> str:
    """The adapter the example's own `llmadapt run` line names (``--adapter X``), else the kind's default (what
    `llmadapt run FILE` uses: hf for a serving workload, torch otherwise)."""
    for line in path.read_text().splitlines():
        found = re.search(rf"llmadapt run \S*{re.escape(path.name)}\b.*--adapter[ =](\S+)", line)
        if found:
            return found.group(1)
    return "hf" if workload.kind == "serve" else "torch"


def input_paths(workload: Workload) -> list[str]:
    """The dotted fields naming a file the workload reads (data.path, eval.path, serve.source.path, ...), where the
    example sets them: every field called 'path' but the model's (a case of its own) and save.path (an output)."""
    found = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        elif prefix.endswith(".path") and value and prefix not in ("model.path", "save.path"):
            found.append(prefix)

    walk("", {k: v for k, v in workload.to_dict().items() if k not in ("adapters", "sources")})
    return sorted(found)


def serve_examples() -> list[Path]:
    return [p for p in WORKLOADS if load(p).kind == "serve"]


PREFERRED = ("tiny-llama.toml", "finetune-lora.yaml", "serve-tiny.toml")
"""What SIGTERM_SET interrupts for its kind: the README's training and serving examples, and the fine-tuning example
that reaches its first step soonest (finetune-eval.toml evaluates before it)."""


def representative(group: list[Path]) -> Path:
    """A group's preferred example, else its cheapest: fewest ranks, fewest files read (a file-driven stream may
    end by itself), fewest fields set, then by name."""
    def cost(path: Path):
        w = load(path)
        return (name(path) not in PREFERRED, w.world_size, len(input_paths(w)), len(w.sources), name(path))

    return min(group, key=cost)


def sigterm_set() -> list[tuple[Path, str]]:
    """One example per (kind, adapter): every kind once, and every adapter an example names."""
    groups: dict[tuple[str, str], list[Path]] = {}
    for path in WORKLOADS:
        w = load(path)
        groups.setdefault((w.kind, documented_adapter(path, w)), []).append(path)
    return sorted(((representative(g), adapter) for (_, adapter), g in groups.items()), key=lambda x: name(x[0]))


SIGTERM_SET = sigterm_set()


# -- helpers --------------------------------------------------------------------------------------------------
def cli(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env=env)


def cli_many(commands: list[list]) -> list[subprocess.CompletedProcess]:
    """Several commands at once (each fails before launch, in about a second of imports): their results."""
    procs = [subprocess.Popen([sys.executable, "-m", "llmadapt.cli", *map(str, c)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    done = []
    for command, proc in zip(commands, procs):
        out, err = proc.communicate(timeout=HANG_GUARD_S)
        done.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
    return done


def one_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    return lines[0]


def sets(*assignments: str) -> list[str]:
    return [a for s in assignments for a in ("--set", s)]


def marked(mark: str) -> list[str]:
    """Live processes (but this one) whose environment carries the mark: whatever the run started inherits it."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                        found.append(f"{entry.name}: {command[:200]}")
            except OSError:
                continue  # gone, or not ours
    return found


def readable(run_dir: Path) -> dict:
    """Every record file of the run read and checked against the contract, launch.json and summary.json parsed:
    the summary."""
    assert json.loads((run_dir / "launch.json").read_text())["run_id"] == run_dir.name
    ranks = sorted(run_dir.glob("rank-*.jsonl"))
    assert ranks, sorted(p.name for p in run_dir.iterdir())
    for path in ranks:
        read_jsonl(path)  # raises on a record that breaks the contract
    return json.loads((run_dir / "summary.json").read_text())


# -- which files are covered ------------------------------------------------------------------------------------
def test_the_examples_are_found_and_sorted_into_workloads_and_sweeps():
    assert {"tiny-llama.toml", "finetune-lora.yaml", "serve-tiny.toml"} <= {name(p) for p in WORKLOADS}
    assert set(WORKLOADS).isdisjoint(SWEEPS) and "sweeps/techniques.toml" in {name(p) for p in SWEEPS}
    for path in WORKLOADS:
        load(path)  # every file taken as a workload is one
    kinds = {load(p).kind for p in WORKLOADS}
    assert {load(p).kind for p, _ in SIGTERM_SET} == kinds  # every kind interrupted once


@pytest.mark.parametrize("path", SWEEPS, ids=name)
def test_every_sweep_names_a_covered_workload(path):
    named = (path.parent / read_document(path)["workload"]).resolve()
    assert named in {p.resolve() for p in WORKLOADS}, f"{name(path)} names {named}, which is not covered here"


# -- (a) a wrong path -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", WORKLOADS, ids=name)
def test_a_wrong_path_is_one_line_naming_it_and_nothing_is_made(path, tmp_path):
    """model.path at a folder that does not exist, and each file the example reads moved away: one line naming the
    field and the path, exit 2 (bad input), no run folder (not even --out)."""
    fields = ["model.path", *input_paths(load(path))]
    missing = {f: tmp_path / "gone" / f"no-such-{f.replace('.', '-')}" for f in fields}
    outs = {f: tmp_path / f"runs-{f}" for f in fields}
    results = cli_many([["run", path, *sets(f"{f}={missing[f]}"), "--out", outs[f]] for f in fields])
    for f, out in zip(fields, results):
        line = one_line(out)
        assert out.returncode == 2, (f, out.returncode, line)
        assert line.startswith("error: ") and f"'{f}'" in line and str(missing[f]) in line, (f, line)
        assert not outs[f].exists(), f"{f}: a refused run made {outs[f]}"


@pytest.mark.parametrize("path", SWEEPS, ids=name)
def test_a_sweep_with_a_wrong_model_path_is_refused_before_it_writes(path, tmp_path):
    missing = tmp_path / "no-such-model"
    out = cli("sweep", "run", path, *sets(f"model.path={missing}"), "--out", tmp_path / "runs")
    line = one_line(out)
    assert out.returncode == 2 and "'model.path'" in line and str(missing) in line, (out.returncode, line)
    assert not (tmp_path / "runs").exists()


# -- (b) a damaged model folder ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def truncated_model(tmp_path_factory) -> tuple[Path, str, set[str]]:
    """A copy of a tiny real model folder (sharded safetensors, a fast tokenizer) whose largest shard is cut in
    half, its header intact: (the folder, the shard's name, the tensors whose bytes are now missing)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_model_folder import save_model_folder  # tests/ is on sys.path, as for every test module here

    folder = save_model_folder(tmp_path_factory.mktemp("example-faults") / "my-llama")
    shard = max(folder.glob("*.safetensors"), key=lambda p: (p.stat().st_size, p.name))
    data = shard.read_bytes()
    cut = len(data) // 2
    shard.write_bytes(data[:cut])
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    lost = {t for t, v in header.items() if t != "__metadata__" and 8 + length + v["data_offsets"][1] > cut}
    assert lost
    return folder, shard.name, lost


@pytest.mark.parametrize("path", WORKLOADS, ids=name)
def test_a_truncated_shard_is_one_line_naming_the_file_and_tensor(path, tmp_path, truncated_model):
    folder, shard, lost = truncated_model
    out = cli("run", path, *sets(f"model.path={folder}"), "--out", tmp_path / "runs")
    line = one_line(out)
    assert out.returncode == 2, (out.returncode, line)
    assert f"{shard} is truncated" in line and any(t in line for t in lost) and str(folder) in line, line
    assert not (tmp_path / "runs").exists()


# -- (c) a truncated stream -------------------------------------------------------------------------------------
def small_serving(workload: Workload) -> list[str]:
    """A few requests, sent quickly: the example's stream, its source and lengths kept."""
    settings = ["serve.requests=4", "serve.warmup_requests=1", "serve.scrape_interval_s=0.2"]
    if workload.serve.arrival.process in ("constant", "poisson", "gamma"):
        settings.append("serve.arrival.rate=50")
    if workload.serve.quality.texts:  # attached by URL: no checkpoint of ours for the fp32 reference to load
        settings.append("serve.quality.texts=0")
    return settings


@pytest.mark.parametrize("path", serve_examples(), ids=name)
def test_a_truncated_stream_makes_the_run_degraded(path, tmp_path, local_server):
    """Attached (openai adapter, serve.url) to a server whose every other stream ends early but cleanly (no finish
    reason, no usage, no [DONE]): the requests so cut are 'truncated', the run 'degraded', exit 1, all readable."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("llmadapt_openai", reason="the openai adapter package is not installed")
    url, _ = local_server("fake_openai.py", "--cycle", "ok,truncated")
    mark = uuid.uuid4().hex
    out = cli("run", path, "--adapter", "openai", *sets(f"serve.url={url}", *small_serving(load(path))),
              "--out", tmp_path / "runs", env={**os.environ, MARK: mark})
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("degraded "), out.stdout[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = readable(run_dir)
    requests = [r for r in read_jsonl(run_dir / "rank-00000.jsonl") if r["type"] == "request" and not r["warmup"]]
    cut = [r for r in requests if r["status"] == "truncated"]
    assert cut and {r["status"] for r in requests} <= {"ok", "truncated"}, [r["status"] for r in requests]
    assert all(r["error_cause"] == "truncated" for r in cut)
    assert summary["status"] == "degraded"
    assert summary["serving"]["failures_by_cause"] == {"truncated": len(cut)}
    assert summary["serving"]["completed"] == len(requests) - len(cut)
    assert marked(mark) == []


# -- (d) SIGTERM mid-way ----------------------------------------------------------------------------------------
def small(workload: Workload) -> list[str]:
    """The smallest sizes, and a run that ends only when it is ended."""
    if workload.kind == "serve":
        return ["serve.requests=100000", "serve.warmup_requests=1", "serve.scrape_interval_s=0.2"]
    settings = ["train.steps=100000", "train.seq_len=32", "train.global_batch=2", "train.micro_batch=1",
                "telemetry.interval_s=0"]
    if workload.eval.examples:
        settings += ["eval.examples=2", "eval.every=0"]
    return settings


def first_record(out: Path, proc: subprocess.Popen, serve: bool) -> Path:
    """The run folder, once its first step record (training) or measured request record (serving) is there."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for run_dir in (p for p in out.iterdir() if p.is_dir()) if out.is_dir() else ():
            rank = run_dir / "rank-00000.jsonl"
            records = read_jsonl(rank, check=False) if rank.is_file() else []
            if any(r["type"] == "step" or (serve and r["type"] == "request" and not r["warmup"]) for r in records):
                return run_dir
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no first record within {HANG_GUARD_S} s: {proc.communicate()[1][-3000:]}")


@pytest.mark.parametrize("path, adapter", SIGTERM_SET, ids=lambda x: name(x) if isinstance(x, Path) else x)
def test_sigterm_mid_way_keeps_the_records_and_says_so(path, adapter, tmp_path):
    """`llmadapt run` (in a session of its own, as a scheduler starts it) sent SIGTERM once its first step or
    request is recorded: exit 143, the records readable, a summary whose status is not ok and whose failures name
    the interruption, `llmadapt show` prints it, and nothing the run started is left."""
    from llmadapt.testing import environments_unready

    why = environments_unready(adapter)
    if why:
        pytest.skip(why)
    workload = load(path)
    mark = uuid.uuid4().hex
    out = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "llmadapt.cli", "run", str(path), "--adapter", adapter,
                             *sets(*small(workload)), "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=interruptible,
                            env={**os.environ, MARK: mark})
    try:
        run_dir = first_record(out, proc, workload.kind == "serve")
        os.kill(proc.pid, signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"did not end after SIGTERM: {proc.communicate()[1][-3000:]}") from None
        assert proc.returncode == 143, err[-3000:]
        assert "terminated (SIGTERM)" in err and "Traceback" not in err, err[-3000:]
        summary = readable(run_dir)
        assert summary["status"] not in ("ok", "degraded"), summary["status"]
        told = [f for f in summary["failures"] if f["cause"] == "interrupted"]
        assert told and "SIGTERM" in told[0]["message"], summary["failures"]
        if workload.kind == "serve":
            assert summary["serving"]["completed"] + summary["serving"]["failed"] >= 1  # what was measured stands
            assert not (run_dir / "engine.pid").exists()
        else:
            assert summary["steps_completed"] >= 1
        shown = cli("show", run_dir)
        assert shown.returncode == 0, shown.stderr[-3000:]
        assert f"[{summary['status']}]" in shown.stdout and "interrupted" in shown.stdout, shown.stdout
        assert "SIGTERM" in shown.stdout, shown.stdout
        deadline = time.monotonic() + 30
        while (left := marked(mark)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == [], left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for pid in marked(mark):
            os.kill(int(pid.split(":")[0]), signal.SIGKILL)
