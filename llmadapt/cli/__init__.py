"""The ``llmadapt`` command line: a thin layer over the Python API, one module per group of commands
(runs, env, perf), parsed in main."""

from __future__ import annotations

from llmadapt.cli.main import main

__all__ = ["main"]
