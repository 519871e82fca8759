"""Comparisons across adapters and layouts, as read: a row per cell (from its runs' folders or the store), and
the table and verdicts that put them side by side. ``llmadapt.experiments.compare`` plans and launches them.

It is over 400 lines because a row is made one way (``row_of_runs``: its runs, repeats or reused, with their
intervals) whether its runs were made now or read from the store, and the tables that show rows live with it.
"""

from __future__ import annotations

import statistics

from pathlib import Path
from typing import Any

import attrs

from llmadapt.analysis.labels import distinct_labels, labelled_by, matrix_settings
from llmadapt.analysis.paritycheck import loss_parity
from llmadapt.analysis.uncertainty import Estimate, bootstrap_median
from llmadapt.analysis.verdict import SUPERLINEAR, ScalingPoint, Verdict, scaling, told_apart, verdict
from llmadapt.errors import LlmadaptError
from llmadapt.contract.records import Topology
from llmadapt.contract.rundir import RunDir
from llmadapt.spec import Workload, problem_difference
from llmadapt.texttable import text_table


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
    run_dirs: list[str] = attrs.Factory(list)
    """Every run of the row (repeats, runs reused or read from the store); ``run_dir`` is the first."""
    estimates: dict[str, Estimate] = attrs.Factory(dict)
    """Medians with their bootstrap intervals (``ESTIMATED``): over the runs when there are several, over the
    measured steps of the one run otherwise."""
    machine: str = ""
    disturbed: list[str] = attrs.Factory(list)
    """Each of the row's runs that measured its steps on a disturbed machine, with the first cause its summary's
    interference names; empty when every run was quiet or not judged."""
    judged: bool = True
    """False where a run's interference was not judged (measured steps too short to count other processes' CPU)."""
    topology: Topology | None = None
    """Its first run's topology (the summary's, rank 0's): interconnect, NUMA nodes, cores and threads."""
    layout: str = ""
    """The row's layout label alone ('torch dp2 recompute=full'), without what ``label`` adds to tell it from the
    other rows: a scaling group is the rows whose layouts differ in their parallel layout alone."""


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


# Serving with output lengths not forced (serve.ignore_eos = false): the answers' lengths each engine chose
OUTPUT_COLUMNS = [("out_tokens_p50", "out tok p50", ".0f"), ("out_tokens_p90", "out tok p90", ".0f"),
                  ("out_tokens_mean", "out tok mean", ".1f"), ("out_tokens_max", "out tok max", ".0f"),
                  ("eos_share", "EOS share", ".0%"), ("cap_share", "cap share", ".0%")]


# Serving runs with serve.quality (llmadapt.runtime.quality): the held-out texts against transformers' fp32
QUALITY_COLUMNS = [("weights", "weights", ""), ("quality_identical", "identical", ".0%"),
                   ("quality_divergence", "diverges at", ".0f"), ("quality_same_top", "same top", ".1%"),
                   ("quality_kl", "KL (top-k)", ".2e"), ("quality_ppl", "ppl", ".3f"),
                   ("quality_ppl_ref", "ppl fp32", ".3f"), ("quality_out_ratio", "out/ref", ".2f"),
                   ("quality_gate", "quality gate", "")]


def _quality_columns(s) -> dict[str, float | str | None]:
    from llmadapt.analysis.verdict import quality_gate

    out: dict[str, float | str | None] = {"weights": s.engine_weights} if s.engine_weights else {}
    q = s.quality
    if q is None:
        return out
    ref = q.reference_output_tokens_mean
    return {**out, "quality_identical": q.identical_share, "quality_divergence": q.first_divergence_median,
            "quality_same_top": q.same_top_share, "quality_kl": q.kl_mean, "quality_ppl": q.perplexity,
            "quality_ppl_ref": q.reference_perplexity,
            "quality_out_ratio": q.output_tokens_mean / ref if ref and q.output_tokens_mean is not None else None,
            "quality_gate": quality_gate(q)}


def row_metrics(summary, baseline_losses: list[float | None] | None) -> dict[str, float | int | str | None]:
    """The comparison columns of one run, from its summary."""
    s = summary
    if s.serving is not None:
        v = s.serving
        out: dict[str, float | int | str | None] = {
            "request_throughput": v.request_throughput, "output_throughput": v.output_throughput,
            "goodput": v.request_goodput, "failed": v.failed,
            # valid: measured correctly and some request completed (a summary written before valid said the
            # latter may not); another tool's client is not judged
            "valid": "NO" if not v.completed else "not judged" if s.measured_by else "yes" if v.valid else "NO",
            "failures_by_cause": ", ".join(f"{k}={n}" for k, n in sorted(v.failures_by_cause.items())) or None,
        }
        for metric in ("ttft", "tpot", "itl", "e2el"):
            st = getattr(v, f"{metric}_ms")
            out[f"{metric}_p50_ms"] = st.p50 if st else None
            out[f"{metric}_p99_ms"] = st.p99 if st else None
        if not v.output_length_forced and v.output_tokens:
            n = v.output_tokens
            out.update(out_tokens_p50=n.p50, out_tokens_p90=n.p90, out_tokens_mean=n.mean, out_tokens_max=n.max,
                       eos_share=v.stopped_at_eos_share, cap_share=v.hit_cap_share)
        return {**out, **_quality_columns(s)}
    delta = loss_parity(baseline_losses, s.losses).max_abs_delta if s.losses and baseline_losses else None
    return {
        "devices": s.world_size,
        "step_p50_s": s.step_time_s.p50 if s.step_time_s else None,
        "step_p90_s": s.step_time_s.p90 if s.step_time_s else None,
        "tokens_per_s": s.tokens_per_s.mean if s.tokens_per_s else None,
        "samples_per_s": s.samples_per_s.mean if s.samples_per_s else None,
        "peak_memory_mib": s.peak_memory_bytes / 2**20 if s.peak_memory_bytes else None,
        "first_loss": s.losses[0] if s.losses else None, "last_loss": s.losses[-1] if s.losses else None,
        "parity_delta": delta,
        "mfu": s.mfu, "hfu": s.hfu if s.hfu != s.mfu else None,
        **_expert_columns(s.expert_imbalance),
        **_eval_columns(s.evaluations),
    }


# Where the device's peak is known (GPUs in the catalog): MFU, and HFU where recomputation makes it differ
UTILISATION_COLUMNS = [("mfu", "MFU", ".1%"), ("hfu", "HFU", ".1%")]

# MoE runs only: the router's balance, the mean over layers of each layer's mean over steps (ExpertImbalance)
EXPERT_COLUMNS = [("expert_cv", "expert CV", ".3f"), ("expert_max_over_mean", "expert max/mean", ".2f"),
                  ("expert_idle", "idle experts", ".2f")]


# A narrow terminal: the columns left out first, in this order, until the table fits (--columns chooses instead)
NARROW_DROP = ["step_p90_s", "samples_per_s", "out_tokens_p90", "out_tokens_max", "first_loss", "hfu",
               "eval_expert_cv", "expert_idle", "expert_max_over_mean", "peak_memory_mib", "eval_loss_before",
               "ttft_p99_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2el_p99_ms", "e2el_p50_ms",
               "tpot_p50_ms", "valid"]


def column_keys(names: list[str]) -> list[str]:
    """The metric keys of columns named by key or by title (``tokens_per_s`` or ``tokens/s``, any case); an
    unknown name is one line listing the known ones."""
    known = {}
    for key, title, _ in EVERY_COLUMNS:
        known[key.lower()] = known[title.lower()] = key
    unknown = [n for n in names if n.strip().lower() not in known]
    if unknown:
        raise LlmadaptError(f"unknown column {', '.join(map(repr, unknown))}: choose from "
                            + ", ".join(dict.fromkeys(known.values())))
    return [known[n.strip().lower()] for n in names]


def _expert_columns(layers) -> dict[str, float]:
    if not layers:
        return {}
    n = len(layers)
    return {"expert_cv": sum(x.cv for x in layers) / n,
            "expert_max_over_mean": sum(x.max_over_mean for x in layers) / n,
            "expert_idle": sum(x.idle_experts for x in layers) / n}


# Runs with workload.eval: the held-out figures before training and after the last step (Evaluation)
EVAL_COLUMNS = [("eval_loss_before", "eval loss before", ".4f"), ("eval_loss", "eval loss", ".4f"),
                ("eval_exact_match", "exact match", ".3f"), ("eval_choice_accuracy", "choice acc", ".3f"),
                ("eval_expert_cv", "eval expert CV", ".3f")]

EVERY_COLUMNS = (TRAIN_COLUMNS + SERVE_COLUMNS + OUTPUT_COLUMNS + EXPERT_COLUMNS + EVAL_COLUMNS + UTILISATION_COLUMNS
                 + QUALITY_COLUMNS)
"""Every column a row can have, in the table's order."""


def _eval_columns(points) -> dict[str, float]:
    if not points:
        return {}
    from llmadapt.contract.breakdowns import imbalance

    first, last = points[0], points[-1]
    out = {"eval_loss_before": first.loss, "eval_loss": last.loss}
    if last.exact_match is not None:
        out["eval_exact_match"] = last.exact_match
    if last.choice_accuracy is not None:
        out["eval_choice_accuracy"] = last.choice_accuracy
    if last.expert_load:
        cvs = [f[0] for f in map(imbalance, last.expert_load) if f is not None]
        if cvs:
            out["eval_expert_cv"] = sum(cvs) / len(cvs)
    return out


@attrs.frozen
class Comparison:
    rows: list[Row]
    """Grouped by problem, in the order the problems first appear."""
    workloads: dict[str, Workload] = attrs.field(factory=dict, repr=False, eq=False)
    """One workload per problem hash, to name how problems differ."""
    baseline: str | None = None
    """The row every other row of its problem is set against (a cell as given, or a row's label); None: each
    problem's first row."""
    seed: int | None = None
    """The seed of the rounds' shuffled orders (None: one round, the cells in their order)."""
    settle: float | None = None
    """The stopping rule's share: rounds were added until every headline interval was narrower than this."""
    unsettled: list[str] = attrs.Factory(list)
    """Rows whose interval never got that narrow before the last round."""
    partial: bool = False
    """Some planned runs have not run (the comparison was interrupted, or is still going): the rows are those
    with a run so far, ``pending`` names the others."""
    pending: list[str] = attrs.Factory(list)
    """Cells with runs still to make (``partial``), one entry per run missing."""
    saved: str | None = None
    """The file the comparison was written to (``compare``: OUT/compare-....json), rewritten as each run ends."""
    problem_notes: dict[str, str] = attrs.Factory(dict)
    """What to say of a problem instead of how it differs from P1: a problem as an imported file states it
    (llmadapt.contract.foreign.AS_FILE_STATES), which no llmadapt run shares."""
    stopped: str | None = None
    """``repeat='auto'``: why the rounds stopped ('decided after 5 repeats: ...', 'budget spent after 10 repeats:
    ...'); None otherwise."""

    def reference(self, problem: str) -> Row | None:
        """The row of ``problem`` the others are set against: the baseline's where it is in the problem, else
        the problem's first row that ran ok."""
        rows = [r for r in self.rows if r.problem_hash == problem and r.status == "ok"]
        named = [r for r in rows if self.baseline in (r.cell, r.label)]
        return (named or rows or [None])[0]

    def problems(self) -> list[str]:
        return list(dict.fromkeys(r.problem_hash for r in self.rows))

    def counts(self) -> dict[str, int]:
        out = {"cells": len(self.rows), "ok": 0, "failed": 0, "unsupported": 0}
        for r in self.rows:
            if r.status in ("diverged", "degraded"):
                out[r.status] = out.get(r.status, 0) + 1
            else:
                out[r.status if r.status in out else "failed"] += 1
        return out

    def table(self, *, columns: list[str] | None = None, width: int | None = None) -> str:
        """The table and the lines under it. ``columns``: the metric columns to show (keys or titles, see
        ``column_keys``); ``width``: a terminal's width, which the table is narrowed to by leaving columns out
        (NARROW_DROP's order), saying which."""
        serve = any("request_throughput" in r.metrics for r in self.rows)
        shown = SERVE_COLUMNS if serve else TRAIN_COLUMNS
        if any("out_tokens_p50" in r.metrics for r in self.rows):
            shown = shown + OUTPUT_COLUMNS
        if any("expert_cv" in r.metrics for r in self.rows):
            shown = shown + EXPERT_COLUMNS
        shown = shown + [c for c in EVAL_COLUMNS + QUALITY_COLUMNS if any(c[0] in r.metrics for r in self.rows)]
        shown = shown + [c for c in UTILISATION_COLUMNS if any(r.metrics.get(c[0]) is not None for r in self.rows)]
        if columns is not None:
            chosen = column_keys(columns)
            every = EVERY_COLUMNS
            shown = [next(c for c in every if c[0] == key) for key in dict.fromkeys(chosen)]
        lines, left_out = self._lines(shown), []
        for key in NARROW_DROP if width is not None and columns is None else []:
            if max(map(len, lines[:len(self.rows) + 2])) <= width:
                break
            if any(c[0] == key for c in shown):
                shown = [c for c in shown if c[0] != key]
                left_out.append(next(title for k, title, _ in EVERY_COLUMNS if k == key))
                lines = self._lines(shown)
        if left_out:
            lines.insert(len(self.rows) + 2, f"left out to fit {width} columns: {', '.join(left_out)} "
                                             "(--columns to choose, --json for all)")
        return "\n".join(lines)

    def _lines(self, columns: list[tuple[str, str, str]]) -> list[str]:
        serve = any("request_throughput" in r.metrics for r in self.rows)
        problems = {h: f"P{i}" for i, h in enumerate(self.problems(), 1)}
        head = ["problem", "run", "status"] + [title for _, title, _ in columns]
        uncertain = any(r.estimates for r in self.rows)
        if uncertain:
            head.insert(4, "vs baseline" if self.baseline else "vs first")
        body = []
        for r in self.rows:
            first = self.reference(r.problem_hash) if r.status == "ok" else None
            cells = [problems[r.problem_hash], r.label, r.status]
            for key, _, fmt in columns:
                estimate = r.estimates.get(key)
                cells.append(estimate.text() if estimate else format_value(r.metrics.get(key), fmt))
            if uncertain:
                cells.insert(4, versus(r, first, HEADLINE["serve" if serve else "train"]))
            body.append(cells)
        lines = text_table(head, body)
        c = self.counts()
        others = "".join(f", {c[k]} {k}" for k in ("diverged", "degraded") if c.get(k))
        lines.append(f"{c['cells']} cells: {c['ok']} ok{others}, {c['failed']} failed, {c['unsupported']} not supported "
                     "(not run)" + ("; parity delta: max |loss delta| against the first row of its problem"
                                    if not serve else ""))
        if uncertain:
            lines.append(_uncertainty_note(self.rows, HEADLINE["serve" if serve else "train"], self.baseline))
            lines += self.verdict_lines(problems, HEADLINE["serve" if serve else "train"])
        if self.seed is not None:
            lines.append(f"run in rounds: every cell once per round, in an order shuffled with seed {self.seed}"
                         + (f"; rounds added until every interval was within {self.settle:.0%} of its median"
                            if self.settle else "")
                         + ("; rounds added until the ranking was decided (--repeat auto)" if self.stopped else ""))
        if self.stopped:
            lines.append(self.stopped)
        if self.unsettled:
            lines.append(f"never settled within {self.settle:.0%}: {', '.join(self.unsettled)}")
        lines += [f"{problems[h]}: problem {h[:12]}{self.problem_notes.get(h) or self.difference(h)}" for h in problems]
        lines += [f"{r.label}: {r.note}" for r in self.rows if r.note]
        if not serve:
            lines += self.scaling_lines(problems)
        if self.partial:
            lines.append(f"partial: {len(self.pending)} run(s) not made: {', '.join(dict.fromkeys(self.pending))}")
        return lines

    def verdicts(self) -> list[Verdict]:
        """Per problem with two or more rows that have the headline figure's interval: the verdict (``Verdict``:
        the fastest row, those that cannot be told apart from it, how much slower the others are, or why it is
        withheld), judged on the problem's kind's headline figure (``HEADLINE``)."""
        problems = {h: f"P{i}" for i, h in enumerate(self.problems(), 1)}
        serving = {r.problem_hash for r in self.rows if "request_throughput" in r.metrics}
        return [v for h, name in problems.items()
                for v in self._verdicts({h: name}, HEADLINE["serve" if h in serving else "train"])]

    def _verdicts(self, problems: dict[str, str], key: str) -> list[Verdict]:
        out = []
        for problem, name in problems.items():
            found = verdict(name, problem, [r for r in self.rows if r.problem_hash == problem and r.status == "ok"],
                            key)
            out += [found] if found else []
        return out

    def verdict_lines(self, problems: dict[str, str], key: str) -> list[str]:
        """Per problem with two or more rows: the fastest row (lowest headline median), the rows that cannot be
        told apart from it (95% intervals overlap), and how much slower the others are. No verdict where a
        row's runs ran on a disturbed machine, or where a row has a single sample (no interval to judge by). The
        lines of ``verdicts``."""
        return [v.text() for v in self._verdicts(problems, key)]

    def scaling(self) -> list[ScalingPoint]:
        """How the step scales with devices, where the rows allow it (``verdict.scaling``): strong scaling within a
        problem, weak scaling across problems that differ in global batch alone; per stack and technique."""
        return scaling(self.rows, {h: f"P{i}" for i, h in enumerate(self.problems(), 1)}, self.workloads)

    def scaling_lines(self, problems: dict[str, str]) -> list[str]:
        """The scaling table (``scaling``) and its notes; a row measured on a disturbed machine is marked so."""
        points = scaling(self.rows, problems, self.workloads)
        if not points:
            return []
        body = [[p.problem, p.label + (" (disturbed)" if p.disturbed else ""), str(p.devices), p.scaling,
                 f"{p.speedup:.2f}x", _efficiency(p.efficiency), p.against] for p in points]
        lines = ["", *text_table(["problem", "run", "devices", "scaling", "speedup", "efficiency", "against"], body),
                 "strong: one problem on more devices, step time against its row with the fewest; weak: the global "
                 "batch grown with the devices, tokens/s per device against the fewest devices' (medians)"]
        if any(p.superlinear for p in points):
            lines.append("!: above 110%, more than linear, which the same work on more devices cannot be: the rows ran "
                         "under unlike conditions (threads per rank, the machine's load), not a real speedup")
        if any(p.disturbed for p in points):
            lines.append("(disturbed): that row or the one it is set against ran on a disturbed machine: its "
                         "figures are not to be trusted")
        return lines

    def breakdown_table(self) -> str:
        """The profiled rows side by side per module class (then operator class and collective): where each stack's
        step time goes. Each cell: ms per profiled step and rank, and its share of that row's step."""
        from llmadapt.analysis.report import read_summary

        rows, phases = [], []
        for r in self.rows:
            summary = read_summary(r.run_dir) if r.run_dir and r.status == "ok" else {}
            b = summary.get("breakdown")
            if b and b["profiled_steps"]:
                rows.append((r.label, b))
            if summary.get("phase_means_s") and (summary.get("step_time_s") or {}).get("mean"):
                phases.append((r.label, summary["phase_means_s"], summary["step_time_s"]["mean"]))
        lines = breakdown_columns(rows) if rows else [
            "no profiled runs: set profile.steps (e.g. --set 'profile.steps=[3]') to break steps down"]
        if phases:  # every run's phases, timed by each stack on every measured step (not only profiled ones)
            names = list(dict.fromkeys(n for _, p, _ in phases for n in p))
            body = [[name] + ["-" if name not in p else f"{p[name] * 1e3:.2f} ({p[name] / step:.0%})"
                              for _, p, step in phases] for name in names]
            lines += ["", *text_table(["phase (source:name), ms (share of the step)"] + [label for label, _, _ in phases],
                                      body)]
        return "\n".join(lines)

    def difference(self, problem: str) -> str:
        first = self.problems()[0]
        if problem == first or not self.workloads:
            return ""
        fields = problem_difference(self.workloads[first], self.workloads[problem])
        return f", unlike P1 in {'; '.join(fields[:4])}" + (f" and {len(fields) - 4} more" if len(fields) > 4 else "")


    def to_dict(self) -> dict[str, Any]:
        return {"rows": [attrs.asdict(r) for r in self.rows], "counts": self.counts(), "baseline": self.baseline,
                "seed": self.seed, "settle": self.settle, "unsettled": self.unsettled, "stopped": self.stopped,
                "partial": self.partial,
                "pending": self.pending, "saved": self.saved,
                "verdicts": [attrs.asdict(v) for v in self.verdicts()],
                "scaling": [{**attrs.asdict(p), "superlinear": p.superlinear} for p in self.scaling()]}

    def to_frame(self, records: str = "rows"):
        """A pandas DataFrame: a row per row of the table (``rows``), or the ``steps``, ``requests``,
        ``breakdown`` or ``telemetry`` of every run of every row, labelled by its row (``analysis.frames``)."""
        from llmadapt.analysis.frames import comparison_rows, frame

        return comparison_rows(self) if records == "rows" else frame(records, self)


# The figure a row is set against its problem's first row by, per kind.
HEADLINE = {"train": "step_p50_s", "serve": "ttft_p50_ms"}
ESTIMATED = {"train": ("step_p50_s", "tokens_per_s"), "serve": ("ttft_p50_ms", "tpot_p50_ms", "output_throughput")}


def _efficiency(value: float) -> str:
    return f"{value:.0%}" + ("!" if value > SUPERLINEAR else "")


def versus(row: Row, first: Row | None, key: str) -> str:
    """The row's headline figure against the reference row of its problem: '+12%' beyond noise, '≈' within it
    (not told apart: ``verdict.told_apart``), '?' after a change where either side has one
    sample, 'disturbed' (no figure) where either side ran on a disturbed machine, '-' for the reference itself."""
    mine, theirs = row.estimates.get(key), first.estimates.get(key) if first else None
    if first is None or first is row or mine is None or theirs is None or not theirs.median:
        return "-"
    if row.disturbed or first.disturbed:
        return "disturbed"
    if mine.n >= 2 and theirs.n >= 2 and not told_apart(mine, theirs):
        return "≈"
    change = f"{(mine.median / theirs.median - 1):+.0%}"
    return change if mine.n >= 2 and theirs.n >= 2 else f"{change}?"


def _uncertainty_note(rows: list[Row], key: str, baseline: str | None = None) -> str:
    counts = sorted({(e.n, e.what) for r in rows for e in [r.estimates.get(key)] if e})
    over = ", ".join(f"{n} {what}" for n, what in counts)
    against = f"vs baseline: the headline against {baseline}" if baseline else \
        "vs first: the headline against the first row of its problem"
    return (f"medians with 95% bootstrap intervals (percentile, {2000} resamples) over {over}; {against}, '≈' "
            "where the intervals overlap (within noise), '?' where either side has a single sample (no interval "
            "to judge by), 'disturbed' where either side ran on a disturbed machine")


def format_value(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "d" and isinstance(value, float):  # a count's median over repeated runs: 2.5 failed requests
        return format(value, ".0f" if value.is_integer() else ".1f")
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


def from_json_summary(data: dict[str, Any]):
    """A summary as the run wrote it (summary.json), as the record type."""
    from llmadapt.contract.launch import structure
    from llmadapt.contract.records import Summary

    return structure(Summary, data, "summary")


def row_of_runs(label: str, adapter: str, variant: str, cell: str, results: list[tuple[str, dict[str, Any]]],
                baselines: dict[str, list[float | None]], machine: str = "", layout: str = "") -> Row:
    """One row from one or more runs of a cell ((run folder, summary) pairs): the first run's figures, the
    headline figures as medians with their intervals, every failure and warning in the note."""
    summaries = [from_json_summary(s) for _, s in results]
    first = summaries[0]
    # A degraded serving run measured (some requests failed or were cut short): its figures stand in its row,
    # which says 'degraded'; the verdict judges 'ok' rows only.
    ok = [(d, s) for (d, _), s in zip(results, summaries) if s.status in ("ok", "degraded")]
    base = baselines.setdefault(first.problem_hash, first.losses) if first.losses else baselines.get(first.problem_hash)
    notes = []
    for s in summaries:
        notes += [f"{f.cause}: {f.message}" for f in s.failures] + [f"warning: {w}" for w in s.warnings]
        if s.serving is not None and s.serving.failures_by_cause:
            notes.append("failed requests: " + ", ".join(f"{k}={n}" for k, n in sorted(s.serving.failures_by_cause.items())))
        if s.serving is not None and not s.serving.valid:
            notes.append(s.serving.validity)
    metrics = row_metrics(first, base)
    if len(ok) > 1:  # one population per row: every figure over the runs, as the headline's median is
        per_run = [row_metrics(s, base) for _, s in ok]
        for key, value in metrics.items():
            values = [m.get(key) for m in per_run]
            if key not in ("devices", "first_loss", "last_loss") and all(isinstance(v, (int, float)) for v in values):
                metrics[key] = max(values) if key == "parity_delta" else statistics.median(values)
    estimates = estimates_of(ok, "serve" if first.serving is not None else "train")
    for key, estimate in estimates.items():
        metrics[key] = estimate.median
    if len(results) > 1:
        failed = sum(1 for s in summaries if s.status != "ok")
        notes.insert(0, f"{len(results)} runs" + (f", {failed} failed" if failed else ""))
    disturbed = [f"{label} run {n}: {s.interference.causes[0]}" if len(results) > 1 else s.interference.causes[0]
                 for n, s in enumerate(summaries, 1) if s.interference is not None and s.interference.causes]
    return Row(label=label, adapter=adapter, variant=variant, run_dir=results[0][0],
               status=_row_status([s.status for s in summaries]), metrics=metrics,
               note="; ".join(dict.fromkeys(notes))[:400], problem_hash=first.problem_hash, cell=cell,
               run_dirs=[d for d, _ in results], estimates=estimates, machine=machine,
               disturbed=list(dict.fromkeys(disturbed)),
               judged=all(s.interference is None or s.interference.quiet is not None for s in summaries),
               layout=layout or label, topology=first.topology)


def _row_status(statuses: list[str]) -> str:
    """A row's status from its runs': 'ok' when every run is; else 'diverged' when one is (a NaN loss says more
    than a failure), 'degraded' when every run measured and some are, else 'failed'."""
    if all(s == "ok" for s in statuses):
        return "ok"
    if "diverged" in statuses:
        return "diverged"
    return "degraded" if all(s in ("ok", "degraded") for s in statuses) else "failed"


def estimates_of(ok: list[tuple[str, Any]], kind: str) -> dict[str, Estimate]:
    """Medians with intervals over the runs (two or more), else over the measured steps of the one run."""
    out: dict[str, Estimate] = {}
    if len(ok) >= 2:
        for key in ESTIMATED[kind]:
            values = [row_metrics(s, None).get(key) for _, s in ok]
            if all(v is not None for v in values):
                out[key] = bootstrap_median(values, "runs")
    elif len(ok) == 1 and kind == "train":
        seconds, tokens = step_samples(Path(ok[0][0]))
        if len(seconds) >= 2:
            out["step_p50_s"] = bootstrap_median(seconds, "steps")
            out["tokens_per_s"] = bootstrap_median([t / s for t, s in zip(tokens, seconds)], "steps")
    return out


def step_samples(run_dir: Path) -> tuple[list[float], list[int]]:
    """Per measured step: the slowest rank's seconds and the step's tokens (as the summary counts them)."""
    from llmadapt.contract.readback import load_records

    try:
        records = load_records(run_dir)
        launch = RunDir(run_dir).read_launch()
    except (OSError, ValueError, LlmadaptError):
        return [], []
    w = launch.require_workload()
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r["type"] == "step" and not r["warmup"] and not (r.get("profiled") and not w.profile.in_statistics):
            by_step.setdefault(r["step"], []).append(r)
    complete = [v for _, v in sorted(by_step.items()) if len(v) == w.world_size]
    model_parallel = w.parallelism.tp * w.parallelism.pp
    return ([max(r["seconds"] for r in v) for v in complete],
            [sum(r["tokens"] for r in v) // model_parallel for v in complete])


def compare_stored(query: str | None = None, *, root: str | Path = "runs") -> Comparison:
    """A comparison of runs already in the store under ROOT that match QUERY (see analysis.store.Query): one row
    per cell (adapter, layout, workload, machine), its runs as repeats; grouped by problem."""
    from llmadapt.analysis.store import RunStore

    with RunStore(root) as store:
        found = store.runs(query)
    if not found:
        raise LlmadaptError(f"no stored run in {root} matches {query or '(all runs)'}")
    machines = {r.machine for r in found if r.machine}  # an imported result's machine is not known: ''
    groups: dict[tuple[str, ...], list[Any]] = {}
    for r in found:
        groups.setdefault((r.problem_hash, r.adapter, r.layout, r.workload_hash, r.machine), []).append(r)
    rows, baselines, workloads, notes = [], {}, {}, {}
    problems = list(dict.fromkeys(r.problem_hash for r in found))
    keys = sorted(groups, key=lambda k: problems.index(k[0]))
    labels = distinct_labels([(groups[k][0].layout, labelled_by(groups[k][0].summary, groups[k][0].workload))
                              for k in keys])
    for key, label in zip(keys, labels):
        runs = groups[key]
        label += f" @{runs[0].machine}" if len(machines) > 1 and runs[0].machine else ""
        name = runs[0].row.get("name") or ""
        rows.append(row_of_runs(label, runs[0].adapter, name, runs[0].layout,
                                [(str(r.folder), r.summary) for r in runs], baselines, machine=runs[0].machine,
                                layout=runs[0].layout))
        workload = workloads.setdefault(runs[0].problem_hash, Workload.from_dict(runs[0].workload))
        if runs[0].summary.get("measured_by") and workload.problem_hash != runs[0].problem_hash:
            from llmadapt.contract.foreign import AS_FILE_STATES

            notes[runs[0].problem_hash] = (f" {AS_FILE_STATES} ({runs[0].summary['measured_by']}; imported without "
                                           "a workload, so no llmadapt run's problem)")
    return Comparison(rows=rows, workloads=workloads, problem_notes=notes)


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
    if any(b.get("module_operators") for _, b in rows):
        # the pairs that hold at least 2% of some run's step, module by module in the taxonomy's order
        big = {c["name"] for _, b in rows for c in b.get("module_operators", [])
               if c["seconds"] >= 0.02 * sum(x["seconds"] for x in b["module_operators"])}
        order = tuple(n for m in MODULE_CLASSES for n in sorted(big) if n.rsplit("/", 1)[0] == m)
        kept = [(label, {**b, "module_operators": [c for c in b.get("module_operators", []) if c["name"] in big]},
                 sum(c["seconds"] for c in b.get("module_operators", []))) for label, b in rows]
        body = [[name] + [cell(next((c["seconds"] for c in b["module_operators"] if c["name"] == name), None),
                               total) for _, b, total in kept] for name in order]
        lines += [""] + text_table(["module/operator (2% or more), ms (share)"] + [label for label, _ in rows], body)
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
