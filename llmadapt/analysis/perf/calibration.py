"""Calibration of the analytical model's efficiency factors: from measured runs (non-negative least
squares, with a prior) or from micro-benchmarks; and validation of the model against held-out runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import attrs

from llmadapt.analysis.perf.estimate import (
    Factors,
    Options,
    calibration_path,
    features,
    load_factors,
    memory,
    step_time,
)
from llmadapt.contract.catalog import DeviceSpec, device_for_reported, find_device, load_catalog
from llmadapt.contract.perf import Fit, FitPoint, Validation, ValidationRow
from llmadapt.contract.rundir import RunDir
from llmadapt.contract.schema import to_json
from llmadapt.errors import LlmadaptError
from llmadapt.spec import Workload


# -- measured runs ----------------------------------------------------------------------------------
@attrs.frozen
class MeasuredRun:
    run_dir: Path
    workload: Workload
    step_s: float
    peak_memory_bytes: int | None
    device_name: str | None
    label: str
    repeats: int = 1


def read_runs(run_dirs: Iterable[str | Path], statistic: str = "p50", best_of_repeats: bool = False) -> list[MeasuredRun]:
    """Measured runs; with ``best_of_repeats``, runs of one workload (same content hash) count once, by the least
    disturbed of them (the lowest statistic): on a shared machine, interference only ever adds time."""
    runs = [read_run(r, statistic) for r in run_dirs]
    if not best_of_repeats:
        return runs
    groups: dict[str, list[MeasuredRun]] = {}
    for r in runs:
        groups.setdefault(r.workload.content_hash, []).append(r)
    out = []
    for group in groups.values():
        best = min(group, key=lambda r: r.step_s)
        out.append(attrs.evolve(best, repeats=len(group),
                                label=best.label + (f" (best of {len(group)})" if len(group) > 1 else "")))
    return out


def read_run(run_dir: str | Path, statistic: str = "p50") -> MeasuredRun:
    run_dir = Path(run_dir)
    summary_path, launch_path = RunDir(run_dir).summary_file, RunDir(run_dir).launch_file
    if not summary_path.is_file() or not launch_path.is_file():
        raise LlmadaptError(f"{run_dir} is not a run directory (no summary.json and launch.json)")
    summary, launch = json.loads(summary_path.read_text()), RunDir(run_dir).read_launch()
    if summary.get("status") != "ok" or not summary.get("step_time_s"):
        raise LlmadaptError(f"{run_dir}: the run did not complete its steps (status {summary.get('status')}): "
                            "only completed runs can calibrate or validate")
    w = launch.require_workload()
    if w.kind == "serve":
        raise LlmadaptError(f"{run_dir}: a serving run; calibration and validation use training runs")
    if statistic not in ("p50", "mean", "min"):
        raise LlmadaptError(f"statistic {statistic!r}: use p50, mean or min")
    device = (summary.get("device") or {}).get("name")
    variant = f"b={w.train.global_batch}/{w.micro_batch} s={w.train.seq_len}"
    if w.optimizations.recompute != "none":
        variant += f" R={w.optimizations.recompute}"
    if w.optimizations.flash_attention:
        variant += " F"
    if w.parallelism.dp > 1:
        variant += f" dp={w.parallelism.dp}"
    if w.precision != "fp32":
        variant += f" {w.precision}"
    return MeasuredRun(run_dir=run_dir, workload=w, step_s=summary["step_time_s"][statistic],
                       peak_memory_bytes=summary.get("peak_memory_bytes"), device_name=device,
                       label=f"{w.model.name} {variant}")


def _resolve_device(runs: list[MeasuredRun], device: str | None, catalog) -> DeviceSpec:
    cat = load_catalog(catalog)
    if device:
        return find_device(device, cat)
    names = {r.device_name for r in runs}
    specs = {n: device_for_reported(n, cat) if n else None for n in names}
    missing = [n for n, s in specs.items() if s is None]
    if missing:
        raise LlmadaptError(f"no catalog device matches the runs' device {missing[0]!r}: pass --device NAME "
                            "(for a CPU: measure it first with `llmadapt micro peak --save NAME`)")
    found = {s.name for s in specs.values()}
    if len(found) > 1:
        raise LlmadaptError(f"the runs ran on different devices ({', '.join(sorted(found))}): validate them separately")
    return next(iter(specs.values()))


# -- least squares, pure Python ---------------------------------------------------------------------
def _solve(a: list[list[float]], y: list[float]) -> list[float] | None:
    """Least squares by the normal equations (small systems), None when singular."""
    n = len(a[0])
    ata = [[sum(r[i] * r[j] for r in a) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * v for r, v in zip(a, y)) for i in range(n)]
    m = [row[:] + [b] for row, b in zip(ata, aty)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[pivot][c]) < 1e-300:
            return None
        m[c], m[pivot] = m[pivot], m[c]
        for r in range(n):
            if r != c:
                factor = m[r][c] / m[c][c]
                m[r] = [x - factor * z for x, z in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(a: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares by trying every active set (a handful of columns)."""
    n = len(a[0])
    best, best_err = [0.0] * n, sum(v * v for v in y)
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sol = _solve([[r[j] for j in cols] for r in a], y)
        if sol is None or any(x < 0 for x in sol):
            continue
        full = [0.0] * n
        for j, x in zip(cols, sol):
            full[j] = x
        err = sum((sum(r[j] * full[j] for j in range(n)) - v) ** 2 for r, v in zip(a, y))
        if err < best_err - 1e-18:
            best, best_err = full, err
    return best


# -- calibration ------------------------------------------------------------------------------------
PRIOR_WEIGHT = 1e-3  # breaks ties the data leave open (e.g. no memory-bound op), pulling toward the defaults


def _fit_factors(rows: list[tuple[list[float], float]], prior: list[float], free: list[bool]) -> list[float]:
    """Weighted (relative-error) NNLS of measured ~ features . theta, with a weak prior on theta."""
    a, y = [], []
    for feats, measured in rows:
        a.append([f / measured for f in feats])
        y.append(1.0)
    for j, (p, is_free) in enumerate(zip(prior, free)):
        row = [0.0] * len(prior)
        if not is_free:
            row[j] = 1e6 / p if p else 1e6
            a.append(row)
            y.append(1e6 if p else 0.0)
        elif p:
            row[j] = PRIOR_WEIGHT / p
            a.append(row)
            y.append(PRIOR_WEIGHT)
    return nnls(a, y)


def _theta_to_factors(theta: list[float], base: Factors, source: str) -> Factors:
    inv = lambda x, old: 1.0 / x if x > 0 else old * 1e3  # noqa: E731 - never used: effectively free
    return attrs.evolve(base, eta_compute=inv(theta[0], base.eta_compute), eta_memory=inv(theta[1], base.eta_memory),
                        op_overhead_s=theta[2], step_overhead_s=theta[3], eta_comm=inv(theta[4], base.eta_comm),
                        source=source)


def _prior(f: Factors) -> list[float]:
    return [1 / f.eta_compute, 1 / f.eta_memory, f.op_overhead_s, f.step_overhead_s or 1e-3, 1 / f.eta_comm]


def calibrate_from_runs(run_dirs: Iterable[str | Path], device: str | None = None, *, statistic: str = "p50",
                        catalog: list[str | Path] | tuple = (), options: Options = Options(),
                        best_of_repeats: bool = False) -> Fit:
    """Fit the efficiency factors to measured step times (relative least squares, factors >= 0)."""
    runs = read_runs(run_dirs, statistic, best_of_repeats)
    if len(runs) < 3:
        raise LlmadaptError(f"too few runs to calibrate: {len(runs)} given, at least 3 needed "
                            "(runs that differ in batch, sequence length or recomputation)")
    spec = _resolve_device(runs, device, catalog)
    factors = Factors.defaults(spec.kind)
    free = [True, True, True, True, any(r.workload.parallelism.dp > 1 for r in runs)]
    for _ in range(25):  # re-assign compute/memory bounds until stable
        rows = []
        for r in runs:
            feats, _ = features(r.workload, spec, factors, options=options)
            rows.append(([feats.compute_s_at_peak, feats.memory_s_at_peak, feats.launches, 1.0, feats.comm_s_at_peak],
                         r.step_s - feats.fixed_s))
        theta = _fit_factors(rows, _prior(Factors.defaults(spec.kind)), free)
        new = _theta_to_factors(theta, factors, "runs")
        if new == factors:
            break
        factors = new
    points = []
    for r in runs:
        pred, _ = step_time(r.workload, spec, factors, options=options)
        points.append(FitPoint(label=f"{r.run_dir.name} {r.label}", x={"micro_batch": r.workload.micro_batch,
                               "seq_len": r.workload.train.seq_len, "global_batch": r.workload.train.global_batch},
                               measured=r.step_s, predicted=pred))
    # runtime memory: what a run holds beyond the model's own needs (CPU: the worker's baseline RSS)
    gaps = [r.peak_memory_bytes - memory(r.workload, spec, r.workload.micro_batch, options,
                                        attrs.evolve(factors, runtime_overhead_bytes=0.0)).total_bytes
            for r in runs if r.peak_memory_bytes]
    coefficients = factors.as_dict()
    if gaps:
        coefficients["runtime_overhead_bytes"] = sorted(gaps)[len(gaps) // 2]
    return _fit_record("roofline", coefficients, {} if free[4] else {"eta_comm": factors.eta_comm}, points,
                       f"{len(runs)} measured runs ({len({r.run_dir.parent for r in runs})} folder(s))", spec.name,
                       "s",
                       f"step time statistic {statistic}" + (", best of repeated runs" if best_of_repeats else ""))


def calibrate_from_micro(micro_dirs: Iterable[str | Path], device: str | None = None, *,
                         catalog: list[str | Path] | tuple = ()) -> Fit:
    """Fit eta_compute, eta_memory and op_overhead_s to operator micro-benchmarks (llmadapt micro ops).

    Peaks come from the micro run's own measurement when it made one, else from the catalog.
    step_overhead_s is not observable in isolated operators and stays at its default.
    """
    from llmadapt.analysis.perf.micro import read_micro

    micro_dirs = list(micro_dirs)
    points_in = []
    spec_name, device_kind = device, "gpu"
    for d in micro_dirs:
        res = read_micro(d)
        device_kind = "cpu" if res.device_kind == "cpu" else "gpu"
        if res.suite != "ops":
            raise LlmadaptError(f"{d}: a micro {res.suite} run; calibration needs `llmadapt micro ops` results")
        peaks = res.peaks
        if not peaks.get("memory_bytes_per_s") or not any(k.startswith("flops_per_s.") for k in peaks):
            spec = find_device(device, extra=catalog) if device else None
            if spec is None:
                raise LlmadaptError(f"{d} has no measured peaks: pass --device NAME to take them from the catalog")
            peaks = {f"flops_per_s.{k}": v for k, v in spec.peak_flops.items()}
            peaks["memory_bytes_per_s"] = spec.memory_bandwidth
        if spec_name is None and res.device_name:
            known = device_for_reported(res.device_name, load_catalog(catalog))
            spec_name = known.name if known else res.device_name
        for r in res.ops:
            if r["status"] != "ok" or not r["seconds"]:
                continue
            peak = peaks.get(f"flops_per_s.{r['dtype']}")
            if not peak:
                continue
            launches = r.get("launches") or 1
            points_in.append((r, peak, peaks["memory_bytes_per_s"], launches))
    if len(points_in) < 4:
        raise LlmadaptError(f"too few operator measurements to calibrate: {len(points_in)} (need at least 4)")
    base = Factors.defaults(find_device(device, extra=catalog).kind if device else device_kind)
    factors = base
    for _ in range(25):
        rows = []
        for r, peak, bw, n in points_in:
            f, by = r["flops"], r["bytes"]
            comp = f / peak if f / (peak * factors.eta_compute) >= by / (bw * factors.eta_memory) else 0.0
            memb = 0.0 if comp else by / bw
            rows.append(([comp, memb, n, 0.0, 0.0], r["seconds"]["p50"]))
        theta = _fit_factors(rows, _prior(base), [True, True, True, False, False])
        theta[3] = base.step_overhead_s
        new = _theta_to_factors(theta, factors, "micro")
        if new == factors:
            break
        factors = new
    points = []
    for r, peak, bw, n in points_in:
        pred = max(r["flops"] / (peak * factors.eta_compute), r["bytes"] / (bw * factors.eta_memory)) \
            + n * factors.op_overhead_s
        points.append(FitPoint(label=f"{r['op']} {r['direction']} {r.get('backend') or ''}".strip(),
                               x={"flops": r["flops"], "bytes": r["bytes"], "launches": n},
                               measured=r["seconds"]["p50"], predicted=pred))
    return _fit_record("roofline", {k: v for k, v in factors.as_dict().items() if k in
                                    ("eta_compute", "eta_memory", "op_overhead_s")},
                       {"step_overhead_s": base.step_overhead_s, "eta_comm": base.eta_comm}, points,
                       f"{len(points)} operator measurements of " + ", ".join(map(str, micro_dirs)), device or spec_name,
                       "s",
                       "per operator call, median time")


def _fit_record(model, coefficients, fixed, points, source, device, unit, note) -> Fit:
    errs = [(p.predicted - p.measured) for p in points]
    rmse = math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else None
    mape = sum(abs(p.predicted - p.measured) / p.measured for p in points) / len(points) if points else None
    return Fit(model=model, coefficients=coefficients, fixed=fixed, points=points, rmse=rmse, mape=mape,
               source=source, device=device, unit=unit, note=note)


def save_calibration(fit: Fit, path: str | Path | None = None) -> Path:
    path = Path(path) if path else calibration_path(fit.device or "device")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(fit), indent=2))
    return path


# -- validation -------------------------------------------------------------------------------------
def validate(run_dirs: Iterable[str | Path], device: str | None = None, *, calibration: str | Path | None = None,
             statistic: str = "p50", catalog: list[str | Path] | tuple = (), options: Options = Options(),
             best_of_repeats: bool = False) -> Validation:
    """Predict each measured run and report the error per run and the mean absolute percentage error."""
    runs = read_runs(run_dirs, statistic, best_of_repeats)
    if not runs:
        raise LlmadaptError("no runs to validate")
    spec = _resolve_device(runs, device, catalog)
    factors = load_factors(spec, calibration)
    rows = []
    for r in runs:
        pred, _ = step_time(r.workload, spec, factors, options=options)
        mem_pred = memory(r.workload, spec, r.workload.micro_batch, options, factors).total_bytes
        mem_err = (mem_pred - r.peak_memory_bytes) / r.peak_memory_bytes if r.peak_memory_bytes else None
        rows.append(ValidationRow(run=str(r.run_dir), label=r.label, measured_step_s=r.step_s, predicted_step_s=pred,
                                  error=(pred - r.step_s) / r.step_s, measured_peak_memory_bytes=r.peak_memory_bytes,
                                  predicted_memory_bytes=mem_pred, memory_error=mem_err))
    mape = sum(abs(r.error) for r in rows) / len(rows)
    mem_errs = [abs(r.memory_error) for r in rows if r.memory_error is not None]
    return Validation(device=spec.name, statistic=statistic + (", best of repeated runs" if best_of_repeats else ""),
                      calibration=factors.source, rows=rows, mape=mape,
                      max_abs_error=max(abs(r.error) for r in rows),
                      memory_mape=sum(mem_errs) / len(mem_errs) if mem_errs else None)
