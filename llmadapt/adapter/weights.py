"""A checkpoint folder's tensors, read when asked for: a rank that needs a tenth of a model reads a tenth.

`CheckpointWeights` maps tensor names to tensors across a folder's safetensors shards (the index's
``weight_map``, or the one ``model.safetensors``), reading a tensor's bytes from its shard only on access. Adapters that convert or slice weights per rank (Megatron-core's tensor- and
pipeline-parallel shards) read through it instead of loading the whole state dict.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from llmadapt.modelfolder import INDEX, WEIGHTS, read_header, shard_layout, write_index

_DTYPES: dict[str, Any] = {}  # safetensors' dtype names -> torch dtypes, filled on first use (torch is heavy)


class CheckpointWeights(Mapping):
    def __init__(self, folder: str | Path, file: str = WEIGHTS) -> None:
        """``file``: the one safetensors file to read when the folder has no index."""
        self.folder = Path(folder)
        if (self.folder / INDEX).is_file():
            self._file_of = json.loads((self.folder / INDEX).read_text())["weight_map"]
        else:
            self._file_of = dict.fromkeys(read_header(self.folder / file)[0], file)
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}

    def __getitem__(self, name: str):
        """Read with plain file reads, not a memory map: only the tensor's bytes enter this process, so its
        resident memory is what it keeps (a map would count every page it touched)."""
        import torch

        file = self._file_of[name]
        if file not in self._headers:
            self._headers[file] = read_header(self.folder / file)
        header, base = self._headers[file]
        meta = header[name]
        start, end = meta["data_offsets"]
        if not _DTYPES:
            _DTYPES.update({"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                            "U8": torch.uint8, "BOOL": torch.bool})
        dtype = _DTYPES[meta["dtype"]]
        if end == start:
            return torch.empty(meta["shape"], dtype=dtype)
        data = bytearray(end - start)
        with open(self.folder / file, "rb") as f:
            f.seek(base + start)
            f.readinto(data)
        return torch.frombuffer(data, dtype=dtype).reshape(meta["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of


def save_hf_model(model, folder: str | Path, *, write: bool, adapter_only: bool = False) -> None:
    """A transformers model, peft-wrapped or not, as a Hugging Face folder (config.json and safetensors shards
    in the published layout, as ``save_pretrained`` writes them): LoRA merged into the base weights, so any
    engine serves the result; or with ``adapter_only``, a peft model's adapter alone, as peft writes it. The model
    itself is left as it was (evaluation saves in the middle of training). ``write``: this rank writes (rank 0);
    the others only take part in what the gather needs."""
    if adapter_only and hasattr(model, "get_base_model"):
        if write:
            model.save_pretrained(str(folder), safe_serialization=True)
        return
    if not hasattr(model, "get_base_model"):  # not a peft model
        if write:
            model.save_pretrained(str(folder), safe_serialization=True, max_shard_size="1GB")
        return
    base = model.get_base_model()
    merged = merged_lora_state_dict(base)
    if write:
        base.save_pretrained(str(folder), state_dict=merged, safe_serialization=True, max_shard_size="1GB")


def merged_lora_state_dict(base) -> dict:
    """A peft model's base (``get_base_model()``) as the plain model's state dict, each LoRA layer's update
    (``get_delta_weight``: B A times its scale) added to a copy of its base weight; LoRA's own tensors left out."""
    out = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            owner, _, leaf = name.rpartition(".base_layer.")
            if leaf == "weight":
                layer = base.get_submodule(owner)
                tensor = tensor + sum(layer.get_delta_weight(a).to(tensor.dtype) for a in layer.active_adapters
                                      if a in layer.lora_A)
            name = f"{owner}.{leaf}"
        out[name] = tensor.detach()
    return out


def write_safetensors(folder: str | Path, tensors: dict[str, Any], shard_bytes: int = 1 << 30) -> None:
    """A state dict as Hugging Face writes one: ``model.safetensors``, or shards of at most ``shard_bytes`` (in
    the dict's order) with their ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    layout = shard_layout([(name, t.numel() * t.element_size()) for name, t in tensors.items()], shard_bytes)
    for file, names in layout:
        save_file({name: tensors[name].contiguous() for name in names}, str(folder / file), metadata={"format": "pt"})
    write_index(folder, layout, sum(t.numel() * t.element_size() for t in tensors.values()))
