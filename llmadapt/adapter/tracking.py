"""What a tracking sink logs: the metrics of a record and of a summary, named with their units.

One place for the names, so that a run reads the same in every tracking tool (plugins/mlflow, plugins/tensorboard):
per step ``step_time_s``, ``loss``, ``grad_norm``, ``tokens_per_s``, ``samples_per_s``, ``memory_peak_bytes``;
per request ``ttft_ms``, ``e2el_ms``; per telemetry sample ``telemetry/<figure>`` (``cpu_percent``,
``rss_bytes``, ``gpu_util_percent``, ``gpu_memory_used_bytes``, ``power_w``); per profiled step
``breakdown/<class>_s``; at the end ``summary.<figure>`` and ``summary.<figure>.<statistic>``. The step of a
request or telemetry metric is its index in the run.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator, NamedTuple

TELEMETRY_FIGURES = ("cpu_percent", "rss_bytes", "gpu_util_percent", "gpu_memory_used_bytes", "power_w")


class TrackedMetric(NamedTuple):
    name: str
    value: float
    step: int
    wall_ns: int
    """When it was measured, on the wall clock (the run's monotonic times through rank 0's header anchor; now, for
    a record with no time or before the header)."""


def is_figure(value: Any) -> bool:
    """A finite number (not a bool): what a tracking tool can plot."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class RecordMetrics:
    """Call it with each record of one run, in order; it yields the record's metrics (none for most records)."""

    def __init__(self) -> None:
        self.requests = self.samples = 0
        self.anchor: tuple[int, int] | None = None  # (wall, monotonic) ns of rank 0's header

    def wall_ns(self, mono_ns: int | None) -> int:
        if self.anchor and mono_ns:
            return self.anchor[0] + mono_ns - self.anchor[1]
        return time.time_ns()

    def __call__(self, record: dict[str, Any]) -> Iterator[TrackedMetric]:
        kind = record.get("type")
        if kind == "header" and record.get("rank", 0) == 0:
            self.anchor = (record["wall_anchor_ns"], record["mono_anchor_ns"])
        elif kind == "step":
            step, when, seconds = record["step"], record.get("end_ns"), record["seconds"]
            memory = record.get("memory") or {}
            yield from self._figures(step, when, step_time_s=seconds, loss=record.get("loss"),
                                grad_norm=record.get("grad_norm"),
                                tokens_per_s=record["tokens"] / seconds if seconds else None,
                                samples_per_s=record["samples"] / seconds if seconds else None,
                                memory_peak_bytes=memory.get("peak_allocated_bytes") or memory.get("peak_rss_bytes"))
        elif kind == "request" and not record.get("warmup") and record.get("status") == "ok" and record.get("sent_ns"):
            sent, first, end = record["sent_ns"], record.get("first_token_ns"), record.get("end_ns")
            yield from self._figures(self.requests, end, ttft_ms=(first - sent) / 1e6 if first else None,
                                e2el_ms=(end - sent) / 1e6 if end else None)
            self.requests += 1
        elif kind == "telemetry":
            yield from self._figures(self.samples, record.get("time_ns"),
                                **{f"telemetry/{key}": record.get(key) for key in TELEMETRY_FIGURES})
            self.samples += 1
        elif kind == "breakdown" and not record.get("error"):
            for c in record.get("modules", []):
                yield from self._figures(record["step"], None, **{f"breakdown/{c['name']}_s": c["seconds"]})


    def _figures(self, step: int, mono_ns: int | None, **figures: Any) -> Iterator[TrackedMetric]:
        for name, value in figures.items():
            if is_figure(value):
                yield TrackedMetric(name, float(value), step, self.wall_ns(mono_ns))


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's figures: ``summary.<key>`` for a number, ``summary.<key>.<stat>`` for a statistics table."""
    out: dict[str, float] = {}
    for key, value in summary.items():
        table = value if isinstance(value, dict) else {"": value}
        for stat, figure in table.items():
            if is_figure(figure):
                out[f"summary.{key}.{stat}" if stat else f"summary.{key}"] = float(figure)
    return out
