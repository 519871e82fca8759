"""llmadapt's kernel-basis breakdown beside Holistic Trace Analysis's on the same real GPU traces.

For each trace in ../shared/data/kineto-gpu (or the files given), prints one Markdown table row per tool: the
kernel span, idle, compute and non-compute time (HTA's temporal breakdown), the communication-computation
overlap, and HTA's kernel-type split (computation, communication, memory alone; the rest overlapping). llmadapt's
figures are on the trace as recorded; HTA rounds fractional microseconds (starts up, ends down), which is the
whole of the difference (tests/test_traces.py asserts both). Needs HTA's environment: `llmadapt env create hta`.

    .venv/bin/python benchmarks/hta_crosscheck.py [TRACE ...] [--json]
    .venv/bin/python benchmarks/hta_crosscheck.py --smoke      # the smallest trace alone (CI's smoke pass)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from llmadapt.experiments.hta import hta_of_traces
from llmadapt.analysis.traces import read_trace, trace_breakdown

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto-gpu"


def ours(path: Path) -> dict[str, float | None]:
    b = trace_breakdown(read_trace(path))
    types = {t.name: t.seconds * 1e3 for t in b.kernel_types}
    return {"span_ms": b.step_seconds * 1e3, "idle_ms": b.idle_seconds * 1e3, "compute_ms": b.compute_seconds * 1e3,
            "non_compute_ms": (b.step_seconds - b.idle_seconds - b.compute_seconds) * 1e3,
            "overlap_pct": 100 * b.overlapped_comm_seconds / b.comm_seconds if b.comm_seconds else None,
            "computation_ms": types.get("computation", 0.0), "communication_ms": types.get("communication", 0.0),
            "memory_ms": types.get("memory", 0.0)}


def theirs(result: dict) -> dict[str, float | None]:
    (t,) = result["temporal_breakdown"]
    (o,) = result["comm_comp_overlap"]
    types = {row["kernel_type"]: row["sum"] / 1e3 for row in result["kernel_type_breakdown"]}
    pctg = o["comp_comm_overlap_pctg"]
    return {"span_ms": t["kernel_time(us)"] / 1e3, "idle_ms": t["idle_time(us)"] / 1e3,
            "compute_ms": t["compute_time(us)"] / 1e3, "non_compute_ms": t["non_compute_time(us)"] / 1e3,
            "overlap_pct": None if pctg is None or math.isnan(pctg) else pctg,
            "computation_ms": types.get("COMPUTATION", 0.0), "communication_ms": types.get("COMMUNICATION", 0.0),
            "memory_ms": types.get("MEMORY", 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path, help=f"trace files (default: {DATA}/*.json.gz)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size: of the default traces, the smallest file alone (traces named still "
                             "count); shows that the script works, in seconds")
    args = parser.parse_args()
    files = args.traces or sorted(DATA.glob("*.json.gz"))
    if not files:
        raise SystemExit(f"no traces: {DATA} is absent and none were named")
    if args.smoke and not args.traces:
        files = [min(files, key=lambda f: f.stat().st_size)]
    rows = [{"trace": f.name, "llmadapt": ours(f), "hta": theirs(h)} for f, h in zip(files, hta_of_traces(files))]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    keys = list(rows[0]["llmadapt"])
    print("| trace | tool | " + " | ".join(k.replace("_ms", " ms").replace("_pct", " %") for k in keys) + " |")
    print("|---|---|" + "---:|" * len(keys))
    for row in rows:
        for tool in ("llmadapt", "hta"):
            cells = ["-" if row[tool][k] is None else f"{row[tool][k]:.2f}" for k in keys]
            print(f"| {row['trace'].removesuffix('.json.gz') if tool == 'llmadapt' else ''} | {tool} | "
                  + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
