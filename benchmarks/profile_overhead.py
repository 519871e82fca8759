"""The cost of looking: the measured loop's own fixed cost per step, telemetry's, and profiling's.

Three measurements, each side by side in one process (launcher inline, one rank, 1 torch thread):

1. The loop's fixed cost. The reference adapter's ``step`` is replaced by one that spins on the CPU for a set
   time (10 ms, 100 ms, 1 s) and returns what the real one returns (loss, three phases); everything else is
   llmadapt's loop as it runs: the batch built, the device synchronised, the clock read, memory reset and read,
   the step record written and flushed, telemetry drained. Its cost per step is the loop's wall time (first
   step's start to last step's end, from the records) over the steps, less the spin; a bare ``for`` loop calling
   the same spin gives the floor. Telemetry is off here (interval 0) so that (3) can price it alone.
2. Profiling: the real tiny-llama step, profiled (levels module and operator) against unprofiled steps of the
   same run (the profiler's cost on the operators it records; its start and stop are outside the clock).
3. Telemetry: the real tiny-llama step with the sampler off, at its default interval (0.5 s) and at 0.05 s,
   runs alternated ABBA; and the cost of one sample, timed directly, times the samples per step.

    python benchmarks/profile_overhead.py             # about 3 minutes
    python benchmarks/profile_overhead.py --json

Not a test: it prints figures and asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "examples" / "tiny-llama.toml"


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def loop_cost(step_s: float, steps: int, out: Path) -> dict:
    """llmadapt's loop around a fixed step against a bare loop around the same step."""
    import llmadapt
    from llmadapt.adapter import StepResult
    from llmadapt.contract.records import Phase
    from llmadapt.reference.trainer import TorchTrainer

    def fixed_step(self, batch):
        spin(step_s)
        return StepResult(loss=1.0, phases=[Phase("forward", step_s / 3, "llmadapt"),
                                            Phase("backward", step_s / 2, "llmadapt"),
                                            Phase("optimizer", step_s / 6, "llmadapt")])

    workload = llmadapt.Workload.from_file(WORKLOAD).with_overrides(
        [f"train.steps={steps}", "train.warmup_steps=1", "telemetry.interval_s=0"])
    real_step = TorchTrainer.step
    TorchTrainer.step = fixed_step
    try:
        result = llmadapt.run(workload, "torch", launcher="inline", out=out)
    finally:
        TorchTrainer.step = real_step
    records = [json.loads(line) for line in (result.run_dir / "rank-00000.jsonl").read_text().splitlines()]
    measured = [r for r in records if r["type"] == "step" and not r["warmup"]]
    wall = (measured[-1]["end_ns"] - measured[0]["start_ns"]) / 1e9
    inside = statistics.mean(r["seconds"] for r in measured) - step_s  # synchronise and clock reads
    per_step = wall / len(measured) - step_s  # ... plus everything between steps (the last one's tail aside)
    # The batch is built between steps too (the data phase): a bare loop needs its batches as well, so it is
    # reported beside the fixed cost, not in it.
    data = statistics.mean(p["seconds"] for r in measured for p in r["phases"] if p["name"] == "data")
    start = time.perf_counter()
    for _ in range(len(measured)):
        spin(step_s)
    bare = (time.perf_counter() - start) / len(measured) - step_s
    fixed = per_step - data - bare
    return {"step_s": step_s, "steps": len(measured), "loop_us": per_step * 1e6, "data_us": data * 1e6,
            "inside_clock_us": inside * 1e6, "bare_us": bare * 1e6, "fixed_us": fixed * 1e6,
            "fixed_percent": 100 * fixed / step_s}


def profiled_cost(level: str, out: Path) -> dict:
    import llmadapt

    workload = llmadapt.Workload.from_file(WORKLOAD).with_overrides(
        ["train.seq_len=128", "train.global_batch=16", "train.warmup_steps=3", "train.steps=12",
         "profile.steps=[5,8,11]", f"profile.level={level}", "telemetry.interval_s=0"])
    result = llmadapt.run(workload, "torch", launcher="inline", out=out)
    steps = [json.loads(line) for line in (result.run_dir / "rank-00000.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["type"] == "step" and not r["warmup"]]
    profiled = statistics.median(r["seconds"] for r in steps if r["profiled"])
    plain = statistics.median(r["seconds"] for r in steps if not r["profiled"])
    return {"level": level, "profiled_step_s": profiled, "plain_step_s": plain, "ratio": profiled / plain}


def telemetry_cost(rounds: int, out: Path) -> dict:
    import llmadapt
    from llmadapt.runtime.telemetry import Sampler

    sampler = Sampler(0, 0.5, None)
    start = time.perf_counter()
    for _ in range(2000):
        sampler.sample()
    sample_us = (time.perf_counter() - start) / 2000 * 1e6

    def median_step(interval: float) -> float:
        workload = llmadapt.Workload.from_file(WORKLOAD).with_overrides(
            ["train.seq_len=128", "train.global_batch=16", "train.warmup_steps=3", "train.steps=40",
             f"telemetry.interval_s={interval}"])
        result = llmadapt.run(workload, "torch", launcher="inline", out=out)
        return result.summary.step_time_s.p50

    runs: dict[float, list[float]] = {0.0: [], 0.5: [], 0.05: []}
    order = [0.0, 0.5, 0.05]
    for i in range(rounds):
        for interval in (order if i % 2 == 0 else order[::-1]):  # ABBA: drift cancels
            runs[interval].append(median_step(interval))
    off = statistics.median(runs[0.0])
    return {
        "sample_us": sample_us, "step_s_off": off,
        "ratio_default_0.5s": statistics.median(runs[0.5]) / off,
        "ratio_0.05s": statistics.median(runs[0.05]) / off,
        "computed_percent_default": 100 * sample_us * 1e-6 / 0.5,  # share of wall time one sampler takes
        "computed_percent_0.05s": 100 * sample_us * 1e-6 / 0.05,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="telemetry: runs of each interval, alternated (default 4)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        loops = [loop_cost(0.010, 200, out), loop_cost(0.100, 40, out), loop_cost(1.0, 6, out)]
        profiles = [profiled_cost(level, out) for level in ("module", "operator")]
        telemetry = telemetry_cost(args.rounds, out)
    report = {"loop": loops, "profile": profiles, "telemetry": telemetry}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("the loop's cost per step, telemetry off (fixed = between and around steps, less the batch and the "
          "bare loop's own)")
    print(f"{'step':>8} {'steps':>6} {'loop us':>8} {'batch us':>9} {'bare us':>8} {'fixed us':>9} "
          f"{'in clock us':>12} {'fixed/step':>11}")
    for r in loops:
        print(f"{r['step_s'] * 1e3:>6.0f}ms {r['steps']:>6} {r['loop_us']:>8.0f} {r['data_us']:>9.0f} "
              f"{r['bare_us']:>8.1f} {r['fixed_us']:>9.0f} {r['inside_clock_us']:>12.1f} {r['fixed_percent']:>10.2f}%")
    print("\nprofiling (tiny-llama, seq 128, batch 16): profiled step / unprofiled step, medians of one run")
    for r in profiles:
        print(f"  level {r['level']:<9} {r['profiled_step_s'] * 1e3:8.1f} ms / {r['plain_step_s'] * 1e3:6.1f} ms "
              f"= {r['ratio']:.2f}")
    t = telemetry
    print(f"\ntelemetry: one sample {t['sample_us']:.1f} us (procfs); at 0.5 s {t['computed_percent_default']:.4f}% "
          f"of wall time, at 0.05 s {t['computed_percent_0.05s']:.3f}%")
    print(f"  median step with the sampler / without (median of {args.rounds} runs each, ABBA): default 0.5 s "
          f"{t['ratio_default_0.5s']:.3f}, 0.05 s {t['ratio_0.05s']:.3f} (off: {t['step_s_off'] * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
