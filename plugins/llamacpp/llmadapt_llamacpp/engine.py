"""The llama.cpp engine process: the checkpoint's GGUF file (written once per content hash and type, into the
state folder's GGUF cache, under a file lock), then llama-cpp-python's server in this same process.

One shim, recorded in every trace (the adapter's patch ``stream-usage``): llama-cpp-python's stream carries no
usage, and its token count is not max_tokens for every response that ends for length: its generation loop skips
the length check while the last token may begin an unfinished UTF-8 character, so a response can run over (seen:
37 tokens for 16 asked). ``count_stream_tokens`` wraps ``Llama.generate`` to count what each completion
generated and puts OpenAI's ``usage`` object on the stream's last chunk, as ``stream_options.include_usage``
asks; nothing else of the engine changes.

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

from llmadapt.modelfolder import content_hash

from .gguf_file import CONVERTER_VERSION, ConversionError, write


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


def count_stream_tokens() -> None:
    """Streams end with usage: the tokens each completion generated (its end-of-generation token not counted,
    as llama-cpp-python's own non-streamed usage does not count it) and its prompt's."""
    import llama_cpp
    from llama_cpp import Llama

    generate, create = Llama.generate, Llama._create_completion

    def counting_generate(self, tokens, *args, **kwargs):
        self.llmadapt_prompt, self.llmadapt_generated = len(tokens), 0
        for token in generate(self, tokens, *args, **kwargs):
            if not llama_cpp.llama_vocab_is_eog(self._model.vocab, token):
                self.llmadapt_generated += 1
            yield token

    def create_with_usage(self, *args, **kwargs):
        for chunk in create(self, *args, **kwargs):
            choices = chunk.get("choices") or []
            if kwargs.get("stream") and choices and choices[0].get("finish_reason") and "usage" not in chunk:
                chunk["usage"] = {"prompt_tokens": self.llmadapt_prompt,
                                  "completion_tokens": self.llmadapt_generated,
                                  "total_tokens": self.llmadapt_prompt + self.llmadapt_generated}
            yield chunk

    Llama.generate, Llama._create_completion = counting_generate, create_with_usage


def main(settings_path: str) -> None:
    s = json.loads(Path(settings_path).read_text())
    try:
        path, summary = gguf_for(Path(s["checkpoint"]), s["type"], Path(s["cache"]))
    except ConversionError as exc:
        sys.exit(f"cannot write {s['checkpoint']} as GGUF: {exc}")
    Path(s["run_dir"], "gguf.json").write_text(json.dumps(summary, indent=2))
    config = dict(s["server"])
    config["models"] = [{**m, "model": str(path)} for m in config["models"]]
    config_path = Path(s["run_dir"], "llamacpp-server.json")
    config_path.write_text(json.dumps(config, indent=2))
    count_stream_tokens()
    sys.argv = ["llama_cpp.server", "--config_file", str(config_path)]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1])
