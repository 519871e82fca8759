"""Do multi-rank runs end well every time? The same workload N times in a row, counted by how each ended.

Races show under load, so ``--load`` runs the same configuration in a second process, in a loop,
for as long as the measured series lasts (its runs are not counted). Each measured run ends as one of:

- ok: every rank finished and the launcher saw nothing go wrong;
- teardown: complete (every rank wrote its end record) but something went wrong after it (the
  summary's warnings say what; nothing measured was lost);
- failed: the run did not complete (the failures' first line says why).

    python benchmarks/repeat.py torch deepspeed megatron colossalai --times 50 --load
    python benchmarks/repeat.py torch-moe megatron-moe --times 20 --load --json
    python benchmarks/repeat.py torch --smoke         # one run (CI's smoke pass)

Configurations (the standard tiny workloads of llmadapt.testing, two ranks each): see CONFIGS.
Not a test: it prints counts and asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {  # name: (adapter, standard workload, overrides)
    "torch": ("torch", "train", ["parallelism.dp=2"]),
    "deepspeed": ("deepspeed", "train", ["parallelism.dp=2", "optimizations.zero_stage=2"]),
    "megatron": ("megatron", "train", ["parallelism.tp=2"]),
    "colossalai": ("colossalai", "train", ["parallelism.dp=2"]),
    "torch-moe": ("torch", "moe", ["parallelism.dp=2"]),
    "megatron-moe": ("megatron", "moe", ["parallelism.dp=2", "parallelism.ep=2"]),
    "deepspeed-moe": ("deepspeed", "moe", ["parallelism.dp=2"]),
}


def workload_of(name: str):
    from llmadapt.testing import standard_workloads

    adapter, base, overrides = CONFIGS[name]
    return adapter, standard_workloads()[base].with_overrides(overrides)


def outcome(result) -> tuple[str, str]:
    s = result.summary
    if s.status != "ok":
        first = s.failures[0] if s.failures else None
        return "failed", f"{first.cause}: {first.message[:160]}" if first else "no failure record"
    if s.warnings:
        return "teardown", s.warnings[0][:160]
    return "ok", ""


def _load_loop(name: str, out: str, stop) -> None:
    from llmadapt import run

    adapter, workload = workload_of(name)
    while not stop.is_set():
        try:
            run(workload, adapter, out=out, timeout=600)
        except Exception:  # noqa: BLE001 - the load only has to keep the machine busy
            time.sleep(1)


def series(name: str, times: int, out: Path, load: bool, log) -> dict:
    from llmadapt import run

    adapter, workload = workload_of(name)
    stop = multiprocessing.Event()
    loader = None
    if load:
        loader = multiprocessing.Process(target=_load_loop, args=(name, str(out / "load"), stop), daemon=True)
        loader.start()
    counts: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    started = time.monotonic()
    try:
        for i in range(times):
            result = run(workload, adapter, out=out / "measured", timeout=600)
            kind, why = outcome(result)
            counts[kind] += 1
            if why:
                reasons[f"{kind}: {why}"] += 1
            log(f"{name} {i + 1}/{times}: {kind}{' - ' + why if why else ''}")
    finally:
        stop.set()
        if loader:
            loader.join(700)
    return {"config": name, "adapter": adapter, "times": times, "load": load, "ok": counts["ok"],
            "teardown": counts["teardown"], "failed": counts["failed"], "reasons": dict(reasons),
            "wall_s": round(time.monotonic() - started, 1), "loadavg_end": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+", choices=sorted(CONFIGS), metavar="CONFIG",
                        help=f"one or more of: {', '.join(CONFIGS)}")
    parser.add_argument("--times", type=int, default=20, help="measured runs per configuration (default 20)")
    parser.add_argument("--load", action="store_true", help="run the same configuration beside, in a loop")
    parser.add_argument("--out", help="folder for the run folders (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size: one measured run per configuration (unless --times is given); shows "
                             "that the script works; its counts mean little")
    args = parser.parse_args()
    if args.smoke:  # its sizes become the defaults: flags given explicitly still count
        parser.set_defaults(times=1)
        args = parser.parse_args()
    if args.times < 1:
        parser.error("--times must be at least 1")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="llmadapt-repeat-"))
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    rows = [series(name, args.times, out / name, args.load, log) for name in args.configs]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'config':<14} {'runs':>5} {'ok':>5} {'teardown':>9} {'failed':>7} {'wall s':>8}  load")
    for r in rows:
        print(f"{r['config']:<14} {r['times']:>5} {r['ok']:>5} {r['teardown']:>9} {r['failed']:>7} {r['wall_s']:>8}  "
              f"{'same config beside' if r['load'] else 'none'}")
        for why, n in r["reasons"].items():
            print(f"    {n} x {why}")


if __name__ == "__main__":
    main()
