"""Shared test fixtures."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmadapt.host import free_port

HERE = Path(__file__).parent


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
