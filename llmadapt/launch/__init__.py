"""The orchestrator: checks a request, builds the run folder, starts and supervises the workers (locally,
torchrun across nodes, Slurm), serves, gathers records and writes the summary. Never imports torch.

- run: ``run()``, the entry point, and ``RunResult``
- settings: launchers, ``NodeSettings``, the run options checked before anything starts
- supervise: worker command lines and environments, process supervision, exit codes read as failures
- multinode, collect, slurm: several machines
- serve: a serving run (engine start, load generator, engine metrics)
- summary: the records of a run folder, read back and summarised
- environments, prepare: adapters' virtualenvs and the canonical checkpoint
"""

from __future__ import annotations

from llmadapt.launch.run import run
from llmadapt.launch.settings import LAUNCHERS, NodeSettings
from llmadapt.launch.summary import RunResult, load_records, summarise
from llmadapt.launch.supervise import kill_tagged, worker_command

__all__ = ["LAUNCHERS", "NodeSettings", "RunResult", "kill_tagged", "load_records", "run", "summarise", "worker_command"]
