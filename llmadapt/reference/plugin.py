"""Registers the reference adapter through the ``llmadapt`` entry-point group, like any third-party
adapter (see pyproject.toml). Light: nothing here imports torch."""

from __future__ import annotations

from llmadapt import AdapterInfo, EnvironmentSpec, Supports, __version__, hookimpl

REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "peft==0.21.2",
    "bitsandbytes==0.50.2",
    "accelerate==1.15.0",
    # `transformers serve` (the hf server) needs these next to transformers
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "openai==3.57.0",
    "rich==15.0.0",
    "requests==2.34.2",
)

TORCH_ENV = EnvironmentSpec(name="torch", requirements=REQUIREMENTS)


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="torch",
        version=__version__,
        framework="torch",
        roles={"train": "llmadapt.reference.trainer:TorchTrainer",
               "finetune": "llmadapt.reference.trainer:TorchFineTuner"},
        environment=TORCH_ENV,
        supports=Supports(
            precisions=("fp32", "bf16"),
            dp=True,
            recompute=("none", "full"),
            flash_attention=True,
            quantization=("none", "int8", "nf4"),
            lora=True,
            moe=True,
        ),
        description="Plain PyTorch + transformers: DDP over gloo/NCCL, gradient checkpointing, peft LoRA, "
                    "bitsandbytes QLoRA. The reference every other adapter is compared against.",
    ))
    register(AdapterInfo(
        name="hf",
        version=__version__,
        framework="transformers-serve",
        roles={"serve": "llmadapt.reference.serve:HFServer"},
        environment=TORCH_ENV,
        description="transformers' own OpenAI-compatible server (continuous batching) on the canonical checkpoint, "
                    "as a subprocess: the reference for serving.",
    ))
