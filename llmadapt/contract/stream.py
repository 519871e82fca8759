"""Streaming records over TCP, the worker's side: every record written to the local file is also sent to
the orchestrator's collector (``llmadapt.launch.collect`` has the protocol and the other side).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.schema import to_json
from llmadapt.errors import LlmadaptError

CONNECT_TIMEOUT_S = 60.0  # a worker may start before the orchestrator listens (torchrun by hand)


SEND_TIMEOUT_S = 10.0  # a stalled orchestrator must not stall training: the local copy is kept regardless


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LlmadaptError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def connect(address: tuple[str, int], timeout: float) -> socket.socket:
    """Connect, retrying until ``timeout`` (the other side may not listen yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(address, timeout=5)
        except OSError as exc:
            if time.monotonic() > deadline:
                host, port = address
                raise LlmadaptError(f"cannot reach the orchestrator's collector at {host}:{port} "
                                    f"after {timeout:g} s: {exc}") from None
            time.sleep(0.5)


def read_lines(sock: socket.socket):
    """Complete lines received, decoded; a torn last line (the peer died mid-write) is dropped."""
    buf = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield line.decode()


def send_line(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall((json.dumps(obj, separators=(",", ":")) + "\n").encode())


# -- worker side ------------------------------------------------------------------------------
class StreamingWriter:
    """A JsonlWriter whose records are also sent to the orchestrator's collector as they are written."""

    def __init__(self, path: Path, address: str, hello: dict[str, Any]) -> None:
        self.local = JsonlWriter(path)
        self.sock: socket.socket | None = connect(parse_address(address), CONNECT_TIMEOUT_S)
        self.sock.settimeout(SEND_TIMEOUT_S)
        send_line(self.sock, {"op": "records", **hello})

    def write(self, record: Any) -> None:
        data = record if isinstance(record, dict) else to_json(record)
        self.local.write(data)  # the node's own copy first: it survives a lost orchestrator
        if self.sock is not None:
            try:
                send_line(self.sock, data)
            except OSError as exc:
                print(f"llmadapt: lost the collector ({exc}); records stay in {self.local.path.parent}",
                      file=sys.stderr)
                self.sock.close()
                self.sock = None

    def close(self) -> None:
        self.local.close()
        if self.sock is not None:
            try:
                send_line(self.sock, {"op": "end"})
            except OSError:
                pass
            self.sock.close()
            self.sock = None
