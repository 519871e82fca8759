"""The orchestrator: checks a request, builds the run folder, starts and supervises the workers (locally,
torchrun across nodes, Slurm), serves, gathers records and writes the summary. Never imports torch.

- runner: ``run()``, the entry point, and ``RunResult`` (a module not named ``run``, so that importing it never
  hides the function ``llmadapt.launch.run``)
- settings: launchers, ``NodeSettings``, the run options checked before anything starts
- supervise: worker command lines and environments, process supervision, exit codes read as failures
- multinode, collect, slurm: several machines
- serve: a serving run (engine start, load generator, engine metrics)
- summary: the old home of the run-folder read-back (llmadapt.contract.readback), kept until 0.3.0
- environments, prepare: adapters' virtualenvs and the canonical checkpoint

The names below are imported on first use: `llmadapt adapters` reads environments' status without importing
the rest of the orchestrator (nor the worker runtime below it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and readers
    from llmadapt.launch.runner import run
    from llmadapt.launch.settings import LAUNCHERS, NodeSettings
    from llmadapt.contract.readback import RunResult, load_records, summarise
    from llmadapt.launch.supervise import kill_tagged, worker_command

__all__ = ["LAUNCHERS", "NodeSettings", "RunResult", "kill_tagged", "load_records", "run", "summarise", "worker_command"]

_HOME = {"run": "llmadapt.launch.runner", **dict.fromkeys(["LAUNCHERS", "NodeSettings"], "llmadapt.launch.settings"),
         **dict.fromkeys(["RunResult", "load_records", "summarise"], "llmadapt.contract.readback"),
         **dict.fromkeys(["kill_tagged", "worker_command"], "llmadapt.launch.supervise")}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value

