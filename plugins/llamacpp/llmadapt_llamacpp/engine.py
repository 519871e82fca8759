"""The llama.cpp engine process: the checkpoint's GGUF file (written once per content hash and type, into the
state folder's GGUF cache, under a file lock), then llama-cpp-python's server in this same process.

Two patches, recorded in every trace, both in ``bounded_and_counted``, which wraps ``Llama.generate`` and
``Llama._create_completion`` and changes nothing else:

- ``max-tokens`` (a fix): llama-cpp-python's generation loop skips its length check while the last token may begin
  an unfinished UTF-8 character. On a tiny random model's byte soup that ran responses past max_tokens (37 tokens
  for 16 asked), some until the context was full and llama_decode failed ("failed to find a memory slot"), which
  ended the response with an error and reset the next request's connection. When the loop asks for a token past
  max_tokens, the wrapped generate gives it an end-of-generation token, which ends the loop the way that writes
  the response's text (stopping the generator instead would leave a plain response's text empty), and the
  finish reason is set back to "length".
- ``stream-usage`` (a shim): its stream carries no usage. The tokens each completion generated are counted and
  OpenAI's ``usage`` object is put on the stream's last chunk, as ``stream_options.include_usage`` asks.

``ENV/bin/python -m llmadapt_llamacpp.engine SETTINGS_JSON``: the orchestrator's LlamaCppServer writes the
settings (checkpoint, type, cache folder, the server's configuration file) and starts this as the engine. The
conversion runs here, not in the orchestrator, so it counts as the engine's start-up, is logged to engine.log
and is stopped with the engine. What was served is written to RUN_DIR/gguf.json before the server starts.
"""

from __future__ import annotations

import fcntl
import json
import os
import runpy
import sys
import time
from pathlib import Path

from llmadapt.adapter import RunDir
from llmadapt.adapter.weights import content_hash

from .gguf_file import CONVERTER_VERSION, ConversionError, write
from .plugin import RUN_FILES


def gguf_for(checkpoint: Path, kind: str, cache: Path) -> tuple[Path, dict]:
    """The cached GGUF file of ``checkpoint`` in ``kind`` (written if missing), and what it holds."""
    key = content_hash(checkpoint)
    target = cache / f"{key}-{kind}-c{CONVERTER_VERSION}.gguf"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer per file; the others wait and then read it
        meta = target.with_suffix(".json")
        if target.is_file() and meta.is_file():
            return target, {**json.loads(meta.read_text()), "converted_now": False}
        started = time.monotonic()
        partial = target.with_suffix(".partial")
        summary = write(checkpoint, partial, kind)
        summary.update(path=str(target), checkpoint=str(checkpoint), checkpoint_hash=key,
                       convert_s=round(time.monotonic() - started, 3))
        os.replace(partial, target)
        meta.write_text(json.dumps(summary, indent=2))
        return target, {**summary, "converted_now": True}


def as_shipped(source: Path) -> tuple[Path, dict]:
    """model.path's GGUF file served as it is: what it holds, from its own header."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    field = reader.get_field("general.file_type")
    file_type = gguf.LlamaFileType(int(field.parts[-1][0])).name.removeprefix("MOSTLY_") if field else None
    return source, {"path": str(source), "bytes": source.stat().st_size, "type": "source", "as_shipped": True,
                    "file_type": file_type, "tensor_types": dict(sorted(counts.items())), "converted_now": False}


def echo_logprobs(llama, logprobs: dict, k: int) -> None:
    """An echoed prompt's log-probabilities from the right rows (the ``echo-logprobs`` fix): llama-cpp-python pairs
    prompt token i with the logits computed at token i, the distribution of token i+1 (unless a BOS token came
    first), so each prompt token's figures were the next one's. Row i-1 is token i's; the positions past the rows
    evaluated (the generated token) are left out (None)."""
    import numpy as np
    from llama_cpp import Llama

    n = llama.n_tokens
    ids = [int(t) for t in llama.input_ids[:n]]
    skip = 1 if ids and ids[0] == llama.token_bos() else 0
    rows = Llama.logits_to_logprobs(llama._scores[:n])
    for i, token_str in enumerate(logprobs["tokens"]):
        r = i + skip - 1
        if r < 0 or i + skip >= n:
            logprobs["token_logprobs"][i] = logprobs["top_logprobs"][i] = None
            continue
        row, token = rows[r], ids[i + skip]
        best = np.argpartition(row, -k)[-k:]
        top = {llama.detokenize([int(t)], prev_tokens=ids[skip:i + skip]).decode("utf-8", errors="ignore"):
               float(row[t]) for t in best[np.argsort(-row[best])]}
        top[token_str] = float(row[token])
        logprobs["token_logprobs"][i], logprobs["top_logprobs"][i] = float(row[token]), top


def bounded_and_counted() -> None:
    """Completions stop at max_tokens, and streams end with usage: the tokens each completion generated (its
    end-of-generation token not counted, as llama-cpp-python's own non-streamed usage does not count it) and its
    prompt's."""
    import llama_cpp
    from llama_cpp import Llama

    generate, create = Llama.generate, Llama._create_completion

    def counting_generate(self, tokens, *args, **kwargs):
        self.llmadapt_prompt, self.llmadapt_generated = len(tokens), 0
        for token in generate(self, tokens, *args, **kwargs):
            if not llama_cpp.llama_vocab_is_eog(self._model.vocab, token):
                self.llmadapt_generated += 1
            yield token
            if self.llmadapt_max and self.llmadapt_generated >= self.llmadapt_max:
                # asked for more than max_tokens: the caller skipped its length check. An end-of-generation
                # token ends its loop the way that writes the response's text; the finish is set back to length.
                self.llmadapt_cut = True
                yield self.token_eos()
                return

    def create_with_usage(self, *args, **kwargs):
        self.llmadapt_max = kwargs.get("max_tokens") if (kwargs.get("max_tokens") or 0) > 0 else None
        self.llmadapt_cut = False
        for chunk in create(self, *args, **kwargs):
            choices = chunk.get("choices") or []
            if self.llmadapt_cut and choices and choices[0].get("finish_reason") == "stop":
                choices[0]["finish_reason"] = "length"
            if kwargs.get("echo") and kwargs.get("logprobs") and choices and choices[0].get("logprobs"):
                echo_logprobs(self, choices[0]["logprobs"], int(kwargs["logprobs"]))
            if kwargs.get("stream") and choices and choices[0].get("finish_reason") and "usage" not in chunk:
                chunk["usage"] = {"prompt_tokens": self.llmadapt_prompt,
                                  "completion_tokens": self.llmadapt_generated,
                                  "total_tokens": self.llmadapt_prompt + self.llmadapt_generated}
            yield chunk

    Llama.generate, Llama._create_completion = counting_generate, create_with_usage


def main(settings_path: str) -> None:
    s = json.loads(Path(settings_path).read_text())
    run = RunDir(s["run_dir"])
    try:
        path, summary = as_shipped(Path(s["source"])) if s.get("source") else \
            gguf_for(Path(s["checkpoint"]), s["type"], Path(s["cache"]))
    except ConversionError as exc:
        sys.exit(f"cannot write {s['checkpoint']} as GGUF: {exc}")
    run.adapter_file("gguf.json", RUN_FILES).write_text(json.dumps(summary, indent=2))
    import llama_cpp

    # what this build of llama.cpp runs on: its CPU features, and whether it has a GPU backend to offload to
    run.adapter_file("llamacpp-backend.json", RUN_FILES).write_text(json.dumps({
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }, indent=2))
    config = dict(s["server"])
    config["models"] = [{**m, "model": str(path)} for m in config["models"]]
    config_path = run.adapter_file("llamacpp-server.json", RUN_FILES)
    config_path.write_text(json.dumps(config, indent=2))
    bounded_and_counted()
    sys.argv = ["llama_cpp.server", "--config_file", str(config_path)]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1])
