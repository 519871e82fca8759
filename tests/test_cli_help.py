"""What the command line shows and takes stays as recorded: the `--help` of every command and subcommand (the parser
walked to its leaves, rendered 100 columns wide), and what every command written in docs/*.md and README.md parses
to (the options each ends with, or its error). The record is tests/data/cli-help.txt; a change to the command line
shows as a diff against it. After an intended change, write it again with LLMADAPT_WRITE_CLI_HELP=1 and read the
diff before committing it."""

import argparse
import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "cli-help.txt"
COLUMNS = "100"
SHELL = {">", ">>", "|", "&&", "||", ";", "2>&1", "&"}  # where a documented line stops being llmadapt's arguments


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(argv to the parser, the parser) for the parser and each of its subcommands, depth first, in help order."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _documented() -> list[tuple[str, str]]:
    """(page, command line) for every `llmadapt ...` command in the docs' code blocks and inline code, with its
    continuation lines joined (the page, not the line: an edit above a command does not change the record)."""
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        text = page.read_text()
        name = page.relative_to(ROOT).as_posix()
        fenced = False
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                command = re.sub(r"^\s*\$\s*", "", line).strip()
                if command.startswith("llmadapt "):
                    j = i
                    while command.endswith("\\") and j + 1 < len(lines):
                        j += 1
                        command = command[:-1].rstrip() + " " + lines[j].strip()
                    found.append((name, command))
            else:
                found += [(name, m) for m in re.findall(r"`(llmadapt [^`]+)`", line)]
    return found


def _parsed(build_parser, command: str) -> str:
    """What the parser makes of a command line, built as cli.main builds it: its options, sorted, or its exit and
    the last lines it printed."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError as exc:
        return f"not a command line: {exc}"
    words = words[1:next((i for i, w in enumerate(words) if w in SHELL), len(words))]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            args = build_parser(words[0] if words and not words[0].startswith("-") else None).parse_args(words)
    except SystemExit as exc:
        text = out.getvalue()
        if words[:1] == ["--version"]:
            text = "llmadapt VERSION"
        return f"exit {exc.code}: " + " | ".join(line for line in text.strip().splitlines()[-3:])
    return " ".join(f"{k}={getattr(v, '__name__', v)!r}" for k, v in sorted(vars(args).items()))


def render() -> str:
    from llmadapt.cli.main import build_parser

    parts = []
    for path, _ in _parsers(build_parser()):
        # as `llmadapt PATH --help` prints it: from the parser main builds for that command alone
        parser = dict(_parsers(build_parser(path[0]) if path else build_parser()))[path]
        parts.append(f"==== llmadapt {' '.join((*path, '--help'))}\n{parser.format_help()}")
    parts.append("==== documented commands, as parsed")
    for where, command in _documented():
        parts.append(f"{where}: $ {command}\n    {_parsed(build_parser, command)}")
    return "\n".join(parts) + "\n"


def test_every_help_and_documented_command_is_as_recorded(monkeypatch):
    monkeypatch.setenv("COLUMNS", COLUMNS)  # argparse wraps help to the terminal's width
    text = render()
    if os.environ.get("LLMADAPT_WRITE_CLI_HELP"):
        RECORD.write_text(text)
    assert text == RECORD.read_text()


def test_the_record_covers_every_command_and_some_documented_ones(monkeypatch):
    """The comparison above can fail: the record names every subcommand's help, and documented command lines that
    parse (their options) as well as ones that do not (their error)."""
    monkeypatch.setenv("COLUMNS", COLUMNS)
    from llmadapt.cli.main import build_parser

    record = RECORD.read_text()
    leaves = [path for path, _ in _parsers(build_parser())]
    assert len(leaves) > 25 and ("micro", "ops") in leaves and ("env", "prune") in leaves
    for path in leaves:
        assert f"==== llmadapt {' '.join((*path, '--help'))}\n" in record, path
    documented = _documented()
    assert len(documented) > 50
    assert "command='compare'" in record and "func='cmd_compare'" in record
    with monkeypatch.context() as m:
        m.setenv("COLUMNS", "60")  # the width is what the record was rendered at: another one differs
        assert render() != record


@pytest.mark.parametrize("command, expected", [
    ("llmadapt show runs/x --json | jq .", "command='show' func='cmd_show' json=True run='runs/x'"),
    ("llmadapt compre x.toml", "exit 2: "),
])
def test_a_documented_line_is_parsed_up_to_the_shell(command, expected):
    from llmadapt.cli.main import build_parser

    assert _parsed(build_parser, command).startswith(expected)


def test_each_command_is_registered_beside_its_handlers():
    """One convention: the module that registers a command (cli/main.py's COMMANDS) holds the handler of it and of
    each of its subcommands, and every registering function of a group is in the table (none left unused)."""
    import importlib
    import inspect

    from llmadapt.cli.main import COMMANDS, build_parser

    for name, group in COMMANDS:
        leaves = [p for path, p in _parsers(build_parser(name)) if path[:1] == (name,)]
        handlers = {p.get_default("func") for p in leaves} - {None}
        assert handlers and {h.__module__ for h in handlers} == {f"llmadapt.cli.{group}"}, name
    for group in {group for _, group in COMMANDS}:
        module = importlib.import_module(f"llmadapt.cli.{group}")
        registered = {n for n, f in inspect.getmembers(module, inspect.isfunction)
                      if n.startswith("register_") and f.__module__ == module.__name__}
        assert registered == {f"register_{n.replace('-', '_')}" for n, g in COMMANDS if g == group}, group
