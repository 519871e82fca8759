"""The load generator and the serve path, against a local streaming server (tests/fake_openai.py)."""

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from llmadapt import Workload, run
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.host import free_port
from llmadapt.models import train_tokenizer
from llmadapt.runtime.requests import arrival_offsets, plan_requests
from llmadapt.testing import interruptible

HERE = Path(__file__).parent
MARK = "LLMADAPT_TEST_MARK"

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


def marked(mark):
    """Live processes (other than this one) whose environment carries ``MARK=mark``: everything started after the
    mark was set inherits it, whatever its process group or parent, so none may be left after a run."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if f"{MARK}={mark}".encode() in (p / "environ").read_bytes().split(b"\0"):
                    found.append(int(p.name))
            except OSError:
                continue  # gone, or not ours
    return found


@pytest.fixture
def mark(monkeypatch):
    """Set a mark in this process's environment (call after starting the fake server): processes the run starts
    inherit it. Whatever a failing test left behind is killed afterwards."""
    value = uuid.uuid4().hex
    yield lambda: monkeypatch.setenv(MARK, value) or value
    for pid in marked(value):
        os.kill(pid, signal.SIGKILL)


def cli(tmp_path, workload, *args, mark, timeout=300):
    """`llmadapt run WORKLOAD --adapter openai ARGS` in a subprocess that must end by itself (``timeout`` is only a
    hang guard): (returncode, stdout and stderr, run_dir)."""
    path = tmp_path / "w.json"
    path.write_text(json.dumps(workload.to_dict()))
    proc = subprocess.Popen([sys.executable, "-m", "llmadapt.cli", "run", str(path), "--adapter", "openai",
                             "--out", str(tmp_path / "runs"), *args], env={**os.environ, MARK: mark},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=timeout)
    (run_dir,) = (tmp_path / "runs").iterdir()
    return proc.returncode, out.decode() + err.decode(), run_dir


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
    # Validity follows the measured send lag and event-loop lag (whether the machine kept up is not this
    # test's business: no timing threshold here), and each reason is written out.
    from llmadapt.contract.stats import LAG_P99_LIMIT_MS

    late, stalled = s.send_lag_ms.p99 > LAG_P99_LIMIT_MS, s.loop_lag_ms.p99 > LAG_P99_LIMIT_MS
    assert s.send_lag_ms.count == 12 and s.valid == (not late and not stalled), s.validity
    assert ("was not delivered" in s.validity) == late and ("event loop stalled" in s.validity) == stalled, s.validity
    samples = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "server_sample"]
    assert samples and samples[-1]["values"]["fake_requests_total"] == 13
    # The client's own health, sampled throughout: every request sent, its CPU, its event loop's wake-ups.
    (client,) = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "client_load"]
    assert client["requests_sent"] == 13 and client["cpu_s"] > 0 and client["loop_lag_ms"]["count"] > 0
    assert s.client_cpu_ms_per_request == pytest.approx(client["cpu_s"] * 1e3 / 13)
    assert s.loop_lag_ms.count == client["loop_lag_ms"]["count"]
    assert s.bunched_share is None and s.engine_itl_ms is None  # the openai adapter names no engine histogram


def test_a_stalled_client_marks_the_run_invalid_and_says_why(tmp_path, fake_server, monkeypatch):
    """A chunk handler that blocks the event loop for 0.3 s (the stall seen beside a busy engine): every stream
    waits meanwhile. The run is invalid, the reason names the stalled loop, the stall is in the trace."""
    from llmadapt.runtime import loadgen

    url, _ = fake_server("--first-ms", "5", "--token-ms", "5")
    real, calls = loadgen.check_chunk, []

    def stalling(chunk):
        calls.append(1)
        if len(calls) == 20:
            time.sleep(0.3)
        return real(chunk)

    monkeypatch.setattr(loadgen, "check_chunk", stalling)
    result = run(serve_workload(url), "openai", out=tmp_path)
    s = result.summary.serving
    assert (s.completed, s.failed) == (12, 0) and not s.valid
    assert "the client's event loop stalled" in s.validity and "ms per request" in s.validity, s.validity
    assert "blocked in a system call" in s.validity  # time.sleep: neither running nor waiting for a CPU
    assert s.loop_lag_ms.max >= 250  # the sampler was due during the 300 ms block: it woke that late
    (client,) = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "client_load"]
    t, lag, cpu, queued = max(client["stalls"], key=lambda stall: stall[1])
    assert lag >= 250 and 0 <= t <= s.duration_s + 1 and queued is not None
    from llmadapt.analysis.report import render_summary

    shown = render_summary(json.loads((result.run_dir / "summary.json").read_text()))
    assert "validity   invalid: " in shown and "event loop stalled" in shown


@pytest.mark.parametrize("stall, cause", [
    # the thread's wait and the CPU are read over the whole stalled sleep: 10 ms interval + 300 ms lag
    ([0.5, 300.0, 2.0, 290.0], "waited runnable for a CPU 290 of the 310 ms those late wake-ups took: starved by "
                               "other processes (Linux"),
    # a wait longer than the lag is legitimate (the sleep's own 10 ms count): never more than its whole
    ([0.5, 300.0, 2.0, 305.0], "waited runnable for a CPU 305 of the 310 ms those late wake-ups took"),
    ([0.5, 300.0, 280.0, 5.0], "the client used 280 ms of CPU (all its threads) over the 310 ms those late wake-ups "
                               "took: work on the event loop"),
    ([0.5, 300.0, 2.0, 3.0], "blocked in a system call"),
])
def test_a_stall_is_explained_by_what_the_loops_thread_did_meanwhile(stall, cause):
    from llmadapt.contract.stats import serving_stats

    w = serve_workload("http://127.0.0.1:1", arrival={"process": "closed", "concurrency": 1})
    lag = {"count": 10, "mean": 30.0, "std": 1.0, "min": 0.0, "p50": 0.1, "p90": 0.2, "p95": 0.3, "p99": 300.0,
           "max": 300.0}
    client = {"type": "client_load", "interval_ms": 10.0, "loop_lag_ms": lag, "stalls": [stall], "cpu_s": 0.5,
              "wall_s": 1.0, "requests_sent": 1, "engine_itl_metric": None, "sched_autogroup": True}
    s = serving_stats([request(0, 0, [10, 20, 30]), client], w)
    assert not s.valid and cause in s.validity, s.validity


def request(index, sent_ms, chunks_ms):
    """A measured request record whose chunks arrived at ``chunks_ms`` (ms after the clock's zero)."""
    ns = [int(t * 1e6) for t in chunks_ms]
    return {"type": "request", "index": index, "warmup": False, "status": "ok", "error_cause": None,
            "scheduled_ns": int(sent_ms * 1e6), "sent_ns": int(sent_ms * 1e6), "first_token_ns": ns[0],
            "end_ns": ns[-1], "chunk_ns": ns, "chunk_tokens": [1] * len(ns), "output_tokens": len(ns),
            "input_tokens": 4, "output_forced": True}


def engine(count, total_s):
    return {"type": "server_sample", "t_ns": 0, "source": "vllm",
            "values": {'vllm:inter_token_latency_seconds_count{model_name="m"}': count,
                       'vllm:inter_token_latency_seconds_sum{model_name="m"}': total_s}}


def test_bunched_chunks_are_measured_against_the_engines_own_inter_token_latency():
    """The engine made tokens 20 ms apart (its histogram between the first and last sample: 400 tokens,
    8 s). One request's chunks arrive 20 ms apart, the other's half in a burst (0.1 ms apart, under a
    tenth of 20 ms). Exact shares: 0 of 9 gaps, then 5 of 18; 28% > 20% makes the run invalid."""
    from llmadapt.contract.stats import serving_stats

    w = serve_workload("http://127.0.0.1:1", arrival={"process": "closed", "concurrency": 2})
    client = {"type": "client_load", "interval_ms": 10.0, "loop_lag_ms": None, "stalls": [], "cpu_s": 0.5,
              "wall_s": 1.0, "requests_sent": 2, "engine_itl_metric": "vllm:inter_token_latency_seconds"}
    steady = request(0, 0, [10 + 20 * i for i in range(10)])
    samples = [engine(100, 2.0), engine(500, 10.0)]
    s = serving_stats([steady, *samples, client], w)
    assert s.engine_itl_ms == pytest.approx(20.0) and s.bunched_share == 0 and s.valid, s.validity
    burst = request(1, 0, [10 + 20 * i for i in range(5)] + [90 + 0.1 * i for i in range(1, 6)])
    s = serving_stats([steady, burst, *samples, client], w)
    assert s.bunched_share == pytest.approx(5 / 18) and not s.valid
    assert "28% of inter-chunk gaps were under a tenth of the engine's own inter-token latency (20.00 ms)" in s.validity
    assert s.client_cpu_ms_per_request == pytest.approx(250.0)
    # One engine sample gives no interval to measure over: no figure, no verdict from it.
    s = serving_stats([steady, burst, samples[-1], client], w)
    assert s.engine_itl_ms is None and s.bunched_share is None and s.valid


def test_failures_are_counted_by_cause_never_crash(tmp_path, fake_server, mark):
    """429, 5xx, in-band errors, malformed SSE, hangs before and after the headers (request timeouts) and a
    connection cut mid-stream are failed requests with their cause; every record stays readable, none is lost."""
    modes = "ok,429,500,inband,malformed,hang,stall,cut,keepalive"
    url, _ = fake_server("--cycle", modes)
    run_mark = mark()
    # one request at a time: the server meets them in plan order, whatever the machine's load
    w = serve_workload(url, requests=17, warmup_requests=1, request_timeout_s=1.0,
                       arrival={"process": "closed", "concurrency": 1})
    result = run(w, "openai", out=tmp_path)
    s = result.summary.serving
    # request 0 (warm-up) is 'ok'; measured requests 1..17 meet the 9 modes in turn
    assert s.failures_by_cause == {"http_429": 2, "http_5xx": 2, "in_band": 2, "malformed": 2, "timeout": 4,
                                   "connection": 2}
    assert s.completed == 3  # one ok and two keepalive (comment lines ignored)
    records = sorted(requests_of(result), key=lambda r: r["index"])  # read_jsonl validates every record
    assert len(records) == 18
    by_mode = dict(zip(modes.split(",") * 2, records))
    assert by_mode["stall"]["error_cause"] == by_mode["hang"]["error_cause"] == "timeout"
    assert by_mode["cut"]["error_cause"] == "connection" and len(by_mode["cut"]["chunk_ns"]) == 2
    assert all(r["error"] for r in records if r["status"] != "ok")
    assert json.loads((result.run_dir / "summary.json").read_text())["serving"]["failed"] == 14
    assert marked(run_mark) == []


def test_a_stream_without_its_end_marker_is_truncated_and_out_of_goodput(tmp_path, fake_server, mark):
    """A stream that ends cleanly but early (no finish reason, no usage, no [DONE]: a proxy or an engine that stopped
    it) is a truncated request, not a response: recorded as such, counted out of goodput, and the run is degraded
    unless serve.max_failed_share allows that share."""
    url, _ = fake_server("--cycle", "ok,truncated")
    run_mark = mark()
    w = serve_workload(url, requests=6, warmup_requests=1, arrival={"process": "closed", "concurrency": 1},
                       slo={"ttft_ms": 60_000.0})
    result = run(w, "openai", out=tmp_path / "strict")
    records = sorted(requests_of(result), key=lambda r: r["index"])
    truncated = [r for r in records if r["status"] != "ok"]
    assert [r["index"] for r in truncated] == [1, 3, 5]  # the fake's cycle: ok (warm-up), truncated, ok, ...
    for r in truncated:
        assert (r["status"], r["error_cause"]) == ("truncated", "truncated") and len(r["chunk_ns"]) == 2
        assert r["error"] == "truncated: the stream ended without a finish reason or data: [DONE]"
    s = result.summary
    assert s.serving.failures_by_cause == {"truncated": 3} and (s.serving.completed, s.serving.failed) == (3, 3)
    assert s.serving.request_goodput * s.serving.duration_s == pytest.approx(3)  # only the complete responses
    assert s.status == "degraded" and not result.ok
    assert s.warnings == ["3 of 6 requests truncated: 50% > serve.max_failed_share 0 (the run is degraded)"]
    lenient = run(w.with_overrides(["serve.max_failed_share=0.5"]), "openai", out=tmp_path / "lenient")
    assert lenient.summary.status == "ok" and lenient.summary.serving.failed == 3
    assert lenient.summary.warnings == ["3 of 6 requests truncated: 50% <= serve.max_failed_share 0.5"]
    assert marked(run_mark) == []


def test_a_run_with_failed_requests_says_how_many_last_and_exits_1(tmp_path, fake_server, mark):
    """`llmadapt run` with 4 of 6 requests failed (two of them truncated): its last line says so, exit 1."""
    url, _ = fake_server("--cycle", "ok,500,truncated")
    run_mark = mark()
    w = serve_workload(url, requests=6, warmup_requests=1, arrival={"process": "closed", "concurrency": 1})
    path = tmp_path / "w.json"
    path.write_text(json.dumps(w.to_dict()))
    proc = subprocess.run([sys.executable, "-m", "llmadapt.cli", "run", str(path), "--adapter", "openai", "--out",
                           str(tmp_path / "runs")], env={**os.environ, MARK: run_mark}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == ("degraded   4 of 6 requests failed (2 of them truncated) (exit 1; "
                                                    "serve.max_failed_share sets how many may fail)")
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "degraded"
    assert marked(run_mark) == []


def test_tokens_without_text_are_a_response_and_nothing_is_a_failure(tmp_path, fake_server):
    """A tiny random model's tokens may make no whole UTF-8 character: an engine that streams text sends none, and
    its usage counts them. That is a response whose tokens all reached the client with its last event; a stream
    with no content, no tokens and no finish reason is a failed (truncated) request."""
    url, _ = fake_server("--cycle", "notext,empty,ok")
    w = serve_workload(url, requests=5, warmup_requests=1, arrival={"process": "closed", "concurrency": 1})
    records = sorted(requests_of(run(w, "openai", out=tmp_path)), key=lambda r: r["index"])
    for r, mode in zip(records, ["notext", "empty", "ok"] * 2):
        if mode == "empty":
            # no chunk, so no finish reason either: [DONE] alone ends no response
            assert r["status"] == "truncated" and r["error"] == ("truncated: the stream ended (data: [DONE]) without "
                                                                 "a finish reason")
            continue
        assert r["status"] == "ok" and r["output_tokens"] == 8
        if mode == "notext":
            assert r["chunk_tokens"] == [8] and r["first_token_ns"] == r["chunk_ns"][0] <= r["end_ns"]
        else:
            assert len(r["chunk_ns"]) == 8


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_values_of_the_wrong_type_fail_the_request_never_the_summary(tmp_path, fake_server, mark, api):
    """A string for a token count, a number for a finish reason or a text, an event that is a list, null or a
    number: the request fails as malformed, naming the field; the records and the summary stay valid."""
    modes = "ok,badusage,badfinish,badtext,list,null,number"
    url, _ = fake_server("--cycle", modes)
    run_mark = mark()
    w = serve_workload(url, requests=6, warmup_requests=1, api=api, arrival={"process": "closed", "concurrency": 1})
    result = run(w, "openai", out=tmp_path)
    assert result.summary.serving.failures_by_cause == {"malformed": 6}
    by_mode = dict(zip(modes.split(","), sorted(requests_of(result), key=lambda r: r["index"])))
    assert by_mode["ok"]["status"] == "ok" and by_mode["ok"]["finish_reason"] == "length"
    content = "delta.content" if api == "chat" else "text"
    for mode, what in (("badusage", "usage.completion_tokens is text, not a count: "),
                       ("badfinish", "choices[0].finish_reason is a number, not text: "),
                       ("badtext", f"choices[0].{content} is a number, not text: "),
                       ("list", "the event is a list, not an object: '["), ("null", "the event is null, not an object"),
                       ("number", "the event is a number, not an object: '42'")):
        r = by_mode[mode]
        assert (r["status"], r["error_cause"]) == ("error", "malformed") and what in r["error"], (mode, r["error"])
        assert r["output_tokens"] is None and r["finish_reason"] in (None, "length")  # what came before stays
    assert json.loads((result.run_dir / "summary.json").read_text())["serving"]["failed"] == 6
    assert marked(run_mark) == []


def test_api_key_is_sent_but_never_written(tmp_path, fake_server, monkeypatch):
    """The key authenticates (the server requires it) and appears in no file of the run."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secret-1234")
    url, _ = fake_server("--require-key", "sk-test-secret-1234")
    result = run(serve_workload(url, requests=3), "openai", out=tmp_path)
    assert result.ok and result.summary.serving.completed == 3
    for path in result.run_dir.iterdir():
        assert "sk-test-secret-1234" not in path.read_text(errors="replace"), path.name


def test_secrets_that_the_server_echoes_are_redacted(tmp_path, fake_server, mark, monkeypatch):
    """A server that quotes the Authorization header it got (in error bodies, in-band errors, malformed data and
    its metrics): the key is replaced by [redacted] in every record, and no file of the run holds it."""
    key = "sk-echo-secret-9876"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    url, _ = fake_server("--echo-auth", "--cycle", "ok,429,500,inband,malformed")
    refusing, _ = fake_server("--echo-auth", "--require-key", "another-key")
    run_mark = mark()
    w = serve_workload(url, requests=4, warmup_requests=1, arrival={"process": "closed", "concurrency": 1})
    result = run(w, "openai", out=tmp_path / "echo")
    assert result.summary.serving.failures_by_cause == {"http_429": 1, "http_5xx": 1, "in_band": 1, "malformed": 1}
    failed = [r for r in requests_of(result) if r["status"] != "ok"]
    assert all("[redacted]" in r["error"] for r in failed), [r["error"] for r in failed]
    samples = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "server_sample"]
    assert 'fake_last_request{authorization="[redacted]"}' in samples[-1]["values"]
    # a server that refuses the key and quotes it (HTTP 401)
    refused = run(serve_workload(refusing, requests=2, warmup_requests=0), "openai", out=tmp_path / "refused")
    assert refused.summary.serving.failures_by_cause == {"http_4xx": 2}
    assert all("Incorrect API key provided (request had Authorization: [redacted])" in r["error"]
               for r in requests_of(refused))
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path
    assert marked(run_mark) == []


def test_engine_dying_mid_run_fails_the_rest_and_keeps_the_summary(tmp_path, fake_server, mark):
    """When the server goes away, in-flight and later requests are failures with a cause; the summary is written."""
    url, proc = fake_server("--exit-after", "5")
    run_mark = mark()
    result = run(serve_workload(url, requests=10, warmup_requests=0), "openai", out=tmp_path)
    s = result.summary.serving
    assert s.completed == 5 and s.failed == 5
    assert set(s.failures_by_cause) <= {"connection", "engine_dead"}
    records = requests_of(result)  # every record readable
    assert len(records) == 10 and sorted(r["index"] for r in records if r["status"] == "ok") == [0, 1, 2, 3, 4]
    assert all(r["error"] for r in records if r["status"] != "ok")
    assert (result.run_dir / "summary.json").is_file()
    assert proc.wait(timeout=30) == 0 and marked(run_mark) == []


def test_a_hung_server_is_ended_by_the_runs_timeout(tmp_path, fake_server, mark):
    """Requests that hang before or after the headers, with a request timeout longer than the run's --timeout:
    the run ends by itself at its timeout, hung requests recorded as cancelled, the completed ones kept."""
    url, _ = fake_server("--cycle", "ok,stall,hang")
    w = serve_workload(url, requests=6, warmup_requests=0, request_timeout_s=3600.0,
                       arrival={"process": "constant", "rate": 5.0})  # far apart: the server meets them in order
    run_mark = mark()
    code, err, run_dir = cli(tmp_path, w, "--timeout", "10", mark=run_mark)
    assert code == 1, err[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert [f["message"] for f in summary["failures"]] == ["the run exceeded its timeout of 10 s"]
    records = [r for r in read_jsonl(run_dir / "rank-00000.jsonl") if r["type"] == "request"]  # all valid
    assert sorted(r["status"] for r in records) == ["cancelled"] * 4 + ["ok"] * 2
    assert summary["serving"]["completed"] == 2 and summary["serving"]["failures_by_cause"] == {"cancelled": 4}
    assert marked(run_mark) == []


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
                             "--out", str(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=interruptible)
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


MANAGED = """
import signal, socket, subprocess, sys, time
from urllib.parse import urlsplit
from llmadapt_openai.server import OpenAIServer

def start(self):  # the adapter starts its engine, in its own session like the real ones (hf, vllm)
    port = urlsplit(self.ctx.base_url).port
    self.proc = subprocess.Popen([sys.executable, FAKE, str(port), "--first-ms", "50", "--token-ms", "20"],
                                 start_new_session=True)
    while self.proc.poll() is None:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
        except OSError:
            time.sleep(0.05)

def stop(self):
    self.proc.terminate()
    self.proc.wait()

OpenAIServer.start, OpenAIServer.stop = start, stop
import llmadapt.launch.serve
llmadapt.launch.serve.check_reachable = lambda workload: None  # serve.url's server is started by the run, after
OpenAIServer.alive = lambda self: self.proc.poll() is None
if sys.argv[1] == "api":  # embedded: llmadapt.run from a program, no CLI and none of its signal handling
    import llmadapt
    workload, out, url = sys.argv[2:]
    llmadapt.run(llmadapt.Workload.from_file(workload).with_overrides([f"serve.url={url}"]), "openai", out=out)
else:
    from llmadapt.cli import main
    main(sys.argv[2:])
"""


@pytest.mark.parametrize(("how", "engine"), [("cli", "attached"), ("cli", "managed"), ("api", "managed")])
def test_sigterm_stops_the_run_like_ctrl_c(tmp_path, fake_server, mark, how, engine):
    """SIGTERM (a Slurm or Kubernetes cancel) to `llmadapt run`, or to a program calling llmadapt.run, mid-run:
    the engine the run started is stopped, the summary counts every request measured so far, the failure names
    the signal, the exit code is non-zero, and no process of the run is left."""
    w = serve_workload("http://unused", requests=200, arrival={"process": "constant", "rate": 5.0})
    path = tmp_path / "w.json"
    path.write_text(json.dumps(w.to_dict()))
    args = ["run", str(path), "--adapter", "openai", "--out", str(tmp_path / "runs")]
    if engine == "attached":
        url, _ = fake_server("--first-ms", "50", "--token-ms", "20")
        cmd = [sys.executable, "-m", "llmadapt.cli", *args, "--set", f"serve.url={url}"]
    else:  # the run starts the engine itself, on the port serve.url names
        script = tmp_path / "managed.py"
        script.write_text(f"FAKE = {str(HERE / 'fake_openai.py')!r}\n" + MANAGED)
        url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, str(script), "cli", *args, "--set", f"serve.url={url}"] if how == "cli" else \
            [sys.executable, str(script), "api", str(path), str(tmp_path / "runs"), url]
    run_mark = mark()
    proc = subprocess.Popen(cmd, env={**os.environ, MARK: run_mark}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=interruptible)
    trace = None
    for _ in range(1200):  # until two measured requests are done (a hang guard, not a timing)
        trace = next((tmp_path / "runs").glob("*/rank-00000.jsonl"), None)
        if trace and sum('"warmup":false' in line and '"status":"ok"' in line
                         for line in trace.read_text().splitlines()) >= 2:
            break
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, err.decode()[-2000:]
    run_dir = trace.parent
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert [f["cause"] for f in summary["failures"]] == ["interrupted"]
    assert "SIGTERM" in summary["failures"][0]["message"]
    measured = [r for r in read_jsonl(run_dir / "rank-00000.jsonl") if r["type"] == "request" and not r["warmup"]]
    assert summary["serving"]["completed"] + summary["serving"]["failed"] == len(measured)
    assert summary["serving"]["completed"] >= 2
    assert marked(run_mark) == []  # the managed engine too


def test_show_export_and_compare_for_serving(tmp_path, fake_server):
    """Serving runs render, export as per-request CSV and vLLM-bench keys, and compare in one table."""
    from llmadapt import compare
    from llmadapt.analysis.report import export, render_summary, show

    url, _ = fake_server("--first-ms", "5")
    w = serve_workload(url, requests=4, slo={"ttft_ms": 10000.0})
    table = compare(w, ["openai"], matrix={"serve.api": ["completions", "chat"]}, out=tmp_path)
    assert [r.status for r in table.rows] == ["ok", "ok"]
    assert table.table().splitlines()[0].split()[:4] == ["problem", "run", "status", "req/s"]
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
    monkeypatch.setattr("llmadapt.launch.serve.check_reachable", lambda workload: None)  # as if it were managed
    result = run(serve_workload("http://127.0.0.1:9"), "openai", out=tmp_path)
    assert result.summary.status == "failed"
    assert "the engine failed to start: RuntimeError: no such engine" in result.summary.failures[0].message
    assert (result.run_dir / "summary.json").is_file()


@pytest.mark.parametrize("answer", ["html", "text", "list", "noid"])
def test_a_server_that_is_not_openai_compatible_fails_at_once(tmp_path, fake_server, mark, answer):
    """/v1/models answers 200 with an HTML page, plain text, or JSON of another shape: the run fails with one
    line saying so (the run's timeout is only a hang guard: waiting would end there, with another message)."""
    url, _ = fake_server("--models", answer)
    run_mark = mark()
    result = run(serve_workload(url), "openai", out=tmp_path, timeout=60)
    assert result.summary.status == "failed" and not requests_of(result)
    (failure,) = result.summary.failures
    assert failure.message.startswith(f"the server at {url} is not an OpenAI-compatible server: GET /v1/models "
                                      "answered 200 (")
    assert "\n" not in failure.message and len(failure.message) < 400
    if answer == "html":
        assert "(text/html) '<!DOCTYPE html> <html> <head><title>Welcome to nginx!" in failure.message
    assert marked(run_mark) == []


def test_nothing_listening_is_bad_input_before_any_run_folder(tmp_path, mark):
    """Attached to an address where nothing listens: one line saying so, after a few seconds of retries, not the
    start-up timeout (the subprocess's timeout is only a hang guard), before any run folder exists; from the CLI,
    exit 2 (bad input) and the error once."""
    from llmadapt.errors import LlmadaptError

    url = f"http://127.0.0.1:{free_port()}"
    run_mark = mark()
    started = time.monotonic()
    with pytest.raises(LlmadaptError, match=f"nothing answers at {url}: connection refused \\(retried for 5 s"):
        run(serve_workload(url), "openai", out=tmp_path / "api", timeout=120)
    assert time.monotonic() - started < 30 and not (tmp_path / "api").exists()
    path = tmp_path / "w.json"
    path.write_text(json.dumps(serve_workload(url).to_dict()))
    proc = subprocess.run([sys.executable, "-m", "llmadapt.cli", "run", str(path), "--adapter", "openai", "--out",
                           str(tmp_path / "runs")], env={**os.environ, MARK: run_mark}, capture_output=True,
                          text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-2000:]
    assert output.count(f"nothing answers at {url}: connection refused") == 1, output
    assert output.strip().count("\n") == 0  # one line
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
    assert marked(run_mark) == []


def test_a_server_that_answers_but_is_not_ready_is_waited_for(tmp_path, fake_server, mark):
    """A server that answers 503 (still loading its model) is waited for, up to the start-up limit (the run's
    timeout here): it is neither "nothing answers" nor "not an OpenAI-compatible server"."""
    url, _ = fake_server("--models", "starting")
    run_mark = mark()
    result = run(serve_workload(url), "openai", out=tmp_path, timeout=8)
    assert [f.message for f in result.summary.failures] == ["the engine was not ready within 8 s"]
    assert marked(run_mark) == []


def test_engine_metrics_are_read_as_the_exposition_format_defines_them():
    """A timestamped sample is its value, not its timestamp (a split at the last space read 1.7e12); labels
    with escaped quotes keep their value; a line that is no metric costs only itself."""
    from llmadapt.adapter.sse import parse_prometheus

    text = ("# HELP vllm:e2e_request_latency_seconds Histogram\n# TYPE vllm:e2e_request_latency_seconds histogram\n"
            'vllm:e2e_request_latency_seconds_bucket{le="0.1",model_name="a\\"b"} 3 1700000000000\n'
            'vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.5\n'
            "vllm:e2e_request_latency_seconds_count 4 1700000000000\n"
            "this is not a metric\n"
            "# TYPE tgi_request_success counter\ntgi_request_success 13\n"
            "tgi_queue_size 2\nother_metric 9\n")
    assert parse_prometheus(text, ("vllm:", "tgi_")) == {
        'vllm:e2e_request_latency_seconds_bucket{le="0.1",model_name="a\\"b"}': 3.0,
        'vllm:e2e_request_latency_seconds_sum{model_name="m"}': 1.5,
        "vllm:e2e_request_latency_seconds_count": 4.0,
        "tgi_request_success": 13.0,  # as printed: a typed parse would call it tgi_request_success_total
        "tgi_queue_size": 2.0,
    }
    assert parse_prometheus("<html>not metrics</html>", ("vllm:",)) == {}


def test_an_attached_serving_run_records_its_window_but_cannot_judge_other_processes(fake_server, tmp_path):
    """Attached by URL, the engine's CPU is not this run's to read: other processes' CPU is left unjudged (it may
    be the engine itself), and show says why."""
    from llmadapt.analysis.report import render_summary

    url, _ = fake_server()
    result = run(serve_workload(url), "openai", out=tmp_path)
    assert result.ok, result.summary.failures
    (window,) = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "interference"]
    assert window["machine_busy_cpu_s"] is None and window["own_cpu_s"] > 0 and window["window_s"] > 0
    i = result.summary.interference
    assert i.quiet is None and i.other_cpu_cores is None
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert "machine    not judged: the engine's CPU is not known (an engine attached by URL" in render_summary(summary)


def test_a_run_whose_every_request_failed_is_never_valid():
    """The client kept its schedule, but no measured request completed: nothing measured the engine, so the run is
    not valid (its validity says so), its table row reads NO, and a share of failures allowed by
    serve.max_failed_share cannot make it ok."""
    import attrs as _attrs

    from llmadapt.analysis.comparison import row_metrics
    from llmadapt.contract.records import Summary
    from llmadapt.contract.stats import failed_requests_verdict, serving_stats

    w = serve_workload("http://127.0.0.1:1", arrival={"process": "closed", "concurrency": 1})
    client = {"type": "client_load", "interval_ms": 10.0, "loop_lag_ms": None, "stalls": [], "cpu_s": 0.1,
              "wall_s": 1.0, "requests_sent": 8, "engine_itl_metric": None}
    dead = [{**request(i, i, [i + 1]), "status": "error", "error_cause": "engine_dead", "first_token_ns": None,
             "chunk_ns": [], "chunk_tokens": [], "output_tokens": None} for i in range(8)]
    s = serving_stats([*dead, client], w)
    assert (s.completed, s.failed) == (0, 8)
    assert not s.valid and s.validity == "no measured request completed (8 of 8 failed)", s.validity
    assert failed_requests_verdict(s, 1.0)[0] == "failed"
    # a summary written before valid required a completed request: its row still reads NO
    summary = Summary(run_id="r", status="failed", role="serve", adapter="llamacpp", framework="llama.cpp",
                      framework_version="", launcher="subprocess", workload_hash="w", problem_hash="p", world_size=1,
                      device=None, patches=[], steps_completed=0, measured_steps=0, losses=[], step_time_s=None,
                      tokens_per_s=None, samples_per_s=None, tokens_per_step=None, peak_memory_bytes=None,
                      peak_memory_per_rank=[], memory_kind=None, model_flops_per_token=None,
                      achieved_flops_per_s=None, mfu=None, phase_means_s={}, failures=[],
                      serving=_attrs.evolve(s, valid=True, validity="closed loop"))
    assert row_metrics(summary, None)["valid"] == "NO"
