"""A comparison's answers as data: the verdict per problem (the fastest row, the rows within noise of it, how much
slower the others are, or why no verdict is given) and how the step scales with devices (strong and weak scaling,
per stack and technique). ``Comparison`` (analysis.comparison) renders its lines from these, and puts them in its
``to_dict`` (``compare --json``, the saved compare file) and the report.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import attrs

from llmadapt.analysis.uncertainty import Estimate, mann_whitney_greater

RUNS_TO_SEPARATE = 4
"""Runs a row needs before the verdict may name it faster or slower over runs: with three a side, two identical
configurations' runs fall wholly apart one time in ten (2/C(6,3)); with four, one in 35 (2/C(8,4) < 5%)."""

ALPHA = 0.05
"""The chance the verdict accepts, of telling apart two rows that cost the same, at one look at them."""


def looks(max_runs: int) -> tuple[int, float]:
    """A ranking judged again after each round (``compare --repeat auto``) looks many times, and each look is one
    more chance to tell two rows of the same cost apart by luck (at ``ALPHA`` a look, about 11% over rounds 4 to 10).
    So the looks share ``ALPHA`` (Bonferroni): returns the first number of runs a row at which the ranking is judged
    and the level each look is judged at, so that over every look up to ``max_runs`` runs a row the chance stays
    under ``ALPHA``. The first look is the first at which the exact test can reach its level at all: with n runs a
    row the smallest two-sided p of the Mann-Whitney test is 2 / C(2n, n)."""
    for first in range(RUNS_TO_SEPARATE, max_runs):
        level = ALPHA / (max_runs - first + 1)
        if 2 / math.comb(2 * first, first) < level:
            return first, level
    return max(RUNS_TO_SEPARATE, max_runs), ALPHA

SUPERLINEAR = 1.1
"""Scaling efficiency above which a figure is marked: more than linear, which the same work on more devices cannot
be (the rows ran under unlike conditions)."""


def told_apart(a: Estimate, b: Estimate, alpha: float = ALPHA) -> bool:
    """Whether two rows differ beyond noise. Over runs (both rows repeated): the two-sided Mann-Whitney test on the
    runs' values at ``alpha`` (``ALPHA``; a sequential look's share of it: ``looks``) (with four runs a row it needs every run of one below every run of the other; with
    five, one pair may cross), and never with fewer than ``RUNS_TO_SEPARATE`` runs a row. Over the steps of one run
    each: the 95% intervals do not overlap."""
    if a.what == "runs" and b.what == "runs" and a.samples and b.samples:
        if min(a.n, b.n) < RUNS_TO_SEPARATE:
            return False
        low = min(mann_whitney_greater(a.samples, b.samples), mann_whitney_greater(b.samples, a.samples))
        return 2 * low < alpha
    if "runs" in (a.what, b.what) and min(a.n, b.n) < RUNS_TO_SEPARATE:
        return False
    return not a.overlaps(b)


def slower_than(a: Estimate, b: Estimate, alpha: float = ALPHA) -> bool:
    """``a`` is above ``b`` beyond noise (lower is better), by ``told_apart``: the one rule by which tune's race drops
    a candidate and ``compare --repeat auto`` calls a ranking decided (at its looks' level)."""
    return a.median > b.median and told_apart(a, b, alpha)


def undecided(rows: list[tuple[str, Estimate]], alpha: float = ALPHA) -> list[tuple[str, str]]:
    """The adjacent pairs of the ranking of ROWS ((label, estimate), lower is better) that ``slower_than`` does not
    tell apart, lowest first; none: the ranking is decided."""
    ranked = sorted(rows, key=lambda r: r[1].median)
    return [(a, b) for (a, low), (b, high) in zip(ranked, ranked[1:]) if not slower_than(high, low, alpha)]


# -- the verdict ------------------------------------------------------------------------------------------------
@attrs.frozen
class Slower:
    """A row told apart from the fastest: how much slower its headline median is, with an interval."""

    label: str
    change: float
    """Its median over the fastest's, less one (0.12: 12% slower)."""
    low: float | None
    high: float | None
    """The change's interval from the two rows' 95% intervals taken at their far ends (the lowest this row could be
    over the highest the fastest could be, and the other way): wider than either, never narrower. None where the
    fastest's interval reaches zero."""


@attrs.frozen
class Verdict:
    """One problem's verdict on its headline figure (lower is better): who is fastest, who cannot be told apart from
    it, how much slower the rest are; or, ``withheld``, why no verdict is given."""

    problem: str
    """Its name in the table ('P1')."""
    problem_hash: str
    metric: str
    """The headline figure judged ('step_p50_s' for training, 'ttft_p50_ms' for serving)."""
    fastest: str | None = None
    ties: list[str] = attrs.Factory(list)
    """The rows that cannot be told apart from the fastest."""
    slower: list[Slower] = attrs.Factory(list)
    withheld: str | None = None
    """Why there is no verdict (a disturbed machine, a single sample); None when there is one."""
    over: str = ""
    """What the medians and intervals are over: 'runs' or 'steps'."""
    rank_test: bool = False
    """Rows told apart by a two-sided Mann-Whitney test over their runs (else by 95% intervals that do not overlap)."""
    few_runs: list[str] = attrs.Factory(list)
    """Rows with fewer than ``RUNS_TO_SEPARATE`` runs: never named faster or slower over runs."""
    unjudged: list[str] = attrs.Factory(list)
    """Rows whose machine's quiet was not judged (measured steps too short)."""
    rows: int = 0
    """How many rows were judged."""
    gated: list[str] = attrs.Factory(list)
    """Rows below the quality gate (``quality_gate``), with why: not to be read as faster."""

    def text(self) -> str:
        """The verdict's line under the comparison table."""
        if self.withheld:
            return f"{self.problem} verdict withheld: {self.withheld}"
        line = f"{self.problem} verdict: fastest {self.fastest}"
        if self.ties:
            line += f"; cannot be told apart from it: {', '.join(self.ties)}"
        if self.slower:
            line += "; slower: " + ", ".join(f"{s.label} {s.change:+.0%}" for s in self.slower)
        line += (" (medians and 95% intervals over runs; told apart by a two-sided Mann-Whitney test over the "
                 f"runs, p < {ALPHA})" if self.rank_test else f" (medians and 95% intervals over {self.over})")
        if self.few_runs:
            line += (f"; {RUNS_TO_SEPARATE} runs a row are needed to tell rows apart over runs, fewer for "
                     f"{', '.join(self.few_runs)}")
        if self.gated:
            line += "; below the quality gate, so not faster for it: " + ", ".join(self.gated)
        if self.unjudged:
            which = "every row" if len(self.unjudged) == self.rows else ", ".join(self.unjudged)
            line += (f"; the machine's quiet not judged for {which}: measured steps under half a second "
                     "(more train.steps to judge)")
        return line


def verdict(name: str, problem: str, rows: list[Any], key: str) -> Verdict | None:
    """The verdict over a problem's ROWS (``Row``: those that ran ok), on the figure KEY; None with fewer than two
    rows that have it. No verdict where a row's runs ran on a disturbed machine, or where a row has a single sample
    (no interval to judge by)."""
    rows = [r for r in rows if r.estimates.get(key)]
    if len(rows) < 2:
        return None
    gated = [f"{r.label} ({r.metrics['quality_gate']})" for r in rows
             if r.metrics.get("quality_gate") not in (None, "pass")]
    base = dict(problem=name, problem_hash=problem, metric=key, rows=len(rows), gated=gated)
    disturbed = [r for r in rows if r.disturbed]
    if disturbed:
        runs = sum(len(r.disturbed) for r in disturbed)
        return Verdict(**base, withheld=f"the machine was disturbed during {', '.join(r.label for r in disturbed)} "
                       f"({runs} run(s); {disturbed[0].disturbed[0]}{', ...' if runs > 1 else ''}); rerun on a "
                       "quiet machine")
    lone = [r.label for r in rows if r.estimates[key].n < 2]
    if lone:
        return Verdict(**base, withheld=f"a single sample, no interval to judge by: {', '.join(lone)}")
    best = min(rows, key=lambda r: r.estimates[key].median)
    b = best.estimates[key]
    ties = [r for r in rows if r is not best and not told_apart(r.estimates[key], b)]
    slower = []
    for r in rows:
        if r is not best and r not in ties:
            e = r.estimates[key]
            slower.append(Slower(r.label, e.median / b.median - 1, e.low / b.high - 1 if b.high else None,
                                 e.high / b.low - 1 if b.low else None))
    return Verdict(**base, fastest=best.label, ties=[r.label for r in ties], slower=slower, over=b.what,
                   rank_test=all(r.estimates[key].what == "runs" and r.estimates[key].samples for r in rows),
                   few_runs=[r.label for r in rows if r.estimates[key].what == "runs"
                             and r.estimates[key].n < RUNS_TO_SEPARATE],
                   unjudged=[r.label for r in rows if not r.judged])


# -- the quality gate ---------------------------------------------------------------------------------------------
def quality_gate(q: Any) -> str:
    """'pass', or why a serving row's quality (a Quality record) fails the gate, as MLPerf's accuracy targets do:
    its same-top-token share (its identical-response share where the engine returned no log-probabilities) below
    ``gate_min_share`` of the reference's (the reference agrees with itself fully: 1.0), or its greedy responses'
    output tokens per request more than ``gate_output_tolerance`` away from the reference's. A row that answers
    shorter or worse does not pass as faster."""
    why = []
    share, what = (q.same_top_share, "same top token") if q.same_top_share is not None else \
        (q.identical_share, "identical responses")
    if share < q.gate_min_share:
        why.append(f"{what} {share:.1%} < {q.gate_min_share:.0%}")
    ref, out = q.reference_output_tokens_mean, q.output_tokens_mean
    if ref and out is not None and abs(out / ref - 1) > q.gate_output_tolerance:
        why.append(f"output tokens {out:.1f} vs reference {ref:.1f} (> {q.gate_output_tolerance:.0%} apart)")
    return "; ".join(why) or "pass"


def quality_line(q: dict) -> str:
    """``show``'s line for a serving run's quality (the summary's, as JSON), and its gate."""
    from llmadapt.contract.launch import structure
    from llmadapt.contract.records import Quality

    line = (f"quality    {q['identical']}/{q['texts']} greedy responses identical to {q['reference']}'s; output "
            f"tokens {q['output_tokens_mean'] or 0:.1f} vs {q['reference_output_tokens_mean']:.1f}")
    if q.get("kl_mean") is not None:
        line += (f"; same top token {q['same_top_share']:.1%}, KL {q['kl_mean']:.2e} (top-{q['top_logprobs']}, a "
                 f"lower bound), ppl {q['perplexity']:.3f} vs {q['reference_perplexity']:.3f} over {q['positions']} "
                 "positions")
    line += f"; gate: {quality_gate(structure(Quality, q, 'quality'))}"
    return line + (f" ({q['note']})" if q.get("note") else "")


# -- scaling ----------------------------------------------------------------------------------------------------
@attrs.frozen
class ScalingPoint:
    """One row's scaling against the row of its group with the fewest devices."""

    problem: str
    label: str
    stack: str
    """The group: the row's stack and techniques, its layout less the parallel layout ('deepspeed zero3')."""
    devices: int
    scaling: str
    """'strong' (one problem on more devices: step time against the fewest devices') or 'weak' (the global batch
    grown with the devices: tokens/s per device against the fewest devices')."""
    speedup: float
    efficiency: float
    """Speedup over the device ratio (strong), or tokens/s per device over the base's (weak); 1.0 is linear."""
    against: str
    """The label of the row it is set against."""
    disturbed: bool = False
    """The row's (or the base's) runs measured on a disturbed machine: its figure is not to be trusted."""

    @property
    def superlinear(self) -> bool:
        return self.efficiency > SUPERLINEAR


def without_layout(label: str) -> str:
    """A row's layout label less its parallel layout (tpN, ppN, dpN, epN) and micro-batch (mbN): the stack and the
    techniques it ran with, which a scaling group shares."""
    return " ".join(w for w in label.split() if not re.fullmatch(r"(tp|pp|dp|ep|mb)\d+", w))


def _median(row: Any, key: str) -> float | None:
    estimate = row.estimates.get(key)
    value = estimate.median if estimate else row.metrics.get(key)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def scaling(rows: list[Any], problems: dict[str, str], workloads: dict[str, Any]) -> list[ScalingPoint]:
    """How the step scales with devices, where ROWS allow: strong scaling within a problem (the same global batch on
    more devices: speedup of the step time against the row with the fewest devices, efficiency = speedup over the
    device ratio); weak scaling across problems that differ in global batch alone, grown with the devices (tokens/s
    per device against the fewest devices'). Each within rows of one stack and its techniques."""
    ok = [r for r in rows if r.status == "ok" and r.metrics.get("devices") and _median(r, "step_p50_s")
          and _median(r, "tokens_per_s")]
    out = []
    for h in problems:
        groups: dict[str, list[Any]] = {}
        for r in ok:
            if r.problem_hash == h:
                groups.setdefault(without_layout(r.layout or r.label), []).append(r)
        for stack, group in groups.items():
            if len({r.metrics["devices"] for r in group}) < 2:
                continue
            base = min(group, key=lambda r: (r.metrics["devices"], group.index(r)))
            for r in group:
                speedup = _median(base, "step_p50_s") / _median(r, "step_p50_s")
                out.append(ScalingPoint(problems[h], r.label, stack, r.metrics["devices"], "strong", speedup,
                                        speedup / (r.metrics["devices"] / base.metrics["devices"]), base.label,
                                        bool(r.disturbed or base.disturbed)))
    for stack, group in _weak_groups(ok, workloads):
        base = min(group, key=lambda r: r.metrics["devices"])
        per_device = _median(base, "tokens_per_s") / base.metrics["devices"]
        for r in group:
            mine = _median(r, "tokens_per_s") / r.metrics["devices"]
            out.append(ScalingPoint(problems[r.problem_hash], r.label, stack, r.metrics["devices"], "weak",
                                    _median(r, "tokens_per_s") / _median(base, "tokens_per_s"), mine / per_device,
                                    base.label, bool(r.disturbed or base.disturbed)))
    return out


def _weak_groups(rows: list[Any], workloads: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """(stack, rows) of problems that differ in global batch alone, with the same batch per device, on two or more
    device counts."""
    groups: dict[str, tuple[str, list[Any]]] = {}
    for r in rows:
        w = workloads.get(r.problem_hash)
        if w is None or w.kind == "serve":
            continue
        problem = w.problem_dict()
        problem["train"] = {k: v for k, v in problem["train"].items() if k != "global_batch"}
        stack = without_layout(r.layout or r.label)
        key = json.dumps([problem, w.train.global_batch / r.metrics["devices"], stack], sort_keys=True, default=str)
        groups.setdefault(key, (stack, []))[1].append(r)
    return [(stack, g) for stack, g in groups.values() if len({r.problem_hash for r in g}) > 1
            and len({r.metrics["devices"] for r in g}) > 1]
