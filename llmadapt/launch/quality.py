"""Quality beside speed (serve.quality), from the orchestrator: after a load point's measured requests, the
held-out texts sent to the engine (llmadapt.runtime.quality.probe), then scored against transformers' fp32
decoding of the same checkpoint in the tools environment (llmadapt.runtime.quality_reference), as one Quality
record in the run's trace."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import attrs

from llmadapt.contract.records import Quality
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError

REFERENCE_TIMEOUT_S = 1800.0


async def measure(server, session, workload, checkpoint: Path | None, run_dir: Path) -> Quality:
    """The engine's answers to the held-out texts, scored; an LlmadaptError (one line) where it cannot be."""
    from llmadapt.runtime.quality import probe

    spec = workload.serve.quality
    if checkpoint is None:
        raise LlmadaptError("serve.quality needs the checkpoint the engine serves (an attached server's is unknown)")
    entries = await probe(server, session, spec)
    given = {"checkpoint": str(Path(checkpoint).absolute()), "output_tokens": spec.output_tokens,
             "top_logprobs": spec.top_logprobs, "entries": entries}
    RunDir(run_dir).quality_file.write_text(json.dumps(given, indent=1))
    return attrs.evolve(reference_scores(given), gate_min_share=spec.min_share,
                        gate_output_tolerance=spec.output_tolerance)


def reference_scores(given: dict) -> Quality:
    """Run the fp32 reference over the probe's entries (in the tools environment) and read its verdict back."""
    from llmadapt.adapter.declaration import TOOLS_ENVIRONMENT
    from llmadapt.launch.environments import process_env, python_for

    with tempfile.TemporaryDirectory(prefix="llmadapt-quality-") as tmp:
        src, dst = Path(tmp, "in.json"), Path(tmp, "out.json")
        src.write_text(json.dumps(given))
        out = subprocess.run([str(python_for(TOOLS_ENVIRONMENT)), "-m", "llmadapt.runtime.quality_reference",
                              str(src), str(dst)], capture_output=True, text=True, check=False,
                             env=process_env(TOOLS_ENVIRONMENT), timeout=REFERENCE_TIMEOUT_S)
        if out.returncode or not dst.is_file():
            last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise LlmadaptError(f"the quality reference (transformers fp32) failed: {last}")
        return Quality(**json.loads(dst.read_text()))
