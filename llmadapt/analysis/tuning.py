"""A tune's answer, as data first: the best configuration per stack, the ranking across stacks with the verdict's
rules, the throughput-against-memory Pareto front, every probe's estimate beside its measurement, what the search
cost against a full grid, and each winner's parity certificate. ``TuneResult.text()`` renders it; the search itself
is ``llmadapt.experiments.tune``.

Every objective is ranked as a cost to minimise, the step time scaled by what the objective weighs: at one global
batch (every candidate of a tune runs the same problem) tokens/s is the inverse of the step time, tokens/s per GiB
weighs it by the peak memory per rank, cost per token by the devices paid for.
"""

from __future__ import annotations

from typing import Any

import attrs

from llmadapt.analysis.comparison import Row
from llmadapt.analysis.paritycheck import loss_parity
from llmadapt.analysis.uncertainty import Estimate
from llmadapt.analysis.verdict import slower_than

OBJECTIVES = {
    "tokens_per_s": "tokens/s (highest)",
    "step_time": "step time (lowest)",
    "tokens_per_s_per_gib": "tokens/s per GiB of peak memory per rank (highest)",
    "cost_per_token": "cost per token at the given price per device-hour (lowest)",
}


def _weight(row: Row, objective: str, price: float | None) -> float | None:
    if objective in ("tokens_per_s", "step_time"):
        return 1.0
    if objective == "tokens_per_s_per_gib":
        mib = row.metrics.get("peak_memory_mib")
        return mib / 1024 if isinstance(mib, (int, float)) and mib > 0 else None
    devices = row.metrics.get("devices") or 1
    return float(devices) * (price or 0.0)


def score(row: Row, objective: str, price: float | None = None) -> Estimate | None:
    """The row's cost to minimise, as a median with its interval (the step time's, weighed); None where not
    measured."""
    step = row.estimates.get("step_p50_s")
    weight = _weight(row, objective, price)
    if step is None or weight is None or row.status != "ok":
        return None
    return attrs.evolve(step, median=step.median * weight, low=step.low * weight, high=step.high * weight,
                        samples=tuple(s * weight for s in step.samples))


@attrs.frozen
class Probed:
    """A candidate the search ran: its row (over its runs), why it was dropped (round, reason) if it was."""

    candidate: Any = attrs.field(repr=False)
    row: Row
    dropped: tuple[int, str] | None
    wall_s: float
    losses: list = attrs.Factory(list)
    """The first run's losses, for the parity certificate."""


@attrs.frozen
class Ranked:
    label: str
    adapter: str
    cell: str
    runs: int
    median: float
    low: float
    high: float
    versus_best: str
    """'fastest', 'cannot be told apart', or '+12% (8%-16%)' (the interval from the two rows' intervals)."""
    workload_file: str | None
    parity: str | None
    """The certificate: the winner's losses against the workload as given on the first adapter."""
    tied_with: list[str] = attrs.Factory(list)
    """The stack's other standing candidates that cannot be told apart from its best: the choice among them is
    not decided by the measurements (more budget, more runs, or, where either ran on a disturbed machine, a quiet
    one). A dropped one is not among them: the race told it apart (its outcome says from what)."""


@attrs.frozen
class TuneResult:
    objective: str
    strategy: str
    budget_s: float
    spent_s: float
    grid_estimate_s: float | None
    """Every candidate probed as many times as the winner was, at the median probe's wall time."""
    enumerated: int
    pruned: dict[str, int]
    order: str
    candidates: int
    probes: int
    unprobed: int
    ranking: list[Ranked]
    verdict: str
    pareto: list[str]
    """Labels on the tokens/s against peak memory front (none faster with less memory)."""
    rows: list[dict[str, Any]]
    """Every probed candidate: estimate beside measurement, runs, dropped or not."""
    folder: str
    predicted_slower: int = 0
    """``model``: candidates not probed because the corrected estimate predicted them slower."""

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def text(self) -> str:
        from llmadapt.texttable import text_table

        lines = [f"{self.candidates} candidates of {self.enumerated} configurations ({self.pruned_text()}), "
                 f"{len(self.rows)} probed; ordered {self.order}"]
        body = [[r["label"], str(r["runs"]), r["status"], _s(r["estimate_step_s"]), _s(r["step_p50_s"]),
                 _n(r["tokens_per_s"]), _n(r["peak_memory_mib"]), r["outcome"]] for r in self.rows]
        lines += text_table(["candidate", "runs", "status", "est step s", "step p50 s", "tokens/s", "peak MiB",
                             "outcome"], body)
        lines.append(f"best per stack, by {OBJECTIVES[self.objective]}:")
        lines += text_table(["stack", "best", "runs", "vs best", "workload file", "parity"],
                            [[r.adapter, r.label, str(r.runs), r.versus_best, r.workload_file or "-",
                              r.parity or "-"] for r in self.ranking])
        lines += [f"{r.adapter}: {r.label} cannot be told apart from {', '.join(r.tied_with)} (undecided: more "
                  "budget or runs to separate them)" for r in self.ranking if r.tied_with]
        lines.append(self.verdict)
        lines.append("Pareto front (tokens/s against peak memory per rank): " + (", ".join(self.pareto) or "none"))
        grid = (f"; a full grid at the same depth: about {self.grid_estimate_s / 60:.0f} min"
                if self.grid_estimate_s else "")
        lines.append(f"{self.strategy}: {self.probes} probes in {self.spent_s / 60:.1f} min of a "
                     f"{self.budget_s / 60:.0f} min budget{grid}"
                     + (f"; {self.unprobed} candidates not probed (budget)" if self.unprobed else "")
                     + (f"; {self.predicted_slower} not probed, predicted slower by the corrected estimate"
                        if self.predicted_slower else ""))
        lines.append(f"tune folder: {self.folder}")
        return "\n".join(lines)

    def pruned_text(self) -> str:
        total = sum(self.pruned.values())
        return f"{total} pruned: " + ", ".join(f"{n} {k}" for k, n in self.pruned.items()) if total else "none pruned"


def _s(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) else "-"


def _n(v: Any) -> str:
    return f"{v:,.0f}" if isinstance(v, (int, float)) else "-"


def answer(probed: list[Probed], space: Any, *, objective: str, strategy: str, budget_s: float, spent_s: float,
           folder: str, reference: Probed | None, price_per_hour: float | None, unprobed: int = 0,
           predicted_slower: int = 0) -> TuneResult:
    """The answer from the probes: per stack its best (the lowest cost among its measured candidates), the stacks'
    bests ranked by the verdict's rules, each with the workload file it is to be written to (FOLDER/best-ADAPTER.json,
    by the search) and its parity certificate."""
    from pathlib import Path

    scored = [(p, score(p.row, objective, price_per_hour)) for p in probed]
    measured = [(p, s) for p, s in scored if s is not None]
    best_of: dict[str, tuple[Probed, Estimate]] = {}
    for p, s in measured:
        if p.candidate.adapter not in best_of or s.median < best_of[p.candidate.adapter][1].median:
            best_of[p.candidate.adapter] = (p, s)
    stacks = sorted(best_of.values(), key=lambda ps: ps[1].median)
    ranking, verdict = [], "no candidate measured: no answer"
    if stacks:
        top = stacks[0][1]
        for p, s in stacks:
            file = Path(folder) / f"best-{p.candidate.adapter}.json"
            # standing ones only: a dropped candidate's reason says what it was slower than, on its own runs. On a
            # disturbed machine's runs nothing is told apart, as the verdict across stacks withholds on them
            tied = [q.row.label for q, t in measured if q.candidate.adapter == p.candidate.adapter and q is not p
                    and q.dropped is None and (p.row.disturbed or q.row.disturbed or not slower_than(t, s))]
            ranking.append(Ranked(p.row.label, p.candidate.adapter, p.candidate.cell, len(p.row.run_dirs) or 1,
                                  s.median, s.low, s.high, _versus(p, s, top, p is stacks[0][0]), str(file),
                                  _certificate(p, reference), tied))
        verdict = _verdict(stacks)
    grid = None
    if probed and stacks:
        walls = sorted(p.wall_s / max(1, len(p.row.run_dirs)) for p in probed)
        grid = len(space.candidates) * ranking[0].runs * walls[len(walls) // 2]
    rows = [_row_dict(p, s) for p, s in scored]
    return TuneResult(objective=objective, strategy=strategy, budget_s=budget_s, spent_s=spent_s,
                      grid_estimate_s=grid, enumerated=space.enumerated, pruned=space.reasons(), order=space.order,
                      candidates=len(space.candidates), probes=sum(len(p.row.run_dirs) or 1 for p in probed),
                      unprobed=unprobed, ranking=ranking, verdict=verdict, pareto=_pareto(measured), rows=rows,
                      folder=folder, predicted_slower=predicted_slower)


def _versus(p: Probed, s: Estimate, top: Estimate, first: bool) -> str:
    """A stack's best against the fastest. One the race dropped was told apart on its own runs (each slower beyond
    its steps' noise), which the rule over runs cannot see in two runs a side: it is slower, with the race's
    evidence, not 'cannot be told apart'."""
    if first:
        return "fastest"
    if p.dropped is not None:  # the race's evidence is its row's outcome, and the verdict's line
        return f"+{s.median / top.median - 1:.0%} (dropped by the race in round {p.dropped[0]})"
    if not slower_than(s, top):
        return "cannot be told apart"
    return (f"+{s.median / top.median - 1:.0%} ({max(0.0, s.low / top.high - 1):.0%}-"
            f"{s.high / top.low - 1:.0%})")


def _verdict(stacks: list[tuple[Probed, Estimate]]) -> str:
    """The ranking's verdict, withheld where a row ran on a disturbed machine or has a single sample."""
    rows = [p.row for p, _ in stacks]
    if len(rows) < 2:
        return f"verdict: only {rows[0].label} measured (one stack)"
    disturbed = [r.label for r in rows if r.disturbed]
    if disturbed:
        return f"verdict withheld: the machine was disturbed during {', '.join(disturbed)}; rerun on a quiet machine"
    (best, top), rest = stacks[0], stacks[1:]
    ties = [p.row.label for p, s in rest if p.dropped is None and not slower_than(s, top)]
    slower = [f"{p.row.label} by {_versus(p, s, top, False)}" + (f": {p.dropped[1]}" if p.dropped else "")
              for p, s in rest if p.dropped is not None or slower_than(s, top)]
    if ties:
        return (f"verdict: {best.row.label} cannot be told apart from {', '.join(ties)} (intervals overlap, or too "
                f"few runs to separate them)"
                + (f"; {'both' if len(ties) == 1 else 'all'} faster than {', '.join(slower)}" if slower else ""))
    return f"verdict: {best.row.label} is faster than " + ", ".join(slower)


def _certificate(p: Probed, reference: Probed | None) -> str | None:
    """The winner's losses against the reference run's (the workload as given on the first adapter)."""
    if reference is None or not reference.losses or not p.losses:
        return None
    if p.candidate.key == reference.candidate.key:
        return "the reference"
    report = loss_parity(reference.losses, p.losses)
    return ("ok" if report.ok else "FAILED") + f" (max |delta| {report.max_abs_delta:.2g} over {report.steps} steps)"


def _pareto(measured: list[tuple[Probed, Estimate]]) -> list[str]:
    points = [(p.row.label, p.row.metrics.get("tokens_per_s"), p.row.metrics.get("peak_memory_mib"))
              for p, _ in measured]
    points = [(label, t, m) for label, t, m in points if isinstance(t, (int, float)) and isinstance(m, (int, float))]
    front = [a for a in points if not any(b[1] >= a[1] and b[2] <= a[2] and b != a and (b[1] > a[1] or b[2] < a[2])
                                          for b in points)]
    return [label for label, _, _ in sorted(front, key=lambda x: -x[1])]


def _row_dict(p: Probed, s: Estimate | None) -> dict[str, Any]:
    r = p.row
    outcome = f"dropped in round {p.dropped[0]}: {p.dropped[1]}" if p.dropped else ("standing" if s else r.status)
    return {"label": r.label, "adapter": p.candidate.adapter, "cell": p.candidate.cell, "runs": len(r.run_dirs),
            "status": r.status, "estimate_step_s": p.candidate.estimate_step_s,
            "estimate_memory_mib": p.candidate.estimate_bytes / 2**20 if p.candidate.estimate_bytes else None,
            "step_p50_s": r.metrics.get("step_p50_s"), "tokens_per_s": r.metrics.get("tokens_per_s"),
            "peak_memory_mib": r.metrics.get("peak_memory_mib"), "score": attrs.asdict(s) if s else None,
            "outcome": outcome, "run_dirs": r.run_dirs}



# -- serving --------------------------------------------------------------------------------------------------
@attrs.frozen
class ServeCandidate:
    """One engine configuration's SLA search: its capacity (the highest load every probe of which met every
    objective), the lowest load above it that failed, and the first objective's figure at the capacity."""

    adapter: str
    label: str
    settings: tuple[str, ...]
    capacity: float | None
    above: float | None
    latency_ms: float | None
    folder: str
    wall_s: float
    note: str = ""
    workload: Any = attrs.field(default=None, repr=False, eq=False)


@attrs.frozen
class ServeRanked:
    adapter: str
    label: str
    capacity: float | None
    above: float | None
    versus_best: str
    workload_file: str | None


@attrs.frozen
class ServeTuneResult:
    over: str
    objectives: list[str]
    budget_s: float
    spent_s: float
    candidates: int
    searched: list[dict[str, Any]]
    ranking: list[ServeRanked]
    verdict: str
    pareto: list[str]
    """Labels on the capacity against latency-at-capacity front (none with more capacity at less latency)."""
    folder: str
    strategy: str = "grid"
    """race: an engine's configurations after its first searched from its best capacity so far; grid: each from the
    start load (``llmadapt.experiments.tuneserve``)."""

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def text(self) -> str:
        from llmadapt.texttable import text_table

        unit = "req/s" if self.over == "rate" else "in flight"
        lines = [f"{len(self.searched)} of {self.candidates} engine configurations searched; objectives: "
                 + ", ".join(self.objectives)]
        lines += text_table(["configuration", f"capacity {unit}", "fails at", "latency at capacity ms", "search min",
                             "note"],
                            [[s["label"], _capacity(s["capacity"], s["above"]), _g(s["above"]), _g(s["latency_ms"]),
                              f"{s['wall_s'] / 60:.1f}", s["note"]] for s in self.searched])
        lines.append("best per engine:")
        lines += text_table(["engine", "best", f"capacity {unit}", "vs best", "workload file"],
                            [[r.adapter, r.label, _capacity(r.capacity, r.above), r.versus_best, r.workload_file or "-"]
                             for r in self.ranking])
        lines.append(self.verdict)
        lines.append("Pareto front (capacity against latency at capacity): " + (", ".join(self.pareto) or "none"))
        lines.append(f"{self.strategy}: {self.spent_s / 60:.1f} min of a {self.budget_s / 60:.0f} min budget; tune "
                     f"folder: {self.folder}")
        return "\n".join(lines)


def _g(v: Any) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else "-"


def _capacity(capacity: float | None, above: float | None) -> str:
    """A capacity that never failed is the search's maximum, a lower bound: '>=1024'."""
    return f">={capacity:g}" if capacity is not None and above is None else _g(capacity)


def capacity_apart(best: ServeCandidate, other: ServeCandidate) -> bool:
    """Whether ``other`` has less capacity than ``best`` beyond the search's resolution: it failed at a load the best
    passed at every probe. Where its failing load is above the best's capacity, both boundaries may lie in one
    bracket: they cannot be told apart."""
    return best.capacity is not None and (other.capacity is None or
                                          (other.above is not None and other.above <= best.capacity))


def serve_answer(searched: list[ServeCandidate], *, over: str, objectives: list[str], budget_s: float,
                 spent_s: float, candidates: int, folder: str, strategy: str = "grid") -> ServeTuneResult:
    from pathlib import Path

    best_of: dict[str, ServeCandidate] = {}
    for c in searched:
        if c.capacity is not None and (c.adapter not in best_of or c.capacity > best_of[c.adapter].capacity):
            best_of[c.adapter] = c
    stacks = sorted(best_of.values(), key=lambda c: -(c.capacity or 0.0))
    # A best that never failed met the objectives up to the search's maximum: its capacity is a lower bound, and so
    # is every difference from it.
    unbounded = bool(stacks) and stacks[0].above is None
    ranking = [ServeRanked(c.adapter, c.label, c.capacity, c.above,
                           "highest" if i == 0 else (("<= " if unbounded else "")
                                                     + f"{c.capacity / stacks[0].capacity - 1:+.0%}"
                                                     if capacity_apart(stacks[0], c) else "cannot be told apart"),
                           str(Path(folder) / f"best-{c.adapter}.json")) for i, c in enumerate(stacks)]
    if not stacks:
        verdict = "no configuration met the objectives at any load tried: no answer"
    elif len(stacks) == 1:
        verdict = f"verdict: only {stacks[0].label} met the objectives (one engine)"
    else:
        ties = [c.label for c in stacks[1:] if not capacity_apart(stacks[0], c)]
        lower = [c.label for c in stacks[1:] if capacity_apart(stacks[0], c)]
        if unbounded:
            verdict = (f"verdict: {stacks[0].label} met the objectives at every load tried, up to the search's "
                       f"maximum ({stacks[0].capacity:g}): its capacity is at least that"
                       + (f"; so did {', '.join(ties)} (raise --max or tighten the objectives to rank them)"
                          if ties else ""))
        else:
            verdict = (f"verdict: {stacks[0].label} has the highest capacity ({stacks[0].capacity:g})"
                       + (f"; cannot be told apart at the search's resolution: {', '.join(ties)}" if ties else ""))
        verdict += f"; lower beyond it: {', '.join(lower)}" if lower else ""
    points = [c for c in searched if c.capacity is not None and c.latency_ms is not None]
    front = [c for c in points if not any(o is not c and o.capacity >= c.capacity and o.latency_ms <= c.latency_ms
                                          and (o.capacity > c.capacity or o.latency_ms < c.latency_ms)
                                          for o in points)]
    return ServeTuneResult(over=over, objectives=objectives, budget_s=budget_s, spent_s=spent_s,
                           candidates=candidates,
                           searched=[attrs.asdict(c, filter=lambda a, _: a.name != "workload") for c in searched],
                           ranking=ranking, verdict=verdict,
                           pareto=[c.label for c in sorted(front, key=lambda c: -c.capacity)], folder=folder,
                           strategy=strategy)
