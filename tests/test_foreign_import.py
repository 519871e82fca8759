"""Other tools' serving results in the run store (llmadapt.contract.foreign, `llmadapt runs import FILE...`), on
files each tool wrote here against one vLLM server (tests/data/foreign/README.md says how): vllm bench serve's
detailed result, AIPerf's profile export, guidellm's report, beside the llmadapt run of the same stream (a
recorded run folder). Nothing is downloaded or run but llmadapt's own commands.

Medians are compared with the file's own: to 1e-3 ms (request records hold integer nanoseconds, and guidellm's
and AIPerf's start times are Unix times whose float seconds keep about 0.2 us)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt.analysis.comparison import compare_stored
from llmadapt.contract.foreign import read_result
from llmadapt.analysis.store import RunStore
from llmadapt.errors import LlmadaptError

DATA = Path(__file__).parent / "data" / "foreign"
RUN = DATA / "20261205-092522-vllm-ec57af78-3304"  # llmadapt's run of the stream (attached to the same server)
VLLM = DATA / "vllm-bench.json"
AIPERF = DATA / "aiperf" / "profile_export.jsonl"
AIPERF_AGGREGATE = DATA / "aiperf" / "profile_export_aiperf.json"
GUIDELLM = DATA / "guidellm" / "benchmarks.json"
TOL = 1e-3  # ms


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The llmadapt run, vllm bench's and AIPerf's results as its stream (--workload: the same prompts were sent),
    guidellm's and AIPerf's aggregate file as their files state them."""
    root = tmp_path_factory.mktemp("store") / "runs"
    done = cli("runs", "import", RUN, VLLM, AIPERF, "--workload", RUN, "--tool-version", "0.32.0", "--root", root)
    assert done.returncode == 0, done.stderr
    done = cli("runs", "import", GUIDELLM, AIPERF_AGGREGATE, "--root", root)
    assert done.returncode == 0, done.stderr
    return root


def stored(root: Path) -> dict[str, object]:
    with RunStore(root) as store:
        return {r.layout: r for r in store.runs()}


def test_each_tool_is_listed_by_name_and_version(root):
    listing = cli("runs", "--root", root)
    assert listing.returncode == 0, listing.stderr
    for label in ("vllm bench serve 0.32.0", "AIPerf 0.13.0", "AIPerf 0.13.0 (summary only)", "guidellm 0.8.1"):
        assert label in listing.stdout
    runs = stored(root)
    assert runs["vllm bench serve 0.32.0"].summary["measured_by"] == "vllm bench serve 0.32.0"
    assert runs["vllm"].summary.get("measured_by") is None
    assert {r.adapter for r in runs.values()} == {"vllm", "vllm-bench", "aiperf", "guidellm"}
    # the per-request frames label each run the same way, from the store and from the run folders alone
    from llmadapt.analysis import frames

    with RunStore(root) as store:
        by_store = set(store.requests()["label"])
    by_folder = set(frames.requests([r.folder for r in runs.values() if "summary only" not in r.layout])["label"])
    assert by_store == by_folder == {"vllm", "vllm bench serve 0.32.0", "AIPerf 0.13.0", "guidellm 0.8.1"}


def test_compare_puts_the_tools_beside_llmadapts_run_of_the_stream(root):
    table = cli("compare", "--runs", "kind=serve", "--out", root)
    assert table.returncode == 0, table.stderr
    rows = {line.split("  ")[0]: line for line in table.stdout.splitlines()}
    lines = table.stdout.splitlines()
    p1 = [line for line in lines if line.startswith("P1 ")]
    assert any(" vllm " in line for line in p1)  # llmadapt's own run
    assert any("vllm bench serve 0.32.0" in line and "not judged" in line for line in p1)
    assert any("AIPerf 0.13.0 " in line and "(summary only)" not in line for line in p1)
    marked = [line for line in lines if "as the file states" in line and line.startswith("P")]
    assert len(marked) == 2, table.stdout  # guidellm's and AIPerf's aggregate: no workload given
    assert rows  # the table parsed
    comparison = compare_stored("kind=serve", root=root)
    llmadapt_row = next(r for r in comparison.rows if r.label == "vllm")
    same = [r.label for r in comparison.rows if r.problem_hash == llmadapt_row.problem_hash]
    assert sorted(same) == ["AIPerf 0.13.0", "vllm", "vllm bench serve 0.32.0"]


def test_vllm_bench_medians_are_the_files_own(root):
    data = json.loads(VLLM.read_text())
    serving = stored(root)["vllm bench serve 0.32.0"].summary["serving"]
    for metric in ("ttft", "tpot", "itl", "e2el"):  # the per-request times were seconds, its figures ms
        assert serving[f"{metric}_ms"]["p50"] == pytest.approx(data[f"median_{metric}_ms"], abs=TOL), metric
        assert serving[f"{metric}_ms"]["p99"] == pytest.approx(data[f"p99_{metric}_ms"], abs=TOL), metric
    assert serving["completed"] == data["completed"] and serving["total_output_tokens"] == data["total_output_tokens"]


def test_aiperf_medians_are_the_files_own(root):
    aggregate = json.loads(AIPERF_AGGREGATE.read_text())
    serving = stored(root)["AIPerf 0.13.0"].summary["serving"]
    for ours, theirs in (("ttft", "time_to_first_token"), ("itl", "inter_chunk_latency"), ("e2el", "request_latency")):
        assert serving[f"{ours}_ms"]["p50"] == pytest.approx(aggregate[theirs]["p50"], abs=TOL), ours
        assert serving[f"{ours}_ms"]["count"] == aggregate[theirs]["count"]
    # TPOT is not AIPerf's "inter token latency": that divides by its own count of the re-tokenized text (11 tokens
    # here), ours by the engine's usage count (8, what was asked)
    assert serving["tpot_ms"]["p50"] > aggregate["inter_token_latency"]["p50"] * 1.2
    only = stored(root)["AIPerf 0.13.0 (summary only)"].summary["serving"]
    assert only["ttft_ms"]["p50"] == pytest.approx(aggregate["time_to_first_token"]["p50"], abs=TOL)
    assert only["validity"].startswith("summary only")
    assert only["itl_ms"]["count"] == aggregate["inter_chunk_latency"]["count"]  # gaps, not requests


def test_guidellm_medians_and_its_own_percentile_convention(root):
    bench = json.loads(GUIDELLM.read_text())["benchmarks"][0]
    serving = stored(root)["guidellm 0.8.1"].summary["serving"]
    requests = bench["requests"]["successful"]
    for ours, theirs, scale in (("ttft", "time_to_first_token_ms", 1.0), ("e2el", "request_latency", 1e3)):
        figures = bench["metrics"][theirs]["successful"]
        values = sorted(r[theirs] * scale for r in requests)  # latency in seconds, TTFT in ms
        assert serving[f"{ours}_ms"]["mean"] == pytest.approx(figures["mean"] * scale, abs=TOL), ours
        assert serving[f"{ours}_ms"]["p50"] == pytest.approx(statistics.median(values), abs=TOL), ours
        # guidellm's median takes the lower middle value (no interpolation): with 8 requests, the 4th
        assert figures["median"] * scale == pytest.approx(values[(len(values) - 1) // 2], abs=TOL), ours
    assert serving["itl_ms"] is None  # it keeps first and last token times only


def test_a_file_of_no_tool_or_missing_fields_is_one_line_and_imports_nothing(tmp_path):
    root = tmp_path / "runs"
    cases = {"other.json": json.dumps({"hello": 1}),
             "vllm-no-duration.json": json.dumps({k: v for k, v in json.loads(VLLM.read_text()).items()
                                                  if k != "duration"}),
             "vllm-short-lists.json": json.dumps({**json.loads(VLLM.read_text()), "ttfts": [0.1]}),
             "text.txt": "not json\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    lonely = tmp_path / "aiperf"
    lonely.mkdir()
    shutil.copy(AIPERF, lonely / AIPERF.name)  # without its aggregate beside it
    for path, words in ((tmp_path / "other.json", "not a result file of vllm bench serve"),
                        (tmp_path / "vllm-no-duration.json", "without duration"),
                        (tmp_path / "vllm-short-lists.json", "differ in length"),
                        (tmp_path / "text.txt", "neither JSON nor JSON lines"),
                        (lonely / AIPERF.name, "profile_export_aiperf.json beside them")):
        done = cli("runs", "import", VLLM, path, "--root", root)  # a good file first: nothing of it imported either
        assert done.returncode == 2, done.stdout
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and words in lines[0], done.stderr
        assert not root.exists()


def test_a_workload_the_file_disagrees_with_is_refused(tmp_path):
    root = tmp_path / "runs"
    done = cli("runs", "import", VLLM, "--workload", RUN, "--root", root)
    assert done.returncode == 0, done.stderr
    other = tmp_path / "c4.json"
    other.write_text(json.dumps(json.loads((RUN / "launch.json").read_text())["workload"]).replace(
        '"concurrency": 2', '"concurrency": 4'))
    with pytest.raises(LlmadaptError, match="closed loop of 2 in flight, the workload has serve.arrival.concurrency=4"):
        from llmadapt.contract.foreign import check_against
        from llmadapt.spec import Workload

        check_against(read_result(VLLM), Workload.from_dict(json.loads(other.read_text())))
    done = cli("runs", "import", AIPERF, "--workload", other, "--root", root)
    assert done.returncode == 2 and "not the stream of the workload given" in done.stderr
    with RunStore(root) as store:
        assert [r.adapter for r in store.runs()] == ["vllm-bench"]  # nothing of the refused file


def test_importing_the_same_file_twice_adds_nothing(tmp_path):
    root = tmp_path / "runs"
    assert cli("runs", "import", GUIDELLM, "--root", root).returncode == 0
    again = cli("runs", "import", GUIDELLM, "--root", root)
    assert again.returncode == 0 and "0 run(s) imported" in again.stdout
