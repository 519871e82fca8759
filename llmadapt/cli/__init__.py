"""The ``llmadapt`` command line: a thin layer over the Python API, one module per group of commands (runs,
results, serving, sweep, env, perf, tune), each registering its commands' options beside their handlers; main
holds the parser, the table of commands, exit codes and signal handling."""

from __future__ import annotations

from llmadapt.cli.main import main

__all__ = ["main"]
