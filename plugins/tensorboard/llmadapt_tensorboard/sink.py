"""Each llmadapt run as a TensorBoard run (event files written with tensorboardX, no TensorFlow), as it goes.

A run writes ``$LLMADAPT_TENSORBOARD_DIR/RUN_ID/``; the runs of a comparison go under one folder of the
comparison's, ``$LLMADAPT_TENSORBOARD_DIR/COMPARISON/RUN_ID/``, so TensorBoard shows them side by side. At the
start: the text ``llmadapt/run`` (what the run is) and ``llmadapt/workload`` (its settings, one per line as
``train.steps = 3``). Per record: the scalars every tracking sink logs (llmadapt.adapter.tracking: ``loss``,
``step_time_s``, ``ttft_ms``, ``telemetry/rss_bytes``, ``breakdown/<class>_s``, ...), stamped with the time the
figure was measured. At the end: the summary's figures under ``summary.``, the text ``llmadapt/tags`` (status,
problem and workload hashes, framework) and ``llmadapt/report`` (what ``llmadapt show`` prints). A comparison's
folder gets ``comparison.json`` (its rows) and each of its runs the scalar ``comparison/parity_delta`` and the
text ``llmadapt/row``.

A folder that cannot be written is said once, in one line, and the run goes on recorded locally as always
(llmadapt.launch.sinks drops a sink that raises).
"""

from __future__ import annotations

import json
import os
import re
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from llmadapt.adapter.tracking import RecordMetrics, summary_metrics
from llmadapt.analysis.report import summary_text

DIR_VAR = "LLMADAPT_TENSORBOARD_DIR"
TAG_KEYS = ("status", "problem_hash", "workload_hash", "adapter", "framework", "framework_version", "launcher")

current_comparison: ContextVar[Path | None] = ContextVar("llmadapt_tensorboard_comparison", default=None)
"""The folder of the comparison whose runs are being made (in this thread), if any."""


def writable_folder(folder: Path) -> Path:
    """The folder, made if needed; OSError in one line when it cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".llmadapt-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OSError(f"TensorBoard folder {folder} cannot be written ({exc.strerror or exc}); the run is recorded "
                      "locally only") from None
    return folder


def settings_lines(settings: dict[str, Any], prefix: str = "") -> list[str]:
    """A nested settings dict as ``name = value`` lines with dotted names, as TOML would set them."""
    lines: list[str] = []
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            lines += settings_lines(value, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key} = {json.dumps(value, default=str)}")
    return lines


def code_block(text: str) -> str:
    """Text as TensorBoard shows it verbatim (its text plugin renders Markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


class TensorBoardSink:
    """One llmadapt run's TensorBoard run: ``write(record)`` per record, ``close(summary)`` at the end."""

    def __init__(self, root: Path, run: dict[str, Any]) -> None:
        from tensorboardX import SummaryWriter

        self.logdir = writable_folder((current_comparison.get() or root) / run["run_id"])
        self.writer = SummaryWriter(logdir=str(self.logdir))
        self.metrics_of = RecordMetrics()
        what = {k: run.get(k) for k in ("run_id", "adapter", "label", "world_size")}
        self.writer.add_text("llmadapt/run", code_block(json.dumps({**what, "run_dir": str(run["run_dir"])}, indent=1)))
        self.writer.add_text("llmadapt/workload", code_block("\n".join(settings_lines(run.get("workload") or {}))))

    def write(self, record: dict[str, Any]) -> None:
        for m in self.metrics_of(record):
            self.writer.add_scalar(m.name, m.value, m.step, walltime=m.wall_ns / 1e9)

    def close(self, summary: dict[str, Any]) -> None:
        try:
            for name, value in summary_metrics(summary).items():
                self.writer.add_scalar(name, value, 0)
            tags = {k: summary[k] for k in TAG_KEYS if summary.get(k) is not None}
            if tags:
                self.writer.add_text("llmadapt/tags", code_block(json.dumps(tags, indent=1, default=str)))
            if summary:
                self.writer.add_text("llmadapt/report", code_block(summary_text(summary)))
        finally:
            self.writer.close()


class ComparisonFolder:
    """A comparison's folder: the runs made until ``close`` go under it; at the close its rows are written to
    ``comparison.json`` and each run is given its row and parity delta."""

    def __init__(self, root: Path, name: str) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        slug = re.sub(r"[^\w.-]+", "-", name).strip("-")[:80] or "comparison"
        self.folder = writable_folder(root / f"{stamp}-{slug}")
        self.token = current_comparison.set(self.folder)

    def close(self, result: dict[str, Any], status: str) -> None:
        from tensorboardX import SummaryWriter

        current_comparison.reset(self.token)
        (self.folder / "comparison.json").write_text(json.dumps({**result, "status": status}, indent=1, default=str))
        for row in result.get("rows") or []:
            delta = (row.get("metrics") or {}).get("parity_delta")
            for run_dir in row.get("run_dirs") or [row.get("run_dir")]:
                logdir = self.folder / Path(run_dir).name if run_dir else None
                if logdir is None or not logdir.is_dir():
                    continue
                # a second event file, TensorBoard reads both; its own suffix: an event file's name is the second
                # it was made in and the host, which the run's own may share
                with SummaryWriter(logdir=str(logdir), filename_suffix=".comparison") as writer:
                    writer.add_text("llmadapt/row", str(row.get("label")))
                    if delta is not None:
                        writer.add_scalar("comparison/parity_delta", delta, 0)
