"""The prepared GPU check (benchmarks/gpu_check.py), rehearsed on this CPU as it runs on a GPU machine: from the
source checkout on PYTHONPATH, by an interpreter that has torch and not llmadapt (the reference adapter's
environment here), every step a real llmadapt command. So the script cannot rot between the GPU machines it
waits for."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from llmadapt.launch.environments import TOOLS_ENVIRONMENT, EnvironmentNotReadyError, python_for

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACE = ROOT.parent / "shared" / "data" / "kineto-gpu" / "a100-2rank-nccl.json.gz"


def test_the_gpu_check_rehearses_every_step_on_cpu(tmp_path):
    from llmadapt.contract.catalog import user_catalog_path

    try:
        python = python_for(TOOLS_ENVIRONMENT)
    except EnvironmentNotReadyError as exc:
        pytest.skip(str(exc))
    user_catalog = user_catalog_path().read_text() if user_catalog_path().is_file() else None
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMADAPT_PYTHON_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([str(python), "benchmarks/gpu_check.py", "--rehearse", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)
    results = json.loads((tmp_path / "gpu-check.json").read_text())
    steps = {s["step"]: s for s in results["steps"]}
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert list(steps) == ["tiny-llama", "llama-1b", "trace", "micro-peak", "estimate", "lora-eval",
                           "deepspeed-zero2", "deepspeed-zero3", "megatron", "maxbatch"]
    for name, s in steps.items():
        # a stack's step may be skipped only where its environment is not built here, saying so
        assert s["status"] == "ok" or (s["status"] == "skipped" and "environment is built" in s["message"]
                                       or name == "trace" and not SHARED_TRACE.is_file()), s
    assert results["machine"]["torch"] and results["rehearsal"] is True and results["finished"]
    tiny = steps["tiny-llama"]["figures"]
    assert tiny["basis"] == "cpu" and tiny["named_module_share"] > 0.5 and tiny["peak_memory_bytes"] > 0
    assert tiny["telemetry_source"] == "procfs" and tiny["energy_j"] is None  # no GPU: never a made-up zero
    big = steps["llama-1b"]["figures"]
    assert big["operator_classes"] and big["step_p50_s"] > 0
    assert steps["estimate"]["figures"]["predicted_step_s"] > 0
    peak = steps["micro-peak"]["figures"]
    assert peak["micro_peak_bf16_flops_per_s"] > 0 and peak["bare_matmul_bf16_flops_per_s"] > 0
    lora = steps["lora-eval"]["figures"]
    assert lora["eval_loss_after"] < lora["eval_loss_before"]  # the fine-tune learned something
    if SHARED_TRACE.is_file():
        assert steps["trace"]["figures"]["named_kernel_share"] > 0.95
    # the CPU was described in the check's own catalog, not the user's
    assert "gpu-check-cpu" in (tmp_path / "devices.toml").read_text()
    assert (user_catalog_path().read_text() if user_catalog_path().is_file() else None) == user_catalog
