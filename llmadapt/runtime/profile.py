"""Profiling one training step (workload.profile): torch.profiler around the adapter's step, a range per module
the adapter classifies, and the timeline folded into one ``Breakdown`` record (docs/breakdown.md).

Attribution: every profiled event's self time goes to the innermost module range around it. A backward operator
runs outside any forward range: it goes, through the autograd node's sequence number, to the range of the forward
operator that made the node. Collectives go to 'communication', the optimizer's step and zero_grad (torch.optim's
own ranges) to 'optimizer', the rest to 'other'. On CUDA the basis is the kernel time of what each operator
launched, and the operator classes are the kernels' own (runtime.timeline's device_breakdown, which reads others'
traces too); on CPU, self CPU time. Hooks exist only during profiled steps.

Size: over 400 lines because attribution (the ranges, the autograd nodes' makers, the gaps that are waits) is
one algorithm over one profiler trace; the timeline's analysis lives in runtime.timeline."""

from __future__ import annotations

import bisect
import contextlib
import gc
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.adapter.breakdown import (LOSS_OPS, MODULE_CLASSES, collective_kind, layer_index, operator_class,
                                        split_module)
from llmadapt.adapter.context import MicroBatch
from llmadapt.adapter.structure import module_classes
from llmadapt.contract.records import Breakdown, ClassTime, LayerTime
from llmadapt.contract.rundir import RunDir
from llmadapt.runtime.interference import thread_run_delay
from llmadapt.runtime.timeline import STEP_MARK, analyse, intersect, length, subtract, union

_MODULE, CALL_RANGE, _LAYER = "llmadapt::module::", "llmadapt::call::", "llmadapt::layer::"
_BACKWARD = "autograd::engine::evaluate_function"
_STEP_EVENT = "ProfilerStep"  # the profiler's events name every ProfilerStep#N range 'ProfilerStep*'
_STEP_CODE = "the step's own code between operators (ProfilerStep*)"  # its own time: Python, the profiler's, waits
_MODEL_INPUTS = ((MicroBatch, "model_inputs", "model"), (MicroBatch, "attention_allowed", "model"))


class StepProfiler:
    """Profiles what runs inside it (one step) on one rank; ``breakdown`` is set on the way out.

    The profiler starts before and stops after the block, so a clock read inside the block times the step with
    the profiler's cost on its operators but not its start and stop. A failure of profiling itself gives a
    breakdown with ``error`` and leaves the block to run (and raise) as it would without profiling."""

    def __init__(self, trainer, *, rank: int, world_size: int, step: int, level: str, cuda: bool,
                 run_dir: Path, sync: Callable[[], None] | None = None) -> None:
        self.trainer, self.rank, self.world_size, self.step = trainer, rank, world_size, step
        self.sync = sync
        self.level, self.cuda, self.run_dir = level, cuda, Path(run_dir)
        self.breakdown: Breakdown | None = None
        self._prof = self._range = None
        self._hooks: list[Any] = []

    def _failed(self, exc: BaseException) -> Breakdown:
        return Breakdown(self.rank, self.step, self.level, "cpu", 0.0, error=f"{type(exc).__name__}: {exc}"[:300])

    def __enter__(self) -> StepProfiler:
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with_ops = self.level in ("operator", "full")
        # Python's collector paused for the step (collected just before): a full collection in a process holding
        # a framework's objects pauses tens of ms, and would land in whichever class it interrupted.
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._hooks = _install_hooks(self.trainer, record_function)
            self._prof = profile(activities=activities, record_shapes=with_ops, with_flops=with_ops)
            self._prof.__enter__()
            if self.sync is not None:  # starting the profiler takes each rank its own time: start the step together
                self.sync()
            self._range = record_function(f"{STEP_MARK}{self.step}")
            self._range.__enter__()
            self._waited = thread_run_delay()
        except Exception as exc:  # noqa: BLE001 - profiling is optional to the run
            self.breakdown = self._failed(exc)
            self._close()
        return self

    def _close(self) -> None:
        for closing in (self._range, self._prof):
            if closing is not None:
                with contextlib.suppress(Exception):
                    closing.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if getattr(self, "_gc_was_enabled", False):
            gc.enable()

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.breakdown is not None:  # profiling never started
            return
        waited = thread_run_delay()
        self._waited = waited - self._waited if waited is not None and self._waited is not None else None
        if self.cuda:
            import torch

            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        self._close()
        with contextlib.suppress(Exception):
            prof.__exit__(None, None, None)
        if exc_type is not None:
            return  # the step failed: its failure is the run's record, not a breakdown
        try:
            self.breakdown = self._fold(prof)
        except Exception as exc:  # noqa: BLE001
            self.breakdown = self._failed(exc)

    def _fold(self, prof) -> Breakdown:
        """The breakdown: modules and operators from the profiler's events, collectives and overlap from its
        Kineto timeline (kept at level full: profile/step-N/rank-R.json, one folder per step as HTA reads it)."""
        import json
        import os
        import tempfile

        if self.level == "full":
            path = RunDir(self.run_dir).profile_trace(self.step, self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
        else:  # read once: a file of this rank's own (removing a shared folder raced other ranks' exports)
            fd, name = tempfile.mkstemp(prefix=f".trace-{self.step}-{self.rank}-", suffix=".json", dir=self.run_dir)
            os.close(fd)
            path = Path(name)
        try:
            prof.export_chrome_trace(str(path))
            timeline = analyse(json.loads(path.read_text()), self.world_size)
        finally:
            if self.level != "full":
                with contextlib.suppress(OSError):
                    os.unlink(path)
        breakdown = fold(prof.events(), rank=self.rank, step=self.step, level=self.level,
                         basis="device" if self.cuda else "cpu")
        trace = str(path.relative_to(self.run_dir)) if self.level == "full" else None
        if "operators" in timeline:  # GPU: operator classes from the kernels, with the GEMM FLOPs of the operators
            flops = {o.name: o.flops for o in breakdown.operators if o.flops}
            timeline["operators"] = [] if self.level == "module" else [
                attrs.evolve(o, flops=flops.get(o.name)) for o in timeline["operators"]]
        return attrs.evolve(breakdown, trace=trace, descheduled_seconds=self._waited, **timeline)


class _Wrapped:
    """A method replaced on one object by a version that runs in a profiler range; ``remove`` puts it back."""

    def __init__(self, owner, name: str, label: str, record_function) -> None:
        self.owner, self.name = owner, name
        self.own = name in vars(owner)  # an instance attribute to restore, else the class's method shows again
        self.original = getattr(owner, name)
        original = self.original

        def timed(*args, **kwargs):
            with record_function(label):
                return original(*args, **kwargs)

        setattr(owner, name, timed)

    def remove(self) -> None:
        setattr(self.owner, self.name, self.original) if self.own else delattr(self.owner, self.name)


def _install_hooks(trainer, record_function) -> list[Any]:
    """A profiler range around every module the trainer or its structure classifies (adapter.structure), every
    transformer block, the calls it names (``Trainer.profiled_calls``), and the inputs the core builds for the
    model (a packed row's mask and position ids: the model's own code, 'model')."""
    hooks: list[Any] = [_Wrapped(owner, name, f"{CALL_RANGE}{cls}", record_function)
                        for owner, name, cls in [*trainer.profiled_calls(), *_MODEL_INPUTS]]
    for root in trainer.profiled_modules():
        for (name, module), cls in zip(root.named_modules(), module_classes(root, trainer.module_class).values()):
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

    # always_call: the range closes when the forward raises too. Non-reentrant activation checkpointing stops a
    # recomputation early by raising through the block's forward; a range left open would span the rest of the
    # step and count its time twice.
    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]


def _range_class(name: str) -> str | None:
    """The class of one of the core's ranges around a module or a call; None for anything else."""
    for prefix in (_MODULE, CALL_RANGE):
        if name.startswith(prefix):
            return name[len(prefix):]
    return "model" if name.startswith(_LAYER) else None


def _framework_function(name: str) -> bool:
    """A framework's own autograd Function or hook node (Megatron-core's tensor-parallel regions and linear
    layers, DeepSpeed ZeRO-3's parameter hooks): not an ATen operator, not a range of llmadapt's, not the
    autograd engine's. Where one waits for a collective, the wait is communication."""
    return not name.startswith(("aten::", "llmadapt::", _BACKWARD, _STEP_EVENT, "Optimizer.", "c10d::", "gloo:",
                                "nccl:", "record_param_comms", "cuda"))


_ACCUMULATE = "AccumulateGrad"  # the autograd node that accumulates a parameter's gradient (and runs its hooks)


def _backward_node(e) -> str:
    """The name of the backward node an event runs in ('' outside backward)."""
    node = e
    while node is not None:
        if node.name.startswith(_BACKWARD):
            return node.name
        node = node.cpu_parent
    return ""


def _gaps(events, comm_spans: list[tuple[float, float, str]] | None
          ) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """(time added to or taken from each event's own time, each event's waits for collectives by kind), on the CPU
    basis.

    A range's own time is the gaps between its children. A gap that leads to a backward node is the autograd
    engine's own work: it goes to that node, not to the range (the step's own code is 'other'). Any other gap
    of the step or of a framework call (Trainer.profiled_calls) while a collective ran is waiting for it: DDP
    waits for its last bucket after backward, DeepSpeed's backward for its gradient all-reduce. (Gaps inside
    the model's modules are left to them: there, Python runs beside a collective the framework prefetches.)
    """
    lead_in: dict[int, float] = defaultdict(float)
    waited: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for start, end, kind in comm_spans or []:
        by_kind[kind].append((start, end))
    comm_unions = {kind: union(spans) for kind, spans in by_kind.items()}
    for parent in events:
        waits = parent.name.startswith((_STEP_EVENT, CALL_RANGE)) or _framework_function(parent.name)
        if not waits and not any(c.name.startswith(_BACKWARD) for c in parent.cpu_children):
            continue
        end = parent.time_range.start
        for child in [*sorted(parent.cpu_children, key=lambda c: c.time_range.start), None]:
            gap_end = child.time_range.start if child is not None else parent.time_range.end
            if gap_end > end:
                if child is not None and child.name.startswith(_BACKWARD):
                    lead_in[id(child)] += (gap_end - end) / 1e6
                    lead_in[id(parent)] -= (gap_end - end) / 1e6
                elif waits:
                    gap = [(end, gap_end)]
                    for kind, spans in comm_unions.items():  # a gap beside two kinds: each its share, once
                        gap_wait = length(intersect(gap, spans))
                        if gap_wait:
                            gap = subtract(gap, spans)
                            waited[id(parent)][kind] += gap_wait / 1e6
                            lead_in[id(parent)] -= gap_wait / 1e6
            if child is not None:
                end = max(end, child.time_range.end)
    return lead_in, waited


def attribute(events, basis: str = "cpu", comm_spans: list[tuple[float, float, str]] | None = None):
    """Each profiled event with where its own time goes: (event, class or None, layer or None, phase, seconds,
    operator class or None); phase is 'forward' (the modules, a loss on their output), 'backward' or 'step'
    (outside both: the optimizer, waits, the adapter's own code). Own time while a collective ran (``comm_spans``:
    the backend threads' spans and their kinds) in the step, a framework call or a framework's autograd Function
    is waiting for it: yielded once more for that event, as 'communication', with the collective's kind."""
    def own_time(e) -> float:
        if basis == "device":
            return (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) / 1e6
        return e.self_cpu_time_total / 1e6

    split: dict[int, dict[int, str | None]] = {}  # a module's call -> its parts' finer classes (split_module)

    def finer(scope, part, cls: str) -> str:
        """The class of what ``part`` (a child of the range ``scope`` of class ``cls``) ran, by study A's split."""
        if id(scope) not in split:
            children = sorted(scope.cpu_children, key=lambda c: c.time_range.start)
            parts = [(c.name, _range_class(c.name)) for c in children]
            split[id(scope)] = dict(zip(map(id, children), split_module(cls, parts)))
        return split[id(scope)].get(id(part)) or cls

    def context(e):
        """(class, layer, backward sequence key, in the model's forward) from the innermost ranges around e."""
        cls = layer = backward_key = None
        comm = in_module = forward = False
        node, below = e, None
        while node is not None:
            name = node.name
            if collective_kind(name):
                comm = True
            if backward_key is None and name.startswith((_MODULE, CALL_RANGE)):
                forward = forward or name.startswith(_MODULE)
                in_module = True
                if cls is None:
                    cls = _range_class(name)
                    if below is not None:
                        cls = finer(node, below, cls)
            elif layer is None and backward_key is None and name.startswith(_LAYER):
                layer = int(name[len(_LAYER):])
            elif cls is None and name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
                cls = "optimizer"
            elif cls is None and not in_module and backward_key is None and any(k in name for k in LOSS_OPS):
                cls = "loss"
            elif backward_key is None and name.startswith(_BACKWARD):
                backward_key = (getattr(node, "fwd_thread", node.thread), node.sequence_nr)
            node, below = node.cpu_parent, node
        return ("communication" if comm else cls), layer, backward_key, forward

    lead_in, waited = _gaps(events, comm_spans) if basis == "cpu" else ({}, {})
    made: dict[tuple[int, int], tuple[str | None, int | None]] = {}  # autograd node -> where its op ran
    contexts = []
    for e in sorted(events, key=lambda e: e.time_range.start):
        ctx = context(e)
        contexts.append((e, ctx))
        # An operator reports the sequence number the next autograd node will get, and the node's maker takes
        # it: the last operator (in time) to report a number made that node. (A custom autograd Function, e.g.
        # Megatron-core's linear layers, reports its number from an event of its own name.) A module's forward run
        # again inside backward (recomputation) makes nodes too, which a nested backward then runs.
        if (ctx[2] is None or ctx[3]) and e.sequence_nr >= 0:
            made[(e.thread, e.sequence_nr)] = (ctx[0], ctx[1])
    # An in-place operator on a view makes more nodes than it reports (CopySlices, AsStrided): a number no
    # operator reported goes to the nearest one below it on its thread, the operator that made those nodes.
    numbers: dict[int, list[int]] = defaultdict(list)
    for thread, number in sorted(made):
        numbers[thread].append(number)

    def maker(key: tuple[int, int]) -> tuple[str | None, int | None]:
        if key in made:
            return made[key]
        below = numbers.get(key[0], [])
        i = bisect.bisect_left(below, key[1])
        return made[(key[0], below[i - 1])] if i else (None, None)

    for e, (cls, layer, backward_key, forward) in contexts:
        if backward_key is not None:
            made_cls, made_layer = maker(backward_key)
            cls = cls or made_cls or ("gradient" if _ACCUMULATE in _backward_node(e) else None)
            layer = layer if layer is not None else made_layer
            phase = "backward"
        else:
            phase = "forward" if forward or cls == "loss" else "step"  # a loss on the logits: the forward's end
        yield e, cls, layer, phase, own_time(e) + lead_in.get(id(e), 0.0), None
        for kind, seconds in (waited.get(id(e)) or {}).items():
            yield e, "communication", None, "step", seconds, kind


def fold(events, *, rank: int, step: int, level: str, basis: str) -> Breakdown:
    """One Breakdown from torch.profiler's FunctionEvents (see the module docstring). On the CPU basis only the
    threads that run the step count (the loop's and the autograd engine's): a communication backend's worker
    threads run beside them, and their time is in the collectives (llmadapt.runtime.timeline)."""
    from torch.autograd import DeviceType

    events = list(events)
    mark = max((e for e in events if e.name.startswith(_STEP_EVENT)),
               key=lambda e: e.time_range.end - e.time_range.start, default=None)
    step_seconds = (mark.time_range.end - mark.time_range.start) / 1e6 if mark is not None else 0.0
    if mark is not None:  # what ran inside the step's range (the ranks' synchronisation before it does not count)
        start, end = mark.time_range.start, mark.time_range.end
        events = [e for e in events if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU
                  or (e.time_range.start >= start and e.time_range.end <= end)]
    comm_spans = None
    if basis == "cpu":
        threads = {e.thread for e in events if e.name.startswith((_STEP_EVENT, _BACKWARD))}
        comm_spans = [(e.time_range.start, e.time_range.end, collective_kind(e.name)) for e in events
                      if e.thread not in threads and collective_kind(e.name)]
        events = [e for e in events if e.thread in threads]
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # forward, backward, step
    layers: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    slot = {"forward": 0, "backward": 1, "step": 2}
    other: dict[str, float] = defaultdict(float)
    other_ops: dict[str, float] = defaultdict(float)
    cross: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # 'module/operator': forward, backward, step
    for e, cls, layer, phase, seconds, waited_kind in attribute(events, basis, comm_spans):
        modules[cls or "other"][slot[phase]] += seconds
        if cls is None:
            node = _backward_node(e)
            name = _STEP_CODE if e.name.startswith(_STEP_EVENT) else e.name  # the core's step range, not the model's
            other[f"{name} (in {node[len(_BACKWARD) + 2:]})" if node and node != e.name else name] += seconds
        if layer is not None and cls not in ("communication", "optimizer") and phase != "step":
            layers[layer][slot[phase]] += seconds
        if level != "module" and not e.name.startswith(("llmadapt::", _BACKWARD, _STEP_EVENT)):
            kind = waited_kind or ("optimizer" if cls == "optimizer" and not collective_kind(e.name)
                                   else operator_class(e.name))
            op = ops[kind]
            cross[f"{cls or 'other'}/{kind}"][slot[phase]] += seconds
            if kind == "other":
                other_ops[e.name] += seconds
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
        other_operators=[ClassTime(name[:120], t) for name, t in sorted(other_ops.items(), key=lambda kv: -kv[1])[:8]],
        module_operators=[ClassTime(n, sum(v), v[0], v[1]) for n, v in sorted(cross.items(), key=lambda kv: -sum(kv[1]))],
    )
