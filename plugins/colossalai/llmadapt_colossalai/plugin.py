"""Registers the ``colossalai`` adapter. Runs in the orchestrator, so it stays light: no torch, no colossalai.

How a workload maps to a ColossalAI Booster plugin (``booster_plugin``; the README explains each):

| workload                                   | Booster plugin                                   |
| ------------------------------------------ | ------------------------------------------------ |
| dense, tp = pp = 1, zero_stage 0 (any dp)  | TorchDDPPlugin                                   |
| dense, tp = pp = 1, zero_stage 1 or 2      | LowLevelZeroPlugin(stage=1 or 2)                 |
| dense, tp = pp = 1, zero_stage 3           | TorchFSDPPlugin (FULL_SHARD, one unit per layer) |
| dense, tp > 1 or pp > 1                    | HybridParallelPlugin(tp_size, pp_size, 1F1B)     |
| MoE (any ep, tp = pp = 1)                  | MoeHybridParallelPlugin(ep_size)                 |

GeminiPlugin is never chosen: its CPUAdam/HybridAdam kernels link libcudart, so it cannot run
without CUDA, and the workload's ZeRO-3 maps to TorchFSDPPlugin instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmadapt.adapter import AdapterInfo, EnvironmentSpec, Supports, hookimpl

from . import __version__

# ColossalAI 0.5.0 pins torch<=2.5.1 and transformers==4.51.3 in its metadata, so it cannot share
# an environment with the others, and pip cannot resolve it next to torch 2.13.0 (the torch every
# environment here shares). The recipe is therefore two pip calls:
#   1. these exact pins, resolved normally (ColossalAI's real dependencies, minus torch's pin);
#   2. NO_DEPS_REQUIREMENTS with --no-deps (their metadata would drag in torch 2.5.1, ray,
#      fabric, diffusers, ... that the Booster path never imports).
REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==4.51.3",
    "tokenizers==0.21.4",
    "huggingface-hub==0.36.2",
    "safetensors==0.8.0",
    "peft==0.13.2",
    "accelerate==1.15.0",
    "bitsandbytes==0.50.2",  # imported at top level by colossalai.nn.optimizer
    "numpy==2.4.6",
    "tqdm==4.70.1",
    "psutil==7.2.2",
    "packaging==26.4",
    "rich==15.0.0",
    "click==8.5.1",
    "contexttimer==0.3.3",
    "ninja==1.13.2",
    "einops==0.8.2",
    "pydantic==2.14.4",
    "sentencepiece==0.2.3",
    "protobuf==7.36.2",
)
NO_DEPS_REQUIREMENTS = (
    "colossalai==0.5.0",  # pure-Python sdist; BUILD_EXT unset: no CUDA extension is compiled
    "galore_torch==1.0",  # imported at top level by colossalai.nn.optimizer
)
PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


# `llmadapt env create colossalai` runs both pip calls. transformers 4.51.3 cannot write the canonical
# checkpoint, so the orchestrator builds it with the core's tools environment first (builds_checkpoint).
ENVIRONMENT = EnvironmentSpec(name="colossalai", requirements=REQUIREMENTS, no_deps_requirements=NO_DEPS_REQUIREMENTS,
                              local_packages=(PACKAGE_DIR,), builds_checkpoint=False)

SUPPORTS = Supports(
    precisions=("fp32", "bf16"),
    dp=True,
    tp=True,
    pp=True,
    ep=True,
    zero_stages=(0, 1, 2, 3),
    # optimizer+params is declared so that `check` can refuse it with the reason (Gemini).
    offload=("none", "optimizer", "optimizer+params"),
    recompute=("none", "full"),
    # ColossalAI's flash attention (shardformer enable_flash_attention) runs CUDA kernels: not on
    # CPU, and not wired for GPUs yet, so not declared (refused as "supported: false").
    flash_attention=False,
    lora=True,
    moe=True,
    save=True,  # ColossalAI's checkpoint IO gathers; LoRA runs are refused in check()
    # the packed rows' 4D mask and position ids go to transformers' model, whose forward shardformer keeps or
    # replaces by one that uses a 4D mask as given (tp, pp)
    packing=True,
)

GEMINI = ("ColossalAI offloads parameters only through GeminiPlugin, whose CPUAdam/HybridAdam kernels link "
          "libcudart: it cannot run without CUDA")


def booster_plugin(workload) -> str:
    """The ColossalAI Booster plugin a workload runs on (see the module docstring)."""
    p, zero = workload.parallelism, workload.optimizations.zero_stage
    if workload.model.is_moe:
        return "MoeHybridParallelPlugin"
    if p.tp > 1 or p.pp > 1:
        return "HybridParallelPlugin"
    if zero == 3:
        return "TorchFSDPPlugin"
    if zero in (1, 2):
        return "LowLevelZeroPlugin"
    return "TorchDDPPlugin"


def check(workload) -> list[tuple[str, Any, str]]:
    """ColossalAI's rules that `Supports` cannot express, each with its reason. Imports neither torch nor colossalai."""
    out: list[tuple[str, Any, str]] = []
    m, p, o = workload.model, workload.parallelism, workload.optimizations
    plugin = booster_plugin(workload)
    fp32 = workload.precision == "fp32"

    if o.offload == "optimizer+params":
        out.append(("optimizations.offload", o.offload, GEMINI))
    elif o.offload == "optimizer" and plugin != "LowLevelZeroPlugin":
        out.append(("optimizations.offload", o.offload,
                    f"optimizer offload runs on LowLevelZeroPlugin (dense, tp=pp=1, zero_stage 1 or 2); this workload "
                    f"maps to {plugin}"))

    if plugin == "MoeHybridParallelPlugin":
        if p.tp > 1 or p.pp > 1:
            out.append(("parallelism.tp" if p.tp > 1 else "parallelism.pp", p.tp if p.tp > 1 else p.pp,
                        "MoE runs on MoeHybridParallelPlugin with dp and ep only here (1); tensor/pipeline "
                        "parallel experts were not exercised"))
        if o.zero_stage >= 2:
            out.append(("optimizations.zero_stage", o.zero_stage,
                        "0 or 1 for MoE: MoeHybridParallelPlugin turns ZeRO-2 into ZeRO-1 itself (ZeRO-2 hangs when "
                        "an expert gets no tokens) and has no ZeRO-3"))
        if p.ep > 1 and (o.zero_stage != 1 or fp32):
            out.append(("parallelism.ep", p.ep,
                        "expert parallelism needs optimizations.zero_stage=1 and precision=bf16: with zero_stage 0 "
                        "MoeHybridParallelPlugin wraps the model in torch DDP, which reduces over one group and cannot "
                        "keep experts apart (0.5.0 then fails with a NameError), and its MoE ZeRO optimizer rejects "
                        "fp32"))
        elif o.zero_stage == 1 and fp32:
            out.append(("optimizations.zero_stage", 1,
                        "MoeHybridParallelPlugin's ZeRO optimizer rejects fp32 ('set precision to fp16 or bf16 when "
                        "using ZeRO'): use precision=bf16 or zero_stage=0"))
    elif plugin == "HybridParallelPlugin":
        if o.zero_stage == 3:
            out.append(("optimizations.zero_stage", 3,
                        "0-2 with tp/pp: HybridParallelPlugin has no ZeRO-3 and TorchFSDPPlugin cannot combine with "
                        "tensor or pipeline parallelism"))
        elif o.zero_stage == 2 and p.pp > 1:
            out.append(("optimizations.zero_stage", 2, "0 or 1 with pp > 1 (HybridParallelPlugin refuses ZeRO-2 "
                                                       "with pipeline parallelism)"))
        elif o.zero_stage > 0 and fp32:
            out.append(("optimizations.zero_stage", o.zero_stage,
                        "0 with tp/pp in fp32: HybridParallelPlugin's ZeRO optimizer rejects fp32 ('set precision to "
                        "fp16 or bf16 when using ZeRO'); use precision=bf16"))
        if p.tp > 1 and (m.hidden_size % p.tp or m.intermediate_size % p.tp or m.vocab_size % p.tp):
            out.append(("parallelism.tp", p.tp,
                        f"must divide model.hidden_size={m.hidden_size}, intermediate_size={m.intermediate_size} and "
                        f"vocab_size={m.vocab_size} (the adapter does not pad the vocabulary: padding would change "
                        "the softmax)"))
        if p.pp > 1:
            microbatches = workload.per_rank_batch // workload.micro_batch
            if microbatches < p.pp:
                out.append(("train.micro_batch", workload.micro_batch,
                            f"with pp={p.pp} the 1F1B schedule needs at least {p.pp} micro-batches per rank "
                            f"(per-rank batch {workload.per_rank_batch} / micro-batch gives {microbatches})"))
        if workload.lora.rank:
            out.append(("lora.rank", workload.lora.rank,
                        "0 with tp/pp: LoRA runs on TorchDDPPlugin (dp only, zero_stage 0) in this adapter"))
        if o.recompute != "none":
            out.append(("optimizations.recompute", o.recompute,
                        "none with tp/pp (shardformer's gradient checkpointing was not exercised)"))
    elif workload.lora.rank and plugin != "TorchDDPPlugin":
        out.append(("lora.rank", workload.lora.rank,
                    f"0 with zero_stage {o.zero_stage}: ColossalAI 0.5.0's {plugin} does not support LoRA "
                    "(support_lora() is False); use zero_stage=0 (TorchDDPPlugin)"))
    if workload.model.is_moe and o.recompute != "none":
        out.append(("optimizations.recompute", o.recompute, "none for MoE (not exercised)"))
    if workload.model.is_moe and workload.lora.rank:
        out.append(("lora.rank", workload.lora.rank, "0 for MoE (not exercised)"))
    if workload.save.path and workload.lora.rank:
        out.append(("save.path", workload.save.path, "not with LoRA here (ColossalAI saves LoRA weights apart, "
                    "unmerged): save a full fine-tune"))
    if workload.eval.examples and workload.lora.rank:
        out.append(("eval.examples", workload.eval.examples, "0 with LoRA here (evaluation reads the model through "
                    "its Hugging Face save, and ColossalAI saves LoRA weights apart, unmerged)"))
    return out


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="colossalai",
        version=__version__,
        framework="colossalai",
        roles={"train": "llmadapt_colossalai.trainer:ColossalAITrainer",
               "finetune": "llmadapt_colossalai.trainer:ColossalAIFineTuner"},
        environment=ENVIRONMENT,
        supports=SUPPORTS,
        check=check,
        description="ColossalAI 0.5.0 Booster on transformers 4.51.3's model: TorchDDP, LowLevelZero (ZeRO-1/2), "
                    "TorchFSDP (ZeRO-3), HybridParallel (tp, pp 1F1B), MoeHybridParallel (ep); LoRA on TorchDDP; "
                    "CPU patches recorded in the trace.",
    ))
