"""``tune``: the best configuration of a training or fine-tuning workload across stacks.

The space is every configuration the adapters declare (``tunespace``), pruned before any probe. Each probe is an
ordinary run in the store. The ``race`` strategy probes every candidate once in order while the budget's first
half lasts, then repeats the survivors in shuffled rounds; after each round a candidate is dropped only where the
comparison's verdict rules tell it apart from the best and slower (over one run's steps: 95% intervals apart, on
each of two pairs of runs, the candidate's and the best's; over repeated runs: a two-sided Mann-Whitney test, four
runs a side at least).
``grid`` probes every candidate the same number of times and drops nothing (the reference the race is measured
against); ``random`` is the race over a seeded shuffle of the candidates. The answer is read in
``llmadapt.analysis.tuning``.

The tune's folder (OUT/tune-ID/) holds ``tune.json``, rewritten after each probe: an interrupted tune resumes from
it (``resume=``), reusing every finished probe, and refuses a workload that changed.

Size: over 400 lines because the strategies (race, grid, random, model) share one search: its budget, its state on
disk and the rule by which a probe drops a candidate; apart, each would carry a copy of them.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from llmadapt.analysis.comparison import row_of_runs
from llmadapt.analysis.tuning import OBJECTIVES, Probed, TuneResult, answer, score, slower_than
from llmadapt.contract.schema import to_json
from llmadapt.errors import LlmadaptError
from llmadapt.experiments.tunespace import Candidate, Space, space
from llmadapt.launch.settings import check_run_options
from llmadapt.spec import Workload

STRATEGIES = ("race", "grid", "random", "model")
MODEL_MARGIN = 0.25
"""``model``: a candidate is probed while its corrected estimate is within this share of the best measured step (the
estimate's error after correction, on the runs it was checked against: docs/estimate.md)."""
MIN_PROBE_S = 20.0
"""The least a probe takes on a CPU machine (a worker's start and imports, a few steps): a budget below one probe
is refused before anything starts."""
STATE = "tune.json"


def tune(workload: Workload | str | Path, adapters: list[str], *, ranks: int | None = None,
         objective: str = "tokens_per_s", max_memory_bytes: float | None = None, max_step_s: float | None = None,
         budget_s: float = 900.0, strategy: str = "race", device: str | None = None, probe_steps: int | None = None,
         max_runs: int = 6, grid_runs: int = 4, price_per_hour: float | None = None, seed: int = 0,
         out: str | Path = "runs", resume: str | Path | None = None, fixed: tuple[str, ...] = (),
         slurm: list[str] | None = None, log: Callable[[str], None] | None = None,
         **run_options: Any) -> TuneResult:
    """Search the adapters' configurations of ``workload`` for the best by ``objective`` within ``budget_s``.
    ``slurm``: run each round's probes as one Slurm job array with these sbatch options (``tuneslurm``); None: one
    after another on this machine."""
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    _check(objective, strategy, budget_s, max_runs, grid_runs, price_per_hour, device)
    check_run_options(None, run_options.get("timeout"), run_options.get("memory_limit_bytes"),
                      run_options.get("stall_timeout"), workload.kind)  # the probes' own, before the first
    if slurm is not None:
        from llmadapt.launch.slurm import require_slurm

        if strategy == "model":
            raise LlmadaptError("strategy model decides each probe on those before it; over Slurm a round's probes "
                                "run at once: use race, grid or random")
        require_slurm()
    ranks = ranks or max(workload.world_size, available_ranks())
    spec = _device(device)
    found = space(workload, adapters, ranks=ranks, max_memory_bytes=max_memory_bytes, device=spec, fixed=fixed)
    if not found.candidates:
        raise LlmadaptError(f"nothing left to probe: all {found.enumerated} configurations were pruned ("
                            + ", ".join(f"{n} by {k}" for k, n in found.reasons().items()) + ")")
    if probe_steps is not None and probe_steps < 2:
        raise LlmadaptError(f"probe steps: got {probe_steps}; a probe needs 2 measured steps at least for an interval")
    folder, state = _state(workload, adapters, out, resume, dict(
        objective=objective, strategy=strategy, ranks=ranks, probe_steps=probe_steps, fixed=list(fixed),
        max_memory_bytes=max_memory_bytes, max_step_s=max_step_s, seed=seed,
        **({"slurm": True} if slurm is not None else {})))  # probes on a cluster and here are not mixed
    pruned = ", ".join(f"{n} {k}" for k, n in found.reasons().items())
    log(f"tune {folder}: {found.enumerated} configurations, {len(found.pruned)} pruned"
        + (f" ({pruned})" if pruned else "") + f", {len(found.candidates)} to probe, ordered {found.order}")
    search = _Search(found, state, folder, objective, budget_s, probe_steps, max_memory_bytes, max_step_s,
                     price_per_hour, log, dict(run_options, out=out, memory_limit_bytes=
                                               run_options.get("memory_limit_bytes") or max_memory_bytes))
    search.slurm, search.workload = slurm, workload
    rng = random.Random(seed)
    order = list(found.candidates)
    if strategy == "random":
        rng.shuffle(order)
    if strategy == "grid":
        search.grid(order, grid_runs, rng)
    else:
        search.race(order, max_runs, rng, model=strategy == "model")
    reference = search.reference(adapters[0])
    result = answer(search.probed(), found, objective=objective, strategy=strategy, budget_s=budget_s,
                    spent_s=search.spent(), folder=str(folder), reference=reference, price_per_hour=price_per_hour,
                    unprobed=len(search.unprobed - set(search.results)), predicted_slower=len(search.skipped))
    for ranked in result.ranking:  # each stack's best, as a workload file `llmadapt run` takes as it is
        best = next(c for c in found.candidates if c.cell == ranked.cell)
        Path(ranked.workload_file).write_text(json.dumps(best.workload.to_dict(), indent=1) + "\n")
    (folder / "answer.json").write_text(json.dumps(result.to_dict(), indent=1, default=str) + "\n")
    return result


def available_ranks() -> int:
    """This node's ranks: its visible GPUs, or on a CPU machine its cores (every rank needs one at least)."""
    import shutil
    import subprocess

    from llmadapt.host import gpu_visible

    if gpu_visible():
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible:
            return len(visible)
        if shutil.which("nvidia-smi"):
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
            return max(1, sum(1 for line in listed.splitlines() if line.startswith("GPU ")))
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check(objective: str, strategy: str, budget_s: float, max_runs: int, grid_runs: int,
           price: float | None, device: str | None) -> None:
    if objective not in OBJECTIVES:
        raise LlmadaptError(f"objective {objective!r} names no known metric; known: {', '.join(OBJECTIVES)}")
    if objective == "cost_per_token" and price is None:
        raise LlmadaptError("objective cost_per_token needs a price per device-hour (--price)")
    if strategy not in STRATEGIES:
        raise LlmadaptError(f"strategy {strategy!r}: known {', '.join(STRATEGIES)}")
    if strategy == "model" and device is None:
        raise LlmadaptError("strategy model needs a device with measured peaks for the estimate (--device NAME; "
                            "`llmadapt micro peak --save NAME` describes this machine)")
    if not budget_s >= MIN_PROBE_S:
        raise LlmadaptError(f"budget {budget_s:g} s is less than one probe (about {MIN_PROBE_S:g} s: a worker's "
                            "start and its steps)")
    if max_runs < 1 or grid_runs < 1:
        raise LlmadaptError("max runs and grid runs are whole numbers >= 1")


def _device(name: str | None):
    if name is None:
        return None
    from llmadapt.contract.catalog import find_device

    return find_device(name)


def _state(workload: Workload, adapters: list[str], out: str | Path, resume: str | Path | None,
           options: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The tune's folder and its state: new, or read back from ``resume`` (the same workload and options)."""
    from llmadapt.contract.launch import new_run_id

    if resume is None:
        folder = Path(out) / f"tune-{new_run_id(workload.content_hash[:8])}"
        folder.mkdir(parents=True)
        return folder, {"workload_hash": workload.content_hash, "workload": workload.to_dict(),
                        "adapters": adapters, "options": options, "probes": []}
    folder = Path(resume)
    try:
        state = json.loads((folder / STATE).read_text())
    except (OSError, ValueError) as exc:
        raise LlmadaptError(f"resume {folder}: no readable {STATE} ({exc})") from None
    if state.get("workload_hash") != workload.content_hash:
        raise LlmadaptError(f"resume {folder}: its tune was for workload {str(state.get('workload_hash'))[:12]}, "
                            f"this workload is {workload.content_hash[:12]}: the workload changed; start a new tune")
    if state.get("adapters") != adapters or state.get("options") != options:
        raise LlmadaptError(f"resume {folder}: its tune had adapters {state.get('adapters')} and options "
                            f"{state.get('options')}; give the same")
    return folder, state


def write_state(folder: Path, data: dict[str, Any]) -> None:
    """FOLDER/tune.json, replaced whole (an interruption leaves the previous one)."""
    tmp = folder / f".{STATE}.{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, folder / STATE)


class _Search:
    """The probes made so far (the state's), the budget, and the two ways to spend it."""

    def __init__(self, found: Space, state: dict[str, Any], folder: Path, objective: str, budget_s: float,
                 probe_steps: int | None, max_memory: float | None, max_step_s: float | None,
                 price: float | None, log: Callable[[str], None], run_options: dict[str, Any]) -> None:
        self.found, self.state, self.folder, self.objective = found, state, folder, objective
        self.budget_s, self.probe_steps, self.log, self.run_options = budget_s, probe_steps, log, run_options
        self.max_memory, self.max_step_s, self.price = max_memory, max_step_s, price
        self.results: dict[str, list[tuple[str, dict[str, Any], float]]] = {}
        for p in state["probes"]:
            self.results.setdefault(p["key"], []).append((p["run_dir"], p["summary"], p["wall_s"]))
        self.dropped: dict[str, tuple[int, str]] = {}
        self.unprobed: set[str] = set()
        self.skipped: dict[str, str] = {}  # ``model``: not probed, the corrected estimate predicting it slower
        self.used: dict[str, int] = {}  # probes of each candidate taken from ``results`` by this search so far
        self.slurm: list[str] | None = None  # sbatch options: each round's new probes as one job array
        self.workload: Workload | None = None

    # -- the budget and one probe ------------------------------------------------------------------
    def spent(self) -> float:
        return sum(wall for runs in self.results.values() for _, _, wall in runs)

    def affordable(self, share: float = 1.0, planned: int = 0) -> bool:
        """Whether one more probe fits the budget's SHARE, after ``planned`` others not yet run (a job array's)."""
        walls = [wall for runs in self.results.values() for _, _, wall in runs]
        expected = statistics.median(walls) if walls else MIN_PROBE_S
        return self.spent() + (planned + 1) * expected <= self.budget_s * share

    def _has_finished_run(self, c: Candidate) -> bool:
        """Whether ``c``'s next probe is a finished one from the state (resuming): it costs no budget."""
        return self.used.get(c.key, 0) < len(self.results.get(c.key, []))

    def probe(self, c: Candidate) -> None:
        """One more run of ``c``: a finished one from the state where there is one, else a new run."""
        from llmadapt.launch.runner import run

        n = self.used.get(c.key, 0)
        self.used[c.key] = n + 1
        if n < len(self.results.get(c.key, [])):
            return
        w = c.workload
        if self.probe_steps is not None:
            w = w.with_overrides([f"train.steps={self.probe_steps}"], source="tune")
        self.log(f"[{sum(map(len, self.results.values())) + 1}] {c.label} (run {n + 1})")
        start = time.monotonic()
        result = run(w, c.adapter, **self.run_options)
        self._record(c, str(result.run_dir), to_json(result.summary), time.monotonic() - start)

    def _record(self, c: Candidate, run_dir: str, summary: dict[str, Any], wall: float) -> None:
        self.results.setdefault(c.key, []).append((run_dir, summary, wall))
        self.state["probes"].append({"key": c.key, "run_dir": run_dir, "summary": summary, "wall_s": wall})
        write_state(self.folder, self.state)

    def run_round(self, todo: list[Candidate], share: float = 1.0) -> list[Candidate]:
        """One more run of each of TODO that the budget's SHARE affords (or whose run is a finished one); returns
        those probed. Here one after another; over Slurm (``slurm``) the new ones first, as one job array."""
        if self.slurm is None:
            probed = []
            for c in todo:
                if self._has_finished_run(c) or self.affordable(share):
                    self.probe(c)
                    probed.append(c)
            return probed
        chosen, new = [], []
        for c in todo:
            if self._has_finished_run(c) or self.affordable(share, planned=len(new)):
                chosen.append(c)
                if not self._has_finished_run(c):
                    new.append(c)
        self._array(new)
        for c in chosen:
            self.probe(c)  # each now a finished run
        return chosen

    def _array(self, todo: list[Candidate]) -> None:
        from llmadapt.experiments.tuneslurm import probe_array

        if not todo:
            return
        finished, missing = probe_array(
            self.folder, self.workload, [(c, self.used.get(c.key, 0) + 1) for c in todo],
            probe_steps=self.probe_steps, out=self.run_options["out"], sbatch=self.slurm,
            run_options=self.run_options, log=self.log)
        for c, run_dir, summary, wall in finished:
            self._record(c, run_dir, summary, wall)
        if missing:
            raise LlmadaptError(f"the job array ended with {len(missing)} probe(s) not run ({', '.join(missing)}): "
                                f"cancelled, or lost with a node; the finished ones are kept: --resume {self.folder}")

    # -- strategies ----------------------------------------------------------------------------------
    def race(self, order: list[Candidate], max_runs: int, rng: random.Random, model: bool = False) -> None:
        """Round 1 probes every candidate once while half the budget lasts (the other half is for the survivors'
        repeats). A race that settles with budget left (one candidate standing, or every round run) goes on: the
        candidates round 1 could not afford are probed with what is left, and raced against those still standing."""
        alive = self._race(order, max_runs, rng, model, [], 0.5)
        while alive is not None:
            rest = [c for c in order if c.key in self.unprobed]
            if not rest or not self.affordable():
                return
            self.unprobed -= {c.key for c in rest}
            alive = self._race(rest, max_runs, rng, model, alive, 1.0)

    def _race(self, order: list[Candidate], max_runs: int, rng: random.Random, model: bool,
              standing: list[Candidate], share: float) -> list[Candidate] | None:
        """Round 1 over ORDER (within SHARE of the budget), then rounds of repeats over those standing with the
        STANDING ones; returns who stands at the end, or None when the budget ran out in a round of repeats."""
        alive = list(standing)
        for c in order if model else ():  # round 1 of ``model``: each probe decided on those before it
            if not (self._has_finished_run(c) or self.affordable(share)):
                self.unprobed.add(c.key)
                continue
            skip = self._predicted_slower(c, alive)
            if skip:
                self.skipped[c.key] = skip
                continue
            self.probe(c)
            if self._failed(c, 1) is None:
                alive.append(c)
        if not model:
            probed = self.run_round(order, share)
            self.unprobed |= {c.key for c in order if c not in probed}
            alive += [c for c in probed if self._failed(c, 1) is None]
        alive = self._cut(alive, 1)
        for round_index in range(2, max_runs + 1):
            if len(alive) < 2:
                break
            todo = [c for c in alive if self.used.get(c.key, 0) < round_index]  # the standing ones have theirs
            rng.shuffle(todo)
            if len(self.run_round(todo)) < len(todo):
                return None  # the budget is spent
            alive = [c for c in alive if c not in todo or self._failed(c, round_index) is None]
            alive = self._cut(alive, round_index)
        return alive

    def _predicted_slower(self, c: Candidate, alive: list[Candidate]) -> str | None:
        """``model``: why the estimate, corrected by the measured/estimated ratio of the stack's probes so far (all
        stacks' while it has none), predicts ``c`` slower than the best measured beyond MODEL_MARGIN; None to probe
        it."""
        measured = [(a, self._row(a).metrics.get("step_p50_s")) for a in alive if a.estimate_step_s]
        measured = [(a, t) for a, t in measured if isinstance(t, (int, float))]
        if not measured or not c.estimate_step_s:
            return None
        own = [t / a.estimate_step_s for a, t in measured if a.adapter == c.adapter]
        ratio = statistics.median(own or [t / a.estimate_step_s for a, t in measured])
        best = min(t for _, t in measured)
        predicted = c.estimate_step_s * ratio
        if predicted > best * (1 + MODEL_MARGIN):
            return (f"predicted {predicted:.3g} s a step (estimate x {ratio:.2f}, the measured/estimated ratio so far) "
                    f"against the best measured {best:.3g} s")
        return None

    def grid(self, order: list[Candidate], runs: int, rng: random.Random) -> None:
        for round_index in range(1, runs + 1):
            todo = list(order)
            if round_index > 1:
                rng.shuffle(todo)
            probed = self.run_round(todo)
            self.unprobed |= {c.key for c in todo if c not in probed and c.key not in self.results}

    def _failed(self, c: Candidate, round_index: int) -> str | None:
        """Why a candidate's last probe rules it out (failed, over a constraint); None when it stands."""
        _, summary, _ = self.results[c.key][self.used[c.key] - 1]
        reason = None
        if summary.get("status") != "ok":
            failures = summary.get("failures") or [{}]
            reason = f"{summary.get('status')}: {failures[0].get('cause', '')} {failures[0].get('message', '')}".strip()
        elif self.max_memory is not None and (summary.get("peak_memory_bytes") or 0) > self.max_memory:
            reason = f"over the memory limit: peak {summary['peak_memory_bytes'] / 2**30:.2f} GiB per rank measured"
        elif self.max_step_s is not None and ((summary.get("step_time_s") or {}).get("p50") or 0) > self.max_step_s:
            reason = f"over the step-time limit: p50 {summary['step_time_s']['p50']:.3g} s measured"
        if reason:
            self.dropped[c.key] = (round_index, reason)
        return reason

    def _cut(self, alive: list[Candidate], round_index: int) -> list[Candidate]:
        """Drop the candidates the verdict's rules call slower than the best beyond noise. Judged on one run a side
        (round 1), a drop is not final until a second run of the candidate is slower than a second run of the best
        too (``_confirmed``)."""
        if len(alive) < 2:
            return alive
        scored = {c.key: self._score(c) for c in alive}
        scored = {k: v for k, v in scored.items() if v is not None}
        if not scored:
            return alive
        best = min(scored, key=lambda k: scored[k].median)
        leader = next(c for c in alive if c.key == best)
        if self._disturbed(leader):
            return alive  # the verdict's rule: no verdict, so no drop, on runs of a disturbed machine
        slower = [c for c in alive if c.key in scored and c.key != best and slower_than(scored[c.key], scored[best])
                  and not self._disturbed(c)]
        once = [c for c in slower if self.used[c.key] == 1]
        confirmed = self._confirmed(once, leader) if once else {}
        slower = [c for c in slower if c not in once] + [c for c in once if c.key in confirmed]
        for c in slower:
            change = f"{scored[c.key].median / scored[best].median - 1:+.0%}"
            if c.key in confirmed:
                second, against = confirmed[c.key]
                change += f" on its first run, {second.median / against.median - 1:+.0%} on its second"
            self.dropped[c.key] = (round_index, f"slower than {self._label(best)} beyond noise ({change}, "
                                                f"round {round_index})")
        return [c for c in alive if c not in slower and c.key not in self.dropped]  # or its second run failed

    def _confirmed(self, once: list[Candidate], best: Candidate) -> dict[str, tuple[Any, Any]]:
        """Of ONCE, judged slower than BEST on one run a side, those whose second run is slower beyond noise than a
        second run of BEST too (key: both second runs' scores, the candidate's and the best's).
        One run's step intervals cannot see a disturbance that lasts the whole run (another job, a throttled core),
        on either side: on a quiet machine a disturbed run of the faster of two planted configurations got it
        dropped once in 20 tunes, and an undisturbed run of the best (+20% on its usual) once dropped every
        DeepSpeed configuration, the grid's equal among them, in a four-stack tune (docs/status.md). A second,
        independent pair of runs is that evidence; where the budget cannot afford it, the candidate stands.
        These runs come out of the whole budget, not round 1's half: a drop made final is what the repeats'
        half is for (taken from round 1's half, none was affordable and the race kept every candidate)."""
        # the best first, where the budget affords only some; one round (over Slurm one job array), as round 2 is
        probed = self.run_round(([best] if self.used[best.key] == 1 else []) + once)
        if self.used[best.key] < 2 or self._failed(best, 1) is not None or self._disturbed(best, last_only=True):
            return {}
        against = self._score(best, last_only=True)
        again = {c.key: self._score(c, last_only=True) for c in probed
                 if c is not best and self._failed(c, 1) is None and not self._disturbed(c, last_only=True)}
        return {k: (s, against) for k, s in again.items()
                if s is not None and against is not None and slower_than(s, against)}

    def _disturbed(self, c: Candidate, last_only: bool = False) -> bool:
        """Whether C's runs so far (``last_only``: its last) measured on a disturbed machine (other processes' CPU,
        as each run's summary judged it): the verdict withholds on them, and the race drops nothing on them. On a
        machine two jobs oversubscribed, a stall of both runs of the faster of two planted configurations got it
        dropped once in 20 tunes (docs/status.md)."""
        return bool(self._row(c, last_only).disturbed)

    def _score(self, c: Candidate, last_only: bool = False) -> Any:
        """C's cost to minimise over its runs so far (``analysis.tuning.score``); ``last_only``: over its last."""
        return score(self._row(c, last_only), self.objective, self.price)

    def _label(self, key: str) -> str:
        return next(c.label for c in self.found.candidates if c.key == key)

    def _row(self, c: Candidate, last_only: bool = False):
        runs = self.results[c.key][:self.used.get(c.key, len(self.results[c.key]))]
        runs = runs[-1:] if last_only else runs
        return row_of_runs(c.label, c.adapter, "", c.cell, [(d, s) for d, s, _ in runs], {})

    def probed(self) -> list[Probed]:
        out = []
        for c in self.found.candidates:
            if c.key in self.results:
                self.used.setdefault(c.key, len(self.results[c.key]))
                out.append(self._probed(c))
        return out

    def _probed(self, c: Candidate) -> Probed:
        runs = self.results[c.key]
        return Probed(c, self._row(c), self.dropped.get(c.key), sum(w for *_, w in runs),
                      list(runs[0][1].get("losses") or []))

    def reference(self, adapter: str) -> Probed | None:
        """The first adapter's run of the workload as given, for the winners' parity certificate: probed (once) if
        the search did not."""
        for c in self.found.candidates:
            if c.key == f"{adapter}:":
                if c.key not in self.results:
                    if self.slurm is not None:
                        self._array([c])
                    self.probe(c)
                self.used.setdefault(c.key, len(self.results[c.key]))
                return self._probed(c)
        return None
