"""The serving conformance suite (llmadapt.testing.ServerConformance) on every serving adapter: the engines started
here (hf, vllm, llamacpp, and plain, the worked example; skipped, with the reason, where an environment is not
built), and the attach-only ones against the project's protocol servers (openai: tests/fake_openai.py; tgi and tgi-openai: tests/fake_tgi.py).
One engine per adapter, a handful of requests each."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmadapt.host import free_port
from llmadapt.testing import ServerConformance

HERE = Path(__file__).parent
pytest.importorskip("aiohttp")


def protocol_server(script: str, *args: str):
    """Start tests/SCRIPT on a free port (before the suite marks its processes); yield its URL; kill it after."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / script), str(port), *args])
    try:
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"{script} exited with {proc.returncode}") from None
                time.sleep(0.05)
        else:
            raise RuntimeError(f"{script} did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


class TestHF(ServerConformance):
    adapter = "hf"
    expected_failures = {"test_rejected_request_is_a_failed_request":
                         "transformers serve does not refuse a prompt longer than the model's context: it answers a "
                         "272-token prompt on the 256-position model (16 tokens, finish 'length')"}


class TestVLLM(ServerConformance):
    adapter = "vllm"


class TestLlamaCpp(ServerConformance):
    adapter = "llamacpp"
    expected_failures = {"test_rejected_request_is_a_failed_request":
                         "llama-cpp-python's server answers a prompt longer than n_ctx with HTTP 200 and a stream "
                         "it ends empty, without an error event: the request reads as truncated, the engine's cause "
                         "never reaches the client"}


class TestPlain(ServerConformance):
    """The worked-example adapter (examples/adapter-plain): its own engine, importing only llmadapt.adapter."""

    adapter = "plain"


class TestOpenAI(ServerConformance):
    """fake_openai.py takes any prompt: the refusal comes from a second one that answers the first request 429."""

    adapter = "openai"

    @pytest.fixture(scope="class")
    @classmethod
    def engine_url(cls):
        yield from protocol_server("fake_openai.py")

    @pytest.fixture(scope="class")
    @classmethod
    def rejecting_url(cls, engine_url):
        yield from protocol_server("fake_openai.py", "--cycle", "429,ok")


class TestTGI(ServerConformance):
    """fake_tgi.py validates as TGI's router does: a prompt over --max-total-tokens is an in-band validation error."""

    adapter = "tgi"

    @pytest.fixture(scope="class")
    @classmethod
    def engine_url(cls):
        yield from protocol_server("fake_tgi.py", "--max-total-tokens", "64")


class TestTGIOpenAI(TestTGI):
    adapter = "tgi-openai"
