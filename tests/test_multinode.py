"""Multi-node torchrun, for real: two network-namespace "nodes" joined by a veth pair.

Each node runs its own `llmadapt run ... --nnodes 2 --node-rank N` with its own private output
folder; node 0 ends up with every rank's records (streamed, no shared run directory), and the
losses equal the single-node run of the same workload. Needs root (ip netns); skips otherwise.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmadapt import LlmadaptError, run
from llmadapt.adapter.plugins import adapters
from llmadapt.analysis.paritycheck import loss_parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.launch.settings import NodeSettings
from llmadapt.testing import standard_workloads

pytest.importorskip("torch")

WORKLOAD = standard_workloads()["train-dp2"]
LLMADAPT = [sys.executable, "-m", "llmadapt.cli"]
ADDR = ("10.77.0.1", "10.77.0.2")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def netns():
    """Two namespaces ("nodes") with a veth pair, 10.77.0.1 and 10.77.0.2; returns [(name, ifname)] * 2."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = os.getpid() % 100000
    nodes = [(f"llmadapt-{tag}-a", f"lla{tag}"), (f"llmadapt-{tag}-b", f"llb{tag}")]
    try:
        steps = [("netns", "add", nodes[0][0]), ("netns", "add", nodes[1][0]),
                 ("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])]
        for (ns, ifname), addr in zip(nodes, ADDR):
            steps += [("link", "set", ifname, "netns", ns), ("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname),
                      ("-n", ns, "link", "set", ifname, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            if (out := _ip(*step)).returncode:
                pytest.skip(f"cannot make network namespaces here: ip {' '.join(step)}: {out.stderr.strip()}")
        yield nodes
    finally:
        for ns, _ in nodes:
            _kill_namespace(ns)
            _ip("netns", "del", ns)


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in the namespace: the node dies."""
    for pid in _ip("netns", "pids", ns).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


# A node's `llmadapt run` through the Python API, for what the command line does not offer (fault injection).
NODE_SCRIPT = """
import json, sys, attrs
from llmadapt.launch import NodeSettings, run
from llmadapt.spec import Workload
a = json.loads(sys.argv[1])
r = run(Workload.from_file(a["workload"]), a["adapter"], out=a["out"], timeout=300, fault=a["fault"],
        nodes=NodeSettings(**a["nodes"]))
print(json.dumps({"run_dir": str(r.run_dir), "summary": attrs.asdict(r.summary)}))
"""


def start_nodes(netns, workload, adapter, tmp_path, *, rdzv: bool = False, fault=None) -> list[subprocess.Popen]:
    """`llmadapt run` on each node, each with its own output folder (tmp_path/node-a, tmp_path/node-b)."""
    wfile = tmp_path / "workload.json"
    wfile.write_text(json.dumps(workload.to_dict()))
    procs = []
    for rank, ((ns, ifname), addr) in enumerate(zip(netns, ADDR)):
        nodes = {"nnodes": 2, "node_rank": rank, "ifname": ifname}
        nodes.update({"rdzv_endpoint": f"{ADDR[0]}:29400", "local_addr": addr} if rdzv
                     else {"master_addr": ADDR[0], "master_port": 29400})
        out = tmp_path / f"node-{'ab'[rank]}"
        if fault:
            cmd = [sys.executable, "-c", NODE_SCRIPT, json.dumps({"workload": str(wfile), "adapter": adapter,
                                                                  "out": str(out), "fault": fault, "nodes": nodes})]
        else:
            cmd = [*LLMADAPT, "run", str(wfile), "--adapter", adapter, "--json", "--out", str(out), "--timeout", "300"]
            cmd += [arg for key, value in nodes.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    return procs


def finish(procs) -> list[dict]:
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert out.strip(), f"exit {proc.returncode}: {err[-3000:]}"
        outputs.append(json.loads(out))
    return outputs


_SINGLE: dict = {}


def single_node(workload, adapter, tmp_path_factory):
    """The same workload on one machine, two ranks under torchrun; once per session (test_slurm uses it too)."""
    key = (workload.content_hash, adapter)
    if key not in _SINGLE:
        result = run(workload, adapter, launcher="torchrun", out=tmp_path_factory.mktemp("single"), timeout=600)
        assert result.ok, result.summary.failures
        _SINGLE[key] = result
    return _SINGLE[key]


def test_two_nodes_match_one_node_and_node_0_gathers_every_record(netns, tmp_path, tmp_path_factory):
    """Reference adapter, static rendezvous: losses equal one node's; node 0 holds both ranks' records."""
    procs = start_nodes(netns, WORKLOAD, "torch", tmp_path)
    baseline = single_node(WORKLOAD, "torch", tmp_path_factory)
    node0, node1 = finish(procs)
    assert node0["summary"]["status"] == "ok", node0["summary"]["failures"]
    assert node1["summary"] == node0["summary"]  # node 1 reports node 0's summary of the whole run
    report = loss_parity(baseline.losses, node0["summary"]["losses"])
    assert report.ok, report.describe(("one node", "two nodes"))

    run0, node1_dir = Path(node0["run_dir"]), Path(node1["run_dir"])
    assert run0.parent == tmp_path / "node-a" and node1_dir == tmp_path / "node-b" / run0.name / "node-1"
    assert sorted(p.name for p in run0.glob("rank-*.jsonl")) == ["rank-00000.jsonl", "rank-00001.jsonl"]
    # Node 1's records were streamed: its own copy stays in its private folder, and is identical.
    assert (run0 / "rank-00001.jsonl").read_text() == (node1_dir / "rank-00001.jsonl").read_text()
    assert not list(node1_dir.parent.glob("rank-*.jsonl"))
    launch = json.loads((run0 / "launch.json").read_text())
    assert [(n["node_rank"], n["ranks"]) for n in launch["nodes"]["seen"]] == [(0, [0]), (1, [1])]


@pytest.mark.skipif("deepspeed" not in adapters(), reason="the deepspeed adapter is not installed")
def test_deepspeed_on_two_nodes_with_c10d_rendezvous_matches_one_node(netns, tmp_path, tmp_path_factory):
    """A framework adapter across the two nodes, elastic c10d rendezvous (is_host and local address set)."""
    workload = WORKLOAD.with_overrides(["train.steps=2", "train.warmup_steps=0"])
    procs = start_nodes(netns, workload, "deepspeed", tmp_path, rdzv=True)
    baseline = single_node(workload, "deepspeed", tmp_path_factory)
    node0, _ = finish(procs)
    assert node0["summary"]["status"] == "ok", node0["summary"]["failures"]
    report = loss_parity(baseline.losses, node0["summary"]["losses"])
    assert report.ok, report.describe(("one node", "two nodes"))


def test_a_node_that_dies_stops_the_other_and_every_earlier_record_is_kept(netns, tmp_path):
    """Node 1 is killed (every process in its namespace) while rank 1 hangs at step 2: node 0 stops,
    keeps steps 0-1 of both ranks, and says node 1 was lost."""
    workload = WORKLOAD.with_overrides(["train.steps=4"])
    procs = start_nodes(netns, workload, "torch", tmp_path, fault={"kind": "hang", "step": 2, "rank": 1})
    gathered = None
    for _ in range(1200):  # until node 0 holds rank 1's step 1, then kill node 1
        runs = list((tmp_path / "node-a").glob("*/rank-00001.jsonl"))
        if runs and any(r["type"] == "step" and r["step"] == 1 for r in read_jsonl(runs[0], check=False)):
            gathered = runs[0]
            break
        assert procs[0].poll() is None, procs[0].communicate()
        time.sleep(0.25)
    assert gathered, "rank 1 never reached step 1"
    # Rank 1 now hangs in step 2 (injected), so node 1 dies mid-run.
    _kill_namespace(netns[1][0])
    node0 = json.loads(procs[0].communicate(timeout=300)[0])
    procs[1].wait(30)
    summary = node0["summary"]
    assert summary["status"] == "failed"
    assert summary["steps_completed"] >= 2
    messages = [f["message"] for f in summary["failures"]]
    assert any(m.startswith("node 1 (") and "agent disconnected" in m for m in messages), messages
    assert any(f["rank"] == 1 and f["message"].startswith("[node 1 ") for f in summary["failures"]), messages
    steps = [r for r in read_jsonl(gathered) if r["type"] == "step"]
    assert [s["step"] for s in steps][:2] == [0, 1]


def test_layout_that_does_not_fit_the_workload_is_one_line(tmp_path):
    """nnodes x nproc-per-node must equal the workload's world size; several nodes need node 0's address."""
    with pytest.raises(LlmadaptError, match=r"^2 nodes x 2 ranks per node = 4 ranks, but the workload's world size "
                                            r"is 2"):
        run(WORKLOAD, "torch", nodes=NodeSettings(nnodes=2, nproc_per_node=2, master_addr="10.0.0.1"), out=tmp_path)
    with pytest.raises(LlmadaptError, match=r"^several nodes need node 0's address: set --master-addr"):
        run(WORKLOAD, "torch", nodes=NodeSettings(nnodes=2), out=tmp_path)
    assert not any(tmp_path.iterdir())


def test_hostname_on_loopback_is_warned_about(tmp_path, monkeypatch):
    """The multi-node trap: a hostname that resolves to 127.x is named, with the settings that fix it."""
    import socket

    from llmadapt.launch import multinode

    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    events = []
    multinode.warn_loopback(NodeSettings(nnodes=2, master_addr="10.0.0.1"), events.append)
    (event,) = events
    assert "resolves to 127.0.1.1, a loopback address" in event["message"] and "set --ifname" in event["message"]
    events.clear()
    multinode.warn_loopback(NodeSettings(nnodes=2, master_addr="10.0.0.1", ifname="eth1"), events.append)
    assert events == []


def test_workers_find_their_place_from_torchrun_then_slurm():
    """torchrun's variables win (also under srun + torchrun); else Slurm's; else a single process."""
    from llmadapt.runtime.device import Place

    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2"}
    assert Place.from_env(slurm) == Place(3, 1, 4, 1, "slurm", 2)
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    assert Place.from_env({**slurm, **torchrun}) == Place(5, 1, 8, 1, "torchrun", 2)
    assert Place.from_env({}) == Place(0, 0, 1, 0, "single", 1)


def test_node_0_refuses_a_node_running_another_workload(tmp_path):
    """A node started with a different workload is refused with the reason, and node 0 sees it as a failure."""
    from llmadapt.contract.launch import LaunchRequest
    from llmadapt.launch.collect import AgentLink, Collector

    collector = Collector(("127.0.0.1", 0))
    collector.start(tmp_path, LaunchRequest(run_id="r", launcher="torchrun", workload_hash="aaa"), nnodes=2)
    try:
        with pytest.raises(LlmadaptError, match=r"^node 0 refused this node: node 1's workload differs from node 0's"):
            AgentLink(("127.0.0.1", collector.port), {"node_rank": 1, "node": "x", "nnodes": 2,
                                                      "workload_hash": "bbb"}, timeout=5)
        (failure,) = collector.node_failures().values()
        assert failure.message.startswith("node refused: node 1's workload differs")
    finally:
        collector.close()
