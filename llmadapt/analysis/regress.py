"""Regression checks: did a change make a stack slower, hungrier or worse? Two sets of stored runs (a baseline and a
candidate, each a store query) are matched cell by cell (adapter, layout, workload) and compared metric by metric
(``analysis.store.METRICS``: step time, throughput, memory, loss; for serving TTFT, TPOT, ITL, E2EL, goodput).

Each metric's samples are its values over a side's runs (repeats), one value a run for every metric: like with
like, so that tokens/s and samples/s of the same runs cannot disagree. Timing figures (step time, throughput,
latency, MFU, energy) need enough runs a side for the test to reach alpha (4 a side at 0.05: ``decidable``): steps
of one run are not independent samples (pooled, two identical runs once read as a 29% "improvement" at p 0.025),
and with fewer runs the verdict is "too few runs".
The Mann-Whitney U test (rank-based, as google/benchmark's compare.py uses: one stalled run moves it little) says
whether the candidate differs beyond noise; a change is a regression when it is worse (by the metric's direction)
by more than the threshold *and* the test says so (one-sided p below alpha). A deterministic figure with one
sample a side (memory, loss of one run each) cannot be tested: it counts as a regression when worse beyond the
threshold, and says it was not tested.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import attrs

from llmadapt.analysis.store import METRICS, Query, RunStore, StoredRun
from llmadapt.analysis.uncertainty import mann_whitney_greater
from llmadapt.errors import LlmadaptError
from llmadapt.texttable import text_table

DETERMINISTIC = ("peak_memory_bytes", "first_loss", "last_loss", "expert_cv")
"""Figures a rerun repeats (the same problem, the same layout): judged on one run a side. The rest are timings."""


def decidable(n1: int, n2: int, alpha: float) -> bool:
    """Whether runs of this many a side can show a difference at all: the smallest one-sided p the rank test can
    give (every candidate run beyond every baseline run) is 1 / C(n1 + n2, n1); three a side cannot reach 0.05."""
    return 1 / math.comb(n1 + n2, n1) < alpha


@attrs.frozen
class Change:
    cell: str
    metric: str
    baseline: float
    candidate: float
    change: float
    """Candidate over baseline, minus 1."""
    worse: bool
    p: float | None
    """One-sided p-value of the candidate being worse; None when untested."""
    samples: tuple[int, int]
    verdict: str
    """'regression', 'improvement', 'within noise', 'within threshold', or 'too few runs' (a timing figure whose
    runs a side cannot reach p < alpha: not judged)."""


@attrs.frozen
class RegressReport:
    baseline: str
    candidate: str
    threshold: float
    alpha: float
    changes: list[Change]
    unmatched: list[str]

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.verdict == "regression"]

    @property
    def ok(self) -> bool:
        return not self.regressions

    def table(self) -> str:
        def fmt(v: float) -> str:
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"

        body = [[c.cell, c.metric, fmt(c.baseline), fmt(c.candidate), f"{c.change:+.1%}",
                 "-" if c.p is None else f"{c.p:.3g}", f"{c.samples[0]}/{c.samples[1]}", c.verdict]
                for c in self.changes]
        lines = text_table(["cell", "metric", "baseline", "candidate", "change", "p (worse)", "n", "verdict"], body)
        lines.append(f"baseline: {self.baseline}; candidate: {self.candidate}; threshold {self.threshold:.0%}, "
                     f"alpha {self.alpha} (Mann-Whitney U over runs, one-sided; medians shown; n: runs per side)")
        undecided = sorted({c.metric for c in self.changes if c.verdict == "too few runs"})
        if undecided:
            lines.append(f"too few runs to decide {', '.join(undecided)}: the rank test over runs cannot reach "
                         f"p < {self.alpha} with these counts (4 a side can); a run's steps are not independent "
                         "samples")
        lines += [f"only on one side: {u}" for u in self.unmatched]
        n = len(self.regressions)
        lines.append(f"{n} regression(s)" + (": " + "; ".join(f"{c.cell} {c.metric} {c.change:+.1%}"
                                                             for c in self.regressions) if n else ""))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "ok": self.ok, "regressions": len(self.regressions)}


def _cell(run: StoredRun) -> tuple[str, str, str]:
    return run.adapter, run.layout, run.workload_hash


def regress(baseline: str, candidate: str, *, root: str | Path = "runs", threshold: float = 0.05,
            alpha: float = 0.05, metrics: list[str] | None = None) -> RegressReport:
    """Compare the candidate runs against the baseline runs, both stored under ROOT (see the module doc)."""
    if not 0 <= threshold < 10:
        raise LlmadaptError(f"threshold must be a fraction >= 0, e.g. 0.05 for 5% (got {threshold})")
    unknown = [m for m in metrics or [] if m not in METRICS and not m.startswith("breakdown.")]
    if unknown:
        raise LlmadaptError(f"unknown metric {unknown[0]!r}; known: {', '.join(METRICS)}")
    with RunStore(root) as store:
        base = store.runs(Query(Query.parse(baseline).terms + (("status", "ok"),)))
        cand = store.runs(Query(Query.parse(candidate).terms + (("status", "ok"),)))
    if not base:
        raise LlmadaptError(f"no finished run in {root} matches the baseline {Query.parse(baseline)}")
    if not cand:
        raise LlmadaptError(f"no finished run in {root} matches the candidate {Query.parse(candidate)}")
    groups: dict[tuple[str, str, str], tuple[list[StoredRun], list[StoredRun]]] = {}
    for side, runs in ((0, base), (1, cand)):
        for r in runs:
            groups.setdefault(_cell(r), ([], []))[side].append(r)
    both = {k: v for k, v in groups.items() if v[0] and v[1]}
    unmatched = [f"{k[1]} {k[2][:8]} ({'baseline' if v[0] else 'candidate'})" for k, v in groups.items() if k not in both]
    if not both:
        raise LlmadaptError("no cell (adapter, layout, workload) has runs in both the baseline and the candidate: "
                            "nothing to compare")
    changes = []
    for key, (a_runs, b_runs) in sorted(both.items()):
        names = metrics or [m for m in METRICS if all(m in r.metrics for r in a_runs + b_runs)]
        for name in names:
            a = [r.metrics[name] for r in a_runs if name in r.metrics]
            b = [r.metrics[name] for r in b_runs if name in r.metrics]
            if not a or not b:
                continue
            changes.append(_judge(f"{key[1]} {key[2][:8]}", name, a, b, threshold, alpha))
    if not changes:
        raise LlmadaptError("the baseline and candidate runs share no metric"
                            + (f" among {', '.join(metrics)}" if metrics else "") + ": nothing to compare")
    return RegressReport(str(Query.parse(baseline)), str(Query.parse(candidate)), threshold, alpha, changes, unmatched)


def _judge(cell: str, metric: str, a: list[float], b: list[float], threshold: float, alpha: float) -> Change:
    ma, mb = statistics.median(a), statistics.median(b)
    change = mb / ma - 1 if ma else (0.0 if mb == ma else float("inf"))
    lower_is_better = METRICS.get(metric, ("", "lower"))[1] == "lower"
    worse = change > 0 if lower_is_better else change < 0
    if metric not in DETERMINISTIC and not decidable(len(a), len(b), alpha):
        return Change(cell, metric, ma, mb, change, worse, None, (len(a), len(b)), "too few runs")
    if len(a) < 2 and len(b) < 2:  # one value a side: nothing to test it by
        p = None
        beyond = abs(change) > threshold
        verdict = ("regression" if worse else "improvement") if beyond else "within threshold"
    else:
        greater = mann_whitney_greater(a, b)  # the candidate's values tend to be larger
        less = mann_whitney_greater(b, a)
        p = greater if lower_is_better else less  # the candidate being worse
        significant = (p if worse else (less if lower_is_better else greater)) < alpha
        if significant and abs(change) > threshold:
            verdict = "regression" if worse else "improvement"
        else:
            verdict = "within noise" if not significant else "within threshold"
    return Change(cell, metric, ma, mb, change, worse, p, (len(a), len(b)), verdict)
