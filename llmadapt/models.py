"""The canonical checkpoint: one HF-format model (safetensors) and tokenizer per model spec and seed.

Every adapter loads this same folder, so every stack starts from identical weights. It is
built locally (no hub), cached in the state folder by content hash, and built once per
machine under a file lock; the header of every trace carries its content hash (the one a
``model.path`` folder gets, `llmadapt.modelfolder`) so runs on different machines can be
checked for the same start. It is written streaming, tensor by tensor into shards of at
most ``SHARD_BYTES``, so building a 70B model's checkpoint needs one shard's memory.

Runs inside workers (imports torch and transformers).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from llmadapt.gguffile import is_gguf
from llmadapt.host import state_dir
from llmadapt.modelfolder import content_hash, shard_layout, tensor_plan, write_index
from llmadapt.contract.records import ModelSource
from llmadapt.spec import ModelSpec
from llmadapt.spec.model import MAMBA_D_CONV, MAMBA_D_STATE, MAMBA_EXPAND, checkpoint_key

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
INIT_STD = 0.02  # transformers' initializer_range for Llama and Mixtral
SHARD_BYTES = int(os.environ.get("LLMADAPT_SHARD_BYTES", 1 << 30))
"""Largest shard the writer makes: what it holds in memory at once."""


def tokenizer_corpus() -> list[str]:
    """Text the tokenizer is trained on: the shipped instruction data (no download)."""
    text = resources.files("llmadapt.resources").joinpath("tiny-instructions.jsonl").read_text()
    lines = []
    for row in map(json.loads, text.splitlines()):
        lines += [row["instruction"], row["answer"]]
    return lines


def train_tokenizer(vocab_size: int):
    """A byte-level BPE trained on the shipped corpus (``tokenizers`` only, no torch); every byte is encodable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 32000),
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int, out_dir: Path):
    """The canonical tokenizer in Hugging Face format, saved next to the weights."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size), pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(out_dir))
    return fast


def hf_config(model: ModelSpec, tokenizer):
    from transformers import LlamaConfig, MixtralConfig

    if model.family == "jamba":
        return _jamba_config(model, tokenizer)
    common = dict(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads,
        max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        rope_theta=model.rope_theta,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if model.family == "mixtral":
        return MixtralConfig(
            num_local_experts=model.num_experts,
            num_experts_per_tok=model.experts_per_token,
            router_aux_loss_coef=0.0,
            **common,
        )
    return LlamaConfig(attention_bias=False, mlp_bias=False, **common)


def _jamba_config(model: ModelSpec, tokenizer):
    """Jamba has no rotary embedding (its attention layers see positions through the Mamba layers): rope_theta is
    not written. The router's auxiliary loss is off, as for Mixtral: the loss is the cross-entropy alone."""
    from transformers import JambaConfig

    return JambaConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads, max_position_embeddings=model.max_position_embeddings,
        rms_norm_eps=model.norm_eps, tie_word_embeddings=model.tie_embeddings, num_experts=model.num_experts,
        num_experts_per_tok=model.experts_per_token, router_aux_loss_coef=0.0,
        attn_layer_period=model.attn_layer_period, attn_layer_offset=model.attn_layer_offset,
        expert_layer_period=model.expert_layer_period, expert_layer_offset=model.expert_layer_offset,
        mamba_d_state=MAMBA_D_STATE, mamba_d_conv=MAMBA_D_CONV, mamba_expand=MAMBA_EXPAND,
        mamba_dt_rank=model.mamba_dt_rank, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "jamba": "JambaForCausalLM"}


def canonical_checkpoint(model: ModelSpec, seed: int, cache: Path | None = None) -> Path:
    """Path of the checkpoint directory for (model, seed), building it if needed (process-safe); a model
    with ``path`` is its own checkpoint."""
    if model.path and is_gguf(model.path):
        return gguf_checkpoint(model, cache)
    if model.path:
        return Path(model.path)
    root = (cache or state_dir() / "checkpoints")
    target = root / checkpoint_key(model, seed)
    if (target / "READY").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other ranks on this machine wait here
        if (target / "READY").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            _build(model, seed, tmp)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


GGUF_CONVERSION = 1
"""How a GGUF file becomes a model folder (``gguf_checkpoint``); part of the folder's name, bumped when the folder
written for the same file changes."""


def gguf_key(model: ModelSpec) -> str:
    """The folder name, under the state folder's ``checkpoints``, of a GGUF model.path's conversion."""
    return f"gguf-{model.checksum}-v{GGUF_CONVERSION}"


def gguf_checkpoint(model: ModelSpec, cache: Path | None = None) -> Path:
    """The model folder a GGUF file (``model.path``) is converted to, once per file (process-safe, atomic: made in
    a temporary folder and renamed, so a failed or interrupted conversion leaves nothing behind and loses nothing
    converted before). Named by the file's content hash (``model.checksum``)."""
    root = cache or state_dir() / "checkpoints"
    target = root / gguf_key(model)
    if (target / "READY").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "READY").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            convert_gguf(Path(model.path), tmp)  # type: ignore[arg-type]
            shutil.rmtree(target, ignore_errors=True)  # a folder without READY: never finished
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(source: Path, out: Path) -> None:
    """A GGUF file as a Hugging Face folder: transformers' GGUF loader dequantizes every tensor to fp32 (the
    weights as the file holds them, value for value), written as safetensors with the file's tokenizer, chat
    template and generation settings; checked as a model.path folder is, then marked READY with its hash and what
    it came from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmadapt.gguffile import source_record
    from llmadapt.modelfolder import shape_of

    record = source_record(source)  # checks the header first: one line on a damaged file
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    hf = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # The loader leaves its GGUF quantizer attached though the weights are dequantized already, and
    # save_pretrained refuses a quantized model: detached, the model is a plain fp32 one.
    hf.hf_quantizer = None
    hf.config.quantization_config = None
    del hf.config.quantization_config
    hf.config.dtype = "float32"
    hf.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _drop_tokens_beyond(out, hf.config.vocab_size)
    top_level_rope_theta(out, hf.config.rope_parameters["rope_theta"] if getattr(hf.config, "rope_parameters", None)
                         else hf.config.rope_theta)
    shape_of(out)  # what the workload checks of a model folder, on what was written
    (out / "READY").write_text(json.dumps({"weights_sha256": content_hash(out), "source": record}))


def _drop_tokens_beyond(folder: Path, vocab_size: int) -> None:
    """transformers' GGUF tokenizer converter adds '<|endoftext|>' to a GPT-2 style vocabulary that lacks it, past
    the model's embedding rows: a token the file never had and the model cannot embed, dropped from what is saved."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    kept = [t for t in data.get("added_tokens", []) if t["id"] < vocab_size]
    if len(kept) == len(data.get("added_tokens", [])):
        return
    dropped = {t["content"] for t in data["added_tokens"]} - {t["content"] for t in kept}
    data["added_tokens"] = kept
    path.write_text(json.dumps(data, ensure_ascii=False))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {k: v for k, v in config.get("added_tokens_decoder", {}).items()
                                      if int(k) < vocab_size}
    for key, value in list(config.items()):
        if isinstance(value, str) and value in dropped:
            config.pop(key)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def init_tensor(name: str, shape: tuple[int, ...], seed: int, pad_token_id: int | None):
    """One tensor as transformers initialises it (norms one, every matrix N(0, 0.02), the padding row of the
    embedding zero), from a generator seeded by (seed, name): the same bytes whatever order or shard.

    Jamba's Mamba mixers as JambaPreTrainedModel._init_weights makes them: A_log = log(1..d_state) on every
    channel (S4D-real), D one, the conv1d and dt_proj biases zero (so the time step starts at softplus(0) = 0.69,
    not Mamba's own log-uniform 0.001-0.1: transformers' choice, followed here). One deviation: the depthwise
    conv1d's weight is PyTorch's default U(+-1/sqrt(d_conv)), as mamba_ssm's Mamba leaves it, not N(0, 0.02):
    four taps of N(0, 0.02) damp the Mamba branch to 0.4% of the residual stream at init (tiny-jamba), so a
    Mamba layer would barely count and loss parity could not see one computed wrongly; this way it is ~12%
    (tests/test_jamba.py: Mamba layers without their skip connection move the loss beyond the parity tolerance)."""
    import torch

    if name.endswith("mamba.A_log"):
        channels, state = shape
        return torch.log(torch.arange(1, state + 1, dtype=torch.float32)).expand(channels, state).contiguous()
    if name.endswith(("mamba.conv1d.bias", "mamba.dt_proj.bias")):
        return torch.zeros(shape, dtype=torch.float32)
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.float32)
    generator = torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:15], 16))
    if name.endswith("mamba.conv1d.weight"):  # PyTorch's (and mamba_ssm's) default: U(+-1/sqrt(d_conv))
        bound = shape[-1] ** -0.5
        return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
    tensor = torch.empty(shape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=generator)
    if name == "model.embed_tokens.weight" and pad_token_id is not None:
        tensor[pad_token_id] = 0
    return tensor


def _build(model: ModelSpec, seed: int, out: Path, shard_bytes: int | None = None) -> None:
    """Written as it is made, one shard at a time: the writer holds at most one shard (plus the tensor being
    made), whatever the model's size. One file when the model fits one shard, as save_pretrained does."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    tokenizer = build_tokenizer(model.vocab_size, out)
    if len(tokenizer) > model.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but model.vocab_size is {model.vocab_size}")
    config = hf_config(model, tokenizer)
    config.architectures = [ARCHITECTURES[model.family]]
    config.dtype = "float32"
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    if model.family != "jamba":  # no rotary embedding in Jamba
        top_level_rope_theta(out, model.rope_theta)

    plan = dict(tensor_plan(model))
    layout = shard_layout([(name, 4 * math.prod(shape)) for name, shape in plan.items()], shard_bytes or SHARD_BYTES)
    for file, names in layout:
        tensors = {name: init_tensor(name, plan[name], seed, tokenizer.pad_token_id) for name in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors  # before the next shard is made
    write_index(out, layout, 4 * sum(math.prod(shape) for shape in plan.values()))
    (out / "READY").write_text(json.dumps({"weights_sha256": content_hash(out), "key": out.name}))


def top_level_rope_theta(folder: Path, theta: float) -> None:
    """transformers 5.x writes rope settings only as rope_parameters; older readers (4.51) ignore that and fall
    back to their default theta. Written at config.json's top level as well."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = theta
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def recorded_weights_hash(checkpoint: Path) -> str | None:
    """The checkpoint's content hash: recorded when it was built, computed for a model folder (cached)."""
    try:
        return json.loads((checkpoint / "READY").read_text())["weights_sha256"]
    except (OSError, KeyError, json.JSONDecodeError):
        pass
    try:
        return content_hash(checkpoint)
    except (OSError, ValueError):
        return None


def recorded_source(checkpoint: Path | None) -> ModelSource | None:
    """What the checkpoint was converted from (a GGUF file: its hash, types, dequantized), or None."""
    try:
        ready = json.loads((Path(checkpoint) / "READY").read_text())  # type: ignore[arg-type]
        return ModelSource(**ready["source"], converted_hash=ready["weights_sha256"])
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return None


def main() -> None:
    """``python -m llmadapt.models MODEL_JSON SEED``: build (or find) the checkpoint here, print its path."""
    import sys

    model = ModelSpec(**json.loads(sys.argv[1]))
    print(canonical_checkpoint(model, int(sys.argv[2])))


if __name__ == "__main__":
    main()
