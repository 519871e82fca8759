"""A run folder's layout: the one place that knows its files' names.

    RUN_ID/
      launch.json         what was asked (workload, adapter, launcher, world size), written before any worker
      rank-00000.jsonl    each rank's records, one per line, flushed as they happen
      launcher.jsonl      what the orchestrator saw (failures it read from exit codes, teardown warnings)
      summary.json        written last, from the records (``show`` rebuilds it when it is missing)
      worker.log          the workers' stdout and stderr; engine.log and engine.pid for a managed server
      profile/step-N/rank-R.json   profile.level full: each profiled step's Kineto trace per rank (HTA reads a folder)
      node-K/             across nodes: node K's own copy of its records, launch and logs
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs


@attrs.frozen
class RunDir:
    path: Path = attrs.field(converter=Path)

    LAUNCH = "launch.json"
    SUMMARY = "summary.json"
    LAUNCHER = "launcher.jsonl"
    WORKER_LOG = "worker.log"
    ENGINE_LOG = "engine.log"
    ENGINE_PID = "engine.pid"
    RANK_GLOB = "rank-*.jsonl"

    @property
    def launch_file(self) -> Path:
        return self.path / self.LAUNCH

    @property
    def summary_file(self) -> Path:
        return self.path / self.SUMMARY

    @property
    def launcher_file(self) -> Path:
        return self.path / self.LAUNCHER

    @property
    def worker_log(self) -> Path:
        return self.path / self.WORKER_LOG

    @property
    def engine_log(self) -> Path:
        return self.path / self.ENGINE_LOG

    @property
    def engine_pid(self) -> Path:
        return self.path / self.ENGINE_PID

    def profile_trace(self, step: int, rank: int) -> Path:
        """A profiled step's Kineto trace of one rank; one folder per step, as Holistic Trace Analysis reads them."""
        return self.path / "profile" / f"step-{step}" / f"rank-{rank}.json"

    def rank_file(self, rank: int) -> Path:
        return self.path / f"rank-{rank:05d}.jsonl"

    def rank_files(self) -> list[Path]:
        return sorted(self.path.glob(self.RANK_GLOB))

    def node(self, node_rank: int) -> RunDir:
        return RunDir(self.path / f"node-{node_rank}")

    def read_launch(self) -> dict[str, Any]:
        return json.loads(self.launch_file.read_text())

    def write_launch(self, launch: dict[str, Any]) -> None:
        self.launch_file.write_text(json.dumps(launch, indent=2))

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.summary_file.write_text(json.dumps(summary, indent=2))
