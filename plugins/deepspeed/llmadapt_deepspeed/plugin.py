"""Registers the ``deepspeed`` adapter. Runs in the orchestrator, so it stays light: no torch, no deepspeed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmadapt.adapter import AdapterInfo, EnvironmentSpec, Supports, hookimpl

from . import __version__

# Exact pins for the adapter's own virtualenv: the reference adapter's stack, DeepSpeed, and
# DeepSpeed's pure-Python dependencies (numpy, packaging, psutil, pydantic and tqdm come pinned
# at the versions the stack above resolves to, so the environment is reproducible).
REQUIREMENTS = (
    "torch==2.13.0",
    "deepspeed==0.19.8",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "peft==0.21.2",
    "bitsandbytes==0.50.2",
    "accelerate==1.15.0",
    "einops==0.8.2",
    "hjson==3.1.0",
    "msgpack==1.2.4",
    "ninja==1.13.2",
    "py-cpuinfo==9.0.0",
    "numpy==2.4.6",
    "packaging==26.4",
    "psutil==7.2.2",
    "pydantic==2.14.4",
    "tqdm==4.70.1",
)

ENVIRONMENT = EnvironmentSpec(
    name="deepspeed",
    requirements=REQUIREMENTS,
    local_packages=(str(Path(__file__).resolve().parents[1]),),
    # DeepSpeed is an sdist: build no C++/CUDA op at install (ops the adapter uses by default
    # are pure torch), and pick the CPU accelerator so nothing probes for CUDA while building.
    install_env=(("DS_BUILD_OPS", "0"), ("DS_ACCELERATOR", "cpu")),
)

RUN_FILES = {"hostfile": "DeepSpeed's launcher only: its hostfile, `localhost slots=N` (launcher.py says why)"}
"""What the adapter writes in a run folder beside the core's files (AdapterInfo.run_files)."""

FP16_ON_CPU = "fp16 is not supported by DeepSpeed on CPU"
CPU_ADAM_ON_CUDA = ("DeepSpeedCPUAdam updates parameters held in host memory: on a CUDA device it needs "
                    "optimizations.offload = optimizer or optimizer+params")


def _deepspeed_launcher(python, run_dir, world: int, port: int) -> list[str]:
    """DeepSpeed's runner as llmadapt's launcher ``deepspeed`` (see launcher.py), pinned to CPU without a GPU."""
    from .launcher import deepspeed_launch_command

    return deepspeed_launch_command(python, run_dir, world, port, cpu=not cuda_visible())


def cuda_visible(environ: dict[str, str] | None = None) -> bool:
    """Whether a worker started from here would run on a CUDA device, decided without importing torch.

    Mirrors the worker's own choice (``llmadapt.runtime``: CUDA when available unless
    ``LLMADAPT_DEVICE=cpu``): no NVIDIA device node under /dev, an empty or "-1"
    ``CUDA_VISIBLE_DEVICES``, or ``LLMADAPT_DEVICE=cpu`` all mean CPU.
    """
    env = os.environ if environ is None else environ
    if env.get("LLMADAPT_DEVICE", "auto") == "cpu":
        return False
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def check(workload) -> list[tuple[str, Any, str]]:
    """DeepSpeed's rules that `Supports` cannot express. Must not import torch or deepspeed.

    The offload rules DeepSpeed has (optimizer offload needs ZeRO >= 1, parameter offload
    ZeRO-3) are the workload's own and refused when it is built; every other combination of
    ZeRO stage, offload, recomputation, LoRA, QLoRA (nf4), MoE, dp and optimizer implementation was
    run on CPU (README). DeepSpeedCPUAdam without offload is CPU-only: on a GPU DeepSpeed's
    optimizer would hold device parameters that CPU Adam cannot update.
    """
    out: list[tuple[str, Any, str]] = []
    if workload.precision == "fp16" and not cuda_visible():
        out.append(("precision", "fp16", f"{FP16_ON_CPU}; use fp32 or bf16 (no CUDA device is visible here)"))
    if (workload.train.optimizer_impl == "cpu_adam" and workload.optimizations.offload == "none"
            and cuda_visible()):
        out.append(("train.optimizer_impl", "cpu_adam", CPU_ADAM_ON_CUDA))
    if workload.model.family == "jamba" and workload.optimizations.quantization != "none":
        out.append(("optimizations.quantization", workload.optimizations.quantization,
                    "none for jamba (its Mamba mixer reads dt_proj's weight directly, which a quantized linear "
                    "packs; not exercised)"))
    return out


SUPPORTS = Supports(
    precisions=("fp32", "bf16", "fp16"),  # fp16 only on CUDA: see check()
    dp=True,
    zero_stages=(0, 1, 2, 3),
    offload=("none", "optimizer", "optimizer+params"),
    # full: every decoder layer recomputed by DeepSpeed's activation checkpointing;
    # selective: only each layer's self-attention block (README: "Recomputation").
    recompute=("none", "selective", "full"),
    flash_attention=True,
    # QLoRA: bitsandbytes nf4 base weights under the engine, as the reference loads them. (LLM.int8 base
    # weights ran too, by hand, but no test exercises them: not declared.)
    quantization=("none", "nf4", "fp4"),
    lora=True,
    moe=True,
    families=("llama", "mixtral", "jamba"),  # jamba: transformers' JambaForCausalLM, ZeRO 0-3 (see trainer)
    # torch.optim (default, nothing compiles) or DeepSpeedCPUAdam (C++, JIT-compiled once per machine).
    optimizer_impls=("torch", "cpu_adam"),
    save=True,  # ZeRO-3 partitions gathered; LoRA merged
    packing=True,  # the packed rows' 4D mask and position ids go to transformers' model (MicroBatch.model_inputs)
)


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="deepspeed",
        version=__version__,
        framework="deepspeed",
        roles={"train": "llmadapt_deepspeed.trainer:DeepSpeedTrainer",
               "finetune": "llmadapt_deepspeed.trainer:DeepSpeedFineTuner"},
        environment=ENVIRONMENT,
        supports=SUPPORTS,
        check=check,
        launchers={"deepspeed": _deepspeed_launcher},
        run_files=RUN_FILES,
        description="DeepSpeed engine on transformers' model: ZeRO 0-3, CPU offload of optimizer and parameters, "
                    "DeepSpeedCPUAdam, DeepSpeed activation checkpointing, peft LoRA and QLoRA, HF Mixtral MoE; "
                    "wall-clock timers, comms logger and FLOPs profiler reported as records.",
    ))
