"""How a worker process is stopped: the stop signal raises once, and the failure record survives a second one."""

import os
import signal

import pytest

from llmadapt.runtime import lifecycle


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
