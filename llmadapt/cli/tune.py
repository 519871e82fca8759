"""``llmadapt tune``: the best configuration of a workload across stacks (llmadapt.experiments.tune). Its options
are registered beside its handler (``register_tune``, found by cli/main.py's table of commands), as in every group
of cli/."""

from __future__ import annotations

import re
import sys

from llmadapt.cli.common import add_command, emit, stall_arg, workload_of
from llmadapt.errors import LlmadaptError

_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_budget(text: str) -> float:
    """'15m', '900s', '1h', '90' (seconds) -> seconds."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not found:
        raise LlmadaptError(f"--budget {text!r}: a duration such as 900s, 15m or 1h")
    return float(found.group(1)) * _UNITS[found.group(2) or "s"]


def cmd_tune(args) -> int:
    from llmadapt.experiments.micro import parse_size
    from llmadapt.experiments.tune import tune

    if not args.adapters:
        raise LlmadaptError("name the stacks to search: --adapters torch,deepspeed")
    workload = workload_of(args)
    log = None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    if args.sbatch_option and not args.slurm:
        raise LlmadaptError("--sbatch-option is for the probes' job arrays: give --slurm too")
    if workload.kind == "serve":
        if args.slurm:
            raise LlmadaptError("--slurm runs a training tune's probes as job arrays; a serving tune runs here")
        from llmadapt.launch.settings import check_run_options

        check_run_options(None, args.timeout, None, args.stall_timeout, workload.kind)  # as each probe's run would
        from llmadapt.experiments.tuneserve import tune_serving

        served = tune_serving(workload, [a.strip() for a in args.adapters.split(",") if a.strip()], args.slo or [],
                              over=args.over, start=args.start, maximum=args.max, budget_s=parse_budget(args.budget),
                              out=args.out, timeout=args.timeout, strategy=args.strategy, log=log)
        emit(args, served.to_dict(), served.text())
        return 0 if served.ranking else 1
    if args.slo:
        raise LlmadaptError("--slo is for serving workloads (kind = 'serve'); a training tune takes --max-step-time")
    result = tune(workload, [a.strip() for a in args.adapters.split(",") if a.strip()],
                  ranks=args.ranks, objective=args.objective, budget_s=parse_budget(args.budget),
                  max_memory_bytes=parse_size(args.max_memory) if args.max_memory else None,
                  max_step_s=args.max_step_time, strategy=args.strategy, device=args.device,
                  probe_steps=args.probe_steps, price_per_hour=args.price, seed=args.seed, out=args.out,
                  resume=args.resume, fixed=tuple(args.fix or ()), timeout=args.timeout,
                  stall_timeout=args.stall_timeout, launcher=args.launcher,
                  slurm=list(args.sbatch_option or []) if args.slurm else None, log=log)
    emit(args, result.to_dict(), result.text())
    return 0 if result.ranking else 1


def register_tune(sub) -> None:
    p = add_command(sub, "tune", cmd_tune, "the best configuration of a workload across stacks: the adapters' "
                                           "declared options, pruned by the estimate, raced with the verdict's rules")
    p.add_argument("workload", help="workload file (.toml, .yaml, .json)")
    p.add_argument("--set", action="append", metavar="PATH=VALUE", help="override a field")
    p.add_argument("--adapters", help="comma-separated stacks to search, e.g. torch,deepspeed,megatron,colossalai")
    p.add_argument("--budget", default="15m", help="time for the probes: 900s, 15m, 1h (default 15m)")
    p.add_argument("--objective", default="tokens_per_s",
                   help="tokens_per_s (default), step_time, tokens_per_s_per_gib or cost_per_token (with --price)")
    p.add_argument("--max-memory", metavar="SIZE", help="memory per rank a configuration may use, e.g. 4G: pruned "
                                                        "by the estimate, enforced on each probe")
    p.add_argument("--max-step-time", type=float, metavar="SECONDS", help="a configuration slower than this per "
                                                                          "step is dropped")
    p.add_argument("--ranks", type=int, help="ranks available (default: the workload's world size or this "
                                             "machine's cores, the larger)")
    p.add_argument("--strategy", default="race", choices=["race", "grid", "random", "model"],
                   help="race (default): every candidate once, then the survivors repeated, dropped on the verdict's "
                        "rules; grid: every candidate equally, nothing dropped; random: the race in a seeded order; "
                        "model: the race, skipping candidates the corrected estimate predicts slower (--device); "
                        "serving: race searches an engine's other configurations from its best capacity so far, "
                        "grid each from --start")
    p.add_argument("--device", help="catalog device for the estimate's step-time order (`llmadapt devices`)")
    p.add_argument("--probe-steps", type=int, help="train.steps of each probe (default: the workload's)")
    p.add_argument("--fix", action="append", metavar="PATH", help="keep the workload's value of this field "
                                                                  "(e.g. train.micro_batch); repeatable")
    p.add_argument("--price", type=float, help="price per device-hour (objective cost_per_token)")
    p.add_argument("--seed", type=int, default=0, help="the order of repeated rounds (and of --strategy random)")
    p.add_argument("--resume", metavar="DIR", help="a tune folder to go on from (same workload and options)")
    p.add_argument("--out", default="runs", help="the run store the probes go to (default ./runs)")
    p.add_argument("--timeout", type=float, help="seconds before a probe's workers are stopped")
    stall_arg(p)
    p.add_argument("--launcher", default="auto", choices=["auto", "subprocess", "torchrun"])
    p.add_argument("--slurm", action="store_true", help="run each round's probes as one Slurm job array (through "
                                                        "`llmadapt sweep`; the folders must be shared)")
    p.add_argument("--sbatch-option", action="append", metavar="OPTION",
                   help="with --slurm: an sbatch option for the arrays, e.g. --partition=gpu (repeat)")
    p.add_argument("--slo", action="append", metavar="OBJECTIVE", help="serving: an objective each configuration's "
                                                                      "capacity must meet, e.g. ttft_p99_ms<=1000")
    p.add_argument("--over", default="rate", choices=["rate", "concurrency"], help="serving: the load searched")
    p.add_argument("--start", type=float, default=1.0, help="serving: the first load of each SLA search")
    p.add_argument("--max", type=float, help="serving: the highest load tried")
