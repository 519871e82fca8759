"""The command line imports only what the command it runs needs: `llmadapt --help` builds the parser alone, and
`llmadapt adapters` reads the adapters' declarations and their environments' status, neither the analysis nor
the worker runtime (nor torch). Checked in a fresh interpreter, by what is in sys.modules at the end; the
timings are benchmarks/cli_startup.py's (docs/status.md), not a test's."""

import json
import subprocess
import sys

import pytest

# Runs the command line as the console script does, then reports the modules it imported, on stderr's last line.
PROBE = """
import json, sys
sys.argv = ["llmadapt", *sys.argv[1:]]
from llmadapt.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def imported(*args: str, cwd) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["code"] == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return report["modules"]


def of(modules: list[str], package: str) -> list[str]:
    return [m for m in modules if m == package or m.startswith(package + ".")]


@pytest.mark.parametrize("args, ran, absent", [
    (["--help"], "llmadapt.cli.main", ["llmadapt.analysis", "llmadapt.launch", "llmadapt.runtime", "torch"]),
    (["adapters"], "llmadapt.reference.plugin", ["llmadapt.analysis", "llmadapt.runtime", "torch"]),
])
def test_a_command_imports_only_what_it_needs(tmp_path, args, ran, absent):
    modules = imported(*args, cwd=tmp_path)
    assert ran in modules  # the command did what it does: built the parser, loaded the plugins
    assert {name: of(modules, name) for name in absent} == {name: [] for name in absent}


def test_the_probe_sees_a_layer_a_command_imports(tmp_path):
    """The check above can fail: listing the run store (`llmadapt runs`) needs the analysis, and the probe sees it."""
    assert of(imported("runs", "--root", str(tmp_path), cwd=tmp_path), "llmadapt.analysis")


def _options(parser) -> list:
    """Every argument of a parser and of its subcommands, recursively: flags, destination, default, nargs."""
    import argparse

    out = []
    for action in parser._actions:
        out.append((tuple(action.option_strings), action.dest, repr(action.default), action.nargs, action.help))
        if isinstance(action, argparse._SubParsersAction):
            out += [(name, _options(sub)) for name, sub in action.choices.items()]
    return out


def test_the_parser_of_one_command_is_that_command_of_the_whole_parser():
    """The command line builds only the parser of the command it is given (the others' options would never be
    read): each command's parser built alone is the one the whole parser holds, and an unknown command gets the
    whole parser, whose error names the closest command."""
    from llmadapt.cli.main import build_parser

    whole = build_parser()
    (commands,) = [a for a in whole._actions if a.choices and a.dest == "command"]
    assert len(commands.choices) > 15
    for name, sub in commands.choices.items():
        (alone,) = [a for a in build_parser(name)._actions if a.dest == "command"]
        assert list(alone.choices) == [name] and _options(alone.choices[name]) == _options(sub), name
    assert len([a for a in build_parser("adaptrs")._actions if a.dest == "command"][0].choices) == len(
        commands.choices)
