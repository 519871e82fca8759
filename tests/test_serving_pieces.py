"""A serving run's pieces, each on its own (llmadapt.launch.engine, .loadpoint and .serve's series of points),
against a local streaming server (tests/fake_openai.py) attached to through the openai adapter."""

import asyncio
import time

import pytest

from llmadapt import Workload
from llmadapt.adapter.plugins import get_adapter
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.rundir import RunDir
from llmadapt.host import free_port
from llmadapt.launch import engine as engine_module
from llmadapt.launch.engine import Engine
from llmadapt.launch.loadpoint import drive, new_point
from llmadapt.launch.serve import serve_points

pytest.importorskip("aiohttp")
pytest.importorskip("llmadapt_openai", reason="the openai adapter package is not installed (pip install -e plugins/openai)")


@pytest.fixture
def fake_server(local_server):
    return lambda *args: local_server("fake_openai.py", *args)


def workload(url, requests=6):
    return Workload.from_dict({"kind": "serve", "model": {"preset": "tiny-llama"}, "serve": {
        "url": url, "requests": requests, "warmup_requests": 0, "input_len": {"mean": 16}, "output_len": {"mean": 4},
        "arrival": {"process": "constant", "rate": 50.0}, "request_timeout_s": 5.0, "scrape_interval_s": 0.2}})


async def _with_session(job):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await job(session)


def wait_ready(engine, timeout):
    return asyncio.run(_with_session(lambda s: engine.wait_ready(s, timeout, time.monotonic())))


def test_the_engine_is_ready_when_its_server_answers(tmp_path, fake_server):
    url, _ = fake_server()
    engine = Engine.prepare(workload(url), get_adapter("openai"), tmp_path)
    assert engine.attach and engine.checkpoint is None
    assert wait_ready(engine, 30) is None


def test_an_engine_that_never_gets_ready_fails_at_the_start_up_limit(tmp_path, fake_server):
    url, _ = fake_server("--models", "starting")  # answers 503: loading, waited for
    engine = Engine.prepare(workload(url), get_adapter("openai"), tmp_path)
    failure = wait_ready(engine, 2)
    assert (failure.cause, failure.message) == ("timeout", "the engine was not ready within 2 s")


def test_an_attached_address_where_nothing_listens_fails_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "REFUSED_GRACE_S", 0.5)
    url = f"http://127.0.0.1:{free_port()}"
    engine = Engine.prepare(workload(url), get_adapter("openai"), tmp_path)
    failure = wait_ready(engine, 60)
    assert failure.cause == "error"
    assert failure.message.startswith(f"nothing answers at {url}: connection refused (retried for 0.5 s")


def test_stopping_the_engine_removes_its_pid_file(tmp_path, fake_server):
    url, _ = fake_server()
    engine = Engine.prepare(workload(url), get_adapter("openai"), tmp_path)
    RunDir(tmp_path).engine_pid.write_text("12345")
    assert engine.group() == 12345
    engine.stop()
    assert not RunDir(tmp_path).engine_pid.exists() and engine.group() is None


def test_a_load_point_writes_its_header_requests_and_window(tmp_path, fake_server):
    url, _ = fake_server()
    w, info = workload(url), get_adapter("openai")
    engine = Engine.prepare(w, info, tmp_path / "engine")
    point = new_point(w, info, tmp_path, None, None)
    assert RunDir(point.run_dir).launch_file.is_file()
    failures = []
    asyncio.run(_with_session(lambda s: drive(engine, point, s, time.monotonic(), None, None, failures)))
    kinds = [r["type"] for r in read_jsonl(RunDir(point.run_dir).rank_file(0))]
    assert failures == []
    assert kinds[0] == "header" and kinds.count("request") == 6 and "interference" in kinds


def test_a_load_point_past_its_timeout_says_so_and_keeps_its_records(tmp_path, fake_server):
    url, _ = fake_server("--token-ms", 400)  # 4 tokens a request at 0.4 s each: longer than the 1 s allowed
    w, info = workload(url), get_adapter("openai")
    engine = Engine.prepare(w, info, tmp_path / "engine")
    point = new_point(w, info, tmp_path, None, None)
    failures = []
    asyncio.run(_with_session(lambda s: drive(engine, point, s, time.monotonic(), 1.0, None, failures)))
    assert [(f.cause, f.message) for f in failures] == [("timeout", "the run exceeded its timeout of 1 s")]
    kinds = [r["type"] for r in read_jsonl(RunDir(point.run_dir).rank_file(0))]
    assert kinds[0] == "header" and "interference" in kinds


def test_points_run_one_after_the_other_against_one_engine_each_summarised(tmp_path, fake_server):
    url, _ = fake_server("--log", tmp_path / "requests.jsonl")
    w, info = workload(url, requests=3), get_adapter("openai")
    seen = []

    def next_point(done):
        seen.append(len(done))
        return None if len(done) == 3 else new_point(w, info, tmp_path / "runs", None, None)

    results = serve_points(w, info, tmp_path / "engine", 60, None, next_point)
    assert seen == [0, 1, 2, 3]  # asked again after each point, given the results so far
    assert [r.summary.status for r in results] == ["ok"] * 3
    assert len({r.run_dir for r in results}) == 3 and all((r.run_dir / "summary.json").is_file() for r in results)
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 9


def test_no_point_asked_for_starts_no_engine(tmp_path):
    w = workload(f"http://127.0.0.1:{free_port()}")
    assert serve_points(w, get_adapter("openai"), tmp_path, 60, None, lambda done: None) == []
