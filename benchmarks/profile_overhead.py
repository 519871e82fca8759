"""The cost of looking: the measured loop's own fixed cost per step, telemetry's, and profiling's.

Three measurements, each side by side in one process (launcher inline, one rank, 1 torch thread):

1. The loop's fixed cost. The reference adapter's ``step`` is replaced by one that spins on the CPU for a set
   time (10 ms, 100 ms, 1 s) and returns what the real one returns (loss, three phases); everything else is
   llmadapt's loop as it runs: the batch built, the device synchronised, the clock read, memory reset and read,
   the step record written and flushed, telemetry drained. From the records: inside the clock, a step's time
   less the spin; between steps, the gap from one step's end to the next one's start, less the batch (the
   ``data`` phase: a bare loop needs its batches too, so it is reported beside the fixed cost, not in it); a
   bare ``for`` loop calling the same spin gives the floor. Fixed cost = between (less the batch and the
   floor) + inside. Medians over the steps: a preemption by another process moves a mean by more than the
   loop costs. Telemetry is off here (interval 0) so that (3) can price it alone.
2. Profiling: the real tiny-llama step, profiled (levels module and operator) against unprofiled steps of the
   same run (the profiler's cost on the operators it records; its start and stop are outside the clock).
3. Telemetry: the real tiny-llama step with the sampler off, at its default interval (0.5 s) and at 0.05 s,
   runs alternated ABBA; and the cost of one sample, timed directly, times the samples per step.

    python benchmarks/profile_overhead.py             # about 3 minutes
    python benchmarks/profile_overhead.py --json
    python benchmarks/profile_overhead.py --smoke     # each measurement at its smallest: seconds (CI's smoke pass)

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

    cpu_marks = []  # this thread's CPU time as each step's work begins and ends

    def work() -> None:
        """The step's work and the benchmark's own CPU-time marks: the bare loop below runs the same, so the
        marks (two clock syscalls) are not counted as the loop's cost."""
        begin = time.thread_time()
        spin(step_s)
        cpu_marks.append((begin, time.thread_time()))

    def fixed_step(self, batch):
        work()  # what a step reports (llmadapt's contract) is built inside the clock, so it counts as the loop's
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
    # Medians over the steps: a preemption by another process lands on a few steps and would move a mean
    # by far more than the loop costs (on a busy 2-core machine, a 10 ms step's mean by hundreds of us).
    marks, llmadapt_marks = [], cpu_marks[:]
    for _ in range(len(measured)):
        work()
        marks.append(time.perf_counter())
    cpu_marks[:] = llmadapt_marks
    bare = statistics.median(b - a - step_s for a, b in zip(marks, marks[1:]))  # the bare loop's own, per step
    # Inside the clock, beyond what the bare loop pays around the same work: the call, the StepResult the step
    # returns, synchronising and the clock reads.
    inside = statistics.median(r["seconds"] for r in measured) - step_s - bare
    gaps = [(b["start_ns"] - a["end_ns"]) / 1e9 for a, b in zip(measured, measured[1:])]  # between two steps
    # The batch is built between steps too (the data phase): a bare loop needs its batches as well, so it is
    # reported beside the fixed cost, not in it.
    data = [next(p["seconds"] for p in b["phases"] if p["name"] == "data") for b in measured[1:]]
    between = statistics.median(gaps)
    fixed = statistics.median(g - d for g, d in zip(gaps, data)) + inside
    # The same in CPU time, which another process's load does not stretch: this thread's CPU from one step's
    # work ending to the next one's beginning (the loop around it), less the CPU a batch takes built alone.
    cpu_loop = statistics.median(b[0] - a[1] for a, b in zip(cpu_marks[1:], cpu_marks[2:]))
    from llmadapt.runtime.data import TokenData

    data_source, batch_cpu = TokenData(workload, None), []
    for i in range(len(measured)):
        begin = time.thread_time()
        data_source.step_batch(i, 0, 1)
        batch_cpu.append(time.thread_time() - begin)
    cpu_fixed = cpu_loop - statistics.median(batch_cpu)
    # A control for the machine, not the loop: one fixed piece of the loop's own code (a step record built and
    # encoded, no I/O) timed right after the same work, and again in a tight loop. Their ratio is what a step of
    # this length does to any code that runs after it (caches and predictors cold: on a virtual machine the host
    # runs others between our instructions); the loop's fixed cost grows with the step by about as much.
    after_work, warm = [], []
    for i in range(len(measured)):
        work()
        begin = time.perf_counter_ns()
        _reference_block(measured[0])
        after_work.append(time.perf_counter_ns() - begin)
    for _ in range(200):
        begin = time.perf_counter_ns()
        _reference_block(measured[0])
        warm.append(time.perf_counter_ns() - begin)
    cpu_marks[:] = llmadapt_marks
    cold_us, warm_us = statistics.median(after_work) / 1e3, statistics.median(warm) / 1e3
    return {"step_s": step_s, "steps": len(measured), "cpu_fixed_us": cpu_fixed * 1e6,
            "control_after_step_us": cold_us, "control_warm_us": warm_us, "control_ratio": cold_us / warm_us,
            "cpu_batch_us": statistics.median(batch_cpu) * 1e6, "between_us": between * 1e6,
            "data_us": statistics.median(data) * 1e6, "inside_clock_us": inside * 1e6, "bare_us": bare * 1e6,
            "fixed_us": fixed * 1e6, "fixed_percent": 100 * fixed / step_s}


def _reference_block(step: dict) -> str:
    """The control's fixed work: the loop's step record, built and encoded as the worker does (no write)."""
    from llmadapt.contract.records import Phase, Step
    from llmadapt.contract.schema import to_json_line

    return to_json_line(Step(rank=0, step=step["step"], warmup=False, start_ns=step["start_ns"],
                             end_ns=step["end_ns"], seconds=step["seconds"], tokens=step["tokens"],
                             samples=step["samples"], loss=step["loss"],
                             phases=[Phase(p["name"], p["seconds"], p["source"]) for p in step["phases"]]))


# The real step's shape for (2) and (3); --smoke makes every run its smallest (the figures then mean little).
SHAPE = ["train.seq_len=128", "train.global_batch=16", "train.warmup_steps=3"]
PROFILED = ["train.steps=12", "profile.steps=[5,8,11]"]
TELEMETRY_STEPS = 40
LOOPS = [(0.010, 200), (0.100, 40), (1.0, 6)]  # (spin per step, steps)
SMOKE_SHAPE = ["train.seq_len=16", "train.global_batch=2", "train.micro_batch=1", "train.warmup_steps=1"]
SMOKE_PROFILED = ["train.steps=3", "profile.steps=[2]"]
SMOKE_TELEMETRY_STEPS = 3
SMOKE_LOOPS = [(0.010, 5)]


def profiled_cost(level: str, out: Path, shape: list[str] = SHAPE, profiled: list[str] = PROFILED) -> dict:
    import llmadapt

    workload = llmadapt.Workload.from_file(WORKLOAD).with_overrides(
        [*shape, *profiled, f"profile.level={level}", "telemetry.interval_s=0"])
    result = llmadapt.run(workload, "torch", launcher="inline", out=out)
    steps = [json.loads(line) for line in (result.run_dir / "rank-00000.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["type"] == "step" and not r["warmup"]]
    profiled = statistics.median(r["seconds"] for r in steps if r["profiled"])
    plain = statistics.median(r["seconds"] for r in steps if not r["profiled"])
    return {"level": level, "profiled_step_s": profiled, "plain_step_s": plain, "ratio": profiled / plain}


def telemetry_cost(rounds: int, out: Path, shape: list[str] = SHAPE, steps: int = TELEMETRY_STEPS) -> dict:
    import llmadapt
    from llmadapt.runtime.telemetry import Sampler

    sampler = Sampler(0, 0.5, None)
    start = time.perf_counter()
    for _ in range(2000):
        sampler.sample()
    sample_us = (time.perf_counter() - start) / 2000 * 1e6

    def median_step(interval: float) -> float:
        workload = llmadapt.Workload.from_file(WORKLOAD).with_overrides(
            [*shape, f"train.steps={steps}", f"telemetry.interval_s={interval}"])
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
    p.add_argument("--smoke", action="store_true",
                   help="the smallest size: the loop's cost at 10 ms for 5 steps, profiling and telemetry on a "
                        "seq-16 step for 3 steps, one telemetry round (unless --rounds is given); shows that the "
                        "script works, in seconds; its figures mean little")
    args = p.parse_args(argv)
    if args.smoke:  # its sizes become the defaults: flags given explicitly still count
        p.set_defaults(rounds=1)
        args = p.parse_args(argv)
    shape, profiled, loop_sizes, telemetry_steps = ((SMOKE_SHAPE, SMOKE_PROFILED, SMOKE_LOOPS, SMOKE_TELEMETRY_STEPS)
                                                    if args.smoke else (SHAPE, PROFILED, LOOPS, TELEMETRY_STEPS))

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        loops = [loop_cost(step_s, steps, out) for step_s, steps in loop_sizes]
        profiles = [profiled_cost(level, out, shape, profiled) for level in ("module", "operator")]
        telemetry = telemetry_cost(args.rounds, out, shape, telemetry_steps)
    report = {"loop": loops, "profile": profiles, "telemetry": telemetry}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("the loop's cost per step, telemetry off (medians over the steps; fixed = between steps less the batch "
          "and the bare loop's own, plus inside the clock)")
    print(f"{'step':>8} {'steps':>6} {'between us':>11} {'batch us':>9} {'bare us':>8} {'in clock us':>12} "
          f"{'fixed us':>9} {'fixed/step':>11} {'fixed CPU us':>13} {'batch CPU us':>13}")
    for r in loops:
        print(f"{r['step_s'] * 1e3:>6.0f}ms {r['steps']:>6} {r['between_us']:>11.0f} {r['data_us']:>9.0f} "
              f"{r['bare_us']:>8.1f} {r['inside_clock_us']:>12.1f} {r['fixed_us']:>9.0f} {r['fixed_percent']:>10.2f}% "
              f"{r['cpu_fixed_us']:>13.0f} {r['cpu_batch_us']:>13.0f}")
    print("fixed CPU: this thread's CPU time around the step, less a batch's, by CPU clock (not stretched by other "
          "processes' load)")
    print("control (the machine, not the loop): one step record built and encoded right after a step's work "
          "against the same in a tight loop")
    for r in loops:
        print(f"{r['step_s'] * 1e3:>6.0f}ms  after the step {r['control_after_step_us']:6.1f} us, warm "
              f"{r['control_warm_us']:5.1f} us: x{r['control_ratio']:.1f}")
    size = "seq 16, batch 2 (smoke)" if args.smoke else "seq 128, batch 16"
    print(f"\nprofiling (tiny-llama, {size}): profiled step / unprofiled step, medians of one run")
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
