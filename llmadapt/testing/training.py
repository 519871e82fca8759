"""The training and fine-tuning conformance suite (``AdapterConformance``) and the tiny workloads every adapter
runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from llmadapt.adapter.plugins import get_adapter
from llmadapt.analysis.paritycheck import loss_parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import UnsupportedError
from llmadapt.launch.runner import RunResult, run
from llmadapt.spec import Workload


INSTRUCTIONS = Path(__file__).parent.parent / "resources" / "tiny-instructions.jsonl"


def standard_workloads() -> dict[str, Workload]:
    """The tiny workloads every adapter runs: seconds each on a CPU."""
    train = Workload.from_dict({
        "kind": "train", "name": "conformance-train", "model": {"preset": "tiny-llama"},
        "train": {"seq_len": 32, "global_batch": 4, "micro_batch": 2, "steps": 3, "warmup_steps": 1, "lr": 0.003},
    })
    return {
        "train": train,
        "train-dp2": train.with_overrides(["parallelism.dp=2", "train.micro_batch=1", "name=conformance-train-dp2"]),
        "finetune": Workload.from_dict({
            "kind": "finetune", "name": "conformance-finetune", "model": {"preset": "tiny-llama"},
            "data": {"source": "jsonl", "path": str(INSTRUCTIONS)},
            "train": {"seq_len": 48, "global_batch": 4, "steps": 3, "warmup_steps": 1, "lr": 0.003},
        }),
        "moe": Workload.from_dict({
            "kind": "train", "name": "conformance-moe", "model": {"preset": "tiny-mixtral"},
            "train": {"seq_len": 32, "global_batch": 4, "steps": 2, "warmup_steps": 1, "lr": 0.003},
        }),
    }


class AdapterConformance:
    """Subclass and set ``adapter``. Override ``run_options`` to pass launcher options."""

    adapter: str = ""
    reference: str = "torch"
    run_options: dict[str, Any] = {}
    startup_timeout_s: float = 40.0
    """Start-up and one step must fit in it. Raise it for slow framework imports."""
    stall_timeout_s: float = 10.0
    """The hang test's stall timeout: how long after a step without the next one is a hang."""

    # -- helpers ------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def out(cls, tmp_path_factory) -> Path:
        return tmp_path_factory.mktemp(f"conformance-{cls.adapter}")

    @pytest.fixture(scope="class")
    @classmethod
    def info(cls):
        return get_adapter(cls.adapter)

    @pytest.fixture(scope="class")
    @classmethod
    def train_run(cls, out) -> RunResult:
        return run(standard_workloads()["train"], cls.adapter, out=out, **cls.run_options)

    def _run(self, name: str, out: Path, **options: Any) -> RunResult:
        return run(standard_workloads()[name], self.adapter, out=out, **{**self.run_options, **options})

    def _require(self, info, workload: Workload) -> None:
        try:
            from llmadapt.adapter.plugins import check_supported

            check_supported(info, workload)
        except UnsupportedError as exc:
            pytest.skip(f"not declared by the adapter: {exc}")

    # -- tests --------------------------------------------------------------------------
    def test_declaration_is_complete(self, info):
        """The adapter registers with a version, a framework, roles and an environment recipe."""
        assert info.name == self.adapter
        assert info.version and info.framework and info.roles
        assert info.environment.requirements, "an environment recipe needs pinned requirements"
        for requirement in info.environment.requirements:
            assert "==" in requirement, f"requirement {requirement!r} is not pinned exactly"

    def test_train_run_records_validate(self, train_run):
        """The tiny training run completes and every record of every rank validates against the schema."""
        assert train_run.ok, train_run.summary.failures
        workload = standard_workloads()["train"]
        files = RunDir(train_run.run_dir).rank_files()
        assert len(files) == workload.world_size
        records = [r for f in files for r in read_jsonl(f, check=True)]
        headers = [r for r in records if r["type"] == "header"]
        steps = [r for r in records if r["type"] == "step"]
        assert len(headers) == workload.world_size
        assert headers[0]["workload_hash"] == workload.content_hash
        assert headers[0]["adapter"] == self.adapter and headers[0]["framework_version"]
        assert headers[0]["checkpoint_hash"], "the canonical checkpoint's hash must be in the header"
        assert len(steps) == workload.train.total_steps * workload.world_size
        assert [s["warmup"] for s in steps if s["rank"] == 0] == [True] + [False] * workload.train.steps
        assert all(s["tokens"] > 0 and s["seconds"] > 0 for s in steps)
        assert all(math.isfinite(loss) for loss in train_run.losses)
        assert train_run.summary.tokens_per_step == workload.train.global_batch * workload.train.seq_len

    def test_fp32_loss_matches_reference(self, train_run, out):
        """On the canonical checkpoint and data, the fp32 loss trajectory matches the reference adapter.

        The reference adapter itself is checked against another computation of the same problem (one sample
        per micro-batch: other reduction order, same math), not against the very run it made."""
        workload = standard_workloads()["train"]
        if self.adapter == self.reference:
            workload = workload.with_overrides(["train.micro_batch=1"])
        reference = run(workload, self.reference, out=out)
        report = loss_parity(reference.losses, train_run.losses)
        assert report.ok, report.describe((self.reference, self.adapter))

    def test_data_parallel_matches_single_rank(self, info, train_run, out):
        """Two data-parallel ranks see the same global batches: the loss matches one rank's."""
        self._require(info, standard_workloads()["train-dp2"])
        dp2 = self._run("train-dp2", out)
        assert dp2.ok, dp2.summary.failures
        report = loss_parity(train_run.losses, dp2.losses)
        assert report.ok, report.describe(("dp=1", "dp=2"))

    def test_finetune_on_instruction_data(self, info, out):
        """Fine-tuning on JSONL instruction data runs and reports a finite, falling loss."""
        self._require(info, standard_workloads()["finetune"])
        result = self._run("finetune", out)
        assert result.ok, result.summary.failures
        assert result.losses[-1] < result.losses[0]

    def test_moe_reports_expert_load(self, info, out):
        """An MoE model reports tokens per expert per layer each step, summing to tokens x top-k."""
        workload = standard_workloads()["moe"]
        self._require(info, workload)
        result = self._run("moe", out)
        assert result.ok, result.summary.failures
        steps = [r for r in read_jsonl(RunDir(result.run_dir).rank_file(0)) if r["type"] == "step"]
        tokens = workload.train.global_batch * workload.train.seq_len
        for s in steps:
            load = s["expert_load"]
            assert load is not None and len(load) == workload.model.num_layers
            assert all(len(layer) == workload.model.num_experts for layer in load)
            assert all(sum(layer) == tokens * workload.model.experts_per_token for layer in load)

    def test_unsupported_workload_fails_before_launch(self, info, out):
        """Asking for what the adapter does not declare fails at once, naming the field; no run directory."""
        bad = standard_workloads()["train"].with_overrides(["parallelism.tp=2", "parallelism.pp=2"])
        if info.supports.tp and info.supports.pp:
            pytest.skip("the adapter declares tp and pp")
        before = set(out.iterdir())
        with pytest.raises(UnsupportedError, match=rf"adapter '{self.adapter}' cannot run parallelism\.(tp|pp)=2"):
            run(bad, self.adapter, out=out, **self.run_options)
        assert set(out.iterdir()) == before

    def test_exception_mid_run_keeps_records(self, out):
        """An exception at step 2 leaves steps 0-1 and a failure record naming the rank, step and cause."""
        result = self._run("train", out, fault={"kind": "error", "step": 2})
        assert not result.ok
        assert result.summary.steps_completed == 2
        (failure,) = result.summary.failures
        assert (failure.cause, failure.rank, failure.step) == ("error", 0, 2)
        assert "injected error at step 2" in failure.message

    def test_killed_worker_is_reported(self, out):
        """A worker killed without a word (SIGKILL) is reported as killed; earlier steps are kept."""
        result = self._run("train", out, fault={"kind": "kill", "step": 1})
        assert not result.ok
        assert result.summary.steps_completed == 1
        assert result.summary.failures[0].cause == "killed"

    def test_hang_times_out_and_leaves_no_process(self, out):
        """A worker hung after its first step is stopped by the stall timeout: failure 'timeout' naming the stall,
        records kept, process group gone. The run's own timeout (start-up, one step and the stall) is only a cap: a
        hang it ends instead fails here."""
        result = self._run("train", out, fault={"kind": "hang", "step": 1},
                           timeout=self.startup_timeout_s + self.stall_timeout_s, stall_timeout=self.stall_timeout_s)
        assert not result.ok
        stalls = [f for f in result.summary.failures if f.cause == "timeout"]
        assert stalls and "the stall timeout" in stalls[0].message, result.summary.failures
        assert result.summary.steps_completed == 1
        # The launcher killed the whole process group: nothing of it is left.
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert str(result.run_dir).encode() not in cmdline, f"process {pid} of the run is still alive"


