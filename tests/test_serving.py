"""The load generator and the serve path, against a local streaming server (tests/fake_openai.py)."""

import json
import random
import signal
import statistics
import subprocess
import sys
import time

import pytest

from llmadapt import Workload, run
from llmadapt.contract import read_jsonl
from llmadapt.models import train_tokenizer
from llmadapt.serving import arrival_offsets, plan_requests

pytest.importorskip("aiohttp")
pytest.importorskip("llmadapt_openai", reason="the openai adapter package is not installed (pip install -e plugins/openai)")


@pytest.fixture
def fake_server(local_server):
    return lambda *args: local_server("fake_openai.py", *args)


def serve_workload(url, **serve):
    base = {"url": url, "requests": 12, "warmup_requests": 1, "input_len": {"mean": 16}, "output_len": {"mean": 8},
            "arrival": {"process": "constant", "rate": 50.0}, "request_timeout_s": 5.0, "scrape_interval_s": 0.2}
    for key, value in serve.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return Workload.from_dict({"kind": "serve", "model": {"preset": "tiny-llama"}, "serve": base})


def requests_of(result):
    return [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "request"]


def test_prompts_have_exact_token_counts_and_the_plan_is_reproducible():
    """Prompts are built from single-token words: the canonical tokenizer counts exactly what was asked."""
    tok = train_tokenizer(512)
    w = Workload.from_dict({"kind": "serve", "serve": {"input_len": {"dist": "uniform", "low": 3, "high": 40},
                                                       "requests": 20}})
    plan = plan_requests(w, tok)
    assert len(plan) == 22 and [p.warmup for p in plan[:3]] == [True, True, False]
    for p in plan:
        assert len(tok.encode(p.prompt, add_special_tokens=False).ids) == p.input_tokens
        assert 3 <= p.input_tokens <= 40
    assert [p.prompt for p in plan_requests(w, tok)] == [p.prompt for p in plan]


@pytest.mark.parametrize(("process", "burstiness", "cv2"), [("poisson", 1.0, 1.0), ("gamma", 0.25, 4.0),
                                                             ("gamma", 4.0, 0.25)])
def test_arrival_processes_have_the_asked_rate_and_burstiness(process, burstiness, cv2):
    """Mean gap = 1/rate; squared coefficient of variation = 1/burstiness (1 for Poisson)."""
    w = Workload.from_dict({"kind": "serve", "serve": {"arrival": {"process": process, "rate": 10.0,
                                                                   "burstiness": burstiness}}})
    t = arrival_offsets(w, 20001, random.Random(0))
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.05)
    assert statistics.pvariance(gaps) / mean**2 == pytest.approx(cv2, rel=0.1)


def test_constant_and_closed_arrivals():
    w = Workload.from_dict({"kind": "serve", "serve": {"arrival": {"process": "constant", "rate": 4.0}}})
    assert arrival_offsets(w, 3, random.Random(0)) == [0.0, 0.25, 0.5]
    closed = w.with_overrides(["serve.arrival.process=closed"])
    assert arrival_offsets(closed, 3, random.Random(0)) == [None, None, None]


@pytest.mark.parametrize("spin", [{}, {"send_spin_ms": 0.0}], ids=["spin", "timer-only"])
def test_every_request_is_recorded_with_client_side_timings(tmp_path, fake_server, spin):
    """TTFT, ITL, TPOT, E2EL come from the generator's clock; warm-up is excluded; the engine's metrics are sampled.
    No request is sent before its time, with or without the pre-send spin."""
    url, _ = fake_server("--first-ms", "20", "--token-ms", "5")
    result = run(serve_workload(url, **spin), "openai", out=tmp_path)
    assert result.ok, result.summary.failures
    s = result.summary.serving
    assert (s.completed, s.failed) == (12, 0)
    assert s.total_output_tokens == 12 * 8 and s.total_input_tokens == 12 * 16
    assert s.ttft_ms.min >= 20 and s.e2el_ms.min >= 20 + 7 * 5  # the server cannot answer sooner
    assert s.itl_ms.count == 12 * 7 and s.tpot_ms.count == 12
    records = requests_of(result)
    assert len(records) == 13 and sum(r["warmup"] for r in records) == 1
    for r in records:
        assert r["scheduled_ns"] <= r["sent_ns"] < r["first_token_ns"] <= r["end_ns"]
        assert len(r["chunk_ns"]) == 8 and r["finish_reason"] == "length"
    assert s.valid and s.send_lag_ms.count == 12
    samples = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "server_sample"]
    assert samples and samples[-1]["values"]["fake_requests_total"] == 13


def test_failures_are_counted_by_cause_never_crash(tmp_path, fake_server):
    """429, 5xx, in-band errors, malformed SSE and timeouts are failed requests with their cause."""
    url, _ = fake_server("--cycle", "ok,429,500,inband,malformed,hang,keepalive")
    w = serve_workload(url, requests=13, warmup_requests=1, request_timeout_s=1.0)
    result = run(w, "openai", out=tmp_path)
    s = result.summary.serving
    # request 0 (warm-up) is 'ok'; measured requests 1..13 meet the 7 modes in turn
    assert s.failures_by_cause == {"http_429": 2, "http_5xx": 2, "in_band": 2, "malformed": 2, "timeout": 2}
    assert s.completed == 3  # one ok and two keepalive (comment lines ignored)
    failed = [r for r in requests_of(result) if r["status"] != "ok"]
    assert all(r["error"] for r in failed)
    assert json.loads((result.run_dir / "summary.json").read_text())["serving"]["failed"] == 10


def test_api_key_is_sent_but_never_written(tmp_path, fake_server, monkeypatch):
    """The key authenticates (the server requires it) and appears in no file of the run."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secret-1234")
    url, _ = fake_server("--require-key", "sk-test-secret-1234")
    result = run(serve_workload(url, requests=3), "openai", out=tmp_path)
    assert result.ok and result.summary.serving.completed == 3
    for path in result.run_dir.iterdir():
        assert "sk-test-secret-1234" not in path.read_text(errors="replace"), path.name


def test_engine_dying_mid_run_fails_the_rest_and_keeps_the_summary(tmp_path, fake_server):
    """When the server goes away, in-flight and later requests are failures with a cause; the summary is written."""
    url, _ = fake_server("--exit-after", "5")
    result = run(serve_workload(url, requests=10, warmup_requests=0), "openai", out=tmp_path)
    s = result.summary.serving
    assert s.completed == 5 and s.failed == 5
    assert set(s.failures_by_cause) <= {"connection", "engine_dead"}
    assert (result.run_dir / "summary.json").is_file()


def test_closed_loop_keeps_concurrency(tmp_path, fake_server):
    """A closed loop never has more requests in flight than its concurrency."""
    url, _ = fake_server("--first-ms", "20", "--token-ms", "2")
    w = serve_workload(url, requests=12, arrival={"process": "closed", "concurrency": 3})
    result = run(w, "openai", out=tmp_path)
    assert result.ok
    events = sorted([(r["sent_ns"], 1) for r in requests_of(result)] + [(r["end_ns"], -1) for r in requests_of(result)])
    in_flight, most = 0, 0
    for _, delta in events:
        in_flight += delta
        most = max(most, in_flight)
    assert most == 3


def test_openai_adapter_refuses_to_run_without_a_url(tmp_path):
    from llmadapt import UnsupportedError

    w = Workload.from_dict({"kind": "serve"})
    with pytest.raises(UnsupportedError, match="adapter 'openai' cannot run serve.url=None: the openai adapter "
                                               "attaches to a running server"):
        run(w, "openai", out=tmp_path)


def test_ctrl_c_leaves_a_valid_partial_trace(tmp_path, fake_server):
    """SIGINT to `llmadapt run` mid-run: exit 130, the summary and every record so far are valid."""
    url, _ = fake_server("--first-ms", "50", "--token-ms", "20")
    path = tmp_path / "w.json"
    w = serve_workload(url, requests=200, arrival={"process": "constant", "rate": 5.0})
    path.write_text(json.dumps(w.to_dict()))
    proc = subprocess.Popen([sys.executable, "-m", "llmadapt.cli", "run", str(path), "--adapter", "openai",
                             "--out", str(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(4)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert {f["cause"] for f in summary["failures"]} == {"interrupted"}
    records = read_jsonl(run_dir / "rank-00000.jsonl")  # validates every record
    assert any(r["type"] == "request" and r["status"] == "ok" for r in records)


def test_show_export_and_compare_for_serving(tmp_path, fake_server):
    """Serving runs render, export as per-request CSV and vLLM-bench keys, and compare in one table."""
    from llmadapt import compare
    from llmadapt.analysis import export, render_summary, show

    url, _ = fake_server("--first-ms", "5")
    w = serve_workload(url, requests=4, slo={"ttft_ms": 10000.0})
    table = compare(w, ["openai"], matrix={"serve.api": ["completions", "chat"]}, out=tmp_path)
    assert [r.status for r in table.rows] == ["ok", "ok"]
    assert table.table().splitlines()[0].split()[:4] == ["run", "status", "req/s", "out"]
    run_dir = table.rows[1].run_dir
    assert "TTFT" in render_summary(show(run_dir))
    keys = json.loads(export(run_dir, "vllm-bench"))
    assert keys["completed"] == 4 and keys["request_goodput"] > 0
    assert {"mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "std_e2el_ms"} <= set(keys)
    rows = export(run_dir, "csv").splitlines()
    assert rows[0].startswith("index,warmup,status") and len(rows) == 1 + 5


def test_trace_replay_sends_at_the_recorded_times_with_the_recorded_lengths(tmp_path, fake_server):
    """A JSONL trace of send times and lengths is replayed as written."""
    trace = tmp_path / "trace.jsonl"
    rows = [{"send_time_s": t, "input_len": n, "output_len": m} for t, n, m in
            [(0.0, 5, 2), (0.05, 9, 3), (0.3, 3, 4), (0.31, 12, 1)]]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    url, _ = fake_server()
    w = serve_workload(url, requests=3, warmup_requests=1, arrival={"process": "trace", "trace": str(trace)})
    result = run(w, "openai", out=tmp_path / "runs")
    assert result.ok
    records = sorted(requests_of(result), key=lambda r: r["index"])
    assert [(r["input_tokens"], r["requested_output_tokens"]) for r in records] == [(5, 2), (9, 3), (3, 4), (12, 1)]
    offsets = [(r["scheduled_ns"] - records[0]["scheduled_ns"]) / 1e9 for r in records]
    assert offsets == pytest.approx([0.0, 0.05, 0.3, 0.31], abs=1e-6)


def test_concurrency_cap_and_duration_bound_an_open_loop(tmp_path, fake_server):
    """max_concurrency caps requests in flight; duration_s stops scheduling early."""
    url, _ = fake_server("--first-ms", "100")
    w = serve_workload(url, requests=40, warmup_requests=0, max_concurrency=2, duration_s=0.5,
                       arrival={"process": "constant", "rate": 40.0})
    result = run(w, "openai", out=tmp_path)
    records = requests_of(result)
    assert 0 < len(records) <= 21  # due times 0 .. 0.5 s at 40 req/s
    events = sorted([(r["sent_ns"], 1) for r in records] + [(r["end_ns"], -1) for r in records])
    in_flight = most = 0
    for _, delta in events:
        in_flight += delta
        most = max(most, in_flight)
    assert most <= 2
    by_send = sorted(records, key=lambda r: r["sent_ns"])
    assert [r["index"] for r in by_send] == sorted(r["index"] for r in records)  # slots go in schedule order
    # waiting for a slot delays the send: the verdict says the arrival process was not delivered
    assert not result.summary.serving.valid and "fell behind" in result.summary.serving.validity


def test_dataset_lengths_come_from_the_instruction_file():
    """dist='dataset' draws prompt and answer lengths from the JSONL data."""
    from llmadapt.testing import INSTRUCTIONS

    tok = train_tokenizer(512)
    w = Workload.from_dict({"kind": "serve", "data": {"source": "jsonl", "path": str(INSTRUCTIONS)},
                            "serve": {"input_len": {"dist": "dataset", "high": 64},
                                      "output_len": {"dist": "dataset", "high": 64}}})
    lengths = {len(tok.encode(json.loads(line)["instruction"], add_special_tokens=False).ids)
               for line in INSTRUCTIONS.read_text().splitlines()}
    plan = plan_requests(w, tok)
    assert {p.input_tokens for p in plan} <= lengths


def test_engine_that_fails_to_start_is_a_failed_run_with_a_summary(tmp_path, monkeypatch):
    """An exception from Server.start() becomes a failure record; the run directory has its summary."""
    from llmadapt_openai.server import OpenAIServer

    def broken(self):
        raise RuntimeError("no such engine")

    monkeypatch.setattr(OpenAIServer, "start", broken)
    result = run(serve_workload("http://127.0.0.1:9"), "openai", out=tmp_path)
    assert result.summary.status == "failed"
    assert "the engine failed to start: RuntimeError: no such engine" in result.summary.failures[0].message
    assert (result.run_dir / "summary.json").is_file()
