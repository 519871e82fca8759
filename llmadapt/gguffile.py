"""A GGUF file as a workload's model (``model.path`` naming a ``.gguf``): its header read and checked before launch.

llama.cpp's single-file format: a header (magic, version, metadata key-values, tensor descriptions) and the tensors'
data after it, each tensor in one of ggml's types (F32, F16, or a block quantization such as Q4_1). Only the
header is read here (pure Python, no numpy, no ``gguf`` package), so the orchestrator checks a file in
milliseconds and refuses, in one line, what the conversion would fail on later: a file that is not GGUF or is
cut short, a tensor whose bytes lie past the end, an architecture llmadapt's stacks do not run (llama only; a
llama with experts is refused too), a tensor type llmadapt cannot dequantize, a missing or misshapen tensor.

The conversion itself (dequantized to fp32 safetensors, in a Hugging Face folder with the tokenizer and chat
template) runs in the reference adapter's environment: ``llmadapt.models.gguf_checkpoint``.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, BinaryIO

from llmadapt.modelfolder import FolderError

MAGIC = b"GGUF"
SUFFIX = ".gguf"
DEFAULT_ALIGNMENT = 32

TYPES: dict[int, tuple[str, int, int]] = {
    # ggml type id: (name, values per block, bytes per block), for the types gguf-py 0.19 dequantizes (what
    # transformers' GGUF loader calls); tests/test_gguf.py checks the table against gguf.constants.
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
}

# Metadata value types: id -> struct format (8 string, 9 array are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_KEEP = 64  # arrays longer than this (the vocabulary, merges) are kept as their length only


class GgufHeader:
    """What the header says: ``metadata`` (key -> value; long arrays as ``('array', length)``), ``tensors``
    (name -> (shape in PyTorch order, type name)), the file's size."""

    def __init__(self, metadata: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], size: int):
        self.metadata, self.tensors, self.size = metadata, tensors, size

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))

    def types(self) -> dict[str, int]:
        """Tensor type name -> how many tensors are stored in it (the file's quantization, as stored)."""
        counts: dict[str, int] = {}
        for _, kind in self.tensors.values():
            counts[kind] = counts.get(kind, 0) + 1
        return dict(sorted(counts.items()))


def is_gguf(path: str | Path) -> bool:
    """A path that names a GGUF file: by its suffix (what a user means), or by its first bytes."""
    path = Path(path)
    if path.suffix.lower() == SUFFIX:
        return True
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == MAGIC
    except OSError:
        return False


def read_header(path: str | Path) -> GgufHeader:
    """The header of a GGUF file, checked: magic and version, every string and array inside the file, every
    tensor of a known type whose data ends inside the file. One FolderError line otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FolderError("no such GGUF file" if not path.exists() else "is not a file")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            return _parse(f, size)
    except (struct.error, EOFError) as exc:
        raise FolderError(f"is truncated or damaged: its GGUF header ends early ({size} bytes; {exc})") from None
    except UnicodeDecodeError:
        raise FolderError("has a damaged GGUF header (a key or string that is not UTF-8)") from None


def _parse(f: BinaryIO, size: int) -> GgufHeader:
    if f.read(4) != MAGIC:
        raise FolderError("is not a GGUF file (its first bytes are not 'GGUF')")
    (version,) = _unpack(f, "<I")
    if version not in (2, 3):
        raise FolderError(f"is GGUF version {version}: llmadapt reads versions 2 and 3")
    n_tensors, n_kv = _unpack(f, "<QQ")
    if n_tensors > size or n_kv > size:  # each needs bytes of its own: counts past that are a damaged header
        raise FolderError(f"has a damaged GGUF header ({n_tensors} tensors, {n_kv} metadata keys in {size} bytes)")
    metadata = {}
    for _ in range(n_kv):
        key = _string(f, size)
        (kind,) = _unpack(f, "<I")
        metadata[key] = _value(f, kind, size, key)
    infos = []
    for _ in range(n_tensors):
        name = _string(f, size)
        (dims,) = _unpack(f, "<I")
        if dims > 8:
            raise FolderError(f"has a damaged GGUF header: tensor {name!r} with {dims} dimensions")
        shape = _unpack(f, f"<{dims}Q")
        kind, offset = _unpack(f, "<IQ")
        if kind not in TYPES:
            known = ", ".join(name for name, _, _ in TYPES.values())
            raise FolderError(f"tensor {name!r} has quantization type {kind}, which llmadapt cannot dequantize "
                              f"(unknown or unsupported; known: {known})")
        infos.append((name, tuple(reversed(shape)), kind, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    start = -(-f.tell() // alignment) * alignment
    tensors = {}
    for name, shape, kind, offset in infos:
        kind_name, block, block_bytes = TYPES[kind]
        count = math.prod(shape)
        if shape and shape[-1] % block:
            raise FolderError(f"has a damaged GGUF header: tensor {name!r} {list(shape)} is not whole {kind_name} "
                              f"blocks of {block}")
        end = start + offset + count // block * block_bytes
        if end > size:
            raise FolderError(f"is truncated: {size} bytes, but tensor {name!r} ({kind_name} {list(shape)}) ends at "
                              f"byte {end}")
        tensors[name] = (shape, kind_name)
    return GgufHeader(metadata, tensors, size)


def _unpack(f: BinaryIO, fmt: str) -> tuple[Any, ...]:
    n = struct.calcsize(fmt)
    data = f.read(n)
    if len(data) < n:
        raise EOFError("the file ends inside it")
    return struct.unpack(fmt, data)


def _string(f: BinaryIO, size: int) -> str:
    (n,) = _unpack(f, "<Q")
    if n > size:
        raise EOFError(f"a string of {n} bytes")
    data = f.read(n)
    if len(data) < n:
        raise EOFError("the file ends inside a string")
    return data.decode("utf-8")


def _value(f: BinaryIO, kind: int, size: int, key: str) -> Any:
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])[0]
    if kind == 8:
        return _string(f, size)
    if kind == 9:
        (inner,) = _unpack(f, "<I")
        (n,) = _unpack(f, "<Q")
        if n > size:
            raise EOFError(f"an array of {n} values")
        if inner in _SCALARS and n > _ARRAY_KEEP:  # skipped, not read: the vocabulary's scores, token types
            width = struct.calcsize(_SCALARS[inner])
            if f.seek(n * width, 1) > size:
                raise EOFError("the file ends inside an array")
            return ("array", n)
        values = [_value(f, inner, size, key) for _ in range(n)]
        return values if n <= _ARRAY_KEEP else ("array", n)
    raise FolderError(f"has a damaged GGUF header: metadata key {key!r} has value type {kind}")


def _need(meta: dict[str, Any], key: str) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FolderError(f"has no usable {key} in its metadata (found {value!r})")
    return value


def shape_of(path: str | Path) -> tuple[dict[str, Any], GgufHeader]:
    """The ModelSpec fields a llama GGUF gives (the names transformers' GGUF loader maps them to), after checking
    the header and every tensor the model needs; and the header."""
    header = read_header(path)
    meta, arch = header.metadata, header.architecture
    if arch != "llama":
        raise FolderError(f"is a GGUF of architecture {arch!r}: llmadapt's stacks run llama (dense) models only")
    if meta.get("llama.expert_count"):
        raise FolderError(f"is a llama GGUF with {meta['llama.expert_count']} experts: llmadapt converts dense "
                          "llama GGUF files only")
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise FolderError(f"asks for rope scaling {scaling!r}, which the adapters' models do not compute")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get("llama.vocab_size") or (tokens[1] if isinstance(tokens, tuple) else len(tokens or ()))
    fields = dict(
        family="llama", vocab_size=vocab, hidden_size=_need(meta, "llama.embedding_length"),
        intermediate_size=_need(meta, "llama.feed_forward_length"), num_layers=_need(meta, "llama.block_count"),
        num_heads=_need(meta, "llama.attention.head_count"),
        num_kv_heads=meta.get("llama.attention.head_count_kv") or meta["llama.attention.head_count"],
        max_position_embeddings=meta.get("llama.context_length", 2048),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in header.tensors,
    )
    if not vocab or meta.get("tokenizer.ggml.model") is None:
        raise FolderError("has no tokenizer (tokenizer.ggml.*): llmadapt needs the model's own tokenizer")
    _check_tensors(header, fields)
    return fields, header


def _check_tensors(header: GgufHeader, fields: dict[str, Any]) -> None:
    """Every tensor a llama needs, by its GGUF name, with the shape the metadata gives."""
    h, i, v = fields["hidden_size"], fields["intermediate_size"], fields["vocab_size"]
    d = h // fields["num_heads"] if h % fields["num_heads"] == 0 else 0
    rope_dims = header.metadata.get("llama.rope.dimension_count", d)
    if not d or rope_dims != d:
        raise FolderError(f"has head size {rope_dims} (rope.dimension_count), not hidden/heads "
                          f"{h}/{fields['num_heads']}: the adapters' models do not compute that")
    kv = fields["num_kv_heads"] * d
    want = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not fields["tie_embeddings"]:
        want["output.weight"] = (v, h)
    for n in range(fields["num_layers"]):
        for name, shape in (("attn_norm", (h,)), ("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
                            ("attn_output", (h, h)), ("ffn_norm", (h,)), ("ffn_gate", (i, h)), ("ffn_up", (i, h)),
                            ("ffn_down", (h, i))):
            want[f"blk.{n}.{name}.weight"] = shape
    for name, shape in want.items():
        if name not in header.tensors:
            raise FolderError(f"has no tensor {name!r} (not a complete llama GGUF)")
        if header.tensors[name][0] != shape:
            raise FolderError(f"tensor {name!r} has shape {list(header.tensors[name][0])}, its metadata implies "
                              f"{list(shape)}")


FILE_TYPES = {0: "ALL_F32", 1: "MOSTLY_F16", 2: "MOSTLY_Q4_0", 3: "MOSTLY_Q4_1", 7: "MOSTLY_Q8_0", 8: "MOSTLY_Q5_0",
              9: "MOSTLY_Q5_1", 10: "MOSTLY_Q2_K", 11: "MOSTLY_Q3_K_S", 12: "MOSTLY_Q3_K_M", 13: "MOSTLY_Q3_K_L",
              14: "MOSTLY_Q4_K_S", 15: "MOSTLY_Q4_K_M", 16: "MOSTLY_Q5_K_S", 17: "MOSTLY_Q5_K_M", 18: "MOSTLY_Q6_K",
              32: "MOSTLY_BF16"}
"""general.file_type's common values (llama.cpp's llama_ftype): the type the file was written at as a whole."""


def gguf_hash(path: str | Path) -> str:
    """The file's sha256, first 20 hex digits: model.checksum of a GGUF model (the length a folder's hash has)."""
    from llmadapt.modelfolder import file_sha256

    return file_sha256(Path(path))[:20]


def source_record(path: str | Path) -> dict[str, Any]:
    """What a run records of a GGUF source (the header's model_source): the file's name and full sha256, the
    tensor types it stores (type -> tensors), its declared file type, and that the weights were dequantized."""
    from llmadapt.modelfolder import file_sha256

    header = read_header(path)
    file_type = header.metadata.get("general.file_type")
    return {"format": "gguf", "file": Path(path).name, "sha256": file_sha256(Path(path)),
            "tensor_types": header.types(),
            "file_type": FILE_TYPES.get(file_type, str(file_type)) if file_type is not None else None,
            "dequantized_to": "float32"}
