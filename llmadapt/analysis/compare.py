"""Comparisons across adapters and layouts: one workload, a matrix of overrides, a row per run, and the
table that puts them side by side.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.adapter.plugins import check_supported, get_adapter
from llmadapt.analysis.parity import loss_parity
from llmadapt.analysis.table import text_table
from llmadapt.errors import LlmadaptError
from llmadapt.launch.run import RunResult, run
from llmadapt.spec import Workload


# -- compare ----------------------------------------------------------------------------------
@attrs.frozen
class Row:
    label: str
    adapter: str
    variant: str
    run_dir: str | None
    status: str
    metrics: dict[str, float | int | str | None]
    """TRAIN_COLUMNS or SERVE_COLUMNS keys, by the workload's kind."""
    note: str = ""


# (key, heading, format) of the comparison table, per kind
TRAIN_COLUMNS = [
    ("step_p50_s", "step p50 s", ".4f"), ("step_p90_s", "step p90 s", ".4f"), ("tokens_per_s", "tokens/s", ",.0f"),
    ("samples_per_s", "samples/s", ",.1f"), ("peak_memory_mib", "peak mem MiB", ",.0f"),
    ("first_loss", "first loss", ".4f"), ("last_loss", "last loss", ".4f"), ("parity_delta", "parity delta", ".2e"),
]


SERVE_COLUMNS = [
    ("request_throughput", "req/s", ".2f"), ("output_throughput", "out tok/s", ",.1f"),
    ("ttft_p50_ms", "TTFT p50 ms", ".1f"), ("ttft_p99_ms", "TTFT p99 ms", ".1f"),
    ("tpot_p50_ms", "TPOT p50 ms", ".1f"), ("tpot_p99_ms", "TPOT p99 ms", ".1f"),
    ("itl_p50_ms", "ITL p50 ms", ".1f"), ("itl_p99_ms", "ITL p99 ms", ".1f"),
    ("e2el_p50_ms", "E2EL p50 ms", ".1f"), ("e2el_p99_ms", "E2EL p99 ms", ".1f"),
    ("goodput", "goodput req/s", ".2f"), ("failed", "failed", "d"), ("valid", "valid", ""),
]


def row_metrics(summary, baseline_losses: list[float | None] | None) -> dict[str, float | int | str | None]:
    """The comparison columns of one run, from its summary."""
    s = summary
    if s.serving is not None:
        v = s.serving
        out: dict[str, float | int | str | None] = {
            "request_throughput": v.request_throughput, "output_throughput": v.output_throughput,
            "goodput": v.request_goodput, "failed": v.failed, "valid": "yes" if v.valid else "NO",
            "failures_by_cause": ", ".join(f"{k}={n}" for k, n in sorted(v.failures_by_cause.items())) or None,
        }
        for metric in ("ttft", "tpot", "itl", "e2el"):
            st = getattr(v, f"{metric}_ms")
            out[f"{metric}_p50_ms"] = st.p50 if st else None
            out[f"{metric}_p99_ms"] = st.p99 if st else None
        return out
    delta = loss_parity(baseline_losses, s.losses).max_abs_delta if s.losses and baseline_losses else None
    return {
        "step_p50_s": s.step_time_s.p50 if s.step_time_s else None,
        "step_p90_s": s.step_time_s.p90 if s.step_time_s else None,
        "tokens_per_s": s.tokens_per_s.mean if s.tokens_per_s else None,
        "samples_per_s": s.samples_per_s.mean if s.samples_per_s else None,
        "peak_memory_mib": s.peak_memory_bytes / 2**20 if s.peak_memory_bytes else None,
        "first_loss": s.losses[0] if s.losses else None, "last_loss": s.losses[-1] if s.losses else None,
        "parity_delta": delta,
    }


@attrs.frozen
class Comparison:
    rows: list[Row]

    def table(self) -> str:
        serve = any("request_throughput" in r.metrics for r in self.rows)
        columns = SERVE_COLUMNS if serve else TRAIN_COLUMNS
        head = ["run", "status"] + [title for _, title, _ in columns]
        body = [[r.label, r.status] + [_f(r.metrics.get(key), fmt) for key, _, fmt in columns] for r in self.rows]
        lines = text_table(head, body)
        notes = [f"{r.label}: {r.note}" for r in self.rows if r.note]
        return "\n".join(lines + notes)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [attrs.asdict(r) for r in self.rows]}


def _f(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt) if fmt else str(value)


def matrix_variants(workload: Workload, matrix: dict[str, list[Any]]) -> list[tuple[str, Workload]]:
    """Every combination of the matrix values, applied as overrides; labels like 'dp=2,recompute=full'.

    A key naming several comma-separated paths is one axis whose values are tuples, one value per
    path, taken together (zipped, not crossed): {"optimizations.zero_stage,optimizations.offload":
    [(0, "none"), (2, "optimizer")]} is two variants. That names configurations a cross product
    cannot, because some combinations are invalid (offload without ZeRO).
    """
    if not matrix:
        return [("", workload)]
    axes = []
    for key, values in matrix.items():
        paths = [p.strip() for p in key.split(",")]
        if not values:
            raise LlmadaptError(f"matrix {key!r}: no values")
        options = []
        for v in values:
            v = tuple(v) if len(paths) > 1 and isinstance(v, (list, tuple)) else (v,)
            if len(v) != len(paths):
                raise LlmadaptError(f"matrix {key!r}: value {v!r} needs {len(paths)} parts, one per path")
            options.append(list(zip(paths, v)))
        axes.append(options)
    out = []
    for combination in itertools.product(*axes):
        pairs = [pair for option in combination for pair in option]
        sets = [f"{k}={_yaml_scalar(v)}" for k, v in pairs]
        label = ",".join(f"{k.split('.')[-1]}={_yaml_scalar(v)}" for k, v in pairs)
        out.append((label, workload.with_overrides(sets)))
    return out


def _yaml_scalar(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def parse_matrix(items: list[str]) -> dict[str, list[Any]]:
    """['optimizations.recompute=none,full', 'parallelism.dp=1,2'] -> {path: [values]}.

    Several paths zip into one axis: 'optimizations.zero_stage,optimizations.offload=0,none;2,optimizer'
    -> {"optimizations.zero_stage,optimizations.offload": [(0, "none"), (2, "optimizer")]} (values of
    one variant separated by ',', variants by ';').
    """
    import yaml

    from llmadapt.spec import load_yaml

    def load_yaml_value(text: str, item: str):
        try:
            return load_yaml(text)
        except yaml.YAMLError:
            raise LlmadaptError(f"--matrix {item[:80]!r}: value {text[:40]!r} is not a YAML scalar") from None

    matrix: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if key.strip() in matrix:
            raise LlmadaptError(f"--matrix {key.strip()[:80]!r} is given twice: give each axis once")
        if not sep or not values:
            raise LlmadaptError(f"--matrix {item!r}: use path=v1,v2 (e.g. parallelism.dp=1,2), or "
                                "path1,path2=a1,a2;b1,b2 for variants that set several fields together")
        paths = [p.strip() for p in key.split(",")]
        if len(paths) == 1:
            matrix[key.strip()] = [load_yaml_value(v, item) for v in values.split(",")]
            continue
        variants = []
        for variant in values.split(";"):
            parts = [load_yaml_value(v, item) for v in variant.split(",")]
            if len(parts) != len(paths):
                raise LlmadaptError(f"--matrix {item!r}: variant {variant!r} has {len(parts)} values for "
                                    f"{len(paths)} paths ({', '.join(paths)})")
            variants.append(tuple(parts))
        matrix[",".join(paths)] = variants
    return matrix


def compare(workload: Workload | str | Path, adapters: list[str], *, matrix: dict[str, list[Any]] | None = None,
            log: Callable[[str], None] | None = None, **run_options: Any) -> Comparison:
    """Run every adapter on every matrix variant, side by side; one row each.

    Every (adapter, variant) pair is checked before the first run starts, so a bad
    combination fails at once instead of after an hour of measurements.
    """
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    plan = []
    for label, variant in matrix_variants(workload, matrix or {}):
        for name in adapters:
            check_supported(get_adapter(name), variant)
            plan.append((name, label, variant))
    rows: list[Row] = []
    baselines: dict[str, list[float | None]] = {}
    for i, (name, label, variant) in enumerate(plan, 1):
        title = f"{name}" + (f" [{label}]" if label else "")
        if log:
            log(f"[{i}/{len(plan)}] {title}")
        result: RunResult = run(variant, name, **run_options)
        s = result.summary
        base = baselines.setdefault(s.problem_hash, s.losses)
        notes = [f"{f.cause}: {f.message}" for f in s.failures] + [f"warning: {w}" for w in s.warnings]
        if s.serving is not None and s.serving.failures_by_cause:
            notes.append("failed requests: " + ", ".join(f"{k}={n}" for k, n in sorted(s.serving.failures_by_cause.items())))
        if s.serving is not None and not s.serving.valid:
            notes.append(s.serving.validity)
        rows.append(Row(label=title, adapter=name, variant=label, run_dir=str(result.run_dir), status=s.status,
                        metrics=row_metrics(s, base), note="; ".join(notes)[:400]))
    return Comparison(rows=rows)
