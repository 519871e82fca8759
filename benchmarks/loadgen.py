"""The load generator's own limits, against a minimal local streaming server (tests/fake_openai.py).

    python benchmarks/loadgen.py [--rate 200] [--requests 2000] [--json]

1. Send lag at a fixed open-loop rate (Poisson): p50/p99/max of actual - scheduled send time.
2. Sustained request rate: a closed loop with many requests in flight against a server that
   answers at once; requests/s the generator completes.
If vLLM's environment is built (`llmadapt env create vllm`), `vllm bench serve` is run against
the same server with the same request count for the side-by-side figure.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llmadapt

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_openai.py"), str(port), *args])
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def serve(url: str, **serve) -> llmadapt.Workload:
    return llmadapt.Workload.from_dict({"kind": "serve", "model": {"preset": "tiny-llama"}, "serve": {
        "url": url, "warmup_requests": 10, "input_len": {"mean": 16}, "output_len": {"mean": 4},
        "scrape_interval_s": 5.0, **serve}})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    proc, url = start_server()
    out = Path(tempfile.mkdtemp(prefix="llmadapt-loadgen-"))
    try:
        lag = llmadapt.run(serve(url, requests=args.requests, arrival={"process": "poisson", "rate": args.rate}),
                           "openai", out=out).summary.serving
        closed = llmadapt.run(serve(url, requests=args.requests,
                                    arrival={"process": "closed", "concurrency": args.concurrency}),
                              "openai", out=out).summary.serving
    finally:
        proc.kill()
    result = {
        "open_loop": {"rate_asked": args.rate, "requests": lag.completed, "achieved_req_s": lag.request_throughput,
                      "send_lag_p50_ms": lag.send_lag_ms.p50, "send_lag_p99_ms": lag.send_lag_ms.p99,
                      "send_lag_max_ms": lag.send_lag_ms.max, "valid": lag.valid},
        "closed_loop": {"concurrency": args.concurrency, "requests": closed.completed,
                        "sustained_req_s": closed.request_throughput},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    o, c = result["open_loop"], result["closed_loop"]
    print(f"open loop, Poisson {o['rate_asked']:g} req/s, {o['requests']} requests: achieved "
          f"{o['achieved_req_s']:.1f} req/s; send lag p50 {o['send_lag_p50_ms']:.3f} ms, p99 "
          f"{o['send_lag_p99_ms']:.3f} ms, max {o['send_lag_max_ms']:.3f} ms; valid: {o['valid']}")
    print(f"closed loop, {c['concurrency']} in flight, {c['requests']} requests: {c['sustained_req_s']:.1f} req/s")


if __name__ == "__main__":
    main()
