"""A loss that is NaN or infinite is an outcome of its own, 'diverged', never 'ok': the run stops at the first
such step (the step and rank named) unless ``train.on_nonfinite = "continue"``, which runs every step and still
ends 'diverged'. The weights of a model folder that hold garbage behind an intact header train with a NaN loss
from the first step: the same outcome.

How a loss is made non-finite for real: a learning rate of 1e30 makes Adam's first update (about lr in size,
whatever the gradient) overflow the weights, so step 1's loss is NaN; step 0 ran on the initial weights.
A gradient norm without the loss: one row of lm_head at 1e20 makes that token's logit huge, the loss about
1e20 (finite in fp32) and the gradients behind it about 1e21, whose squares overflow fp32: the norm is inf.
Adam would take that step quietly (its second moment is inf, its update 0), so only the norm tells.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_model_folder import TRAIN, save_model_folder

from llmadapt import Workload, run
from llmadapt.experiments.parity import parity
from llmadapt.errors import LlmadaptError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SHORT = ["train.steps=3", "train.warmup_steps=1", "telemetry.interval_s=0"]


def test_a_nan_loss_stops_the_run_as_diverged_naming_step_and_rank(tmp_path):
    workload = Workload.from_file(EXAMPLES / "tiny-llama.toml").with_overrides([*SHORT, "train.lr=1e30"])
    result = run(workload, "torch", out=tmp_path, launcher="inline")
    s = result.summary
    assert s.status == "diverged" and not result.ok
    assert math.isfinite(s.losses[0]) and math.isnan(s.losses[1])
    assert s.steps_completed == 2  # stopped at the first non-finite step, nothing after it ran
    (failure,) = s.failures
    assert (failure.cause, failure.step, failure.rank) == ("diverged", 1, 0)
    assert "the loss is nan at step 1 on rank 0" in failure.message


def test_going_on_past_a_nan_loss_runs_every_step_and_still_reads_diverged(tmp_path):
    workload = Workload.from_file(EXAMPLES / "tiny-llama.toml").with_overrides(
        [*SHORT, "train.lr=1e30", "train.on_nonfinite=continue"])
    s = run(workload, "torch", out=tmp_path, launcher="inline").summary
    assert s.status == "diverged" and s.steps_completed == 4
    (failure,) = s.failures  # listed as a stopped run's is: the status is not the only place it shows
    assert (failure.cause, failure.step) == ("diverged", 1)
    assert failure.message == ("the loss was not finite at 3 step(s), the first at step 1; the gradient norm was "
                               "not finite at 3 step(s), the first at step 1")
    # going on or not is not the problem: the same problem hash; the workload's own hash differs (it runs more)
    stop = Workload.from_file(EXAMPLES / "tiny-llama.toml").with_overrides([*SHORT, "train.lr=1e30"])
    assert workload.problem_hash == stop.problem_hash and workload.content_hash != stop.content_hash


def test_garbage_weights_behind_an_intact_header_diverge_at_step_zero_and_exit_1(tmp_path):
    folder = save_model_folder(tmp_path / "garbage")
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = b"\xff" * (len(data) - header)  # every float32 0xffffffff: NaN
    shard.write_bytes(bytes(data))
    cmd = [sys.executable, "-m", "llmadapt.cli", "run", str(EXAMPLES / "tiny-llama.toml"), "--adapter", "torch",
           "--launcher", "inline", "--out", str(tmp_path / "runs"), "--set", f"model.path={folder}",
           *[a for o in TRAIN for a in ("--set", o)], "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    summary = json.loads(done.stdout)["summary"]
    assert summary["status"] == "diverged"
    assert [(f["cause"], f["step"]) for f in summary["failures"]] == [("diverged", 0)]


def test_parity_names_a_diverged_run(tmp_path):
    workload = Workload.from_file(EXAMPLES / "tiny-llama.toml").with_overrides([*SHORT, "train.lr=1e30"])
    with pytest.raises(LlmadaptError, match=r"parity: the torch run diverged \(diverged: the loss is nan at step 1"):
        parity(workload, cells=["torch", "torch:parallelism.threads_per_rank=1"], out=tmp_path, launcher="inline")


def test_compare_shows_a_diverged_row_and_does_not_judge_it(tmp_path):
    from llmadapt.experiments.compare import compare

    workload = Workload.from_file(EXAMPLES / "tiny-llama.toml").with_overrides(SHORT)
    comparison = compare(workload, cells=["torch", "torch:train.lr=1e30"], out=tmp_path, launcher="inline")
    assert sorted(r.status for r in comparison.rows) == ["diverged", "ok"]
    table = comparison.table()
    assert "1 ok, 1 diverged, 0 failed" in table
    diverged = next(r for r in comparison.rows if r.status == "diverged")
    assert "the loss is nan at step 1" in diverged.note


def test_an_infinite_gradient_norm_behind_a_finite_loss_stops_the_run_as_diverged(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = save_model_folder(tmp_path / "steep")
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        model.lm_head.weight[5] = 1e20
    model.save_pretrained(str(folder), max_shard_size="40KB")
    workload = Workload().with_overrides([f"model.path={folder}", *TRAIN])
    s = run(workload, "torch", out=tmp_path / "runs", launcher="inline").summary
    assert s.status == "diverged"
    assert math.isfinite(s.losses[0]) and s.grad_norms == [math.inf]
    (failure,) = s.failures
    assert (failure.cause, failure.step, failure.rank) == ("diverged", 0, 0)
    assert "the gradient norm is inf at step 0 on rank 0" in failure.message


def test_every_step_reports_the_gradient_norm_it_stepped_with(tmp_path):
    s = run(Workload.from_file(EXAMPLES / "tiny-llama.toml").with_overrides(SHORT), "torch", out=tmp_path,
            launcher="inline").summary
    assert s.status == "ok" and len(s.grad_norms) == 4 and all(0 < n < 100 for n in s.grad_norms), s.grad_norms
