"""How many of llmadapt's files does one `compare` pass through, and how often does it come back to one?

A reader who follows `llmadapt compare` from the command line to the printed table opens every file whose code
runs. This script runs the README's main job (the tiny llama, torch adapter, recompute off/on, one and two ranks)
in this process with a profiler on, and keeps the first call of each llmadapt function in the orchestrator
(workers are other processes, and the adapters' code is outside this count). In that order of first calls:

- files: how many llmadapt modules hold code that ran (module and class bodies, i.e. imports, not counted; nor are
  functions the import system calls, such as the finder of the old module paths);
- stays: consecutive first calls in one file are one stay; a walk from file to file;
- returns: stays in a file visited before (stays minus files): how often the reader goes back;
- launch entries: stays in llmadapt/launch/ (the orchestrator).

Each is given three ways: every function; the calls a reader follows (no dunder methods such as attrs'
``__attrs_post_init__`` and no properties); and those outside ``cli/`` (the orchestrator's walk from where the
command line hands over).

    python benchmarks/compare_walk.py                 # the README's main job, 4 measured steps
    python benchmarks/compare_walk.py --list          # and each file's functions, in the order they first ran
    python benchmarks/compare_walk.py --smoke         # one cell, one rank, 2 steps (CI's smoke pass)

Needs the torch adapter's environment (`llmadapt env create torch`). Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import itertools
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CO_NEWLOCALS = 0x2  # set on functions' code, not on module or class bodies


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="measured steps per cell (default 4: the walk does not "
                                                         "depend on them)")
    p.add_argument("--list", action="store_true", help="also list each file's functions in first-call order")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--smoke", action="store_true", help="one cell on one rank, 2 steps: a pass that shows the "
                                                        "script works; its figures are not the main job's")
    return p.parse_args(argv)


def command(args: argparse.Namespace) -> list[str]:
    """The compare to walk (its --out is added where it runs)."""
    cmd = ["compare", str(ROOT / "examples" / "tiny-llama.toml"), "--adapters", "torch"]
    if args.smoke:
        return cmd + ["--set", "train.steps=2"]
    return cmd + ["--set", f"train.steps={args.steps}", "--matrix", "optimizations.recompute=none,full",
                  "--matrix", "parallelism.dp=1,2"]


def kind(frame) -> str:
    """"dunder", "property" (a property's or cached_property's getter) or "function"."""
    code = frame.f_code
    if code.co_name.startswith("__") and code.co_name.endswith("__"):
        return "dunder"
    if code.co_argcount and code.co_varnames[0] == "self":
        for cls in type(frame.f_locals.get("self")).__mro__:
            found = cls.__dict__.get(code.co_name)
            if found is not None:
                return "property" if isinstance(found, (property, functools.cached_property)) else "function"
    return "function"


def trace(argv: list[str]) -> tuple[list[tuple[str, str, int, str]], int, str]:
    """(file, function, first line, kind) of every llmadapt function call, the command's exit code and its
    output."""
    import llmadapt
    from llmadapt.cli import main

    package = str(Path(llmadapt.__file__).resolve().parent) + os.sep
    calls: list[tuple[str, str, int, str]] = []

    def on_event(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(package) and code.co_flags & CO_NEWLOCALS and not (
                frame.f_back and frame.f_back.f_code.co_filename.startswith("<frozen importlib")):
            calls.append((code.co_filename[len(package):], code.co_name, code.co_firstlineno, kind(frame)))

    sys.argv, out, exit_code = ["llmadapt", *argv], io.StringIO(), 0
    threading.setprofile(on_event)
    sys.setprofile(on_event)
    try:
        with contextlib.redirect_stdout(out):
            main()
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return calls, exit_code, out.getvalue()


MEASURES = {
    "all": lambda call: True,
    "followed": lambda call: call[3] == "function",
    "followed, outside cli/": lambda call: call[3] == "function" and not call[0].startswith("cli" + os.sep),
}
"""Which calls each measure keeps: every function; the calls a reader follows (no dunders, no properties); and of
those, the ones outside the command line's layer."""


def walk(calls: list[tuple[str, str, int, str]], keep=MEASURES["all"]) -> dict:
    """Files, stays, returns and launch entries of the first calls that ``keep`` keeps (comprehensions and lambdas
    belong to their function: left out)."""
    first, seen = [], set()
    for call in calls:
        if call[:3] not in seen and not call[1].startswith("<") and keep(call):
            seen.add(call[:3])
            first.append(call)
    stays = [f for f, _ in itertools.groupby(c[0] for c in first)]
    files = sorted(set(stays))
    by_file = {f: [c[1] for c in first if c[0] == f] for f in files}
    return {"functions": len(first), "files": len(files), "stays": len(stays), "returns": len(stays) - len(files),
            "launch_entries": sum(s.startswith("launch" + os.sep) for s in stays), "by_file": by_file}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cmd = command(args)
    with tempfile.TemporaryDirectory() as tmp:
        calls, code, output = trace([*cmd, "--out", str(Path(tmp) / "runs")])
    shown = " ".join(["llmadapt", *cmd]).replace(str(ROOT) + os.sep, "")  # the example's path from the checkout
    result = {"command": shown, "exit_code": code, **walk(calls),
              "measures": {name: {k: v for k, v in walk(calls, keep).items() if k != "by_file"}
                           for name, keep in MEASURES.items()}}
    if code:
        print(output[-3000:], file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"exit code {code}")
        for name, m in result["measures"].items():
            print(f"{m['files']} files, {m['stays']} stays, {m['returns']} returns, {m['launch_entries']} entries "
                  f"into launch/; {m['functions']} functions ({name})")
        if args.list:
            for f, names in result["by_file"].items():
                print(f"  {len(names):3d} {f}: {' '.join(names)}")
    return 1 if code else 0


if __name__ == "__main__":
    sys.exit(main())
