"""The canonical checkpoint, built before any worker starts.

``python -m llmadapt.models MODEL_JSON SEED`` builds (or finds) it in the environment that runs
the command and prints its path. The orchestrator (which has no torch) calls it with an
environment's interpreter: the adapter's own, or the reference environment's when the adapter's
transformers cannot build it (``EnvironmentSpec.builds_checkpoint``). Building it once, up front,
keeps every adapter on identical weights and keeps ranks from racing to build it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import attrs

from llmadapt.adapter.declaration import EnvironmentSpec
from llmadapt.errors import LlmadaptError
from llmadapt.host import state_dir
from llmadapt.launch.environments import process_env, python_for
from llmadapt.spec import Workload


def checkpoint_dir(workload: Workload) -> Path:
    from llmadapt.models import checkpoint_key

    return state_dir() / "checkpoints" / checkpoint_key(workload.model, workload.seed)


def ensure_checkpoint(workload: Workload, environment: EnvironmentSpec) -> Path:
    """The canonical checkpoint of the workload, built with the right environment if missing."""
    target = checkpoint_dir(workload)
    if (target / "READY").is_file():
        return target
    if not environment.builds_checkpoint:
        from llmadapt.launch.environments import REFERENCE_ENVIRONMENT

        environment = REFERENCE_ENVIRONMENT
    python = python_for(environment)
    out = subprocess.run([str(python), "-m", "llmadapt.models", json.dumps(attrs.asdict(workload.model)),
                          str(workload.seed)], capture_output=True, text=True, check=False,
                         env=process_env(environment))
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LlmadaptError(f"building the canonical checkpoint in environment {environment.name!r} failed: {last}")
    return Path(out.stdout.strip().splitlines()[-1])
