"""Records from every node reach the orchestrator's run directory, with no shared disk.

Each worker started with ``LLMADAPT_COLLECT=host:port`` writes its records to its node's own
folder, as always, and sends each line, once flushed there, to the orchestrator's collector
over TCP, which appends it to ``rank-NNNNN.jsonl`` in the run directory. Streaming rather
than gathering at the end: when a node dies, every record it made before is already at the
orchestrator, and a stream that ends without its closing line tells which rank died.

Node agents (the ``llmadapt run`` of each node but node 0, under multi-node torchrun) keep a
control connection: node 0 hears how each node ended, tells the others to stop when one
fails, and sends them the run's summary.

Protocol, one JSON object per line; the first line says what the connection is:

- ``{"op": "records", "run_id", "rank", "node_rank", "node"}``, then records, then ``{"op": "end"}``.
- ``{"op": "agent", "node_rank", "node", "nnodes", "workload_hash"}``: the collector answers
  ``{"op": "launch", "launch": {...}}`` (or ``{"op": "refused", "reason"}``) and later
  ``{"op": "stop", "reason"}`` and ``{"op": "summary", "summary", "nodes"}``; the agent sends
  ``{"op": "exit", "code", "failures": [...]}`` when its workers are gone.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from llmadapt.contract import Failure, JsonlWriter, to_json
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


def _lines(sock: socket.socket):
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


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall((json.dumps(obj, separators=(",", ":")) + "\n").encode())


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat()


# -- worker side ------------------------------------------------------------------------------
class StreamingWriter:
    """A JsonlWriter whose records are also sent to the orchestrator's collector as they are written."""

    def __init__(self, path: Path, address: str, hello: dict[str, Any]) -> None:
        self.local = JsonlWriter(path)
        self.sock: socket.socket | None = connect(parse_address(address), CONNECT_TIMEOUT_S)
        self.sock.settimeout(SEND_TIMEOUT_S)
        _send(self.sock, {"op": "records", **hello})

    def write(self, record: Any) -> None:
        data = record if isinstance(record, dict) else to_json(record)
        self.local.write(data)  # the node's own copy first: it survives a lost orchestrator
        if self.sock is not None:
            try:
                _send(self.sock, data)
            except OSError as exc:
                print(f"llmadapt: lost the collector ({exc}); records stay in {self.local.path.parent}",
                      file=sys.stderr)
                self.sock.close()
                self.sock = None

    def close(self) -> None:
        self.local.close()
        if self.sock is not None:
            try:
                _send(self.sock, {"op": "end"})
            except OSError:
                pass
            self.sock.close()
            self.sock = None


# -- orchestrator side ------------------------------------------------------------------------
@attrs.define
class RankStream:
    rank: int
    node_rank: int
    node: str
    ended: bool = False  # the closing line arrived: the worker closed its records itself
    open: bool = True
    failed: bool = False  # a failure record came through


@attrs.define
class Agent:
    node_rank: int
    node: str
    sock: socket.socket
    exit_code: int | None = None
    failures: list[dict[str, Any]] = attrs.Factory(list)
    open: bool = True


class Collector:
    """Receives every rank's records into ``run_dir`` and keeps the node agents' connections."""

    def __init__(self, bind: tuple[str, int]) -> None:
        try:
            self.server = socket.create_server(bind, reuse_port=False)
        except OSError as exc:
            raise LlmadaptError(f"cannot listen for records on {bind[0]}:{bind[1]}: {exc} "
                                "(choose another port with --collect-port)") from None
        self.port = self.server.getsockname()[1]
        self.run_dir: Path | None = None
        self.launch: dict[str, Any] = {}
        self.nnodes = 1
        self.streams: dict[int, RankStream] = {}
        self.agents: dict[int, Agent] = {}
        self.refused: list[str] = []
        self.lock = threading.Lock()
        self.closed = False

    def start(self, run_dir: Path, launch: dict[str, Any], nnodes: int = 1) -> None:
        self.run_dir, self.launch, self.nnodes = Path(run_dir), launch, nnodes
        threading.Thread(target=self._accept, daemon=True, name="llmadapt-collector").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lines = _lines(conn)
        try:
            hello = json.loads(next(lines))
        except (StopIteration, json.JSONDecodeError):
            conn.close()
            return
        if hello.get("op") == "records":
            self._records(conn, hello, lines)
        elif hello.get("op") == "agent":
            self._agent(conn, hello, lines)
        else:
            conn.close()

    def _records(self, conn: socket.socket, hello: dict[str, Any], lines) -> None:
        rank = int(hello["rank"])
        with self.lock:
            if hello.get("run_id") != self.launch["run_id"] or rank in self.streams:
                conn.close()  # a stray worker of another run, or a duplicate rank
                return
            stream = self.streams[rank] = RankStream(rank, int(hello.get("node_rank", 0)), str(hello.get("node")))
        with JsonlWriter(self.run_dir / f"rank-{rank:05d}.jsonl") as out:
            for line in lines:
                record = json.loads(line)
                if record.get("op") == "end":
                    stream.ended = True
                    continue
                stream.failed |= record.get("type") == "failure"
                out.write(record)
            if not stream.ended and not stream.failed:
                # The process went without a word: killed, or its node or the network to it died.
                out.write(Failure(cause="killed", rank=rank, time=_now(), message=(
                    f"[node {stream.node_rank} {stream.node}] rank {rank}'s record stream ended without a failure "
                    "record: the process, its node or the network to it died (seen by the orchestrator)")))
        conn.close()
        stream.open = False

    def _agent(self, conn: socket.socket, hello: dict[str, Any], lines) -> None:
        node_rank = int(hello["node_rank"])
        reason = None
        with self.lock:
            if hello.get("workload_hash") != self.launch["workload_hash"]:
                reason = (f"node {node_rank}'s workload differs from node 0's (hash {hello.get('workload_hash')} "
                          f"vs {self.launch['workload_hash']}): run the same workload and --set options on every node")
            elif int(hello.get("nnodes", 0)) != self.nnodes:
                reason = f"node {node_rank} was started with --nnodes {hello.get('nnodes')}, node 0 with {self.nnodes}"
            elif not 0 < node_rank < self.nnodes or node_rank in self.agents:
                reason = f"node rank {node_rank} is out of range or already taken (nnodes {self.nnodes})"
            else:
                agent = self.agents[node_rank] = Agent(node_rank, str(hello.get("node")), conn)
        try:
            if reason:
                self.refused.append(reason)
                _send(conn, {"op": "refused", "reason": reason})
                conn.close()
                return
            _send(conn, {"op": "launch", "launch": self.launch})
            for line in lines:
                msg = json.loads(line)
                if msg.get("op") == "exit":
                    agent.exit_code, agent.failures = int(msg["code"]), list(msg.get("failures", []))
        except OSError:
            pass
        agent.open = False

    # -- what the orchestrator asks -------------------------------------------------------------
    def node_failures(self) -> dict[int, Failure]:
        """Each node that failed or vanished, as a failure naming it; empty while all is well."""
        out = {-1 - i: Failure(cause="error", time=_now(), message=f"node refused: {reason}")
               for i, reason in enumerate(self.refused)}
        for agent in list(self.agents.values()):
            if agent.exit_code not in (None, 0):
                why = "; ".join(f["message"] for f in agent.failures) or f"exit code {agent.exit_code}"
                out[agent.node_rank] = Failure(cause="crash", time=_now(), exit_code=agent.exit_code,
                                               message=f"node {agent.node_rank} ({agent.node}) failed: {why}")
            elif not agent.open and agent.exit_code is None:
                out[agent.node_rank] = Failure(cause="killed", time=_now(), message=(
                    f"node {agent.node_rank} ({agent.node}): its llmadapt agent disconnected without reporting "
                    "(it was killed, or the node or the network to it died)"))
        return out

    def stop_nodes(self, reason: str) -> None:
        for agent in list(self.agents.values()):
            if agent.open:
                try:
                    _send(agent.sock, {"op": "stop", "reason": reason})
                except OSError:
                    pass

    def wait(self, timeout: float) -> bool:
        """Wait until every agent has reported and every record stream has closed; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            agents = list(self.agents.values())
            agents_done = len(agents) == self.nnodes - 1 and all(a.exit_code is not None or not a.open for a in agents)
            if agents_done and not any(s.open for s in list(self.streams.values())):
                return True
            time.sleep(0.1)
        return False

    def nodes(self) -> list[dict[str, Any]]:
        """Every node seen, with its ranks, from the workers' own reports."""
        by_node: dict[int, dict[str, Any]] = {}
        for s in sorted(self.streams.values(), key=lambda s: s.rank):
            entry = by_node.setdefault(s.node_rank, {"node_rank": s.node_rank, "node": s.node, "ranks": []})
            entry["ranks"].append(s.rank)
        for a in self.agents.values():
            by_node.setdefault(a.node_rank, {"node_rank": a.node_rank, "node": a.node, "ranks": []})
        return [by_node[k] for k in sorted(by_node)]

    def send_summary(self, summary: dict[str, Any]) -> None:
        for agent in list(self.agents.values()):
            try:
                _send(agent.sock, {"op": "summary", "summary": summary, "nodes": self.nodes()})
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.server.close()
        for agent in list(self.agents.values()):
            try:
                agent.sock.close()
            except OSError:
                pass


class AgentLink:
    """A node agent's control connection to node 0's collector."""

    def __init__(self, address: tuple[str, int], hello: dict[str, Any], timeout: float) -> None:
        self.sock = connect(address, timeout)
        self.sock.settimeout(None)
        _send(self.sock, {"op": "agent", **hello})
        self.messages = _lines(self.sock)
        first = json.loads(next(self.messages, '{"op": "refused", "reason": "node 0 closed the connection"}'))
        if first["op"] != "launch":
            self.sock.close()
            raise LlmadaptError(f"node 0 refused this node: {first['reason']}")
        self.launch: dict[str, Any] = first["launch"]
        self.stop_reason: str | None = None
        self.summary: dict[str, Any] | None = None
        self.nodes: list[dict[str, Any]] = []
        self.done = threading.Event()
        threading.Thread(target=self._listen, daemon=True, name="llmadapt-agent").start()

    def _listen(self) -> None:
        for line in self.messages:
            msg = json.loads(line)
            if msg["op"] == "stop":
                self.stop_reason = msg["reason"]
            elif msg["op"] == "summary":
                self.summary, self.nodes = msg["summary"], msg["nodes"]
        if self.stop_reason is None and self.summary is None:
            self.stop_reason = "lost node 0 (its llmadapt orchestrator closed the connection or died)"
        self.done.set()

    def report(self, code: int, failures: list[Failure]) -> None:
        try:
            _send(self.sock, {"op": "exit", "code": code, "failures": [to_json(f) for f in failures]})
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def local_hostname_is_loopback() -> tuple[str, str] | None:
    """(hostname, address) when this host's name resolves to a loopback address, the multi-node trap."""
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        return None
    return (name, addr) if addr.startswith("127.") or addr == "::1" else None


def node_name() -> str:
    """The node's name as the scheduler knows it (Slurm's node name where set), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
