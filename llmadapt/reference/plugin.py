"""Registers the reference adapter through the ``llmadapt`` entry-point group, like any third-party
adapter (see pyproject.toml). Light: nothing here imports torch."""

from __future__ import annotations

from llmadapt.adapter import TOOLS_ENVIRONMENT, VERSION, AdapterInfo, EnvironmentSpec, Supports, hookimpl

ENVIRONMENT = EnvironmentSpec(name="torch", requirements=TOOLS_ENVIRONMENT.requirements)
"""The core's tools environment under the reference adapters' own name (`llmadapt env create torch`,
LLMADAPT_PYTHON_TORCH): the same recipe, so the same build."""


def check(workload):
    """The reference adapter's rule that `Supports` cannot express."""
    if workload.model.family == "jamba" and workload.optimizations.quantization != "none":
        return [("optimizations.quantization", workload.optimizations.quantization,
                 "none for jamba (its Mamba mixer reads dt_proj's weight directly, which a quantized linear packs; "
                 "not exercised)")]
    return []


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="torch",
        version=VERSION,
        framework="torch",
        roles={"train": "llmadapt.reference.trainer:TorchTrainer",
               "finetune": "llmadapt.reference.trainer:TorchFineTuner"},
        environment=ENVIRONMENT,
        supports=Supports(
            precisions=("fp32", "bf16"),
            dp=True,
            recompute=("none", "full"),
            flash_attention=True,
            quantization=("none", "int8", "nf4", "fp4"),
            lora=True,
            moe=True,
            families=("llama", "mixtral", "jamba"),
            save=True,
            packing=True,
        ),
        check=check,
        description="Plain PyTorch + transformers: DDP over gloo/NCCL, gradient checkpointing, peft LoRA, "
                    "bitsandbytes QLoRA. The reference every other adapter is compared against.",
    ))
    register(AdapterInfo(
        name="hf",
        version=VERSION,
        framework="transformers-serve",
        roles={"serve": "llmadapt.reference.serve:HFServer", "offline": "llmadapt.reference.offline:HFOffline"},
        environment=ENVIRONMENT,
        # --cb-max-batch-tokens; the profile from llmadapt.reference.profiled_serve
        supports=Supports(engine=("max_batched_tokens",), engine_profile=True),
        description="transformers' own OpenAI-compatible server (continuous batching) on the canonical checkpoint, "
                    "as a subprocess: the reference for serving.",
    ))
