"""Megatron-core 0.16.1 on a CPU: the compatibility layer, applied only when the worker's device is a CPU.

Megatron-core assumes CUDA throughout (literal ``device="cuda"``, ``torch.cuda.current_device()``,
CUDA RNG states, stream synchronisation, tensor type strings). Each item below is either a real
CPU equivalent (``cpu-equivalent``: the CPU does what the CUDA call did for the CUDA device) or a
shim (``shim``: something is faked). Every item applied is returned as an ``llmadapt.Patch`` so it
lands in each trace header of the run. None of them changes the arithmetic.

The patches are process-wide (module attributes), installed by :func:`install` in the worker's
``setup`` and undone (the torch-level ones) by :func:`uninstall` in its ``teardown``. The
device mapping is a ``TorchFunctionMode`` that is active only inside ``Compat.mode()`` (model
build, optimizer build, each step).
"""

from __future__ import annotations

import contextlib
from typing import Any

from llmadapt.adapter import Patch

FRAMEWORK = "megatron-core"

_applied: set[str] = set()  # patches this process has applied
_originals: list[tuple[Any, str, Any]] = []  # (object, attribute, original value) of the torch-level patches


def _patch(name: str, description: str, kind: str = "cpu-equivalent") -> Patch:
    return Patch(framework=FRAMEWORK, name=name, description=description, kind=kind)


# -- the device mapping --------------------------------------------------------------------------
def _is_cuda_device(value: Any) -> bool:
    import torch

    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    if isinstance(value, torch.device):
        return value.type == "cuda"
    # A bare int as a device means cuda:N (that is what torch.cuda.current_device() returns on a GPU).
    return isinstance(value, int) and not isinstance(value, bool)


def _make_mode(fake_type_strings: bool):
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")
    tensor_cuda = torch.Tensor.cuda
    tensor_to = torch.Tensor.to
    tensor_type = torch.Tensor.type

    class CudaToCpuMode(TorchFunctionMode):
        """Maps CUDA devices to the CPU in every torch call made while active; `.cuda()` is a no-op.

        With ``fake_type_strings``, ``tensor.type()`` of a CPU float tensor answers the CUDA
        string (``torch.cuda.FloatTensor``), which is what megatron's distributed and mixed-precision
        optimizers classify parameters by. That one is a shim."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is tensor_cuda:
                return args[0]
            if fake_type_strings and func is tensor_type and len(args) == 1 and not kwargs:
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
            device = kwargs.get("device")
            if device is not None and _is_cuda_device(device):
                kwargs["device"] = cpu
            if func is tensor_to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)) \
                    and _is_cuda_device(args[1]):
                args = (args[0], cpu, *args[2:])
            return func(*args, **kwargs)

    return CudaToCpuMode()


class Compat:
    """The CPU compatibility layer of one run: which patches it applied, and the device mode."""

    def __init__(self, *, fake_type_strings: bool, moe: bool = False) -> None:
        self.fake_type_strings = fake_type_strings
        self.moe = moe
        self.patches: list[Patch] = []
        self._mode = None

    def install(self) -> list[Patch]:
        self.patches = install(fake_type_strings=self.fake_type_strings, moe=self.moe)
        self._mode = _make_mode(self.fake_type_strings)
        return self.patches

    def uninstall(self) -> None:
        if self._mode is not None:
            uninstall()
            self._mode = None

    @contextlib.contextmanager
    def mode(self):
        if self._mode is None:
            yield
            return
        _ACTIVE.append(self._mode)
        try:
            with self._mode:
                yield
        finally:
            _ACTIVE.pop()


# Modes of the Compat contexts now entered (innermost last): the backward wrapper re-enters the innermost.
_ACTIVE: list[Any] = []


def install(*, fake_type_strings: bool, moe: bool = False) -> list[Patch]:
    """Apply every CPU patch (idempotent) and return the list of those this run relies on."""
    import torch

    if "base" not in _applied:
        _install_torch_cuda_stubs(torch)
        _install_backward_in_mode(torch)
        _install_rng(torch)
        _applied.add("base")
    if moe and "moe" not in _applied:
        if _install_moe_gemm():
            _applied.add("moe-te-gemm-none")
        _applied.add("moe")
    patches = [
        _patch("device-map", "torch.cuda.current_device() returns the CPU device, and while megatron code runs a "
                             "TorchFunctionMode maps device='cuda' / cuda:N / int devices to cpu and makes "
                             "Tensor.cuda() a no-op (megatron has ~55 literal device='cuda' and ~175 "
                             "current_device() sites)"),
        _patch("backward-in-mode", "torch.autograd's engine call (private torch.autograd.graph._engine_run_backward) "
                                   "re-enters the device mapping: a TorchFunctionMode is popped while it handles "
                                   "torch.autograd.backward, so megatron code run by the backward pass (recomputation, "
                                   "gradient hooks) would otherwise see CUDA devices. Fragile: tied to torch 2.13's internals"),
        _patch("synchronize-noop", "torch.cuda.synchronize is a no-op (CPU kernels are synchronous): megatron's timers "
                                   "and pipeline p2p call it"),
        _patch("rng-tracker-cpu", "tensor_parallel.random's CUDA RNG tracker keeps and restores CPU generator states "
                                  "(the CPU generator is the device generator); used by forks and recomputation"),
    ]
    if moe and "moe-te-gemm-none" in _applied:
        patches.append(_patch(
            "moe-te-gemm-none", "0.16.1 bug: moe_utils reads te_general_gemm, which exists only with TransformerEngine; "
                                "set to None, which selects megatron's own torch.mm router path"))
    if fake_type_strings:
        patches.append(_patch(
            "cuda-type-strings",
            "Tensor.type() of CPU float tensors answers 'torch.cuda.FloatTensor' / 'torch.cuda.BFloat16Tensor' "
            "while megatron runs: the distributed and mixed-precision optimizers classify parameters by these "
            "strings and refuse CPU ones. Fakes a string; the optimizer math is unchanged",
            kind="shim"))
    return patches


def uninstall() -> None:
    """Undo the torch-level patches (an inline run leaves the caller's torch as it found it).

    The megatron-level ones stay: they only change megatron's behaviour on a CPU, and re-applying
    them is idempotent."""
    while _originals:
        obj, name, value = _originals.pop()
        setattr(obj, name, value)
    _applied.discard("base")


def _set(obj: Any, name: str, value: Any) -> None:
    _originals.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def _install_torch_cuda_stubs(torch) -> None:
    cpu = torch.device("cpu")
    _set(torch.cuda, "current_device", lambda: cpu)
    _set(torch.cuda, "synchronize", lambda device=None: None)


def _install_backward_in_mode(torch) -> None:
    import torch.autograd.graph as graph

    original = graph._engine_run_backward

    def run_backward(*args, **kwargs):
        # Inside our mode's handler for torch.autograd.backward the mode stack is empty: push it again
        # so Python code run by the engine on this thread (autograd Functions, hooks) is mapped too.
        if _ACTIVE and torch._C._len_torch_function_stack() == 0:
            with _ACTIVE[-1]:
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    _set(graph, "_engine_run_backward", run_backward)
    _set(torch.autograd, "_engine_run_backward", run_backward)


def _install_rng(torch) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    if getattr(mrandom.CudaRNGStatesTracker.add, "_llmadapt_cpu", False):
        return
    add._llmadapt_cpu = True
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add


def _install_moe_gemm() -> bool:
    """True when the module needed the fix (TransformerEngine absent: the name was never bound)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
