"""Topology: every training header says how the rank's device reaches the others (NUMA and cores on CPU; NVML's
PCIe path, NVLink and P2P status on GPU) and the communication settings it ran with; parallelism.p2p = false turns
NCCL's peer-to-peer path off, and is refused where nothing would honour it."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmadapt import UnsupportedError, Workload
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.runtime.device import describe_topology
from llmadapt.testing import environments_unready

ROOT = Path(__file__).resolve().parents[1]
TINY = Workload.from_file(ROOT / "examples" / "tiny-llama.toml")


class FakeNvml:
    """NVML as pynvml exposes it, for a machine of four GPUs: 0-1 and 2-3 NVLink pairs on one PCIe switch each,
    the pairs across the host bridge (the way DGX-like boards are wired). Faithful to pynvml's names and codes."""

    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_P2P_CAPS_INDEX_READ = 0
    NVML_P2P_CAPS_INDEX_NVLINK = 2

    def nvmlDeviceGetCount(self):
        return 4

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= 4:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return 1

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 10 if a // 2 == b // 2 else 30  # one PCIe switch within a pair, the host bridge across

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        if index == self.NVML_P2P_CAPS_INDEX_NVLINK:
            return 0 if a // 2 == b // 2 else 5  # NVLink within a pair only
        return 0


def test_a_gpu_rank_records_each_peers_path_nvlink_and_p2p():
    device = SimpleNamespace(type="cuda", index=1)
    t = describe_topology(device, env={"CUDA_VISIBLE_DEVICES": "2,3", "NCCL_ALGO": "Ring", "HOME": "/root"},
                          nvml=FakeNvml())
    # torch's cuda:1 under CUDA_VISIBLE_DEVICES=2,3 is NVML's GPU 3
    assert t.interconnect == "nvlink" and t.nvlinks_active == 4
    assert [(g.peer, g.path, g.nvlink, g.p2p) for g in t.gpu_links] == [
        (0, "PCIe host bridge", False, "ok"), (1, "PCIe host bridge", False, "ok"),
        (2, "one PCIe switch", True, "ok")]
    assert t.settings == {"CUDA_VISIBLE_DEVICES": "2,3", "NCCL_ALGO": "Ring"}  # what steers communication only
    off = describe_topology(device, env={"NCCL_P2P_DISABLE": "1"}, nvml=FakeNvml())
    assert {g.p2p for g in off.gpu_links} == {"disabled by NCCL_P2P_DISABLE"}


def test_without_nvml_the_topology_is_unknown_not_a_failure():
    class Broken(FakeNvml):
        def nvmlDeviceGetCount(self):
            raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")

    t = describe_topology(SimpleNamespace(type="cuda", index=0), env={}, nvml=Broken())
    assert t.interconnect == "unknown" and t.gpu_links == []


def test_a_cpu_rank_records_numa_nodes_cores_and_settings():
    t = describe_topology(SimpleNamespace(type="cpu", index=None), env={"GLOO_SOCKET_IFNAME": "lo"})
    assert t.interconnect == "cpu" and t.cpus == sorted(os.sched_getaffinity(0))
    assert t.numa_nodes is None or t.numa_nodes >= 1
    assert t.settings == {"GLOO_SOCKET_IFNAME": "lo"}


def test_the_topology_line_says_links_cores_and_threads():
    from llmadapt.analysis.topology import topology_line

    t = {"interconnect": "pcie", "numa_nodes": 2, "cpus": list(range(16)), "threads": {"intra_op": 8},
         "nvlinks_active": 0, "gpu_links": [{"peer": 1, "path": "one PCIe switch", "nvlink": False, "p2p": "ok"}]}
    assert topology_line(t) == ("topology   pcie; 2 NUMA node(s); rank 0 on 16 core(s); threads intra_op=8; 0 NVLink "
                                "link(s) up; GPU 1 over one PCIe switch (no NVLink)")


def test_p2p_off_is_refused_where_nothing_would_honour_it(monkeypatch):
    from llmadapt.launch.settings import resolve

    off = TINY.with_overrides(["parallelism.p2p=false"])
    assert off.problem_hash == TINY.problem_hash  # a layout setting: the same problem
    assert off.content_hash != TINY.content_hash and TINY.to_dict()["parallelism"]["p2p"] is True
    monkeypatch.setenv("LLMADAPT_DEVICE", "cpu")
    with pytest.raises(UnsupportedError, match="no GPU is visible here, and gloo on a CPU has no such path"):
        resolve(off, "torch")


@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
def test_every_rank_header_carries_its_topology(tmp_path):
    from llmadapt import run

    result = run(TINY.with_overrides(["parallelism.dp=2", "train.steps=2"]), "torch", out=tmp_path)
    assert result.ok
    for rank in (0, 1):
        header = read_jsonl(result.run_dir / f"rank-{rank:05d}.jsonl")[0]
        t = header["topology"]
        assert t["interconnect"] == "cpu" and t["cpus"] and t["gpu_links"] == []
        assert "MASTER_ADDR" in t["settings"]  # torchrun's rendezvous: how the ranks found each other
    # the run's topology as data: in its summary (rank 0's), show, the store's index and a comparison's row
    from llmadapt.analysis.comparison import compare_stored
    from llmadapt.analysis.report import render_summary, show
    from llmadapt.analysis.store import RunStore

    rank0 = read_jsonl(result.run_dir / "rank-00000.jsonl")[0]["topology"]
    summary = show(result.run_dir)
    assert summary["topology"] == rank0
    assert "topology   cpu; " in render_summary(summary) and f"rank 0 on {len(rank0['cpus'])} core(s)" in \
        render_summary(summary)
    with RunStore(tmp_path) as store:
        (stored,) = store.runs("interconnect=cpu")
    assert stored.row["interconnect"] == "cpu"
    (row,) = compare_stored(root=tmp_path).rows
    assert row.topology is not None and row.topology.interconnect == "cpu" and row.topology.cpus == rank0["cpus"]


@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
def test_a_comparison_runs_its_cells_with_the_threads_it_chose_and_records_them(tmp_path):
    """dp1 against dp2 on this machine: both cells' ranks run with the same intra-op threads (each header says
    so), the count the comparison chose; without it the 1-rank cell got every core and the 2-rank cell half."""
    from llmadapt import compare
    from llmadapt.launch.supervise import default_threads

    table = compare(TINY.with_overrides(["train.steps=2"]), ["torch"], matrix={"parallelism.dp": [1, 2]},
                    out=tmp_path)
    assert [r.status for r in table.rows] == ["ok", "ok"]
    threads = set()
    for row in table.rows:
        for rank in range(int(row.label.split("dp")[1][0])):
            header = read_jsonl(Path(row.run_dir) / f"rank-{rank:05d}.jsonl")[0]
            threads.add(header["topology"]["threads"]["intra_op"])
    assert threads == {default_threads(2)}  # OMP_NUM_THREADS where exported, else the cores over two ranks
