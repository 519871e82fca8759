"""``llmadapt``: the parser, the entry point, and how a command ends: its exit code from one table
(errors.ExitCode, docs/runs.md), Ctrl-C and SIGTERM, a closed pipe on stdout, errors as one line.

It is over 400 lines because every command's options are declared here, beside one another: one file to read for
what the command line takes (the commands' code is imported only when a command runs)."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import signal
import sys

from llmadapt.cli.common import Once, Unbuilt, WatchedStdout, add_command, printable
from llmadapt.errors import ExitCode, LlmadaptError, Terminated, did_you_mean, exit_code_of, os_error_line


def _lazy(module: str, name: str):
    """The command function ``name`` of ``llmadapt.cli.<module>``, imported when the command runs: building the
    parser (and printing --help) imports no command's module, nor the layers below it."""
    def command(args):
        return getattr(importlib.import_module(f"llmadapt.cli.{module}"), name)(args)

    command.__name__ = command.__qualname__ = name
    return command


cmd_run, cmd_compare, cmd_parity, cmd_show, cmd_export, cmd_runs, cmd_regress, cmd_report, cmd_trace, cmd_hta = (
    _lazy("runs", name) for name in ("cmd_run", "cmd_compare", "cmd_parity", "cmd_show", "cmd_export", "cmd_runs",
                                     "cmd_regress", "cmd_report", "cmd_trace", "cmd_hta"))
cmd_adapters, cmd_schema, cmd_env_create, cmd_env_list, cmd_env_prune = (
    _lazy("env", name) for name in ("cmd_adapters", "cmd_schema", "cmd_env_create", "cmd_env_list", "cmd_env_prune"))
cmd_load_sweep, cmd_sla = _lazy("serving", "cmd_load_sweep"), _lazy("serving", "cmd_sla")
cmd_sweep = _lazy("sweep", "cmd_sweep")


EXAMPLES = """examples:
  llmadapt adapters                                   what is installed, what each supports
  llmadapt run examples/tiny-llama.toml --adapter torch --set train.steps=5
  llmadapt compare examples/tiny-llama.toml --adapters torch --matrix optimizations.recompute=none,full
  llmadapt parity examples/tiny-llama.toml --adapters torch,plain
  llmadapt run examples/serve-tiny.toml --adapter hf  serving: one request stream, client-side timing
  llmadapt show runs/<run-id>
  llmadapt runs adapter=torch status=ok               the run store: runs under ./runs, filtered, newest 50

`llmadapt COMMAND --help` for a command's options; docs/cli.md for all of them."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose 'invalid choice' error (a mistyped command, action or format) says which valid
    choice is close, if one is."""

    def error(self, message: str):
        found = re.match(r"argument .*?: invalid choice: '(.*?)' (\(choose from .*\))$", message)
        if found:
            guess = did_you_mean(found.group(1), re.findall(r"'([^']*)'", found.group(2)))
            message = message[:found.start(2) - 1] + guess + " " + found.group(2)
        super().error(message)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command; ``only``: of that command alone (the one argv names), or of every command
    when no command has that name (the error then names the closest)."""
    from llmadapt.host import VERSION

    parser = _Parser(prog="llmadapt", description="Run one LLM workload on several stacks and "
                     "compare the traces.", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"llmadapt {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    built = []

    def command(name: str, func, help: str):
        if only not in (None, name):
            return Unbuilt()
        built.append(name)
        return add_command(sub, name, func, help)

    def add_parser(name: str, **kwargs):
        if only not in (None, name):
            return Unbuilt()
        built.append(name)
        return sub.add_parser(name, **kwargs)

    def workload_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("workload", help="workload file (.toml, .yaml, .json)")
        p.add_argument("--set", action="append", metavar="[ADAPTER:]PATH=VALUE",
                       help="override a field, e.g. train.steps=5; for one adapter only: megatron:parallelism.tp=2")
        p.add_argument("--launcher", default="auto", metavar="LAUNCHER",
                       help="auto (default), inline, subprocess, torchrun, slurm, or one an adapter brings "
                            "(deepspeed)")
        p.add_argument("--out", default="runs", help="folder for run directories (default: ./runs)")
        p.add_argument("--timeout", type=float, default=None, help="seconds before a run is stopped")

    def attach_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--attach", metavar="ADAPTER=URL,...",
                       help="serving: measure engines already running, e.g. hf=http://127.0.0.1:8000,vllm=http://b:8000 "
                            "(each adapter's serve.url, instead of starting them; the same request plan for each, "
                            "run back to back)")

    def cells_args(p: argparse.ArgumentParser, adapters_help: str) -> None:
        p.add_argument("--adapters", help=adapters_help)
        p.add_argument("--cell", action="append", metavar="ADAPTER[:PATH=VALUE,...]",
                       help="one adapter in a layout of its own, e.g. 'megatron:parallelism.tp=2' or "
                            "'deepspeed:parallelism.dp=2,optimizations.zero_stage=3' (repeat)")

    p = command("run", cmd_run, "run a workload on one adapter")
    workload_args(p)
    p.add_argument("--adapter", default=None, help="adapter name (default: torch; hf for a serve workload)")
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

    p = command("compare", cmd_compare, "run a workload on several adapters and option variants, or compare "
                "stored runs (--runs); one table")
    workload_args(p)
    _optional_workload(p)
    cells_args(p, "comma-separated adapter names, e.g. torch,deepspeed (one cell each)")
    p.add_argument("--matrix", action="append", metavar="PATH=V1,V2",
                   help="option variants, e.g. optimizations.recompute=none,full (repeat for a grid); a cell "
                        "the adapter cannot run is shown as not supported and not run")
    p.add_argument("--refuse-unsupported", action="store_true",
                   help="refuse a comparison that has a cell its adapter cannot run (a --cell or a matrix "
                        "variant), instead of skipping that cell")
    p.add_argument("--breakdown", action="store_true",
                   help="also set the runs' step breakdowns side by side per class (needs profile.steps)")
    p.add_argument("--repeat", default=1, metavar="N|auto",
                   help="runs per cell: rows show medians with 95%% bootstrap intervals over them (default 1); auto: "
                        "rounds until the verdict tells every two adjacent rows apart, up to --max-rounds")
    p.add_argument("--reuse", action="store_true",
                   help="count runs already in --out of the same workload, adapter version and machine, instead "
                        "of running them again")
    p.add_argument("--settle", type=float, metavar="SHARE",
                   help="after --repeat rounds, add rounds until every row's 95%% interval is narrower than SHARE of "
                        "its median (0.05: 5%%), up to --max-rounds; the rows that never settle are named")
    p.add_argument("--max-rounds", type=int, default=10, metavar="N", help="the most rounds --settle or --repeat auto runs (default 10)")
    p.add_argument("--seed", type=int, metavar="N",
                   help="the seed of the rounds' shuffled order (default: drawn, and printed under the table)")
    p.add_argument("--columns", metavar="LIST", type=lambda v: [c for c in v.split(",") if c.strip()],
                   help="the metric columns to show, by key or title, comma-separated, e.g. 'step p50 s,tokens/s' "
                        "(default: all; on a narrow terminal the least read are left out, saying which)")
    p.add_argument("--baseline", metavar="CELL",
                   help="the row the others are set against: a cell as given (torch, 'megatron:parallelism.tp=2') "
                        "or a row's label (default: each problem's first row)")
    p.add_argument("--runs", metavar="QUERY",
                   help="compare stored runs in --out instead of running: key=value terms, e.g. "
                        "'adapter=torch since=2026-12-01' ('' for all)")
    p.add_argument("--report", metavar="FILE", help="also write the comparison's HTML report (llmadapt report)")
    p.add_argument("--save-sweep", metavar="FILE",
                   help="write this comparison as a sweep file (.toml, .yaml, .json) instead of running it "
                        "(llmadapt sweep run FILE: resumable, Slurm job arrays)")

    attach_arg(p)

    def serving_args(p: argparse.ArgumentParser) -> None:
        workload_args(p)
        p.add_argument("--adapters", required=True, help="comma-separated serving adapters, e.g. hf,vllm")
        attach_arg(p)
        p.add_argument("--engine-matrix", action="append", metavar="serve.engine.NAME=V1,V2",
                       help="engine settings to vary (repeat to cross them): each combination on each adapter is an "
                            "engine started fresh and measured at every load, e.g. serve.engine.max_sequences=2,8")

    p = command("load-sweep", cmd_load_sweep, "serve at several loads against each engine (started once): a "
                "latency-against-load table; each point is a run of its own")
    serving_args(p)
    p.add_argument("--rates", metavar="R1,R2,...|geometric:START:FACTOR[:MAX]",
                   help="request rates (requests/s, the workload's arrival process), increasing; geometric steps "
                        "continue until the engine saturates or MAX")
    p.add_argument("--concurrencies", metavar="C1,C2,...|geometric:START:FACTOR[:MAX]",
                   help="closed-loop concurrencies instead of rates")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="runs per load (default 1)")
    p.add_argument("--pareto", default="e2el_p99", metavar="METRIC_QUANTILE",
                   help="the latency the throughput frontier is drawn against (default e2el_p99; e.g. ttft_p99, "
                        "tpot_p50): points no other beats on output tok/s and that latency at once are marked *")

    p = command("sla", cmd_sla, "find each engine's highest load that meets service-level objectives "
                "(exponential probe, bisection, repeats at the answer)")
    serving_args(p)
    p.add_argument("--slo", action="append", metavar="METRIC_QUANTILE_ms<=LIMIT",
                   help="an objective, e.g. ttft_p99_ms<=500 or tpot_p99_ms<=50 (repeat); metrics ttft, tpot, itl, "
                        "e2el; quantiles p50, p90, p99, mean")
    p.add_argument("--over", choices=["rate", "concurrency"], default="rate",
                   help="search over request rate (default) or concurrency")
    p.add_argument("--start", type=float, default=None, help="first load probed (default 1)")
    p.add_argument("--max", type=float, default=None, help="highest load probed (default 1024 req/s, 256 in flight)")
    p.add_argument("--resolution", type=float, default=0.1,
                   help="stop bisecting when the bracket is this fraction wide (default 0.1; concurrency: 1)")
    p.add_argument("--repeats", type=int, default=2, help="probes at the answer, all of which must pass (default 2)")

    p = command("sweep", cmd_sweep, "run a sweep file's cells (resuming: finished cells are skipped, failed ones "
                "retried), locally or as a Slurm job array; or show their status")
    p.add_argument("action", choices=["run", "status"])
    p.add_argument("sweep", help="sweep file (.toml, .yaml, .json): workload, adapters/cells, set, matrix, repeat, "
                                 "retries")
    p.add_argument("--set", action="append", metavar="[ADAPTER:]PATH=VALUE", help="override a workload field")
    p.add_argument("--out", default="runs", help="folder for run directories and the sweep's state (default: ./runs)")
    p.add_argument("--launcher", default="auto", metavar="LAUNCHER", help="for each cell's run (default: auto)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (with --slurm: for the whole array)")
    p.add_argument("--index", type=int, default=None, help="run only cell I (what each Slurm array task does)")
    p.add_argument("--slurm", action="store_true", help="submit the cells not done as one Slurm job array and wait")
    p.add_argument("--sbatch-option", action="append", metavar="OPTION",
                   help="an sbatch option for the array, e.g. --partition=gpu (repeat)")

    p = command("parity", cmd_parity, "check two adapters' fp32 loss trajectories agree at every step")
    workload_args(p)
    _optional_workload(p)
    p.add_argument("--runs", metavar="QUERY", help="check two runs already stored in --out instead of running")
    cells_args(p, "two comma-separated adapter names")
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--atol", type=float, default=None)

    p = command("show", cmd_show, "show a run's summary")
    p.add_argument("run", help="run directory")

    p = command("export", cmd_export, "export a run as JSON, CSV, a Chrome trace (Perfetto) or vLLM-bench keys")
    p.add_argument("run", help="run directory")
    p.add_argument("--format", required=True, choices=["json", "csv", "breakdown-csv", "evaluation-csv", "chrome-trace",
                                                         "vllm-bench"],
                   action=Once, help="csv: steps (requests for serving); breakdown-csv: the profiled steps' classes, "
                   "layers, collectives; evaluation-csv: the held-out figures per evaluation (and expert loads); "
                   "vllm-bench: a serving run's summary under `vllm bench serve`'s result keys")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")

    p = command("runs", cmd_runs, "list the runs in a folder (its run store), filtered by key=value terms; "
                "`llmadapt runs import PATH...` adds run folders made elsewhere, and the result files of vllm bench "
                "serve, AIPerf and guidellm as serving runs")
    p.add_argument("terms", nargs="*", metavar="QUERY",
                   help="adapter=torch status=ok since=2026-12-01 machine=NODE workload=HASH|NAME "
                        "optimizations.zero_stage=3 ...; or: import PATH... (run folders, other tools' result files)")
    p.add_argument("--root", default="runs", help="the folder of runs (default: ./runs)")
    p.add_argument("--parquet", metavar="FILE", help="also write the matching runs to a Parquet file")
    p.add_argument("--frame", choices=("runs", "steps", "requests", "breakdown", "telemetry"), default="runs",
                   help="what --parquet writes: a row per run (default), or the runs' steps, requests, breakdown "
                        "classes or telemetry samples (llmadapt.analysis.frames)")
    p.add_argument("--limit", type=int, metavar="N", help="list the newest N matching runs (default 50; --json: all)")
    p.add_argument("--page", type=int, metavar="P", help="the P-th page of --limit runs, newest first (default 1)")
    p.add_argument("--all", action="store_true", help="list every matching run")
    p.add_argument("--rescan", action="store_true", help="read every run folder again: see changes to finished runs")
    p.add_argument("--workload", metavar="PATH", help="import of result files: the workload (file or run folder) whose "
                   "stream the tool sent, checked against the file; without it the problem is as the file states")
    p.add_argument("--tool-version", metavar="V", help="import of result files: the tool's version, where they lack it")

    p = command("regress", cmd_regress, "did the candidate runs get worse than the baseline runs? Stored runs, "
                "matched cell by cell, tested metric by metric; exit 1 on a regression")
    p.add_argument("baseline", help="store query of the baseline runs, e.g. 'adapter=deepspeed until=2026-12-01'")
    p.add_argument("candidate", help="store query of the candidate runs")
    p.add_argument("--root", default="runs", help="the folder of runs (default: ./runs)")
    p.add_argument("--threshold", type=float, default=5.0, metavar="PERCENT",
                   help="a change worse than this (and beyond noise) is a regression (default: 5)")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the t-test (default: 0.05)")
    p.add_argument("--metric", action="append", help="only this metric (repeat); default: every shared one")

    p = command("report", cmd_report, "a self-contained HTML report of runs: the comparison table and every figure "
                "their records hold (one file, no network needed)")
    p.add_argument("runs", nargs="*", metavar="RUN", help="run folders, or folders of runs")
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default: report.html)")
    p.add_argument("--runs", dest="query", metavar="QUERY", help="also the stored runs in --root matching QUERY")
    p.add_argument("--root", default="runs", help="the folder of runs for --runs (default: ./runs)")
    p.add_argument("--figures", metavar="DIR", help="also write each figure as PNG and SVG into DIR")
    p.add_argument("--title", default="llmadapt report")

    p = command("trace", cmd_trace, "the kernel-basis breakdown of torch.profiler (Kineto) traces of any GPU job: "
                "per rank operator classes, collectives, overlap, idle, annotations; stragglers across ranks")
    p.add_argument("paths", nargs="+", metavar="TRACE", help="trace files (.json, .json.gz), or folders of them")
    p.add_argument("--include-last-step", action="store_true",
                   help="also what was launched in the trace's last ProfilerStep (left out by default, as HTA does: "
                        "the profiler may stop inside it)")

    p = command("hta", cmd_hta, "Holistic Trace Analysis on a run's profiler traces (profile.level = full; "
                "its own environment: llmadapt env create hta)")
    p.add_argument("run", help="run directory")
    p.add_argument("--step", type=int, help="profiled step (default: the first traced)")

    command("adapters", cmd_adapters, "list registered adapters, what they support and their environments")
    command("schema", cmd_schema, "print the JSON Schema of trace records")

    env = add_parser("env", help="build and list adapter environments")
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

    if only is None or not built:
        from llmadapt.cli.perf import register
        from llmadapt.cli.tune import register as register_tune

        register(add_parser, command)
        register_tune(add_parser, command)
    if only is not None and not built:
        return build_parser()
    return parser


def _optional_workload(p: argparse.ArgumentParser) -> None:
    """The workload file is not needed where --runs reads stored runs instead."""
    for action in p._actions:
        if action.dest == "workload":
            action.nargs, action.help = "?", "workload file (.toml, .yaml, .json); none with --runs"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv and not argv[0].startswith("-") else None).parse_args(argv)
    for name in ("rtol", "atol"):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            print(f"error: --{name}: got {value!r}; must be a finite number >= 0", file=sys.stderr)
            raise SystemExit(ExitCode.BAD_INPUT)
    if getattr(args, "rtol", "absent") is None or getattr(args, "atol", "absent") is None:
        from llmadapt.analysis.paritycheck import PARITY_ATOL, PARITY_RTOL

        args.rtol = PARITY_RTOL if args.rtol is None else args.rtol
        args.atol = PARITY_ATOL if args.atol is None else args.atol
    # SIGTERM (a scheduler's cancel, `kill`) unwinds like Ctrl-C: workers and engines stopped, partial summary kept.
    signal.signal(signal.SIGTERM, _terminated)
    stdout, sys.stdout = sys.stdout, WatchedStdout(sys.stdout)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe or a full disk on stdout shows here, where it is handled, not at exit
    except BrokenPipeError as exc:
        if getattr(exc, "on_stdout", False):  # `llmadapt runs --json | head -1`: the reader has what it wanted
            _quiet_stdout()
            code = ExitCode.CLOSED_PIPE
        else:
            code = _error(exc)
    except (LlmadaptError, OSError) as exc:
        code = _error(exc)
    except KeyboardInterrupt as exc:
        _say(f"{'terminated (SIGTERM)' if isinstance(exc, Terminated) else 'interrupted'}: the partial trace "
             "was kept")
        code = exit_code_of(exc)
    finally:
        sys.stdout = stdout
    try:  # what an error left in stdout's buffer, flushed here so that exit has nothing left to fail on
        sys.stdout.flush()
    except OSError:
        _quiet_stdout()
    raise SystemExit(int(code))


def _error(exc: BaseException) -> int:
    """One line on stderr for an error that ends a command; its exit code from the table (errors.ExitCode)."""
    on_stdout = getattr(exc, "on_stdout", False)
    if on_stdout:
        text = f"cannot write to standard output: {getattr(exc, 'strerror', None) or exc}"
        _quiet_stdout()
    elif isinstance(exc, OSError) and not isinstance(exc, LlmadaptError):
        text = os_error_line(exc)
    else:
        text = str(exc)
    _say(f"error: {printable(text)}")  # one line: a newline in a name cannot start a line of its own
    return exit_code_of(exc)


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # stderr closed too: the exit code is all that is left to say it
        pass


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises nothing more (Python's own recipe for
    SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


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
