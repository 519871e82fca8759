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

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.launch import LaunchRequest
from llmadapt.contract.records import Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.contract.schema import to_json
from llmadapt.contract.stream import connect, read_lines, send_line
from llmadapt.errors import LlmadaptError
from llmadapt.host import exit_cause, exit_text, utc_now


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
        self.launch: LaunchRequest | None = None
        self.nnodes = 1
        self.streams: dict[int, RankStream] = {}
        self.agents: dict[int, Agent] = {}
        self.refused: list[str] = []
        self.lock = threading.Lock()
        self.closed = False

    def start(self, run_dir: Path, launch: LaunchRequest, nnodes: int = 1) -> None:
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
        lines = read_lines(conn)
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
            if hello.get("run_id") != self.launch.run_id or rank in self.streams:
                conn.close()  # a stray worker of another run, or a duplicate rank
                return
            stream = self.streams[rank] = RankStream(rank, int(hello.get("node_rank", 0)), str(hello.get("node")))
        with JsonlWriter(RunDir(self.run_dir).rank_file(rank)) as out:
            for line in lines:
                record = json.loads(line)
                if record.get("op") == "end":
                    stream.ended = True
                    continue
                stream.failed |= record.get("type") == "failure"
                out.write(record)
            if not stream.ended and not stream.failed:
                # The process went without a word: killed, or its node or the network to it died.
                out.write(Failure(cause="killed", rank=rank, time=utc_now(), message=(
                    f"[node {stream.node_rank} {stream.node}] rank {rank}'s record stream ended without a failure "
                    "record: the process, its node or the network to it died (seen by the orchestrator)")))
        conn.close()
        stream.open = False

    def _agent(self, conn: socket.socket, hello: dict[str, Any], lines) -> None:
        node_rank = int(hello["node_rank"])
        reason = None
        with self.lock:
            if hello.get("workload_hash") != self.launch.workload_hash:
                reason = (f"node {node_rank}'s workload differs from node 0's (hash {hello.get('workload_hash')} "
                          f"vs {self.launch.workload_hash}): run the same workload and --set options on every node")
            elif int(hello.get("nnodes", 0)) != self.nnodes:
                reason = f"node {node_rank} was started with --nnodes {hello.get('nnodes')}, node 0 with {self.nnodes}"
            elif not 0 < node_rank < self.nnodes or node_rank in self.agents:
                reason = f"node rank {node_rank} is out of range or already taken (nnodes {self.nnodes})"
            else:
                agent = self.agents[node_rank] = Agent(node_rank, str(hello.get("node")), conn)
        try:
            if reason:
                self.refused.append(reason)
                send_line(conn, {"op": "refused", "reason": reason})
                conn.close()
                return
            send_line(conn, {"op": "launch", "launch": self.launch.to_json()})
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
        out = {-1 - i: Failure(cause="error", time=utc_now(), message=f"node refused: {reason}")
               for i, reason in enumerate(self.refused)}
        for agent in list(self.agents.values()):
            if agent.exit_code not in (None, 0):
                why = "; ".join(f["message"] for f in agent.failures) or f"its workers {exit_text(agent.exit_code)}"
                out[agent.node_rank] = Failure(cause=exit_cause(agent.exit_code), time=utc_now(),
                                               exit_code=agent.exit_code,
                                               message=f"node {agent.node_rank} ({agent.node}) failed: {why}")
            elif not agent.open and agent.exit_code is None:
                out[agent.node_rank] = Failure(cause="killed", time=utc_now(), message=(
                    f"node {agent.node_rank} ({agent.node}): its llmadapt agent disconnected without reporting "
                    "(it was killed, or the node or the network to it died)"))
        return out

    def stop_nodes(self, reason: str) -> None:
        for agent in list(self.agents.values()):
            if agent.open:
                try:
                    send_line(agent.sock, {"op": "stop", "reason": reason})
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
                send_line(agent.sock, {"op": "summary", "summary": summary, "nodes": self.nodes()})
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
        send_line(self.sock, {"op": "agent", **hello})
        self.messages = read_lines(self.sock)
        first = json.loads(next(self.messages, '{"op": "refused", "reason": "node 0 closed the connection"}'))
        if first["op"] != "launch":
            self.sock.close()
            raise LlmadaptError(f"node 0 refused this node: {first['reason']}")
        self.launch = LaunchRequest.from_json(first["launch"])
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
            send_line(self.sock, {"op": "exit", "code": code, "failures": [to_json(f) for f in failures]})
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
