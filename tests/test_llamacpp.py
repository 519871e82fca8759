"""The `llamacpp` adapter: llama-cpp-python's server on the canonical checkpoint written as GGUF, driven for real.

The declaration and rules need nothing; the rest runs when the environment is built (`llmadapt env create
llamacpp`, which compiles llama.cpp) and is skipped with the reason otherwise. The model is tiny-llama with hidden
size 128, the serving examples' model.

Tolerances, and why:
- GGUF F32 logits against transformers' fp32 forward: 1e-5 absolute (logits of about 1; measured 5e-7 with the F32
  KV cache the adapter sets for fp32). The same file written without the RoPE row permutation is off by more than
  1e-2: the check catches that bug. Q8_0: 0.05 (block rounding; measured 0.016).
- Greedy outputs: identical, except where the reference's top two logits are within NEAR_TIE (1e-4, 200x the
  largest logit difference measured in F32) at the first differing token. Texts are compared without U+FFFD:
  llama-cpp-python drops the bytes of an unfinished UTF-8 character where transformers writes U+FFFD.
"""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from llmadapt import UnsupportedError, Workload, adapters, run
from llmadapt.adapter.context import ServeContext
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.testing import environments_unready

pytest.importorskip("llmadapt_llamacpp", reason="the llamacpp adapter package is not installed "
                                                  "(pip install -e plugins/llamacpp)")

from llmadapt_llamacpp.plugin import check  # noqa: E402

MODEL = {"preset": "tiny-llama", "hidden_size": 128}
NEAR_TIE = 1e-4


def workload(model=None, **top) -> Workload:
    serve = {"requests": 8, "warmup_requests": 1, "input_len": {"dist": "uniform", "low": 8, "high": 40},
             "output_len": {"mean": 12}, "arrival": {"process": "closed", "concurrency": 2},
             "request_timeout_s": 120.0, "ignore_eos": True}
    serve.update(top.pop("serve", {}))
    return Workload.from_dict({"kind": "serve", "model": model or MODEL, "serve": serve, **top})


@pytest.fixture(scope="module")
def env():
    why = environments_unready("llamacpp")
    if why:
        pytest.skip(why)
    from llmadapt.launch.environments import process_env, python_for

    spec = adapters()["llamacpp"].environment
    return python_for(spec), process_env(spec)


@pytest.fixture(scope="module")
def checkpoint():
    from llmadapt.launch.prepare import ensure_checkpoint

    why = environments_unready("hf")  # the reference environment builds the checkpoint (no torch in llamacpp's)
    if why:
        pytest.skip(why)
    return ensure_checkpoint(workload(), adapters()["llamacpp"].environment)


# -- the declaration and the rules: no engine --------------------------------------------------------------------
def test_registered_with_a_pinned_environment_that_compiles_llama_cpp():
    info = adapters()["llamacpp"]
    assert info.framework == "llama.cpp" and info.roles == {"serve": "llmadapt_llamacpp.server:LlamaCppServer"}
    spec = info.environment
    assert "llama-cpp-python==0.3.36" in spec.requirements and "gguf==0.19.0" in spec.requirements
    assert all("==" in r for r in spec.requirements)
    env = dict(spec.install_env)
    assert env["CMAKE_ARGS"] == ("-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON "
                                 "-DCMAKE_PROJECT_INCLUDE={build_files}/no-common.cmake")
    # llama.cpp's common library, which nothing here loads, is not compiled (README, "The environment")
    assert dict(spec.build_files)["no-common.cmake"].endswith("\nset(LLAMA_BUILD_COMMON OFF)\n")
    # no AMX kernels: built here, they crashed every quantized prompt batch (README, "The environment")
    assert env["CFLAGS"] == env["CXXFLAGS"] == "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert not spec.builds_checkpoint  # no torch there


def test_what_llama_cpp_cannot_run_is_refused_before_anything_starts(tmp_path):
    assert check(workload()) == [] and check(workload(precision="bf16")) == []
    fields = [p[0] for p in check(workload({"preset": "tiny-mixtral", "hidden_size": 128}, parallelism={"tp": 2},
                                           serve={"api": "chat"}))]
    assert fields == ["serve.api", "parallelism.tp", "model.num_experts"]
    assert check(workload(serve={"api": "chat", "url": "http://127.0.0.1:1"})) == []  # attached: not ours to judge
    for engine, match in (({"quantization": "fp8"}, "serve.engine.quantization"),
                          ({"max_sequences": 4}, "serve.engine.max_sequences")):
        with pytest.raises(UnsupportedError, match=match):
            run(workload(serve={"engine": engine}), "llamacpp", out=tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before a run directory existed


def test_a_model_folder_whose_tokenizer_llama_cpp_would_split_differently_is_refused(tmp_path, checkpoint):
    """A SentencePiece-style (Metaspace) pre-tokenizer is not GPT-2's: llama.cpp would tokenize prompts otherwise."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder, ignore=shutil.ignore_patterns("READY", "*.lock"))
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    w = workload(model={"path": str(folder)})
    problems = check(w)
    assert [p[0] for p in problems] == ["model.path"] and "GPT-2" in problems[0][2]
    with pytest.raises(UnsupportedError, match="model.path"):
        run(w, "llamacpp", out=tmp_path / "runs")


# -- the GGUF file ---------------------------------------------------------------------------------------------
LOGITS = """
import json, sys
from llama_cpp import Llama
import llmadapt_llamacpp.gguf_file as g
folder, out, kind, permute = sys.argv[1:5]
if permute == "no":  # the bug the parity check must catch
    g.permute_rope = lambda weight, heads: weight
g.write(__import__("pathlib").Path(folder), __import__("pathlib").Path(out), kind)
llm = Llama(model_path=out, n_ctx=256, logits_all=True, verbose=False, type_k=0, type_v=0)
rows = []
for prompt in json.loads(sys.argv[5]):
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=False)
    llm.reset()
    llm.eval(ids)
    rows.append({"ids": ids, "logits": llm.scores[:len(ids)].tolist()})
print(json.dumps(rows))
"""

PROMPTS = ["Hello world, this is a test.", "  two  spaces and\ttabs\nnewline", "numbers 12345 and 3.14!",
           "unicode: caf\u00e9 na\u00efve \u2014 ok", "Write a short poem about the sea."]


def test_the_build_loads_without_llama_cpps_common_library(env):
    """llama-cpp-python loads its libraries (llama, ggml) in the environment, and llama.cpp's common library, which
    its build forces on and nothing loads, was not compiled (README, "The environment")."""
    python, penv = env
    code = ("import json, sysconfig, llama_cpp; print(json.dumps([sysconfig.get_paths()['purelib'], "
            "llama_cpp.llama_cpp._lib._name, bool(llama_cpp.llama_supports_mmap())]))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=penv, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    site, loaded, _ = json.loads(done.stdout.splitlines()[-1])
    assert Path(loaded).name == "libllama.so" and Path(loaded).parent == Path(site) / "llama_cpp" / "lib"
    assert not list(Path(site).glob("lib/libllama-common*")), "llama.cpp's common library was built"


def test_the_gguf_file_computes_what_the_checkpoint_computes(env, checkpoint, tmp_path):
    """Same token ids as the canonical tokenizer for every prompt (spaces, tabs, digits, non-ASCII), and the same
    logits as transformers within the stated tolerances; a file without the RoPE permutation fails the check."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    python, environ = env
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    worst = {}
    for kind, permute in (("f32", "yes"), ("q8_0", "yes"), ("f32", "no")):
        out = subprocess.run([str(python), "-c", LOGITS, str(checkpoint), str(tmp_path / f"{kind}-{permute}.gguf"),
                              kind, permute, json.dumps(PROMPTS)], capture_output=True, text=True, env=environ,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        diff = 0.0
        for prompt, row in zip(PROMPTS, json.loads(out.stdout.splitlines()[-1])):
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            assert row["ids"] == ids, prompt
            with torch.no_grad():
                ref = model(torch.tensor([ids])).logits[0].numpy()
            diff = max(diff, float(np.abs(ref - np.asarray(row["logits"])).max()))
        worst[(kind, permute)] = diff
    assert worst[("f32", "yes")] < 1e-5, worst
    assert worst[("q8_0", "yes")] < 0.05, worst
    assert worst[("f32", "no")] > 1e-2, worst


# -- serving, for real -----------------------------------------------------------------------------------------
def test_a_serving_run_records_every_token_and_reuses_its_gguf_file(env, checkpoint, tmp_path):
    """Two concurrent streams (llama.cpp serves one at a time, the other waits in the server) all end with their
    tokens: none cut short, none fewer than asked (min_tokens), none more (the max-tokens fix), each counted by the
    stream-usage shim. The second
    run reuses the first one's GGUF file."""
    first = run(workload(), "llamacpp", out=tmp_path, timeout=600)
    assert first.ok, first.summary
    d = Path(first.run_dir)
    header = next(r for r in read_jsonl(d / "rank-00000.jsonl") if r["type"] == "header")
    assert [p["name"] for p in header["patches"]] == ["max-tokens", "stream-usage"]
    assert header["framework_version"] == "llama-cpp-python 0.3.36"
    reqs = [r for r in read_jsonl(d / "rank-00000.jsonl") if r["type"] == "request"]
    assert len(reqs) == 9 and all(r["status"] == "ok" and r["finish_reason"] == "length" for r in reqs)
    assert all(r["output_forced"] and r["output_tokens"] == r["requested_output_tokens"] for r in reqs)
    measured = [r for r in reqs if not r["warmup"]]
    per_chunk = sum(r["output_tokens"] for r in measured) / sum(len(r["chunk_ns"]) for r in measured)
    assert first.summary.serving.tokens_per_chunk == pytest.approx(per_chunk)  # ITL is per chunk: the summary says
    engine = json.loads((d / "engine.json").read_text())
    model = engine["settings"]["server"]["models"][0]
    assert engine["settings"]["server"]["interrupt_requests"] is False
    assert (model["type_k"], model["type_v"], model["logits_all"]) == (0, 0, False)  # F32 cache for fp32
    backend = json.loads((d / "llamacpp-backend.json").read_text())  # what the build runs on, for the reader
    assert isinstance(backend["gpu_offload"], bool) and backend["system_info"].startswith("CPU")
    gguf = json.loads((d / "gguf.json").read_text())
    assert gguf["type"] == "f32" and gguf["tensor_types"] == {"F32": 21}
    again = run(workload(serve={"requests": 2}), "llamacpp", out=tmp_path, timeout=600)
    assert again.ok
    reused = json.loads((Path(again.run_dir) / "gguf.json").read_text())
    assert reused["converted_now"] is False and reused["path"] == gguf["path"]


@pytest.mark.parametrize("quantization, qtype", [("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
def test_a_quantized_model_serves_every_request(env, checkpoint, tmp_path, quantization, qtype):
    """serve.engine.quantization: the GGUF file holds the block-quantized weights, and the engine serves them, every
    request to its last token (a build whose quantized kernels crashed the engine served none of them), in prompt
    batches and in one-token decoding steps, on all the engine's threads."""
    result = run(workload(serve={"engine": {"quantization": quantization}}), "llamacpp", out=tmp_path, timeout=600)
    d = Path(result.run_dir)
    assert result.ok, (result.summary.failures, (d / "engine.log").read_text(errors="replace")[-2000:])
    s = result.summary.serving
    assert (s.completed, s.failed) == (8, 0), s  # (validity also judges the client's timing: not this test's)
    reqs = [r for r in read_jsonl(d / "rank-00000.jsonl") if r["type"] == "request"]
    assert all(r["output_tokens"] == r["requested_output_tokens"] for r in reqs)
    gguf = json.loads((d / "gguf.json").read_text())
    # every 2-D weight but ffn_down, whose rows (intermediate size 176) do not split into 32-value blocks
    assert gguf["type"] == quantization and gguf["tensor_types"] == {qtype: 14, "F16": 2, "F32": 5}, gguf


def test_a_serving_example_runs_from_any_folder_with_a_relative_out(env, checkpoint, tmp_path):
    """The README's serving example with a relative --out, from another working folder: the engine starts in the run
    folder, so every path the adapter hands it is absolute (a relative settings path failed every such run)."""
    example = Path(__file__).resolve().parent.parent / "examples" / "serve-compare.toml"
    small = ["serve.requests=2", "serve.warmup_requests=0", "serve.arrival.process=closed",
             "serve.arrival.concurrency=1", "serve.output_len.mean=4"]
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "run", str(example), "--adapter", "llamacpp",
                          "--out", "runs", *(a for s in small for a in ("--set", s))], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"
    engine = json.loads((run_dir / "engine.json").read_text())
    assert all(Path(p).is_absolute() for p in engine["command"][2:] if p.endswith(".json"))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _streamed_usage(url: str, body: dict) -> dict | None:
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    usage = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                usage = json.loads(line[5:]).get("usage") or usage
    return usage


def _wait(url: str, path: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} answered no {path} within 300 s")


def test_greedy_outputs_agree_with_the_reference_server(env, checkpoint, tmp_path):
    """The same 24 prompts, greedy, to llama.cpp and to the reference server (transformers serve): both produce what
    transformers' own greedy decoding produces, token for token, but at near-ties. llama.cpp's token count is what
    it reports for a plain response, and the stream-usage shim reports the same count for the streamed one."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from llmadapt.host import free_port
    from llmadapt.launch.environments import process_env, python_for
    from llmadapt.reference.serve import HFServer
    from llmadapt.runtime.requests import plan_requests
    from llmadapt_llamacpp.server import LlamaCppServer

    if environments_unready("hf"):
        pytest.skip(environments_unready("hf"))
    n = 12
    w = workload(serve={"requests": 24, "warmup_requests": 0, "ignore_eos": False})
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    plan = plan_requests(w, tok)
    answers: dict[str, list[tuple[str, int]]] = {}
    for name, cls, ready in (("hf", HFServer, "/health"), ("llamacpp", LlamaCppServer, "/v1/models")):
        spec = adapters()[name].environment
        (tmp_path / name).mkdir()
        server = cls(ServeContext(w, name, tmp_path / name, python_for(spec), checkpoint, free_port(),
                                  process_env(spec)))
        server.start()
        try:
            _wait(server.ctx.base_url, ready)
            answers[name] = []
            for request in plan:
                body = {**server.payload(request)[1], "stream": False, "max_tokens": n}
                body.pop("stream_options")
                reply = _post(server.ctx.base_url, body)
                count = reply["usage"]["completion_tokens"]
                if name == "llamacpp":
                    assert _streamed_usage(server.ctx.base_url, body)["completion_tokens"] == count
                answers[name].append((reply["choices"][0]["text"].replace("\ufffd", ""), count))
        finally:
            server.stop()

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    exact = {"hf": 0, "llamacpp": 0}
    for i, request in enumerate(plan):
        longest = max(answers[k][i][1] for k in answers)
        ids, generated, margins = list(request.prompt_token_ids), [], []
        with torch.no_grad():
            for _ in range(longest + 1):
                top = torch.topk(model(torch.tensor([ids + generated])).logits[0, -1], 2)
                margins.append(float(top.values[0] - top.values[1]))
                if int(top.indices[0]) == eos:
                    break
                generated.append(int(top.indices[0]))
        for name in answers:
            text, count = answers[name][i]
            expected = tok.decode(generated[:count]).replace("\ufffd", "")
            if text == expected:
                exact[name] += 1
                continue
            first = next(j for j in range(len(generated) + 1)
                         if not text.startswith(tok.decode(generated[:j + 1]).replace("\ufffd", ""))
                         or j == len(generated))
            assert margins[first] < NEAR_TIE, (name, i, first, margins[first], text, expected)
    assert exact["llamacpp"] >= len(plan) - 2 and exact["hf"] >= len(plan) - 2, exact
    # at most max_tokens: llama-cpp-python alone runs past it on unfinished UTF-8 (9 of 64 here), the max-tokens fix
    assert all(count <= n for name in answers for _, count in answers[name])
