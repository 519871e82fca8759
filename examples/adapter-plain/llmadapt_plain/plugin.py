"""Registers the ``plain`` adapter. Runs in the orchestrator, so it stays light: no torch here."""

from __future__ import annotations

from pathlib import Path

from llmadapt.adapter import AdapterInfo, EnvironmentSpec, Supports, hookimpl

from . import __version__

# Exact pins for the adapter's own virtualenv (the same stack as the reference adapter's).
REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "peft==0.21.2",
    "bitsandbytes==0.50.2",
    "accelerate==1.15.0",
)

ENVIRONMENT = EnvironmentSpec(
    name="plain",
    requirements=REQUIREMENTS,
    # This package's source folder: workers import trainer.py from it (on PYTHONPATH; nothing is installed).
    local_packages=(str(Path(__file__).resolve().parents[1]),),
)


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="plain",
        version=__version__,
        framework="torch",
        roles={"train": "llmadapt_plain.trainer:PlainTrainer",
               "finetune": "llmadapt_plain.trainer:PlainFineTuner",
               "serve": "llmadapt_plain.server:PlainServer"},
        environment=ENVIRONMENT,
        supports=Supports(precisions=("fp32",)),  # one rank, fp32, dense models, no LoRA
        description="Worked example: transformers' model and a hand-written fp32 loop on one rank; served by a "
                    "hand-written greedy decoder over the OpenAI completions API.",
    ))
