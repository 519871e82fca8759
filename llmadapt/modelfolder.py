"""A local Hugging Face model folder as a workload's model (``model.path``): checked and hashed before launch.

What is checked, each failure one line naming the folder: the folder exists (a missing path that looks like
``org/name`` is called a hub name: llmadapt never downloads); ``config.json`` is readable JSON of an
architecture llmadapt's adapters run (Llama or Mixtral: SiLU, no biases, no rope scaling); the weights are
safetensors, one file or shards with their index, every shard present and every tensor the index names in its
shard's header, the embedding's shape the config's; a fast tokenizer (``tokenizer.json``) whose vocabulary fits
the model's. Only headers are read, so checking a 140 GB folder takes milliseconds.

The content hash covers the config, the weights index, each shard's sha256 and the tokenizer files. Hashing
shards reads every byte once; the result is cached in the state folder by path, size and modification time,
so the next workload on the same folder costs a stat per shard.

Light (json, struct, hashlib; ``tokenizers`` for the vocabulary), so the workload spec can use it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

from llmadapt.host import state_dir

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header


class FolderError(ValueError):
    """What is wrong with a model folder, in one line (the spec turns it into a WorkloadError on model.path)."""


def shape_of(folder: str | Path) -> dict[str, Any]:
    """The ModelSpec fields the folder's config.json gives, after checking the whole folder."""
    folder = Path(folder)
    if not folder.exists():
        if HUB_NAME.match(str(folder)) and not str(folder).startswith("."):
            raise FolderError("looks like a Hugging Face hub name, not a local folder: llmadapt never downloads; "
                              f"fetch it yourself (hf download {folder} --local-dir DIR) and give DIR")
        raise FolderError("no such folder")
    if not folder.is_dir():
        raise FolderError("is a file: give the model's folder (config.json, safetensors, tokenizer.json)")
    config = _read_json(folder / "config.json")
    fields = _fields_of(config)
    tensors = _tensors(folder)
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise FolderError("the weights have no model.embed_tokens.weight (not a Llama/Mixtral causal LM checkpoint)")
    if list(embed) != [fields["vocab_size"], fields["hidden_size"]]:
        raise FolderError(f"model.embed_tokens.weight has shape {list(embed)}, config.json says "
                          f"[vocab_size, hidden_size] = [{fields['vocab_size']}, {fields['hidden_size']}]")
    layers = {int(m.group(1)) for name in tensors if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    if layers != set(range(fields["num_layers"])):
        raise FolderError(f"the weights hold {len(layers)} layers, config.json says num_hidden_layers = "
                          f"{fields['num_layers']}")
    vocab = _tokenizer_size(folder)
    if vocab > fields["vocab_size"]:
        raise FolderError(f"tokenizer.json has {vocab} tokens but the model's vocabulary is {fields['vocab_size']}: "
                          "the tokenizer does not belong to these weights")
    return fields


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FolderError(f"has no {path.name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FolderError(f"{path.name} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FolderError(f"{path.name} is not a JSON object")
    return data


def _fields_of(config: dict[str, Any]) -> dict[str, Any]:
    """config.json -> ModelSpec fields; refuses what the adapters' models would compute differently."""
    kind = config.get("model_type")
    if kind not in ("llama", "mixtral"):
        raise FolderError(f"config.json's model_type {kind!r} ({', '.join(config.get('architectures') or [])}) is "
                          "not an architecture llmadapt's adapters run: llama or mixtral")
    unsupported = []
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {config['hidden_act']!r} (SiLU only)")
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            unsupported.append(f"{bias} true")
    rope = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or (config.get("rope_parameters") or {}).get("rope_type")
    if rope_type not in (None, "default"):
        unsupported.append(f"rope scaling {rope_type!r}")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_dim")
        if head_dim is not None and int(head_dim) != hidden // heads:
            unsupported.append(f"head_dim {head_dim} != hidden_size/num_attention_heads")
        if unsupported:
            raise FolderError(f"config.json asks for what the adapters' models do not compute: {'; '.join(unsupported)}")
        theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        fields = dict(
            family=kind, vocab_size=int(config["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)), rope_theta=float(theta),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
        if kind == "mixtral":
            fields.update(num_experts=int(config["num_local_experts"]),
                          experts_per_token=int(config.get("num_experts_per_tok", 2)))
    except KeyError as exc:
        raise FolderError(f"config.json has no {exc.args[0]}") from None
    except (TypeError, ValueError) as exc:
        raise FolderError(f"config.json has a value of the wrong type: {exc}") from None
    return fields


def shards(folder: Path) -> list[Path]:
    """The weight files: the index's shards, or the one model.safetensors."""
    if (folder / INDEX).is_file():
        weight_map = _read_json(folder / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FolderError(f"{INDEX} has no weight_map")
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise FolderError("holds pickled weights (.bin/.pt): llmadapt reads safetensors only (convert them with "
                          "transformers: from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True))")
    raise FolderError(f"has no weights ({WEIGHTS} or {INDEX})")


def _tensors(folder: Path) -> dict[str, list[int]]:
    """Every tensor's shape, from the shards' headers; the index and the headers must agree."""
    found: dict[str, list[int]] = {}
    for shard in shards(folder):
        found.update({name: shape for name, shape in _header(shard).items()})
    if (folder / INDEX).is_file():
        missing = sorted(set(_read_json(folder / INDEX)["weight_map"]) - set(found))
        if missing:
            raise FolderError(f"{INDEX} names {len(missing)} tensor(s) no shard holds, e.g. {missing[0]}")
    return found


def _header(shard: Path) -> dict[str, list[int]]:
    return {name: meta["shape"] for name, meta in read_header(shard)[0].items()}


def read_header(shard: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's tensor entries (dtype, shape, data_offsets) and the offset where their data starts."""
    if not shard.is_file():
        raise FolderError(f"shard {shard.name} is missing")
    try:
        with open(shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= _HEADER_LIMIT:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise FolderError(f"{shard.name} is not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


def shard_layout(sizes: list[tuple[str, int]], shard_bytes: int) -> list[tuple[str, list[str]]]:
    """How Hugging Face lays weights out in files: (file name, tensor names) per shard, in order, a shard
    closed before it would pass ``shard_bytes``; one ``model.safetensors`` when everything fits one."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return [(WEIGHTS, groups[0])]
    return [(f"model-{k:05d}-of-{len(groups):05d}.safetensors", group) for k, group in enumerate(groups, 1)]


def write_index(folder: Path, layout: list[tuple[str, list[str]]], total_bytes: int) -> None:
    """The weights index of a sharded layout (none for one file)."""
    if len(layout) > 1:
        weight_map = {name: file for file, names in layout for name in names}
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
                                               indent=2))


def _tokenizer_size(folder: Path) -> int:
    path = folder / "tokenizer.json"
    if not path.is_file():
        other = [p.name for p in folder.glob("tokenizer*")]
        hint = (f" ({', '.join(other)} found: save it as a fast tokenizer with transformers' "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))") if other else ""
        raise FolderError(f"has no tokenizer.json{hint}")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # the Rust parser's errors: one line
        raise FolderError(f"tokenizer.json cannot be loaded: {str(exc).splitlines()[0]}") from None


def content_hash(folder: str | Path) -> str:
    """sha256 over config, weights index, each shard's sha256 and the tokenizer files (first 20 hex digits)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for name in ("config.json", INDEX, *TOKENIZER_FILES):
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for shard in shards(folder):
        digest.update(shard.name.encode() + b"\0" + file_sha256(shard).encode())
    return digest.hexdigest()[:20]


def file_sha256(path: Path) -> str:
    """A file's sha256, cached by (real path, size, mtime): a large shard is read once per change."""
    stat = path.stat()
    key = f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
    cache_file = state_dir() / "file-hashes.json"
    cache = _load_cache(cache_file)
    if key in cache:
        return cache[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            digest.update(chunk)
    value = digest.hexdigest()
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{cache_file}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cache = _load_cache(cache_file)
            cache[key] = value
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, cache_file)
    except OSError:
        pass  # a read-only state folder: hash again next time
    return value


def _load_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}
