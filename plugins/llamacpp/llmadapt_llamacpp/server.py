"""The ``llamacpp`` Server: llama-cpp-python's OpenAI-compatible server on the canonical checkpoint written as
GGUF, as a subprocess in the adapter's own environment. Runs in the orchestrator: no llama_cpp, no numpy.

What it starts::

    ENV/bin/python -m llmadapt_llamacpp.engine RUN_DIR/llamacpp-engine.json
        (writes or reuses STATE/gguf/HASH-TYPE-cN.gguf, then becomes)
    ENV/bin/python -m llama_cpp.server --config_file RUN_DIR/llamacpp-server.json

in its own process group, logging to RUN_DIR/engine.log. The command, the server's configuration and the
installed versions go to RUN_DIR/engine.json; what the GGUF file holds to RUN_DIR/gguf.json.

How it differs from the other engines, and what the adapter does about it:

- One request at a time: the server holds a lock around its one llama.cpp context, so concurrent requests
  queue in the server (their wait is part of their TTFT), and there is no batching across requests.
- ``interrupt_requests`` is off: on (the server's default), a streaming response is ended early, with
  [DONE], as soon as another request waits, so every concurrent request but the last would be cut short.
- Sampling as on the other engines: the server's default repeat penalty (1.1) would change even greedy decoding;
  requests set it to 1.0 (off).
- Output lengths are forced with the server's ``min_tokens`` (the end-of-sequence logit is -inf until that
  many tokens exist), set to the request's ``max_tokens``; it has no ``ignore_eos``.
- Its stream carries no token counts: no token ids, and a chunk holds several tokens while their bytes are not
  yet whole UTF-8 (so ITL here is per chunk, and a response's first chunk can come after its first token). The
  engine process adds OpenAI's usage to the last chunk (the ``stream-usage`` shim, llmadapt_llamacpp.engine).
- llama-cpp-python skips its max_tokens check while the last token may begin an unfinished UTF-8 character (on
  the tiny model's byte soup: 37 tokens for 16 asked, and runs to the end of the context that failed the
  request): the engine process stops generation at max_tokens (the ``max-tokens`` fix).
- Completions only: for chat, llama-cpp-python would wrap the prompt in a chat format of its own.
- No /health and no metrics endpoint: ready is a model list from GET /v1/models.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from llmadapt.adapter import (
    LlmadaptError,
    Patch,
    PlannedRequest,
    RunDir,
    engine_popen_options,
    installed_versions,
    state_dir,
    stop_engine,
)
from llmadapt.adapter.sse import OpenAICompatibleServer

from .plugin import LLAMA_CPP_PYTHON, RUN_FILES, gguf_type

STOP_GRACE_S = 30.0
DEFAULT_BATCH = 512
"""Tokens per llama_decode call (the server's n_batch default); serve.engine.max_batched_tokens overrides it."""

KV_CACHE_TYPES = {"fp32": 0, "fp16": 1, "bf16": 30}
"""The workload's precision -> the KV cache's GGML type (F32, F16, BF16). llama.cpp's default is F16 whatever the
weights: with F32 weights it put logits 3e-4 away from transformers' fp32 forward on the test model, and 5e-7 with
an F32 cache."""


def gguf_cache() -> Path:
    """Where GGUF files of checkpoints are kept, one per content hash, type and converter version."""
    return state_dir() / "gguf"


def threads() -> int:
    """CPUs this process may run on: llama.cpp's threads for prompt and generation (its default is half)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LlamaCppServer(OpenAICompatibleServer):
    supports_ignore_eos = True  # as min_tokens (see the module's docstring)
    served_model_name = "llmadapt"
    api_key_env = "LLMADAPT_LLAMACPP_API_KEY"

    proc: subprocess.Popen | None = None
    _version = ""

    def model_name(self) -> str:
        return self.served_model_name

    async def ready(self, session) -> bool:
        models = await self.list_models(session)  # no /health; a 200 that is no model list: WrongServer
        if not models:
            return False
        if self.ctx.workload.serve.url:  # attached: the name that server gives its model
            self.served_model_name = models[0]["id"]
        return True

    def payload(self, request: PlannedRequest) -> tuple[str, dict[str, Any]]:
        path, body = super().payload(request)
        body["repeat_penalty"] = 1.0  # the server's default, 1.1, changes greedy decoding; the other engines use none
        if request.ignore_eos:
            body["min_tokens"] = request.output_tokens
        return path, body

    def settings(self) -> dict[str, Any]:
        """The engine process's settings: the checkpoint, the GGUF type and cache, and the server's configuration
        (llama-cpp-python's ConfigFileSettings; the GGUF path is filled in by the engine process)."""
        ctx, w = self.ctx, self.ctx.workload
        n = threads()
        # absolute: the engine runs in the run folder, where a path relative to the caller's folder is not found
        return {
            "checkpoint": str(Path(ctx.checkpoint).absolute()), "type": gguf_type(w),
            "source": str(Path(w.model.path).absolute()) if gguf_type(w) == "source" else None,
            "cache": str(gguf_cache().absolute()), "run_dir": str(Path(ctx.run_dir).absolute()),
            "server": {
                "host": "127.0.0.1", "port": ctx.port, "interrupt_requests": False,
                "models": [{
                    "model_alias": self.served_model_name, "n_ctx": w.model.max_position_embeddings,
                    # every layer on the GPU where this llama.cpp build has a GPU backend; ignored by a CPU build
                    "n_gpu_layers": -1,
                    "n_batch": w.serve.engine.max_batched_tokens or DEFAULT_BATCH,
                    "n_threads": n, "n_threads_batch": n, "seed": w.seed,
                    "type_k": KV_CACHE_TYPES[w.precision], "type_v": KV_CACHE_TYPES[w.precision],
                    # the server's default computes logits for every prompt token: off, but for the quality probe's
                    # log-probabilities (llama-cpp-python refuses logprobs without it); the header's notes say so
                    "logits_all": bool(w.serve.quality.texts),
                    "verbose": False,
                }],
            },
        }

    def start(self) -> None:
        ctx = self.ctx
        if ctx.workload.serve.url:
            self.proc = None
            return
        self.patches.append(Patch(
            framework="llama.cpp", name="max-tokens", kind="fix",
            description="llama-cpp-python skips its max_tokens check while the last token may begin an unfinished "
                        "UTF-8 character (responses ran to 37 tokens of 16, some until the context was full and "
                        "decoding failed): the engine process stops generation at max_tokens (wrapping "
                        "Llama.generate)",
        ))
        self.patches.append(Patch(
            framework="llama.cpp", name="stream-usage", kind="shim",
            description="llama-cpp-python's stream has no usage: the engine process counts the tokens each completion "
                        "generates (wrapping Llama.generate) and adds OpenAI's usage object to the stream's last chunk",
        ))
        if ctx.workload.serve.quality.texts:  # log-probabilities asked for: logits_all, and the fix that reads them
            self.patches.append(Patch(
                framework="llama.cpp", name="echo-logprobs", kind="fix",
                description="llama-cpp-python gives an echoed prompt's token i the log-probabilities of the logits "
                            "computed at token i (the next token's distribution) when no BOS token comes first: the "
                            "engine process recomputes them from row i-1 (the quality probe's perplexity and KL read "
                            "them)",
            ))
            self.notes.append("logits_all on for the quality probe's log-probabilities: the prompt's every position "
                              "gets its logits computed, in the measured requests too")
        found = self.installed()
        self._version = found.get("llama_cpp_python") or ""
        settings = self.settings()
        # absolute (settings' run_dir is): the engine's cwd is the run's
        settings_path = RunDir(settings["run_dir"]).adapter_file("llamacpp-engine.json", RUN_FILES)
        settings_path.write_text(json.dumps(settings, indent=2))
        cmd = [str(Path(ctx.python).absolute()), "-m", "llmadapt_llamacpp.engine", str(settings_path)]
        RunDir(ctx.run_dir).engine_json.write_text(json.dumps({
            "engine": "llama.cpp", "version": self._version, "command": cmd, "settings": settings,
            "installed": found,
        }, indent=2))
        env = {**(ctx.env or os.environ),  # the engine process imports llmadapt and the converter
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(settings["server"]["models"][0]["n_threads"])}
        self.log = open(RunDir(ctx.run_dir).engine_log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ctx.run_dir,
                                     **engine_popen_options())
        RunDir(ctx.run_dir).engine_pid.write_text(str(self.proc.pid))

    def installed(self) -> dict[str, str | None]:
        try:
            return installed_versions(self.ctx.python, ["llama_cpp_python", "gguf", "numpy", "fastapi", "uvicorn"])
        except RuntimeError as exc:
            raise LlmadaptError(f"cannot inspect the llamacpp environment ({self.ctx.python}): {exc}") from None

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_engine(self.proc, STOP_GRACE_S)
        self.log.close()
        self.proc = None

    def engine_weights(self) -> str | None:
        """The GGUF type served and where the file came from, from the engine's gguf.json."""
        if self.ctx.workload.serve.url:
            return None
        try:
            served = json.loads(RunDir(self.ctx.run_dir).adapter_file("gguf.json", RUN_FILES).read_text())
        except (OSError, ValueError):
            return None
        kind = str(served.get("type", "?")).upper()
        if served.get("as_shipped"):
            return f"GGUF {served.get('file_type') or kind} as shipped ({Path(served['path']).name})"
        origin = "the fp32 folder of " + Path(self.ctx.workload.model.path).name if self.ctx.workload.model.path \
            else "the checkpoint"
        return f"GGUF {kind} written from {origin}, KV cache {self.ctx.workload.precision}"

    def engine_version(self) -> str:
        return f"llama-cpp-python {self._version or LLAMA_CPP_PYTHON}" if self.proc or self._version \
            else "llama.cpp (attached)"

    def metrics_source(self) -> str:
        return "llamacpp"
