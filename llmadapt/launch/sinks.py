"""Live record sinks: a run's records forwarded, as the orchestrator sees them, to a Python callback (``run(...,
on_record=)``) and to the sinks plugins provide (the ``llmadapt_record_sink`` hook): how llmadapt feeds the
tracking tools people already use (plugins/tensorboard, plugins/mlflow). An experiment's sinks (the
``llmadapt_experiment_sink`` hook) see several runs as one. A sink never fails a run: one that raises is
dropped with a warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from llmadapt.contract.schema import RECORD_TYPES

Progress = Callable[[dict[str, Any]], None]


class RecordSinks:
    """Wraps a run's progress callback: on its start event it opens the plugins' sinks; every record after it goes
    to them and to ``on_record``; ``close(summary)`` ends them."""

    def __init__(self, progress: Progress | None, on_record: Callable[[dict[str, Any]], None] | None,
                 workload: dict[str, Any]) -> None:
        self.progress, self.on_record, self.workload = progress, on_record, workload
        self.sinks: list[tuple[str, Any]] = []
        self.started = False

    def _warn(self, message: str) -> None:
        if self.progress:
            self.progress({"type": "warning", "message": message})

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("type") == "start" and not self.started:
            self.started = True
            self._open(event)
        elif event.get("type") in RECORD_TYPES:
            self.record(event)
        if self.progress:
            self.progress(event)

    def _open(self, start: dict[str, Any]) -> None:
        from llmadapt.adapter.plugins import default_manager

        run = {"run_id": Path(start["run_dir"]).name, "run_dir": start["run_dir"], "adapter": start.get("adapter"),
               "label": start.get("label"), "world_size": start.get("world_size"), "workload": self.workload}
        self.sinks = open_sinks(default_manager().hook.llmadapt_record_sink, "record", self._warn, run=run)

    def record(self, record: dict[str, Any]) -> None:
        if self.on_record:
            self.on_record(record)
        for name, sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as exc:  # noqa: BLE001
                self.sinks.remove((name, sink))
                self._warn(f"record sink of plugin {name!r} dropped: {exc}")

    def close(self, summary: dict[str, Any]) -> None:
        for name, sink in self.sinks:
            try:
                sink.close(summary)
            except Exception as exc:  # noqa: BLE001
                self._warn(f"record sink of plugin {name!r} failed to close: {exc}")
        self.sinks = []


class ExperimentSinks:
    """The plugins' sinks for one experiment (``llmadapt_experiment_sink``): opened before its first run,
    ``close(result, status)`` once it is over; a sink that raises is dropped with a warning (``warn``)."""

    def __init__(self, experiment: dict[str, Any], warn: Callable[[str], None] | None) -> None:
        from llmadapt.adapter.plugins import default_manager

        self.warn = warn or (lambda message: None)
        self.sinks = open_sinks(default_manager().hook.llmadapt_experiment_sink, "experiment", self.warn,
                                experiment=experiment)

    def close(self, result: dict[str, Any], status: str) -> None:
        for name, sink in reversed(self.sinks):  # the last opened first: each may have set state the others saw
            try:
                sink.close(result, status)
            except Exception as exc:  # noqa: BLE001
                self.warn(f"experiment sink of plugin {name!r} failed to close: {exc}")
        self.sinks = []


def open_sinks(hook, kind: str, warn: Callable[[str], None], **kwargs: Any) -> list[tuple[str, Any]]:
    """Each plugin's sink from ``hook`` (called with ``kwargs``), with its plugin's name; a plugin that raises is
    named through ``warn`` and left out: a sink never fails what it watches."""
    sinks = []
    for impl in reversed(hook.get_hookimpls()):
        try:
            sink = impl.function(**kwargs)
        except Exception as exc:  # noqa: BLE001
            warn(f"{kind} sink of plugin {impl.plugin_name!r} failed to start: {exc}")
            continue
        if sink is not None:
            sinks.append((impl.plugin_name, sink))
    return sinks
