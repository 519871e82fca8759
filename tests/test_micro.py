"""Micro-benchmarks for real, in the reference adapter's environment: operators, peaks, collectives."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt import LlmadaptError, Workload
from llmadapt.analysis.perf.micro import read_micro
from llmadapt.experiments.micro import ATTENTION_BACKENDS, micro_comm, micro_ops, op_specs, parse_sizes, save_measured_device
from llmadapt.contract.catalog import find_device
from llmadapt.contract.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
MOE = Workload.from_file(ROOT / "examples" / "tiny-mixtral.toml").with_overrides(
    ["train.seq_len=32", "train.global_batch=4"])
FAST = {"warmup": 1, "repeats": 2, "min_time_s": 0.0, "max_time_s": 0.5}


def cli(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], capture_output=True, text=True,
                          check=False, env={**os.environ, **(env or {})})


def test_op_specs_cover_the_step_with_shapes_from_the_workload():
    """QKV, output, fc1/fc2, lm_head, attention per backend, RMSNorm, rotary, SwiGLU, MoE router/dispatch, CE."""
    specs = op_specs(MOE)
    names = {s.op for s in specs}
    assert names == {"qkv", "output", "fc1", "fc2", "lm_head", "attention", "rmsnorm", "rotary", "swiglu",
                     "moe_router", "moe_dispatch", "cross_entropy"}
    assert [s.backend for s in specs if s.op == "attention"] == list(ATTENTION_BACKENDS)
    qkv = next(s for s in specs if s.op == "qkv")
    t, h, kv = 4 * 32, 64, 2 * 16
    assert qkv.shape == {"m": t, "k": h, "n": h + 2 * kv}
    assert qkv.cost["forward"].flops == 2 * t * h * (h + 2 * kv)
    assert qkv.cost["backward"].flops == 2 * qkv.cost["forward"].flops
    eager = next(s for s in specs if s.backend == "eager")
    flash = next(s for s in specs if s.backend == "flash")
    assert flash.cost["forward"].flops == eager.cost["forward"].flops / 2  # causal blocks skipped
    dense = {s.op for s in op_specs(MOE.with_overrides(["model.preset=tiny-llama"]))}
    assert "moe_router" not in dense and "moe_dispatch" not in dense


@pytest.fixture(scope="module")
def ops_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro-ops")
    peak = {"dtypes": ["fp32"], "gemm_sizes_cpu": [64, 128], "copy_bytes_cpu": 8 << 20}
    return micro_ops(MOE, timing=FAST, out=out, peak=peak)


def test_micro_ops_records_every_operator_on_the_roofline(ops_run):
    """Each operator and direction has an op_bench record with raw times; rates use the median; unsupported SDPA
    backends are recorded as such; the peaks measured first place every operator on the roofline."""
    r = ops_run
    assert r.status == "ok", r.failures
    assert r.device_kind in ("cpu", "cuda") and r.peaks["flops_per_s.fp32"] > 0 and r.peaks["memory_bytes_per_s"] > 0
    records = read_jsonl(r.run_dir / "rank-00000.jsonl")  # validates every record against the schema
    assert records[0]["type"] == "header" and records[0]["role"] == "micro-ops"
    seen = {(x["op"], x["direction"], x.get("backend")) for x in r.ops}
    for op in ("qkv", "output", "fc1", "fc2", "rmsnorm", "rotary", "swiglu", "moe_router", "moe_dispatch",
               "cross_entropy"):
        assert (op, "forward", None) in seen and (op, "backward", None) in seen, op
    backends = {x["backend"] for x in r.ops if x["op"] == "attention"}
    assert {"eager", "math"} <= backends
    assert backends | {u["backend"] for u in r.unsupported if u["op"] == "attention"} == set(ATTENTION_BACKENDS)
    for x in r.ops:
        assert len(x["times_s"]) == x["seconds"]["count"] >= 2
        if x["flops"]:
            assert x["flops_per_s"] == pytest.approx(x["flops"] / x["seconds"]["p50"])
        assert x["bound"] in ("compute", "memory") and x["roof_fraction"] > 0
    again = read_micro(r.run_dir)  # rebuilt from the records alone
    assert again.to_dict() == r.to_dict()
    rows = r.csv().strip().splitlines()
    assert rows[0].startswith("op,direction,backend") and len(rows) == 1 + len(r.peak_runs) + len(r.ops)


def test_measured_device_feeds_the_estimate(ops_run, tmp_path):
    """A CPU is described by measurement: saved peaks make a catalog entry the estimate can use."""
    path = save_measured_device("mycpu", ops_run, price_per_hour=0.1, path=tmp_path / "devices.toml")
    dev = find_device("mycpu", extra=[path])
    assert dev.measured and dev.kind == ops_run.device_kind.replace("cuda", "gpu")
    assert dev.peak("fp32") == ops_run.peaks["flops_per_s.fp32"]
    assert dev.sources["peak_flops"].ref.startswith("measured by llmadapt micro ops") and dev.sources["peak_flops"].date
    out = cli("estimate", ROOT / "examples" / "tiny-llama.toml", "--device", "mycpu", "--catalog", path, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cost_per_step"] > 0
    fit = cli("estimate", "--calibrate", ops_run.run_dir, "--save", tmp_path / "cal.json", "--json")
    assert fit.returncode == 0, fit.stderr
    coef = json.loads(fit.stdout)["fit"]["coefficients"]
    assert coef["eta_compute"] > 0 and coef["eta_memory"] > 0 and coef["op_overhead_s"] >= 0


def test_micro_comm_busbw_follows_nccl_tests(tmp_path):
    """Two ranks over gloo: every collective and size recorded; busbw = algbw x the nccl-tests factor."""
    r = micro_comm(ranks=2, sizes=[1 << 10, 1 << 16], iters=2, warmup=1, out=tmp_path)
    assert r.status == "ok", r.failures
    factors = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5, "broadcast": 1.0}
    measured = {c["op"] for c in r.comm}
    assert measured | {u["op"] for u in r.unsupported} == set(factors)
    for c in r.comm:
        mean = c["total_seconds"] / c["count"]
        assert c["count"] == 2 and c["algbw_gbytes_per_s"] == pytest.approx(c["message_bytes"] / mean / 1e9)
        assert c["busbw_gbytes_per_s"] == pytest.approx(c["algbw_gbytes_per_s"] * factors[c["op"]])
    heads = [x for x in read_jsonl(r.run_dir / "rank-00001.jsonl") if x["type"] == "header"]
    assert heads and heads[0]["world_size"] == 2
    assert "busbw GB/s" in r.table() and r.csv().startswith("op,ranks,message_bytes")


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(LlmadaptError, match="unknown operator 'gemv'"):
        op_specs(MOE, ops=["gemv"])
    with pytest.raises(LlmadaptError, match="collectives need at least 2 ranks"):
        micro_comm(ranks=1, out=tmp_path)
    assert parse_sizes("1K..16K") == [1024, 4096, 16384] and parse_sizes("1K,2M") == [1024, 2 << 20]
    for args, message in [(["micro", "comm", "--ops", "gossip"], "error: unknown collective 'gossip'"),
                          (["micro", "comm", "--sizes", "lots"], "error: size 'lots'"),
                          (["micro", "ops", ROOT / "examples" / "tiny-llama.toml", "--ops", "moe"],
                           "error: unknown operator 'moe'"),
                          (["micro", "show", tmp_path], "error: ")]:
        out = cli(*args, "--out", tmp_path / "runs") if args[1] != "show" else cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.startswith(message) and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "runs").exists()
