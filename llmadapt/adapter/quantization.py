"""Base-weight quantization (QLoRA) as every stack that loads a transformers model does it (worker side): the
bitsandbytes config, the experts transformers 5 fuses into 3-D parameters quantized too, and what the model holds
per module class, checked against the workload before step 0.

bitsandbytes replaces ``nn.Linear`` layers; transformers 5 holds a MoE layer's experts as 3-D parameters
(Mixtral's ``mlp.experts.gate_up_proj`` and ``down_proj``), which it leaves as they were loaded. Those are quantized
here with bitsandbytes' functional API (the codes and block size of its Linear4bit, or LLM.int8's row-wise int8)
and dequantized for the length of the experts' forward into a tensor under the parameter's name: peft's LoRA on the
experts (its ``ParamWrapper``, which maps w1/w2/w3 onto the fused tensors and parametrizes that tensor with its
update) works on it as on the unquantized model. Nothing here imports torch at module level.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from llmadapt.adapter.breakdown import hf_module_class
from llmadapt.contract.records import WeightClass

FOUR_BIT = ("nf4", "fp4")
BLOCKSIZE = 64  # bitsandbytes' Linear4bit default (transformers' BitsAndBytesConfig passes none)


def bnb_config(quant: str, compute_dtype):
    """transformers' BitsAndBytesConfig for ``optimizations.quantization`` (nf4/fp4: 4-bit, int8: LLM.int8)."""
    from transformers import BitsAndBytesConfig

    if quant in FOUR_BIT:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_compute_dtype=compute_dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


class FusedWeight:
    """One fused expert tensor held quantized: bitsandbytes' codes and state, dequantized for the length of the
    experts' forward (in the input's dtype) into a buffer of the experts' module under the parameter's name (peft's
    LoRA parametrizes a buffer as it does a parameter), empty between calls."""

    def __init__(self, module, leaf: str, quant: str, double: bool) -> None:
        import bitsandbytes.functional as bf
        import torch

        weight = getattr(module, leaf).detach()
        self.quant, self.shape = quant, tuple(weight.shape)
        if quant in FOUR_BIT:
            self.codes, self.state = bf.quantize_4bit(weight, blocksize=BLOCKSIZE, compress_statistics=double,
                                                      quant_type=quant)
        else:
            self.codes, self.state, _ = bf.int8_vectorwise_quant(weight.reshape(-1, weight.shape[-1]).half())
        # a buffer from now on, empty between forwards: frozen anyway, and what a framework does to parameters
        # (ZeRO-3 partitions them, DeepSpeed broadcasts them) has no business with it
        self.module, self.leaf, self.device = module, leaf, weight.device
        del module._parameters[leaf]
        module.register_buffer(leaf, self._stand_in())
        module.__dict__.setdefault("quantized_experts", {})[leaf] = self  # a save writes it dequantized

    def _stand_in(self):
        import torch

        return torch.empty(0, dtype=torch.float32, device=self.device)

    def dequantized(self, dtype):
        import bitsandbytes.functional as bf

        if self.quant in FOUR_BIT:
            return bf.dequantize_4bit(self.codes, self.state).to(dtype)
        return bf.int8_vectorwise_dequant(self.codes, self.state).reshape(self.shape).to(dtype)

    def load(self, dtype) -> None:
        """The weight dequantized in ``dtype``, the input's (as bitsandbytes' Linear4bit computes)."""
        self.module._buffers[self.leaf] = self.dequantized(dtype)

    def release(self) -> None:
        self.module._buffers[self.leaf] = self._stand_in()  # autograd keeps what the forward saved

    @property
    def stored_bytes(self) -> int:
        return self.codes.nbytes + _state_bytes(self.state)


def _state_bytes(state) -> int:
    """The bytes a 4-bit quantization state (absmax, code table, nested statistics) or int8 row scales hold."""
    if not hasattr(state, "absmax"):
        return state.nbytes
    total = state.absmax.nbytes + state.code.nbytes
    if state.nested:
        total += state.state2.absmax.nbytes + state.state2.code.nbytes + state.offset.nbytes
    return total


def quantize_fused_experts(model, quant: str) -> dict[str, FusedWeight]:
    """Quantize every 3-D floating parameter of the model's expert modules (transformers 5's fused experts) as
    bitsandbytes quantized the linear layers (4-bit codes in blocks of 64, double quantization as the model's
    quantization config says; or int8 per row), dequantized for the length of each forward of the module the MoE
    block calls (peft's outermost ParamWrapper where LoRA targets the experts: its LoRA parametrization reads the
    weight). Call after get_peft_model: peft then wraps the parameters as it would unquantized. Returns the
    quantized tensors by parameter name (``model.named_parameters``')."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    double = bool(getattr(config, "bnb_4bit_use_double_quant", False) if not isinstance(config, dict)
                  else config.get("bnb_4bit_use_double_quant"))
    done: dict[str, FusedWeight] = {}
    for name, module in list(model.named_modules()):
        fused = [leaf for leaf, p in module.named_parameters(recurse=False)
                 if p.dim() == 3 and p.is_floating_point() and not p.requires_grad]
        if not fused or hf_module_class(name, type(module).__name__) != "moe.experts":
            continue
        weights = [FusedWeight(module, leaf, quant, double) for leaf in fused]
        done.update({f"{name}.{leaf}": w for leaf, w in zip(fused, weights)})
        outer = name
        while outer.endswith(".base_layer"):
            outer = outer.removesuffix(".base_layer")
        _dequantize_in_forward(model.get_submodule(outer), weights)
    return done


def _dequantize_in_forward(module, weights: list[FusedWeight]) -> None:
    """The module's forward with its weights dequantized for its length. Inside the forward, not in a hook: the
    profiler's range around the module (llmadapt.runtime.profile, hooks added later) then holds the
    dequantization, as it holds bitsandbytes' inside a Linear4bit."""
    forward = module.forward

    def dequantized_forward(hidden_states, *args, **kwargs):
        for w in weights:
            w.load(hidden_states.dtype)
        try:
            return forward(hidden_states, *args, **kwargs)
        finally:
            for w in weights:
                w.release()

    module.forward = dequantized_forward


def _tensors(model) -> Iterator[tuple[str, str, str, Any]]:
    """(owner module name, owner type name, parameter name, parameter) for every parameter of the model's base (LoRA's
    own left out), the fused experts' quantized buffers included."""
    from torch import nn

    for name, module in model.named_modules():
        if "lora_" in name:
            continue
        for leaf, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if isinstance(tensor, nn.Parameter) or leaf in getattr(module, "quantized_experts", {}):
                yield name, type(module).__name__, f"{name}.{leaf}" if name else leaf, tensor


def _classify(model, module_class: Callable[[str, str], str | None]) -> Callable[[str, str], str]:
    """A module's class, or its nearest classified ancestor's ('model' at the top)."""
    types = {name: type(m).__name__ for name, m in model.named_modules()}

    def find(name: str, type_name: str) -> str:
        while True:
            cls = module_class(name, type_name)
            if cls or not name:
                return cls or "model"
            name = name.rpartition(".")[0]
            type_name = types.get(name, "")
    return find


def _dtype_name(dtype) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(dtype).removeprefix("torch."),
                                                                        str(dtype).removeprefix("torch."))


def _describe(tensor, fused: FusedWeight | None, load_dtype) -> tuple[str, int, int, int]:
    """(format, parameters, stored bytes, bytes at the dtype it was loaded in) of one weight."""
    import torch

    kind, load_size = type(tensor).__name__, torch.empty((), dtype=load_dtype).element_size()
    if fused is not None:
        n = math.prod(fused.shape)
        return fused.quant, n, fused.stored_bytes, n * load_size
    if kind == "Params4bit":
        qs = tensor.quant_state
        n = math.prod(qs.shape)
        return qs.quant_type, n, tensor.nbytes + _state_bytes(qs), n * load_size
    if kind == "Int8Params":
        scales = getattr(tensor, "SCB", None)
        return "int8", tensor.numel(), tensor.nbytes + (scales.nbytes if scales is not None else 0), \
            tensor.numel() * load_size
    return _dtype_name(tensor.dtype), tensor.numel(), tensor.nbytes, tensor.nbytes


def weight_classes(model, load_dtype, fused: dict[str, FusedWeight] | None = None,
                   module_class: Callable[[str, str], str | None] = hf_module_class) -> list[WeightClass]:
    """What the model's base holds, per module class and storage format: tensors, parameters, stored bytes
    (quantization state included) and the bytes the same weights take unquantized (a quantized weight at
    ``load_dtype``, the dtype it was loaded in; a float weight as held). ``fused``: what ``quantize_fused_experts``
    returned."""
    classify, rows, fused = _classify(model, module_class), {}, fused or {}
    for owner, type_name, name, tensor in _tensors(model):
        fmt, n, stored, plain = _describe(tensor, fused.get(name), load_dtype)
        key = (classify(owner, type_name), fmt)
        t, p, b, u = rows.get(key, (0, 0, 0, 0))
        rows[key] = (t + 1, p + n, b + stored, u + plain)
    return [WeightClass(module_class=c, format=f, tensors=t, params=p, stored_bytes=b, unquantized_bytes=u)
            for (c, f), (t, p, b, u) in sorted(rows.items())]


QUANTIZED_CLASSES = ("attention.", "mlp", "moe.experts")
"""The module classes whose matrices QLoRA quantizes: attention's and the MLP's projections and the experts. The
embedding, the norms, the router and lm_head stay in the compute dtype (bitsandbytes leaves lm_head; transformers
5's router is no Linear), as llmadapt.analysis.perf.estimate counts them."""


def quantize_and_check(model, quant: str, load_dtype) -> list[WeightClass]:
    """Quantize what bitsandbytes left of a model loaded for ``quant`` and wrapped by peft (its fused experts), and
    say what the model's base holds per module class; raises naming each module class whose matrices the
    quantization should cover (``QUANTIZED_CLASSES``) and does not, before the run's first step."""
    fused = quantize_fused_experts(model, quant)
    classes = weight_classes(model, load_dtype, fused)
    classify, missing = _classify(model, hf_module_class), {}
    for owner, type_name, name, tensor in _tensors(model):
        if (name not in fused and type(tensor).__name__ not in ("Params4bit", "Int8Params") and tensor.dim() >= 2
                and tensor.is_floating_point()):
            cls = classify(owner, type_name)
            if cls.startswith(QUANTIZED_CLASSES):
                missing.setdefault((cls, _dtype_name(tensor.dtype)), []).append(name)
    if missing:
        raise RuntimeError(
            f"optimizations.quantization={quant} does not cover the whole model on this stack: " + "; ".join(
                f"{cls}: {len(names)} weight matrices stay {fmt} (e.g. {names[0]})"
                for (cls, fmt), names in sorted(missing.items())))
    return classes
