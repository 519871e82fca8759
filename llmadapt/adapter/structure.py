"""A module's breakdown class from its structure (its own parameters and its children), where the stack's classifier
(by name: ``Trainer.module_class``) names none. A new model family lands in a named class, or in 'unclassified'
with its share, never silently in the block around it (docs/breakdown.md). Duck-typed: nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Callable

_CONTAINERS = ("ModuleList", "ModuleDict", "ParameterList", "ParameterDict")  # no forward of their own: no range
_GLUE = (None, "model", "communication")
"""Classes of the model's own code (and a wrapper's): a module with weights inside one of them, named by nothing, is
a part of the model the taxonomy does not know."""


def module_classes(root: Any, by_name: Callable[[str, str], str | None]) -> dict[str, str | None]:
    """Each module of ``root`` by qualified name, with its class or None (its time goes to the enclosing module's):
    ``by_name`` (the stack's classifier) first, then ``structural_class``; a module holding weights that neither
    names, whose nearest classified ancestor is the model's own code ('model', a wrapper's 'communication', or
    none), is 'unclassified'."""
    modules = dict(root.named_modules())
    vocab = max((int(m.num_embeddings) for m in modules.values() if _embedding(m)), default=0)
    out: dict[str, str | None] = {}
    for name, module in modules.items():  # parents before their children
        if type(module).__name__ in _CONTAINERS:
            out[name] = None
            continue
        cls = by_name(name, type(module).__name__) or structural_class(name, module, modules, vocab)
        if cls is None and _enclosing(name, out) in _GLUE and next(iter(module.parameters()), None) is not None:
            cls = "unclassified"
        out[name] = cls
    return out


def structural_class(name: str, module: Any, modules: dict[str, Any], vocab: int = 0) -> str | None:
    """The class the structure of one module gives it, or None:

    - a state-space mixer (Mamba, Mamba-2): its selective scan's parameters (``A_log``; ``D`` or ``dt_bias``
      beside a causal 1-D convolution); an RWKV time mix (``time_decay``, ``time_first``): 'mixer';
    - an embedding table (``num_embeddings``): 'embedding'; a linear map to the vocabulary's size: 'lm_head';
    - experts: 3-D weights stacked over N experts, or one of N same-type modules in a list beside a router;
      the router: a weight of N rows beside those experts; the block holding both: 'moe.dispatch';
    - a norm: a type named ``*Norm*``, or a leaf whose only weights are 1-D (scale, shift)."""
    own = dict(module.named_parameters(recurse=False))
    children = dict(module.named_children())
    if "A_log" in own or (("D" in own or "dt_bias" in own) and any(map(_conv, children.values()))) \
            or "time_decay" in own or "time_first" in own:
        return "mixer"
    if _embedding(module):
        return "embedding"
    if vocab and getattr(module, "out_features", None) == vocab:
        return "lm_head"
    if _stacked(own):
        return "moe.experts"
    parent = modules.get(name.rpartition(".")[0]) if name else None
    if parent is not None and type(parent).__name__ == "ModuleList" and name:
        holder = modules.get(name.rpartition(".")[0].rpartition(".")[0])
        if holder is not None and _experts_in(holder) and _routed(holder):
            return "moe.experts"
    if parent is not None and _experts_in(parent) and _rows(own.get("weight")) == _experts_in(parent):
        return "moe.router"
    if _experts_in(module) and _routed(module):
        return "moe.dispatch"
    if "Norm" in type(module).__name__ or (own and not children and set(own) <= {"weight", "bias"}
                                           and not hasattr(module, "out_features")
                                           and all(len(_shape(p)) == 1 for p in own.values())):
        return "norm"
    return None


def _shape(p: Any) -> tuple[int, ...]:
    """A parameter's full shape: DeepSpeed ZeRO-3 leaves each rank an empty shard and keeps the shape in ds_shape."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


def _rows(weight: Any) -> int | None:
    """The rows of a 2-D weight (a router has one per expert); None for anything else."""
    shape = _shape(weight) if weight is not None else ()
    return shape[0] if len(shape) == 2 else None


def _enclosing(name: str, classes: dict[str, str | None]) -> str | None:
    """The class of the nearest classified ancestor of a module (None where none is)."""
    while name:
        name = name.rpartition(".")[0]
        if classes.get(name) is not None:
            return classes[name]
    return None


def _embedding(module: Any) -> bool:
    return hasattr(module, "num_embeddings") and hasattr(module, "embedding_dim")


def _conv(module: Any) -> bool:
    return hasattr(module, "kernel_size") and hasattr(module, "in_channels")


def _stacked(own: dict[str, Any]) -> int:
    """N where every own weight is stacked over N >= 2 experts (3-D or more, one leading size); else 0."""
    shapes = [_shape(p) for p in own.values()]
    leading = {shape[0] for shape in shapes if len(shape) >= 3}
    if shapes and len(leading) == 1 and all(len(shape) >= 3 for shape in shapes) and min(leading) >= 2:
        return int(min(leading))
    return 0


def _experts_in(module: Any) -> int:
    """How many experts a module holds among its children: a child of stacked weights, or a list of N >= 2
    modules of one type, each with weights; 0 for none."""
    for child in module.children():
        n = _stacked(dict(child.named_parameters(recurse=False)))
        if n:
            return n
        if type(child).__name__ == "ModuleList":
            items = list(child.children())
            if len(items) >= 2 and len({type(i) for i in items}) == 1 \
                    and all(next(iter(i.parameters()), None) is not None for i in items):
                return len(items)
    return 0


def _routed(module: Any) -> bool:
    """A module holds a router for its experts: a child whose own weight has one row per expert (a list of
    identical blocks without one is a stack of layers, not experts)."""
    n = _experts_in(module)
    return any(_rows(dict(child.named_parameters(recurse=False)).get("weight")) == n for child in module.children())
