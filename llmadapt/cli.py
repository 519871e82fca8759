"""The command line: a thin layer over the Python API. Every command takes --json."""

from __future__ import annotations

import argparse
import functools
import json
import math
import signal
import sys
from typing import Any

from llmadapt.errors import LlmadaptError, Terminated


def _workload(args):
    from llmadapt.spec import Workload

    return Workload.from_file(args.workload).with_overrides(args.set or [])


def _emit(args, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text)


def _run_options(args) -> dict[str, Any]:
    opts: dict[str, Any] = {"launcher": args.launcher, "out": args.out, "timeout": args.timeout}
    opts["progress"] = _progress
    return opts


def _progress(record: dict[str, Any]) -> None:
    if record.get("type") == "warning":
        print(f"warning: {record['message']}", file=sys.stderr, flush=True)
    elif record.get("type") == "node":
        print(record["message"], file=sys.stderr, flush=True)
    elif record.get("type") == "slurm":
        reason = f" ({record['reason']})" if record.get("reason") not in (None, "", "None") else ""
        print(f"  slurm job {record['job_id']}: {record['state'] or 'gone'}{reason}", file=sys.stderr, flush=True)
    elif record.get("type") == "start":
        print(f"running {record['label']} on {record['adapter']} (world size {record['world_size']}, "
              f"{record['launcher']}) -> {record['run_dir']}", file=sys.stderr, flush=True)
    elif record.get("type") == "step":
        tag = " (warm-up)" if record["warmup"] else ""
        print(f"  step {record['step']:>4}  loss {record['loss']:.4f}  {record['seconds']:.4f} s{tag}",
              file=sys.stderr, flush=True)
    elif record.get("type") == "failure":
        print(f"  failure on rank {record.get('rank')}: {record['cause']}: {record['message']}", file=sys.stderr)


def cmd_run(args) -> int:
    import attrs

    from llmadapt.analysis import render_summary
    from llmadapt.launch import run

    result = run(_workload(args), args.adapter, **_run_options(args), **_node_options(args))
    summary = attrs.asdict(result.summary)
    nodes = json.loads((result.run_dir / "launch.json").read_text()).get("nodes", {}).get("seen")
    where = "".join(f"\nnode {n['node_rank']:<6} {n['node']}, ranks {', '.join(map(str, n['ranks']))}"
                    for n in nodes or [])
    _emit(args, {"run_dir": str(result.run_dir), "summary": summary},
          render_summary(summary) + where + f"\ntrace      {result.run_dir}")
    return 0 if result.ok else 1


def _node_options(args) -> dict[str, Any]:
    """Multi-node torchrun or Slurm settings from the `run` options; only what was given."""
    if args.launcher == "slurm":
        from llmadapt.slurm import SlurmSettings

        return {"slurm": SlurmSettings(
            nnodes=args.nnodes, ntasks_per_node=args.nproc_per_node, partition=args.partition, time=args.time,
            options=tuple(args.sbatch_option or ()), collect_addr=args.collect_addr, master_port=args.master_port)}
    if args.nnodes == 1 and not (args.master_addr or args.rdzv_endpoint or args.nproc_per_node):
        return {}
    from llmadapt.launch import NodeSettings

    return {"nodes": NodeSettings(
        nnodes=args.nnodes, node_rank=args.node_rank, nproc_per_node=args.nproc_per_node,
        master_addr=args.master_addr, master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint,
        local_addr=args.local_addr, ifname=args.ifname, collect_port=args.collect_port)}


def cmd_compare(args) -> int:
    from llmadapt.analysis import compare, parse_matrix

    comparison = compare(_workload(args), _names(args.adapters, distinct=True), matrix=parse_matrix(args.matrix or []),
                         log=None if args.json else (lambda m: print(m, file=sys.stderr, flush=True)),
                         **_run_options(args))
    _emit(args, comparison.to_dict(), comparison.table())
    return 0 if all(r.status == "ok" for r in comparison.rows) else 1


def cmd_parity(args) -> int:
    import attrs

    from llmadapt.analysis import parity

    names = _names(args.adapters)
    report = parity(_workload(args), names, rtol=args.rtol, atol=args.atol, **_run_options(args))
    _emit(args, attrs.asdict(report), report.describe((names[0], names[1])))
    return 0 if report.ok else 1


def cmd_show(args) -> int:
    from llmadapt.analysis import render_summary, show

    summary = show(args.run)
    _emit(args, summary, render_summary(summary))
    return 0


def cmd_export(args) -> int:
    from llmadapt.analysis import export

    text = export(args.run, args.format)
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text)
        except OSError as exc:
            raise LlmadaptError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def cmd_adapters(args) -> int:
    from llmadapt import environments
    from llmadapt.plugins import adapters

    rows = []
    for info in adapters().values():
        env = info.environment
        rows.append({
            "name": info.name, "version": info.version, "framework": info.framework, "roles": list(info.roles),
            "supports": info.supports.summary() if set(info.roles) - {"serve"} else "-",
            "environment": env.name if env else "-",
            "environment_status": environments.status(env) if env else "attach only",
            "description": info.description,
        })
    lines = [f"{'name':<10} {'version':<8} {'roles':<16} {'environment':<24} supports"]
    for r in rows:
        env = f"{r['environment']} ({r['environment_status']})"
        lines.append(f"{r['name']:<10} {r['version']:<8} {','.join(r['roles']):<16} {env:<24} {r['supports']}")
    _emit(args, rows, "\n".join(lines))
    return 0


def cmd_schema(args) -> int:
    from llmadapt.contract import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def _environment(name: str):
    from llmadapt.plugins import adapters

    for info in adapters().values():
        if info.environment and name in (info.environment.name, info.name):
            return info.environment
    known = sorted({i.environment.name for i in adapters().values() if i.environment})
    raise LlmadaptError(f"unknown environment {name!r}; known: {', '.join(known)}")


def cmd_env_create(args) -> int:
    from llmadapt.environments import create

    python = create(_environment(args.name), force=args.force, log=lambda m: print(m, file=sys.stderr, flush=True))
    _emit(args, {"environment": args.name, "python": str(python)}, f"{args.name}: {python}")
    return 0


def cmd_env_list(args) -> int:
    from llmadapt import environments
    from llmadapt.plugins import adapters

    envs = {info.environment.name: info.environment for info in adapters().values() if info.environment}
    rows = [{"environment": name, "status": environments.status(spec), "path": str(environments.env_dir(spec)),
             "requirements": list(spec.requirements),
             "older_builds": [str(p) for p in environments.older_builds(spec)]} for name, spec in sorted(envs.items())]
    lines = [f"{r['environment']:<16} {r['status']:<9} {r['path']}" for r in rows]
    older = sum(len(r["older_builds"]) for r in rows)
    if older and not args.json:
        lines.append(f"({older} builds from other recipes: `llmadapt env prune` removes them)")
    _emit(args, rows, "\n".join(lines))
    return 0


def cmd_env_prune(args) -> int:
    from llmadapt import environments
    from llmadapt.plugins import adapters

    specs = {info.environment.name: info.environment for info in adapters().values() if info.environment}
    if args.name:
        specs = {args.name: _environment(args.name)}
    removed = [str(p) for spec in specs.values() for p in environments.prune(spec)]
    _emit(args, removed, "\n".join(f"removed {p}" for p in removed) or "nothing to remove")
    return 0


def _names(text: str, *, distinct: bool = False) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise LlmadaptError(f"--adapters {text[:80]!r} names no adapter: give comma-separated names, e.g. torch,plain")
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if distinct and duplicate:
        raise LlmadaptError(f"--adapters names {duplicate!r} twice: give each adapter once (use --matrix for variants)")
    return names


class _Once(argparse.Action):
    """An option that may be given once: a second value is an error, not a silent override."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)!r} and {values!r}): give one")
        setattr(namespace, self.dest, values)


def add_command(subparsers, name: str, func, help: str) -> argparse.ArgumentParser:
    """A (sub)command with its help, a --json switch and the function that runs it."""
    p = subparsers.add_parser(name, help=help, description=help)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    from llmadapt import __version__

    parser = argparse.ArgumentParser(prog="llmadapt", description="Run one LLM workload on several stacks and "
                                     "compare the traces.")
    parser.add_argument("--version", action="version", version=f"llmadapt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = functools.partial(add_command, sub)

    def workload_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("workload", help="workload file (.toml, .yaml, .json)")
        p.add_argument("--set", action="append", metavar="PATH=VALUE", help="override a field, e.g. train.steps=5")
        p.add_argument("--launcher", default="auto", metavar="LAUNCHER",
                       help="auto (default), inline, subprocess, torchrun, slurm, or one an adapter brings "
                            "(deepspeed)")
        p.add_argument("--out", default="runs", help="folder for run directories (default: ./runs)")
        p.add_argument("--timeout", type=float, default=None, help="seconds before a run is stopped")

    p = command("run", cmd_run, "run a workload on one adapter")
    workload_args(p)
    p.add_argument("--adapter", default="torch", help="adapter name (default: torch)")
    g = p.add_argument_group("several nodes (torchrun: the same command on every node, changing --node-rank; "
                             "slurm: one command, one job); see docs/distributed.md")
    g.add_argument("--nnodes", "--nodes", type=int, default=1, help="number of nodes (default: 1)")
    g.add_argument("--nproc-per-node", "--ntasks-per-node", type=int, default=None,
                   help="ranks per node (default: world size / nnodes)")
    g.add_argument("--node-rank", type=int, default=0, help="torchrun: this node's rank; node 0 gathers the records")
    g.add_argument("--master-addr", help="torchrun: node 0's address, reachable from every node (static rendezvous)")
    g.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0 (default: 29500)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="torchrun: c10d rendezvous on node 0 instead")
    g.add_argument("--local-addr", help="torchrun: this node's address as the others reach it")
    g.add_argument("--ifname", help="torchrun: network interface for gloo/NCCL (GLOO_SOCKET_IFNAME)")
    g.add_argument("--collect-port", type=int, help="torchrun: port on node 0 for records (default: rendezvous+1)")
    g.add_argument("--partition", help="slurm: partition")
    g.add_argument("--time", help="slurm: time limit, e.g. 30 or 1:00:00")
    g.add_argument("--sbatch-option", action="append", metavar="OPTION",
                   help="slurm: another sbatch option, e.g. --sbatch-option=--account=abc (repeat)")
    g.add_argument("--collect-addr", help="slurm: this machine's address as the compute nodes reach it")

    p = command("compare", cmd_compare, "run a workload on several adapters and option variants; one table")
    workload_args(p)
    p.add_argument("--adapters", required=True, help="comma-separated adapter names, e.g. torch,deepspeed")
    p.add_argument("--matrix", action="append", metavar="PATH=V1,V2",
                   help="option variants, e.g. optimizations.recompute=none,full (repeat for a grid)")

    p = command("parity", cmd_parity, "check two adapters' fp32 loss trajectories agree at every step")
    workload_args(p)
    p.add_argument("--adapters", required=True, help="two comma-separated adapter names")
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--atol", type=float, default=None)

    p = command("show", cmd_show, "show a run's summary")
    p.add_argument("run", help="run directory")

    p = command("export", cmd_export, "export a run as JSON, CSV, a Chrome trace (Perfetto) or vLLM-bench keys")
    p.add_argument("run", help="run directory")
    p.add_argument("--format", required=True, choices=["json", "csv", "chrome-trace", "vllm-bench"], action=_Once,
                   help="vllm-bench: a serving run's summary under `vllm bench serve`'s result keys")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")

    command("adapters", cmd_adapters, "list registered adapters, what they support and their environments")
    command("schema", cmd_schema, "print the JSON Schema of trace records")

    env = sub.add_parser("env", help="build and list adapter environments")
    env_sub = env.add_subparsers(dest="env_command", required=True, metavar="ACTION")
    p = env_sub.add_parser("create", help="build an adapter's environment (virtualenv with pinned requirements)")
    p.add_argument("name", help="environment (or adapter) name")
    p.add_argument("--force", action="store_true", help="rebuild even if ready")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env_create)
    p = env_sub.add_parser("list", help="list environments and whether they are built")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env_list)
    p = env_sub.add_parser("prune", help="remove builds from other recipes (older pins, other checkouts' code)")
    p.add_argument("name", nargs="?", help="one environment (default: all)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env_prune)

    from llmadapt.cli_perf import register

    register(sub, command)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for name in ("rtol", "atol"):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            print(f"error: --{name}: got {value!r}; must be a finite number >= 0", file=sys.stderr)
            raise SystemExit(2)
    if getattr(args, "rtol", "absent") is None or getattr(args, "atol", "absent") is None:
        from llmadapt.analysis import PARITY_ATOL, PARITY_RTOL

        args.rtol = PARITY_RTOL if args.rtol is None else args.rtol
        args.atol = PARITY_ATOL if args.atol is None else args.atol
    # SIGTERM (a scheduler's cancel, `kill`) unwinds like Ctrl-C: workers and engines stopped, partial summary kept.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = args.func(args)
    except LlmadaptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt as exc:
        print(f"{'terminated (SIGTERM)' if isinstance(exc, Terminated) else 'interrupted'}: the partial trace "
              "was kept", file=sys.stderr)
        code = getattr(exc, "exit_code", 130)
    raise SystemExit(code)


def _terminated(signum, frame) -> None:
    # One is enough: a second must not cut the unwinding (and its summary) short, also when the first was
    # raised by a handler of its own (a serving run's) and is being handled now.
    if _terminated.seen or isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return
    _terminated.seen = True
    raise Terminated("terminated by SIGTERM")


_terminated.seen = False


if __name__ == "__main__":
    main()
