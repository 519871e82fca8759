"""The worker kinds, and the one worker entry point: ``python -m llmadapt.runtime RUN_DIR``.

Every process the launcher starts to do a run's work runs this. It reads the run's launch record and picks the
kind's module from ``WORKER_KINDS``; each kind is one module with one function ``run(run_dir) -> exit code``,
which runs inside llmadapt.runtime.lifecycle's shell (stop signal, orphan watch, End or failure record).

A new kind: its module under runtime/ (a ``run`` function), one entry here, and ``kind_of`` told how its launch
record says so (a new ``LaunchRequest.kind``, say); launch.supervise starts it like any other.
"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs

from llmadapt.adapter.declaration import load_role
from llmadapt.contract.launch import LaunchRequest
from llmadapt.runtime import lifecycle

USAGE = "usage: python -m llmadapt.runtime RUN_DIR"


@attrs.frozen
class WorkerKind:
    run: str
    """'module:function' of ``run(run_dir) -> exit code``, imported only when this kind runs."""
    hard_exit: bool = True
    """End with ``lifecycle.exit_process`` (no finalisers racing gloo's threads); False: as Python does, so that an
    engine's own exit hooks run (the offline worker has no process group)."""


WORKER_KINDS: dict[str, WorkerKind] = {
    "train": WorkerKind("llmadapt.runtime.worker:run_worker"),
    "micro": WorkerKind("llmadapt.runtime.microbench:run_micro"),
    "offline": WorkerKind("llmadapt.runtime.offline:run_offline", hard_exit=False),
}
"""The kind's name -> how it runs. 'train' covers training and fine-tuning ranks."""


def kind_of(launch: LaunchRequest) -> str:
    """The worker kind a launch record asks for."""
    if launch.kind == "micro":
        return "micro"
    if launch.launcher == "offline":
        return "offline"
    return "train"


def main(argv: list[str] | None = None) -> None:
    """``python -m llmadapt.runtime RUN_DIR``: the run's kind of worker, to its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    run_dir = Path(argv[0])
    kind = WORKER_KINDS[kind_of(lifecycle.launch_record(run_dir))]
    code = load_role(kind.run)(run_dir)
    if kind.hard_exit:
        lifecycle.exit_process(code)  # no finalisers: see llmadapt.runtime.lifecycle
    sys.stdout.flush()
    raise SystemExit(code)
