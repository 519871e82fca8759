"""A Hugging Face Llama folder (the canonical checkpoint, or a model.path) written as one GGUF file, with the
``gguf`` package, for llama.cpp. Runs in the llamacpp environment: numpy and gguf, no torch.

What it writes, as llama.cpp's own converter (convert_hf_to_gguf.py, LlamaModel) does for a Llama:

- hyperparameters under the ``llama`` architecture (context length, widths, heads, RMS epsilon, RoPE base);
- the tokenizer: a byte-level BPE with GPT-2 pre-tokenization (``tokenizer.ggml.model = gpt2``, ``pre = gpt-2``),
  its tokens with their types (added special tokens are control tokens; ids the tokenizer does not use, up to the
  model's vocabulary, are unused ``[PADi]`` tokens), merges and special ids read by gguf's SpecialVocab;
- the tensors under GGUF's names (gguf's own tensor name map), q_proj and k_proj rows permuted from Hugging
  Face's half-split RoPE layout to the interleaved one llama.cpp's Llama uses;
- 1-D tensors (norms) in F32 always, 2-D weights in the asked type: F32, F16, BF16, Q8_0, Q4_1 or Q4_0 (gguf's
  numpy quantizers; it has none for the K-quants); a weight whose rows do not split into the quantizer's blocks stays F16, and the file's summary
  says so.

Tensors are read through numpy memory maps of the safetensors shards (llmadapt.modelfolder reads the headers),
so BF16 checkpoints need no torch. ``python -m llmadapt_llamacpp.gguf_file FOLDER OUT TYPE`` writes OUT and
prints its summary as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from llmadapt.adapter.weights import read_header, shards

from .plugin import tokenizer_problem

CONVERTER_VERSION = 1
"""Bump when the files this writes change: the GGUF cache is keyed by it."""

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_1", "q4_0")

_SAFETENSORS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class ConversionError(ValueError):
    """The folder holds something this converter does not write (said in one line)."""


def tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor, memory-mapped; BF16 widened to float32 as it is read."""
    for shard in shards(folder):
        header, start = read_header(shard)
        for name, meta in header.items():
            if meta["dtype"] not in _SAFETENSORS:
                raise ConversionError(f"tensor {name} is {meta['dtype']}; the converter reads F32, F16 and BF16")
            begin, end = meta["data_offsets"]
            raw = np.memmap(shard, dtype=_SAFETENSORS[meta["dtype"]], mode="r", offset=start + begin,
                            shape=tuple(meta["shape"]) or (1,))
            if meta["dtype"] == "BF16":  # the top half of a float32
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            assert raw.nbytes == (end - begin) * (2 if meta["dtype"] == "BF16" else 1)
            yield name, raw


def permute_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's q/k rows (per head: first halves, then second halves of the rotary pairs) in the interleaved
    order of llama.cpp's Llama (llama.cpp's LlamaModel.permute)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def encode(array: np.ndarray, kind: str) -> tuple[np.ndarray, Any, str]:
    """(data, GGML type, the type's name) for one tensor in the asked type."""
    import gguf

    T = gguf.GGMLQuantizationType
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim == 1 or kind == "f32":
        return array, T.F32, "F32"
    if kind == "f16":
        return array.astype(np.float16), T.F16, "F16"
    qtype = {"bf16": T.BF16, "q8_0": T.Q8_0, "q4_1": T.Q4_1, "q4_0": T.Q4_0}[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if array.shape[-1] % block:
        return array.astype(np.float16), T.F16, "F16"
    return gguf.quants.quantize(array, qtype), qtype, qtype.name


def vocabulary(folder: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """The token strings and GGUF token types for ids 0..vocab_size-1."""
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    control = {}
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        if added.get("special"):
            control[added["id"]] = True
    if max(by_id) >= vocab_size:
        raise ConversionError(f"the tokenizer has id {max(by_id)}, beyond the model's vocabulary of {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, types


def write(folder: Path, out: Path, kind: str) -> dict[str, Any]:
    """Write ``folder`` as a GGUF file at ``out`` in type ``kind``; the summary of what was written."""
    import gguf

    if kind not in TYPES:
        raise ConversionError(f"type {kind!r}: one of {', '.join(TYPES)}")
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ConversionError(f"architecture {config.get('architectures')}: the converter writes Llama models only")
    problem = tokenizer_problem(folder)
    if problem:
        raise ConversionError(problem)
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // heads

    writer = gguf.GGUFWriter(str(out), arch="llama")
    writer.add_name(folder.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[kind])
    tokens, types = vocabulary(folder, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=config["vocab_size"])
    if not special.merges:
        raise ConversionError("the tokenizer's merges were not found in tokenizer.json")
    special.add_to_gguf(writer, quiet=True)
    writer.add_add_bos_token(False)  # the canonical tokenizer adds no BOS: prompts are the same ids on every engine
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    counts: dict[str, int] = {}
    for name, array in tensors(folder):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ConversionError(f"tensor {name} has no GGUF name for a Llama")
        if name.endswith("q_proj.weight"):
            array = permute_rope(np.asarray(array), heads)
        elif name.endswith("k_proj.weight"):
            array = permute_rope(np.asarray(array), kv_heads)
        data, qtype, type_name = encode(array, kind)
        writer.add_tensor(target, data, raw_dtype=qtype)
        counts[type_name] = counts.get(type_name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"path": str(out), "bytes": out.stat().st_size, "type": kind, "tensor_types": counts,
            "tokenizer": "gpt2 (pre gpt-2)", "converter_version": CONVERTER_VERSION,
            "gguf": _version("gguf")}


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    folder_arg, out_arg, kind_arg = sys.argv[1:4]
    try:
        print(json.dumps(write(Path(folder_arg), Path(out_arg), kind_arg)))
    except ConversionError as exc:
        sys.exit(f"cannot convert {folder_arg} to GGUF: {exc}")
