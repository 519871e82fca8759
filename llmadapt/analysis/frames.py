"""Runs as pandas DataFrames (and Parquet files): a row per step of every rank, per request, per breakdown class
of a profiled step, or per telemetry sample, read from the run folders' records.

Each function takes what a user holds: a run folder, a ``RunResult`` (``llmadapt.run``), a ``StoredRun``
(``RunStore.runs``), a ``Comparison`` or one of its rows, or a list of any of these. Every row starts with the
same identity columns (``IDENTITY``): the run's id, its adapter, its label (the comparison row's, else its
layout: ``torch dp2 zero3``), the workload's name, the problem hash, the node and the rank; then the step (the
request's index for requests). Units are in the column names: ``_s`` seconds, ``_ms`` milliseconds, ``_ns``
nanoseconds of the rank's monotonic clock, ``_bytes``, ``_percent``, ``_w`` watts, ``_j`` joules, ``_utc`` a
wall-clock timestamp (UTC; ranks and runs line up on it).

Runs without the records a frame needs (the requests of a training run, the breakdown of a run that profiled no
step) add no rows; when no run given has them, the frame is refused in one line saying why. pandas and pyarrow
are the ``report`` extra: without them, one line says what to install.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
from pathlib import Path
from typing import Any, Callable, Iterable

from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, StorageError

__all__ = ["FRAMES", "IDENTITY", "breakdown", "comparison_rows", "frame", "requests", "steps", "telemetry",
           "to_parquet"]

IDENTITY = {"run_id": "str", "adapter": "str", "label": "str", "workload": "str", "problem_hash": "str",
            "node": "str", "rank": "int64"}
"""The columns every frame starts with, and their types (pandas'; ``Int64``: an integer or missing)."""

PANDAS_MISSING = "a DataFrame needs pandas: pip install 'llmadapt[report]' (or pandas)"


def _pandas():
    try:
        import pandas as pd
    except ImportError:
        raise LlmadaptError(PANDAS_MISSING) from None
    return pd


# -- what a user holds, as run folders ------------------------------------------------------------------
def _sources(runs: Any) -> list[tuple[Path, str | None]]:
    """(run folder, label or None) for each run in RUNS: a folder, a RunResult, a StoredRun, a Comparison, a
    comparison's Row, or an iterable of these."""
    if isinstance(runs, (str, Path)):
        return [(Path(runs), None)]
    if isinstance(runs, RunDir):
        return [(runs.path, None)]
    if hasattr(runs, "rows") and hasattr(runs, "problems"):  # a Comparison
        return [s for row in runs.rows for s in _sources(row)]
    if hasattr(runs, "run_dirs") and hasattr(runs, "label"):  # a comparison's Row (unsupported rows: no runs)
        return [(Path(d), runs.label) for d in runs.run_dirs or ([runs.run_dir] if runs.run_dir else [])]
    if hasattr(runs, "folder") and hasattr(runs, "layout"):  # a StoredRun: labelled among the others (_frame)
        return [(Path(runs.folder), None)]
    if hasattr(runs, "run_dir") and hasattr(runs, "summary"):  # a RunResult
        return [(Path(runs.run_dir), None)]
    if isinstance(runs, Iterable) and not isinstance(runs, (bytes, dict)):
        return [s for item in runs for s in _sources(item)]
    raise LlmadaptError(f"cannot read runs from a {type(runs).__name__}: give run folders, RunResults, "
                        "StoredRuns or a Comparison")


class _Run:
    """One run folder's records by rank, with what identifies its rows."""

    def __init__(self, folder: Path, label: str | None) -> None:
        from llmadapt.analysis.labels import layout_label
        from llmadapt.spec import Workload

        rundir = RunDir(folder)
        if not rundir.launch_file.is_file():
            raise LlmadaptError(f"{folder} is not a run folder (no {RunDir.LAUNCH})")
        try:
            launch = rundir.read_launch()
            self.workload = launch.require_workload()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LlmadaptError(f"{folder}: damaged run folder ({type(exc).__name__}: {str(exc)[:160]})") from None
        self.folder = folder
        self.records: list[dict[str, Any]] = []
        for path in rundir.rank_files():
            self.records += read_jsonl(path)
        self.headers = {r["rank"]: r for r in self.records if r["type"] == "header"}
        first = self.headers.get(0) or next(iter(self.headers.values()), {})
        self.adapter = first.get("adapter") or launch.adapter
        self.run_id = first.get("run_id") or launch.run_id or folder.name
        self.told_by: Workload | None = self.workload
        self.label = label or self._measured_by(rundir) or layout_label(self.adapter, self.workload)
        self.problem_hash = first.get("problem_hash", "")

    def _measured_by(self, rundir: RunDir) -> str | None:
        """A run imported from another tool's result file is labelled with the tool (cells.run_label); what tells
        it apart from the other runs is ``told_by``, its workload unless the file came without one."""
        from llmadapt.analysis.labels import labelled_by, run_label

        try:
            summary = json.loads(rundir.summary_file.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(summary, dict) or not summary.get("measured_by"):
            return None
        self.told_by = labelled_by(summary, self.workload)
        return run_label(summary, self.workload)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == kind]

    def identity(self, rank: int) -> dict[str, Any]:
        return {"run_id": self.run_id, "adapter": self.adapter, "label": self.label, "workload": self.workload.name,
                "problem_hash": self.problem_hash, "node": (self.headers.get(rank) or {}).get("node", ""),
                "rank": rank}

    def utc(self, rank: int, mono_ns: int | None):
        """A time on RANK's monotonic clock as a UTC timestamp (its header's anchors), or None."""
        h = self.headers.get(rank)
        if mono_ns is None or h is None:
            return None
        wall_ns = h["wall_anchor_ns"] + (mono_ns - h["mono_anchor_ns"])
        return dt.datetime.fromtimestamp(wall_ns / 1e9, dt.timezone.utc)


def _frame(runs: Any, what: str, rows_of: Callable[[_Run], list[dict[str, Any]]], missing: Callable[[_Run], str],
           schema: dict[str, str]):
    pd = _pandas()
    sources = _sources(runs)
    if not sources:
        raise LlmadaptError(f"{what}: no runs given")
    rows: list[dict[str, Any]] = []
    lacking = []
    from llmadapt.analysis.labels import distinct_labels

    built = [(_Run(folder, label), label) for folder, label in sources]
    own = [run for run, label in built if label is None]  # labelled here: by what sets each apart from the others
    for run, text in zip(own, distinct_labels([(r.label, r.told_by) for r in own])):
        run.label = text
    for run, _ in built:
        found = rows_of(run)
        if not found:
            lacking.append(run)
        rows += found
    if not rows:
        why = missing(lacking[0])
        more = f" (and {len(lacking) - 1} more run(s) without them)" if len(lacking) > 1 else ""
        raise LlmadaptError(f"no {what} in {lacking[0].folder}: {why}{more}")
    extra = {c: "float64" for c in dict.fromkeys(k for r in rows for k in r) if c not in schema}  # phases
    types = {**schema, **extra}
    if int(pd.__version__.split(".")[0]) < 3:  # no 'str' dtype before pandas 3: its text type, missing as NA
        types = {k: "string" if v == "str" else v for k, v in types.items()}
    # Each column has its type whatever the runs hold (a column missing everywhere is still a column of
    # numbers or text), so frames of different runs concatenate and their Parquet files share one schema.
    return pd.DataFrame(rows, columns=list(types)).astype(types)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- the frames -------------------------------------------------------------------------------------------
UTC = "datetime64[us, UTC]"
STEP_COLUMNS = {**IDENTITY, "step": "int64", "warmup": "bool", "profiled": "bool", "step_time_s": "float64",
                "tokens": "int64", "samples": "int64", "tokens_per_s": "float64", "samples_per_s": "float64",
                "loss": "float64", "start_utc": UTC, "start_ns": "int64", "end_ns": "int64", "run_delay_s": "float64",
                "memory_kind": "str", "peak_allocated_bytes": "Int64", "peak_reserved_bytes": "Int64",
                "rss_bytes": "Int64", "peak_rss_bytes": "Int64"}


def steps(runs: Any):
    """A row per step and rank (warm-up and profiled steps included, flagged): its time, tokens and samples (this
    rank's), throughput, the global batch's loss, memory at its end, and each phase as ``phase_<name>_s``
    (``phase_<source>:<name>_s`` for a framework's own timer)."""
    def rows(run: _Run) -> list[dict[str, Any]]:
        out = []
        for r in run.of("step"):
            memory = r.get("memory") or {}
            row = {**run.identity(r["rank"]), "step": r["step"], "warmup": r["warmup"],
                   "profiled": r.get("profiled", False), "step_time_s": r["seconds"], "tokens": r["tokens"],
                   "samples": r["samples"], "tokens_per_s": _ratio(r["tokens"], r["seconds"]),
                   "samples_per_s": _ratio(r["samples"], r["seconds"]), "loss": r["loss"],
                   "start_utc": run.utc(r["rank"], r["start_ns"]), "start_ns": r["start_ns"], "end_ns": r["end_ns"],
                   "run_delay_s": r.get("run_delay_s"), "memory_kind": memory.get("kind"),
                   **{k: memory.get(k) for k in ("peak_allocated_bytes", "peak_reserved_bytes", "rss_bytes",
                                                 "peak_rss_bytes")}}
            for p in r.get("phases") or []:
                name = p["name"] if p["source"] == "llmadapt" else f"{p['source']}:{p['name']}"
                row[f"phase_{name}_s"] = row.get(f"phase_{name}_s", 0.0) + p["seconds"]
            out.append(row)
        return out

    return _frame(runs, "step records", rows, _why_no_steps, STEP_COLUMNS)


def _why_no_steps(run: _Run) -> str:
    if run.workload.kind == "serve":
        return "it is a serving run (steps are a training run's; requests(...) reads this one)"
    return "its ranks recorded no step (it failed before its first: llmadapt show says why)"


REQUEST_COLUMNS = {**IDENTITY, "request": "int64", "warmup": "bool", "status": "str", "error_cause": "str",
                   "finish_reason": "str", "input_tokens": "int64", "output_tokens": "Int64",
                   "requested_output_tokens": "int64", "server_input_tokens": "Int64", "output_forced": "bool",
                   "chunks": "int64", "sent_s": "float64", "send_lag_ms": "float64", "ttft_ms": "float64",
                   "tpot_ms": "float64", "itl_mean_ms": "float64", "itl_max_ms": "float64", "e2el_ms": "float64",
                   "error": "str"}


def requests(runs: Any):
    """A row per request of a serving run (warm-up included, flagged), as the load generator saw it: its status,
    tokens, when it was sent (``sent_s``: seconds after the run's first send), and its latencies where its times
    exist (TTFT, TPOT, mean and largest gap between chunks, E2EL; the summary's figures count ``status == 'ok'``
    requests only, the way this frame filtered by status gives them)."""
    ms = 1e-6

    def rows(run: _Run) -> list[dict[str, Any]]:
        records = run.of("request")
        sent = [r["sent_ns"] for r in records if r["sent_ns"] is not None]
        start = min(sent) if sent else None
        timed = run.workload.serve.mode != "offline"  # one call for all: no request's own times
        out = []
        for r in records:
            s, first, end, chunks = r["sent_ns"], r["first_token_ns"], r["end_ns"], r["chunk_ns"] or []
            gaps = [(b - a) * ms for a, b in zip(chunks, chunks[1:])] if timed else []
            n = r["output_tokens"]
            out.append({
                **run.identity(0), "request": r["index"], "warmup": r["warmup"], "status": r["status"],
                "error_cause": r.get("error_cause"), "finish_reason": r["finish_reason"],
                "input_tokens": r["input_tokens"], "output_tokens": n,
                "requested_output_tokens": r["requested_output_tokens"],
                "server_input_tokens": r.get("server_input_tokens"), "output_forced": r["output_forced"],
                "chunks": len(chunks), "sent_s": (s - start) / 1e9 if s is not None and start is not None else None,
                "send_lag_ms": (s - r["scheduled_ns"]) * ms if s is not None else None,
                "ttft_ms": (first - s) * ms if timed and None not in (s, first) else None,
                "tpot_ms": ((end - first) * ms / (n - 1) if timed and None not in (first, end) and n and n > 1
                            else None),
                "itl_mean_ms": sum(gaps) / len(gaps) if gaps else None, "itl_max_ms": max(gaps) if gaps else None,
                "e2el_ms": (end - s) * ms if timed and None not in (s, end) else None, "error": r.get("error")})
        return out

    def why(run: _Run) -> str:
        if run.workload.kind == "train":
            return "it is a training run (requests are a serving run's; steps(...) reads this one)"
        return "its load generator recorded no request (it failed before sending: llmadapt show says why)"

    return _frame(runs, "request records", rows, why, REQUEST_COLUMNS)


BREAKDOWN_KINDS = ("module", "operator", "module_operator", "layer", "collective", "kernel_type")
BREAKDOWN_COLUMNS = {**IDENTITY, "step": "int64", "level": "str", "basis": "str", "kind": "str", "name": "str",
                     "time_s": "float64", "forward_s": "float64", "backward_s": "float64", "share_of_step": "float64",
                     "count": "Int64", "flops": "float64", "step_time_s": "float64", "bytes": "Int64",
                     "algbw_gbytes_per_s": "float64", "busbw_gbytes_per_s": "float64", "backend": "str",
                     "algorithm": "str"}


def breakdown(runs: Any):
    """A row per class of each profiled step and rank (docs/breakdown.md): ``kind`` is module, operator (levels
    operator and full), module_operator ('attention.softmax/softmax'), layer ('layer 3': its forward and
    backward), collective (with its bytes and bandwidths) or kernel_type (on a GPU); ``time_s`` on the
    breakdown's basis, ``share_of_step`` of the profiled step's time (``step_time_s``, as the profiler saw it).
    A profiled step whose profiling failed has no rows."""
    def rows(run: _Run) -> list[dict[str, Any]]:
        out = []
        for b in run.of("breakdown"):
            base = {**run.identity(b["rank"]), "step": b["step"], "level": b["level"], "basis": b["basis"]}
            total = b["step_seconds"]
            items = [(kind, c) for kind, key in (("module", "modules"), ("operator", "operators"),
                                                 ("module_operator", "module_operators"),
                                                 ("kernel_type", "kernel_types"))
                     for c in b.get(key) or []]
            for kind, c in items:
                out.append({**base, "kind": kind, "name": c["name"], "time_s": c["seconds"],
                            "forward_s": c.get("forward_seconds"), "backward_s": c.get("backward_seconds"),
                            "share_of_step": _ratio(c["seconds"], total), "count": c.get("count"),
                            "flops": c.get("flops"), "step_time_s": total})
            for layer in b.get("layers") or []:
                seconds = layer["forward_seconds"] + layer["backward_seconds"]
                out.append({**base, "kind": "layer", "name": f"layer {layer['layer']}", "time_s": seconds,
                            "forward_s": layer["forward_seconds"], "backward_s": layer["backward_seconds"],
                            "share_of_step": _ratio(seconds, total), "step_time_s": total})
            for c in b.get("collectives") or []:
                out.append({**base, "kind": "collective", "name": c["kind"], "time_s": c["seconds"],
                            "share_of_step": _ratio(c["seconds"], total), "count": c["count"], "step_time_s": total,
                            "bytes": c.get("bytes"), "algbw_gbytes_per_s": c.get("algbw_gbytes_per_s"),
                            "busbw_gbytes_per_s": c.get("busbw_gbytes_per_s"), "backend": c.get("backend"),
                            "algorithm": c.get("algorithm")})
        return out

    def why(run: _Run) -> str:
        failed = [b["error"] for b in run.of("breakdown") if b.get("error")]
        if failed:
            return f"its profiling failed ({failed[0][:160]})"
        if run.workload.kind == "serve":
            return "it is a serving run (a breakdown is a profiled training step's)"
        return "it profiled no step (set profile.steps in the workload: docs/breakdown.md)"

    return _frame(runs, "breakdown records", rows, why, BREAKDOWN_COLUMNS)


TELEMETRY_COLUMNS = {**IDENTITY, "step": "Int64", "time_utc": UTC, "elapsed_s": "float64", "time_ns": "int64",
                     "source": "str", "cpu_percent": "float64", "rss_bytes": "Int64", "gpu_util_percent": "float64",
                     "gpu_memory_util_percent": "float64", "gpu_memory_used_bytes": "Int64", "power_w": "float64",
                     "energy_j": "float64"}
_SAMPLED = list(TELEMETRY_COLUMNS)[len(IDENTITY) + 4:]


def telemetry(runs: Any):
    """A row per background sample of each rank (workload.telemetry): CPU and memory of the rank's process, and
    on a GPU its utilisation, memory, power and energy (None where not measured here, never a made-up zero).
    ``step`` is the step the rank was in when the sample was taken (None between steps), ``elapsed_s`` the
    time since the rank started measuring."""
    def rows(run: _Run) -> list[dict[str, Any]]:
        spans: dict[int, list[tuple[int, int, int]]] = {}
        for s in run.of("step"):
            spans.setdefault(s["rank"], []).append((s["start_ns"], s["end_ns"], s["step"]))
        for v in spans.values():
            v.sort()
        out = []
        for r in run.of("telemetry"):
            rank, t = r["rank"], r["time_ns"]
            within = spans.get(rank, [])
            i = bisect.bisect_right(within, (t, float("inf"), 0)) - 1
            step = within[i][2] if i >= 0 and within[i][0] <= t <= within[i][1] else None
            h = run.headers.get(rank)
            out.append({**run.identity(rank), "step": step, "time_utc": run.utc(rank, t),
                        "elapsed_s": (t - h["mono_anchor_ns"]) / 1e9 if h else None, "time_ns": t,
                        **{k: r.get(k) for k in _SAMPLED}})
        return out

    def why(run: _Run) -> str:
        if run.workload.kind == "serve":
            return "it is a serving run (telemetry is sampled in training ranks)"
        if not run.workload.telemetry.interval_s:
            return "its sampler was off (telemetry.interval_s = 0)"
        return "its ranks recorded no sample (the run ended before the first: llmadapt show says why)"

    return _frame(runs, "telemetry samples", rows, why, TELEMETRY_COLUMNS)


def comparison_rows(comparison: Any):
    """A row per row of a Comparison: its label, adapter, status, runs and every figure of its table (units in
    the names), with each headline's median interval as ``<figure>_low`` and ``<figure>_high``."""
    pd = _pandas()
    out = []
    for r in comparison.rows:
        row = {"label": r.label, "adapter": r.adapter, "variant": r.variant, "cell": r.cell, "status": r.status,
               "problem_hash": r.problem_hash, "machine": r.machine, "runs": len(r.run_dirs),
               "run_ids": [Path(d).name for d in r.run_dirs], **r.metrics}
        for key, e in r.estimates.items():
            row.update({f"{key}_low": e.low, f"{key}_high": e.high, f"{key}_over": e.what})
        row.update({"disturbed": bool(r.disturbed), "note": r.note})
        out.append(row)
    return pd.DataFrame(out)


FRAMES: dict[str, Callable[[Any], Any]] = {"steps": steps, "requests": requests, "breakdown": breakdown,
                                           "telemetry": telemetry}
"""The per-record frames by name, as ``llmadapt runs --frame`` and ``Comparison.to_frame`` name them."""


def frame(name: str, runs: Any):
    """The frame NAME (``FRAMES``) of RUNS."""
    if name not in FRAMES:
        raise LlmadaptError(f"unknown frame {name!r}; frames: {', '.join(FRAMES)}")
    return FRAMES[name](runs)


def to_parquet(frame: Any, path: str | Path) -> Path:
    """Write a frame to a Parquet file (pyarrow): the path, or one line saying what is wrong."""
    path = Path(path)
    if path.is_dir():
        raise LlmadaptError(f"{path}: is a folder, expected a Parquet file")
    try:
        frame.to_parquet(path, index=False)
    except ImportError as exc:
        raise LlmadaptError(f"Parquet needs pyarrow: pip install 'llmadapt[report]' (or pyarrow) ({exc})") from None
    except OSError as exc:  # pyarrow's names no file
        raise StorageError(f"cannot write {path}: {exc.strerror or str(exc)[:200]}") from None
    return path
