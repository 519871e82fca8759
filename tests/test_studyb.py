"""Study B's empirical model: Eq. 1 (max batch), Eq. 2 (throughput vs batch), the cost of a fine-tuning job."""

import json
import math
import subprocess
import sys

import pytest

from llmadapt import LlmadaptError, Workload
from llmadapt.analysis.perf import studyb
from llmadapt.contract.jsonl import read_jsonl


def cli(*args):
    return subprocess.run([sys.executable, "-m", "llmadapt.cli", *map(str, args)], capture_output=True, text=True,
                          check=False)


@pytest.fixture(autouse=True)
def isolated_state(tmp_path_factory, monkeypatch):
    """No user catalog or calibration of this machine leaks in: a fresh state folder (no workers run here)."""
    monkeypatch.setenv("LLMADAPT_HOME", str(tmp_path_factory.mktemp("state")))
    monkeypatch.delenv("LLMADAPT_DEVICES", raising=False)


def test_eq2_fit_reproduces_seeds():
    """Least squares with C3 = 1.8 on the ten reference points gives seeds.md's C4, C2 and RMSE."""
    fit = studyb.fit_throughput(studyb.REFERENCE_POINTS, 1.8)
    assert round(fit.coefficients["C4"], 4) == 0.3169
    assert round(fit.coefficients["C2"], 4) == 0.2808
    assert round(fit.rmse, 4) == 0.0547
    assert (round(fit.coefficients["C4"], 2), round(fit.coefficients["C2"], 2), round(fit.rmse, 2)) == (0.32, 0.28, 0.05)
    assert fit.fixed == {"C3": 1.8} and len(fit.points) == 10
    # each point is predicted with its own sparsity: the dense points use sparsity 1
    dense = fit.points[0]
    assert dense.predicted == pytest.approx(studyb.throughput(1, 1.0, fit.coefficients["C4"], fit.coefficients["C2"], 1.8))


def test_c3_enters_only_as_c2_over_c3():
    """Doubling C3 doubles the fitted C2 and leaves every prediction unchanged: C3 cannot be fitted with C2."""
    a = studyb.fit_throughput(studyb.REFERENCE_POINTS, 1.8)
    b = studyb.fit_throughput(studyb.REFERENCE_POINTS, 3.6)
    assert b.coefficients["C2"] == pytest.approx(2 * a.coefficients["C2"])
    assert [p.predicted for p in b.points] == pytest.approx([p.predicted for p in a.points])


def test_table_iv_costs():
    """15,000 queries x 10 epochs at Table IV's rounded throughputs and prices give its costs.

    The table's throughputs are rounded to 0.01 queries/s: each cost must lie within what those
    roundings allow (plus the table's own rounding to $0.1).
    """
    for gpu, _, _, q, price, table in studyb.TABLE_IV:
        lo = studyb.cost(15000, 10, q + 0.005, price)
        hi = studyb.cost(15000, 10, q - 0.005, price)
        assert lo - 0.05 <= table <= hi + 0.05, (gpu, lo, hi, table)
    assert round(studyb.cost(15000, 10, 2.74, 1.67), 1) == 25.4
    assert round(studyb.cost(15000, 10, 4.90, 2.10), 1) == 17.9
    assert studyb.cost(15000, 10, 1.01, 0.79) == pytest.approx(15000 * 10 / 1.01 / 3600 * 0.79)


def test_eq1_authors_projections():
    """C0 = 62, C1 = 0.89, 23.35 GB, seq 512, sparsity 0.25: 6.06, 8.98, 20.63 -> floor 6/8/20; the authors' ~9/~21 round."""
    a = studyb.AUTHORS_EQ1
    args = (a["model_mem_gb"], a["seq_len"], a["sparsity"], a["C0"], a["C1"])
    assert [studyb.max_batch(m, *args) for m in (40, 48, 80)] == [6, 8, 20]
    assert [studyb.max_batch(m, *args, rounding="round") for m in (40, 48, 80)] == [6, 9, 21]
    assert studyb.eq1_continuous(48, *args) == pytest.approx(8.98, abs=0.005)


def test_eq1_fit_recovers_synthetic_coefficients():
    """Points made by Eq. 1 itself (two sparsities, three memory sizes) are fitted back exactly."""
    truth = dict(c0=62.0, c1=0.89)
    points = [{"gpu_mem_gb": m, "seq_len": 512, "sparsity": s,
               "max_batch": studyb.max_batch(m, 23.35, 512, s, **truth)}
              for m in (40, 48, 80, 141) for s in (0.25, 1.0)]
    fit = studyb.fit_max_batch(points, model_mem_gb=23.35)
    assert "C1" in fit.coefficients and fit.fixed == {"model_mem_gb": 23.35}
    assert all(p.predicted == p.measured for p in fit.points), fit.points
    assert fit.coefficients["C1"] == pytest.approx(0.89, abs=0.05)
    # one sparsity: C1 given; model memory fitted from several memory sizes
    one = [p for p in points if p["sparsity"] == 0.25]
    fit2 = studyb.fit_max_batch(one, c1=0.89)
    assert set(fit2.coefficients) == {"C0", "model_mem_gb"}
    assert all(abs(p.predicted - p.measured) <= 1 for p in fit2.points)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: studyb.fit_throughput([(1, 0.25, 0.3), (2, 0.25, 0.6)]), "too few points to fit Eq. 2"),
    (lambda: studyb.fit_throughput([(2, 0.25, 0.3), (2, 0.25, 0.6), (2, 0.25, 0.5)]), "2 different batch sizes"),
    (lambda: studyb.fit_max_batch([{"gpu_mem_gb": 48, "max_batch": 4, "seq_len": 512, "sparsity": 0.25}], c1=0.89,
                                  model_mem_gb=23.35), "too few points to fit Eq. 1"),
    (lambda: studyb.fit_max_batch([{"gpu_mem_gb": 48, "max_batch": 4, "seq_len": 512, "sparsity": 0.25},
                                   {"gpu_mem_gb": 80, "max_batch": 9, "seq_len": 512, "sparsity": 0.25}],
                                  c1=0.89), "too few points to fit Eq. 1: 2 point"),
    (lambda: studyb.fit_max_batch([{"gpu_mem_gb": 48, "max_batch": 4, "seq_len": 512, "sparsity": 0.25},
                                   {"gpu_mem_gb": 80, "max_batch": 9, "seq_len": 512, "sparsity": 0.25}],
                                  model_mem_gb=23.35), "C1 cannot be fitted from one sparsity"),
    (lambda: studyb.fit_max_batch([{"gpu_mem_gb": 48, "max_batch": 4, "seq_len": 512, "sparsity": 0.25}] * 3,
                                  c1=0.89), "needs the model memory"),
])
def test_bad_fits_are_one_clear_error(call, message):
    with pytest.raises(LlmadaptError, match=message):
        call()


def _fake_run(root, name, workload: Workload, samples_per_s: float):
    d = root / name
    d.mkdir()
    (d / "launch.json").write_text(json.dumps({"workload": workload.to_dict()}))
    stats = {"count": 3, "mean": samples_per_s, "std": 0.0, "min": samples_per_s, "p50": samples_per_s,
             "p90": samples_per_s, "p95": samples_per_s, "p99": samples_per_s, "max": samples_per_s}
    (d / "summary.json").write_text(json.dumps({"status": "ok", "samples_per_s": stats}))
    return d


def test_fit_from_measured_runs_and_cost_from_the_fit(tmp_path):
    """A batch sweep of (MoE) runs feeds Eq. 2: batch = global batch, sparsity = top-k / experts, queries/s = samples/s."""
    base = Workload.from_dict({"kind": "finetune", "model": {"preset": "tiny-mixtral"}})
    runs = []
    for b in (1, 2, 4, 8):
        q = studyb.throughput(b, 0.5, 0.3, 0.25, 1.8)
        runs.append(_fake_run(tmp_path, f"b{b}", base.with_overrides([f"train.global_batch={b}"]), q))
    assert studyb.throughput_points_from_runs(runs)[0] == (1.0, 0.5, pytest.approx(0.3))
    record = tmp_path / "fits.jsonl"
    out = cli("studyb", "fit-throughput", *runs, "--c3", "1.8", "--json", "--record", record)
    assert out.returncode == 0, out.stderr
    fit = json.loads(out.stdout)
    assert fit["coefficients"]["C4"] == pytest.approx(0.3) and fit["coefficients"]["C2"] == pytest.approx(0.25)
    assert fit["rmse"] == pytest.approx(0.0, abs=1e-9)
    assert read_jsonl(record)[0]["model"] == "studyb-eq2"  # a valid contract record
    cost = cli("studyb", "cost", "--queries", 15000, "--epochs", 10, "--fit", record, "--batch", 4, "--sparsity", 0.5,
               "--device", "A40", "--json")
    assert cost.returncode == 0, cost.stderr
    data = json.loads(cost.stdout)
    assert data["queries_per_s"] == pytest.approx(studyb.throughput(4, 0.5, 0.3, 0.25, 1.8))
    assert data["cost"] == pytest.approx(15000 * 10 / data["queries_per_s"] / 3600 * 0.79)
    assert "Study B" in data["price_source"]


def test_cli_reproduce_and_csv_data(tmp_path):
    out = cli("studyb", "reproduce")
    assert out.returncode == 0, out.stderr
    assert "C4 = 0.3169, C2 = 0.2808, RMSE = 0.0547" in out.stdout
    data = tmp_path / "sweep.csv"
    data.write_text("batch,sparsity,throughput\n" + "\n".join(f"{b},{s},{q}" for b, s, q in studyb.REFERENCE_POINTS))
    fit = json.loads(cli("studyb", "fit-throughput", data, "--json").stdout)
    assert round(fit["rmse"], 4) == 0.0547
    csv_out = tmp_path / "points.csv"
    assert cli("studyb", "fit-throughput", "--reference", "--csv", csv_out).returncode == 0
    assert len(csv_out.read_text().strip().splitlines()) == 11


@pytest.mark.parametrize(("args", "message"), [
    (["fit-throughput", "--reference", "--c3", "0"], "error: C3 must be positive"),
    (["fit-maxbatch"], "error: a sweep with too few points to fit Eq. 1"),
    (["cost", "--queries", "100", "--throughput", "1", "--device", "nope"], "error: unknown device 'nope'"),
    (["cost", "--queries", "100", "--throughput", "1", "--device", "RTX4090"], "error: device 'RTX4090' has no price"),
])
def test_cli_bad_input_one_line(args, message):
    out = cli("studyb", *args)
    assert out.returncode == 2, out
    assert out.stderr.startswith(message), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_reference_throughput_is_monotone_and_log_shaped():
    fit = studyb.fit_throughput(studyb.REFERENCE_POINTS)
    c = {**fit.coefficients, **fit.fixed}
    values = [studyb.throughput(b, 0.25, c["C4"], c["C2"], c["C3"]) for b in range(1, 9)]
    gains = [b - a for a, b in zip(values, values[1:])]
    assert all(g > 0 for g in gains) and all(x > y for x, y in zip(gains, gains[1:]))  # diminishing returns
    assert math.isclose(values[0], c["C4"])
