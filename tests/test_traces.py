"""The kernel-basis breakdown on real GPU traces (../shared/data/kineto-gpu: A100, V100, MI250 and a 128-rank job's
ranks, recorded by others and published as Holistic Trace Analysis's test data), held against HTA 0.5.0's reading
of the same files.

The definitions are HTA's, and one difference is known and asserted exactly: HTA rounds a trace with fractional
microseconds to whole ones (each event's start up, its end down: hta.common.trace_parser.round_down_time_stamps),
llmadapt keeps the trace's own times. On the trace rounded as HTA rounds it, every figure equals HTA's to the
microsecond; on the trace as recorded, every figure is within 1% of the trace's span of HTA's.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
from pathlib import Path

import pytest

from llmadapt.adapter.breakdown import OPERATOR_CLASSES, kernel_class
from llmadapt.analysis.traces import analyse_traces, read_trace, render, trace_breakdown
from llmadapt.errors import LlmadaptError
from llmadapt.launch.environments import HTA_ENVIRONMENT, EnvironmentNotReadyError, python_for
from llmadapt.runtime.timeline import device_activities

HERE = Path(__file__).parent
DATA = HERE.parent.parent / "shared" / "data" / "kineto-gpu"  # ../shared/data/kineto-gpu from the repository root
TRACES = sorted(DATA.glob("*.json.gz")) if DATA.is_dir() else []
needs_data = pytest.mark.skipif(not TRACES, reason=f"the real GPU traces are absent ({DATA}: ../shared/data/"
                                                   "kineto-gpu relative to the repository root)")


def _hta_unready() -> str | None:
    try:
        python_for(HTA_ENVIRONMENT)
    except EnvironmentNotReadyError as exc:
        return str(exc)
    return None


needs_hta = pytest.mark.skipif(bool(_hta_unready()), reason=_hta_unready() or "")

HTA_TYPES = {"COMPUTATION": "computation", "COMMUNICATION": "communication", "MEMORY": "memory"}


def hta_rounded(trace: dict) -> dict:
    """The trace with HTA's rounding: where any start is fractional, every event starts at its start rounded up
    and ends at its end rounded down."""
    events = trace["traceEvents"]
    if all(float(e.get("ts", 0)).is_integer() for e in events if "ts" in e):
        return trace
    out = copy.copy(trace)
    out["traceEvents"] = []
    for e in events:
        if "ts" in e and "dur" in e:
            e = dict(e, ts=math.ceil(float(e["ts"])), dur=math.floor(float(e["ts"]) + float(e["dur"]))
                     - math.ceil(float(e["ts"])))
        out["traceEvents"].append(e)
    return out


def figures(b) -> dict[str, float]:
    """A breakdown's figures in HTA's terms, in microseconds."""
    us = {"kernel_time": b.step_seconds, "idle_time": b.idle_seconds, "compute_time": b.compute_seconds,
          "non_compute_time": b.step_seconds - b.idle_seconds - b.compute_seconds,
          "overlap": b.overlapped_comm_seconds}
    us.update({f"type {t.name}": t.seconds for t in b.kernel_types})
    return {k: v * 1e6 for k, v in us.items()}


def hta_figures(h: dict, comm_us: float) -> dict[str, float]:
    (t,) = h["temporal_breakdown"]
    (o,) = h["comm_comp_overlap"]
    out = {k: float(t[f"{k}(us)"]) for k in ("kernel_time", "idle_time", "compute_time", "non_compute_time")}
    pctg = o["comp_comm_overlap_pctg"]  # HTA's ratio in percent, to two decimals; None (NaN) with no NCCL kernel
    out["overlap"] = 0.0 if pctg is None or math.isnan(pctg) else pctg / 100 * comm_us
    for row in h["kernel_type_breakdown"]:
        name = "+".join(HTA_TYPES[p] for p in row["kernel_type"].split(" overlapping "))
        out[f"type {name}"] = float(row["sum"])
    return out


@pytest.fixture(scope="module")
def hta_results():
    from llmadapt.experiments.hta import hta_of_traces

    return dict(zip(TRACES, hta_of_traces(TRACES)))


def compare(trace: dict, hta: dict) -> tuple[dict[str, float], dict[str, float]]:
    b = trace_breakdown(trace)
    ours = figures(b)
    return ours, hta_figures(hta, b.comm_seconds * 1e6)


@needs_data
@needs_hta
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_the_kernel_basis_agrees_with_hta_on_real_gpu_traces(path, hta_results):
    """Temporal breakdown (idle, compute, non-compute), kernel types (computation, communication, memory and
    their overlaps) and the communication-computation overlap: on the trace HTA-rounded, equal to HTA's within
    2 us (HTA sums per-interval durations it has cast to int); as recorded, within 1% of the span."""
    trace = read_trace(path)
    hta = hta_results[path]
    ours, theirs = compare(hta_rounded(trace), hta)
    assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
    for key in ours:
        # HTA's overlap is a percentage to two decimals: 0.005% of the communication time is its own rounding
        slack = 2.0 + (5e-5 * trace_breakdown(trace).comm_seconds * 1e6 if key == "overlap" else 0.0)
        assert ours[key] == pytest.approx(theirs[key], abs=slack), (key, ours[key], theirs[key])
    ours, theirs = compare(trace, hta)
    span = theirs["kernel_time"]
    for key in theirs:
        assert abs(ours.get(key, 0.0) - theirs[key]) <= 0.01 * span, (key, ours.get(key), theirs[key], span)


@needs_data
def test_kernels_are_classified_by_their_library_names():
    """On every real trace at least 98% of GPU time goes to a named operator class; the names of each library
    land where they belong."""
    for path in TRACES:
        b = trace_breakdown(read_trace(path))
        total = sum(o.seconds for o in b.operators)
        other = sum(o.seconds for o in b.operators if o.name == "other")
        assert other <= 0.02 * total, (path.name, other / total)
        assert {o.name for o in b.operators} <= set(OPERATOR_CLASSES)
    assert [kernel_class(n) for n in (
        "volta_sgemm_64x64_nt", "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>(x)",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32",
        "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>(x)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<x>::Params)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(x)",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float)",
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::func_wrapper_t<float>>>(x)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, x>(int, x)",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_"
        "kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>(x)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<x, at::native::(anonymous namespace)::"
        "FusedAdamMathFunctor<float, 4, 0>, x>(x)",
        "void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat16*)",
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
        "sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16",
    )] == ["gemm", "gemm", "gemm", "gemm", "gemm", "attention", "attention", "softmax", "normalization",
           "reduction", "elementwise", "memory", "optimizer", "dequantization", "reduce_scatter", "convolution"]
    assert [kernel_class(n, c) for n, c in (("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy"),
                                            ("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy"),
                                            ("Memcpy DtoD (Device -> Device)", "gpu_memcpy"),
                                            ("Memcpy PtoP (Device -> Device)", "gpu_memcpy"),
                                            ("Memset (Device)", "gpu_memset"))] == [
        "memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "memcpy_other", "memset"]


@needs_data
def test_nccl_collectives_bytes_and_bus_bandwidth_from_a_real_trace():
    """The A100 rank of a 2-rank DDP job: its all-reduces carry their element counts and dtype (PyTorch copies
    them onto NCCL's kernels); bytes are summed and the bus bandwidth is nccl-tests' (2(n-1)/n for all-reduce,
    n=2: busbw equals algbw)."""
    trace = read_trace(DATA / "a100-2rank-nccl.json.gz")
    b = trace_breakdown(trace)
    kernels = [e for e in device_activities(trace) if "AllReduce" in e["name"]]  # before the last step
    reduce = next(c for c in b.collectives if c.kind == "all_reduce")
    assert (reduce.backend, reduce.group_size, reduce.algorithm) == ("nccl", 2, "RING_LL")
    assert reduce.count == len(kernels)
    assert reduce.bytes == sum(4 * e["args"]["In msg nelems"] for e in kernels)  # dtype Float
    assert reduce.busbw_gbytes_per_s == pytest.approx(reduce.bytes / reduce.seconds / 1e9)
    assert b.rank == 0 and b.step == 4  # distributedInfo; the first ProfilerStep analysed


@needs_data
def test_module_classes_from_annotations_and_stragglers_across_ranks():
    """The 128-rank job's two sampled ranks: kernels go to the annotation around their launch ('## backward ##'
    from the autograd thread's launches, DDP's forward), their sum is the GPU time; the rank that computes
    longer is the straggler, and it waits less in its collectives."""
    result = analyse_traces([DATA / "sampled-rank-0.json.gz", DATA / "sampled-rank-1.json.gz"])
    for r in result.ranks:
        b = r.breakdown
        modules = {m.name: m.seconds for m in b.modules}
        assert {"## backward ##", "DistributedDataParallel.forward", "communication", "optimizer"} <= set(modules)
        assert sum(modules.values()) == pytest.approx(sum(o.seconds for o in b.operators), rel=1e-9)
        assert modules.get("unannotated", 0.0) < 0.05 * sum(modules.values())
    slow, fast = result.stragglers
    assert (slow.rank, fast.rank) == (1, 0) and slow.compute_seconds > fast.compute_seconds
    assert slow.exposed_comm_seconds < fast.exposed_comm_seconds
    text = render(result)
    assert "stragglers" in text and "send_recv" in text


def test_a_trace_that_is_not_one_is_refused_in_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    (tmp_path / "broken.json.gz").write_bytes(gzip.compress(b"{not json"))
    with pytest.raises(LlmadaptError, match="bad.json: not a Kineto trace"):
        analyse_traces([tmp_path / "bad.json"])
    with pytest.raises(LlmadaptError, match="broken.json.gz: not a readable trace"):
        read_trace(tmp_path / "broken.json.gz")
    with pytest.raises(LlmadaptError, match="no such trace file or folder"):
        analyse_traces([tmp_path / "absent.json"])
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                                                     "ts": 0, "dur": 5}]}))
    with pytest.raises(LlmadaptError, match=r"cpu.json: no GPU activity in this trace .*: nothing to break down"):
        analyse_traces([tmp_path / "cpu.json"])


@needs_data
def test_a_trace_without_gpu_activity_is_refused_by_the_command(tmp_path):
    """A real GPU trace with its GPU work left out (the profiler ran on the CPU only) is refused by `llmadapt trace`
    with that reason (exit 2, one line), where the trace as recorded is broken down."""
    import subprocess
    import sys

    trace = read_trace(DATA / "a100-2rank-nccl.json.gz")
    gpu_work = ("kernel", "gpu_memcpy", "gpu_memset")  # Kineto's categories of what a GPU runs
    cpu_only = dict(trace, traceEvents=[e for e in trace["traceEvents"] if e.get("cat") not in gpu_work])
    assert len(cpu_only["traceEvents"]) < len(trace["traceEvents"])
    (tmp_path / "cpu-only.json").write_text(json.dumps(cpu_only))

    def trace_command(path):
        return subprocess.run([sys.executable, "-m", "llmadapt.cli", "trace", str(path)], capture_output=True,
                              text=True, timeout=300)

    done = trace_command(tmp_path / "cpu-only.json")
    assert done.returncode == 2, done.stderr
    assert "cpu-only.json: no GPU activity in this trace" in done.stderr and "nothing to break down" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = trace_command(DATA / "a100-2rank-nccl.json.gz")
    assert done.returncode == 0, done.stderr
    assert "rank 0" in done.stdout


def test_a_trace_field_of_the_wrong_type_exits_2_naming_it(tmp_path):
    import subprocess
    import sys

    (tmp_path / "rank.json").write_text(json.dumps({"distributedInfo": {"rank": "zero"}, "traceEvents": []}))
    done = subprocess.run([sys.executable, "-m", "llmadapt.cli", "trace", str(tmp_path / "rank.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "rank.json: distributedInfo.rank is 'zero', expected a whole number >= 0" in done.stderr
