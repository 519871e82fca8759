"""Serving at several loads against one engine: load sweeps and the SLA search (llmadapt.experiments.loadsweep).

The search's logic is checked against simulated engines with known capacity (a smooth latency curve, a cliff, a
noisy answer, nothing passing), then everything runs for real against the reference server (`hf`) and vLLM.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from llmadapt import Workload, adapters
from llmadapt.cli.common import attach_settings
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.errors import LlmadaptError
from llmadapt.experiments import loadsweep
from llmadapt.experiments.loadsweep import Objective, isotonic_decreasing, parse_loads, sla_search
from llmadapt.testing import environments_unready

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# -- input --------------------------------------------------------------------------------------------------------
def test_objectives_parse_and_bad_ones_are_one_line():
    o = Objective.parse("ttft_p99_ms<=500")
    assert (o.metric, o.quantile, o.limit_ms, o.name) == ("ttft", "p99", 500.0, "ttft_p99_ms")
    assert str(Objective.parse(" tpot_mean_ms <= 12.5 ")) == "tpot_mean_ms<=12.5"
    for text, message in [("ttft_p99<=5", "write METRIC_QUANTILE_ms<=LIMIT"), ("queue_p99_ms<=5", "unknown metric"),
                          ("ttft_p95_ms<=5", "unknown quantile"), ("ttft_p99_ms<=0", "positive number"),
                          ("ttft_p99_ms<=1e999", "positive number")]:
        with pytest.raises(LlmadaptError, match=message) as caught:
            Objective.parse(text)
        assert "\n" not in str(caught.value)


def test_loads_parse_and_bad_ones_are_one_line():
    assert parse_loads("1,2,4", "rate").values == [1.0, 2.0, 4.0]
    g = parse_loads("geometric:2:1.5:20", "rate")
    assert (g.values, g.factor, g.maximum) == ([2.0], 1.5, 20.0)
    for text, kind, message in [("", "rate", "is empty"), ("2,1", "rate", "must increase"), ("1,1", "rate", "must increase"),
                                ("0,1", "rate", "> 0"), ("a,b", "rate", "comma-separated"),
                                ("1.5,2", "concurrency", "whole numbers"), ("geometric:1:1", "rate", "FACTOR > 1"),
                                ("geometric:x", "rate", "write geometric")]:
        with pytest.raises(LlmadaptError, match=message):
            parse_loads(text, kind)


def test_attach_names_only_adapters_in_the_comparison():
    assert attach_settings("hf=http://a:1,vllm=http://b:2", ["hf", "vllm"]) == [
        "hf:serve.url=http://a:1", "vllm:serve.url=http://b:2"]
    with pytest.raises(LlmadaptError, match="not among the adapters compared"):
        attach_settings("tgi=http://a:1", ["hf", "vllm"])
    with pytest.raises(LlmadaptError, match="write ADAPTER=URL"):
        attach_settings("http://a:1", ["hf"])


def test_cli_refuses_bad_input_before_anything_starts(tmp_path):
    serve = str(EXAMPLES / "serve-tiny.toml")
    cases = [
        (["sla", serve, "--adapters", "hf", "--slo", "latency_p99_ms<=5"], "unknown metric"),
        (["sla", serve, "--adapters", "hf"], "give at least one objective"),
        (["load-sweep", serve, "--adapters", "hf", "--rates", "4,2"], "must increase"),
        (["load-sweep", serve, "--adapters", "hf", "--rates", ""], "is empty"),
        (["load-sweep", serve, "--adapters", "hf"], "give the loads"),
        (["load-sweep", serve, "--adapters", "hf", "--rates", "1", "--attach", "vllm=http://x:1"], "not among"),
        (["load-sweep", str(EXAMPLES / "tiny-llama.toml"), "--adapters", "torch", "--rates", "1"], "not 'serve'"),
        (["sla", serve, "--adapters", "hf", "--slo", "ttft_p99_ms<=5", "--over", "concurrency", "--start", "1.5"],
         "whole numbers"),
        # serve-tiny sends 24 requests a point: 32 users in a closed loop are the same load as 24
        (["load-sweep", serve, "--adapters", "hf", "--concurrencies", "8,32"], "the same load as 24"),
        (["sla", serve, "--adapters", "hf", "--slo", "ttft_p99_ms<=5", "--over", "concurrency", "--start", "32"],
         "the same load as 24"),
    ]
    for argv, message in cases:
        out = subprocess.run([sys.executable, "-m", "llmadapt.cli", *argv, "--out", str(tmp_path / "runs")],
                             capture_output=True, text=True)
        assert out.returncode == 2 and message in out.stderr, (argv, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


# -- the search, against simulated engines -------------------------------------------------------------------------
def test_isotonic_fit_pools_violators():
    assert isotonic_decreasing([1, 2, 3, 4], [0.5, 0.7, -0.1, -0.3]) == pytest.approx([0.6, 0.6, -0.1, -0.3])
    assert isotonic_decreasing([3, 1, 2], [-1.0, 1.0, 0.0]) == [-1.0, 1.0, 0.0]  # any order of probes
    assert isotonic_decreasing([1, 1, 2], [0.2, -0.2, 0.4]) == pytest.approx([0.4 / 3] * 3)


@attrs.frozen
class _Simulated:
    load: float
    repeat: int


def _simulate(monkeypatch, ttft_ms):
    """Replace the engine: each point's TTFT p99 is ttft_ms(load, repeat)."""
    def run_points(workload, info, out, engine_dir, timeout, progress, choose):
        done, ran = [], []
        while (pick := choose(done)) is not None:
            done.append(_Simulated(pick[0].value, pick[1]))
            ran.append((pick[0], pick[1], done[-1]))
        return ran

    monkeypatch.setattr(loadsweep, "_run_points", run_points)
    monkeypatch.setattr(loadsweep, "point_figures", lambda r: {
        "status": "ok", "failed": 0, "valid": True, "ttft_p99_ms": ttft_ms(r.load, r.repeat), "run_dir": ""})


class _Info:
    name = "sim"


def _search(tmp_path, kind="rate", workload=None, **options):
    options = {"start": 1.0, "maximum": 1024.0, **options}
    folder, result = sla_search(workload or Workload(kind="serve"), _Info(), [Objective.parse("ttft_p99_ms<=730")],
                                kind, tmp_path, **options)
    history = json.loads((folder / "sla.json").read_text())
    assert len(history["probes"]) == len(result.probes)  # the history holds every probe, in order
    return result


def test_a_smooth_boundary_is_bracketed_within_the_resolution_in_fewer_probes_than_a_scan(monkeypatch, tmp_path):
    _simulate(monkeypatch, lambda load, repeat: 100 * load)  # capacity 7.3 req/s
    r = _search(tmp_path)
    assert r.capacity < 7.3 <= r.above and r.above / r.capacity - 1 <= 0.1
    assert r.passes_at_capacity == "2/2" and r.shape == "smooth" and r.note == ""
    assert r.boundary == pytest.approx(7.3, rel=0.1)
    assert [p.phase for p in r.probes][:4] == ["probe"] * 4 and r.probes[-1].phase == "repeat"
    assert len(r.probes) < r.scan_probes / 2


def test_a_cliff_is_called_one(monkeypatch, tmp_path):
    _simulate(monkeypatch, lambda load, repeat: 100 if load < 7.3 else 5000)
    r = _search(tmp_path)
    assert r.capacity < 7.3 <= r.above and r.shape == "cliff"


def test_a_repeat_that_fails_moves_the_answer_down(monkeypatch, tmp_path):
    first = {}

    def noisy(load, repeat):  # the first answer fails when repeated: it is not the capacity after all
        if repeat > 0 and "load" not in first:
            first["load"] = load
            return 1000
        return 100 * load

    _simulate(monkeypatch, noisy)
    r = _search(tmp_path)
    assert r.capacity < first["load"] <= r.above and r.passes_at_capacity == "2/2"
    assert all(p.passed for p in r.probes if p.load == r.capacity)


def test_concurrency_is_searched_in_whole_numbers_and_the_maximum_ends_an_all_passing_search(monkeypatch, tmp_path):
    _simulate(monkeypatch, lambda load, repeat: 100 * load)
    r = _search(tmp_path, kind="concurrency", maximum=64.0)
    assert (r.capacity, r.above) == (7.0, 8.0) and all(p.load == int(p.load) for p in r.probes)
    assert r.scan_probes == 8 + 1
    r = _search(tmp_path, kind="concurrency", maximum=4.0)
    assert (r.capacity, r.above, r.passes_at_capacity) == (4.0, None, "2/2")


def test_a_concurrency_search_stops_at_a_probes_request_count(monkeypatch, tmp_path):
    """12 requests a probe: 16 or 64 users in a closed loop are the same load as 12 (all in flight at once), so the
    search goes no higher and says so, instead of telling apart noise between 13 and 14."""
    _simulate(monkeypatch, lambda load, repeat: 100)
    w = Workload(kind="serve").with_overrides(["serve.requests=12"])
    r = _search(tmp_path, kind="concurrency", maximum=64.0, workload=w)
    assert (r.capacity, r.above, r.passes_at_capacity) == (12.0, None, "2/2")
    assert max(p.load for p in r.probes) == 12 and "all 12 requests of a probe in flight at once" in r.note
    r = _search(tmp_path / "below", kind="concurrency", maximum=8.0, workload=w)  # a maximum below it is kept
    assert (r.capacity, r.above, r.note) == (8.0, None, "")


def test_nothing_passing_says_so(monkeypatch, tmp_path):
    _simulate(monkeypatch, lambda load, repeat: 10_000)
    r = _search(tmp_path, start=4.0)
    assert r.capacity is None and "no load" in r.note and min(p.load for p in r.probes) >= 0.5


def test_a_search_whose_first_probe_is_invalid_says_why_and_what_to_change(monkeypatch, tmp_path):
    """A first probe whose load generator fell behind measured the client, not the engine: the search stops there
    and its note says so and what to change, instead of halving into "no load tried meets the objectives"."""
    _simulate(monkeypatch, lambda load, repeat: 100)
    behind = "invalid: the client's event loop stalled (loop lag p99 40.0 ms, max 90 ms > 10 ms)"
    monkeypatch.setattr(loadsweep, "point_figures", lambda r: {
        "status": "ok", "failed": 0, "valid": False, "validity": behind, "ttft_p99_ms": 100, "run_dir": ""})
    r = _search(tmp_path, kind="concurrency", maximum=8.0)
    assert r.capacity is None and len(r.probes) == 1
    assert r.note.startswith("no capacity found because the first probe (concurrency 1) is invalid, not failed: "
                             "the load generator fell behind (" + behind + ")")
    assert "serve.send_spin_ms=0" in r.note and "docs/serving.md" in r.note


def test_an_interrupted_sla_search_resumes_from_its_probes(monkeypatch, tmp_path):
    """The same search run again with the same out replays the probes that ended (not run again) and goes on from
    them to the answer an uninterrupted search finds; another workload's interrupted search is left as it is."""
    from llmadapt.errors import Terminated

    capacity = lambda load, repeat: 100 * load  # noqa: E731
    _simulate(monkeypatch, capacity)
    whole = _search(tmp_path / "whole")
    ran: list[tuple[float, int]] = []
    simulated = loadsweep._run_points

    def stopped_at_the_sixth(workload, info, out, engine_dir, timeout, progress, choose):
        done = []
        while (pick := choose(done)) is not None:
            if len(done) == 5:
                raise Terminated("terminated by SIGTERM")
            ran.append((pick[0].value, pick[1]))
            done.append(_Simulated(pick[0].value, pick[1]))
        return []

    monkeypatch.setattr(loadsweep, "_run_points", stopped_at_the_sixth)
    with pytest.raises(Terminated):
        _search(tmp_path / "runs")
    (path,) = (tmp_path / "runs").glob("*-sim-sla-*/sla.json")
    assert json.loads(path.read_text())["state"] == "interrupted" and len(json.loads(path.read_text())["probes"]) == 5

    def counting(workload, info, out, engine_dir, timeout, progress, choose):
        done = simulated(workload, info, out, engine_dir, timeout, progress, choose)
        ran.extend((load.value, repeat) for load, repeat, _ in done)
        return done

    monkeypatch.setattr(loadsweep, "_run_points", counting)
    notes: list[str] = []
    other = sla_search(Workload(kind="serve").with_overrides(["serve.requests=7"]), _Info(), [Objective.parse("ttft_p99_ms<=730")], "rate",
                       tmp_path / "runs", start=1.0, maximum=1024.0, progress=lambda r: notes.append(r["text"]))[0]
    assert other != path.parent and notes == [f"{path}: an interrupted sla of another workload: left as it is"]
    del ran[5:]
    resumed = _search(tmp_path / "runs")
    assert [(p.load, p.repeat) for p in resumed.probes] == [(p.load, p.repeat) for p in whole.probes]
    assert ran == [(p.load, p.repeat) for p in whole.probes]  # each probe ran once: the first five before, the rest now
    assert (resumed.capacity, resumed.above, resumed.passes_at_capacity) == (whole.capacity, whole.above, "2/2")
    final = json.loads(path.read_text())
    assert final["state"] == "finished" and len(final["probes"]) == len(whole.probes)


def _cmd_load_sweep(monkeypatch, tmp_path, figures: list[dict], capsys) -> tuple[int, str]:
    """`load-sweep` over simulated points with these figures: (exit code, what it printed)."""
    import argparse

    from llmadapt.cli import serving as cli_serving

    loads = [loadsweep.Load("rate", float(2**i)) for i in range(len(figures))]
    points = [loadsweep.SweepPoint(load, 0, {"status": "ok", "failed": 0, "valid": True, **f})
              for load, f in zip(loads, figures)]
    monkeypatch.setattr(cli_serving, "_engines", lambda args: [(_Info(), Workload(kind="serve"))])
    monkeypatch.setattr(loadsweep, "load_sweep", lambda *a, **k: (tmp_path, points))
    args = argparse.Namespace(rates=",".join(str(2**i) for i in range(len(figures))), concurrencies=None, repeat=1,
                              out=tmp_path, timeout=None, json=False, pareto="e2el_p99")
    code = cli_serving.cmd_load_sweep(args)
    return code, capsys.readouterr().out


def test_a_sweep_reports_each_point_and_fails_only_without_a_valid_one(monkeypatch, tmp_path, capsys):
    """Points with failed or truncated requests are results, reported in their row (exit 0); a point that failed or
    whose client fell behind has none (exit 1); every point behind says what that means and what to do."""
    code, out = _cmd_load_sweep(monkeypatch, tmp_path, [{}, {"status": "degraded", "failed": 2, "truncated": 1}],
                                capsys)
    assert code == 0 and "2 failed (1 truncated)" in out and "no valid result" not in out
    behind = {"valid": False, "validity": "invalid: the generator fell behind its schedule"}
    code, out = _cmd_load_sweep(monkeypatch, tmp_path, [behind, behind], capsys)
    assert code == 1
    assert "every point: client behind (exit 1): this machine could not run the load generator on time" in out
    assert "2 of 2 points have no valid result (exit 1)" in out
    code, out = _cmd_load_sweep(monkeypatch, tmp_path, [{}, {"status": "failed"}], capsys)
    assert code == 1 and "FAILED" in out and "1 of 2 points have no valid result (exit 1)" in out


MANAGED = """
import subprocess, sys, time, socket
from urllib.parse import urlsplit
from llmadapt.contract.rundir import RunDir
from llmadapt_openai.server import OpenAIServer
import llmadapt.launch.serve

def start(self):  # a managed engine (the fake), with its pid file, as the real adapters write it
    port = urlsplit(self.ctx.base_url).port
    self.proc = subprocess.Popen([sys.executable, FAKE, str(port), "--first-ms", "20", "--token-ms", "5"],
                                 start_new_session=True)
    RunDir(self.ctx.run_dir).engine_pid.write_text(str(self.proc.pid))
    while self.proc.poll() is None:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
        except OSError:
            time.sleep(0.05)

def stop(self):
    self.proc.terminate()
    self.proc.wait()

OpenAIServer.start, OpenAIServer.stop = start, stop
OpenAIServer.alive = lambda self: self.proc.poll() is None
llmadapt.launch.serve.check_reachable = lambda workload: None  # serve.url's server is started by the run, after
from llmadapt.cli import main
main(sys.argv[1:])
"""


def test_sigterm_mid_sweep_leaves_a_readable_partial_result_and_no_pid_file_and_resumes(tmp_path):
    """load-sweep.json is written as each point ends: SIGTERM mid-sweep leaves the points that ended, marked as
    interrupted, and the engine's pid file goes with the engine. A sweep of another workload in the same --out
    leaves it as it is; the same command again resumes it: only the loads missing run."""
    import os
    import signal
    import time

    from llmadapt.host import free_port
    from llmadapt.testing import interruptible

    pytest.importorskip("llmadapt_openai")
    script = tmp_path / "managed.py"
    script.write_text(f"FAKE = {str(Path(__file__).parent / 'fake_openai.py')!r}\n" + MANAGED)
    w = Workload.from_dict({"kind": "serve", "model": {"preset": "tiny-llama"}, "serve": {
        "url": f"http://127.0.0.1:{free_port()}", "requests": 8, "warmup_requests": 0, "input_len": {"mean": 8},
        "output_len": {"mean": 4}, "request_timeout_s": 10.0, "scrape_interval_s": 0.2}})
    path = tmp_path / "w.json"
    path.write_text(json.dumps(w.to_dict()))
    command = [sys.executable, str(script), "load-sweep", str(path), "--adapters", "openai", "--concurrencies",
               "1,2,3,4,5,6,7,8", "--out", str(tmp_path / "runs")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)
    sweep = None
    for _ in range(1200):  # until two points have ended (a hang guard, not a timing)
        sweep = next((tmp_path / "runs").glob("*-load-sweep-*/load-sweep.json"), None)
        if sweep and len(json.loads(sweep.read_text())["points"]) >= 2:
            break
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, err.decode()[-2000:]
    data = json.loads(sweep.read_text())
    assert data["state"] == "interrupted" and "SIGTERM" in data["note"]
    assert len(data["points"]) >= 2 and all(p["status"] == "ok" for p in data["points"])
    assert not (sweep.parent / "engine.pid").exists()
    assert not os.path.exists(sweep.parent / "load-sweep.tmp")
    assert f"what ended is in {sweep}; run the same command again (same --out) to resume it" in err.decode()

    other = subprocess.run([*command[:-4], "--concurrencies", "1", *command[-2:], "--set", "serve.requests=5"],
                           capture_output=True, text=True, timeout=300)
    assert other.returncode in (0, 1) and "FAILED" not in other.stdout, other.stderr[-2000:]  # 1: client behind
    assert f"{sweep}: an interrupted load-sweep of another workload: left as it is" in other.stderr
    assert json.loads(sweep.read_text()) == data and len(list(sweep.parent.parent.glob("*-load-sweep-*"))) == 2

    kept = {p["load"]: p["run_dir"] for p in data["points"]}
    runs = set((tmp_path / "runs").glob("*/launch.json"))
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode in (0, 1) and "FAILED" not in again.stdout, again.stderr[-2000:]
    assert f"resuming {sweep}: {len(kept)} point(s) that ended there are kept, not run again" in again.stderr
    done = json.loads(sweep.read_text())
    assert done["state"] == "finished" and [p["load"] for p in done["points"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert all(p["run_dir"] == kept[p["load"]] for p in done["points"] if p["load"] in kept)
    assert len(set((tmp_path / "runs").glob("*/launch.json")) - runs) == 8 - len(kept)  # only the missing loads ran


# -- for real -------------------------------------------------------------------------------------------------------
def _ready(adapter: str) -> None:
    if adapter not in adapters():
        pytest.skip(f"the {adapter} adapter is not installed")
    if environments_unready(adapter):
        pytest.skip(environments_unready(adapter))


def _cli(*argv, cwd=None) -> tuple[int, str, str]:
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", *argv], capture_output=True, text=True, cwd=cwd,
                         timeout=1200)
    return out.returncode, out.stdout, out.stderr


SMALL = ["serve.requests=6", "serve.warmup_requests=1", "serve.output_len.mean=8", "serve.input_len.low=8",
         "serve.input_len.high=24"]


def _check_sweep(out: Path, stdout: str, adapter: str, loads: list[float]) -> list[dict]:
    """The sweep's file and its points: each a run folder of its own that `show` reads, each load with a request
    stream of its own."""
    from llmadapt.analysis.report import read_summary

    (sweep,) = json.loads(stdout)
    assert sweep["adapter"] == adapter and [p["load"] for p in sweep["points"]] == loads
    on_disk = json.loads((Path(sweep["folder"]) / "load-sweep.json").read_text())
    assert [p["run_dir"] for p in on_disk["points"]] == [p["run_dir"] for p in sweep["points"]]
    streams = set()
    for p in sweep["points"]:
        summary = read_summary(p["run_dir"])
        assert summary["status"] == "ok" and summary["serving"]["completed"] == 6
        launch = json.loads((Path(p["run_dir"]) / "launch.json").read_text())
        streams.add(launch["workload"]["serve"]["stream"])
        assert p["ttft_p99_ms"] > 0 and p["send_lag_p99_ms"] is not None
    assert len(streams) == len(loads) and 0 not in streams
    return sweep["points"]


def _check_search(out: Path, stdout: str, adapter: str) -> dict:
    (r,) = json.loads(stdout)
    assert r["adapter"] == adapter and r["kind"] == "concurrency"
    history = json.loads((Path(r["folder"]) / "sla.json").read_text())
    assert history["probes"] == r["probes"] and r["probes"][0]["load"] == 1
    for p in r["probes"]:
        assert Path(p["figures"]["run_dir"]).is_dir() and p["passed"] == (p["margin"] >= 0)
    if r["capacity"] is None and "the first probe (" in (r.get("note") or ""):
        # a machine too busy to deliver even the first load: the search says so, and why, instead of a capacity
        assert len(r["probes"]) == 1 and "fell behind" in r["note"], r["note"]
        return r
    if r["capacity"] is not None:
        at = [p for p in r["probes"] if p["load"] == r["capacity"]]
        assert len(at) == 2 and all(p["passed"] for p in at)  # --repeats 2
    if r["above"] is not None:
        assert any(not p["passed"] for p in r["probes"] if p["load"] == r["above"])
        assert r["capacity"] is None or r["above"] - r["capacity"] == 1
    else:
        assert r["capacity"] == 6 and "all 6 requests of a probe in flight at once" in r["note"]  # SMALL's 6
    return r


@pytest.mark.parametrize("adapter, model", [
    ("hf", ["serve.engine.max_batched_tokens=1024"]),
    ("vllm", ["model.hidden_size=128", "serve.engine.max_sequences=4", "serve.engine.max_batched_tokens=512"])])
def test_a_rate_sweep_and_an_sla_search_for_real(adapter, model, tmp_path):
    """Against each real engine, started once per sweep or search with engine arguments passed through: two rates,
    then the highest concurrency that keeps TTFT p99 under 2 s (whatever this busy machine gives, the search's
    answer must be consistent with its own probes)."""
    _ready(adapter)
    if adapter == "vllm":
        from llmadapt_vllm.server import environment_problem

        from llmadapt.launch.environments import python_for

        why, _ = environment_problem(python_for(adapters()["vllm"].environment))
        if why:
            pytest.skip(why)
    out = tmp_path / "runs"
    sets = [a for s in [*SMALL, *model] for a in ("--set", s)]
    code, stdout, stderr = _cli("load-sweep", str(EXAMPLES / "serve-tiny.toml"), "--adapters", adapter,
                                "--rates", "2,6", "--out", str(out), "--json", *sets)
    assert code in (0, 1), stderr  # 1: a point whose generator fell behind on this busy machine (checked below)
    points = _check_sweep(out, stdout, adapter, [2.0, 6.0])
    assert points[1]["request_throughput"] > points[0]["request_throughput"]
    header = next(r for r in read_jsonl(Path(points[0]["run_dir"]) / "rank-00000.jsonl") if r["type"] == "header")
    engine = header["workload"]["serve"]["engine"]
    assert engine["max_batched_tokens"] == (1024 if adapter == "hf" else 512)
    if adapter == "vllm":  # the flags the engine was started with
        command = json.loads((Path(json.loads(stdout)[0]["folder"]) / "engine.json").read_text())["command"]
        assert " --max-num-seqs 4 " in f" {' '.join(command)} " and "--max-num-batched-tokens" in command
    code, stdout, stderr = _cli("sla", str(EXAMPLES / "serve-tiny.toml"), "--adapters", adapter, "--over",
                                "concurrency", "--max", "8", "--slo", "ttft_p99_ms<=2000", "--out", str(out),
                                "--json", *sets)
    assert code in (0, 1), stderr
    _check_search(out, stdout, adapter)
    # every point is a run the store lists
    code, listing, _ = _cli("runs", "--root", str(out), f"adapter={adapter}", "--json")
    assert code == 0 and len(json.loads(listing)) >= 3


def _wait_healthy(url: str, seconds: float = 300) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} did not become healthy in {seconds:g} s")


def test_two_running_engines_attached_in_one_comparison(tmp_path):
    """Two reference servers started outside llmadapt, measured by one `compare` with the same request plan: the
    hf adapter attached to one, the generic OpenAI-compatible adapter to the other, back to back."""
    from llmadapt.adapter.context import ServeContext
    from llmadapt.host import free_port
    from llmadapt.launch.environments import python_for
    from llmadapt.launch.prepare import ensure_checkpoint
    from llmadapt.reference.serve import HFServer

    _ready("hf")
    w = Workload.from_file(EXAMPLES / "serve-tiny.toml").with_overrides(SMALL)
    env = adapters()["hf"].environment
    checkpoint = ensure_checkpoint(w, env)
    engines = []
    try:
        for name in ("one", "two"):
            (tmp_path / name).mkdir()
            engine = HFServer(ServeContext(w, "hf", tmp_path / name, python_for(env), checkpoint, free_port()))
            engine.start()
            engines.append(engine)
        urls = [e.ctx.base_url for e in engines]
        for url in urls:  # running, as an engine one attaches to is
            _wait_healthy(url)
        # the hf adapter knows the name the engine answers to (this machine's canonical checkpoint); the generic
        # adapter is told it (model.path), since transformers serve's /v1/models lists the hub cache instead
        code, stdout, stderr = _cli("compare", str(EXAMPLES / "serve-tiny.toml"), "--adapters", "hf,openai",
                                    "--attach", f"hf={urls[0]},openai={urls[1]}", "--out", str(tmp_path / "runs"),
                                    "--json", "--set", f"openai:model.path={checkpoint}",
                                    *[a for s in SMALL for a in ("--set", s)])
        assert code == 0, stderr
        rows = json.loads(stdout)["rows"]
        assert [r["status"] for r in rows] == ["ok", "ok"]
        plans = []
        for r in rows:
            launch = json.loads((Path(r["run_dir"]) / "launch.json").read_text())
            assert launch["launcher"] == "attach"
            plans.append(sorted((q["index"], q["input_tokens"]) for q in read_jsonl(Path(r["run_dir"]) /
                                                                                "rank-00000.jsonl")
                                if q["type"] == "request"))  # written as they end: in each engine's own order
        assert plans[0] == plans[1] and len(plans[0]) == 7  # the same requests, warm-up included
        assert {launch["workload"]["serve"]["url"] for launch in [json.loads((Path(r["run_dir"]) / "launch.json")
                                                                           .read_text()) for r in rows]} == set(urls)
    finally:
        for e in engines:
            e.stop()


def test_engine_arguments_are_checked_against_what_the_adapter_declares():
    from llmadapt.adapter.plugins import check_supported
    from llmadapt.errors import UnsupportedError, WorkloadError

    w = Workload.from_file(EXAMPLES / "serve-tiny.toml")
    check_supported(adapters()["hf"], w.with_overrides(["serve.engine.max_batched_tokens=512"]))
    with pytest.raises(UnsupportedError, match="serve.engine.scheduling='priority': this adapter takes "
                                               "serve.engine.max_batched_tokens"):
        check_supported(adapters()["hf"], w.with_overrides(["serve.engine.scheduling=priority"]))
    with pytest.raises(WorkloadError, match="an attached engine"):
        w.with_overrides(["serve.url=http://127.0.0.1:1", "serve.engine.max_sequences=4"])
    with pytest.raises(WorkloadError, match="serve.engine.scheduling"):
        w.with_overrides(["serve.engine.scheduling=lifo"])
    assert w.content_hash == w.with_overrides(["serve.engine.scheduling=fcfs"]).content_hash  # defaults: unhashed
    if "vllm" in adapters():
        with pytest.raises(UnsupportedError, match="supported: none, fp8, bitsandbytes"):
            check_supported(adapters()["vllm"], w.with_overrides(["model.hidden_size=128",
                                                                   "serve.engine.quantization=awq"]))


@pytest.mark.parametrize("adapter, model", [("hf", []), ("vllm", ["model.hidden_size=128"])])
def test_offline_throughput_beside_the_online_numbers(adapter, model, tmp_path):
    """serve.mode = 'offline': the same request plan handed at once to the engine's offline API (transformers'
    generate, vLLM's LLM.generate), in one comparison with the online run: every requested token generated; with
    each request's times too: TTFT from the call and TPOT (transformers: every token's time; vLLM: its request
    stats, the first and last token's)."""
    _ready(adapter)
    if adapter == "vllm":
        from llmadapt_vllm.server import environment_problem

        from llmadapt.launch.environments import python_for

        why, _ = environment_problem(python_for(adapters()["vllm"].environment))
        if why:
            pytest.skip(why)
    sets = [a for s in [*SMALL, *model] for a in ("--set", s)]
    cells = ["--cell", adapter, "--cell", f"{adapter}:serve.mode=offline"] if adapter == "hf" else \
        ["--cell", f"{adapter}:serve.mode=offline"]
    code, stdout, stderr = _cli("compare", str(EXAMPLES / "serve-tiny.toml"), *cells, "--out", str(tmp_path),
                                "--json", *sets)
    assert code == 0, stderr
    rows = json.loads(stdout)["rows"]
    offline = rows[-1]
    assert offline["status"] == "ok" and offline["metrics"]["output_throughput"] > 0
    records = [r for r in read_jsonl(Path(offline["run_dir"]) / "rank-00000.jsonl") if r["type"] == "request"]
    assert len(records) == 6 and all(r["output_tokens"] == r["requested_output_tokens"] for r in records)
    if adapter == "hf":  # generate's streamer times each step: a request's tokens, from the call to the last
        for r in records:
            assert len(r["chunk_ns"]) == r["output_tokens"], r
            assert r["sent_ns"] < r["first_token_ns"] == r["chunk_ns"][0] <= r["chunk_ns"][-1] == r["end_ns"], r
        assert offline["metrics"]["ttft_p50_ms"] > 0 and offline["metrics"]["tpot_p50_ms"] > 0
    else:  # LLM.generate's request stats: when each request's first and last tokens came, not every token's
        for r in records:
            assert r["chunk_ns"] == [] and r["sent_ns"] < r["first_token_ns"] < r["end_ns"], r
        assert offline["metrics"]["ttft_p50_ms"] > 0 and offline["metrics"]["tpot_p50_ms"] > 0
    header = next(r for r in read_jsonl(Path(offline["run_dir"]) / "rank-00000.jsonl") if r["type"] == "header")
    assert header["launcher"] == "offline" and header["workload"]["serve"]["mode"] == "offline"
    if adapter == "hf":
        assert rows[0]["metrics"]["ttft_p50_ms"] > 0  # the online row beside it


def test_offline_is_refused_where_there_is_no_offline_api(tmp_path):
    from llmadapt.adapter.plugins import check_supported
    from llmadapt.errors import UnsupportedError, WorkloadError

    w = Workload.from_file(EXAMPLES / "serve-tiny.toml").with_overrides(["serve.mode=offline"])
    if "openai" in adapters():
        with pytest.raises(UnsupportedError, match="no offline API"):
            check_supported(adapters()["openai"], w)
    with pytest.raises(WorkloadError, match="not with serve.url"):
        w.with_overrides(["serve.url=http://127.0.0.1:1"])


def test_a_serving_comparison_repeats_in_rounds_with_intervals_over_runs(tmp_path):
    """compare --repeat on a serving cell: every run a fresh engine, the row's figures medians over its runs with
    their intervals; a count (failed requests) is a median too, printed as one (it once stopped the table with a
    ValueError: a float given the integer format)."""
    _ready("hf")
    sets = [a for s in SMALL for a in ("--set", s)]
    code, stdout, stderr = _cli("compare", str(EXAMPLES / "serve-tiny.toml"), "--cell", "hf", "--repeat", "2",
                                "--out", str(tmp_path), "--json", *sets)
    assert code == 0, stderr[-2000:]
    data = json.loads(stdout)
    (row,) = data["rows"]
    assert row["status"] == "ok" and len(row["run_dirs"]) == 2 and len(set(row["run_dirs"])) == 2
    assert row["metrics"]["failed"] == 0 and row["metrics"]["ttft_p50_ms"] > 0
    for key in ("output_throughput", "ttft_p50_ms", "tpot_p50_ms"):
        e = row["estimates"][key]
        assert (e["what"], e["n"]) == ("runs", 2) and e["low"] <= e["median"] <= e["high"], (key, e)


def test_a_count_over_repeated_runs_prints_as_a_count():
    from llmadapt.analysis.comparison import format_value

    assert [format_value(v, "d") for v in (3, 3.0, 2.5, None)] == ["3", "3", "2.5", "-"]


# -- engine configurations and the throughput-latency frontier ------------------------------------------------------
def test_the_frontier_is_the_points_no_other_beats_on_both():
    from llmadapt.analysis.pareto import on_frontier

    points = [(10.0, 100.0), (20.0, 150.0), (15.0, 90.0), (20.0, 150.0), (30.0, 140.0), (None, 500.0), (5.0, None),
              (10.0, 100.0)]
    # (15, 90) is beaten by (10, 100); (30, 140) by (20, 150); equal points do not beat each other; a point
    # without a figure is never on it
    assert on_frontier(points) == [True, True, False, True, False, False, False, True]
    assert on_frontier([]) == [] and on_frontier([(1.0, 1.0)]) == [True]


def test_the_stream_prefix_share_counts_tokens_that_repeat_an_earlier_prompt():
    from llmadapt.adapter.context import PlannedRequest
    from llmadapt.runtime.loadgen import prefix_share

    def req(i: int, ids: list[int], warmup: bool = False) -> PlannedRequest:
        return PlannedRequest(index=i, warmup=warmup, offset_s=0.0, prompt="", prompt_token_ids=ids,
                              input_tokens=len(ids), output_tokens=1, ignore_eos=True, api="completions")

    plan = [req(0, [1, 2, 3, 4], warmup=True),  # earlier, not measured
            req(1, [1, 2, 3, 9, 9]),  # 3 of 5 repeat the warm-up's start
            req(2, [1, 2, 3, 9, 9, 7]),  # 5 of 6 repeat request 1's
            req(3, [8, 1, 2])]  # starts differently: none (a repeat inside a prompt is not a prefix)
    assert prefix_share(plan) == pytest.approx((3 + 5 + 0) / (5 + 6 + 3))
    assert prefix_share(plan[:1]) is None  # no measured request


def test_engine_matrix_and_pareto_mistakes_are_one_line_before_any_engine_starts(tmp_path):
    out = tmp_path / "runs"
    for argv, message in (
            (["--engine-matrix", "serve.requests=2,4"], "--engine-matrix 'serve.requests': only engine settings vary "
                                                        "here"),
            (["--engine-matrix", "serve.engine.max_sequences=2,4"], "adapter 'hf' cannot run "
                                                                    "serve.engine.max_sequences=2"),
            (["--engine-matrix", "serve.engine.max_batched_tokens"], "--matrix 'serve.engine.max_batched_tokens': use "
                                                                     "path=v1,v2"),
            (["--pareto", "e2el_p95"], "--pareto 'e2el_p95': a latency percentile")):
        code, _, stderr = _cli("load-sweep", str(EXAMPLES / "serve-tiny.toml"), "--adapters", "hf", "--rates", "2",
                               "--out", str(out), *argv)
        assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr
    assert not out.exists()


def test_an_engine_configuration_sweep_marks_its_frontier(tmp_path):
    """Two settings of the reference server's batch size in tokens, each an engine started fresh and measured at two
    rates: each configuration its points, the frontier marked as the figures say, in the table and the JSON."""
    from llmadapt.analysis.pareto import on_frontier

    _ready("hf")
    out = tmp_path / "runs"
    sets = [a for s in SMALL for a in ("--set", s)]
    argv = ["load-sweep", str(EXAMPLES / "serve-tiny.toml"), "--adapters", "hf", "--rates", "2,6",
            "--engine-matrix", "serve.engine.max_batched_tokens=64,1024", "--pareto", "ttft_p99", "--out", str(out),
            *sets]
    code, stdout, stderr = _cli(*argv, "--json")
    assert code in (0, 1), stderr  # 1: a point whose generator fell behind on this busy machine
    configs = json.loads(stdout)
    assert [c["config"] for c in configs] == ["hf max_batched_tokens=64", "hf max_batched_tokens=1024"]
    assert [c["engine"] for c in configs] == [{"max_batched_tokens": 64}, {"max_batched_tokens": 1024}]
    assert len({c["folder"] for c in configs}) == 2  # an engine of its own each
    points = [p for c in configs for p in c["points"]]
    assert [p["load"] for p in points] == [2.0, 6.0, 2.0, 6.0]
    for c in configs:  # each point ran on its configuration's engine
        for p in c["points"]:
            header = next(r for r in read_jsonl(Path(p["run_dir"]) / "rank-00000.jsonl") if r["type"] == "header")
            assert header["workload"]["serve"]["engine"]["max_batched_tokens"] == c["engine"]["max_batched_tokens"]
    usable = [p["status"] == "ok" and p["valid"] and not p["failed"] for p in points]
    expected = on_frontier([(p["ttft_p99_ms"], p["output_throughput"]) if ok else (None, None)
                            for p, ok in zip(points, usable)])
    assert [p["frontier"] for p in points] == expected and any(expected) == any(usable)
    # the table of the same points: its frontier marks and the line naming them
    from llmadapt.cli.serving import sweep_text

    lines = sweep_text(configs, "ttft_p99_ms").splitlines()
    rows = [line for line in lines if line.startswith("hf max_batched_tokens=")]
    assert [row.split()[-2] == "*" for row in rows] == expected
    front = next(line for line in lines if line.startswith("frontier (*): output tok/s against ttft p99 ms"))
    assert front.count(" at ") == sum(expected)


def test_prefix_caching_on_and_off_on_vllm_beside_the_streams_shared_prefixes(tmp_path):
    """A shared-prefix stream (2 prefixes of 160 words, 4 suffixes each) against vLLM with its prefix cache on and
    off, each engine started fresh: the summary sets the engine's own hit share (its counters over the run) beside
    the share of prompt tokens the stream repeats; off, the engine counts nothing."""
    _ready("vllm")
    from llmadapt_vllm.server import environment_problem

    from llmadapt.analysis.report import read_summary, render_summary
    from llmadapt.launch.environments import python_for

    why, _ = environment_problem(python_for(adapters()["vllm"].environment))
    if why:
        pytest.skip(why)
    sets = ["model.hidden_size=128", "serve.requests=8", "serve.warmup_requests=0", "serve.output_len.mean=4",
            "serve.source.kind=shared_prefix", "serve.source.prefixes=2", "serve.source.suffixes=4",
            "serve.source.prefix_len=160", "serve.source.suffix_len=16"]
    code, stdout, stderr = _cli("load-sweep", str(EXAMPLES / "serve-tiny.toml"), "--adapters", "vllm", "--rates", "4",
                                "--engine-matrix", "serve.engine.prefix_caching=true,false", "--out",
                                str(tmp_path / "runs"), "--json", *[a for s in sets for a in ("--set", s)])
    assert code in (0, 1), stderr
    on, off = json.loads(stdout)
    assert (on["config"], off["config"]) == ("vllm prefix_caching=true", "vllm prefix_caching=false")
    for config, flag in ((on, "--enable-prefix-caching"), (off, "--no-enable-prefix-caching")):
        command = json.loads((Path(config["folder"]) / "engine.json").read_text())["command"]
        assert flag in command
    s_on, s_off = (read_summary(c["points"][0]["run_dir"]) for c in (on, off))
    shared = s_on["serving"]["stream_prefix_share"]
    assert shared == s_off["serving"]["stream_prefix_share"]  # the same stream
    assert 0.5 < shared < 3 / 4  # 3 of each 4 prompts repeat a prefix; their suffixes never
    hits = s_on["serving"]["engine_prefix_cache_hit_share"]
    samples = [r["values"] for r in read_jsonl(Path(on["points"][0]["run_dir"]) / "rank-00000.jsonl")
               if r["type"] == "server_sample"]

    def counter(values: dict, name: str) -> float:
        return sum(v for k, v in values.items() if k.startswith(name + "{"))

    found, looked = ((counter(samples[-1], n) - counter(samples[0], n))
                     for n in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"))
    # the first sample is taken before the first request: the lookups are every measured prompt token
    assert looked == s_on["serving"]["total_input_tokens"]
    assert hits == pytest.approx(found / looked) and 0 < hits <= shared  # whole KV blocks only
    assert s_off["serving"]["engine_prefix_cache_hit_share"] is None
    assert f"the engine's prefix cache found {hits:.1%}" in render_summary(s_on)
