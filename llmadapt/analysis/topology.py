"""The topology a run ran on (the summary's, rank 0's header's), as the line `show` prints."""

from __future__ import annotations

from typing import Any


def topology_line(t: dict[str, Any]) -> str:
    """'topology   pcie; 2 NUMA node(s); rank 0 on 16 core(s); threads intra_op=8, inter_op=8; GPU 1 over one PCIe
    switch (no NVLink)': the summary's topology (rank 0's), one line."""
    parts = [t["interconnect"]]
    if t.get("numa_nodes"):
        parts.append(f"{t['numa_nodes']} NUMA node(s)")
    if t.get("cpus"):
        parts.append(f"rank 0 on {len(t['cpus'])} core(s)")
    if t.get("threads"):
        parts.append("threads " + ", ".join(f"{k}={v}" for k, v in t["threads"].items()))
    if t.get("nvlinks_active") is not None:
        parts.append(f"{t['nvlinks_active']} NVLink link(s) up")
    for link in t.get("gpu_links") or []:
        over = {True: "NVLink", False: "no NVLink", None: "NVLink not known"}[link.get("nvlink")]
        parts.append(f"GPU {link['peer']} over {link['path']} ({over})")
    return "topology   " + "; ".join(parts)
