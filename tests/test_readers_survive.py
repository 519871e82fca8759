"""Every reader survives any input: for a file that is not what it expects, each reader of a format llmadapt reads
(Kineto traces, run folders, other tools' serving results, workload files, JSONL/ShareGPT data) returns a result or
raises LlmadaptError (one line for the user, exit 2), never another exception.

The inputs are real valid examples mutated (hypothesis): a key dropped, a value of the wrong type put in its place,
a list or string cut short, the file's text truncated; the mutation walks into the document at random, so it reaches
deep fields (an event's args, a request's times). Each property is bounded (max_examples) to keep the file quick.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from llmadapt.errors import LlmadaptError

HERE = Path(__file__).parent
ROOT = HERE.parent
FOREIGN = HERE / "data" / "foreign"
RUN = FOREIGN / "20261205-092522-vllm-ec57af78-3304"  # a recorded serving run folder
EXAMPLES = ROOT / "examples"

BOUNDED = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.data_too_large])

WRONG = (None, True, 0, -1, 2.5, float("nan"), 1e300, "", "x", "7", [], [1], {}, {"x": 1})
"""Values of the wrong type (or out of range) put where a field was."""

_names = itertools.count()


class Mutant:
    """A mutated document; its repr lists the mutations (what hypothesis prints for a failing case)."""

    def __init__(self, doc: Any, steps: list[str]) -> None:
        self.doc, self.steps = doc, steps

    def __repr__(self) -> str:
        return f"Mutant({'; '.join(self.steps)})"


@st.composite
def mutated(draw, doc: Any, most: int = 3) -> Mutant:
    """DOC with one to MOST mutations, each at a node reached by walking down from the root."""
    doc, steps = copy.deepcopy(doc), []
    for _ in range(draw(st.integers(1, most))):
        doc = _mutate_once(draw, doc, steps)
    return Mutant(doc, steps)


def _mutate_once(draw, doc: Any, steps: list[str]) -> Any:
    parent, key, node, where = None, None, doc, ""
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, keys[draw(st.integers(0, len(keys) - 1))]
        node, where = node[key], f"{where}[{key!r}]"
    op = draw(st.sampled_from(("drop", "wrong", "cut")))
    if op == "cut" and isinstance(node, (list, str)) and node:
        new: Any = node[:draw(st.integers(0, len(node) - 1))]
        steps.append(f"{where or 'the document'} cut to {len(new)}")
    elif op == "drop" and parent is not None:
        del parent[key]
        steps.append(f"drop {where}")
        return doc
    else:
        new = copy.deepcopy(draw(st.sampled_from(WRONG)))  # a copy: a later mutation may walk into it
        steps.append(f"{where or 'the document'} = {new!r}")
    if parent is None:
        return new
    parent[key] = new
    return doc


@st.composite
def cut_text(draw, text: str) -> str:
    """TEXT truncated at any point (a file written by a process that was killed)."""
    return text[:draw(st.integers(0, len(text)))]


def _fresh(folder: Path, name: str) -> Path:
    """A file name not used before in this session: readers that cache by path, size and time see a new file."""
    return folder / f"{next(_names)}-{name}"


def survives(call, *args, **kwargs) -> Any:
    """The property: a result, or LlmadaptError with one line; any other exception fails the test."""
    try:
        result = call(*args, **kwargs)
    except LlmadaptError as exc:
        assert "\n" not in str(exc).strip(), str(exc)
        _count(f"{call.__name__}: refused")
        return exc
    _count(f"{call.__name__}: read")
    return result


def _count(what: str) -> None:
    """How often a reader read and refused (--hypothesis-show-statistics): a property that only ever refuses
    would test little."""
    if currently_in_test_context():
        event(what)


# -- Kineto traces --------------------------------------------------------------------------------------------
def kineto_trace() -> dict[str, Any]:
    """A small valid Kineto trace of one rank of two: two profiled steps, a module annotation, launches with their
    kernels (a GEMM, an NCCL all-reduce with its message size), a copy, and a gloo collective on the CPU."""
    events: list[dict[str, Any]] = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "pid": 1, "tid": 1, "ts": 100.0, "dur": 90.0},
        {"ph": "X", "cat": "user_annotation", "name": "llmadapt::module::attention", "pid": 1, "tid": 1,
         "ts": 5.0, "dur": 40.0},
        {"ph": "X", "cat": "cpu_op", "name": "gloo:all_reduce", "pid": 1, "tid": 1, "ts": 60.0, "dur": 5.0,
         "args": {"Input Dims": [[4, 8]], "Input type": ["float"]}},
    ]
    for i, (name, cat, start) in enumerate((
            ("volta_sgemm_64x64_nt", "kernel", 20.0),
            ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "kernel", 50.0),
            ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 70.0),
            ("volta_sgemm_64x64_nt", "kernel", 120.0))):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": start - 10.0, "dur": 3.0, "args": {"correlation": 10 + i}})
        args: dict[str, Any] = {"stream": 7, "correlation": 10 + i, "device": 0}
        if "nccl" in name:
            args.update({"In msg nelems": 1024, "Out msg nelems": 1024, "dtype": "Float", "Group size": 2,
                         "Collective name": "allreduce"})
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": start, "dur": 15.0,
                       "args": args})
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2},
            "traceEvents": events}


def _analysed(trace: dict[str, Any]):
    from llmadapt.analysis.traces import analyse_traces

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank0.json"
        path.write_text(json.dumps(trace))
        return analyse_traces([path])


def test_the_valid_trace_is_read():
    from llmadapt.analysis.traces import render

    result = _analysed(kineto_trace())
    (rank,) = result.ranks
    b = rank.breakdown
    assert b.error is None and (b.rank, b.step) == (0, 4)
    assert {o.name for o in b.operators} == {"gemm", "all_reduce", "memcpy_htod"}
    assert "rank 0" in render(result)


@BOUNDED
@given(mutated(kineto_trace(), most=4))
def test_the_trace_reader_survives_any_trace(trace):
    from llmadapt.analysis.traces import render

    result = survives(_analysed, trace.doc)
    if not isinstance(result, LlmadaptError):
        render(result)


# -- other tools' serving results --------------------------------------------------------------------------
def _load(path: Path) -> Any:
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" else \
        json.loads(text)


FOREIGN_FILES = {"vllm-bench": FOREIGN / "vllm-bench.json", "guidellm": FOREIGN / "guidellm" / "benchmarks.json",
                 "aiperf-aggregate": FOREIGN / "aiperf" / "profile_export_aiperf.json",
                 "aiperf-records": FOREIGN / "aiperf" / "profile_export.jsonl"}


def _import(doc: Any, original: Path) -> Any:
    """read_result on DOC written as ORIGINAL's format (AIPerf's records beside their aggregate file), then the run
    folder it becomes."""
    from llmadapt.contract.foreign import read_result
    from llmadapt.launch.importer import write_run

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if original.suffix == ".jsonl":
            shutil.copy(original.parent / "profile_export_aiperf.json", folder)
            text = "\n".join(json.dumps(r) for r in doc) if isinstance(doc, list) else json.dumps(doc)
        else:
            text = json.dumps(doc)
        path = folder / original.name
        path.write_text(text)
        measured = survives(read_result, path)
        if isinstance(measured, LlmadaptError):
            return measured
        return survives(write_run, measured, folder / "runs")


def test_the_valid_results_are_read():
    for original in FOREIGN_FILES.values():
        assert isinstance(_import(_load(original), original), Path), original


@pytest.mark.parametrize("tool", sorted(FOREIGN_FILES))
def test_the_foreign_result_readers_survive_any_file(tool):
    original = FOREIGN_FILES[tool]

    @BOUNDED
    @given(mutated(_load(original), most=3))
    def check(mutant):
        _import(mutant.doc, original)

    check()


# -- run folders --------------------------------------------------------------------------------------------
RUN_FILES = ("launch.json", "summary.json", "rank-00000.jsonl")


def _run_folder_read(name: str, doc: Any) -> None:
    from llmadapt.analysis.report import read_summary, summary_text
    from llmadapt.analysis import frames
    from llmadapt.analysis.store import describe_run
    from llmadapt.contract.readback import summarise

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / RUN.name
        shutil.copytree(RUN, folder)
        target = folder / name
        if name.endswith(".jsonl"):
            target.write_text("\n".join(json.dumps(r) for r in doc) if isinstance(doc, list) else json.dumps(doc))
        else:
            target.write_text(json.dumps(doc))
        survives(summarise, folder, write=False)
        summary = survives(read_summary, folder)
        if isinstance(summary, dict):
            survives(summary_text, summary)
        survives(describe_run, folder)  # what the run store indexes (`runs`, `runs import`)
        for frame in (frames.requests, frames.steps):  # the per-request and per-step tables (pandas)
            survives(frame, [folder])


@pytest.mark.parametrize("name", RUN_FILES)
def test_the_run_folder_readers_survive_any_file(name):
    @BOUNDED
    @given(mutated(_load(RUN / name), most=3))
    def check(mutant):
        _run_folder_read(name, mutant.doc)

    check()


# -- workload files ------------------------------------------------------------------------------------------
WORKLOADS = ("tiny-llama.toml", "finetune-lora.yaml", "serve-sharegpt.toml", "finetune-eval.toml")


def _workload_doc(name: str) -> dict[str, Any]:
    from llmadapt.spec.loading import file_data

    return file_data(EXAMPLES / name)


@contextlib.contextmanager
def _beside_examples():
    """A folder where the examples' relative paths (data/...) resolve as they do beside the examples."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "data").symlink_to(EXAMPLES / "data")
        yield Path(tmp)


@pytest.mark.parametrize("name", WORKLOADS)
def test_the_workload_reader_survives_any_workload(name):
    from llmadapt.spec import Workload

    base = _workload_doc(name)

    @BOUNDED
    @given(mutated(base, most=3))
    def check(mutant):
        with _beside_examples() as tmp:
            path = tmp / "w.json"
            path.write_text(json.dumps(mutant.doc))
            survives(Workload.from_file, path)

    check()


@pytest.mark.parametrize("name", WORKLOADS)
def test_the_workload_reader_survives_a_cut_file(name):
    from llmadapt.spec import Workload

    text = (EXAMPLES / name).read_text()

    @BOUNDED
    @given(cut_text(text))
    def check(cut):
        with _beside_examples() as tmp:
            path = tmp / name
            path.write_text(cut)
            survives(Workload.from_file, path)

    check()


# -- JSONL and ShareGPT data --------------------------------------------------------------------------------
DATA = {"instruction-input-output": "commonsense-tiny.jsonl", "hellaswag": "hellaswag-tiny.jsonl",
        "gsm8k": "gsm8k-tiny.jsonl", "prompt-answer": "tiny-instructions.jsonl"}


@pytest.mark.parametrize("fmt", sorted(DATA))
def test_the_data_reader_survives_any_rows(fmt):
    """The workload's check of data.path either refuses the file in one line or passes it, and every row it passes
    is parsed by what the workers run (dataformats.parse) into texts."""
    from llmadapt.dataformats import parse, problem
    from llmadapt.spec import Workload

    rows = _load(EXAMPLES / "data" / DATA[fmt])[:4]
    base = {"kind": "finetune", "model": {"preset": "tiny-llama"}, "lora": {"rank": 4},
            "train": {"seq_len": 64, "global_batch": 2, "steps": 2, "warmup_steps": 0}}
    if fmt == "prompt-answer":
        base["data"] = {"prompt_field": "instruction", "answer_field": "response"}

    @BOUNDED
    @given(mutated(rows, most=3))
    def check(mutant):
        with tempfile.TemporaryDirectory() as tmp:
            path = _fresh(Path(tmp), "data.jsonl")
            lines = mutant.doc if isinstance(mutant.doc, list) else [mutant.doc]
            path.write_text("\n".join(json.dumps(r) for r in lines))
            data = {**base.get("data", {}), "source": "jsonl", "path": str(path), "format": fmt}
            accepted = survives(Workload.from_dict, {**base, "data": data})
        if isinstance(accepted, LlmadaptError):
            return
        d = accepted.data
        for row in lines:
            if problem(row, fmt, d.prompt_field, d.answer_field) is None:
                texts = parse(row, fmt, d.prompt_field, d.answer_field)
                assert isinstance(texts.prompt, str) and isinstance(texts.answer, str)

    check()


STREAMS = {"sharegpt": "sharegpt-tiny.json", "prompts": "prompts-tiny.jsonl", "mooncake": "mooncake-tiny.jsonl"}


@pytest.mark.parametrize("kind", sorted(STREAMS))
def test_the_stream_file_readers_survive_any_file(kind):
    from llmadapt.spec import Workload

    original = EXAMPLES / "data" / STREAMS[kind]
    doc = _load(original)
    doc = doc[:6] if isinstance(doc, list) else doc
    serve = {"requests": 2, "warmup_requests": 0}
    if kind == "mooncake":
        serve["arrival"] = {"process": "closed", "concurrency": 1}

    @BOUNDED
    @given(mutated(doc, most=3))
    def check(mutant):
        with tempfile.TemporaryDirectory() as tmp:
            path = _fresh(Path(tmp), original.name)
            if original.suffix == ".jsonl" and isinstance(mutant.doc, list):
                path.write_text("\n".join(json.dumps(r) for r in mutant.doc))
            else:
                path.write_text(json.dumps(mutant.doc))
            survives(Workload.from_dict, {"kind": "serve", "model": {"preset": "tiny-llama"},
                                          "serve": {**serve, "source": {"kind": kind, "path": str(path)}}})

    check()


# -- the crashes the properties found, kept as examples -------------------------------------------------------
@pytest.mark.parametrize("change, field", [
    (lambda t: t["distributedInfo"].update(rank="zero"), "distributedInfo.rank"),
    (lambda t: t.update(distributedInfo=True), "distributedInfo"),
    (lambda t: t["traceEvents"].__setitem__(0, None), r"traceEvents\[0\]"),
    (lambda t: t["traceEvents"][5].update(ts="20"), r"traceEvents\[5\].ts"),
    (lambda t: t["traceEvents"][5].update(args="stream 7"), r"traceEvents\[5\].args"),
    (lambda t: t["traceEvents"][5]["args"].update(stream=None), r"traceEvents\[5\].args.stream"),
    (lambda t: t["traceEvents"][4]["args"].update(correlation=[10]), r"traceEvents\[4\].args.correlation"),
    (lambda t: t["traceEvents"][5].update(pid=[0]), r"traceEvents\[5\].pid"),
])
def test_a_trace_field_of_the_wrong_type_is_named(change, field):
    trace = kineto_trace()
    change(trace)
    with pytest.raises(LlmadaptError, match=rf"rank0.json: {field} is .*, expected "):
        _analysed(trace)


@pytest.mark.parametrize("tool, change, field", [
    ("vllm-bench", lambda d: d.update(input_lens=None), "input_lens"),
    ("vllm-bench", lambda d: d["itls"].__setitem__(0, 0.1), r"itls\[0\]"),
    ("vllm-bench", lambda d: d.update(num_prompts=float("nan")), "num_prompts"),
    ("vllm-bench", lambda d: d.update(model_id=True), "model_id"),
    ("vllm-bench", lambda d: d["start_times"].__setitem__(0, 1e300), r"start_times\[0\]"),
    ("guidellm", lambda d: d["benchmarks"].__setitem__(0, None), r"benchmarks\[0\]"),
    ("guidellm", lambda d: d["benchmarks"][0]["requests"].update(successful="x"), "requests.successful"),
    ("aiperf-records", lambda d: d[0].update(metadata=None), "line 1 metadata"),
    ("aiperf-records", lambda d: d[0]["metrics"].update(inter_chunk_latency={"value": 3.0, "unit": "ms"}),
     "line 1 inter_chunk_latency"),
    ("aiperf-aggregate", lambda d: d.update(error_summary=7), "error_summary"),
])
def test_a_result_field_of_the_wrong_type_is_named(tool, change, field):
    original = FOREIGN_FILES[tool]
    doc = _load(original)
    change(doc)
    result = _import(doc, original)
    assert isinstance(result, LlmadaptError), result
    assert rf"{original.name}: " in str(result) and field.replace("\\", "") in str(result), str(result)


def test_a_damaged_summary_is_rebuilt_from_the_records():
    """A summary.json whose field has the wrong type is damaged: show rebuilds it from the records and says so."""
    from llmadapt.analysis.report import read_summary, summary_text

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / RUN.name
        shutil.copytree(RUN, folder)
        summary = json.loads((folder / "summary.json").read_text())
        (folder / "summary.json").write_text(json.dumps({**summary, "phase_means_s": None}))
        rebuilt = read_summary(folder)
    assert rebuilt["warnings"][0].startswith("summary.json is damaged (summary record, field phase_means_s")
    assert rebuilt["serving"]["completed"] == summary["serving"]["completed"]
    assert "could not render" not in summary_text(rebuilt)


def test_an_adapters_own_files_leave_the_run_as_it_reads():
    """Every file an adapter declares (AdapterInfo.run_files), holding anything: `show`, the run store and the run's
    status read the run exactly as without them, with its summary and rebuilt from its records (no summary.json)."""
    import llmadapt
    from llmadapt.analysis.report import read_summary
    from llmadapt.analysis.runstatus import live_processes
    from llmadapt.analysis.store import describe_run

    names = {name for a in llmadapt.adapters().values() for name in a.run_files}
    assert {"vllm-cache", "gguf.json", "hostfile"} <= names
    with tempfile.TemporaryDirectory() as tmp:
        plain, adapted = Path(tmp) / "plain" / RUN.name, Path(tmp) / "adapted" / RUN.name
        shutil.copytree(RUN, plain)
        shutil.copytree(RUN, adapted)
        for name in names:
            (adapted / name).write_text('{"type": "header", "node": "x"')  # a record's start, cut: not JSON
        for summary_too in (True, False):
            if not summary_too:
                (plain / "summary.json").unlink()
                (adapted / "summary.json").unlink()
            assert read_summary(adapted) == read_summary(plain)
            assert describe_run(adapted) == describe_run(plain)
        assert live_processes([adapted]) == {adapted: []}


def test_a_yaml_parse_error_is_one_line():
    from llmadapt.spec import Workload

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.yaml"
        path.write_text("kind: finetune\nname: x\np")
        with pytest.raises(LlmadaptError) as caught:
            Workload.from_file(path)
    assert "could not be parsed" in str(caught.value) and "\n" not in str(caught.value)


def test_a_record_whose_type_is_not_a_name_is_refused_in_one_line():
    from llmadapt.contract.jsonl import read_jsonl
    from llmadapt.errors import ContractError

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank-00000.jsonl"
        path.write_text('{"type": []}\n{"type": "end"}\n')
        with pytest.raises(ContractError, match=r"rank-00000.jsonl:1: record has unknown type \[\]"):
            read_jsonl(path)


def test_the_store_reads_a_run_whose_rank_file_starts_with_no_header():
    """A rank file whose first line is JSON null: the run is indexed (its node unknown), from its summary."""
    from llmadapt.analysis.store import describe_run

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / RUN.name
        shutil.copytree(RUN, folder)
        (folder / "rank-00000.jsonl").write_text("null\n")
        row, _ = describe_run(folder)
    assert (row["run_id"], row["machine"]) == (RUN.name, "")


@pytest.mark.parametrize("tool, change", [
    ("vllm-bench", lambda d: d.update({k: [] for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies",
                                                       "start_times", "errors")})),
    ("guidellm", lambda d: d["benchmarks"][0]["requests"].clear()),
    ("guidellm", lambda d: d["benchmarks"][0]["requests"]["successful"].pop()),
])
def test_per_request_lists_that_miss_requests_are_refused(tool, change):
    """A file whose per-request lists are empty or shorter than its own count of completed requests: imported, it
    would be a run of fewer requests (or none) than the tool measured."""
    original = FOREIGN_FILES[tool]
    doc = _load(original)
    change(doc)
    result = _import(doc, original)
    assert isinstance(result, LlmadaptError), result
    assert f"{original.name}: its per-request lists hold " in str(result), str(result)
    assert "completed), its count says 8 completed: nothing imported" in str(result), str(result)


def test_the_command_exits_2_naming_the_file_and_the_field():
    import subprocess
    import sys

    doc = _load(FOREIGN_FILES["vllm-bench"])
    doc["itls"][3] = "0.1"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vllm-bench.json"
        path.write_text(json.dumps(doc))
        done = subprocess.run([sys.executable, "-m", "llmadapt.cli", "runs", "import", str(path), "--root",
                               str(Path(tmp) / "runs")], capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"error: {path}: itls[3] is \"0.1\", expected a list: nothing imported"], done.stderr
        assert not (Path(tmp) / "runs").exists() or not any((Path(tmp) / "runs").iterdir())
