"""Experiments: the commands that plan several runs and launch them, each through ``llmadapt.launch``'s entry
points (``launch.runner.run`` for a run, ``launch.serve`` for serving points against one engine).

- compare: cells (adapters, layouts) on a matrix of overrides, repeated in shuffled rounds, reused, settled;
- parity: two cells of one problem, their losses checked step by step;
- sweep: a sweep file's cells with stable ids and a state each, here or as a Slurm job array;
- maxbatch: the largest batch that fits, by real probes;
- loadsweep: serving at several loads against one engine (load-sweep), and the SLA search (sla);
- micro: micro-benchmarks (operators, peaks, collectives) in the tools environment.

The layer sits above launch and below the command line; ``llmadapt.analysis`` below it only reads run folders and
the store (the tables, the verdicts, ``read_maxbatch``, ``read_micro``).
"""

from __future__ import annotations

from llmadapt.experiments.compare import compare
from llmadapt.experiments.parity import parity

__all__ = ["compare", "parity"]
