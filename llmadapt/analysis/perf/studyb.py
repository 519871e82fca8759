"""Study B's empirical model (arXiv 2408.04693): max batch size (Eq. 1), throughput vs batch (Eq. 2), cost.

- Eq. 1: ``MaxBSZ = floor(C0 * (GPU_mem - model_mem) / (seq_len * ((1 - C1) + C1 * sparsity)))``,
  memories in GB (1e9 bytes), as the authors' coefficients (C0 = 62, C1 = 0.89 for Mixtral) assume.
- Eq. 2: ``throughput = C4 + C2 * ln(batch ** (1 / (sparsity * C3)))`` queries/s; C3 is the MoE
  attenuation coefficient (1.8 Mixtral, 2.5 BlackMamba), held fixed: it enters only as C2 / C3,
  so C2 and C3 cannot both be fitted. C4 and C2 are linear least squares.
- Cost: ``queries * epochs / throughput / 3600 * price per GPU-hour``.

Points come from measured runs (samples/s is queries/s; batch = global batch; sparsity =
experts_per_token / num_experts, 1.0 for dense models), from ``llmadapt maxbatch`` results,
or from supplied data (CSV or JSON). Pure Python.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Iterable

from llmadapt.contract.perf import Fit, FitPoint
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, not_a_file

GB = 1e9


MOE_ATTENUATION = {"mixtral": 1.8, "blackmamba": 2.5}


# Seeds: Mixtral on commonsense_15k, A40 (batch, sparsity, queries/s); the fit to reproduce.
REFERENCE_POINTS = [(1, 1.0, 0.3214), (2, 1.0, 0.5139), (1, 0.25, 0.3413), (2, 0.25, 0.6567), (3, 0.25, 0.9264),
                    (4, 0.25, 1.1348), (5, 0.25, 1.3063), (6, 0.25, 1.4602), (7, 0.25, 1.5789), (8, 0.25, 1.6552)]


REFERENCE_FIT = {"C4": 0.3169, "C2": 0.2808, "rmse": 0.0547, "C3": 1.8}


# The authors' Eq. 1 coefficients for Mixtral and their projections (~6 at 40 GB, ~9 at 48 GB, ~21 at 80 GB).
AUTHORS_EQ1 = {"C0": 62.0, "C1": 0.89, "model_mem_gb": 23.35, "seq_len": 512, "sparsity": 0.25}


# Table IV: Mixtral sparse, 10 epochs, ~15K queries: (GPU, memory GB, max batch, queries/s, $/h, cost $).
TABLE_IV = [("A40", 48, 4, 1.01, 0.79, 32.7), ("A100-80GB", 80, 17, 2.74, 1.67, 25.4),
            ("H100-SXM", 80, 17, 4.90, 2.10, 17.9)]


# -- the equations --------------------------------------------------------------------------------
def eq1_continuous(gpu_mem_gb: float, model_mem_gb: float, seq_len: float, sparsity: float, c0: float,
                   c1: float) -> float:
    return c0 * (gpu_mem_gb - model_mem_gb) / (seq_len * ((1 - c1) + c1 * sparsity))


def max_batch(gpu_mem_gb: float, model_mem_gb: float, seq_len: float, sparsity: float, c0: float, c1: float,
              rounding: str = "floor") -> int:
    """Eq. 1. ``rounding='floor'`` as written; ``'round'`` reproduces the authors' quoted ~9 (48 GB) and ~21 (80 GB)."""
    x = eq1_continuous(gpu_mem_gb, model_mem_gb, seq_len, sparsity, c0, c1)
    if rounding == "floor":
        return max(0, math.floor(x))
    if rounding == "round":
        return max(0, math.floor(x + 0.5))
    raise LlmadaptError(f"rounding {rounding!r}: use floor or round")


def throughput(batch: float, sparsity: float, c4: float, c2: float, c3: float) -> float:
    """Eq. 2, queries/s."""
    return c4 + c2 * math.log(batch ** (1.0 / (sparsity * c3)))


def cost(queries: float, epochs: float, queries_per_s: float, price_per_hour: float) -> float:
    """Cost of a fine-tuning job: hours of GPU time x price per GPU-hour."""
    if queries_per_s <= 0:
        raise LlmadaptError(f"throughput must be positive, got {queries_per_s}")
    return queries * epochs / queries_per_s / 3600 * price_per_hour


# -- fitting --------------------------------------------------------------------------------------
def fit_throughput(points: Iterable[tuple[float, float, float]], c3: float = MOE_ATTENUATION["mixtral"], *,
                   source: str = "supplied data") -> Fit:
    """Least-squares C4 and C2 of Eq. 2 with C3 fixed; RMSE over every point, each with its own sparsity."""
    pts = [(float(b), float(s), float(q)) for b, s, q in points]
    for b, s, q in pts:
        if b < 1 or not 0 < s <= 1 or q <= 0:
            raise LlmadaptError(f"point (batch {b:g}, sparsity {s:g}, throughput {q:g}): need batch >= 1, "
                                "0 < sparsity <= 1, throughput > 0")
    if c3 <= 0:
        raise LlmadaptError(f"C3 must be positive, got {c3}")
    xs = [math.log(b) / (s * c3) for b, s, _ in pts]
    if len(pts) < 3 or len({round(x, 12) for x in xs}) < 2:
        raise LlmadaptError(f"a sweep with too few points to fit Eq. 2: {len(pts)} point(s), "
                            f"{len({b for b, _, _ in pts})} batch size(s); need at least 3 points with 2 different "
                            "batch sizes")
    n = len(pts)
    mx, my = sum(xs) / n, sum(q for _, _, q in pts) / n
    c2 = sum((x - mx) * (q - my) for x, (_, _, q) in zip(xs, pts)) / sum((x - mx) ** 2 for x in xs)
    c4 = my - c2 * mx
    fitted = [FitPoint(label=f"batch {b:g} sparsity {s:g}", x={"batch": b, "sparsity": s}, measured=q,
                       predicted=throughput(b, s, c4, c2, c3)) for b, s, q in pts]
    rmse = math.sqrt(sum((p.predicted - p.measured) ** 2 for p in fitted) / n)
    mape = sum(abs(p.predicted - p.measured) / p.measured for p in fitted) / n
    return Fit(model="studyb-eq2", coefficients={"C4": c4, "C2": c2}, fixed={"C3": c3}, points=fitted, rmse=rmse,
               mape=mape, source=source, unit="queries/s",
               note="throughput = C4 + C2 * ln(batch^(1/(sparsity*C3))); C3 fixed (only C2/C3 is identifiable)")


def fit_max_batch(points: Iterable[dict[str, float]], *, c1: float | None = None, model_mem_gb: float | None = None,
                  source: str = "supplied data") -> Fit:
    """Fit Eq. 1 to measured max batch sizes.

    Each point: ``gpu_mem_gb``, ``max_batch``, ``seq_len``, ``sparsity`` and optionally
    ``model_mem_gb``. Fitted: C0 always; C1 when the points span two or more sparsities and it is
    not given; model memory when it is neither given nor in the points and they span two or
    more memory sizes. Each measured value y stands for the interval [y, y + 1) of the
    continuous equation, so the fit targets y + 0.5.
    """
    pts = [dict(p) for p in points]
    for p in pts:
        for key in ("gpu_mem_gb", "max_batch", "seq_len", "sparsity"):
            if key not in p:
                raise LlmadaptError(f"an Eq. 1 point lacks {key!r}: {p}")
    if len(pts) < 2:
        raise LlmadaptError(f"a sweep with too few points to fit Eq. 1: {len(pts)} point(s); need at least 2")
    fit_c1 = c1 is None and len({p["sparsity"] for p in pts}) >= 2
    fit_mem = model_mem_gb is None and not all("model_mem_gb" in p for p in pts)
    if fit_mem and len({p["gpu_mem_gb"] for p in pts}) < 2:
        raise LlmadaptError("Eq. 1 needs the model memory: give --model-mem GB, or points at 2 or more memory sizes "
                            "(e.g. maxbatch under several --memory-limit caps) so it can be fitted")
    if c1 is None and not fit_c1:
        raise LlmadaptError("Eq. 1's MoE coefficient C1 cannot be fitted from one sparsity: give --c1 "
                            "(the authors' Mixtral value is 0.89; any value for a dense model, sparsity 1)")
    free = 1 + fit_c1 + fit_mem
    if len(pts) < free + 1:
        raise LlmadaptError(f"a sweep with too few points to fit Eq. 1: {len(pts)} point(s) for {free} "
                            f"coefficient(s); need at least {free + 1}")
    if any(p["max_batch"] < 0 for p in pts):
        raise LlmadaptError("max_batch must be >= 0")

    def solve(c1v: float) -> tuple[float, float, float]:
        # target y + 0.5 = C0 * (M - m0) / (s * D): with z = (y + 0.5) * s * D, z = C0 * M - C0 * m0
        zs, ms = [], []
        for p in pts:
            d = p["seq_len"] * ((1 - c1v) + c1v * p["sparsity"])
            zs.append((p["max_batch"] + 0.5) * d)
            ms.append(p["gpu_mem_gb"] - (p.get("model_mem_gb", model_mem_gb or 0.0) if not fit_mem else 0.0))
        n = len(pts)
        if fit_mem:
            mm, mz = sum(ms) / n, sum(zs) / n
            c0 = sum((m - mm) * (z - mz) for m, z in zip(ms, zs)) / sum((m - mm) ** 2 for m in ms)
            m0 = (c0 * mm - mz) / c0 if c0 else 0.0
        else:
            c0, m0 = sum(m * z for m, z in zip(ms, zs)) / sum(m * m for m in ms), 0.0
        err = 0.0
        for p, m in zip(pts, ms):
            d = p["seq_len"] * ((1 - c1v) + c1v * p["sparsity"])
            err += (c0 * (m - m0) / d - (p["max_batch"] + 0.5)) ** 2
        return c0, m0, err

    def evaluate(c1v: float) -> tuple[tuple[int, float], float, float]:
        # least squares gives model memory and a first C0; then C0 moves to where the most floors match
        c0_ls, m0, _ = solve(c1v)
        xs = []
        for p in pts:
            mem0 = m0 if fit_mem else p.get("model_mem_gb", model_mem_gb or 0.0)
            xs.append((p["gpu_mem_gb"] - mem0) / (p["seq_len"] * ((1 - c1v) + c1v * p["sparsity"])))
        ys = [p["max_batch"] for p in pts]
        c0 = _stab(xs, ys, c0_ls)
        matches = sum(math.floor(c0 * x) == y for x, y in zip(xs, ys))
        err = sum((c0 * x - (y + 0.5)) ** 2 for x, y in zip(xs, ys))
        return (-matches, err), c0, m0

    if fit_c1:
        _, c0, m0, c1v = min(evaluate(i / 1000) + (i / 1000,) for i in range(0, 1000))
    else:
        c1v = float(c1)
        _, c0, m0 = evaluate(c1v)
    coefficients = {"C0": c0}
    fixed = {}
    if fit_c1:
        coefficients["C1"] = c1v
    else:
        fixed["C1"] = c1v
    if fit_mem:
        coefficients["model_mem_gb"] = m0
    elif model_mem_gb is not None:
        fixed["model_mem_gb"] = model_mem_gb
    fitted = []
    for p in pts:
        mem0 = m0 if fit_mem else p.get("model_mem_gb", model_mem_gb or 0.0)
        pred = max_batch(p["gpu_mem_gb"], mem0, p["seq_len"], p["sparsity"], c0, c1v)
        fitted.append(FitPoint(label=f"{p['gpu_mem_gb']:g} GB seq {p['seq_len']:g} sparsity {p['sparsity']:g}",
                               x={k: float(v) for k, v in p.items() if isinstance(v, (int, float))},
                               measured=float(p["max_batch"]), predicted=float(pred)))
    n = len(fitted)
    rmse = math.sqrt(sum((f.predicted - f.measured) ** 2 for f in fitted) / n)
    nonzero = [f for f in fitted if f.measured]
    mape = sum(abs(f.predicted - f.measured) / f.measured for f in nonzero) / len(nonzero) if nonzero else None
    exact = sum(f.predicted == f.measured for f in fitted)
    return Fit(model="studyb-eq1", coefficients=coefficients, fixed=fixed, points=fitted, rmse=rmse, mape=mape,
               source=source, unit="samples",
               note=f"MaxBSZ = floor(C0 (GPU_mem - model_mem) / (seq_len ((1 - C1) + C1 sparsity))), GB; "
                    f"{exact}/{n} points predicted exactly")


def _stab(xs: list[float], ys: list[float], guess: float) -> float:
    """The C0 inside the most intervals [y/x, (y+1)/x) (where floor(C0 x) = y), nearest the guess; midpoint of it."""
    bounds = []
    for x, y in zip(xs, ys):
        if x > 0:
            bounds.append((y / x, (y + 1) / x))
    if not bounds:
        return guess
    edges = sorted({b for pair in bounds for b in pair})
    best, best_key = guess, None
    for lo, hi in zip(edges, edges[1:]):
        mid = (lo + hi) / 2
        covered = sum(a <= mid < b for a, b in bounds)
        key = (-covered, abs(mid - guess))
        if best_key is None or key < best_key:
            best, best_key = mid, key
    return best


# -- reading points -------------------------------------------------------------------------------
def read_points(path: str | Path, columns: tuple[str, ...]) -> list[dict[str, float]]:
    """Rows from a CSV (with a header) or JSON (a list of objects, or of lists in ``columns`` order)."""
    path = Path(path)
    if not path.is_file():
        raise LlmadaptError(f"{path}: " + ("is a folder, expected a data file" if path.is_dir() else
                                           "no such data file"))
    text = path.read_text()
    rows: list[dict[str, Any]]
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LlmadaptError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(data, dict) and "points" in data:
            data = data["points"]
        if not isinstance(data, list):
            raise LlmadaptError(f"{path}: expected a list of points")
        rows = [dict(zip(columns, r)) if isinstance(r, (list, tuple)) else dict(r) for r in data]
    else:
        rows = list(csv.DictReader(io.StringIO(text)))
    out = []
    for i, r in enumerate(rows, 1):
        missing = [c for c in columns if c not in r or r[c] in ("", None)]
        if missing:
            raise LlmadaptError(f"{path}: point {i} lacks {missing[0]!r} (columns: {', '.join(columns)})")
        try:
            out.append({k: float(v) for k, v in r.items() if k in columns or _is_number(v)})
        except (TypeError, ValueError):
            raise LlmadaptError(f"{path}: point {i} has a value that is not a number: {r}") from None
    return out


def _is_number(v: Any) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def throughput_points_from_runs(run_dirs: Iterable[str | Path]) -> list[tuple[float, float, float]]:
    """(batch, sparsity, queries/s) of measured runs: global batch, active/total experts, mean samples/s."""

    out = []
    for d in run_dirs:
        d = Path(d)
        summary_p, launch_p = RunDir(d).summary_file, RunDir(d).launch_file
        if not summary_p.is_file() or not launch_p.is_file():
            raise LlmadaptError(f"{d} is not a run directory (no summary.json and launch.json)")
        summary, launch = json.loads(summary_p.read_text()), RunDir(d).read_launch()
        if summary.get("status") != "ok" or not summary.get("samples_per_s"):
            raise LlmadaptError(f"{d}: the run did not complete (status {summary.get('status')})")
        w = launch.require_workload()
        out.append((float(w.train.global_batch), sparsity_of(w.model), float(summary["samples_per_s"]["mean"])))
    return out


def sparsity_of(model) -> float:
    return model.experts_per_token / model.num_experts if model.is_moe else 1.0


def maxbatch_points(dirs: Iterable[str | Path]) -> list[dict[str, float]]:
    """Eq. 1 points from ``llmadapt maxbatch`` results: capacity (cap or device memory) in GB, max batch, seq, sparsity."""
    from llmadapt.contract.jsonl import read_jsonl

    out = []
    for d in dirs:
        path = Path(d) / "probes.jsonl" if Path(d).is_dir() else Path(d)
        if not path.is_file():
            raise LlmadaptError(f"{d} is not a maxbatch result (no probes.jsonl)")
        result = [r for r in read_jsonl(path) if r["type"] == "maxbatch"]
        if not result:
            raise LlmadaptError(f"{d}: the search has no result record (it was interrupted)")
        r = result[-1]
        if r["status"] != "ok" or r["max_batch"] is None:
            raise LlmadaptError(f"{d}: the search failed ({r['message']}); it gives no Eq. 1 point")
        if r.get("capacity_bytes") is None:
            raise LlmadaptError(f"{d}: the memory the search ran against is unknown (no cap, no device memory)")
        out.append({"gpu_mem_gb": r["capacity_bytes"] / GB, "max_batch": float(r["max_batch"]),
                    "seq_len": float(r["seq_len"]), "sparsity": float(r["sparsity"])})
    return out


def reproduce() -> dict[str, Any]:
    """Seeds' reproduction: the Eq. 2 fit, the authors' Eq. 1 projections, and Table IV's costs."""
    fit = fit_throughput(REFERENCE_POINTS, REFERENCE_FIT["C3"], source="Study B's published points (Mixtral, A40)")
    a = AUTHORS_EQ1
    projections = {f"{mem} GB": {r: max_batch(mem, a["model_mem_gb"], a["seq_len"], a["sparsity"], a["C0"], a["C1"], r)
                                 for r in ("floor", "round")}
                   | {"continuous": eq1_continuous(mem, a["model_mem_gb"], a["seq_len"], a["sparsity"], a["C0"],
                                                   a["C1"])}
                   for mem in (40, 48, 80)}
    table = [{"gpu": g, "max_batch": mb, "queries_per_s": q, "price_per_hour": p, "cost": cost(15000, 10, q, p),
              "table_cost": c} for g, _, mb, q, p, c in TABLE_IV]
    return {"eq2_fit": fit, "eq1_projections": projections, "table_iv": table}
