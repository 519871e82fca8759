"""How much does llmadapt add to a training step? The reference adapter vs a bare PyTorch loop.

Both sides run in this one process, on the same device, with the same thread count:

- llmadapt: ``llmadapt.run(workload, "torch", launcher="inline")``; the step times are the ones
  llmadapt records (rank-00000.jsonl, summarised in summary.step_time_s).
- bare: the loop a user would write by hand doing the same work: the same canonical checkpoint
  loaded with transformers (fp32, eager attention unless the workload asks for flash
  attention), the same optimizer and learning rate, the same batches from TokenData, the same
  loss (sum-reduced cross entropy / loss-bearing tokens of the global batch, summed over
  micro-batches), backward, the gradient norm (what a training loop logs and clips by; the
  reference adapter reports it) and optimizer.step, each step timed with time.perf_counter.

Both exclude the workload's warm-up steps. After one untimed priming pass of each side
(imports, checkpoint build), the sides alternate in rounds, in ABBA order (llmadapt, bare,
bare, llmadapt, ...), so slow drift of the machine cancels out; every round loads the model
afresh. The loss trajectories of the two sides are compared too, as a check that they did
the same work (on the CPU they agree exactly).

    python benchmarks/overhead.py                     # tiny-llama, 30 measured steps, 6 rounds
    python benchmarks/overhead.py --rounds 10 --threads 2 --json
    python benchmarks/overhead.py --smoke             # one round of 2 steps, no priming (CI's smoke pass)

Not a test: it prints figures and asserts nothing about time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = REPO / "examples" / "tiny-llama.toml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD),
                   help="workload file (default: examples/tiny-llama.toml)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per run (train.steps; default 30)")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="further workload overrides")
    p.add_argument("--rounds", type=int, default=6,
                   help="runs of each side, alternated in ABBA order (default 6; 3 or more recommended)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for both sides (default 1: the least noisy on a shared machine)")
    p.add_argument("--device", choices=["auto", "cpu"], default="auto",
                   help="auto: CUDA if available, as llmadapt's worker picks; cpu: force the CPU on both sides")
    p.add_argument("--no-prime", action="store_true",
                   help="skip the untimed priming pass (imports, checkpoint build, first kernels) before round 1")
    p.add_argument("--keep", metavar="DIR", help="keep llmadapt's run directories in DIR (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest size: one round of 2 measured steps, no priming pass (flags given explicitly "
                        "still count); shows that the script works, in seconds; its figures mean little")
    args = p.parse_args(argv)
    if args.smoke:  # its sizes become the defaults: flags given explicitly still count
        p.set_defaults(rounds=1, steps=2, no_prime=True)
        args = p.parse_args(argv)
    return args


# -- the two sides ------------------------------------------------------------------------
def run_llmadapt(workload, out: Path) -> dict:
    import llmadapt

    t0 = time.perf_counter()
    result = llmadapt.run(workload, "torch", launcher="inline", out=out)
    wall = time.perf_counter() - t0
    s = result.summary
    if not result.ok:
        raise SystemExit(f"llmadapt run failed: {[f'{f.cause}: {f.message}' for f in s.failures]} ({result.run_dir})")
    steps = []
    with open(result.run_dir / "rank-00000.jsonl") as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") == "step" and not record["warmup"]:
                steps.append(record["seconds"])
    return {
        "step_s": steps, "losses": list(s.losses), "wall_s": wall,
        "summary_p50_s": s.step_time_s.p50, "summary_mean_s": s.step_time_s.mean,
        "device": _device_name(s.device), "run_dir": str(result.run_dir),
    }


def _device_name(device) -> str | None:
    # Summary.device is annotated as a Device but holds the header's plain dict: accept both.
    if device is None:
        return None
    return device["name"] if isinstance(device, dict) else device.name


def run_bare(workload, device) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from llmadapt.chattemplate import read_chat_template
    from llmadapt.models import canonical_checkpoint
    from llmadapt.runtime.data import TokenData

    w = workload
    t0 = time.perf_counter()
    checkpoint = canonical_checkpoint(w.model, w.seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[w.precision]
    attn = "sdpa" if w.optimizations.flash_attention else "eager"
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype, attn_implementation=attn).to(device)
    model.config.use_cache = False
    model.train()
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[w.train.optimizer]
    optimizer = cls(model.parameters(), lr=w.train.lr, weight_decay=w.train.weight_decay)
    tokenizer = None
    if w.data.source == "jsonl":  # text: the canonical tokenizer, as llmadapt's worker reads it
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(checkpoint))
    data = TokenData(w, tokenizer, read_chat_template(checkpoint))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    steps, losses = [], []
    for step in range(w.train.total_steps):
        batch = data.step_batch(step, 0, 1)  # built outside the clock, as llmadapt does
        sync()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for mb in batch.micro_batches:
            input_ids, labels = mb.input_ids.to(device), mb.labels.to(device)
            logits = model(input_ids=input_ids).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=-100, reduction="sum")
            (loss / batch.loss_tokens_global).backward()
            total += loss.detach().double()
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
        optimizer.step()
        losses.append(total.item() / batch.loss_tokens_global)
        sync()
        seconds = time.perf_counter() - start
        if step >= w.train.warmup_steps:
            steps.append(seconds)
    wall = time.perf_counter() - t0
    del model, optimizer
    return {"step_s": steps, "losses": losses, "wall_s": wall}


# -- reporting ----------------------------------------------------------------------------
def describe(values: list[float]) -> dict:
    data = sorted(values)
    n = len(data)
    return {
        "count": n, "median_s": statistics.median(data), "mean_s": statistics.fmean(data),
        "min_s": data[0], "p90_s": data[min(n - 1, round(0.9 * (n - 1)))],
        "stdev_s": statistics.stdev(data) if n > 1 else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Before torch loads: llmadapt's worker sets torch's threads from OMP_NUM_THREADS (when set),
    # so setting both keeps the two sides on the same count. Quiet transformers on both sides.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.device == "cpu":
        os.environ["LLMADAPT_DEVICE"] = "cpu"

    import torch

    from llmadapt.spec import Workload

    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and os.environ.get("LLMADAPT_DEVICE", "auto") != "cpu"
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")  # the rule of runtime.pick_device
    if use_cuda:
        torch.cuda.set_device(device)

    workload = Workload.from_file(args.workload).with_overrides([f"train.steps={args.steps}", *args.set])
    if workload.world_size != 1:
        raise SystemExit(f"the inline launcher runs one rank; this workload needs {workload.world_size}")

    order = []
    for r in range(args.rounds):
        order += [("llmadapt", r), ("bare", r)] if r % 2 == 0 else [("bare", r), ("llmadapt", r)]

    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="llmadapt-overhead-")
    out = Path(args.keep or tmp.name)
    runs: dict[str, list[dict]] = {"llmadapt": [], "bare": []}
    threads_seen = set()
    try:
        if not args.no_prime:
            # Untimed: loads transformers, builds the canonical checkpoint if needed and runs a few
            # steps of each side, so that no round pays one-off costs.
            if not args.json:
                print("priming (untimed) ...", file=sys.stderr, flush=True)
            short = workload.with_overrides(["train.steps=2"])
            run_llmadapt(short, out)
            run_bare(short, device)
        for side, r in order:
            if not args.json:
                print(f"round {r + 1}/{args.rounds}: {side} ...", file=sys.stderr, flush=True)
            gc.collect()
            res = run_llmadapt(workload, out) if side == "llmadapt" else run_bare(workload, device)
            threads_seen.add(torch.get_num_threads())
            res["round"] = r + 1
            res["median_s"] = statistics.median(res["step_s"])
            runs[side].append(res)
            gc.collect()
    finally:
        if tmp is not None:
            tmp.cleanup()

    la, bare = runs["llmadapt"], runs["bare"]
    stats = {side: describe([t for run in rs for t in run["step_s"]]) for side, rs in runs.items()}
    ratio = stats["llmadapt"]["median_s"] / stats["bare"]["median_s"]
    ratio_mean = stats["llmadapt"]["mean_s"] / stats["bare"]["mean_s"]
    ratio_min = stats["llmadapt"]["min_s"] / stats["bare"]["min_s"]
    # Paired by round (each llmadapt run with the bare run next to it): robust to drift over minutes.
    round_ratios = [a["median_s"] / b["median_s"] for a, b in zip(la, bare)]
    ratio_paired = statistics.median(round_ratios)
    wall = {side: statistics.median(run["wall_s"] for run in rs) for side, rs in runs.items()}
    loss_diff = max(abs(x - y) for a, b in zip(la, bare) for x, y in zip(a["losses"], b["losses"]))
    report = {
        "workload": workload.label,
        "workload_file": args.workload,
        "model": workload.model.name,
        "steps_per_run": workload.train.steps, "warmup_steps": workload.train.warmup_steps,
        "global_batch": workload.train.global_batch, "micro_batch": workload.train.micro_batch,
        "seq_len": workload.train.seq_len, "rounds": args.rounds, "threads": args.threads,
        "threads_seen": sorted(threads_seen), "device": str(device), "device_name": la[0]["device"],
        "torch": torch.__version__,
        "llmadapt": stats["llmadapt"], "bare": stats["bare"],
        "ratio_median": ratio, "overhead_median_pct": (ratio - 1) * 100,
        "ratio_mean": ratio_mean, "overhead_mean_pct": (ratio_mean - 1) * 100,
        "ratio_min": ratio_min, "overhead_min_pct": (ratio_min - 1) * 100,
        "round_ratios_median": round_ratios,
        "ratio_paired": ratio_paired, "overhead_paired_pct": (ratio_paired - 1) * 100,
        "llmadapt_summary_p50_s": [run["summary_p50_s"] for run in la],
        "llmadapt_summary_mean_s": [run["summary_mean_s"] for run in la],
        "bare_round_median_s": [run["median_s"] for run in bare],
        "wall_per_run_s": wall, "wall_ratio": wall["llmadapt"] / wall["bare"],
        "max_loss_diff": loss_diff,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0


def render(r: dict) -> str:
    ms = lambda s: f"{s * 1e3:9.2f}"  # noqa: E731
    lines = [
        f"workload  {r['workload']} ({r['model']}): {r['steps_per_run']} measured steps + {r['warmup_steps']} warm-up, "
        f"global batch {r['global_batch']} (micro {r['micro_batch']}), seq {r['seq_len']}",
        f"device    {r['device']} ({r['device_name']}), torch {r['torch']}, {r['threads']} thread(s) "
        f"(seen: {r['threads_seen']}), {r['rounds']} rounds per side, ABBA order",
        "",
        f"{'side':<10} {'steps':>5} {'median ms':>9} {'mean ms':>9} {'min ms':>9} {'p90 ms':>9}",
    ]
    for side in ("llmadapt", "bare"):
        s = r[side]
        lines.append(f"{side:<10} {s['count']:>5} {ms(s['median_s'])} {ms(s['mean_s'])} {ms(s['min_s'])} "
                     f"{ms(s['p90_s'])}")
    lines += [
        "",
        f"ratio llmadapt/bare (median)  {r['ratio_median']:.3f}  ({r['overhead_median_pct']:+.1f}% overhead)",
        f"ratio llmadapt/bare (mean)    {r['ratio_mean']:.3f}  ({r['overhead_mean_pct']:+.1f}%)",
        f"ratio llmadapt/bare (min)     {r['ratio_min']:.3f}  ({r['overhead_min_pct']:+.1f}%; the fastest steps)",
        f"median of per-round ratios    {r['ratio_paired']:.3f}  ({r['overhead_paired_pct']:+.1f}%; paired by round)",
        "per-round ratios (median)     " + "  ".join(f"{x:.3f}" for x in r["round_ratios_median"]),
        "llmadapt summary p50 ms       " + "  ".join(f"{x * 1e3:.2f}" for x in r["llmadapt_summary_p50_s"]),
        "bare round median ms          " + "  ".join(f"{x * 1e3:.2f}" for x in r["bare_round_median_s"]),
        f"wall per run (median)         llmadapt {r['wall_per_run_s']['llmadapt']:.2f} s, "
        f"bare {r['wall_per_run_s']['bare']:.2f} s (ratio {r['wall_ratio']:.2f}; model load, trace, summary)",
        f"max |loss difference|         {r['max_loss_diff']:.2e} (same work on both sides when ~0)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
