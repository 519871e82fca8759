"""Registers the ``llamacpp`` adapter. Runs in the orchestrator, so it stays light: no llama_cpp, no numpy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmadapt.adapter import AdapterInfo, EnvironmentSpec, Supports, hookimpl

from . import __version__

LLAMA_CPP_PYTHON = "0.3.36"
"""llama-cpp-python's release. PyPI has only its source release for Linux: pip compiles the llama.cpp it vendors
(cmake and a C++ compiler, about 10 minutes on 2 cores), for this machine's CPU (GGML_NATIVE)."""

NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"""Compiler flags that leave AMX out of a native build (README, "The environment", says why)."""

NO_COMMON = """\
# llama-cpp-python forces llama.cpp's `common` library on (a cache variable set with FORCE, so -D cannot), and with
# it cpp-httplib, yet loads only libllama, libggml and libmtmd. A normal variable of the same name hides that cache
# entry (CMP0126), so neither is compiled: 45% of the build's CPU (README, "The environment").
set(LLAMA_BUILD_COMMON OFF)
"""
"""Read at llama-cpp-python's project() (CMAKE_PROJECT_INCLUDE)."""

# Exact pins: llama-cpp-python with its server's dependencies, and the gguf writer (numpy, no torch).
REQUIREMENTS = (
    f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
    "gguf==0.19.0",
    "numpy==2.4.6",
    "fastapi==0.165.0",
    "uvicorn==0.55.0",
    "sse-starlette==3.7.1",
    "starlette-context==0.3.6",
    "pydantic-settings==2.16.3",
    "PyYAML==6.0.4",
)

ENVIRONMENT = EnvironmentSpec(
    name="llamacpp",
    requirements=REQUIREMENTS,
    local_packages=(str(Path(__file__).resolve().parents[1]),),
    # No llava/mtmd library: text models only. GGML_NATIVE: kernels for the CPU that builds (and runs) them, but
    # not AMX: built by GCC 12, ggml's AMX matmul loads an empty tile configuration and every quantized prompt
    # batch crashed the engine (SIGILL, SIGSEGV); quantized weights use the AVX-512 VNNI kernels instead.
    # No llama.cpp `common` library (NO_COMMON): nothing here loads it.
    install_env=(("CMAKE_ARGS", "-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON "
                                "-DCMAKE_PROJECT_INCLUDE={build_files}/no-common.cmake"),
                 ("CFLAGS", NO_AMX), ("CXXFLAGS", NO_AMX)),
    build_files=(("no-common.cmake", NO_COMMON),),
    builds_checkpoint=False,  # no torch or transformers here: the core's tools environment builds the checkpoint
)

RUN_FILES = {
    "llamacpp-engine.json": "the engine process's settings, as the adapter's Server wrote them (checkpoint, GGUF type "
                            "and cache, the server's configuration)",
    "llamacpp-server.json": "llama-cpp-python's server configuration file, with the GGUF file's path filled in",
    "llamacpp-backend.json": "what this build of llama.cpp runs on: its CPU features, whether it offloads to a GPU",
    "gguf.json": "the GGUF file served: its type, where it came from, whether it is model.path as shipped",
}
"""What the adapter writes in a run folder beside the core's files (AdapterInfo.run_files)."""

PRECISIONS = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}
"""The workload's precision -> the GGUF type of the weights."""
QUANTIZATIONS = ("q8_0", "q4_1", "q4_0", "source")
"""serve.engine.quantization: llama.cpp's block quantizations the converter writes from the model folder (gguf's
numpy quantizers; it has none for the K-quants), or ``source``: model.path's GGUF file itself, as shipped, at its own
types (the stacks that need a model folder run its fp32 dequantization)."""


def tokenizer_problem(folder: Path) -> str | None:
    """Why the folder's tokenizer cannot be written as llama.cpp's GPT-2 BPE, or None. Light: JSON only."""
    try:
        tok = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError) as exc:
        return f"its tokenizer.json cannot be read ({exc})"
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        return f"its tokenizer is {model.get('type')!r}, not a BPE (llama.cpp's adapter writes byte-level BPE only)"
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
        return ("its pre-tokenizer is not GPT-2's byte-level split (ByteLevel, regex on, no prefix space), the only "
                "one this converter names for llama.cpp: another would tokenize prompts differently there")
    return None


def is_gguf_path(path: str) -> bool:
    """model.path names a GGUF file (its conversion to a model folder is checked there, not here)."""
    return Path(path).suffix.lower() == ".gguf"


def gguf_type(workload) -> str:
    """The GGUF type the workload's weights are written in."""
    q = workload.serve.engine.quantization
    return q if q and q != "none" else PRECISIONS[workload.precision]


def check(workload) -> list[tuple[str, Any, str]]:
    """llama.cpp rules that `Supports` cannot express. Must not import llama_cpp or numpy."""
    out: list[tuple[str, Any, str]] = []
    if workload.serve.url:
        return out  # attached to someone else's llama.cpp server: its model and settings
    m, p = workload.model, workload.parallelism
    if workload.serve.api != "completions":
        out.append(("serve.api", workload.serve.api, "supported: completions (for chat, llama-cpp-python wraps the "
                    "prompt in a chat format of its own, so the engines would not see the same tokens)"))
    if workload.precision not in PRECISIONS:
        out.append(("precision", workload.precision, f"supported: {', '.join(PRECISIONS)}"))
    for name in ("dp", "tp", "pp", "ep"):
        if getattr(p, name) != 1:
            out.append((f"parallelism.{name}", getattr(p, name), "supported: 1 (one llama.cpp process)"))
    if workload.serve.engine.quantization == "source" and not (m.path and is_gguf_path(m.path)):
        out.append(("serve.engine.quantization", "source", "serves model.path's GGUF file as shipped: model.path must "
                    "name a .gguf file"))
    if m.is_moe:
        out.append(("model.num_experts", m.num_experts, "supported: 0 (the GGUF converter writes dense Llama models)"))
    if m.path and not is_gguf_path(m.path):  # a GGUF's folder is written by the conversion, checked there
        problem = tokenizer_problem(Path(m.path))
        if problem:
            out.append(("model.path", m.path, f"cannot be written as GGUF: {problem}"))
    return out


@hookimpl
def llmadapt_register_adapters(register):
    register(AdapterInfo(
        name="llamacpp",
        version=__version__,
        framework="llama.cpp",
        roles={"serve": "llmadapt_llamacpp.server:LlamaCppServer"},
        environment=ENVIRONMENT,
        supports=Supports(precisions=tuple(PRECISIONS), engine=("quantization", "max_batched_tokens"),
                          engine_quantization=QUANTIZATIONS),
        check=check,
        run_files=RUN_FILES,
        description=f"llama.cpp through llama-cpp-python {LLAMA_CPP_PYTHON}'s OpenAI-compatible server, on the "
                    "canonical checkpoint written as GGUF here (f32/f16/bf16, or q8_0/q4_1/q4_0), or a GGUF model.path as shipped "
                    "(quantization source); one request at a time "
                    "(no batching across requests); output lengths forced with min_tokens.",
    ))
