"""Profiling one training step (workload.profile): torch.profiler around the adapter's step, a range per module
the adapter classifies, and the timeline folded into one ``Breakdown`` record (docs/breakdown.md).

Attribution: every profiled event's self time goes to the innermost module range around it. A backward
operator runs outside any forward range: it goes, through the autograd node's sequence number, to the range
of the forward operator that made the node. Collectives go to 'communication', the optimizer's step and
zero_grad (torch.optim's own ranges) to 'optimizer', the rest to 'other'. On CUDA the basis is the kernel
time of what each operator launched; on CPU, self CPU time. Hooks exist only during profiled steps.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from llmadapt.adapter.breakdown import MODULE_CLASSES, collective_kind, layer_index, operator_class
from llmadapt.contract.records import Breakdown, ClassTime, LayerTime

_MODULE, _LAYER, _STEP = "llmadapt::module::", "llmadapt::layer::", "llmadapt::step"
_BACKWARD = "autograd::engine::evaluate_function"


def profiled_step(trainer, step_fn: Callable[[], Any], *, rank: int, step: int, level: str, cuda: bool,
                  run_dir: Path) -> tuple[Any, Breakdown]:
    """Run ``step_fn`` (one step) under the profiler: (its result, the breakdown). A failure of profiling
    itself gives a breakdown with ``error``; a failure of the step propagates as without profiling."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with_ops = level in ("operator", "full")
    try:
        hooks = _install_hooks(trainer, record_function)
        prof = profile(activities=activities, record_shapes=with_ops, with_flops=with_ops)
        prof.__enter__()
    except Exception as exc:  # noqa: BLE001 - profiling is optional to the run
        return step_fn(), Breakdown(rank, step, level, "cpu", 0.0, error=f"{type(exc).__name__}: {exc}"[:300])
    try:
        with record_function(_STEP):
            result = step_fn()
        if cuda:
            torch.cuda.synchronize()
    finally:
        with contextlib.suppress(Exception):
            prof.__exit__(None, None, None)
        for h in hooks:
            h.remove()
    try:
        breakdown = fold(prof.events(), rank=rank, step=step, level=level, basis="device" if cuda else "cpu")
        if level == "full":
            prof.export_chrome_trace(str(Path(run_dir) / f"profile-rank-{rank:05d}.json"))
    except Exception as exc:  # noqa: BLE001
        breakdown = Breakdown(rank, step, level, "cpu", 0.0, error=f"{type(exc).__name__}: {exc}"[:300])
    return result, breakdown


def _install_hooks(trainer, record_function) -> list[Any]:
    """A profiler range around every module the trainer classifies, and around every transformer block."""
    hooks = []
    for root in trainer.profiled_modules():
        for name, module in root.named_modules():
            cls = trainer.module_class(name, type(module).__name__)
            layer = layer_index(name)
            labels = ([f"{_LAYER}{layer}"] if layer is not None else []) + ([f"{_MODULE}{cls}"] if cls else [])
            if labels:
                hooks += _range_hooks(module, labels, record_function)
    return hooks


def _range_hooks(module, labels: list[str], record_function) -> list[Any]:
    open_ranges: list[list[Any]] = []

    def enter(_module, _args):
        ranges = [record_function(label) for label in labels]
        for r in ranges:
            r.__enter__()
        open_ranges.append(ranges)

    def leave(_module, _args, _output):
        if open_ranges:
            for r in reversed(open_ranges.pop()):
                r.__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


_LOSS_OPS = ("cross_entropy", "nll_loss")  # a loss the adapter computes outside the model's modules


def attribute(events, basis: str = "cpu"):
    """Each profiled event with where its own time goes: (event, class or None, layer or None, phase, seconds);
    phase is 'forward', 'backward' or 'step' (outside both: the optimizer, the adapter's own code)."""
    def own_time(e) -> float:
        if basis == "device":
            return (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) / 1e6
        return e.self_cpu_time_total / 1e6

    def context(e):
        """(class, layer, backward sequence key) from the innermost ranges around e."""
        cls = layer = backward_key = None
        comm = in_module = False
        node = e
        while node is not None:
            name = node.name
            if collective_kind(name):
                comm = True
            if backward_key is None and name.startswith(_MODULE):
                in_module = True
                cls = cls or name[len(_MODULE):]
            elif layer is None and backward_key is None and name.startswith(_LAYER):
                layer = int(name[len(_LAYER):])
            elif cls is None and name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
                cls = "optimizer"
            elif cls is None and not in_module and backward_key is None and any(k in name for k in _LOSS_OPS):
                cls = "lm_head_loss"
            elif backward_key is None and name.startswith(_BACKWARD):
                backward_key = (getattr(node, "fwd_thread", node.thread), node.sequence_nr)
            node = node.cpu_parent
        return ("communication" if comm else cls), layer, backward_key

    # On the CPU timeline the autograd engine's own work between two backward nodes (and before the first)
    # falls in no event: it goes to the node it leads to, not to the step's own time ('other').
    lead_in: dict[int, float] = {}
    if basis == "cpu":
        for step in (e for e in events if e.name == _STEP):
            end = step.time_range.start
            for child in sorted(step.cpu_children, key=lambda c: c.time_range.start):
                if child.name.startswith(_BACKWARD) and child.time_range.start > end:
                    lead_in[id(child)] = (child.time_range.start - end) / 1e6
                    lead_in[id(step)] = lead_in.get(id(step), 0.0) - lead_in[id(child)]
                end = max(end, child.time_range.end)
    made: dict[tuple[int, int], tuple[str | None, int | None]] = {}  # autograd node -> where its op ran
    contexts = []
    for e in events:
        ctx = context(e)
        contexts.append(ctx)
        # Operators report the sequence number the next autograd node will get, so several share one:
        # the first that ran inside a class wins over one outside every class.
        key = (e.thread, e.sequence_nr)
        if ctx[2] is None and e.sequence_nr >= 0 and (key not in made or made[key][0] is None):
            made[key] = (ctx[0], ctx[1])
    for e, (cls, layer, backward_key) in zip(events, contexts):
        if backward_key is not None:
            made_cls, made_layer = made.get(backward_key, (None, None))
            cls = cls or made_cls
            layer = layer if layer is not None else made_layer
            phase = "backward"
        else:
            phase = "forward" if cls not in (None, "optimizer") and e.name != _STEP else "step"
        yield e, cls, layer, phase, own_time(e) + lead_in.get(id(e), 0.0)


def fold(events, *, rank: int, step: int, level: str, basis: str) -> Breakdown:
    """One Breakdown from torch.profiler's FunctionEvents (see the module docstring)."""
    events = list(events)
    step_seconds = max(((e.time_range.end - e.time_range.start) / 1e6 for e in events if e.name == _STEP),
                       default=0.0)
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # forward, backward, step
    layers: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    slot = {"forward": 0, "backward": 1, "step": 2}
    other: dict[str, float] = defaultdict(float)
    for e, cls, layer, phase, seconds in attribute(events, basis):
        modules[cls or "other"][slot[phase]] += seconds
        if cls is None:
            other[e.name] += seconds
        if layer is not None and cls not in ("communication", "optimizer") and phase != "step":
            layers[layer][slot[phase]] += seconds
        if level != "module" and not e.name.startswith(("llmadapt::", _BACKWARD)):
            kind = "optimizer" if cls == "optimizer" and not collective_kind(e.name) else operator_class(e.name)
            op = ops[kind]
            op[0] += seconds
            op[1] += 1
            op[2] += float(getattr(e, "flops", 0) or 0)
    names = [*[n for n in MODULE_CLASSES if n in modules], *sorted(set(modules) - set(MODULE_CLASSES))]
    return Breakdown(
        rank=rank, step=step, level=level, basis=basis, step_seconds=step_seconds,
        modules=[ClassTime(n, sum(modules[n]), modules[n][0], modules[n][1]) for n in names],
        layers=[LayerTime(i, *layers[i]) for i in sorted(layers)],
        operators=[ClassTime(name, v[0], count=int(v[1]), flops=v[2] or None)
                   for name, v in sorted(ops.items(), key=lambda kv: -kv[1][0])],
        other=[ClassTime(name[:120], t) for name, t in sorted(other.items(), key=lambda kv: -kv[1])[:8]],
    )
