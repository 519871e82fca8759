"""How a worker process is stopped: the stop signal raises once, and the failure record survives a second one;
and the shell every worker runs in (WorkerProcess): its End or failure record, its teardown, its exit code."""

import os
import signal

import pytest

from llmadapt.contract.jsonl import JsonlWriter, read_jsonl
from llmadapt.runtime import lifecycle
from llmadapt.runtime.device import Place


@pytest.fixture
def stop_handler():
    previous = lifecycle.install_stop_handler()
    yield
    signal.signal(signal.SIGTERM, previous)
    lifecycle._stop.clear()


def sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a C call: the Python handler has run when it returns


def test_the_stop_signal_raises_once(stop_handler):
    with pytest.raises(lifecycle.Stopped, match="stopped by signal SIGTERM"):
        sigterm_self()
    sigterm_self()  # torchrun stopping the other ranks after this one left: already unwinding, no second raise
    assert lifecycle.stop_message().startswith("stopped by signal SIGTERM")


def test_a_stop_that_lands_while_a_failure_is_written_gets_the_record(stop_handler):
    """A collective failed because a stopped peer left; the stop pending meanwhile lands in the except block."""
    written = []

    def write(exc):
        if not written and not isinstance(exc, lifecycle.Stopped):
            sigterm_self()  # lands before anything is written
        written.append(lifecycle.failure_cause(exc, repr))
        return written[-1][1]

    lifecycle._stop["reason"] = "its orchestrator, pid 1, is gone"
    code = lifecycle.write_failure(RuntimeError("Connection closed by peer"), write)
    assert written == [("killed", 143, "stopped by signal SIGTERM (its orchestrator, pid 1, is gone)")]
    assert code == 143


def test_an_error_after_a_stop_was_asked_names_the_stop(stop_handler):
    """The watch thread set its reason but the signal has not been handled yet when the collective fails."""
    lifecycle._stop["reason"] = "its orchestrator, pid 1, is gone"
    cause, code, message = lifecycle.failure_cause(RuntimeError("Connection reset"), repr)
    assert (cause, code) == ("killed", 143)
    assert message == "stopping (its orchestrator, pid 1, is gone); then RuntimeError('Connection reset')"


def test_an_error_without_a_stop_is_an_error(stop_handler):
    assert lifecycle.failure_cause(ValueError("x"), repr) == ("error", 1, "ValueError('x')")
    assert lifecycle.failure_cause(MemoryError(), repr)[0] == "oom"


# -- the worker shell ---------------------------------------------------------------------------------------


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """A WorkerProcess over a record file, and a reader of what it wrote; no orchestrator to watch."""
    monkeypatch.delenv(lifecycle.ORCHESTRATOR_VAR, raising=False)
    path = tmp_path / "rank-00000.jsonl"

    def make(**kwargs):
        return lifecycle.WorkerProcess(JsonlWriter(path), Place(0, 0, 1, 0, "single"), "worker", **kwargs)

    yield make, lambda: read_jsonl(path)
    lifecycle._stop.clear()


def test_a_finished_block_ends_with_an_end_record_then_tears_down(shell):
    make, records = shell
    seen = []
    with make(signals=False) as worker:
        worker.at_close(lambda: seen.append(("close", [r["type"] for r in records()])))
        worker.at_teardown(lambda: seen.append(("teardown", worker.writer._fd)))
        for _ in worker.steps(3):
            pass
    assert worker.code == 0 and worker.completed
    assert [r["type"] for r in records()] == ["end"]
    assert seen == [("close", ["end"]), ("teardown", None)]  # closed after the End record, torn down after that


def test_an_error_is_one_failure_record_naming_step_and_role_and_no_teardown(shell, capsys):
    make, records = shell
    torn = []
    with make(signals=False) as worker:
        worker.role = lambda: "pp stage 1"
        worker.at_teardown(lambda: torn.append(True))
        for step in worker.steps(5):
            if step == 2:
                raise RuntimeError("boom")
    (failure,) = records()
    assert worker.code == 1 and not worker.completed and torn == []
    assert (failure["cause"], failure["step"], failure["exit_code"]) == ("error", 2, 1)
    assert failure["message"].startswith("[pp stage 1] RuntimeError: boom (at ") and failure["time"]
    assert "RuntimeError: boom" in capsys.readouterr().err  # the traceback, for the log


def test_a_role_that_cannot_be_told_leaves_the_message_bare(shell):
    make, records = shell
    with make(signals=False) as worker:
        worker.role = lambda: 1 / 0
        raise ValueError("bad")
    assert records()[0]["message"].startswith("ValueError: bad")


def test_a_failed_teardown_is_a_warning_and_exit_code_1_after_the_end_record(shell, capsys):
    make, records = shell
    with make(signals=False) as worker:
        worker.at_teardown(lambda: 1 / 0)
    assert worker.code == 1 and [r["type"] for r in records()] == ["end"]
    assert "llmadapt worker rank 0: teardown after the last record failed: ZeroDivisionError" in capsys.readouterr().err


def test_sigterm_in_the_block_is_a_killed_record_and_the_handler_is_given_back(shell):
    make, records = shell
    before = signal.getsignal(signal.SIGTERM)
    with make() as worker:
        for step in worker.steps(3):
            if step == 1:
                sigterm_self()
    (failure,) = records()
    assert (failure["cause"], failure["step"], failure["exit_code"]) == ("killed", 1, 143)
    assert failure["message"].startswith("stopped by signal SIGTERM") and worker.code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_inline_block_leaves_the_signals_alone(shell):
    make, _ = shell
    before = signal.getsignal(signal.SIGTERM)
    with make(signals=False):
        assert signal.getsignal(signal.SIGTERM) is before


def test_the_one_worker_entry_point_picks_the_kind_from_the_launch_record():
    """`python -m llmadapt.runtime RUN_DIR` runs the training, micro-benchmark or offline worker as the record says;
    every kind's run function is importable from its 'module:function'; no argument: its usage, exit code 2."""
    import subprocess
    import sys

    from llmadapt.adapter.declaration import load_role
    from llmadapt.contract.launch import LaunchRequest
    from llmadapt.runtime.kinds import USAGE, WORKER_KINDS, kind_of

    assert kind_of(LaunchRequest(run_id="r", launcher="torchrun")) == "train"
    assert kind_of(LaunchRequest(run_id="r", launcher="subprocess", kind="micro")) == "micro"
    assert kind_of(LaunchRequest(run_id="r", launcher="offline", role="serve")) == "offline"
    assert all(callable(load_role(kind.run)) for kind in WORKER_KINDS.values())
    done = subprocess.run([sys.executable, "-m", "llmadapt.runtime"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and USAGE in done.stderr
