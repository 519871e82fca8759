"""Metrics contract: schema, validation, streaming writes, statistics and cross-rank aggregation."""

import json
import math
import subprocess
import sys

import attrs
import pytest

from llmadapt import ContractError, json_schema
from llmadapt.contract.jsonl import JsonlWriter, read_jsonl
from llmadapt.contract.launch import LaunchRequest
from llmadapt.contract.records import Breakdown, ClassTime, Failure, Memory, Phase, Span, Step
from llmadapt.contract.schema import to_json, to_json_line, validate
from llmadapt.contract.stats import aggregate, describe, percentile
from llmadapt.spec import Workload


def step(rank=0, index=0, seconds=1.0, tokens=100, loss=2.0, warmup=False, peak=1000, phases=()):
    return to_json(Step(rank=rank, step=index, warmup=warmup, start_ns=0, end_ns=int(seconds * 1e9), seconds=seconds,
                        tokens=tokens, samples=2, loss=loss, phases=list(phases),
                        memory=Memory(kind="cpu-rss", rss_bytes=peak, peak_rss_bytes=peak)))


def test_schema_is_generated_from_record_types():
    """The schema has one definition per record type, with the fields' docs."""
    schema = json_schema()
    assert {"Header", "Step", "Failure", "Summary", "Phase", "Memory"} <= set(schema["$defs"])
    step_def = schema["$defs"]["Step"]
    assert step_def["properties"]["type"] == {"const": "step"}
    assert "global batch" in step_def["properties"]["loss"]["description"]
    assert "loss" in step_def["required"] and "phases" not in step_def["required"]


def test_validate_accepts_a_step_and_names_the_bad_field():
    """A valid record passes; a wrong type is reported with the field path."""
    record = step()
    assert validate(record) is record
    record["phases"] = [{"name": "forward", "seconds": "fast", "source": "llmadapt"}]
    with pytest.raises(ContractError, match=r"step record, field phases/0/seconds: 'fast' is not of type 'number'"):
        validate(record)
    with pytest.raises(ContractError, match="unknown type 'bogus'"):
        validate({"type": "bogus"})


def test_writer_flushes_every_record_and_reader_survives_a_torn_line(tmp_path):
    """Records are readable while the writer is open; a half-written last line is ignored."""
    path = tmp_path / "rank-00000.jsonl"
    writer = JsonlWriter(path)
    writer.write(Step(**{k: v for k, v in step().items() if k not in ("type", "memory")}))
    assert len(read_jsonl(path)) == 1  # not closed yet: already on disk
    with open(path, "a") as f:
        f.write('{"type": "step", "rank": 0, "st')  # killed mid-write
    assert len(read_jsonl(path)) == 1
    writer.close()


def test_a_record_line_is_the_json_of_its_dict():
    """The writer's encoder (record fields handed to json's encoder one record at a time) writes exactly what
    json.dumps(to_json(record)) writes: nested records, lists, tuples, None, floats, non-ASCII names. It was
    also checked on 52,233 real records of every written type. Anything else is refused as json refuses it."""
    record = Step(rank=1, step=3, warmup=False, start_ns=5, end_ns=9, seconds=0.1 + 0.2, tokens=7, samples=2,
                  loss=float("nan"), phases=[Phase("données", 1e-7, "llmadapt"), Phase('a"b', 3.0, "x")],
                  memory=Memory(kind="cpu-rss", rss_bytes=1, peak_rss_bytes=None), expert_load=[[1, 2], [3, 4]],
                  spans=[Span("forward", 1, 2)], run_delay_s=None)
    breakdown = Breakdown(rank=0, step=1, level="operator", basis="cpu", step_seconds=2.0,
                          modules=[ClassTime("attention", 1.5)],
                          operators=[ClassTime("gemm", 0.5, count=3)])
    for r in (record, breakdown, Failure(cause="oom", message="x\ny", rank=0)):
        assert to_json_line(r) == json.dumps(to_json(r), separators=(",", ":"))
    with pytest.raises(TypeError, match="not JSON serializable"):
        to_json_line(Phase("x", object(), "y"))


def test_statistics_match_numpy_definitions():
    """Percentiles interpolate linearly (numpy's default); std is the sample std."""
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    s = describe(values)
    assert (s.count, s.min, s.max, s.p50) == (6, 1.0, 10.0, 3.5)
    assert s.p90 == pytest.approx(7.5)
    assert s.mean == pytest.approx(25 / 6)
    assert s.std == pytest.approx(math.sqrt(sum((v - 25 / 6) ** 2 for v in values) / 5))
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert describe([]) is None


def test_aggregation_takes_slowest_rank_sums_tokens_and_keeps_memory_per_rank():
    """Step time = slowest rank; tokens summed; memory max plus per rank; warm-up excluded."""
    launch = LaunchRequest(run_id="r", role="train", adapter="x", launcher="torchrun",
                           workload=Workload.from_dict({"parallelism": {"dp": 2}, "train": {"steps": 2, "warmup_steps": 1}}))
    records = [
        step(0, 0, 9.0, warmup=True), step(1, 0, 9.0, warmup=True),
        step(0, 1, 1.0, peak=100, phases=[to_json(Phase("forward", 0.25, "llmadapt"))]),
        step(1, 1, 2.0, peak=300, phases=[to_json(Phase("forward", 0.75, "llmadapt"))]),
        step(0, 2, 1.0, loss=1.5), step(1, 2, 1.0, loss=1.5),
    ]
    s = aggregate("r", records, launch)
    assert s.status == "ok" and s.steps_completed == 3 and s.measured_steps == 2
    assert s.step_time_s.max == 2.0 and s.step_time_s.min == 1.0
    assert s.tokens_per_step == 200
    assert s.tokens_per_s.max == 200.0
    assert s.peak_memory_bytes == 1000 and s.peak_memory_per_rank == [1000, 1000]
    assert s.losses == [2.0, 2.0, 1.5]
    assert s.phase_means_s == {"llmadapt:forward": 0.5}


def test_incomplete_run_is_failed_even_without_a_failure_record():
    """A run that ends early is never reported as ok."""
    launch = LaunchRequest(run_id="r", role="train", adapter="x", launcher="subprocess",
                           workload=Workload.from_dict({"train": {"steps": 3}}))
    s = aggregate("r", [step(0, 0, warmup=True)], launch)
    assert s.status == "failed" and s.failures[0].cause == "crash"


def test_a_run_read_while_it_goes_on_has_only_its_recorded_failures():
    """Read before its end (over=False: no summary yet, a process may still work in it), a run whose steps are not
    all done has not crashed: no failure is made up for it; the ones its records hold stay."""
    launch = LaunchRequest(run_id="r", role="train", adapter="x", launcher="subprocess",
                           workload=Workload.from_dict({"train": {"steps": 3}}))
    assert aggregate("r", [step(0, 0, warmup=True)], launch, over=False).failures == []
    oom = to_json(Failure(cause="oom", message="out of memory", rank=0, step=1))
    assert [f.cause for f in aggregate("r", [step(0, 0, warmup=True), oom], launch, over=False).failures] == ["oom"]


def test_a_run_that_went_on_past_a_nan_loss_lists_its_divergence_in_failures():
    """train.on_nonfinite = "continue": every step ran, nothing stopped it, and still its failures say why it is
    diverged (the first step not finite, what was not), as a stopped run's do."""
    launch = LaunchRequest(run_id="r", role="train", adapter="x", launcher="subprocess",
                           workload=Workload.from_dict({"train": {"steps": 3, "warmup_steps": 0, "on_nonfinite": "continue"}}))
    s = aggregate("r", [step(0, 0), step(0, 1, loss=math.nan), step(0, 2, loss=math.inf)], launch)
    assert s.status == "diverged"
    (failure,) = s.failures
    assert (failure.cause, failure.step, failure.rank) == ("diverged", 1, None)
    assert failure.message == "the loss was not finite at 2 step(s), the first at step 1"


def test_failure_causes_are_constrained_by_the_schema():
    """A failure record with an unknown cause does not validate."""
    good = to_json(Failure(cause="oom", message="x", rank=0))
    validate(good)
    with pytest.raises(ContractError, match="cause"):
        validate({**good, "cause": "gremlins"})


def test_schema_command_prints_the_schema():
    """`llmadapt schema` prints the generated JSON Schema."""
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "schema"], capture_output=True, text=True, check=False)
    assert json.loads(out.stdout) == json_schema()


def test_summary_round_trips_through_its_schema():
    """A real summary serialises to a record the schema accepts."""
    launch = LaunchRequest(run_id="r", role="train", adapter="x", launcher="inline",
                           workload=Workload.from_dict({"train": {"steps": 1, "warmup_steps": 0}}))
    summary = aggregate("r", [step()], launch)
    validate(json.loads(json.dumps(attrs.asdict(summary))))


def test_a_summary_read_back_is_the_summary_written_and_a_damaged_field_is_named():
    """summary.json read back as the record type (the comparison's reader) goes through the launch record's
    converter: the same Summary, its nested records (step-time statistics, failures) rebuilt; a field of the wrong
    shape is one ContractError naming it, not an error from inside the walk."""
    from llmadapt.analysis.comparison import from_json_summary

    def launch(**train):
        return LaunchRequest(run_id="r", role="train", adapter="x", launcher="subprocess",
                             workload=Workload.from_dict({"train": train}))

    ok = aggregate("r", [step()], launch(steps=1, warmup_steps=0))
    failed = aggregate("r", [step(0, 0, warmup=True)], launch(steps=3))
    assert ok.step_time_s is not None and failed.failures, "both shapes of nesting must be there to test anything"
    for summary in (ok, failed):
        assert from_json_summary(json.loads(json.dumps(to_json(summary)))) == summary
    with pytest.raises(ContractError, match=r"summary\.step_time_s: expected a JSON object for Stats, got str"):
        from_json_summary({**to_json(ok), "step_time_s": "fast"})


def test_model_parallel_ranks_do_not_multiply_tokens():
    """With tp=2, both ranks of the one replica report the same tokens: they count once."""
    launch = LaunchRequest(run_id="r", role="train", adapter="x", launcher="torchrun",
                           workload=Workload.from_dict({"parallelism": {"tp": 2}, "train": {"steps": 1, "warmup_steps": 0}}))
    s = aggregate("r", [step(0, 0, tokens=128), step(1, 0, tokens=128)], launch)
    assert s.tokens_per_step == 128


def test_a_comm_record_of_schema_1_1_reads_under_todays_field_names(tmp_path):
    """Schema 1.1 spelt the bandwidths algbw_gbps/busbw_gbps (GB/s, despite the name): read as the 1.2 names,
    same values, and the record validates."""
    old = {"type": "comm", "rank": 0, "op": "all_reduce", "message_bytes": 1024, "count": 2, "total_seconds": 0.5,
           "source": "deepspeed", "step": 0, "algbw_gbps": 4.096e-06, "busbw_gbps": 4.096e-06}
    path = tmp_path / "rank-00000.jsonl"
    path.write_text(json.dumps(old) + "\n")
    (record,) = read_jsonl(path)
    assert record["algbw_gbytes_per_s"] == 4.096e-06 and "algbw_gbps" not in record


# A launch.json as schema 1.8 wrote it (a torchrun run across two nodes): no kind, problem hash, version or type.
LAUNCH_1_8 = {
    "run_id": "20261204-170336-torch-730d4673-67a8", "adapter": "torch", "adapter_version": "0.2.0",
    "framework": "torch", "role": "train", "worker_class": "llmadapt.reference.trainer:TorchTrainer",
    "launcher": "torchrun", "world_size": 2, "workload": {"train": {"steps": 3}}, "workload_hash": "730d4673ab",
    "fault": None, "memory_limit_bytes": None, "python": "/envs/torch/bin/python", "created": 1764867816.5,
    "nodes": {"nnodes": 2, "nproc_per_node": 1, "rendezvous": "static",
              "seen": [{"node_rank": 0, "node": "a", "ranks": [0]}, {"node_rank": 1, "node": "b", "ranks": [1]}]},
}


def test_a_launch_json_of_schema_1_8_reads_as_the_launch_record(tmp_path):
    """The fields it has read as attributes (nested ones as records), the ones it lacks take their defaults, and
    written back it keeps every value it had and validates as a launch record."""
    from llmadapt.contract.rundir import RunDir

    (tmp_path / "launch.json").write_text(json.dumps(LAUNCH_1_8))
    launch = RunDir(tmp_path).read_launch()
    assert (launch.run_id, launch.launcher, launch.world_size, launch.workload.train.steps) == (
        LAUNCH_1_8["run_id"], "torchrun", 2, 3)
    assert launch.nodes.nnodes == 2 and [n["node"] for n in launch.nodes.seen] == ["a", "b"]
    assert (launch.kind, launch.problem_hash, launch.slurm, launch.suite) == ("workload", "", None, None)
    written = validate(launch.to_json())  # the workload written back whole, as it was resolved
    assert {k: written[k] for k in LAUNCH_1_8 if k != "workload"} == {k: v for k, v in LAUNCH_1_8.items()
                                                                         if k != "workload"}
    assert written["workload"] == launch.workload.to_dict() and written["type"] == "launch"
    assert LaunchRequest.from_json(written) == launch


# launch.json as 0.2 wrote it, before the record was typed below its top: the workload, the fault and a
# micro-benchmark's spec as plain objects (the micro spec repeating the workload and its hashes).
_OP_0_2 = {"op": "qkv", "kind": "gemm", "dtype": "fp32", "shape": {"m": 128, "k": 64, "n": 128},
           "cost": {"forward": {"flops": 2097152.0, "bytes": 98304.0, "launches": 1},
                    "backward": {"flops": 4194304.0, "bytes": 196608.0, "launches": 2}},
           "directions": ["forward", "backward"], "trainable": True}
_ROUTER_0_2 = {**_OP_0_2, "op": "moe_router", "extra": {"k": 2}}
_ATTENTION_0_2 = {**_OP_0_2, "op": "attention", "kind": "attention", "backend": "eager"}
LAUNCH_0_2_FAULT = {"run_id": "r", "launcher": "subprocess", "kind": "workload", "role": "train",
                    "fault": {"kind": "error", "step": 1, "rank": 0}, "spec": None, "suite": None,
                    "schema_version": "1.13", "type": "launch"}
LAUNCH_0_2_MICRO = {"run_id": "m", "launcher": "subprocess", "kind": "micro", "role": "micro-ops", "workload": {},
                    "suite": "ops", "fault": None, "schema_version": "1.13", "type": "launch",
                    "spec": {"workload": {"kind": "train"}, "workload_hash": "h", "problem_hash": "p",
                             "ops": [_OP_0_2, _ROUTER_0_2, _ATTENTION_0_2],
                             "timing": {"warmup": 1, "repeats": 3, "min_time_s": 0.0, "max_time_s": 1.0},
                             "peak": {"dtypes": ["fp32"], "gemm_sizes_cpu": [64], "gemm_sizes_gpu": [2048],
                                      "copy_bytes_cpu": 1024, "copy_bytes_gpu": 2048}}}
LAUNCH_0_2_COMM = {**LAUNCH_0_2_MICRO, "suite": "comm", "workload": {},
                   "spec": {"comm": {"ops": ["all_reduce"], "sizes": [1024], "iters": 2, "warmup": 1},
                            "timing": {"warmup": 2, "repeats": 10, "min_time_s": 0.05, "max_time_s": 2.0}}}


def test_a_launch_json_of_0_2_reads_typed_all_the_way_down(tmp_path):
    """The workload reads as a Workload, the fault as a Fault, the micro spec as a MicroSpec with its operators,
    costs, timing, peaks and collectives as records (a micro-benchmark's empty workload as none); written back,
    each reads as the same record."""
    from llmadapt.contract.launch import CommSpec, Fault, MicroSpec, OpCost, PeakSpec, Timing
    from llmadapt.contract.rundir import RunDir
    from llmadapt.spec import Workload

    workload = Workload.from_dict({"kind": "train", "train": {"steps": 3}})
    (tmp_path / "launch.json").write_text(json.dumps({**LAUNCH_0_2_FAULT, "workload": workload.to_dict()}))
    launch = RunDir(tmp_path).read_launch()
    assert launch.workload == workload and launch.workload.content_hash == workload.content_hash
    assert launch.fault == Fault(kind="error", step=1, rank=0)
    micro = LaunchRequest.from_json(LAUNCH_0_2_MICRO)
    assert micro.workload is None and isinstance(micro.spec, MicroSpec)
    qkv, router, attention = micro.spec.ops
    assert (qkv.op, qkv.shape, qkv.directions, qkv.trainable) == ("qkv", {"m": 128, "k": 64, "n": 128},
                                                                   ["forward", "backward"], True)
    assert qkv.cost["backward"] == OpCost(flops=4194304.0, bytes=196608.0, launches=2)
    assert (router.extra, attention.backend, qkv.backend) == ({"k": 2}, "eager", None)
    assert micro.spec.timing == Timing(warmup=1, repeats=3, min_time_s=0.0, max_time_s=1.0)
    assert micro.spec.peak == PeakSpec(dtypes=["fp32"], gemm_sizes_cpu=[64], gemm_sizes_gpu=[2048],
                                       copy_bytes_cpu=1024, copy_bytes_gpu=2048)
    comm = LaunchRequest.from_json(LAUNCH_0_2_COMM)
    assert comm.spec.comm == CommSpec(ops=["all_reduce"], sizes=[1024], iters=2, warmup=1) and comm.spec.peak is None
    for read in (launch, micro, comm):
        assert LaunchRequest.from_json(json.loads(json.dumps(validate(read.to_json())))) == read


def test_a_launch_json_whose_workload_is_wrong_is_one_contract_error():
    """A workload the workload's own checks refuse: one ContractError naming the field."""
    with pytest.raises(ContractError, match=r"launch.workload: .*train.lr"):
        LaunchRequest.from_json({**LAUNCH_0_2_FAULT, "workload": {"train": {"lr": "fast"}}})


def test_a_launch_json_that_is_no_request_is_one_contract_error(tmp_path):
    """Not an object, or a nested part missing what it needs: a ContractError naming launch.json."""
    from llmadapt.contract.rundir import RunDir

    (tmp_path / "launch.json").write_text("[1, 2]")
    with pytest.raises(ContractError, match="holds a list, not a launch request"):
        RunDir(tmp_path).read_launch()
    with pytest.raises(ContractError, match="launch.slurm: SlurmJob"):
        LaunchRequest.from_json({**LAUNCH_1_8, "slurm": {"nnodes": 1}})


def test_the_header_is_filled_from_the_launch_record():
    """One builder: who ran what comes from the request; the process adds its place, versions and device."""
    from llmadapt.contract.launch import run_header

    launch = LaunchRequest.from_json({**LAUNCH_1_8, "problem_hash": "p1"})
    header = run_header(launch, rank=1, local_rank=0, world_size=2, framework_version="2.5", device=None,
                        software={"torch": "2.5"}, patches=[])
    assert (header.run_id, header.adapter, header.adapter_version, header.framework, header.launcher) == (
        LAUNCH_1_8["run_id"], "torch", "0.2.0", "torch", "torchrun")
    assert (header.role, header.rank, header.world_size, header.workload_hash, header.problem_hash) == (
        "train", 1, 2, "730d4673ab", "p1")
    assert header.workload == launch.workload.to_dict() and header.workload["train"]["steps"] == 3
    assert header.start_time and header.mono_anchor_ns > 0
    validate(to_json(header))


def test_run_ids_are_time_parts_and_four_hex_digits():
    import re

    from llmadapt.contract.launch import new_run_id

    assert re.fullmatch(r"\d{8}-\d{6}-torch-730d4673-[0-9a-f]{4}", new_run_id("torch", "730d4673"))
    assert re.fullmatch(r"\d{8}-\d{6}-micro-ops-[0-9a-f]{4}", new_run_id("micro", "ops"))
