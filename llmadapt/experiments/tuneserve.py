"""``tune`` for serving: each engine's parameters searched for the highest load that meets the SLOs.

The candidates are the engine settings each adapter declares it takes (``Supports.engine``) crossed over a ladder of
values (``LADDERS``); nothing here names an engine. Each candidate gets its own SLA search (``loadsweep.sla_search``:
its engine started once, the load probed up, bisected and repeated at the answer), in order (each engine's defaults
first, engines interleaved) while the budget lasts: every engine's defaults while any is left, a later configuration
while that engine's own median search fits; a search that starts runs to its end. ``race`` (the default) spends a
search only where it can change the answer: once an engine has a capacity, its other configurations are searched from
that load up, and one that fails there is done after that one probe (it cannot be that engine's best); ``grid``
searches every configuration from the start load. The answer: per engine the configuration with the highest capacity,
the engines ranked, and the capacity against latency front (``llmadapt.analysis.tuning.ServeTuneResult``).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.adapter.plugins import get_adapter
from llmadapt.analysis.tuning import ServeCandidate, ServeTuneResult, serve_answer
from llmadapt.errors import LlmadaptError
from llmadapt.experiments.loadsweep import Objective, prepared, sla_search
from llmadapt.experiments.tune import write_state
from llmadapt.spec import Workload

LADDERS: dict[str, tuple[Any, ...]] = {
    "max_sequences": (4, 16, 64),
    "max_batched_tokens": (256, 1024, 4096),
    "prefix_caching": (True, False),
}
"""The engine settings searched and the values tried (the engine's own default is always a candidate too)."""
NOT_SEARCHED = {
    "quantization": "changes what the engine computes: a quality question (compare with quality columns)",
    "tensor_parallel": "the devices given to the engine, not a setting of its capacity on them",
    "kv_cache_bytes": "sized by the memory the engine is given",
    "scheduling": "a policy between requests, not a capacity setting",
}
STRATEGIES = ("race", "grid")
MIN_SEARCH_S = 60.0
"""The least one SLA search takes (an engine's start and a few load points)."""


def candidates(workload: Workload, adapters: list[str],
               ladders: dict[str, tuple[Any, ...]] | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """(adapter, settings) for every engine configuration: the engine's defaults first, then each declared
    setting's ladder crossed with the others', engines interleaved."""
    ladders = LADDERS if ladders is None else ladders
    unknown = [k for k in ladders if k not in LADDERS]
    if unknown:
        raise LlmadaptError(f"engine settings {', '.join(unknown)} are not searched; searched: {', '.join(LADDERS)}")
    per: list[list[tuple[str, tuple[str, ...]]]] = []
    for adapter in adapters:
        takes = [k for k in ladders if k in get_adapter(adapter).supports.engine
                 and k not in workload.for_adapter(adapter).serve.engine.given()]
        if not takes:
            raise LlmadaptError(f"adapter {adapter!r} has no tunable engine option (it takes "
                                f"{', '.join(get_adapter(adapter).supports.engine) or 'none'}; tune searches "
                                f"{', '.join(LADDERS)})")
        combos = [()] + [tuple(f"serve.engine.{k}={json.dumps(v)}" for k, v in zip(takes, values))
                         for values in itertools.product(*(ladders[k] for k in takes))]
        per.append([(adapter, c) for c in combos])
    return [c for group in itertools.zip_longest(*per) for c in group if c is not None]


def tune_serving(workload: Workload, adapters: list[str], objectives: list[str], *, over: str = "rate",
                 start: float = 1.0, maximum: float | None = None, resolution: float = 0.2, repeats: int = 1,
                 max_probes: int = 12, budget_s: float = 1800.0, out: str | Path = "runs",
                 ladders: dict[str, tuple[Any, ...]] | None = None, timeout: float | None = None,
                 strategy: str = "race", log: Callable[[str], None] | None = None, progress=None) -> ServeTuneResult:
    """The highest load meeting every objective, per engine configuration, searched within ``budget_s``."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if strategy not in STRATEGIES:
        raise LlmadaptError(f"strategy {strategy!r}: a serving tune takes {' or '.join(STRATEGIES)}")
    if not objectives:
        raise LlmadaptError("a serving tune needs at least one objective: --slo ttft_p99_ms<=500")
    slos = [Objective.parse(text) for text in objectives]
    if over not in ("rate", "concurrency"):
        raise LlmadaptError(f"over {over!r}: rate or concurrency")
    if not budget_s >= MIN_SEARCH_S:
        raise LlmadaptError(f"budget {budget_s:g} s is less than one SLA search (about {MIN_SEARCH_S:g} s)")
    maximum = maximum or (256.0 if over == "concurrency" else 1024.0)
    planned = []
    for adapter, settings in candidates(workload, adapters, ladders):  # every one checked before any engine starts
        info, w = prepared(workload.with_overrides(list(settings), source="tune"), adapter)
        planned.append((info, w, settings))
    out = Path(out)
    from llmadapt.contract.launch import new_run_id

    folder = out / f"tune-{new_run_id(workload.content_hash[:8])}"
    folder.mkdir(parents=True)
    log(f"tune {folder}: {len(planned)} engine configurations of {', '.join(adapters)}; objectives "
        + ", ".join(map(str, slos)) + f"; not searched: {', '.join(NOT_SEARCHED)}")
    done: list[ServeCandidate] = []
    walls: dict[str, list[float]] = {}  # each engine's searches so far: engines start and step at their own speeds
    spent = 0.0
    to_beat: dict[str, float] = {}  # race: each engine's best capacity so far
    for info, w, settings in planned:
        if spent >= budget_s:
            break
        # An engine's defaults are searched while any budget is left, so that every engine answers; a later
        # configuration only if that engine's own median search still fits (a slow engine's does not stop a fast one's)
        mine = walls.get(info.name)
        if mine and spent + statistics.median(mine) > budget_s:
            continue
        label = f"{info.name} {w.serve.engine.label()}".strip()
        floor = to_beat.get(info.name) if strategy == "race" else None
        log(f"[{len(done) + 1}/{len(planned)}] {label}: SLA search over {over}"
            + (f" from {floor:g}, the engine's best so far" if floor is not None else ""))
        began = time.monotonic()
        search_dir, result = sla_search(w, info, slos, over, out, start=floor or start, maximum=maximum,
                                        resolution=resolution, repeats=repeats, max_probes=max_probes,
                                        timeout=timeout, progress=progress, floor=floor is not None)
        if result.capacity is not None and result.capacity > to_beat.get(info.name, 0.0):
            to_beat[info.name] = result.capacity
        wall = time.monotonic() - began
        walls.setdefault(info.name, []).append(wall)
        spent += wall
        done.append(ServeCandidate(info.name, label, settings, result.capacity, result.above,
                                   _latency_at(result, slos[0]), str(search_dir), wall, result.note, w))
        _save(folder, workload, done)
    answer = serve_answer(done, over=over, objectives=[str(o) for o in slos], budget_s=budget_s, spent_s=spent,
                          candidates=len(planned), folder=str(folder), strategy=strategy)
    for ranked in answer.ranking:  # each engine's best, as a workload file `llmadapt run` takes as it is
        best = next(c for c in done if c.label == ranked.label)
        Path(ranked.workload_file).write_text(json.dumps(best.workload.to_dict(), indent=1) + "\n")
    (folder / "answer.json").write_text(json.dumps(answer.to_dict(), indent=1, default=str) + "\n")
    return answer


def _latency_at(result, objective: Objective) -> float | None:
    """The first objective's figure at the capacity (the median over the probes there)."""
    key = f"{objective.metric}_{objective.quantile}_ms"
    values = [p.figures.get(key) for p in result.probes if p.load == result.capacity and p.passed]
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def _save(folder: Path, workload: Workload, done: list[ServeCandidate]) -> None:
    write_state(folder, {"workload_hash": workload.content_hash,
                         "searched": [attrs.asdict(c, filter=lambda a, _: a.name != "workload") for c in done]})
