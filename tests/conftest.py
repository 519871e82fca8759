"""Shared test fixtures."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmadapt.host import free_port

HERE = Path(__file__).parent

HEAVIEST_FIRST = ("test_loadsweep.py", "test_benchmarks.py", "test_deepspeed.py", "test_breakdown.py",
                  "test_colossalai.py", "test_breakdown_layouts.py", "test_megatron.py", "test_model_folder.py",
                  "test_faults.py", "test_realmodel_train.py", "test_store.py", "test_quality.py", "test_slurm.py",
                  "test_jamba.py", "test_evaluation.py", "test_examples_faults.py", "test_docs.py", "test_vllm.py")
"""The files of most worker-seconds (docs/status.md), started first: `make test`'s workers take whole files in
collection order (--no-loadscope-reorder: else pytest-xdist orders them by their number of tests), and a heavy file
started last runs alone while the other worker has nothing left."""


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def state_folder_is_left_as_found():
    """A test that points LLMADAPT_HOME elsewhere and does not put it back sends every later test of its worker
    process to a state folder without environments: fail the test that leaked it, not the thirty after it."""
    import os

    before = os.environ.get("LLMADAPT_HOME")
    yield
    after = os.environ.get("LLMADAPT_HOME")
    assert after == before, f"this test left LLMADAPT_HOME={after!r} (it was {before!r}): use monkeypatch.setenv"


@pytest.fixture
def local_server():
    """Start a test server script (``tests/NAME PORT ARGS...``) as a subprocess, so it shares neither the load
    generator's event loop nor its clock; returns (url, process). Every server is killed afterwards."""
    procs = []

    def start(script: str, *args):
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(HERE / script), str(port), *map(str, args)])
        procs.append(proc)
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                return f"http://127.0.0.1:{port}", proc
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"{script} exited with {proc.returncode}") from None
                time.sleep(0.05)
        raise RuntimeError(f"{script} did not start")

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


# -- tracking sinks (tests/test_mlflow.py, tests/test_tensorboard.py) ----------------------------------------------
@pytest.fixture
def compare_two_cells(tmp_path):
    """`llmadapt compare` from the command line, inline, on tiny-llama's two cells of one problem (torch, and torch
    with one thread per rank) for STEPS steps, with ENV added: its rows (--json). For the sinks' comparison tests."""
    import json
    import os

    def compare(env: dict[str, str], steps: int) -> list[dict]:
        done = subprocess.run(
            [sys.executable, "-m", "llmadapt.cli", "compare", str(HERE.parent / "examples" / "tiny-llama.toml"),
             "--cell", "torch", "--cell", "torch:parallelism.threads_per_rank=1", "--launcher", "inline",
             "--set", f"train.steps={steps}", "--out", str(tmp_path / "runs"), "--json"],
            capture_output=True, text=True, env={**os.environ, **env}, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)["rows"]

    return compare


@pytest.fixture
def run_with_a_failing_sink(tmp_path):
    """Run tiny-llama (WORKLOAD) inline with a sink that fails: the run is ok, the console gets one warning naming the
    plugin and the failure, and every step record is on disk and reached on_record as well."""
    from llmadapt.contract.jsonl import read_jsonl
    from llmadapt.launch.runner import run

    def check(workload, plugin: str, failure: str) -> None:
        events, seen = [], []
        result = run(workload, "torch", launcher="inline", out=tmp_path / "runs", progress=events.append,
                     on_record=seen.append)
        assert result.ok
        warnings = [e["message"] for e in events if e["type"] == "warning"]
        assert len(warnings) == 1 and f"plugin '{plugin}'" in warnings[0] and failure in warnings[0], warnings
        on_disk = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "step"]
        assert [r["step"] for r in seen if r["type"] == "step"] == [r["step"] for r in on_disk]
        assert len(on_disk) == result.summary.steps_completed

    return check
