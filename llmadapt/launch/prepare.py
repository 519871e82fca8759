"""The canonical checkpoint, built before any worker starts.

``python -m llmadapt.models MODEL_JSON SEED`` builds (or finds) it in the environment that runs
the command and prints its path; for a GGUF ``model.path`` it converts the file to a model folder (the
reference environment's build: transformers and gguf). The orchestrator (which has no torch) calls it with an
environment's interpreter: the adapter's own, or the core's tools environment's when the adapter's
transformers cannot build it (``EnvironmentSpec.builds_checkpoint``). Building it once, up front,
keeps every adapter on identical weights and keeps ranks from racing to build it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import attrs

from llmadapt.adapter.declaration import EnvironmentSpec
from llmadapt.errors import LlmadaptError, WorkloadError
from llmadapt.host import state_dir
from llmadapt.launch.environments import process_env, python_for
from llmadapt.spec import Workload


def checkpoint_dir(workload: Workload) -> Path:
    from llmadapt.spec.model import checkpoint_key

    return state_dir() / "checkpoints" / checkpoint_key(workload.model, workload.seed)


def gguf_dir(workload: Workload) -> Path:
    """Where a GGUF model.path is converted to (llmadapt.models.gguf_checkpoint)."""
    from llmadapt.models import gguf_key

    return state_dir() / "checkpoints" / gguf_key(workload.model)


def checked_folder(workload: Workload) -> Path:
    """model.path, if its content is still what the workload recorded (a folder changed after a workload was
    written, or another folder at the same path on this machine, would run another model under its hash)."""
    from llmadapt.gguffile import gguf_hash, is_gguf
    from llmadapt.modelfolder import FolderError, content_hash

    m = workload.model
    try:
        now = gguf_hash(m.path) if is_gguf(m.path) else content_hash(m.path)
    except (FolderError, OSError) as exc:
        raise WorkloadError("model.path", m.path, f"cannot be read: {exc}") from None
    if now != m.checksum:
        raise WorkloadError("model.path", m.path, f"changed since the workload was built (content hash {now}, "
                            f"recorded {m.checksum}): build the workload again from its file")
    return Path(m.path)


def check_save_folder(workload: Workload) -> None:
    """save.path: a new or empty folder (a saved model is never overwritten, nor mixed with other files)."""
    path = workload.save.path
    if path and Path(path).exists() and (not Path(path).is_dir() or any(Path(path).iterdir())):
        raise WorkloadError("save.path", path, "exists and is not an empty folder: name a new one (a saved model "
                            "is never overwritten)")


def ensure_checkpoint(workload: Workload, environment: EnvironmentSpec) -> Path:
    """The canonical checkpoint of the workload, built with the right environment if missing; a model folder
    (model.path), checked to hold what the workload was built from."""
    from llmadapt.gguffile import is_gguf
    from llmadapt.launch.environments import TOOLS_ENVIRONMENT

    gguf = bool(workload.model.path) and is_gguf(workload.model.path)
    if workload.model.path:
        checked_folder(workload)
    if workload.model.path and not gguf:
        return Path(workload.model.path)
    target = gguf_dir(workload) if gguf else checkpoint_dir(workload)
    if (target / "READY").is_file():
        return target
    if gguf or not environment.builds_checkpoint:
        # A GGUF is converted where transformers and gguf are (the reference environment's build), whatever
        # the adapter's own environment holds.
        environment = TOOLS_ENVIRONMENT
    python = python_for(environment)
    out = subprocess.run([str(python), "-m", "llmadapt.models", json.dumps(attrs.asdict(workload.model)),
                          str(workload.seed)], capture_output=True, text=True, check=False,
                         env=process_env(environment))
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        what = f"converting {workload.model.path}" if gguf else "building the canonical checkpoint"
        raise LlmadaptError(f"{what} in environment {environment.name!r} failed: {last}")
    return Path(out.stdout.strip().splitlines()[-1])


def check_data_fits(workload: Workload, checkpoint: Path) -> None:
    """Every training step of a JSONL workload, and its held-out examples, have an answer token within
    train.seq_len, on the checkpoint's own tokenizer and the workers' batches (runtime.data.TokenData): a seq_len
    that every prompt of a step fills trains nothing, and is refused here, before launch, instead of failing that
    step (or scoring the held-out examples' loss as NaN)."""
    if workload.kind == "serve" or not (workload.data.source == "jsonl" or workload.eval.path) or \
            not (checkpoint / "tokenizer.json").is_file():
        return
    from llmadapt.adapter.context import IGNORE
    from llmadapt.chattemplate import read_chat_template
    from llmadapt.runtime.data import TokenData

    try:
        data = TokenData(workload, CheckpointTokenizer(checkpoint), read_chat_template(checkpoint))
        seq_len = workload.train.seq_len
        for step in range(workload.train.total_steps if workload.data.source == "jsonl" else 0):
            _check_step(data, step, seq_len)
    except WorkloadError:
        raise
    except ValueError as exc:  # conversations: no chat template, one that cannot be rendered, none that fits
        raise WorkloadError("data.format", workload.data.format, str(exc)) from None
    # held-out examples are cut to seq_len too: with no answer token left, their loss would be NaN
    if data.has_answers and not any(t != IGNORE for e in data.eval_examples() for t in e.sample.labels):
        raise WorkloadError("train.seq_len", seq_len, f"no answer token of the {workload.eval.examples} held-out "
                            f"examples (eval) fits within it (each of their prompts takes more than {seq_len} tokens "
                            "of the model's tokenizer): raise train.seq_len, or give shorter prompts")


def _check_step(data, step: int, seq_len: int) -> None:
    if not data.loss_tokens(step):
        raise WorkloadError("train.seq_len", seq_len, f"no answer token of step {step}'s samples fits within it "
                            f"(each of their prompts takes more than {seq_len} tokens of the model's tokenizer): "
                            "raise train.seq_len, or give shorter prompts")


class CheckpointTokenizer:
    """A checkpoint's tokenizer.json through the ``tokenizers`` library (no torch, no transformers), with what
    TokenData reads of a Hugging Face tokenizer: the same tokens the workers get from the same file."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            self._special(config.get(name)) for name in ("bos_token", "eos_token", "pad_token"))

    def _special(self, token) -> int | None:
        token = token.get("content") if isinstance(token, dict) else token
        return self._tokenizer.token_to_id(token) if isinstance(token, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
