"""What every command shares: reading the workload and its --set overrides, --json output, run options,
progress lines, text from the outside world made safe to print, and the helpers that register a command and
the options several groups' commands share (each group's module registers its own commands beside them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from typing import Any, Callable, Iterator

from llmadapt.errors import LlmadaptError


def workload_of(args, *, runs_adapters: bool = True):
    """The workload file with its --set overrides; ``runs_adapters=False`` for commands that run none (estimate,
    micro), which refuse a setting for one adapter given on the command line rather than drop it."""
    from llmadapt.spec import Workload

    workload = Workload.from_file(args.workload).with_overrides(args.set or [], source="--set")
    if not runs_adapters:
        from llmadapt.launch.settings import check_adapter_settings

        check_adapter_settings(workload, [])
    return workload


# C0 and C1 controls (a newline, a carriage return, an escape sequence) and the bidirectional overrides, embeddings,
# isolates and marks that reorder what follows them on a terminal (U+202E, a right-to-left override).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: object) -> str:
    """``text`` with its control characters and bidirectional overrides escaped (``\\n``, ``\\x1b``, ``\\u202e``):
    names, labels and server bodies from the outside world print as one line that reads as it is stored."""
    def escaped(match: re.Match) -> str:
        char = match.group()
        return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")

    return _UNPRINTABLE.sub(escaped, str(text))


def printable_lines(text: object) -> str:
    """``printable`` line by line: a text of several lines keeps its lines, each made safe."""
    return "\n".join(printable(line) for line in str(text).split("\n"))


def emit(args, data: Any, text: str) -> None:
    """--json: the data as JSON (every control character escaped by JSON itself); else the text, each line
    printed with its control characters escaped."""
    print(json.dumps(data, indent=2, default=str) if args.json else printable_lines(text))


def run_options(args) -> dict[str, Any]:
    opts: dict[str, Any] = {"launcher": args.launcher, "out": args.out, "timeout": args.timeout,
                            "stall_timeout": getattr(args, "stall_timeout", None)}
    opts["progress"] = _progress
    return opts


def _progress(record: dict[str, Any]) -> None:
    if record.get("type") == "warning":
        print(f"warning: {printable_lines(record['message'])}", file=sys.stderr, flush=True)
    elif record.get("type") == "node":
        print(printable_lines(record["message"]), file=sys.stderr, flush=True)
    elif record.get("type") == "slurm":
        reason = f" ({record['reason']})" if record.get("reason") not in (None, "", "None") else ""
        print(f"  slurm job {record['job_id']}: {record['state'] or 'gone'}{reason}", file=sys.stderr, flush=True)
    elif record.get("type") == "start":
        print(f"running {printable(record['label'])} on {printable(record['adapter'])} (world size "
              f"{record['world_size']}, {record['launcher']}) -> {printable(record['run_dir'])}", file=sys.stderr,
              flush=True)
    elif record.get("type") == "step":
        tag = " (warm-up)" if record["warmup"] else ""
        print(f"  step {record['step']:>4}  loss {record['loss']:.4f}  {record['seconds']:.4f} s{tag}",
              file=sys.stderr, flush=True)
    elif record.get("type") == "failure":
        print(f"  failure on rank {record.get('rank')}: {record['cause']}: {printable_lines(record['message'])}",
              file=sys.stderr)


def name_list(text: str, *, distinct: bool = False) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise LlmadaptError(f"--adapters {text[:80]!r} names no adapter: give comma-separated names, e.g. torch,plain")
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if distinct and duplicate:
        raise LlmadaptError(f"--adapters names {duplicate!r} twice: give each adapter once (use --cell or --matrix "
                            "for variants)")
    return names


class Once(argparse.Action):
    """An option that may be given once: a second value is an error, not a silent override."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)!r} and {values!r}): give one")
        setattr(namespace, self.dest, values)


def repeat_arg(text: Any) -> int | str:
    """compare's --repeat: a whole number >= 1, or 'auto'."""
    if text == "auto" or isinstance(text, int):
        return text
    try:
        return int(text)  # compare says what a number below 1 is
    except ValueError:
        raise LlmadaptError(f"--repeat {text!r}: a whole number >= 1, or auto") from None


def add_command(subparsers, name: str, func, help: str) -> argparse.ArgumentParser:
    """A (sub)command with its help, a --json switch and the function that runs it."""
    p = subparsers.add_parser(name, help=help, description=help)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=func)
    return p


def workload_args(p: argparse.ArgumentParser) -> None:
    """The options of a command that runs a workload file (run, compare, parity, load-sweep, sla)."""
    p.add_argument("workload", help="workload file (.toml, .yaml, .json)")
    p.add_argument("--set", action="append", metavar="[ADAPTER:]PATH=VALUE",
                   help="override a field, e.g. train.steps=5; for one adapter only: megatron:parallelism.tp=2")
    p.add_argument("--launcher", default="auto", metavar="LAUNCHER",
                   help="auto (default), inline, subprocess, torchrun, slurm, or one an adapter brings "
                        "(deepspeed)")
    p.add_argument("--out", default="runs", help="folder for run directories (default: ./runs)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a run is stopped")


def stall_arg(p: argparse.ArgumentParser) -> None:
    """--stall-timeout: the commands that start training runs (run, compare, parity, sweep, tune)."""
    p.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                   help="training: stop a run whose rank 0 recorded no step for this long after its first (a hung "
                        "collective or a stopped rank)")


def attach_arg(p: argparse.ArgumentParser) -> None:
    """--attach: measure serving engines already running (compare, load-sweep, sla)."""
    p.add_argument("--attach", metavar="ADAPTER=URL,...",
                   help="serving: measure engines already running, e.g. hf=http://127.0.0.1:8000,vllm=http://b:8000 "
                        "(each adapter's serve.url, instead of starting them; the same request plan for each, "
                        "run back to back)")


def attach_settings(text: str | None, adapters: list[str]) -> list[str]:
    """--attach hf=http://a:8000,vllm=http://b:8000 as per-adapter serve.url settings; an adapter that is not
    in the comparison, or an entry that is no NAME=URL, is one line before anything starts."""
    if not text:
        return []
    out = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, sep, url = entry.partition("=")
        if not sep or not name or not url:
            raise LlmadaptError(f"--attach {entry!r}: write ADAPTER=URL, e.g. vllm=http://127.0.0.1:8000")
        if name not in adapters:
            raise LlmadaptError(f"--attach names {name!r}, which is not among the adapters compared "
                                f"({', '.join(adapters)})")
        out.append(f"{name}:serve.url={url}")
    return out


def time_left(elapsed: float | None, done: float, total: float | None) -> str:
    """'0:01:23': the runs left at the mean time of a run so far (elapsed over runs done); '-:--:--' before the
    first run ends. (rich's own estimate needs several updates within 30 s: a comparison of minute-long runs
    never gave it one.)"""
    if not done or not total or elapsed is None:
        return "-:--:--"
    seconds = int(elapsed / done * max(0.0, total - done))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _runs_left_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RunsLeft(ProgressColumn):
        def render(self, task) -> Text:
            return Text(time_left(task.elapsed, task.completed, task.total), style="progress.remaining")

    return RunsLeft()


@contextlib.contextmanager
def cells_progress(args) -> Iterator[Callable[[int, int, str], None] | None]:
    """A progress bar of runs done, elapsed and estimated time left, on a terminal's stderr; None (plain lines
    instead) with --json or when stderr is not a terminal."""
    if getattr(args, "json", False) or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("left"), _runs_left_column(), console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("runs", total=None)

        def on_cell(done: int, total: int, title: str) -> None:
            bar.update(task, completed=done, total=total, description=title[:40])

        yield on_cell


class WatchedStdout:
    """sys.stdout while a command runs: an error writing it (a closed pipe, a full disk under `> file`), which
    names no file, is marked as stdout's."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            exc.on_stdout = True
            raise

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            exc.on_stdout = True
            raise

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
