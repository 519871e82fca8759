"""``llmadapt``: the parser, the entry point, and how a command ends: its exit code from one table
(errors.ExitCode, docs/runs.md), Ctrl-C and SIGTERM, a closed pipe on stdout, errors as one line.

One convention for commands: each group's module in cli/ holds its commands' handlers (``cmd_*``) and, beside each,
the function that registers the command's options (``register_<command>``). This module knows the commands only by
name, in COMMANDS; it imports a group's module when the command line names one of its commands (or for --help), and
never the layers below (each handler imports what it needs when it runs)."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys

from llmadapt.cli.common import WatchedStdout, printable
from llmadapt.errors import ExitCode, LlmadaptError, Terminated, did_you_mean, exit_code_of, os_error_line

# Every command and the cli/ module that registers it (its ``register_<command>``, '-' written '_'), in the order
# `llmadapt --help` lists them.
COMMANDS = (("run", "runs"), ("compare", "runs"), ("load-sweep", "serving"), ("sla", "serving"), ("sweep", "sweep"),
            ("parity", "runs"), ("show", "results"), ("export", "results"), ("runs", "results"),
            ("regress", "results"), ("report", "results"), ("trace", "results"), ("hta", "results"),
            ("adapters", "env"), ("schema", "env"), ("env", "env"), ("micro", "perf"), ("estimate", "perf"),
            ("devices", "perf"), ("maxbatch", "perf"), ("studyb", "perf"), ("tune", "tune"))

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
    """The parser of every command; ``only``: of that command alone (the one argv names; the others' options would
    never be read, and building them all is a fifth of `llmadapt adapters`' start), or of every command when no
    command has that name (the error then names the closest)."""
    from llmadapt.host import VERSION

    parser = _Parser(prog="llmadapt", description="Run one LLM workload on several stacks and "
                     "compare the traces.", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"llmadapt {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    whole = only not in {name for name, _ in COMMANDS}
    for name, group in COMMANDS:
        if whole or name == only:
            register = getattr(importlib.import_module(f"llmadapt.cli.{group}"), f"register_{name.replace('-', '_')}")
            register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv and not argv[0].startswith("-") else None).parse_args(argv)
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
