"""The run store: an embedded database (SQLite) indexing the run folders under one root (``runs/`` by default).

The folders are the source of truth; the database (``ROOT/llmadapt-runs.sqlite``) is an index over them that
keeps itself up to date cheaply: each time it is opened it lists the root's folder names, indexes the folders it
does not know, forgets the ones that are gone, and looks again at the runs that had not finished when indexed
(no summary yet, or a damaged one): their fingerprint (their summary's, launch file's and records' sizes and
modification times, and whether a process works in them). A finished run's folder is not read again, so a change
made to it after it was indexed (a summary rewritten, records edited) is seen on request: ``RunStore(root,
rescan=True)``, ``refresh(full=True)`` or ``llmadapt runs --rescan`` re-fingerprint every folder. Deleted or
damaged, the index is rebuilt from the folders. Runs made elsewhere (another machine, a cluster) join with
``import_runs``, which copies their folders under the root: importing twice adds nothing.

Each run is a row of ``runs`` (who ran what, where, when: workload and problem hash, adapter and version,
layout, machine, device, status, and the whole summary as JSON) and a set of named figures in ``metrics``
(``METRICS``: step time, throughput, memory, loss, serving latencies and goodput, breakdown classes). New runs
are written in batches, each one transaction (a run with its figures, or not at all), so a crash while indexing
leaves every batch before it and the next open indexes the rest; two processes may index at once (SQLite's
locking, a busy timeout).

A run's status is ``runstatus``'s, as ``show`` reads it: its summary's (ok, failed, ...) once it has one;
before, ``running`` while a process on this machine works in its folder (holds a file there open, has it as its
working folder or on its command line, or is named by a pid file in it), else ``incomplete`` (``failed`` when its
records hold a failure). A run whose summary.json cannot be read is ``damaged``: listed, with a warning, its
figures from its records.

Queries select runs by ``key=value`` terms (``Query``): adapter, status, machine, workload (hash prefix or name),
problem, run (id prefix), since/until (dates), kind, or any workload field by its dotted path
(``optimizations.zero_stage=3``). The terms on the row's own columns are answered by SQL; device and workload
fields are checked in Python on the rows SQL leaves; only the runs selected are decoded, with their figures.
``runs(query, limit=, offset=, newest_first=)`` pages them and ``count(query)`` counts them.

It is over 400 lines because the index's schema, what it records of a run, how it stays up to date, imports and
queries change together: one file to read for the store.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import attrs

from llmadapt.analysis.runstatus import live_processes
from llmadapt.contract.launch import unstructure
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, StorageError, os_error_line

__all__ = ["Query", "RunStore", "StoredRun"]

DB_NAME = "llmadapt-runs.sqlite"
STORE_VERSION = "5"
"""The index's own layout: a store of another version is rebuilt from the folders (3: running, incomplete and
damaged runs told apart; 4: which runs are settled, and indexes for refreshing and paging; 5: the interconnect)."""

BATCH = 500
"""Runs written per transaction while indexing (a commit per run was a write to disk per run)."""

UNFINISHED = ("running", "incomplete", "damaged")
"""Statuses of runs without a readable summary (besides ``failed``, when their records hold a failure)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, folder TEXT NOT NULL, fingerprint TEXT NOT NULL, status TEXT NOT NULL,
    kind TEXT, name TEXT, workload_hash TEXT, problem_hash TEXT, adapter TEXT, adapter_version TEXT,
    framework TEXT, framework_version TEXT, launcher TEXT, world_size INTEGER, layout TEXT, machine TEXT,
    device_kind TEXT, device_name TEXT, interconnect TEXT, created TEXT, fault TEXT, workload TEXT NOT NULL,
    summary TEXT NOT NULL,
    settled INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE, name TEXT NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (run_id, name)
);
CREATE INDEX IF NOT EXISTS runs_workload ON runs(workload_hash);
CREATE INDEX IF NOT EXISTS runs_problem ON runs(problem_hash);
CREATE INDEX IF NOT EXISTS runs_folder ON runs(folder);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created, run_id);
"""
# settled: the run had its summary when indexed (not damaged), so refresh does not read its folder again

RUN_COLUMNS = ("run_id", "folder", "status", "kind", "name", "workload_hash", "problem_hash", "adapter",
               "adapter_version", "framework", "framework_version", "launcher", "world_size", "layout", "machine",
               "device_kind", "device_name", "interconnect", "created", "fault")

# (metric, what it is, better): the figures a run is compared by; lower or higher is better
METRICS: dict[str, tuple[str, str]] = {
    "step_p50_s": ("median step time, s", "lower"),
    "step_mean_s": ("mean step time, s", "lower"),
    "tokens_per_s": ("tokens per second (mean)", "higher"),
    "samples_per_s": ("samples per second (mean)", "higher"),
    "peak_memory_bytes": ("peak memory (device, or RSS on CPU), bytes", "lower"),
    "first_loss": ("loss at the first step", "lower"),
    "last_loss": ("loss at the last step", "lower"),
    "mfu": ("model FLOPs utilisation", "higher"),
    "request_throughput": ("requests per second", "higher"),
    "output_throughput": ("output tokens per second", "higher"),
    "goodput": ("requests per second within the SLOs", "higher"),
    **{f"{m}_{q}_ms": (f"{m.upper()} {q}, ms", "lower")
       for m in ("ttft", "tpot", "itl", "e2el") for q in ("p50", "p90", "p99", "mean")},
    "expert_cv": ("router imbalance: CV of tokens per expert, mean over layers", "lower"),
    "joules_per_token": ("energy per token, J", "lower"),
}


def metrics_of(summary: dict[str, Any]) -> dict[str, float]:
    """The named figures of one summary (those it has)."""
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)

    st = summary.get("step_time_s") or {}
    put("step_p50_s", st.get("p50"))
    put("step_mean_s", st.get("mean"))
    put("tokens_per_s", (summary.get("tokens_per_s") or {}).get("mean"))
    put("samples_per_s", (summary.get("samples_per_s") or {}).get("mean"))
    put("peak_memory_bytes", summary.get("peak_memory_bytes"))
    losses = [x for x in summary.get("losses") or [] if x is not None]
    if losses:
        put("first_loss", losses[0])
        put("last_loss", losses[-1])
    put("mfu", summary.get("mfu"))
    v = summary.get("serving")
    if v:
        put("request_throughput", v.get("request_throughput"))
        put("output_throughput", v.get("output_throughput"))
        put("goodput", v.get("request_goodput"))
        for m in ("ttft", "tpot", "itl", "e2el"):
            for q in ("p50", "p90", "p99", "mean"):
                put(f"{m}_{q}_ms", (v.get(f"{m}_ms") or {}).get(q))
    layers = summary.get("expert_imbalance") or []
    if layers:
        put("expert_cv", sum(x["cv"] for x in layers) / len(layers))
    put("joules_per_token", (summary.get("telemetry") or {}).get("joules_per_token"))
    points = summary.get("evaluations") or []
    if points:  # before training and after the last step
        for key in ("loss", "exact_match", "choice_accuracy"):
            put(f"eval_{key}_before", points[0].get(key))
            put(f"eval_{key}", points[-1].get(key))
    for c in (summary.get("breakdown") or {}).get("modules", []):
        put(f"breakdown.{c['name']}_s", c["seconds"])
    return out


@attrs.frozen
class StoredRun:
    """One indexed run: its row (``RUN_COLUMNS``), its workload and summary as JSON, its metrics."""

    run_id: str
    folder: Path
    status: str
    adapter: str
    layout: str
    workload_hash: str
    problem_hash: str
    machine: str
    created: str
    workload: dict[str, Any]
    summary: dict[str, Any]
    metrics: dict[str, float]
    row: dict[str, Any] = attrs.field(repr=False)


# -- queries ----------------------------------------------------------------------------------------
_KEYS = ("adapter", "status", "machine", "workload", "problem", "run", "since", "until", "kind", "layout", "device",
         "interconnect")


@attrs.frozen
class Query:
    """Runs selected by ``key=value`` terms (all must hold): adapter, status, machine, device, kind, interconnect
    (the summary's topology: nvlink, pcie, single gpu, cpu), layout
    (substring), workload (hash prefix or workload name), problem (hash prefix), run (id prefix), since and until
    (ISO dates, by when the run was made), or a workload field by its dotted path (``train.seq_len=128``)."""

    terms: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str | Iterable[str] | None) -> Query:
        if text is None:
            return cls()
        items = text.replace(",", " ").split() if isinstance(text, str) else [t for x in text for t in
                                                                             x.replace(",", " ").split()]
        terms = []
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key or not value:
                raise LlmadaptError(f"run query {item!r}: write key=value, e.g. adapter=torch status=ok "
                                    f"since=2026-12-01 optimizations.zero_stage=3 (keys: {', '.join(_KEYS)}, or "
                                    "a workload field)")
            if key not in _KEYS and "." not in key:
                raise LlmadaptError(f"run query {item!r}: unknown key {key!r}; keys: {', '.join(_KEYS)}, or a "
                                    "workload field by its dotted path (train.seq_len=128)")
            if key in ("since", "until"):
                _date(value, item)
            terms.append((key, value))
        return cls(tuple(terms))

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.terms) or "(all runs)"

    def matches(self, run: StoredRun) -> bool:
        return all(_holds(key, value, run.row, run.workload) for key, value in self.terms)

    def sql(self) -> tuple[list[str], list[Any], tuple[tuple[str, str], ...]]:
        """The terms SQL answers from a row's columns, as conditions and their parameters (each meaning what
        ``_holds`` does), and the terms left to check in Python (device, workload fields)."""
        where: list[str] = []
        params: list[Any] = []
        rest = []
        for key, value in self.terms:
            if key in ("adapter", "status", "machine", "kind", "interconnect"):
                where.append(f"{key} = ?")
                params.append(value)
            elif key == "layout":
                where.append("instr(layout, ?) > 0")
                params.append(value)
            elif key in ("workload", "problem", "run"):
                column = {"workload": "workload_hash", "problem": "problem_hash", "run": "run_id"}[key]
                where.append(f"substr({column}, 1, ?) = ?" if key != "workload" else
                             "(substr(workload_hash, 1, ?) = ? OR name = ?)")
                params += [len(value), value] + ([value] if key == "workload" else [])
            elif key in ("since", "until"):
                where.append(f"substr(created, 1, 10) {'>=' if key == 'since' else '<='} ?")
                params.append(value[:10])
            else:
                rest.append((key, value))
        return where, params, tuple(rest)


def _holds(key: str, value: str, row: dict[str, Any], workload: dict[str, Any] | None) -> bool:
    """One term on a run's row (and its workload, for a dotted field)."""
    def text(column: str) -> str:
        return row.get(column) or ""

    if key in ("adapter", "status", "machine", "interconnect"):
        return text(key) == value
    if key == "device":
        return value.lower() in text("device_name").lower()
    if key == "kind":
        return row.get("kind") == value
    if key == "layout":
        return value in text("layout")
    if key == "workload":
        return text("workload_hash").startswith(value) or row.get("name") == value
    if key == "problem":
        return text("problem_hash").startswith(value)
    if key == "run":
        return text("run_id").startswith(value)
    if key == "since":
        return text("created")[:10] >= value[:10]
    if key == "until":
        return text("created")[:10] <= value[:10]
    if "." in key:
        return _field_equals(workload or {}, key, value)
    return True


def _date(value: str, item: str) -> None:
    try:
        dt.date.fromisoformat(value[:10])
    except ValueError:
        raise LlmadaptError(f"run query {item!r}: {value!r} is not a date (YYYY-MM-DD)") from None


def _field_equals(workload: dict[str, Any], path: str, value: str) -> bool:
    node: Any = workload
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    from llmadapt.spec import load_yaml

    try:
        wanted = load_yaml(value)
    except Exception:  # noqa: BLE001 - a value YAML cannot read is compared as text
        wanted = value
    return node == wanted or str(node) == value


# -- the store --------------------------------------------------------------------------------------
class RunStore:
    """The index of the run folders under ``root``. Open it with ``RunStore(root)``; it refreshes itself (new,
    gone and unfinished runs; ``rescan=True``: every folder, for changes made to finished runs)."""

    def __init__(self, root: str | Path = "runs", *, refresh: bool = True, rescan: bool = False,
                 warn: Callable[[str], None] | None = None, create: bool = False) -> None:
        """``create``: make the root (and its parents) if it does not exist yet, as importing into a new one does."""
        self.root = Path(root)
        if create and not self.root.exists():
            try:
                self.root.mkdir(parents=True)
            except OSError as exc:
                raise StorageError(f"cannot make the run store's folder: {os_error_line(exc)}") from None
        self.path = self.root / DB_NAME
        self.warn = warn or (lambda message: None)
        self.skipped: list[str] = []
        """Folders the last refresh could not index, each with why (damaged, not a run)."""
        self._conn = self._open()
        if refresh or rescan:
            self.refresh(full=rescan)

    # opening, and rebuilding what cannot be opened
    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA journal_mode = WAL")  # readers do not wait for a writer
        # No sync per commit: a power cut may lose the last batches, which the next open indexes again
        conn.execute("PRAGMA synchronous = NORMAL")
        return conn

    def _open(self) -> sqlite3.Connection:
        if self.root.exists() and not self.root.is_dir():
            raise LlmadaptError(f"{self.root} is a file, expected a folder of runs")
        if not self.root.is_dir():
            raise LlmadaptError(f"{self.root} is not a folder of runs (llmadapt writes runs to ./runs, or --out)")
        try:
            conn = self._connect()
            with conn:
                conn.executescript(_SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
            if row is None:
                conn.execute("INSERT OR IGNORE INTO meta VALUES ('version', ?)", (STORE_VERSION,))
            elif row[0] != STORE_VERSION:
                conn.close()
                return self._rebuilt(f"store version {row[0]}, this llmadapt's is {STORE_VERSION}")
            conn.execute("SELECT count(*) FROM runs").fetchone()
            return conn
        except sqlite3.DatabaseError as exc:  # damaged (a crash mid-write of the file itself, a truncated copy)
            return self._rebuilt(f"{type(exc).__name__}: {exc}")

    def _rebuilt(self, why: str) -> sqlite3.Connection:
        """Move the unreadable index aside and start an empty one; refresh() fills it from the folders."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for suffix in ("", "-wal", "-shm"):
            old = Path(f"{self.path}{suffix}")
            if old.exists():
                old.replace(Path(f"{self.path}.unreadable-{stamp}{suffix}"))
        self.warn(f"run store {self.path} could not be read ({why[:160]}): rebuilt from the run folders")
        conn = self._connect()
        with conn:
            conn.executescript(_SCHEMA)
            conn.execute("INSERT INTO meta VALUES ('version', ?)", (STORE_VERSION,))
        return conn

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # indexing
    def refresh(self, full: bool = False) -> int:
        """Index the folders the index does not know, forget the ones that are gone, and index again the runs that
        had not finished when indexed if their fingerprint changed: how many were indexed. ``full``: look at every
        folder's fingerprint, finished runs' too (a change made to a finished run is seen only so)."""
        known = {folder: (fingerprint, bool(settled)) for folder, fingerprint, settled in
                 self._conn.execute("SELECT folder, fingerprint, settled FROM runs")}
        self.skipped = []
        with os.scandir(self.root) as entries:  # names and kinds in one listing: no stat per known folder
            present = sorted(e.name for e in entries if e.is_dir())
        # Not a run folder (a figures folder, a profile): nothing to index. A finished run is not read again.
        folders = [self.root / name for name in present
                   if (name not in known and RunDir(self.root / name).launch_file.is_file())
                   or (name in known and (full or not known[name][1]))]
        # A run without a summary yet may be running: whether a process works in it is part of its fingerprint,
        # so it is indexed again once it ends.
        unfinished = [f for f in folders if not RunDir(f).summary_file.exists()]
        live = live_processes(unfinished) if unfinished else {}
        indexed, batch = 0, []
        for folder in folders:
            running = bool(live.get(folder))
            fingerprint = _fingerprint(folder) + ("|running" if running else "")
            if known.get(folder.name, ("",))[0] == fingerprint:
                continue
            try:
                batch.append(self._describe(folder, fingerprint, running=running))
            except LlmadaptError as exc:
                self.skipped.append(str(exc))
            if len(batch) >= BATCH:
                indexed += self._write(batch)
                batch = []
        indexed += self._write(batch)
        gone = set(known) - set(present)
        if gone:
            with self._conn:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.executemany("DELETE FROM runs WHERE folder = ?", [(g,) for g in sorted(gone)])
        for line in self.skipped:
            self.warn(f"not indexed: {line}")
        return indexed

    @staticmethod
    def _describe(folder: Path, fingerprint: str, *, running: bool = False) -> tuple[dict[str, Any], dict]:
        row, metrics = describe_run(folder, running=running)
        return {**row, "folder": folder.name, "fingerprint": fingerprint}, metrics

    def _write(self, described: list[tuple[dict[str, Any], dict[str, float]]]) -> int:
        """Write runs (rows and metrics) in one transaction, replacing what the index held of their ids and
        folders: all of them or none."""
        if not described:
            return 0
        names = list(described[0][0])
        insert = f"INSERT INTO runs ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            for row, metrics in described:  # two deletes: each uses its index (an OR would scan the table)
                self._conn.execute("DELETE FROM runs WHERE run_id = ?", (row["run_id"],))
                self._conn.execute("DELETE FROM runs WHERE folder = ?", (row["folder"],))
                self._conn.execute(insert, [row[n] for n in names])
                self._conn.executemany("INSERT INTO metrics VALUES (?, ?, ?)",
                                       [(row["run_id"], k, v) for k, v in metrics.items()])
        return len(described)

    def import_runs(self, folders: Iterable[str | Path], *, log: Callable[[str], None] | None = None
                    ) -> list[str]:
        """Copy run folders from elsewhere under the root and index them: the run ids added. A run already
        here (same id and content) is skipped; a folder that is not a readable run is refused, one line, before
        anything is copied."""
        checked = []
        for source in map(Path, folders):
            if not source.is_dir() or not RunDir(source).launch_file.is_file():
                raise LlmadaptError(f"{source} is not a run folder (no launch.json): nothing imported")
            row, _ = describe_run(source)  # damaged: refused here, before anything is copied
            checked.append((source, row["run_id"]))
        added = []
        for source, run_id in checked:
            target = self.root / source.name
            if target.resolve() == source.resolve():
                pass
            elif target.exists():
                if _fingerprint(target, content=True) != _fingerprint(source, content=True):
                    raise LlmadaptError(f"{target} exists and differs from {source}: a different run under the "
                                        "same folder name; nothing more imported")
                if log:
                    log(f"{source.name}: already in {self.root}")
                continue
            else:
                partial = self.root / f".importing-{source.name}"
                shutil.rmtree(partial, ignore_errors=True)
                shutil.copytree(source, partial)
                partial.replace(target)  # appears whole or not at all
            existing = self._conn.execute("SELECT fingerprint FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            fingerprint = _fingerprint(target)
            if existing and existing[0] == fingerprint:
                if log:
                    log(f"{source.name}: already in {self.root}")
                continue
            self._write([self._describe(target, fingerprint)])
            added.append(run_id)
            if log:
                log(f"{source.name}: imported")
        return added

    # reading
    def runs(self, query: Query | str | None = None, *, limit: int | None = None, offset: int = 0,
             newest_first: bool = False) -> list[StoredRun]:
        """The indexed runs that match, oldest first (``newest_first``: newest first); ``limit`` and ``offset``
        take a page of them. Only the runs returned are decoded, with their metrics."""
        query = query if isinstance(query, Query) else Query.parse(query)
        rows = self._select(query, limit=limit, offset=offset, newest_first=newest_first)
        ids = [row["run_id"] for row in rows]
        texts: dict[str, tuple[str, str]] = {}
        metrics: dict[str, dict[str, float]] = {}
        for start in range(0, len(ids), 500):  # under SQLite's limit on parameters
            chunk = ids[start:start + 500]
            marks = ", ".join("?" * len(chunk))
            for run_id, workload, summary in self._conn.execute(
                    f"SELECT run_id, workload, summary FROM runs WHERE run_id IN ({marks})", chunk):
                texts[run_id] = (workload, summary)
            for run_id, name, value in self._conn.execute(
                    f"SELECT run_id, name, value FROM metrics WHERE run_id IN ({marks})", chunk):
                metrics.setdefault(run_id, {})[name] = value
        out = []
        for row in rows:
            if row["run_id"] not in texts:  # forgotten in between by another process's refresh
                continue
            workload, summary = texts[row["run_id"]]
            out.append(StoredRun(
                run_id=row["run_id"], folder=self.root / row["folder"], status=row["status"],
                adapter=row["adapter"] or "", layout=row["layout"] or "", workload_hash=row["workload_hash"] or "",
                problem_hash=row["problem_hash"] or "", machine=row["machine"] or "", created=row["created"] or "",
                workload=json.loads(workload), summary=json.loads(summary), metrics=metrics.get(row["run_id"], {}),
                row=row))
        return out

    def count(self, query: Query | str | None = None) -> int:
        """How many indexed runs match."""
        query = query if isinstance(query, Query) else Query.parse(query)
        where, params, rest = query.sql()
        if rest:
            return len(self._select(query))
        return self._conn.execute("SELECT count(*) FROM runs" + (f" WHERE {' AND '.join(where)}" if where else ""),
                                  params).fetchone()[0]

    def _select(self, query: Query, *, limit: int | None = None, offset: int = 0,
                newest_first: bool = False) -> list[dict[str, Any]]:
        """The matching runs' rows (``RUN_COLUMNS``), in order: SQL selects by the row's columns (and pages,
        when no term is left to Python), Python checks the rest on the rows SQL leaves."""
        if (limit is not None and limit < 0) or offset < 0:
            raise LlmadaptError(f"a page of runs: limit {limit} and offset {offset} must not be negative")
        where, params, rest = query.sql()
        fields = any("." in key for key, _ in rest)  # a workload field: the workload is read for it
        order = " DESC" if newest_first else ""
        sql = (f"SELECT {', '.join(RUN_COLUMNS)}{', workload' if fields else ''} FROM runs"
               + (f" WHERE {' AND '.join(where)}" if where else "") + f" ORDER BY created{order}, run_id{order}")
        if limit is not None and not rest:
            sql += f" LIMIT {int(limit)} OFFSET {int(offset)}"
        rows = []
        for values in self._conn.execute(sql, params):
            row = dict(zip(RUN_COLUMNS, values))
            workload = json.loads(values[-1]) if fields else None
            if all(_holds(key, value, row, workload) for key, value in rest):
                rows.append(row)
        if rest or limit is None:
            rows = rows[offset:] if limit is None else rows[offset:offset + limit]
        return rows

    def frame(self, query: Query | str | None = None):
        """The matching runs as a pandas DataFrame: a row per run, its columns and its metrics."""
        try:
            import pandas as pd
        except ImportError:
            raise LlmadaptError("a DataFrame needs pandas: pip install pandas") from None
        return pd.DataFrame([{**r.row, **r.metrics} for r in self.runs(query)])

    def records_frame(self, name: str, query: Query | str | None = None):
        """A frame of the matching runs' records (``analysis.frames.FRAMES``: steps, requests, breakdown,
        telemetry), each row labelled by its run's layout; no matching run, or none with such records: one line."""
        from llmadapt.analysis.frames import frame

        found = self.runs(query)
        if not found:
            raise LlmadaptError(f"no stored run in {self.root} matches {query or '(all runs)'}")
        return frame(name, found)

    def steps(self, query: Query | str | None = None):
        """A row per step and rank of the matching runs (``analysis.frames.steps``)."""
        return self.records_frame("steps", query)

    def requests(self, query: Query | str | None = None):
        """A row per request of the matching serving runs (``analysis.frames.requests``)."""
        return self.records_frame("requests", query)

    def breakdown(self, query: Query | str | None = None):
        """A row per breakdown class, rank and profiled step of the matching runs (``analysis.frames.breakdown``)."""
        return self.records_frame("breakdown", query)

    def telemetry(self, query: Query | str | None = None):
        """A row per telemetry sample of the matching runs (``analysis.frames.telemetry``)."""
        return self.records_frame("telemetry", query)

    def to_parquet(self, path: str | Path, query: Query | str | None = None, *, frame: str = "runs") -> Path:
        """The matching runs as a Parquet file: a row per run (``frame='runs'``), or the records frame named."""
        if Path(path).is_dir():
            raise LlmadaptError(f"--parquet {path}: is a folder, expected a file")
        from llmadapt.analysis.frames import to_parquet

        return to_parquet(self.frame(query) if frame == "runs" else self.records_frame(frame, query), path)


def describe_run(folder: Path, *, running: bool = False) -> tuple[dict[str, Any], dict[str, float]]:
    """The index row and metrics of one run folder; a folder that cannot be read is one clear error.
    ``running``: a process works in the folder (``live_processes``); a run without a summary is then
    ``running``, else ``incomplete``. A run whose summary cannot be read is ``damaged``."""
    from llmadapt.analysis.labels import run_label
    from llmadapt.analysis.report import read_summary
    rundir = RunDir(folder)
    try:
        launch = rundir.read_launch()
        summary = read_summary(folder, running=running)
        workload = launch.require_workload()
        workload_text = json.dumps(workload.to_dict())
    except LlmadaptError as exc:
        raise LlmadaptError(f"{folder}: damaged run folder ({exc})") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LlmadaptError(f"{folder}: damaged run folder ({type(exc).__name__}: {str(exc)[:160]})") from None
    device = summary.get("device") or {}
    created = launch.created
    status = summary["status"]  # read_summary's: running, incomplete and damaged as runstatus defines them
    has_summary = rundir.summary_file.exists()
    row = {
        "run_id": summary["run_id"], "status": status, "kind": workload.kind, "name": workload.name,
        "workload_hash": summary["workload_hash"], "problem_hash": summary["problem_hash"],
        "adapter": summary["adapter"], "adapter_version": launch.adapter_version,
        "framework": summary["framework"], "framework_version": summary["framework_version"],
        "launcher": summary["launcher"], "world_size": summary["world_size"],
        "layout": run_label(summary, workload), "machine": _machine(folder),
        "device_kind": device.get("kind"), "device_name": device.get("name"),
        "interconnect": (summary.get("topology") or {}).get("interconnect"),
        "created": (dt.datetime.fromtimestamp(created, dt.timezone.utc).isoformat(timespec="seconds")
                    if isinstance(created, (int, float)) else ""),
        "fault": json.dumps(unstructure(launch.fault)) if launch.fault else None,
        "workload": workload_text, "summary": json.dumps(summary),
        "settled": int(has_summary and status != "damaged"),  # refresh reads a settled run's folder no more
    }
    return row, metrics_of(summary)


def _machine(folder: Path) -> str:
    """The node of rank 0 (or of the serving client): its header's first line."""
    for path in [RunDir(folder).rank_file(0), *sorted(folder.glob(RunDir.RECORDS_GLOB))]:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                first = json.loads(f.readline() or "{}")
            if isinstance(first, dict) and first.get("type") == "header":  # a line of anything else: no node
                return first["node"] if isinstance(first.get("node"), str) else ""
        except (OSError, json.JSONDecodeError):
            continue
    return ""


def _fingerprint(folder: Path, *, content: bool = False) -> str:
    """What changes when a run folder does: sizes and times of its summary, launch file and records (with
    ``content``, sizes only: a copy has new times)."""
    parts = []
    try:
        with os.scandir(folder) as entries:  # one listing (two globs cost twice as much)
            files = sorted((e for e in entries if e.name.endswith((".json", ".jsonl"))), key=lambda e: e.name)
    except OSError:
        return ""
    for entry in files:
        try:
            stat = entry.stat()
        except OSError:
            continue
        parts.append(f"{entry.name}:{stat.st_size}" + ("" if content else f":{stat.st_mtime_ns}"))
    return "|".join(parts)
