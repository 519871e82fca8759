"""Which implementation a model's code runs where transformers picks between a fused kernel and its own PyTorch
reference (worker side): a run on the slow path says so in its trace (``Trainer.notes``), as its timings are not
the fused kernels'.

transformers decides once, when its modeling module is imported: each such function is wrapped by
``use_kernel_func_from_hub_with_fallback``, which keeps whether it found the package's kernel
(``is_new_implementation``) in the wrapper's closure. That decision is read back here; where the wrapper is not
that shape (another transformers), whether the package imports is what decides, as transformers' rule is.
"""

from __future__ import annotations

import importlib
import importlib.util

# model class name suffix -> (modeling module, [(function name there, package with the fused kernel)])
_FALLBACKS = {
    "JambaMambaMixer": ("transformers.models.jamba.modeling_jamba", [
        ("mamba_selective_scan", "mamba_ssm"), ("causal_conv1d_fn", "causal_conv1d"),
    ]),
}


def _fused(module, function: str, package: str) -> bool:
    fn = getattr(module, function, None)
    cells = dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), getattr(fn, "__closure__", None) or ()))
    if "is_new_implementation" in cells:
        return bool(cells["is_new_implementation"].cell_contents)
    return importlib.util.find_spec(package) is not None


def slow_paths(model) -> list[str]:
    """One line per kind of layer in ``model`` (a torch module) that runs transformers' PyTorch reference instead
    of a fused kernel, naming the functions and the packages that would have given the kernels; [] when none."""
    present = {type(m).__name__ for m in model.modules()}
    notes = []
    for cls, (module_name, functions) in _FALLBACKS.items():
        if cls not in present:
            continue
        module = importlib.import_module(module_name)
        slow = [(fn, pkg) for fn, pkg in functions if not _fused(module, fn, pkg)]
        if slow:
            notes.append(f"slow path: transformers' {cls} runs its PyTorch reference for "
                         f"{', '.join(fn for fn, _ in slow)} ({', '.join(sorted({pkg for _, pkg in slow}))} not "
                         "installed): timings are not the fused kernels'")
    return notes
