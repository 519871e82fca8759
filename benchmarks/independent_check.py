"""An independent check of llmadapt's operator classes: the same step profiled with nothing of llmadapt.

Two sides, each N separate processes, interleaved (round r: llmadapt's run r, then the bare run r) so that drift
of the machine hits both:

- llmadapt: ``llmadapt.run`` of the torch adapter on a workload (default examples/tiny-llama.toml) with
  ``profile.level = "operator"`` on the first measured steps, one rank, one thread (OMP_NUM_THREADS=1, which
  llmadapt's worker reads); the launcher is llmadapt's own (a worker process in the torch adapter's environment).
  Each profiled step's breakdown record (rank-00000.jsonl, type 'breakdown') holds ``operators``: seconds per
  operator class, from llmadapt's attribution (``llmadapt.runtime.profile.fold``).
- bare: this file run by the same environment's interpreter with ``--bare``: it imports torch and transformers
  only (it checks that no llmadapt module was loaded) and does by hand what the torch adapter's step does: the
  same checkpoint loaded by transformers with the workload's dtype and attention, AdamW with the workload's lr
  and weight decay, the same batches (written to a file by this process), zero_grad, the same loss (sum-reduced
  cross entropy times 1 / loss-bearing tokens of the global batch per micro-batch), backward, the gradients'
  total norm (the adapter records it every step), optimizer step (``bare_step``); the same warm-up steps unprofiled, then each profiled step under its own ``torch.profiler``
  session as llmadapt opens it (CPU activity, record_shapes and with_flops, Python's collector paused, the step
  in a ``ProfilerStep#N`` range, the profiler's results freed before the next step: kept alive, they cost the
  next profiled step thousands of page faults, docs/status.md). It writes every profiler event (name, thread,
  start, end, self CPU time, parent) to JSON, with each profiled step's page faults and wait for a core.

The analysis (``bare_operators``, run here after the bare process ends) maps each event's name to an
operator class with ``llmadapt.adapter.breakdown.operator_class``, the taxonomy (a pure function of the name:
what is checked here is llmadapt's attribution and accounting, not the name mapping), and sums the events' self
CPU time per class, with the rules of llmadapt's ``fold`` (docs/breakdown.md, "How time is attributed"), so
that both sides count the same thing:

- only events inside the step's range (the longest ``ProfilerStep`` event), on the threads that run the step
  (those with the step's range or an ``autograd::engine::evaluate_function`` event: the loop's and, where the
  engine runs one, the autograd engine's);
- left out of the operator classes, as fold leaves them out: the step's own range (``ProfilerStep*``: its own
  time is the Python between operators, in no operator), the autograd engine's wrapper around each backward node
  (``autograd::engine::evaluate_function: ...``: the engine's bookkeeping; the node's own time is its
  ``...Backward0`` event, class ``autograd``), and llmadapt's ranges (``llmadapt::``, none on the bare side);
- everything inside torch.optim's own ranges (``Optimizer.step#...``, ``Optimizer.zero_grad#...``), the ranges'
  own time included, is class ``optimizer``, as fold counts it (without that rule the ranges' own time would be
  ``framework_function`` and the optimizer's plain ATen operators ``elementwise``; the report gives the bare
  shares by name alone too).

Before any share is compared, the check asserts its own precondition: in every round both sides ran as many
operators of each class (``same_work``; it stops naming the classes whose counts differ). Each side's share of a
class is its seconds over the operator time of the run's profiled steps; the table gives
the median over runs of each side, the difference in points and whether it is within the tolerance (5 points).
The losses of the profiled steps are compared as a check that both sides did the same work (on the CPU they
agree exactly).

    python benchmarks/independent_check.py                    # 5 rounds, about 1 minute on 2 cores
    python benchmarks/independent_check.py --runs 9 --json figures.json
    python benchmarks/independent_check.py --smoke            # one round, one profiled step, not judged (CI)

Exit status 1 when a class differs by more than the tolerance, or when the two sides did not run the same
operators (the precondition, judged under --smoke too). Everything it writes is in a temporary folder
(or --keep DIR), and the --json file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Nothing of llmadapt (nor torch) at module level: the bare side runs this file with --bare.
REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = REPO / "examples" / "tiny-llama.toml"
TOLERANCE_POINTS = 5.0

STEP_RANGE = "ProfilerStep"  # torch.profiler's name for a step, the range llmadapt opens around a profiled step
EVALUATE = "autograd::engine::evaluate_function"  # the autograd engine's wrapper around a backward node
NOT_OPERATORS = ("llmadapt::", EVALUATE, STEP_RANGE)  # ranges and wrappers fold leaves out of operator classes
OPTIMIZER_RANGES = ("Optimizer.step#", "Optimizer.zero_grad#")  # torch.optim's own ranges


# -- the bare side: torch and transformers only ------------------------------------------------------------------
def bare_main(spec_path: str, out_path: str) -> int:
    """One bare run: warm-up steps, then each profiled step under its own profiler; events and losses to JSON."""
    import gc
    import resource

    spec = json.loads(Path(spec_path).read_text())
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    device = torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["precision"]]
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=dtype,
                                                 attn_implementation=spec["attention"]).to(device)
    model.config.use_cache = False
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[spec["optimizer"]]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = cls(params, lr=spec["lr"], weight_decay=spec["weight_decay"])
    batches = [{"loss_tokens_global": b["loss_tokens_global"],
                "micro_batches": [(torch.tensor(ids, dtype=torch.long), torch.tensor(lab, dtype=torch.long))
                                  for ids, lab in b["micro_batches"]]} for b in spec["batches"]]

    model.train()  # once, as the reference adapter does: train() walks every module

    def train_step(batch) -> float:
        return bare_step(model, optimizer, params, batch, spec["flash"])

    def run_delay() -> float | None:  # this thread's wait for a core so far (schedstat), as llmadapt reads it
        try:
            with open("/proc/thread-self/schedstat") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    profiled = set(spec["profiled_steps"])
    losses, steps = {}, []
    for step, batch in enumerate(batches):
        if step not in profiled:
            losses[step] = train_step(batch)
            continue
        gc.collect()
        gc.disable()
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True)
        prof.__enter__()
        mark = record_function(f"{STEP_RANGE}#{step}")
        mark.__enter__()
        waited, faults = run_delay(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        start = time.perf_counter()
        losses[step] = train_step(batch)
        seconds = time.perf_counter() - start
        after, faults = run_delay(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
        mark.__exit__(None, None, None)
        prof.__exit__(None, None, None)
        gc.enable()
        events = profiler_events(prof)
        del prof  # the profiler's results freed before the next step, as llmadapt frees them
        steps.append({"step": step, "seconds": seconds, "events": events, "minor_faults": faults,
                      "descheduled_seconds": after - waited if None not in (after, waited) else None})
    import transformers

    result = {"torch": torch.__version__, "transformers": transformers.__version__,
              "threads": torch.get_num_threads(), "python": sys.executable, "losses": losses, "steps": steps,
              "llmadapt_modules": sorted(m for m in sys.modules if m == "llmadapt" or m.startswith("llmadapt."))}
    Path(out_path).write_text(json.dumps(result))
    return 0


def bare_step(model, optimizer, params, batch, flash: bool) -> float:
    """One global step as the reference adapter's TorchTrainer.step does it, every operator included: zero_grad,
    per micro-batch forward (under the FlashAttention backend when asked), sum-reduced cross entropy scaled by
    1 / the global batch's loss-bearing tokens, backward; the gradients' total norm (the adapter records it each
    step); optimizer step; the loss and the norm read back."""
    from contextlib import nullcontext

    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    scale = 1 / batch["loss_tokens_global"]
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for ids, lab in batch["micro_batches"]:
        input_ids, labels = ids.to(device), lab.to(device)
        if flash:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        else:
            backend = nullcontext()
        with backend:
            logits = model(input_ids=input_ids).logits
            token_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                         ignore_index=-100, reduction="sum")
            (token_loss * scale).backward()
        loss_sum += token_loss.detach().double()
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    optimizer.step()
    grad_norm.item()
    return loss_sum.item() / batch["loss_tokens_global"]


def profiler_events(prof) -> list[dict]:
    """Every event of a finished torch.profiler session: id, name, thread, start_us, end_us, self_us, parent."""
    events = []
    for e in prof.events():
        parent = e.cpu_parent
        events.append({"id": e.id, "name": e.name, "thread": e.thread, "start_us": e.time_range.start,
                       "end_us": e.time_range.end, "self_us": e.self_cpu_time_total,
                       "parent": parent.id if parent is not None else None})
    return events


# -- the analysis: pure Python ------------------------------------------------------------------------------------
def bare_operators(events: list[dict], *, optimizer_ranges: bool = True) -> dict[str, list]:
    """[seconds, count] per operator class of one profiled step's events (dicts: id, name, thread, start_us,
    end_us, self_us, parent), with fold's rules (the module docstring): the step's range and threads, no ranges
    or engine wrappers, torch.optim's ranges as 'optimizer' (``optimizer_ranges``; else by name alone)."""
    from llmadapt.adapter.breakdown import operator_class

    marks = [e for e in events if e["name"].startswith(STEP_RANGE)]
    if marks:
        mark = max(marks, key=lambda e: e["end_us"] - e["start_us"])
        events = [e for e in events if e["start_us"] >= mark["start_us"] and e["end_us"] <= mark["end_us"]]
    threads = {e["thread"] for e in events if e["name"].startswith((STEP_RANGE, EVALUATE))}
    by_id = {e["id"]: e for e in events}

    def in_optimizer(e) -> bool:
        node = e
        while node is not None:
            if node["name"].startswith(OPTIMIZER_RANGES):
                return True
            node = by_id.get(node["parent"])
        return False

    classes: dict[str, list] = {}
    for e in events:
        if e["thread"] not in threads or e["name"].startswith(NOT_OPERATORS):
            continue
        cls = operator_class(e["name"])
        if optimizer_ranges and in_optimizer(e) and cls not in _COLLECTIVE_CLASSES:
            cls = "optimizer"
        entry = classes.setdefault(cls, [0.0, 0])
        entry[0] += e["self_us"] / 1e6
        entry[1] += 1
    return classes


_COLLECTIVE_CLASSES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv",
                       "other_collective")


def shares(seconds: dict[str, float]) -> dict[str, float]:
    """Each class's share of the operator time, in percent."""
    total = sum(seconds.values())
    return {k: 100 * v / total for k, v in seconds.items()} if total else {}


def add(into: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + v
    return into


def compare(llmadapt_runs: list[dict[str, float]], bare_runs: list[dict[str, float]],
            tolerance: float = TOLERANCE_POINTS) -> list[dict]:
    """Per class (every class either side saw): the median share of each side over its runs (a run without the
    class counts 0), the difference in points, and whether it is within the tolerance."""
    classes = {k for run in (*llmadapt_runs, *bare_runs) for k in run}
    rows = []
    for cls in classes:
        a = statistics.median(run.get(cls, 0.0) for run in llmadapt_runs)
        b = statistics.median(run.get(cls, 0.0) for run in bare_runs)
        rows.append({"class": cls, "llmadapt": a, "bare": b, "difference": a - b,
                     "within": abs(a - b) <= tolerance})
    return sorted(rows, key=lambda r: -max(r["llmadapt"], r["bare"]))


def same_work(llmadapt_runs: list[dict[str, float]], bare_runs: list[dict[str, float]]) -> None:
    """The check's precondition, before any share is compared: in every round both sides ran the same operators,
    as many of each class (a share of different work says nothing about the attribution). SystemExit naming
    each class whose counts differ, and the round, otherwise."""
    differ = []
    for r, (a, b) in enumerate(zip(llmadapt_runs, bare_runs, strict=True), 1):
        for cls in sorted(set(a) | set(b)):
            if int(a.get(cls, 0)) != int(b.get(cls, 0)):
                differ.append(f"{cls} (llmadapt {int(a.get(cls, 0))}, bare {int(b.get(cls, 0))}, round {r})")
    if differ:
        raise SystemExit("the two sides did not do the same work: operator counts differ for "
                         f"{'; '.join(differ)}; no share is compared")


def counts_by_class(runs: list[dict[str, float]]) -> dict[str, list[int]]:
    """Each class's operator count per run (the same every run when the work is the same)."""
    classes = sorted({k for run in runs for k in run})
    return {cls: [int(run.get(cls, 0)) for run in runs] for cls in classes}


# -- the two sides, driven from here -----------------------------------------------------------------------------
def workload_for(args):
    from llmadapt.spec import Workload

    w = Workload.from_file(args.workload)
    first = w.train.warmup_steps
    profiled = list(range(first, first + args.profiled_steps))
    w = w.with_overrides([f"train.steps={args.profiled_steps}", f"profile.steps={profiled}",
                          "profile.level=operator", "parallelism.dp=1", "telemetry.interval_s=0", *args.set])
    if w.world_size != 1:
        raise SystemExit(f"the check runs one rank; this workload needs {w.world_size}")
    return w


def bare_spec(w, threads: int) -> dict:
    from llmadapt.models import canonical_checkpoint
    from llmadapt.runtime.data import TokenData

    if w.lora.rank or w.optimizations.quantization != "none" or w.optimizations.recompute != "none" \
            or w.model.is_moe or w.data.packing or w.kind != "train":
        raise SystemExit("the bare side does a dense pre-training step only: no LoRA, quantization, recompute, MoE, "
                         "packing")
    data = TokenData(w)
    batches = []
    for step in range(w.train.total_steps):
        b = data.step_batch(step, 0, 1)
        batches.append({"loss_tokens_global": b.loss_tokens_global,
                        "micro_batches": [(mb.input_ids.tolist(), mb.labels.tolist()) for mb in b.micro_batches]})
    return {"checkpoint": str(canonical_checkpoint(w.model, w.seed)), "seed": w.seed, "precision": w.precision,
            "attention": "sdpa" if w.optimizations.flash_attention else "eager",
            "flash": w.optimizations.flash_attention, "optimizer": w.train.optimizer,
            "lr": w.train.lr, "weight_decay": w.train.weight_decay, "threads": threads,
            "profiled_steps": list(w.profile.steps), "batches": batches}


def run_llmadapt(w, out: Path) -> dict:
    import llmadapt
    from llmadapt.contract.readback import load_records

    t0 = time.perf_counter()
    result = llmadapt.run(w, "torch", out=out)
    wall = time.perf_counter() - t0
    if not result.ok:
        s = result.summary
        raise SystemExit(f"llmadapt run failed: {[f'{f.cause}: {f.message}' for f in s.failures]} ({result.run_dir})")
    records = load_records(result.run_dir)
    breakdowns = [r for r in records if r["type"] == "breakdown"]
    if len(breakdowns) != len(w.profile.steps) or any(b.get("error") for b in breakdowns):
        raise SystemExit(f"llmadapt run {result.run_dir}: breakdowns {[b.get('error') for b in breakdowns]}")
    seconds: dict[str, float] = {}
    counts: dict[str, float] = {}
    for b in breakdowns:
        add(seconds, {o["name"]: o["seconds"] for o in b["operators"]})
        add(counts, {o["name"]: o["count"] for o in b["operators"]})
    per_step = {b["step"]: {o["name"]: o["seconds"] for o in b["operators"]} for b in breakdowns}
    losses = {r["step"]: r["loss"] for r in records if r["type"] == "step" and r["profiled"]}
    return {"seconds": seconds, "counts": counts, "shares": shares(seconds), "wall_s": wall, "losses": losses,
            "seconds_per_step": per_step,
            "step_seconds": [b["step_seconds"] for b in breakdowns],
            "descheduled_seconds": [b.get("descheduled_seconds") for b in breakdowns], "run_dir": str(result.run_dir)}


def run_bare(python: Path, spec_file: Path, out: Path, env: dict) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([str(python), str(Path(__file__).resolve()), "--bare", str(spec_file), str(out)],
                          env=env, cwd=out.parent, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"bare run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if result["llmadapt_modules"]:
        raise SystemExit(f"the bare side loaded llmadapt: {result['llmadapt_modules'][:5]}")
    seconds: dict[str, float] = {}
    counts: dict[str, float] = {}
    by_name: dict[str, float] = {}
    step_seconds, per_step = [], {}
    for step in result["steps"]:
        classes = bare_operators(step["events"])
        per_step[step["step"]] = {cls: t for cls, (t, _) in classes.items()}
        for cls, (t, n) in classes.items():
            add(seconds, {cls: t})
            add(counts, {cls: n})
        add(by_name, {cls: t for cls, (t, _) in bare_operators(step["events"], optimizer_ranges=False).items()})
        mark = max((e for e in step["events"] if e["name"].startswith(STEP_RANGE)),
                   key=lambda e: e["end_us"] - e["start_us"])
        step_seconds.append((mark["end_us"] - mark["start_us"]) / 1e6)  # as fold reads the profiled step
    out.unlink()  # the events are large; the figures are kept
    return {"seconds": seconds, "counts": counts, "shares": shares(seconds), "shares_by_name": shares(by_name),
            "wall_s": wall, "losses": {int(k): v for k, v in result["losses"].items()}, "torch": result["torch"],
            "transformers": result["transformers"], "threads": result["threads"], "step_seconds": step_seconds,
            "seconds_per_step": per_step, "minor_faults": [s["minor_faults"] for s in result["steps"]],
            "descheduled_seconds": [s["descheduled_seconds"] for s in result["steps"]]}


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--bare":
        return bare_main(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs of each side, interleaved (default 5)")
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD),
                   help="workload file (default: examples/tiny-llama.toml)")
    p.add_argument("--profiled-steps", type=int, default=2,
                   help="profiled steps per run, the first measured ones (default 2); shares are over their sum")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="further workload overrides")
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default 1)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE_POINTS,
                   help=f"largest difference of a class's median share, in points (default {TOLERANCE_POINTS:g})")
    p.add_argument("--keep", metavar="DIR", help="keep llmadapt's run folders in DIR (default: a temporary folder)")
    p.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest size: one round, one profiled step (flags given explicitly still count); the "
                        "tolerance is reported, not judged (exit 0): one round is too noisy for it; shows that the "
                        "script works")
    args = p.parse_args(argv)
    if args.smoke:  # its sizes become the defaults: flags given explicitly still count
        p.set_defaults(runs=1, profiled_steps=1)
        args = p.parse_args(argv)

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # llmadapt's worker sets torch's threads from it
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ["LLMADAPT_DEVICE"] = "cpu"  # the bare side profiles the CPU basis: so does llmadapt's
    from llmadapt.adapter.plugins import get_adapter
    from llmadapt.launch.environments import python_for

    load_start = os.getloadavg()
    t_start = time.perf_counter()
    w = workload_for(args)
    python = python_for(get_adapter("torch").environment)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="llmadapt-independent-")
    out = Path(args.keep or tmp.name)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"llmadapt": [], "bare": []}
    loads = []
    try:
        spec_file = out / "bare-spec.json"
        spec_file.write_text(json.dumps(bare_spec(w, args.threads)))
        for r in range(args.runs):
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.runs}: llmadapt ...", file=sys.stderr, flush=True)
            runs["llmadapt"].append(run_llmadapt(w, out))
            print(f"round {r + 1}/{args.runs}: bare ...", file=sys.stderr, flush=True)
            runs["bare"].append(run_bare(python, spec_file, out / f"bare-{r}.json", env))
    finally:
        if tmp is not None:
            tmp.cleanup()
    load_end = os.getloadavg()

    same_work([x["counts"] for x in runs["llmadapt"]], [x["counts"] for x in runs["bare"]])
    rows = compare([x["shares"] for x in runs["llmadapt"]], [x["shares"] for x in runs["bare"]], args.tolerance)
    counts = {side: counts_by_class([x["counts"] for x in runs[side]]) for side in runs}
    for row in rows:  # operators counted per run: a difference is a difference of accounting, not of timing
        row["count_llmadapt"] = statistics.median(counts["llmadapt"].get(row["class"], [0]))
        row["count_bare"] = statistics.median(counts["bare"].get(row["class"], [0]))
    by_name = compare([x["shares"] for x in runs["llmadapt"]], [x["shares_by_name"] for x in runs["bare"]],
                      args.tolerance)
    loss_diff = max(abs(a["losses"][s] - b["losses"][s]) for a, b in zip(runs["llmadapt"], runs["bare"])
                    for s in a["losses"])
    bare0 = runs["bare"][0]
    median = lambda side, key: statistics.median(v for x in runs[side] for v in x[key] if v is not None)  # noqa: E731
    report = {
        "workload": w.label, "model": w.model.name, "seq_len": w.train.seq_len, "global_batch": w.train.global_batch,
        "micro_batch": w.train.micro_batch, "warmup_steps": w.train.warmup_steps,
        "profiled_steps": list(w.profile.steps),
        "runs": args.runs, "threads": args.threads, "bare_threads": sorted({x["threads"] for x in runs["bare"]}),
        "torch": bare0["torch"], "transformers": bare0["transformers"], "python": str(python),
        "tolerance_points": args.tolerance, "classes": rows, "classes_bare_by_name_only": by_name,
        "counts_per_run": counts,
        "within": all(r["within"] for r in rows),
        "loadavg_start": list(load_start), "loadavg_end": list(load_end), "loadavg_1min_per_round": loads,
        "max_loss_difference": loss_diff,
        "step_seconds_median": {side: median(side, "step_seconds") for side in runs},
        "descheduled_seconds_median": {side: median(side, "descheduled_seconds") for side in runs},
        "operator_seconds_median": {side: statistics.median(sum(x["seconds"].values()) for x in runs[side])
                                    for side in runs},
        "wall_per_run_s": {side: statistics.median(x["wall_s"] for x in runs[side]) for side in runs},
        "wall_total_s": time.perf_counter() - t_start,
        "per_run": {side: [{k: v for k, v in x.items() if k not in ("run_dir",)} for x in runs[side]]
                    for side in runs},
    }
    print(render(report))
    if args.smoke:
        print("--smoke: the tolerance is not judged (exit 0)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["within"] or args.smoke else 1


def render(r: dict) -> str:
    la = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        f"workload  {r['workload']} ({r['model']}): seq {r['seq_len']}, global batch {r['global_batch']} "
        f"(micro {r['micro_batch']}), {r['warmup_steps']} warm-up steps, profiled steps {r['profiled_steps']}",
        f"runs      {r['runs']} per side, interleaved; torch {r['torch']}, transformers {r['transformers']}, "
        f"{r['threads']} thread(s) (bare saw {r['bare_threads']})",
        f"load avg  start {la(r['loadavg_start'])}; end {la(r['loadavg_end'])}; 1-min before each round "
        f"{la(r['loadavg_1min_per_round'])}",
        "",
        f"{'operator class':<22} {'llmadapt %':>10} {'bare %':>8} {'diff pts':>9}  "
        f"{'within ' + format(r['tolerance_points'], 'g'):<8} {'operators llmadapt / bare':>25}",
    ]
    for row in r["classes"]:
        lines.append(f"{row['class']:<22} {row['llmadapt']:>10.2f} {row['bare']:>8.2f} {row['difference']:>+9.2f}  "
                     f"{'yes' if row['within'] else 'NO':<8} {row['count_llmadapt']:>12g} / {row['count_bare']:g}")
    ms = lambda d: f"llmadapt {d['llmadapt'] * 1e3:.2f} ms, bare {d['bare'] * 1e3:.2f} ms"  # noqa: E731
    worst = max(r["classes_bare_by_name_only"], key=lambda row: abs(row["difference"]))
    lines += [
        "",
        f"operator time per run (median)   {ms(r['operator_seconds_median'])}",
        f"profiled step (median)           {ms(r['step_seconds_median'])}",
        f"waiting for a core (median)      {ms(r['descheduled_seconds_median'])} per profiled step",
        f"max |loss difference|            {r['max_loss_difference']:.2e} (same work on both sides when ~0)",
        f"wall per run (median)            llmadapt {r['wall_per_run_s']['llmadapt']:.1f} s, bare "
        f"{r['wall_per_run_s']['bare']:.1f} s; whole check {r['wall_total_s']:.0f} s",
        f"bare by name alone (no optimizer-range rule): largest difference {worst['class']} "
        f"{worst['difference']:+.2f} points",
        f"verdict   {'every class within' if r['within'] else 'NOT every class within'} {r['tolerance_points']:g} "
        f"points",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
