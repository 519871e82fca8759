"""Max batch search: grow then bisect, each probe a real run in its own worker; OOM is real on CPU under a cap."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt import LlmadaptError, Workload
from llmadapt.analysis.perf.maxbatch import read_maxbatch
from llmadapt.experiments.maxbatch import maxbatch
from llmadapt.analysis.perf.studyb import fit_max_batch, maxbatch_points
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.perf import Probe

ROOT = Path(__file__).resolve().parents[1]
TINY = Workload.from_file(ROOT / "examples" / "tiny-llama.toml")


def cli(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], capture_output=True, text=True,
                          check=False, env={**os.environ, **(env or {})})


def stub(limit: int | None, crash_at: int | None = None, calls: list | None = None):
    """A probe that fits up to ``limit`` and runs out of memory above it (``crash_at``: fails another way)."""

    def probe(w: Workload, b: int, where: Path) -> Probe:
        if calls is not None:
            calls.append(b)
        assert w.micro_batch == b and w.per_rank_batch == b
        outcome = "error" if b == crash_at else ("fits" if limit is not None and b <= limit else "oom")
        return Probe(batch=b, outcome=outcome, run_dir="", message=None if outcome == "fits" else f"{outcome} at {b}",
                     steps_completed=2 if outcome == "fits" else 0, peak_memory_bytes=None, step_time_s=None,
                     samples_per_s=None, memory_limit_bytes=1 << 30, memory_limit_kind="RLIMIT_AS", seconds=0.0)

    return probe


def test_grows_then_bisects(tmp_path):
    calls: list[int] = []
    r = maxbatch(TINY, memory_limit_bytes=1 << 30, out=tmp_path, probe=stub(13, calls=calls))
    assert calls == [1, 2, 4, 8, 16, 12, 14, 13]
    assert r.ok and (r.result.max_batch, r.result.first_failing) == (13, 14)
    assert r.result.message.startswith("max batch 13 per rank under a 1.00 GiB per-worker cap (RLIMIT_AS)")
    records = read_jsonl(r.search_dir / "probes.jsonl")  # contract records, validated
    assert [x["type"] for x in records] == ["probe"] * 8 + ["maxbatch"]
    assert read_maxbatch(r.search_dir).result == r.result


def test_a_profiled_workload_is_probed_unprofiled_and_says_so(tmp_path):
    """profile.steps names a step the probes' two steps do not have: the probes run with profiling off (a cost of
    its own), and the search says so."""
    profiled = TINY.with_overrides(["profile.steps=[5]", "profile.level=operator"])
    seen: list[Workload] = []
    said: list[str] = []

    def probe(w, b, where):
        seen.append(w)
        return stub(4)(w, b, where)

    r = maxbatch(profiled, memory_limit_bytes=1 << 30, out=tmp_path, probe=probe, log=said.append)
    assert r.result.max_batch == 4 and all(w.profile.steps == () for w in seen)
    assert any("probes run unprofiled (profile.steps [5] left out)" in line for line in said)


def test_limit_reached_and_start(tmp_path):
    calls: list[int] = []
    r = maxbatch(TINY, memory_limit_bytes=1 << 30, start=3, max_batch=20, out=tmp_path, probe=stub(None or 10**6,
                                                                                                   calls=calls))
    assert calls == [3, 6, 12, 20] and r.result.max_batch == 20 and r.result.first_failing is None
    assert "every probe up to --max-batch 20 fitted" in r.result.message


def test_start_above_the_limit_bisects_down(tmp_path):
    r = maxbatch(TINY, memory_limit_bytes=1 << 30, start=16, out=tmp_path, probe=stub(5))
    assert r.result.max_batch == 5 and r.result.first_failing == 6


def test_does_not_fit_at_batch_1(tmp_path):
    r = maxbatch(TINY, memory_limit_bytes=1 << 30, out=tmp_path, probe=stub(None))
    assert not r.ok and r.result.max_batch is None
    assert "does not fit at batch 1 under a 1.00 GiB per-worker cap" in r.result.message


def test_a_crash_is_not_counted_as_out_of_memory(tmp_path):
    r = maxbatch(TINY, memory_limit_bytes=1 << 30, out=tmp_path, probe=stub(100, crash_at=8))
    assert not r.ok and r.result.max_batch == 4 and r.result.first_failing is None
    assert "probe at batch 8 failed for a reason other than memory (error: error at 8)" in r.result.message


def test_bad_input(tmp_path):
    with pytest.raises(LlmadaptError, match="need 1 <= --start"):
        maxbatch(TINY, start=4, max_batch=2, out=tmp_path, probe=stub(1))
    serve = Workload.from_dict({"kind": "serve"})
    with pytest.raises(LlmadaptError, match="a serve workload has none"):
        maxbatch(serve, out=tmp_path)
    out = cli("maxbatch", ROOT / "examples" / "tiny-llama.toml", "--out", tmp_path / "runs",
              env={"LLMADAPT_DEVICE": "cpu"})
    assert out.returncode == 2 and out.stderr.startswith("error: no GPU visible: on CPU, maxbatch needs "
                                                         "--memory-limit SIZE")
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()
    out = cli("maxbatch", ROOT / "examples" / "tiny-llama.toml", "--adapter", "nope", "--memory-limit", "2G")
    assert out.returncode == 2 and out.stderr.startswith("error: unknown adapter 'nope'")


# -- real probes ------------------------------------------------------------------------------------
# A 32,768-token vocabulary over 2,048 positions (flash attention, so the logits dominate): the fp32 logits,
# their log-softmax and gradients take about 1 GiB per sample (measured here: 1,419 MiB peak RSS at batch
# 1, 2,471 MiB at batch 2), far above the noise in a worker's address space. Measured thresholds of the
# address-space cap: batch 1 fits under 1.95G; batch 2 fails under 2.9G and fits under 3.2G. 2.4G sits
# between with about 0.5 GiB of margin either side.
LONG = TINY.with_overrides(["model.max_position_embeddings=2048", "train.seq_len=2048", "model.vocab_size=32768",
                            "optimizations.flash_attention=true"])
CAP = "2.4G"
CAP_BYTES = int(2.4 * 2**30)


def test_real_probes_fit_then_run_out_of_memory(tmp_path):
    """Batch 1 completes its steps under the cap; batch 2 fails out of memory for real (RLIMIT_AS)."""
    wfile = tmp_path / "long.json"
    wfile.write_text(json.dumps(LONG.to_dict()))
    out = cli("maxbatch", wfile, "--memory-limit", CAP, "--max-batch", "2", "--steps", "1", "--out", tmp_path / "runs",
              "--json", "--csv", tmp_path / "probes.csv")
    data = json.loads(out.stdout)
    probes = data["probes"]
    assert [p["batch"] for p in probes] == [1, 2], probes
    assert probes[0]["outcome"] == "fits" and probes[0]["steps_completed"] == 1
    assert probes[1]["outcome"] == "oom", probes[1]
    assert out.returncode == 0 and data["result"]["max_batch"] == 1 and data["result"]["first_failing"] == 2
    assert all(p["memory_limit_kind"] == "RLIMIT_AS" and p["memory_limit_bytes"] == CAP_BYTES for p in probes)
    launch = json.loads((Path(probes[1]["run_dir"]) / "launch.json").read_text())
    assert launch["memory_limit_bytes"] == CAP_BYTES  # the trace says a cap was used
    assert len((tmp_path / "probes.csv").read_text().strip().splitlines()) == 3
    # the result is an Eq. 1 point: the cap is the memory, in GB
    point = maxbatch_points([data["search_dir"]])[0]
    assert point == {"gpu_mem_gb": CAP_BYTES / 1e9, "max_batch": 1.0, "seq_len": 2048.0, "sparsity": 1.0}
    fit = fit_max_batch([point, {**point, "gpu_mem_gb": 5.0, "max_batch": 4.0}], c1=0.5, model_mem_gb=1.0)
    assert fit.coefficients["C0"] > 0 and fit.points[0].predicted == 1


def test_real_probe_error_is_reported_as_such(tmp_path):
    """A probe that fails with an exception (injected) stops the search and is not counted as out of memory."""
    w = TINY.with_overrides(["train.seq_len=32"])
    r = maxbatch(w, memory_limit_bytes=8 << 30, steps=1, out=tmp_path, fault={"kind": "error", "step": 0})
    assert not r.ok and r.probes[0].outcome == "error"
    assert "failed for a reason other than memory (error: RuntimeError: injected error at step 0" in r.result.message
