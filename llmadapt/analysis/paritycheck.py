"""Loss parity (the proof that a comparison is fair), as read from runs: step-by-step loss agreement within a
stated tolerance, and expert-load agreement for MoE routers. ``llmadapt.experiments.parity`` runs the two cells.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from llmadapt.analysis.report import read_summary
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, TraceMismatchError
from llmadapt.spec import problem_difference

# fp32 loss trajectories of two correct stacks differ only by floating-point reduction order
# (summation order in matmuls, all-reduce order across ranks), which the optimizer carries
# forward. On the tiny presets over tens of steps that stays below 1e-5 relative; the
# tolerance leaves a 10x margin yet catches a wrong loss normalisation, a skipped micro-batch
# or different data (all >= 1e-3 relative).
PARITY_RTOL = 1e-4


PARITY_ATOL = 1e-5


@attrs.frozen
class ParityReport:
    ok: bool
    rtol: float
    atol: float
    steps: int
    first_divergence: int | None
    """First step whose losses differ by more than atol + rtol * |reference|; None when all agree."""
    max_abs_delta: float
    reference: list[float | None]
    candidate: list[float | None]
    names: tuple[str, str] = ("reference", "candidate")
    """What ran each trajectory (`parity` gives the layouts: 'torch dp2', 'megatron tp2')."""

    def describe(self, names: tuple[str, str] | None = None) -> str:
        names = names or self.names
        if self.ok:
            return (f"parity ok: {names[1]} matches {names[0]} at all {self.steps} steps "
                    f"(max |delta| {self.max_abs_delta:.3g}; tolerance atol {self.atol:g} + rtol {self.rtol:g})")
        if self.first_divergence is None:
            return f"parity failed: {names[0]} has {len(self.reference)} steps, {names[1]} {len(self.candidate)}"
        i = self.first_divergence
        return (f"parity failed at step {i}: {names[0]} loss {self.reference[i]!r}, {names[1]} loss "
                f"{self.candidate[i]!r} (|delta| {abs((self.reference[i] or 0) - (self.candidate[i] or 0)):.3g} > "
                f"atol {self.atol:g} + rtol {self.rtol:g} x |loss|)")


def loss_parity(reference: list[float | None], candidate: list[float | None], *,
                rtol: float = PARITY_RTOL, atol: float = PARITY_ATOL) -> ParityReport:
    import math

    for name, value in (("rtol", rtol), ("atol", atol)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise LlmadaptError(f"parity {name}: got {value!r}; must be a finite number >= 0 (NaN passes everything)")
    first, worst = None, 0.0
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a is None or b is None:
            first = i if first is None else first
            continue
        delta = abs(a - b)
        worst = max(worst, delta)
        if delta > atol + rtol * abs(a) and first is None:
            first = i
    same_length = len(reference) == len(candidate) and len(reference) > 0
    return ParityReport(ok=first is None and same_length, rtol=rtol, atol=atol, steps=min(len(reference),
                        len(candidate)), first_divergence=first, max_abs_delta=worst,
                        reference=list(reference), candidate=list(candidate))


@attrs.frozen
class ExpertLoadReport:
    """Two runs' expert loads, step by step and layer by layer.

    Exact where the routers' choices are clear; where a layer had near-ties (tokens whose k-th and
    (k+1)-th logits were within fp noise, llmadapt.adapter.moe), at most that many tokens may have moved
    between experts: moved = sum |a - b| / 2 (each moved token leaves one expert for another).
    """

    ok: bool
    steps: int
    first_mismatch: tuple[int, int] | None
    """(step, layer) of the first disagreement beyond the near-ties; None when all agree."""
    moved: int
    """At that (step, layer), the tokens that went elsewhere; 0 when all agree."""
    allowed: int
    """At that (step, layer), the near-ties (the larger of the two runs' counts)."""
    near_ties: int
    """Near-ties over all steps and layers (the larger run's, per layer)."""

    def describe(self, names: tuple[str, str] = ("reference", "candidate")) -> str:
        if self.ok:
            return (f"expert load ok: {names[1]} routes as {names[0]} at all {self.steps} steps "
                    f"({self.near_ties} near-tie tokens allowed to move)")
        if self.first_mismatch is None:
            return f"expert load failed: {names[0]} and {names[1]} report different steps or layers"
        step, layer = self.first_mismatch
        return (f"expert load failed at step {step}, layer {layer}: {self.moved} tokens routed differently, "
                f"{self.allowed} near-ties")


def expert_load_parity(reference: list[dict[str, Any]], candidate: list[dict[str, Any]]) -> ExpertLoadReport:
    """Compare the step records (rank 0's, which carry the global counts) of two MoE runs."""

    def by_step(records):
        return {r["step"]: r for r in records if r.get("type") == "step" and r.get("expert_load") is not None}

    a, b = by_step(reference), by_step(candidate)
    total_ties = 0
    if not a or a.keys() != b.keys():
        return ExpertLoadReport(False, min(len(a), len(b)), None, 0, 0, 0)
    for step in sorted(a):
        la, lb = a[step]["expert_load"], b[step]["expert_load"]
        ta = a[step].get("expert_near_ties") or [0] * len(la)
        tb = b[step].get("expert_near_ties") or [0] * len(lb)
        if len(la) != len(lb) or any(len(x) != len(y) for x, y in zip(la, lb)):
            return ExpertLoadReport(False, len(a), None, 0, 0, total_ties)
        for layer, (x, y) in enumerate(zip(la, lb)):
            moved = sum(abs(i - j) for i, j in zip(x, y)) // 2
            allowed = max(ta[layer], tb[layer])
            total_ties += allowed
            if moved > allowed or sum(x) != sum(y):
                return ExpertLoadReport(False, len(a), (step, layer), moved, allowed, total_ties)
    return ExpertLoadReport(True, len(a), None, 0, 0, total_ties)


def parity_of_runs(reference: str | Path, candidate: str | Path, *, rtol: float = PARITY_RTOL,
                   atol: float = PARITY_ATOL, allow_mismatch: bool = False) -> ParityReport:
    """Loss parity of two finished runs of one problem, whatever their adapters and layouts."""
    a, b = (read_summary(r, needs=("problem_hash", "losses")) for r in (reference, candidate))
    if a["problem_hash"] != b["problem_hash"] and not allow_mismatch:
        fields = _differing_fields(reference, candidate) or f"problem hash {a['problem_hash'][:12]} vs " \
            f"{b['problem_hash'][:12]}"
        raise TraceMismatchError(f"{reference} and {candidate} ran different problems ({fields}): their losses are "
                                 "not comparable (pass allow_mismatch to compare anyway)")
    return loss_parity(a["losses"], b["losses"], rtol=rtol, atol=atol)


def parity_of_stored(query: str, *, root: str | Path = "runs", rtol: float = PARITY_RTOL,
                     atol: float = PARITY_ATOL) -> ParityReport:
    """Loss parity of the two stored runs under ROOT that match QUERY (analysis.store.Query); any other count,
    or two different problems, is refused in one line."""
    from llmadapt.analysis.store import RunStore

    with RunStore(root) as store:
        found = store.runs(query)
    if len(found) != 2:
        raise LlmadaptError(f"parity --runs needs exactly two stored runs; {query or '(all runs)'} matches "
                            f"{len(found)} in {root}" + (": " + ", ".join(r.run_id for r in found[:4]) if found else ""))
    report = parity_of_runs(found[0].folder, found[1].folder, rtol=rtol, atol=atol)
    # the runs named in the result line: their ids and layouts (a stored run has no cell label of its own)
    return attrs.evolve(report, names=tuple(f"run {r.run_id} ({r.layout})" for r in found))


def _differing_fields(*run_dirs: str | Path) -> str:
    """'train.lr (0.001 vs 0.01)' from the runs' launch records; '' where a record cannot be read."""
    try:
        a, b = (RunDir(r).read_launch().require_workload() for r in run_dirs)
    except Exception:  # an old or damaged folder: the hashes alone say it
        return ""
    return "; ".join(problem_difference(a, b)[:4])
