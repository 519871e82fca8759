"""A run folder's layout: the one place that knows its files' names.

    RUN_ID/
      launch.json         what was asked (workload, adapter, launcher, world size), written before any worker
      rank-00000.jsonl    each rank's records, one per line, flushed as they happen
      launcher.jsonl      what the orchestrator saw (failures it read from exit codes, teardown warnings)
      summary.json        written last, from the records (``show`` rebuilds it when it is missing)
      worker.log          the workers' stdout and stderr; engine.log and engine.pid for a managed server
      engine.json         a managed server's command line and settings, as its adapter started it
      engine-profile/     serve.profile: the engine's own torch profile, where its adapter has the engine write it
      micro.json          a micro-benchmark's result, rebuilt from its records
      quality.json        serve.quality: the engine's answers to the held-out texts, scored by the fp32 reference
      job.sbatch          a Slurm run's batch script; slurm.out its output, copied back when readable here
      .eval-model/        workload.eval: the model as trained so far, saved for evaluation, removed after each
      profile/step-N/rank-R.json   profile.level full: each profiled step's Kineto trace per rank (HTA reads a folder)
      node-K/             across nodes: node K's own copy of its records, launch and logs

Beside these, an adapter writes files of its own (a cache, an engine's settings): it declares them, name and what
each holds, in ``AdapterInfo.run_files`` and joins them through ``RunDir.adapter_file``, which refuses a name not
declared. A run folder's whole layout is then this list and each adapter's declaration (`llmadapt adapters --json`
lists them); the core reads none of them, so an adapter's file is neither read as a record nor taken for damage.

Nothing else names these files: tests/test_architecture.py fails on any literal name joined onto a run folder
elsewhere (the core's or an adapter's).
"""

from __future__ import annotations

import json
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection

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
    ENGINE_PROFILE = "engine-profile"
    MICRO = "micro.json"
    QUALITY = "quality.json"
    SLURM_SCRIPT = "job.sbatch"
    SLURM_OUT = "slurm.out"
    PROFILE = "profile"
    EVAL_SCRATCH = ".eval-model"
    RANK_GLOB = "rank-*.jsonl"
    RECORDS_GLOB = "*.jsonl"
    """Every records file (ranks', the launcher's, a serving client's): read for the run's machine (the store)."""
    PID_GLOB = "*.pid"
    """engine.pid, or an adapter's own pid file: a process still working in the run (runstatus)."""
    NODE_GLOB = "node-*"
    """A node's own copy of its part of the run (``node``)."""

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
    def engine_profile_dir(self) -> Path:
        """serve.profile: the folder a managed engine writes its own torch profile to (``Server.start_profile``)."""
        return self.path / self.ENGINE_PROFILE

    def adapter_file(self, name: str, declared: Collection[str]) -> Path:
        """A file or folder an adapter writes here beside the core's: ``name`` must be one that ``declared`` (the
        adapter's ``AdapterInfo.run_files``) holds, so that the adapter's declaration lists every file it writes.
        ValueError for one it does not, or for a name the core writes or reads (``adapter_name_problem``)."""
        problem = self.adapter_name_problem(name)
        if problem is None and name not in declared:
            problem = f"is not among the adapter's declared run-folder files ({', '.join(declared) or 'none'}): " \
                      "add it to its AdapterInfo.run_files"
        if problem:
            raise ValueError(f"run-folder file {name!r} {problem}")
        return self.path / name

    @classmethod
    def adapter_name_problem(cls, name: str) -> str | None:
        """Why an adapter may not write ``name`` in a run folder, or None: it must be a plain name (no folders), and
        neither one of the core's files nor one the core reads by pattern (records, node folders)."""
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
            return "is not a plain file or folder name"
        core = {v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str) and "*" not in v}
        if name in core:
            return "is one of the core's run-folder files (llmadapt.contract.rundir)"
        if fnmatch(name, cls.RECORDS_GLOB) or fnmatch(name, cls.NODE_GLOB):
            return f"would be read by the core as records or a node folder ({cls.RECORDS_GLOB}, {cls.NODE_GLOB})"
        return None

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
    def eval_scratch(self) -> Path:
        """workload.eval: the trained model's save, scored on rank 0 and removed (llmadapt.runtime.evaluation)."""
        return self.path / self.EVAL_SCRATCH

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
