"""``compare``: plan the cells of a comparison (adapters, layouts, a matrix of overrides), launch their runs
through ``llmadapt.launch.runner`` (repeated in shuffled rounds, reused from the store, settled), and keep the table
on disk as each run ends. The rows and the table they make are read in ``llmadapt.analysis.comparison``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.experiments.cells import Cell, as_cells, plan, same_threads
from llmadapt.analysis.comparison import HEADLINE, Comparison, Row, estimates_of, from_json_summary, row_of_runs
from llmadapt.contract.schema import to_json
from llmadapt.errors import LlmadaptError
from llmadapt.launch.runner import RunResult, run
from llmadapt.launch.sinks import ExperimentSinks
from llmadapt.spec import Workload


def compare(workload: Workload | str | Path, adapters: list[str] | None = None, *,
            cells: list[Cell | str] | None = None, matrix: dict[str, list[Any]] | None = None,
            refuse_unsupported: bool = False, repeat: int | str = 1, reuse: bool = False, baseline: str | None = None,
            settle: float | None = None, max_rounds: int = 10, seed: int | None = None,
            log: Callable[[str], None] | None = None, on_cell: Callable[[int, int, str], None] | None = None,
            **run_options: Any) -> Comparison:
    """Run every cell on every matrix variant, side by side; one row each, grouped by problem.

    ``adapters``: one cell per adapter, with the workload's settings (and each adapter's own: ``[adapters.NAME]``,
    ``NAME:path=value``); ``cells``: more, each an adapter with settings of its own ("megatron:parallelism.tp=2",
    or `Cell`). Every cell is resolved and checked before the first run starts (`cells.plan`): a cell an adapter
    declares it cannot run, explicit or from the ``matrix``, is a row marked unsupported, not run (counted under
    the table), unless ``refuse_unsupported``; where no cell can run, that is an error.

    ``baseline``: the row the others of its problem are set against (a cell as given, e.g. 'torch' or
    'megatron:parallelism.tp=2', or a row's label); default each problem's first row.

    ``repeat``: runs per cell, in rounds: every cell once per round, in an order shuffled anew each round
    (``seed``, recorded in the comparison; drawn when None), so that the machine's drift falls on every cell
    alike; a row then shows medians with bootstrap intervals over its whole runs. ``settle``: after ``repeat``
    rounds, more rounds until every row's headline interval is narrower than this share of its median, or
    ``max_rounds`` is reached (the rows that never settled are named). ``repeat='auto'``: rounds until the verdict
    decides the ranking (every two adjacent rows of a problem told apart by ``verdict.slower_than``, the rule tune's
    race drops a candidate by: over runs it needs ``RUNS_TO_SEPARATE`` a row), or ``max_rounds`` is spent; the
    comparison's ``stopped`` says which, naming the rows that could not be told apart. ``reuse``: runs already in the run store
    (``out``) of the same workload hash, adapter version and machine, finished ok, count towards them (the
    newest first) and are not run again. ``on_cell(done, total, title)`` follows the runs.
    """
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    auto = repeat == "auto"
    repeat, level = _check_rounds(repeat, settle, max_rounds)
    planned = plan(workload, as_cells(adapters, cells), matrix, refuse_unsupported=refuse_unsupported)
    if baseline is not None and not any(baseline in (str(p.cell), p.title) for p in planned):
        raise LlmadaptError(f"baseline {baseline!r} names no cell of this comparison; its cells: "
                            + ", ".join(dict.fromkeys(str(p.cell) for p in planned)))
    if run_options.get("launcher", "auto") in ("auto", "torchrun") and not run_options.get("nodes"):
        planned, threads = same_threads(planned)  # this machine's cores are the ranks' (not a cluster's nodes')
        if log and threads:
            log(threads)
    out = Path(run_options.get("out", "runs"))
    reused = _reusable(planned, out) if reuse else {}
    to_run = [(i, p) for i, p in enumerate(planned) if not p.unsupported]
    results: dict[int, list[tuple[str, dict[str, Any]]]] = {i: reused.get(i, [])[:repeat] for i, _ in to_run}
    if log:
        _log_plan(log, planned, to_run, results, out)
    rounds = repeat if settle is None and not auto else max_rounds
    shuffled = rounds > 1
    seed = random.SystemRandom().randrange(2**31) if seed is None and shuffled else seed
    rng = random.Random(seed)
    if log and shuffled:
        log(f"in rounds: every cell once per round, in an order shuffled with seed {seed}")
    total = sum(max(0, repeat - len(results[i])) for i, _ in to_run)
    done = 0
    table = ComparisonFile(out, workload, log)
    finish = dict(planned=planned, to_run=to_run, results=results, baseline=baseline,
                  seed=seed if shuffled else None, settle=settle)
    sinks = ExperimentSinks({"kind": "compare", "name": f"{workload.name}: " + ", ".join(p.title for _, p in to_run),
                             "out": str(out), "cells": [p.title for p in planned]},
                            lambda message: print(f"warning: {message}", file=sys.stderr)) if total else None
    try:
        for round_index in range(rounds):
            if round_index >= repeat and (_decided(_assemble(**finish), level) if auto else
                                          not _unsettled(to_run, results, settle, workload.kind)):
                break
            order = [(i, p) for i, p in to_run if len(results[i]) <= round_index]
            if shuffled:
                rng.shuffle(order)
            if round_index >= repeat:
                total += len(order)
            for i, p in order:
                done += 1
                if log:
                    log(f"[{done}/{total}] {p.title}" + (f" (round {round_index + 1})" if shuffled else ""))
                if on_cell:
                    on_cell(done - 1, total, p.title)
                result: RunResult = run(p.workload, p.cell.adapter, **run_options)
                results[i].append((str(result.run_dir), to_json(result.summary)))
                # the table so far, on disk as each run ends: an interruption leaves it
                table.write(_assemble(**finish, pending=_pending(to_run, results, repeat), partial=True))
    except BaseException as exc:  # Ctrl-C or SIGTERM (llmadapt.errors.Terminated), or a failure: the runs so far
        interrupted = isinstance(exc, KeyboardInterrupt)
        if sinks or interrupted:
            so_far = _assemble(**finish, pending=_pending(to_run, results, repeat), partial=True)
            if sinks:
                sinks.close(so_far.to_dict(), "KILLED" if interrupted else "FAILED")
            if interrupted:
                table.interrupted(so_far, exc)
        raise
    if on_cell and total:
        on_cell(done, total, "")
    unsettled = [p.title for p in _unsettled(to_run, results, settle, workload.kind)] if settle else []
    comparison = attrs.evolve(_assemble(**finish), unsettled=unsettled)
    if auto:
        comparison = attrs.evolve(comparison, stopped=_stopped(comparison, max_rounds, level))
    if sinks:
        sinks.close(comparison.to_dict(), "FINISHED")
    return table.write(comparison) if (done or reused) else comparison


def _check_rounds(repeat: int | str, settle: float | None, max_rounds: int) -> tuple[int, float | None]:
    """The repeats and the settling rule, before anything runs: one line naming what is wrong. Returns the rounds
    before the first judgement and, for ``repeat='auto'``, the level of each look (None otherwise)."""
    if repeat == "auto":
        return _check_auto(settle, max_rounds)
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise LlmadaptError(f"repeat must be a whole number >= 1, got {repeat!r} (or 'auto': rounds until the "
                            "ranking is decided)")
    if settle is not None:
        if not 0 < settle < 1:
            raise LlmadaptError(f"settle is a share of the median between 0 and 1 (0.05: intervals within 5%), "
                                f"got {settle!r}")
        if not isinstance(max_rounds, int) or max_rounds < max(2, repeat):
            raise LlmadaptError(f"max rounds must be a whole number >= {max(2, repeat)} (the repeats, and two runs "
                                f"for an interval), got {max_rounds!r}")
    return repeat, None


def _log_plan(log: Callable[[str], None], planned, to_run, results, out: Path) -> None:
    """The cells not run (unsupported), and the runs reused from the store."""
    skipped = [p for p in planned if p.unsupported]
    if skipped:
        log(f"not supported, not run ({len(skipped)} of {len(planned)} cells):")
        for p in skipped:
            log(f"  {p.title}: {p.unsupported}")
    for i, p in to_run:
        if results[i]:
            log(f"{p.title}: {len(results[i])} run(s) reused from {out}: {', '.join(Path(d).name for d, _ in results[i])}")


def _check_auto(settle: float | None, max_rounds: int) -> tuple[int, float]:
    """``repeat='auto'``'s options, checked; the rounds it makes before it first judges the ranking, and the level of
    each look (``verdict.looks``: the looks share the verdict's 5%, so that judging after every round does not make
    two equal rows 'decided' more often)."""
    from llmadapt.analysis.verdict import RUNS_TO_SEPARATE, looks

    if settle is not None:
        raise LlmadaptError("repeat 'auto' and settle both add rounds, to different ends: give one")
    if not isinstance(max_rounds, int) or max_rounds < RUNS_TO_SEPARATE:
        raise LlmadaptError(f"max rounds must be a whole number >= {RUNS_TO_SEPARATE} with repeat 'auto' (the verdict "
                            f"tells rows apart over {RUNS_TO_SEPARATE} runs a row at least), got {max_rounds!r}")
    return looks(max_rounds)


def undecided_pairs(comparison: Comparison, level: float | None = None) -> list[tuple[str, str]]:
    """Per problem, the adjacent rows of its ranking by the headline figure that the verdict's rule does not tell
    apart (``verdict.undecided``; at ``level``, default the verdict's), over the rows that ran ok."""
    from llmadapt.analysis.verdict import ALPHA, undecided

    out = []
    for h in comparison.problems():
        rows = [r for r in comparison.rows if r.problem_hash == h and r.status == "ok"]
        key = HEADLINE["serve" if any("request_throughput" in r.metrics for r in rows) else "train"]
        out += undecided([(r.label, r.estimates[key]) for r in rows if key in r.estimates],
                         ALPHA if level is None else level)
    return out


def _unranked(comparison: Comparison) -> list[str]:
    """Rows that ran but are not in the ranking (a run failed, or no headline figure): more rounds do not rank them."""
    return [r.label for r in comparison.rows if r.status != "unsupported" and r.run_dirs
            and (r.status != "ok" or not set(HEADLINE.values()) & set(r.estimates))]


def _decided(comparison: Comparison, level: float) -> bool:
    """``repeat='auto'`` stops: every adjacent pair told apart, or a row that more rounds cannot rank."""
    return bool(_unranked(comparison)) or not undecided_pairs(comparison, level)


def _stopped(comparison: Comparison, max_rounds: int, level: float) -> str:
    """Why ``repeat='auto'`` stopped where it did, in one line."""
    rounds = max((len(r.run_dirs) for r in comparison.rows), default=0)
    unranked = _unranked(comparison)
    if unranked:
        return f"stopped after {rounds} repeats: not ranked (a run failed): {', '.join(unranked)}"
    pairs = undecided_pairs(comparison, level)
    if not pairs:
        line = (f"decided after {rounds} repeats: every two adjacent rows told apart (each look at p < {level:.2g}, "
                f"so that over up to {max_rounds} repeats equal rows read as apart under 5% of the time)")
        disturbed = [r.label for r in comparison.rows if r.disturbed]
        return line + (f"; but the machine was disturbed during {', '.join(disturbed)}: the verdict is withheld"
                       if disturbed else "")
    return (f"budget spent after {rounds} repeats (max rounds {max_rounds}): "
            + "; ".join(f"rows {a} and {b} cannot be told apart" for a, b in pairs))


def _pending(to_run, results, repeat: int) -> list[str]:
    """The runs still to make to reach ``repeat`` per cell (more rounds to settle are not counted)."""
    return [p.title for i, p in to_run for _ in range(repeat - len(results[i]))]


def _assemble(planned, to_run, results, baseline, seed, settle, pending: list[str] | None = None,
              partial: bool = False) -> Comparison:
    """The comparison of the runs in ``results``: a row per cell with a run (so far, when ``partial``; the runs
    still to make in ``pending``), unsupported cells as rows of their own."""
    rows: dict[int, Row] = {}
    baselines: dict[str, list[float | None]] = {}
    for i, p in to_run:  # in the cells' order: a problem's first row is its parity reference
        if results[i]:
            rows[i] = row_of_runs(p.title, p.cell.adapter, p.variant, str(p.cell), results[i], baselines,
                                  layout=p.layout)
    for i, p in enumerate(planned):
        if p.unsupported:
            rows[i] = Row(label=p.title, adapter=p.cell.adapter, variant=p.variant, run_dir=None, status="unsupported",
                          metrics={}, note=p.unsupported, problem_hash=p.workload.problem_hash, cell=str(p.cell),
                          layout=p.layout)
    problems = list(dict.fromkeys(p.workload.problem_hash for p in planned))
    order = sorted(rows, key=lambda i: (problems.index(planned[i].workload.problem_hash), i))
    return Comparison(rows=[rows[i] for i in order], baseline=baseline, seed=seed, settle=settle,
                      workloads={p.workload.problem_hash: p.workload for p in reversed(planned)},
                      partial=partial, pending=pending or [])


class ComparisonFile:
    """Where ``compare`` keeps its table: OUT/compare-TIME-HASH-XXXX.json, rewritten (atomically) as each run
    ends, so that an interrupted comparison leaves the rows it finished (``"partial": true``, the runs not made
    under ``pending``); ``--reuse`` picks the finished runs up again from the store."""

    def __init__(self, out: Path, workload: Workload, log: Callable[[str], None] | None) -> None:
        from llmadapt.contract.launch import new_run_id

        self.path = out / f"compare-{new_run_id(workload.content_hash[:8])}.json"
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.failed = False

    def write(self, comparison: Comparison, **extra: Any) -> Comparison:
        """Write the comparison (its rows, counts and text table); returns it with ``saved`` set when written. A
        disk that refuses it is said once; the runs themselves are in their folders."""
        import os

        data = {**comparison.to_dict(), **extra, "table": comparison.table()}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({**data, "saved": str(self.path)}, indent=1, default=str) + "\n")
            os.replace(tmp, self.path)
        except OSError as exc:
            if not self.failed:
                self.log(f"warning: could not write the comparison's table {self.path}: {exc.strerror or exc}")
            self.failed = True
            tmp.unlink(missing_ok=True)
            return comparison
        return attrs.evolve(comparison, saved=str(self.path))

    def interrupted(self, comparison: Comparison, exc: BaseException) -> None:
        """The comparison as far as it got, written when a stop signal ends it, and where it is said."""
        from llmadapt.launch.supervise import interrupt_text

        made = sum(len(r.run_dirs) for r in comparison.rows)
        saved = self.write(comparison, interrupted=interrupt_text(exc)).saved
        if saved:
            self.log(f"{interrupt_text(exc)}: the partial comparison ({made} run(s), {len(comparison.pending)} not "
                     f"made) is in {saved}; run the same compare with --reuse to make only the runs missing")


def _unsettled(to_run, results, settle: float | None, kind: str) -> list:
    """The cells whose headline interval over their runs is not yet narrower than ``settle`` of its median."""
    if settle is None:
        return []
    kind = "serve" if kind == "serve" else "train"
    out = []
    for i, p in to_run:
        ok = [(d, s) for d, s in results[i] if s.get("status") == "ok"]
        estimate = estimates_of([(d, from_json_summary(s)) for d, s in ok], kind).get(HEADLINE[kind]) \
            if len(ok) >= 2 else None
        if estimate is None or not estimate.median or (estimate.high - estimate.low) / estimate.median > settle:
            out.append(p)
    return out


def _reusable(planned, out: Path) -> dict[int, list[tuple[str, dict[str, Any]]]]:
    """Runs in the store under OUT that measured a planned cell already: same workload hash (its adapter's
    settings applied), adapter and adapter version, this machine, finished ok, no fault injected."""
    from llmadapt.adapter.plugins import get_adapter
    from llmadapt.analysis.store import RunStore
    from llmadapt.host import node_name

    if not out.is_dir():
        return {}
    with RunStore(out) as store:
        stored = store.runs("status=ok")
    found: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for i, p in enumerate(planned):
        if p.unsupported:
            continue
        version = get_adapter(p.cell.adapter).version
        for r in stored:
            if (r.workload_hash == p.workload.content_hash and r.adapter == p.cell.adapter
                    and r.row.get("adapter_version") == version and r.machine == node_name()
                    and not r.row.get("fault")):
                found.setdefault(i, []).append((str(r.folder), r.summary))
    return {i: sorted(runs, key=lambda run: Path(run[0]).name, reverse=True) for i, runs in found.items()}
