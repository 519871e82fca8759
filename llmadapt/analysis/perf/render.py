"""Text and CSV of estimates, calibration fits and validations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmadapt.analysis.perf.estimate import GIB
from llmadapt.contract.perf import Estimate, Fit, Validation
from llmadapt.contract.schema import to_json
from llmadapt.texttable import text_table


def render(est: Estimate) -> str:
    m = est.memory

    def gib(x: float | None) -> str:
        return "-" if x is None else f"{x / GIB:,.3f} GiB"

    lines = [
        f"workload   {est.label} ({est.kind}, {est.precision}, world size {est.world_size}, micro-batch "
        f"{est.micro_batch}) on {est.device} ({est.device_kind})",
        f"memory     {gib(m.total_bytes)} per rank of {gib(m.capacity_bytes)}"
        + ("" if m.fits is None else ("  [fits]" if m.fits else "  [DOES NOT FIT]")),
        f"           weights {gib(m.weights_bytes)}, gradients {gib(m.gradients_bytes)}, optimizer "
        f"{gib(m.optimizer_bytes)}, activations {gib(m.activations_bytes)}"
        + (f", KV cache {gib(m.kv_cache_bytes)}" if m.kv_cache_bytes else "")
        + f", runtime {gib(m.runtime_overhead_bytes)}" + (f"; host (offloaded) {gib(m.host_bytes)}" if m.host_bytes else ""),
    ]
    if est.serving:
        s = est.serving
        lines.append(f"serving    {s['sequences']:.0f} sequences in flight: TTFT {s['ttft_s'] * 1e3:.2f} ms, "
                     f"TPOT {s['tpot_s'] * 1e3:.3f} ms, {s['output_tokens_per_s']:,.1f} output tokens/s; "
                     f"max sequences that fit {s['max_sequences']:.0f}")
    else:
        lines.append(f"flops      {est.model_flops_per_step:.4g} model FLOPs/step (PaLM), "
                     f"{est.hardware_flops_per_step:.4g} executed")
        lines.append(f"step time  {est.step_time_s:.4g} s  ->  {est.tokens_per_s:,.0f} tokens/s, "
                     f"{est.samples_per_s:,.2f} samples/s" + (f", MFU {est.mfu:.1%}" if est.mfu is not None else ""))
        lines.append("           " + ", ".join(f"{k} {v:.3g} s" for k, v in est.time_breakdown_s.items() if v))
        lines.append(f"max batch  {est.max_micro_batch if est.max_micro_batch is not None else '-'} per rank "
                     "(micro-batch, memory model)")
    if est.price_per_hour is not None:
        cost = f"cost       ${est.price_per_hour:.2f}/h per device"
        if est.cost_per_step is not None:
            cost += f"; ${est.cost_per_step:.3g}/step, ${est.run_cost:.3g} for the workload's steps, " \
                    f"${est.cost_per_million_tokens:.3g} per 1M tokens"
        elif est.cost_per_million_tokens is not None:
            cost += f"; ${est.cost_per_million_tokens:.3g} per 1M output tokens"
        lines.append(cost)
    else:
        lines.append("cost       - (no price for this device: pass --price)")
    if est.job:
        j = est.job
        lines.append(f"job        {j['queries']:,.0f} queries x {j['epochs']:g} epochs: {j['hours']:.2f} h"
                     + (f", ${j['cost']:.2f}" if j["cost"] >= 0 else ""))
    f = est.factors
    lines.append(f"factors    eta_compute {f['eta_compute']:.3g}, eta_memory {f['eta_memory']:.3g}, "
                 f"op overhead {f['op_overhead_s'] * 1e6:.3g} us, step overhead {f['step_overhead_s'] * 1e3:.3g} ms, "
                 f"eta_comm {f['eta_comm']:.3g} ({est.calibration or 'defaults, not calibrated'})")
    return "\n".join(lines)


def render_validation(v: Validation) -> str:
    head = ["run", "workload", "measured s", "predicted s", "error", "peak mem MiB", "pred mem MiB", "mem error"]
    body = []
    for r in v.rows:
        body.append([Path(r.run).name, r.label, f"{r.measured_step_s:.4f}", f"{r.predicted_step_s:.4f}",
                     f"{r.error:+.1%}", "-" if r.measured_peak_memory_bytes is None else
                     f"{r.measured_peak_memory_bytes / 2**20:,.0f}",
                     "-" if r.predicted_memory_bytes is None else f"{r.predicted_memory_bytes / 2**20:,.0f}",
                     "-" if r.memory_error is None else f"{r.memory_error:+.1%}"])
    lines = text_table(head, body)
    lines.append(f"step time MAPE {v.mape:.1%} over {len(v.rows)} runs (max |error| {v.max_abs_error:.1%}; "
                 f"statistic {v.statistic}; device {v.device}; factors: {v.calibration or 'defaults'})")
    if v.memory_mape is not None:
        lines.append(f"peak memory MAPE {v.memory_mape:.1%}")
    return "\n".join(lines)


def render_fit(fit: Fit) -> str:
    lines = [f"fit        {fit.model} on {fit.source}"]
    lines.append("coefficients " + ", ".join(f"{k} {v:.4g}" for k, v in fit.coefficients.items()))
    if fit.fixed:
        lines.append("fixed      " + ", ".join(f"{k} {v:.4g}" for k, v in fit.fixed.items()))
    for p in fit.points:
        lines.append(f"  {p.label:<60} measured {p.measured:.4g}  predicted {p.predicted:.4g}  "
                     f"({(p.predicted - p.measured) / p.measured:+.1%})" if p.measured else f"  {p.label}")
    if fit.rmse is not None:
        lines.append(f"in-sample RMSE {fit.rmse:.4g} {fit.unit}, MAPE {fit.mape:.1%}")
    return "\n".join(lines)


def csv_rows(obj: Any) -> tuple[list[str], list[list[Any]]]:
    """Flat rows for --csv of an Estimate, Fit or Validation."""
    if isinstance(obj, Validation):
        head = ["run", "label", "measured_step_s", "predicted_step_s", "error", "measured_peak_memory_bytes",
                "predicted_memory_bytes", "memory_error"]
        return head, [[getattr(r, k) for k in head] for r in obj.rows]
    if isinstance(obj, Fit):
        keys = sorted({k for p in obj.points for k in p.x})
        return (["label", *keys, "measured", "predicted"],
                [[p.label, *[p.x.get(k) for k in keys], p.measured, p.predicted] for p in obj.points])
    if isinstance(obj, Estimate):
        flat = {k: v for k, v in to_json(obj).items() if not isinstance(v, (dict, list))}
        flat.update({f"memory.{k}": v for k, v in to_json(obj.memory).items()})
        flat.update({f"time.{k}": v for k, v in obj.time_breakdown_s.items()})
        flat.update({f"factor.{k}": v for k, v in obj.factors.items()})
        return list(flat), [list(flat.values())]
    raise TypeError(obj)
