"""Registers the ``megatron`` adapter. Runs in the orchestrator, so it stays light: no torch, no megatron."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmadapt.adapter import AdapterInfo, EnvironmentSpec, Supports, hookimpl

from . import __version__

# Exact pins for the adapter's own virtualenv. megatron-core 0.16.1 is the newest release offered
# for Python 3.11; its wheel pulls only numpy and packaging. transformers/tokenizers/safetensors
# build and read the canonical checkpoint (the same versions as the reference adapter's);
# tqdm is imported by megatron-core's optional helpers.
REQUIREMENTS = (
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "tqdm==4.70.1",
    "numpy==2.4.6",
    "packaging==26.4",
)

ENVIRONMENT = EnvironmentSpec(
    name="megatron",
    requirements=REQUIREMENTS,
    local_packages=(str(Path(__file__).resolve().parents[1]),),
)

SUPPORTS = Supports(
    precisions=("fp32", "bf16"),
    dp=True,
    tp=True,
    pp=True,
    ep=True,
    # 0: megatron DDP (gradients all-reduced, every rank keeps the whole optimizer state);
    # 1: megatron's distributed optimizer (optimizer state and fp32 main params sharded over the
    #    data-parallel ranks, gradients reduce-scattered, parameters all-gathered): the ZeRO-1
    #    equivalent. ZeRO 2/3 have no megatron-core counterpart (FSDP is a separate wrapper).
    zero_stages=(0, 1),
    # selective: megatron recomputes core attention only; full: every transformer layer.
    recompute=("none", "selective", "full"),
    moe=True,
    save=True,  # every rank's slice gathered and converted back (convert.megatron_to_hf)
    # packed rows: the local spec's attention takes a [b, 1, s, s] mask (THD PackedSeqParams needs
    # TransformerEngine); RoPE gets each token's position from a hook (trainer._packed_rope)
    packing=True,
)


def check(workload) -> list[tuple[str, Any, str]]:
    """Megatron's rules that `Supports` cannot express. Must not import torch or megatron."""
    out: list[tuple[str, Any, str]] = []
    m, p = workload.model, workload.parallelism
    if m.num_heads % p.tp or m.num_kv_heads % p.tp:
        out.append(("parallelism.tp", p.tp,
                    f"must divide model.num_heads={m.num_heads} and model.num_kv_heads={m.num_kv_heads}"))
    if p.tp > 1 and m.vocab_size % p.tp:
        out.append(("parallelism.tp", p.tp, f"must divide model.vocab_size={m.vocab_size} (the adapter does not "
                                            "pad the vocabulary: padding would change the softmax)"))
    if p.tp > 1 and (m.intermediate_size % p.tp or m.hidden_size % p.tp):
        out.append(("parallelism.tp", p.tp,
                    f"must divide model.intermediate_size={m.intermediate_size} and hidden_size={m.hidden_size}"))
    if m.num_layers % p.pp:
        out.append(("parallelism.pp", p.pp, f"must divide model.num_layers={m.num_layers} (equal stages)"))
    if m.is_moe and p.tp > 1:
        out.append(("parallelism.tp", p.tp,
                    "MoE with tp>1 needs sequence parallelism (megatron's MoE layer refuses to train without it), "
                    "and sequence parallelism needs TransformerEngine or apex norms, which this environment (and "
                    "any CPU) lacks: use tp=1 with parallelism.ep for the experts"))
    return out


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="megatron",
        version=__version__,
        framework="megatron-core",
        roles={"train": "llmadapt_megatron.trainer:MegatronTrainer",
               "finetune": "llmadapt_megatron.trainer:MegatronFineTuner"},
        environment=ENVIRONMENT,
        supports=SUPPORTS,
        check=check,
        description="Megatron-core GPTModel converted from the canonical checkpoint: tensor, pipeline (1F1B), data "
                    "and expert parallelism, distributed optimizer (zero_stage=1), selective/full recomputation, "
                    "MoE (top-k, allgather dispatcher); megatron's own timers as phases. Full fine-tuning only.",
    ))
