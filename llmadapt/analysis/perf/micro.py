"""A micro-benchmark run as read from its records (``read_micro``): operators with their roofline position,
measured peaks, collectives, what was unsupported and what failed; as a table or CSV. ``llmadapt.experiments.micro``
runs the suites.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.texttable import text_table


@attrs.frozen
class MicroResult:
    run_dir: Path
    suite: str
    status: str
    device_name: str | None
    device_kind: str | None
    device_memory_bytes: int | None
    world_size: int
    peaks: dict[str, float]
    """'flops_per_s.<dtype>' and 'memory_bytes_per_s', as measured by this run (empty if it measured none)."""
    ops: list[dict[str, Any]]
    """op_bench records of operators, each with its roofline position added."""
    peak_runs: list[dict[str, Any]]
    comm: list[dict[str, Any]]
    unsupported: list[dict[str, Any]]
    failures: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["run_dir"] = str(self.run_dir)
        return d

    # -- text ----------------------------------------------------------------------------------
    def table(self) -> str:
        lines = [f"micro {self.suite}  [{self.status}]  {self.run_dir}",
                 f"device     {self.device_kind}: {self.device_name}" + (f" x {self.world_size} ranks"
                                                                          if self.world_size > 1 else "")]
        for k, v in sorted(self.peaks.items()):
            unit = "GB/s" if k.startswith("memory") else "GFLOP/s"
            lines.append(f"peak       {k:<24} {v / 1e9:,.1f} {unit} (measured)")
        if self.ops:
            head = ["op", "dir", "backend", "dtype", "shape", "p50 us", "min us", "GFLOP/s", "GB/s", "F/B", "bound",
                    "of roof"]
            body = []
            for r in self.ops:
                st = r["seconds"]
                body.append([r["op"], r["direction"][:3], r.get("backend") or "-", r["dtype"], _shape(r["shape"]),
                             f"{st['p50'] * 1e6:,.1f}" if st else r["status"], f"{st['min'] * 1e6:,.1f}" if st else "-",
                             _num(r.get("flops_per_s"), 1e9, ",.2f"), _num(r.get("bytes_per_s"), 1e9, ",.2f"),
                             f"{r['intensity']:.2f}" if r.get("intensity") is not None else "-",
                             r.get("bound") or "-",
                             f"{r['roof_fraction']:.1%}" if r.get("roof_fraction") is not None else "-"])
            lines += text_table(head, body)
        if self.comm:
            head = ["op", "bytes", "time us", "algbw GB/s", "busbw GB/s"]
            body = [[c["op"], f"{c['message_bytes']:,}", f"{c['total_seconds'] / c['count'] * 1e6:,.1f}",
                     f"{c['algbw_gbytes_per_s']:.3f}", f"{c['busbw_gbytes_per_s']:.3f}"] for c in self.comm]
            lines += text_table(head, body)
        seen = set()
        for u in self.unsupported:
            key = (u["op"], u.get("backend"), u.get("note"))
            if key not in seen:
                seen.add(key)
                lines.append(f"{u['status']} {u['op']}{' ' + u['backend'] if u.get('backend') else ''}: {u.get('note')}")
        for f in self.failures:
            lines.append(f"failure    {f['cause']} (rank {f.get('rank')}): {f['message']}")
        return "\n".join(lines)

    def csv(self) -> str:
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf)
        if self.suite == "comm":
            w.writerow(["op", "ranks", "message_bytes", "count", "mean_s", "algbw_gbytes_per_s", "busbw_gbytes_per_s"])
            for c in self.comm:
                w.writerow([c["op"], self.world_size, c["message_bytes"], c["count"], c["total_seconds"] / c["count"],
                            c["algbw_gbytes_per_s"], c["busbw_gbytes_per_s"]])
            return buf.getvalue()
        w.writerow(["op", "direction", "backend", "dtype", "shape", "status", "count", "p50_s", "mean_s", "min_s",
                    "flops", "bytes", "flops_per_s", "bytes_per_s", "intensity", "bound", "roof_fraction"])
        for r in self.peak_runs + self.ops:
            st = r["seconds"] or {}
            w.writerow([r["op"], r["direction"], r.get("backend") or "", r["dtype"], _shape(r["shape"]), r["status"],
                        st.get("count", 0), st.get("p50", ""), st.get("mean", ""), st.get("min", ""), r["flops"],
                        r["bytes"], r.get("flops_per_s") or "", r.get("bytes_per_s") or "", r.get("intensity", ""),
                        r.get("bound", ""), r.get("roof_fraction", "")])
        return buf.getvalue()


def _num(v, scale, fmt) -> str:
    return "-" if not v else format(v / scale, fmt)


def _shape(shape: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def read_micro(run_dir: str | Path) -> MicroResult:
    """Rebuild a micro-benchmark result from its records on disk."""
    from llmadapt.contract.readback import load_records

    run_dir = Path(run_dir)
    launch_path = RunDir(run_dir).launch_file
    if not launch_path.is_file():
        raise LlmadaptError(f"{run_dir} is not a micro-benchmark run directory (no launch.json)")
    launch = RunDir(run_dir).read_launch()
    if launch.kind != "micro":
        raise LlmadaptError(f"{run_dir} is not a micro-benchmark run (a {launch.role or 'workload'} run)")
    records = load_records(run_dir)
    headers = [r for r in records if r["type"] == "header"]
    head = min(headers, key=lambda h: h["rank"]) if headers else None
    device = (head or {}).get("device") or {}
    peaks = {r["name"].removeprefix("peak."): r["value"] for r in records
             if r["type"] == "metric" and r["name"].startswith("peak.")}
    bench = [r for r in records if r["type"] == "op_bench"]
    peak_runs = [r for r in bench if r["source"] == "llmadapt.micro peak" and r["status"] == "ok"]
    ops = [dict(r) for r in bench if r["source"] == "llmadapt.micro" and r["status"] == "ok"]
    unsupported = [r for r in bench if r["status"] != "ok"]
    bw = peaks.get("memory_bytes_per_s")
    for r in ops:
        _roofline(r, peaks.get(f"flops_per_s.{r['dtype']}"), bw)
    comm = [r for r in records if r["type"] == "comm"]
    failures = [r for r in records if r["type"] == "failure"]
    worker_failed = any(f.get("rank") is not None for f in failures)
    if worker_failed:  # the worker's own record says more than the launcher's exit code
        failures = [f for f in failures if not (f.get("rank") is None and f["cause"] in ("crash", "killed"))]
    return MicroResult(run_dir=run_dir, suite=launch.suite, status="failed" if failures or not head else "ok",
                       device_name=device.get("name"), device_kind=device.get("kind"),
                       device_memory_bytes=device.get("memory_bytes"), world_size=launch.world_size,
                       peaks=peaks, ops=ops, peak_runs=peak_runs, comm=comm, unsupported=unsupported,
                       failures=failures)


def _roofline(r: dict[str, Any], peak: float | None, bw: float | None) -> None:
    """Arithmetic intensity, the bound, and the achieved fraction of the attainable roof."""
    flops, by = r["flops"], r["bytes"]
    r["intensity"] = flops / by if by else None
    if not peak or not bw or not r["seconds"]:
        r["bound"] = r["roof_fraction"] = None
        return
    t = r["seconds"]["p50"]
    attainable = min(peak, (flops / by) * bw) if (by and flops) else (peak if flops else None)
    if flops and attainable:
        r["bound"] = "compute" if attainable >= peak else "memory"
        r["roof_fraction"] = flops / t / attainable
    else:
        r["bound"] = "memory"
        r["roof_fraction"] = by / t / bw if by else None
