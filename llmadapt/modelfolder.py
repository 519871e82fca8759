"""A local Hugging Face model folder as a workload's model (``model.path``): checked and hashed before launch.

What is checked, each failure one line naming the folder and the file (and tensor) it is about: the folder
exists (a missing path that looks like ``org/name`` is called a hub name: llmadapt never downloads);
``config.json`` is readable JSON of an architecture llmadapt's adapters run (Llama or Mixtral: SiLU, no biases,
no rope scaling), each size a whole number; the weights are safetensors, one file or shards with their index,
every shard present and every tensor the index names in the shard it says; in every shard's header the tensors'
byte ranges follow one another and end where the file ends (a truncated file is refused here, not in rank 0);
every tensor the config implies (embedding, attention, MLP or experts, norms, lm_head) is there, floating-point,
with the shape the config gives; the tokenizer and generation files are JSON, and ``tokenizer.json`` a fast
tokenizer whose vocabulary fits the model's. Only headers are read, so checking a 140 GB folder takes
milliseconds.

The content hash covers the config, the weights index, each shard's sha256 and the tokenizer files (the chat
template too). Hashing shards reads every byte once; the result is cached in the state folder by path, size and
modification time, so the next workload on the same folder costs a stat per shard.

Light (json, struct, hashlib; ``tokenizers`` for the vocabulary), so the workload spec can use it.
It is over 400 lines because it is the one place that knows how a folder's weights are laid out (the tensor
plan, the shards and their index, the header), written by the canonical checkpoint's writer and read by the
checks and the loaders.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

from llmadapt.host import state_dir

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 4.51+ saves a tokenizer's chat template
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "C64": 8, "I32": 4, "U32": 4,
                "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1}
_FLOATS = ("F32", "BF16", "F16", "F64")  # what every stack loads a weight from (and casts)
_DIMS = (  # the config.json fields that make a tensor's shape, for the message that finds another
    (r"(embed_tokens|lm_head)\.weight$", "vocab_size, hidden_size"),
    (r"norm\.weight$", "hidden_size"),
    (r"q_proj\.weight$", "num_attention_heads*head_dim, hidden_size"),
    (r"[kv]_proj\.weight$", "num_key_value_heads*head_dim, hidden_size"),
    (r"o_proj\.weight$", "hidden_size, num_attention_heads*head_dim"),
    (r"(gate_proj|up_proj|w1|w3)\.weight$", "intermediate_size, hidden_size"),
    (r"(down_proj|w2)\.weight$", "hidden_size, intermediate_size"),
    (r"gate\.weight$", "num_local_experts, hidden_size"),
)

MAMBA_D_STATE, MAMBA_D_CONV, MAMBA_EXPAND = 16, 4, 2
"""Jamba's Mamba mixer sizes: fixed at the released checkpoint's (and JambaConfig's defaults), so a jamba model is
given by the shape fields and its layout; its dt rank is ceil(hidden_size / 16) (JambaConfig's 'auto')."""


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
    head_dim = _whole(config, "head_dim", None) or fields["hidden_size"] // fields["num_heads"]
    tensors = _tensors(folder)
    if "model.embed_tokens.weight" not in tensors:
        raise FolderError("the weights have no model.embed_tokens.weight (not a Llama/Mixtral causal LM checkpoint)")
    layers = {int(m.group(1)) for name in tensors if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    if layers != set(range(fields["num_layers"])):
        raise FolderError(f"the weights hold {len(layers)} layers, config.json says num_hidden_layers = "
                          f"{fields['num_layers']}")
    _check_tensors(tensors, fields, head_dim, config)
    if head_dim * fields["num_heads"] != fields["hidden_size"]:
        raise FolderError(f"config.json asks for what the adapters' models do not compute: head_dim {head_dim} != "
                          "hidden_size/num_attention_heads")
    for name in (*TOKENIZER_FILES[1:], "generation_config.json"):
        if (folder / name).exists():
            _read_json(folder / name)
    vocab = _tokenizer_size(folder)
    if vocab > fields["vocab_size"]:
        raise FolderError(f"tokenizer.json has {vocab} tokens but the model's vocabulary is {fields['vocab_size']}: "
                          "the tokenizer does not belong to these weights")
    return fields


def _read_json(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise FolderError(f"{path.name} is a folder, not a file")
    if not path.is_file():
        raise FolderError(f"has no {path.name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FolderError(f"{path.name} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FolderError(f"{path.name} is not a JSON object")
    return data


_REQUIRED = object()


def _whole(config: dict[str, Any], key: str, default: Any = _REQUIRED, least: int = 1) -> Any:
    """config.json's ``key`` as a whole number >= ``least`` (``default`` when absent or null)."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise FolderError(f"config.json has no {key}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < least:
        raise FolderError(f"config.json's {key} is {value!r}: a whole number >= {least} is needed")
    return int(value)


def _number(config: dict[str, Any], key: str, default: float) -> float:
    """config.json's ``key`` as a positive finite number (``default`` when absent or null)."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise FolderError(f"config.json's {key} is {value!r}: a positive number is needed")
    return float(value)


def _fields_of(config: dict[str, Any]) -> dict[str, Any]:
    """config.json -> ModelSpec fields; refuses what the adapters' models would compute differently (a head_dim
    other than hidden/heads is refused by shape_of, after the weights: a hidden_size that disagrees with them is
    named as that)."""
    kind = config.get("model_type")
    if kind not in ("llama", "mixtral"):
        architectures = config.get("architectures")
        names = ", ".join(map(str, architectures)) if isinstance(architectures, list) else ""
        raise FolderError(f"config.json's model_type {kind!r} ({names}) is not an architecture llmadapt's adapters "
                          "run: llama or mixtral")
    unsupported = []
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {config['hidden_act']!r} (SiLU only)")
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            unsupported.append(f"{bias} true")
    rope = config.get("rope_scaling") or {}
    parameters = config.get("rope_parameters") or {}
    if not isinstance(rope, dict) or not isinstance(parameters, dict):
        raise FolderError("config.json's rope_scaling and rope_parameters must be JSON objects")
    rope_type = rope.get("rope_type") or rope.get("type") or parameters.get("rope_type")
    if rope_type not in (None, "default"):
        unsupported.append(f"rope scaling {rope_type!r}")
    if unsupported:
        raise FolderError(f"config.json asks for what the adapters' models do not compute: {'; '.join(unsupported)}")
    heads = _whole(config, "num_attention_heads")
    fields = dict(
        family=kind, vocab_size=_whole(config, "vocab_size"), hidden_size=_whole(config, "hidden_size"),
        intermediate_size=_whole(config, "intermediate_size"), num_layers=_whole(config, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=_whole(config, "num_key_value_heads", heads),
        max_position_embeddings=_whole(config, "max_position_embeddings", 2048),
        rope_theta=_number(config, "rope_theta", _number(parameters, "rope_theta", 10000.0)),
        norm_eps=_number(config, "rms_norm_eps", 1e-6), tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    if kind == "mixtral":
        fields.update(num_experts=_whole(config, "num_local_experts"),
                      experts_per_token=_whole(config, "num_experts_per_tok", 2))
    return fields


def _check_tensors(tensors: dict[str, tuple[str, dict[str, Any]]], fields: dict[str, Any], head_dim: int,
                   config: dict[str, Any]) -> None:
    """Every tensor the config implies is there, floating-point, and of the shape the config gives (extra
    tensors, such as a tied model's lm_head, are left to the loaders). Any float dtype passes, whatever
    config.json's dtype says: every stack casts on loading, and a saved folder keeps its start's config.json."""
    from types import SimpleNamespace

    model = SimpleNamespace(**{"num_experts": 0, **fields}, head_dim=head_dim, is_moe=fields["family"] == "mixtral")
    for name, shape in tensor_plan(model):
        if name not in tensors:
            hint = " (config.json says tie_word_embeddings false)" if name == "lm_head.weight" else ""
            raise FolderError(f"the weights have no {name}{hint}")
        file, meta = tensors[name]
        if meta["dtype"] not in _FLOATS:
            said = config.get("dtype") or config.get("torch_dtype")
            raise FolderError(f"{file}: {name} has dtype {meta['dtype']}, expected a floating-point one "
                              f"({', '.join(_FLOATS)}{f'; config.json says {said}' if said else ''})")
        if list(meta["shape"]) != list(shape):
            dims = next(dims for pattern, dims in _DIMS if re.search(pattern, name))
            raise FolderError(f"{file}: {name} has shape {list(meta['shape'])}, config.json expects {list(shape)} "
                              f"({dims})")


def tensor_plan(model: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in file order, with its shape: Hugging Face's published Llama, Jamba and
    Mixtral layouts (Mixtral's experts as ``block_sparse_moe.experts.E.w1/w2/w3``, which every loader reads).
    ``model``: a ModelSpec, or anything with its shape fields, ``head_dim`` and ``is_moe``. The canonical
    checkpoint is written from it and a model folder's weights are checked against it."""
    h, i, v = model.hidden_size, model.intermediate_size, model.vocab_size
    if getattr(model, "family", "llama") == "jamba":
        return _jamba_plan(model)
    plan = [("model.embed_tokens.weight", (v, h))]
    for n in range(model.num_layers):
        p = f"model.layers.{n}"
        plan += [(f"{p}.input_layernorm.weight", (h,)), *_attention_plan(model, p),
                 (f"{p}.post_attention_layernorm.weight", (h,))]
        if model.is_moe:
            plan.append((f"{p}.block_sparse_moe.gate.weight", (model.num_experts, h)))
            for e in range(model.num_experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                plan += [(f"{q}.w1.weight", (i, h)), (f"{q}.w2.weight", (h, i)), (f"{q}.w3.weight", (i, h))]
        else:
            plan += [(f"{p}.mlp.gate_proj.weight", (i, h)), (f"{p}.mlp.up_proj.weight", (i, h)),
                     (f"{p}.mlp.down_proj.weight", (h, i))]
    plan.append(("model.norm.weight", (h,)))
    if not model.tie_embeddings:
        plan.append(("lm_head.weight", (v, h)))
    return plan


def _attention_plan(model: Any, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """One layer's attention projections (Llama's, Mixtral's and Jamba's names and shapes)."""
    h, d = model.hidden_size, model.head_dim
    return [(f"{p}.self_attn.q_proj.weight", (model.num_heads * d, h)),
            (f"{p}.self_attn.k_proj.weight", (model.num_kv_heads * d, h)),
            (f"{p}.self_attn.v_proj.weight", (model.num_kv_heads * d, h)),
            (f"{p}.self_attn.o_proj.weight", (h, model.num_heads * d))]


def _jamba_plan(model: Any) -> list[tuple[str, tuple[int, ...]]]:
    """ai21labs/Jamba-v0.1's layout (what transformers' JambaForCausalLM loads; its experts as
    ``feed_forward.experts.E.gate_proj/up_proj/down_proj``, which it fuses on loading)."""
    h, i, v = model.hidden_size, model.intermediate_size, model.vocab_size
    inner, rank, state = model.mamba_inner, model.mamba_dt_rank, MAMBA_D_STATE
    plan = [("model.embed_tokens.weight", (v, h))]
    for n, (mixer, moe) in enumerate(model.layer_kinds):
        p = f"model.layers.{n}"
        plan.append((f"{p}.input_layernorm.weight", (h,)))
        if mixer == "attention":
            plan += _attention_plan(model, p)
        else:
            q = f"{p}.mamba"
            plan += [(f"{q}.A_log", (inner, state)), (f"{q}.D", (inner,)),
                     (f"{q}.conv1d.weight", (inner, 1, MAMBA_D_CONV)), (f"{q}.conv1d.bias", (inner,)),
                     (f"{q}.in_proj.weight", (2 * inner, h)), (f"{q}.x_proj.weight", (rank + 2 * state, inner)),
                     (f"{q}.dt_proj.weight", (inner, rank)), (f"{q}.dt_proj.bias", (inner,)),
                     (f"{q}.out_proj.weight", (h, inner)), (f"{q}.dt_layernorm.weight", (rank,)),
                     (f"{q}.b_layernorm.weight", (state,)), (f"{q}.c_layernorm.weight", (state,))]
        plan.append((f"{p}.pre_ff_layernorm.weight", (h,)))
        if moe:
            plan.append((f"{p}.feed_forward.router.weight", (model.num_experts, h)))
            for e in range(model.num_experts):
                q = f"{p}.feed_forward.experts.{e}"
                plan += [(f"{q}.gate_proj.weight", (i, h)), (f"{q}.up_proj.weight", (i, h)),
                         (f"{q}.down_proj.weight", (h, i))]
        else:
            plan += [(f"{p}.feed_forward.gate_proj.weight", (i, h)), (f"{p}.feed_forward.up_proj.weight", (i, h)),
                     (f"{p}.feed_forward.down_proj.weight", (h, i))]
    plan.append(("model.final_layernorm.weight", (h,)))
    if not model.tie_embeddings:
        plan.append(("lm_head.weight", (v, h)))
    return plan


def shards(folder: Path) -> list[Path]:
    """The weight files: the index's shards, or the one model.safetensors."""
    if (folder / INDEX).is_file():
        return [folder / name for name in sorted(set(_weight_map(folder).values()))]
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise FolderError("holds pickled weights (.bin/.pt): llmadapt reads safetensors only (convert them with "
                          "transformers: from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True))")
    raise FolderError(f"has no weights ({WEIGHTS} or {INDEX})")


def _weight_map(folder: Path) -> dict[str, str]:
    weight_map = _read_json(folder / INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise FolderError(f"{INDEX} has no weight_map")
    bad = next((f for f in weight_map.values()
                if not isinstance(f, str) or not f or Path(f).name != f or not f.isprintable()), None)
    if bad is not None:
        raise FolderError(f"{INDEX}'s weight_map names {bad!r}, not a file name in the folder")
    return weight_map


def _tensors(folder: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every tensor's shard and header entry, each shard's byte ranges checked; the index and the headers
    must agree."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for shard in shards(folder):
        header, start = read_header(shard)
        _check_ranges(shard, header, start)
        found.update({name: (shard.name, meta) for name, meta in header.items()})
    if (folder / INDEX).is_file():
        weight_map = _weight_map(folder)
        missing = sorted(set(weight_map) - set(found))
        if missing:
            raise FolderError(f"{INDEX} names {len(missing)} tensor(s) no shard holds, e.g. {_shown(missing[0])}")
        elsewhere = next((name for name, file in weight_map.items() if found[name][0] != file), None)
        if elsewhere:
            raise FolderError(f"{INDEX} puts {_shown(elsewhere)} in {weight_map[elsewhere]}, but "
                              f"{found[elsewhere][0]} holds it")
    return found


def _check_ranges(shard: Path, header: dict[str, Any], start: int) -> None:
    """What safetensors checks when a rank opens the file, from the header and the file's size: each entry well
    formed, each tensor's bytes its dtype times its shape, the tensors one after another from the header's end
    to the file's (a file cut short, or with bytes after the last tensor, is named with its first tensor off)."""
    size = shard.stat().st_size
    entries = []
    for name, meta in header.items():
        meta = meta if isinstance(meta, dict) else {"entry": meta}
        offsets = meta.get("data_offsets")
        if not (isinstance(meta.get("dtype"), str) and _naturals(meta.get("shape")) and _naturals(offsets)
                and len(offsets) == 2 and offsets[0] <= offsets[1]):
            raise FolderError(f"{shard.name}: the header entry of tensor {_shown(name)} is not a safetensors one "
                              f"(dtype, shape, data_offsets [begin, end]): {_shown(str(meta)[:120])}")
        if meta["dtype"] not in _DTYPE_BYTES:
            raise FolderError(f"{shard.name}: tensor {_shown(name)} has dtype {_shown(meta['dtype'])}, which llmadapt "
                              "does not read")
        entries.append((offsets[0], offsets[1], name, meta))
    end_of_last = 0
    for begin, end, name, meta in sorted(entries, key=lambda e: (e[0], e[1])):
        if start + end > size:
            raise FolderError(f"{shard.name} is truncated: {size} bytes, but its header puts tensor {_shown(name)} "
                              f"at bytes {start + begin}..{start + end} (the file should have "
                              f"{start + max(e[1] for e in entries)})")
        if begin != end_of_last:
            raise FolderError(f"{shard.name}: tensor {_shown(name)}'s data_offsets {[begin, end]} "
                              f"{'overlap' if begin < end_of_last else 'leave a gap after'} the previous tensor's "
                              f"(which ends at {end_of_last}): the header is damaged")
        nbytes = _DTYPE_BYTES[meta["dtype"]] * math.prod(meta["shape"])
        if end - begin != nbytes:
            raise FolderError(f"{shard.name}: tensor {_shown(name)} is {meta['dtype']} {list(meta['shape'])}, "
                              f"{nbytes} bytes, but its data_offsets hold {end - begin}: the header is damaged")
        end_of_last = end
    if start + end_of_last != size:
        raise FolderError(f"{shard.name} has {size - start - end_of_last} bytes after its last tensor: not the "
                          f"file its header was written for ({start + end_of_last} bytes)")


def _shown(text: str) -> str:
    """A name read from a file, as one printable line (control characters escaped)."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _naturals(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def read_header(shard: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's tensor entries (dtype, shape, data_offsets) and the offset where their data starts."""
    if not shard.is_file():
        raise FolderError(f"shard {shard.name} is missing")
    try:
        with open(shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= _HEADER_LIMIT:
                raise ValueError(f"header length {length}")
            if 8 + length > os.fstat(f.fileno()).st_size:
                raise ValueError(f"cut short: its header alone needs {8 + length} bytes, the file has "
                                 f"{os.fstat(f.fileno()).st_size}")
            header = json.loads(f.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
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
        _read_json(path)  # not JSON at all: said so (parsed only on failure: a large one is read once)
        raise FolderError(f"tokenizer.json cannot be loaded as a fast tokenizer: {str(exc).splitlines()[0]}") from None


def content_hash(folder: str | Path) -> str:
    """sha256 over config, weights index, each shard's sha256 and the tokenizer files, chat template included (first
    20 hex digits)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for name in ("config.json", INDEX, *TOKENIZER_FILES, CHAT_TEMPLATE_FILE):
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
