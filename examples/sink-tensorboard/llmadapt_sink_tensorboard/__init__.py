"""A record sink writing each run's records to TensorBoard event files (tensorboardX), as they happen.

Active only when ``LLMADAPT_TENSORBOARD_DIR`` names a folder: each run writes ``DIR/RUN_ID/``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llmadapt.adapter import hookimpl

SUMMARY_FIGURES = ("measured_steps", "peak_memory_bytes", "achieved_flops_per_s")


@hookimpl
def llmadapt_record_sink(run: dict[str, Any]):
    folder = os.environ.get("LLMADAPT_TENSORBOARD_DIR")
    if not folder:
        return None
    return TensorBoardSink(Path(folder) / run["run_id"], run)


class TensorBoardSink:
    def __init__(self, logdir: Path, run: dict[str, Any]) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(logdir))
        self.writer.add_text("run", json.dumps({k: run[k] for k in ("run_id", "adapter", "label", "world_size")}))
        self.requests = 0

    def write(self, record: dict[str, Any]) -> None:
        kind, w = record.get("type"), self.writer
        if kind == "step":
            step = record["step"]
            w.add_scalar("train/step_seconds", record["seconds"], step)
            if record["seconds"]:
                w.add_scalar("train/tokens_per_second", record["tokens"] / record["seconds"], step)
            if record["loss"] is not None:
                w.add_scalar("train/loss", record["loss"], step)
        elif kind == "request" and not record["warmup"] and record["status"] == "ok" and record["sent_ns"]:
            self.requests += 1
            if record["first_token_ns"]:
                w.add_scalar("serve/ttft_ms", (record["first_token_ns"] - record["sent_ns"]) / 1e6, self.requests)
            if record["end_ns"]:
                w.add_scalar("serve/e2el_ms", (record["end_ns"] - record["sent_ns"]) / 1e6, self.requests)
        elif kind == "telemetry":
            if record["cpu_percent"] is not None:
                w.add_scalar("telemetry/cpu_percent", record["cpu_percent"], record["time_ns"] // 1_000_000)
            if record["rss_bytes"] is not None:
                w.add_scalar("telemetry/rss_mib", record["rss_bytes"] / 2**20, record["time_ns"] // 1_000_000)
        elif kind == "breakdown" and not record.get("error"):
            for c in record["modules"]:
                w.add_scalar(f"breakdown/{c['name']}_ms", c["seconds"] * 1e3, record["step"])

    def close(self, summary: dict[str, Any]) -> None:
        for name in SUMMARY_FIGURES:
            if isinstance(summary.get(name), (int, float)):
                self.writer.add_scalar(f"summary/{name}", summary[name], 0)
        if summary.get("step_time_s"):
            self.writer.add_scalar("summary/step_p50_seconds", summary["step_time_s"]["p50"], 0)
        if summary:
            self.writer.add_text("summary", json.dumps(summary)[:60_000])
        self.writer.close()
