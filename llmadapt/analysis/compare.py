"""Comparisons across adapters and layouts: one workload, a matrix of overrides, a row per run, and the
table that puts them side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.analysis.cells import Cell, as_cells, matrix_settings, plan
from llmadapt.analysis.parity import loss_parity
from llmadapt.analysis.table import text_table
from llmadapt.errors import LlmadaptError
from llmadapt.launch.run import RunResult, run
from llmadapt.spec import Workload, problem_difference


# -- compare ----------------------------------------------------------------------------------
@attrs.frozen
class Row:
    label: str
    """The run's layout ('megatron tp2'), and a serving run's matrix variant."""
    adapter: str
    variant: str
    run_dir: str | None
    status: str
    """ok, failed, or unsupported (declared impossible by its adapter: not run, not a failure)."""
    metrics: dict[str, float | int | str | None]
    """TRAIN_COLUMNS or SERVE_COLUMNS keys, by the workload's kind."""
    note: str = ""
    problem_hash: str = ""
    cell: str = ""
    """The cell as given ('megatron:parallelism.tp=2')."""


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
        **_expert_columns(s.expert_imbalance),
    }


# MoE runs only: the router's balance, the mean over layers of each layer's mean over steps (ExpertImbalance)
EXPERT_COLUMNS = [("expert_cv", "expert CV", ".3f"), ("expert_max_over_mean", "expert max/mean", ".2f"),
                  ("expert_idle", "idle experts", ".2f")]


def _expert_columns(layers) -> dict[str, float]:
    if not layers:
        return {}
    n = len(layers)
    return {"expert_cv": sum(x.cv for x in layers) / n,
            "expert_max_over_mean": sum(x.max_over_mean for x in layers) / n,
            "expert_idle": sum(x.idle_experts for x in layers) / n}


@attrs.frozen
class Comparison:
    rows: list[Row]
    """Grouped by problem, in the order the problems first appear."""
    workloads: dict[str, Workload] = attrs.field(factory=dict, repr=False, eq=False)
    """One workload per problem hash, to name how problems differ."""

    def problems(self) -> list[str]:
        return list(dict.fromkeys(r.problem_hash for r in self.rows))

    def counts(self) -> dict[str, int]:
        out = {"cells": len(self.rows), "ok": 0, "failed": 0, "unsupported": 0}
        for r in self.rows:
            out[r.status if r.status in out else "failed"] += 1
        return out

    def table(self) -> str:
        serve = any("request_throughput" in r.metrics for r in self.rows)
        columns = SERVE_COLUMNS if serve else TRAIN_COLUMNS
        if any("expert_cv" in r.metrics for r in self.rows):
            columns = columns + EXPERT_COLUMNS
        problems = {h: f"P{i}" for i, h in enumerate(self.problems(), 1)}
        head = ["problem", "run", "status"] + [title for _, title, _ in columns]
        body = [[problems[r.problem_hash], r.label, r.status] + [_f(r.metrics.get(key), fmt) for key, _, fmt in columns]
                for r in self.rows]
        lines = text_table(head, body)
        c = self.counts()
        lines.append(f"{c['cells']} cells: {c['ok']} ok, {c['failed']} failed, {c['unsupported']} not supported "
                     "(not run)" + ("; parity delta: max |loss delta| against the first row of its problem"
                                    if not serve else ""))
        lines += [f"{problems[h]}: problem {h[:12]}{self._difference(h)}" for h in problems]
        lines += [f"{r.label}: {r.note}" for r in self.rows if r.note]
        return "\n".join(lines)

    def breakdown_table(self) -> str:
        """The profiled rows side by side per module class (then operator class and collective): where each stack's
        step time goes. Each cell: ms per profiled step and rank, and its share of that row's step."""
        from llmadapt.analysis.report import read_summary

        rows = []
        for r in self.rows:
            b = read_summary(r.run_dir).get("breakdown") if r.run_dir and r.status == "ok" else None
            if b and b["profiled_steps"]:
                rows.append((r.label, b))
        if not rows:
            return "no profiled runs: set profile.steps (e.g. --set 'profile.steps=[3]') to break steps down"
        return "\n".join(breakdown_columns(rows))

    def _difference(self, problem: str) -> str:
        first = self.problems()[0]
        if problem == first or not self.workloads:
            return ""
        fields = problem_difference(self.workloads[first], self.workloads[problem])
        return f", unlike P1 in {'; '.join(fields[:4])}" + (f" and {len(fields) - 4} more" if len(fields) > 4 else "")


    def to_dict(self) -> dict[str, Any]:
        return {"rows": [attrs.asdict(r) for r in self.rows], "counts": self.counts()}


def _f(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt) if fmt else str(value)


def matrix_variants(workload: Workload, matrix: dict[str, list[Any]]) -> list[tuple[str, Workload]]:
    """Every combination of the matrix values applied to the workload (see `cells.matrix_settings`)."""
    return [(label, workload.with_overrides(sets, source="matrix")) for label, sets in matrix_settings(matrix)]


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


def compare(workload: Workload | str | Path, adapters: list[str] | None = None, *,
            cells: list[Cell | str] | None = None, matrix: dict[str, list[Any]] | None = None,
            refuse_unsupported: bool = False, log: Callable[[str], None] | None = None,
            **run_options: Any) -> Comparison:
    """Run every cell on every matrix variant, side by side; one row each, grouped by problem.

    ``adapters``: one cell per adapter, with the workload's settings (and each adapter's own: ``[adapters.NAME]``,
    ``NAME:path=value``); ``cells``: more, each an adapter with settings of its own ("megatron:parallelism.tp=2",
    or `Cell`). Every cell is resolved and checked before the first run starts (`cells.plan`): a cell an adapter
    declares it cannot run is an error by itself, and in a grid (with ``matrix``) a row marked unsupported,
    not run, unless ``refuse_unsupported``.
    """
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    planned = plan(workload, as_cells(adapters, cells), matrix, refuse_unsupported=refuse_unsupported)
    skipped = [p for p in planned if p.unsupported]
    if log and skipped:
        log(f"not supported, not run ({len(skipped)} of {len(planned)} cells):")
        for p in skipped:
            log(f"  {p.title}: {p.unsupported}")
    rows: dict[int, Row] = {}
    baselines: dict[str, list[float | None]] = {}
    to_run = [(i, p) for i, p in enumerate(planned) if not p.unsupported]
    for n, (i, p) in enumerate(to_run, 1):
        if log:
            log(f"[{n}/{len(to_run)}] {p.title}")
        result: RunResult = run(p.workload, p.cell.adapter, **run_options)
        s = result.summary
        base = baselines.setdefault(s.problem_hash, s.losses) if s.losses else baselines.get(s.problem_hash)
        notes = [f"{f.cause}: {f.message}" for f in s.failures] + [f"warning: {w}" for w in s.warnings]
        if s.serving is not None and s.serving.failures_by_cause:
            notes.append("failed requests: " + ", ".join(f"{k}={n}" for k, n in sorted(s.serving.failures_by_cause.items())))
        if s.serving is not None and not s.serving.valid:
            notes.append(s.serving.validity)
        rows[i] = Row(label=p.title, adapter=p.cell.adapter, variant=p.variant, run_dir=str(result.run_dir),
                      status=s.status, metrics=row_metrics(s, base), note="; ".join(notes)[:400],
                      problem_hash=s.problem_hash, cell=str(p.cell))
    for i, p in enumerate(planned):
        if p.unsupported:
            rows[i] = Row(label=p.title, adapter=p.cell.adapter, variant=p.variant, run_dir=None, status="unsupported",
                          metrics={}, note=p.unsupported, problem_hash=p.workload.problem_hash, cell=str(p.cell))
    problems = list(dict.fromkeys(p.workload.problem_hash for p in planned))
    order = sorted(rows, key=lambda i: (problems.index(planned[i].workload.problem_hash), i))
    return Comparison(rows=[rows[i] for i in order],
                      workloads={p.workload.problem_hash: p.workload for p in reversed(planned)})


def breakdown_columns(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Class-by-run tables of the breakdowns in ROWS ((label, summary breakdown) pairs)."""
    from llmadapt.adapter.breakdown import MODULE_CLASSES, OPERATOR_CLASSES

    def cell(seconds: float | None, total: float) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.2f} ({seconds / total:.0%})" if total else "-"

    def table(title: str, key: str, order: tuple[str, ...]) -> list[str]:
        present = {c["name"] for _, b in rows for c in b[key]}
        names = [n for n in order if n in present] + sorted(present - set(order))
        body = []
        for name in names:
            body.append([name] + [cell(next((c["seconds"] for c in b[key] if c["name"] == name), None),
                                       sum(c["seconds"] for c in b[key])) for _, b in rows])
        return text_table([title] + [label for label, _ in rows], body)

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    lines = table("module class, ms (share)", "modules", MODULE_CLASSES)
    if any(b["operators"] for _, b in rows):
        lines += [""] + table("operator class, ms (share)", "operators", OPERATOR_CLASSES)
    timeline = [
        ["profiled step ms"] + [ms(b["step_seconds"]) for _, b in rows],
        ["compute ms"] + [ms(b["compute_seconds"]) for _, b in rows],
        ["exposed communication ms"] + [ms(b["comm_seconds"] - b["overlapped_comm_seconds"]) for _, b in rows],
        ["idle ms"] + [ms(b["idle_seconds"]) for _, b in rows],
        ["communication overlapped"] + [f"{b['overlapped_comm_seconds'] / b['comm_seconds']:.0%}"
                                        if b["comm_seconds"] else "-" for _, b in rows],
        ["GEMM GFLOP/s"] + [f"{b['gemm_flops_per_s'] / 1e9:,.2f}" if b.get("gemm_flops_per_s") else "-"
                            for _, b in rows],
    ]
    kinds = list(dict.fromkeys(c["kind"] for _, b in rows for c in b["collectives"]))
    for kind in kinds:
        found = [next((c for c in b["collectives"] if c["kind"] == kind), None) for _, b in rows]
        timeline.append([f"{kind} ms"] + ["-" if c is None else ms(c["seconds"]) for c in found])
        timeline.append([f"{kind} busbw GB/s"] + ["-" if c is None or c["busbw_gbytes_per_s"] is None
                                                   else f"{c['busbw_gbytes_per_s']:.3f}" for c in found])
    return lines + [""] + text_table(["timeline (per profiled step and rank)"] + [label for label, _ in rows],
                                     timeline)
