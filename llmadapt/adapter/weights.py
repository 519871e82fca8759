"""A checkpoint folder's tensors, read when asked for: a rank that needs a tenth of a model reads a tenth.

`CheckpointWeights` maps tensor names to tensors across a folder's safetensors shards (the index's
``weight_map``, or the one ``model.safetensors``), reading a tensor's bytes from its shard only on access. Adapters that convert or slice weights per rank (Megatron-core's tensor- and
pipeline-parallel shards) read through it instead of loading the whole state dict.

A checkpoint folder's files, for adapters that read them: ``INDEX`` and ``WEIGHTS`` (the file names), ``shards``,
``read_header`` (a safetensors header) and ``content_hash`` (llmadapt.modelfolder's, re-exported here).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from llmadapt.modelfolder import INDEX, WEIGHTS, content_hash, read_header, shard_layout, shards, write_index

_DTYPES: dict[str, Any] = {}  # safetensors' dtype names -> torch dtypes, filled on first use (torch is heavy)


class CheckpointWeights(Mapping):
    """A checkpoint folder's tensors by name, each read from its safetensors shard when asked for."""

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
    engine serves the result; or with ``adapter_only``, a peft model's adapter alone, as peft writes it. A base
    quantized by bitsandbytes (QLoRA) is saved dequantized to the dtype it was loaded in (every weight then holds
    exactly the value the quantized layer computed with), its config without the quantization settings: the
    folder loads as a plain model. The model itself is left as it was (evaluation saves in the middle of
    training). ``write``: this rank writes (rank 0); the others only take part in what the gather needs."""
    if adapter_only and hasattr(model, "get_base_model"):
        if write:
            model.save_pretrained(str(folder), safe_serialization=True)
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    quantized = _quantized_modules(base)
    if not quantized and base is model:  # a plain model
        if write:
            model.save_pretrained(str(folder), safe_serialization=True, max_shard_size="1GB")
        return
    merged = merged_lora_state_dict(base, quantized)
    if not write:
        return
    if not quantized:
        base.save_pretrained(str(folder), state_dict=merged, safe_serialization=True, max_shard_size="1GB")
        return
    import torch

    config = base.config.to_dict()
    config.pop("quantization_config", None)
    dtype = getattr(base.config, "dtype", None) or getattr(base.config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    config["dtype"] = str(dtype).removeprefix("torch.")
    if config.get("tie_word_embeddings"):
        merged.pop("lm_head.weight", None)  # tied: the embedding holds it, as save_pretrained writes it
    merged = _published_layout(base, merged)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(str(folder))
    write_safetensors(folder, {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()})


def _published_layout(base, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict under the names and shapes ``save_pretrained`` writes. transformers 5 keeps some families
    in another layout in memory than in their published checkpoints (Mixtral's experts fused into
    ``mlp.experts.gate_up_proj``, published as ``block_sparse_moe.experts.N.w1/w3``) and reverts it on save;
    a state dict written by hand must be reverted the same way. transformers 4 has one layout."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return state_dict
    return dict(revert_weight_conversion(base, state_dict))


def _quantized_modules(base) -> dict[str, Any]:
    """The modules whose weight bitsandbytes holds quantized (4-bit Params4bit, 8-bit Int8Params), by name."""
    return {name: m for name, m in base.named_modules()
            if type(getattr(m, "weight", None)).__name__ in ("Params4bit", "Int8Params")}


def merged_lora_state_dict(base, quantized: dict[str, Any] | None = None) -> dict:
    """A peft model's base (``get_base_model()``) as the plain model's state dict, each LoRA layer's update
    (``get_delta_weight``: B A times its scale) added to a copy of its base weight; LoRA's own tensors left out.
    ``quantized`` (``_quantized_modules``): those modules' weights dequantized (peft's own dequantization) and
    their quantization state (absmax, quant_map, SCB, ...) left out; fused experts quantized by
    llmadapt.adapter.quantization dequantized too."""
    import torch

    quantized = quantized or {}
    fused = {f"{name}.{leaf}": weight for name, m in base.named_modules()  # llmadapt.adapter.quantization's experts
             for leaf, weight in getattr(m, "quantized_experts", {}).items()}
    out = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        if name in fused:
            tensor = fused[name].dequantized(torch.float32)
        owner, _, leaf = name.rpartition(".")
        module = quantized.get(owner)
        if module is None and any(name.startswith(f"{q}.weight.") for q in quantized):
            continue  # a quantized weight's state (Params4bit's quant_state entries)
        if module is not None:
            if leaf not in ("weight", "bias"):
                continue  # Int8Params' SCB, weight_format
            if leaf == "weight":
                from peft.utils.integrations import dequantize_module_weight

                tensor = dequantize_module_weight(module)
        if ".base_layer." in name:
            owner, leaf = name.partition(".base_layer.")[0], name.rpartition(".")[2]
            tensor = tensor + _lora_delta(base.get_submodule(owner), leaf, tensor.dtype)
            name = f"{owner}.{leaf}"
        out[name] = tensor.detach()
    return out


def _lora_delta(layer, leaf: str, dtype):
    """The LoRA update to the base tensor ``leaf`` of a peft layer: a Linear's to its weight, or a ParamWrapper's
    (LoRA on a parameter: transformers 5's fused experts, each wrapped around the next) to the parameter it
    wraps; 0 where none."""
    while layer is not None and hasattr(layer, "lora_A"):
        if getattr(layer, "parameter_name", "weight") == leaf:
            return sum(layer.get_delta_weight(a).to(dtype) for a in layer.active_adapters if a in layer.lora_A)
        layer = getattr(layer, "base_layer", None)
    return 0


def write_safetensors(folder: str | Path, tensors: dict[str, Any], shard_bytes: int = 1 << 30) -> None:
    """A state dict as Hugging Face writes one: ``model.safetensors``, or shards of at most ``shard_bytes`` (in
    the dict's order) with their ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    layout = shard_layout([(name, t.numel() * t.element_size()) for name, t in tensors.items()], shard_bytes)
    for file, names in layout:
        save_file({name: tensors[name].contiguous() for name in names}, str(folder / file), metadata={"format": "pt"})
    write_index(folder, layout, sum(t.numel() * t.element_size() for t in tensors.values()))
