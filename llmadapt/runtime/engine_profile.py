"""A serving engine's own profile, per engine step, in the training breakdown's classes (``serve.profile``).

The engine writes a Kineto trace of its model worker (vLLM, and the reference server under
``llmadapt.reference.profiled_serve``: ``/start_profile`` .. ``/stop_profile``); each engine step is a range the
engine names (vLLM: ``execute_context_<n>(<tokens>)_generation_<n>(<tokens>)``; the reference server:
``continuous_batching_prefill_<n>(<tokens>)_decode_<n>(<tokens>)``), the prefill and decode requests it batched.
One ``Breakdown`` record per engine step, on the CPU basis (self time of every event inside the step, as a profiled
training step is read): operators by ``operator_class`` (gemm, attention, normalization, elementwise, memory,
collectives ...), the engine's own operators by what they do (``sampling``, ``scheduler``; its KV-cache writes under
``memory``), and the engine step's own Python, the time inside the step that no operator took, as ``python``. A
range named ``llmadapt::call::<class>`` (the reference server's scheduling and sampling, as in a profiled training
step) takes its whole time, operators inside it included, as ``<class>``. On a GPU the kernels are in the trace too
and the per-kernel reading of ``llmadapt.analysis.traces`` applies; this module reads the CPU side, which every
engine trace has.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from llmadapt.adapter.breakdown import operator_class
from llmadapt.contract.records import Breakdown, ClassTime
from llmadapt.runtime.profile import CALL_RANGE

STEPS = (re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)"),
         re.compile(r"^continuous_batching_prefill_(\d+)\((\d+)\)_decode_(\d+)\((\d+)\)"))
"""The names of one engine step, vLLM's and the reference server's (``llmadapt.reference.profiled_serve``):
requests and tokens in prefill (vLLM: context) and in decode (vLLM: generation)."""
_ENGINE_OPS = (  # the engine's own operators (not ATen), by what they do; the first match decides
    ("sampling", re.compile(r"sampl|gumbel|argmax|top_?[kp]|multinomial|logprob", re.IGNORECASE)),
    ("scheduler", re.compile(r"schedul", re.IGNORECASE)),
    ("attention", re.compile(r"attention|attn|paged", re.IGNORECASE)),
    ("memory", re.compile(r"kv_cache|cache_update|reshape_and_cache|copy_blocks|swap_blocks", re.IGNORECASE)),
    ("gemm", re.compile(r"_mm\b|mm$|gemm|gemv|matmul|linear", re.IGNORECASE)),
    ("normalization", re.compile(r"norm", re.IGNORECASE)),
    ("elementwise", re.compile(r"silu|gelu|act_and_mul|rotary|rope", re.IGNORECASE)),
)


def read_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def op_class(name: str) -> str:
    """An operator's class: ATen's by ``operator_class``, an engine's own by what its name says it does."""
    if name.startswith(("aten::", "c10d::", "nccl:", "gloo:")) or name in ("detach", "detach_"):
        return operator_class(name)
    for cls, pattern in _ENGINE_OPS:
        if pattern.search(name):
            return cls
    return operator_class(name)


def step_match(name: str) -> re.Match[str] | None:
    """The engine step a range's name says (its groups: the step's shape), or None."""
    for pattern in STEPS:
        m = pattern.match(name)
        if m:
            return m
    return None


def engine_steps(trace: dict[str, Any]) -> list[Breakdown]:
    """One Breakdown per engine step in the trace (step = its index in the trace), classes in seconds: they add up to
    the step's time."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e
              and e.get("cat") in ("cpu_op", "user_annotation")]
    steps = sorted((e for e in events if e["cat"] == "user_annotation" and step_match(e["name"])),
                   key=lambda e: e["ts"])
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):  # a range before what starts with it, inside it
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    starts = {thread: [e["ts"] for e in mine] for thread, mine in by_thread.items()}
    self_us = _self_times(by_thread)
    out = []
    for index, step in enumerate(steps):
        # The step's range is the model's forward; what the worker runs after it until the next step (sampling the
        # next tokens, preparing the next inputs) belongs to it too. Time with nothing running (the engine waiting
        # for requests) does not: the step's time is its range plus the operators after it.
        start, thread = step["ts"], (step.get("pid"), step.get("tid"))
        until = steps[index + 1]["ts"] if index + 1 < len(steps) else float("inf")
        classes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        unclaimed: dict[str, float] = defaultdict(float)
        mine = by_thread[thread]
        claimed_until = float("-inf")  # the end of the llmadapt::call:: range the events are in, if any
        for e in mine[bisect.bisect_left(starts[thread], start):bisect.bisect_left(starts[thread], until)]:
            if e is step or e["ts"] + e["dur"] > until or e["ts"] < claimed_until:
                continue
            us = self_us[id(e)]
            if e["cat"] == "user_annotation" and e["name"].startswith(CALL_RANGE):
                # its class takes all of it, its operators included (their own times add up to its duration)
                cls, us, claimed_until = e["name"][len(CALL_RANGE):], e["dur"], e["ts"] + e["dur"]
            else:
                cls = "python" if e["cat"] == "user_annotation" else op_class(e["name"])
            classes[cls][0] += us
            classes[cls][1] += 1
            if cls == "other":
                unclaimed[e["name"]] += us
        classes["python"][0] += self_us[id(step)]  # the range's own time: the engine's Python around its operators
        classes["python"][1] += 1
        out.append(Breakdown(
            rank=0, step=index, level="operator", basis="cpu",
            step_seconds=sum(us for us, _ in classes.values()) / 1e6,
            operators=[ClassTime(name, us / 1e6, count=n) for name, (us, n) in sorted(classes.items())],
            other_operators=[ClassTime(name, us / 1e6) for name, us in
                             sorted(unclaimed.items(), key=lambda kv: -kv[1])[:8]],
            compute_seconds=sum(us for name, (us, _) in classes.items() if name != "python") / 1e6,
            idle_seconds=classes["python"][0] / 1e6,
        ))
    return out


def step_shape(trace: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    """Each engine step's (prefill requests, prefill tokens, decode requests, decode tokens), from its name."""
    return [tuple(int(g) for g in step_match(e["name"]).groups())  # type: ignore[misc, union-attr]
            for e in sorted((e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
                             and e.get("cat") == "user_annotation" and step_match(e.get("name", ""))),
                            key=lambda e: e["ts"])]


def _self_times(by_thread: dict[Any, list[dict[str, Any]]]) -> dict[int, float]:
    """Each event's duration less its direct children's (events nest on a thread), in microseconds."""
    out: dict[int, float] = {}
    for events in by_thread.values():
        stack: list[dict[str, Any]] = []
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            out[id(e)] = e["dur"]
            if stack:
                out[id(stack[-1])] -= e["dur"]
            stack.append(e)
    return {k: max(v, 0.0) for k, v in out.items()}
