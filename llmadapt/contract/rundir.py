"""A run folder's layout: the one place that knows its files' names.

    RUN_ID/
      launch.json         what was asked (workload, adapter, launcher, world size), written before any worker
      rank-00000.jsonl    each rank's records, one per line, flushed as they happen
      launcher.jsonl      what the orchestrator saw (failures it read from exit codes, teardown warnings)
      summary.json        written last, from the records (``show`` rebuilds it when it is missing)
      worker.log          the workers' stdout and stderr; engine.log and engine.pid for a managed server
      engine.json         a managed server's command line and settings, as its adapter started it
      micro.json          a micro-benchmark's result, rebuilt from its records
      quality.json        serve.quality: the engine's answers to the held-out texts, scored by the fp32 reference
      job.sbatch          a Slurm run's batch script; slurm.out its output, copied back when readable here
      profile/step-N/rank-R.json   profile.level full: each profiled step's Kineto trace per rank (HTA reads a folder)
      node-K/             across nodes: node K's own copy of its records, launch and logs

Nothing else names these files: tests/test_architecture.py fails on a literal one elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from llmadapt.contract.launch import LaunchRequest


@attrs.frozen
class RunDir:
    """A run folder: every file a run writes, by name (the layout above); an adapter finds its engine's log and
    pid file here (``engine_log``, ``engine_pid``)."""

    path: Path = attrs.field(converter=Path)

    LAUNCH = "launch.json"
    SUMMARY = "summary.json"
    LAUNCHER = "launcher.jsonl"
    WORKER_LOG = "worker.log"
    ENGINE_LOG = "engine.log"
    ENGINE_PID = "engine.pid"
    ENGINE_JSON = "engine.json"
    MICRO = "micro.json"
    QUALITY = "quality.json"
    SLURM_SCRIPT = "job.sbatch"
    SLURM_OUT = "slurm.out"
    PROFILE = "profile"
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

    @property
    def engine_json(self) -> Path:
        return self.path / self.ENGINE_JSON

    @property
    def quality_file(self) -> Path:
        """serve.quality: the engine's answers to the held-out texts, as sent to the fp32 reference
        (llmadapt.runtime.quality)."""
        return self.path / self.QUALITY

    @property
    def micro_file(self) -> Path:
        return self.path / self.MICRO

    @property
    def slurm_script(self) -> Path:
        return self.path / self.SLURM_SCRIPT

    @property
    def slurm_out(self) -> Path:
        return self.path / self.SLURM_OUT

    @property
    def profile_dir(self) -> Path:
        return self.path / self.PROFILE

    def profile_step(self, step: int) -> Path:
        """One profiled step's traces, a folder per step, as Holistic Trace Analysis reads them."""
        return self.profile_dir / f"step-{step}"

    def profile_trace(self, step: int, rank: int) -> Path:
        """A profiled step's Kineto trace of one rank."""
        return self.profile_step(step) / f"rank-{rank}.json"

    def rank_file(self, rank: int) -> Path:
        return self.path / f"rank-{rank:05d}.jsonl"

    def rank_files(self) -> list[Path]:
        return sorted(self.path.glob(self.RANK_GLOB))

    def node(self, node_rank: int) -> RunDir:
        return RunDir(self.path / f"node-{node_rank}")

    def read_launch(self) -> LaunchRequest:
        from llmadapt.contract.launch import LaunchRequest  # here: naming a run's files needs no record class

        return LaunchRequest.from_json(json.loads(self.launch_file.read_text()))

    def write_launch(self, launch: LaunchRequest) -> None:
        self.launch_file.write_text(json.dumps(launch.to_json(), indent=2))

    def write_summary(self, summary: dict[str, Any]) -> None:
        self.summary_file.write_text(json.dumps(summary, indent=2))
