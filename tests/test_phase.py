"""WorkerContext.phase, the helper the trainers time their parts with: one phase per name and source for the step,
and, when asked, one span per call on the same clock readings."""

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmadapt.adapter.context import WorkerContext
from llmadapt.contract.records import Phase, Span


def context() -> WorkerContext:
    return WorkerContext(workload=None, rank=0, local_rank=0, world_size=1, device=SimpleNamespace(type="cpu"),
                         checkpoint=Path("."), run_dir=Path("."))


def test_a_phase_timed_per_micro_batch_is_one_phase_of_the_step_and_a_span_per_call():
    ctx, phases, spans = context(), [], []
    for i in range(2):
        with ctx.phase("forward", phases, spans=spans, span=f"forward {i}"):
            time.sleep(0.002)
        with ctx.phase("backward", phases, spans=spans, span=f"backward {i}"):
            pass
    with ctx.phase("optimizer", phases, spans=spans, span="engine.step", span_source="deepspeed"):
        pass
    assert [(p.name, p.source) for p in phases] == [("forward", "llmadapt"), ("backward", "llmadapt"),
                                                    ("optimizer", "llmadapt")]
    assert [(s.name, s.source) for s in spans] == [("forward 0", "llmadapt"), ("backward 0", "llmadapt"),
                                                   ("forward 1", "llmadapt"), ("backward 1", "llmadapt"),
                                                   ("engine.step", "deepspeed")]
    # each phase is the sum of its spans, read from the same clock readings
    of_phase = {"forward": ("forward 0", "forward 1"), "backward": ("backward 0", "backward 1"),
                "optimizer": ("engine.step",)}
    for phase in phases:
        assert phase.seconds == sum((s.end_ns - s.start_ns) / 1e9 for s in spans if s.name in of_phase[phase.name])
    assert phases[0].seconds >= 0.004
    assert all(a.end_ns <= b.start_ns for a, b in zip(spans, spans[1:]))  # in order, no overlap


def test_without_spans_only_the_phase_is_recorded_and_another_source_is_another_phase():
    ctx, phases = context(), [Phase("data", 0.5, "llmadapt")]
    with ctx.phase("optimizer", phases):
        pass
    with ctx.phase("optimizer", phases, source="plain"):
        pass
    assert [(p.name, p.source) for p in phases] == [("data", "llmadapt"), ("optimizer", "llmadapt"),
                                                    ("optimizer", "plain")]
    assert phases[0] == Phase("data", 0.5, "llmadapt")
    spans: list[Span] = []
    with ctx.phase("optimizer", phases, spans=spans):  # the span's name defaults to the phase's
        pass
    assert [(s.name, s.source) for s in spans] == [("optimizer", "llmadapt")]


def test_a_part_that_raises_records_nothing():
    ctx, phases, spans = context(), [], []
    with pytest.raises(RuntimeError):
        with ctx.phase("forward", phases, spans=spans, span="forward 0"):
            raise RuntimeError("out of memory")
    assert phases == [] and spans == []
