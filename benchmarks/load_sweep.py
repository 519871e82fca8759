"""The SLA search's cost in probes against a plain scan, and the load generator's send lag at every point of a
sweep, on a real engine.

1. Probes (no engine: the search's own logic, llmadapt.experiments.loadsweep.sla_search, driven by a simulated engine
   whose TTFT p99 is known): for capacities spread over two decades, smooth (latency proportional to load) and
   cliff-shaped (flat, then 50x past the capacity), the probes the search spends (exponential probe, bisection to
   --resolution, --repeats at the answer) against a plain scan at the same resolution from the same start up to
   the first failing load (plus the same repeats): what vLLM's evenly spaced `bench sweep` scan and any
   exhaustive table pay for the same answer.
2. A rate sweep against the engine (default the reference server, `hf`; `--engine vllm`, `--engine llamacpp`), started once: per point
   the offered and achieved rate, TTFT and TPOT p99, and the p99 send lag (how late the generator sent,
   against its schedule), then a real SLA search over concurrency (--slo, default TTFT p99 <= 100 ms, up to --max
   64) with its probes and the scan it saved.

    python benchmarks/load_sweep.py                      # about 3 minutes on 2 cores with hf
    python benchmarks/load_sweep.py --engine vllm --json
    python benchmarks/load_sweep.py --smoke              # one rate of 4 requests, concurrency up to 2 (CI)

Not a test: it prints figures and asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def simulated(resolution: float, repeats: int) -> list[dict]:
    from unittest import mock

    from llmadapt.experiments import loadsweep
    from llmadapt.spec import Workload

    class Info:
        name = "simulated"

    out = []
    for shape in ("smooth", "cliff"):
        for capacity in (1.7, 3.3, 7.3, 15.5, 42.0, 130.0):
            def ttft(load: float) -> float:
                return 730.0 * load / capacity if shape == "smooth" else (100.0 if load < capacity else 5000.0)

            def run_points(workload, info, out_dir, engine_dir, timeout, progress, choose):
                done, ran = [], []
                while (pick := choose(done)) is not None:
                    done.append(pick[0].value)
                    ran.append((pick[0], pick[1], pick[0].value))
                return ran

            figures = lambda load: {"status": "ok", "failed": 0, "valid": True, "ttft_p99_ms": ttft(load)}  # noqa: E731
            with mock.patch.object(loadsweep, "_run_points", run_points), \
                    mock.patch.object(loadsweep, "point_figures", figures), tempfile.TemporaryDirectory() as tmp:
                _, r = loadsweep.sla_search(Workload(kind="serve"), Info(), [loadsweep.Objective.parse(
                    "ttft_p99_ms<=730")], "rate", Path(tmp), start=1.0, maximum=1024.0, resolution=resolution,
                    repeats=repeats)
            out.append({"shape": shape, "capacity": capacity, "found": r.capacity, "fails_at": r.above,
                        "boundary": r.boundary, "called": r.shape, "probes": len(r.probes), "scan": r.scan_probes})
    return out


def real(engine: str, rates: str, requests: int, slo: str, maximum: int) -> dict:
    from llmadapt.experiments.loadsweep import Objective, load_sweep, parse_loads, prepared, sla_search
    from llmadapt.spec import Workload

    w = Workload.from_file(ROOT / "examples" / "serve-tiny.toml").with_overrides(
        [f"serve.requests={requests}", "serve.warmup_requests=2"]
        + (["model.hidden_size=128"] if engine in ("vllm", "llamacpp") else []))
    info, w = prepared(w, engine)
    out = Path(tempfile.mkdtemp(prefix="llmadapt-load-sweep-"))
    _, points = load_sweep(w, info, parse_loads(rates, "rate"), out)
    sweep = [{"offered": p.load.value, "achieved": p.figures.get("request_throughput"),
              "ttft_p99_ms": p.figures.get("ttft_p99_ms"), "tpot_p99_ms": p.figures.get("tpot_p99_ms"),
              "send_lag_p99_ms": p.figures.get("send_lag_p99_ms"), "valid": p.figures.get("valid")} for p in points]
    _, r = sla_search(w, info, [Objective.parse(slo)], "concurrency", out, start=1, maximum=maximum)
    return {"engine": engine, "sweep": sweep, "sla": {"slo": slo, "maximum": maximum,
        "capacity": r.capacity, "fails_at": r.above, "boundary": r.boundary, "shape": r.shape,
        "probes": [(p.phase, p.load, round(p.margin, 3)) for p in r.probes], "scan": r.scan_probes}, "out": str(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="hf")
    ap.add_argument("--rates", default="1,2,4,8,16,32")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--resolution", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--slo", default="ttft_p99_ms<=100", help="the real SLA search's objective")
    ap.add_argument("--max", type=int, default=64, help="the real SLA search's highest concurrency")
    ap.add_argument("--no-engine", action="store_true", help="only the simulated probe counts")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest size of the real part: one rate (4 req/s) of 4 requests, the SLA search up to "
                         "concurrency 2 (flags given explicitly still count; the simulated part is kept whole: it "
                         "takes a second); shows that the script works; its figures mean little")
    args = ap.parse_args()
    if args.smoke:  # its sizes become the defaults: flags given explicitly still count
        ap.set_defaults(rates="4", requests=4, max=2)
        args = ap.parse_args()
    result = {"simulated": simulated(args.resolution, args.repeats)}
    if not args.no_engine:
        result["real"] = real(args.engine, args.rates, args.requests, args.slo, args.max)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"SLA search vs a plain scan at {args.resolution:.0%} resolution, {args.repeats} probes at the answer "
          "(simulated engine, TTFT p99 <= 730 ms):")
    print(f"{'shape':<7} {'capacity':>8} {'found':>7} {'fails at':>8} {'boundary':>8} {'called':>7} {'probes':>6} "
          f"{'scan':>5}")
    for s in result["simulated"]:
        print(f"{s['shape']:<7} {s['capacity']:>8g} {s['found']:>7.3g} {s['fails_at']:>8.3g} {s['boundary']:>8.3g} "
              f"{s['called']:>7} {s['probes']:>6} {s['scan']:>5}")
    total = sum(s["probes"] for s in result["simulated"]), sum(s["scan"] for s in result["simulated"])
    print(f"in all: {total[0]} probes against {total[1]} ({total[0] / total[1]:.0%})")
    if "real" in result:
        r = result["real"]
        print(f"\nrate sweep on {r['engine']} ({args.requests} requests per point; runs in {r['out']}):")
        print(f"{'offered':>8} {'achieved':>8} {'TTFT p99':>9} {'TPOT p99':>9} {'send lag p99':>12}  valid")
        for p in r["sweep"]:
            print(f"{p['offered']:>8g} {p['achieved']:>8.2f} {p['ttft_p99_ms']:>9.1f} {p['tpot_p99_ms']:>9.1f} "
                  f"{p['send_lag_p99_ms']:>10.2f} ms  {p['valid']}")
        s = r["sla"]
        print(f"\nSLA search over concurrency ({s['slo']}, up to {s['maximum']}): capacity {s['capacity']}, fails at "
              f"{s['fails_at']}, boundary {s['boundary'] and round(s['boundary'], 2)} ({s['shape']}); "
              f"{len(s['probes'])} probes, a scan would take {s['scan']}")
        print("probes: " + ", ".join(f"{ph} {load:g} ({m:+.2f})" for ph, load, m in s["probes"]))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
