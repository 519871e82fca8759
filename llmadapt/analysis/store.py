"""The run store: an embedded database (SQLite) indexing the run folders under one root (``runs/`` by default).

The folders are the source of truth; the database (``ROOT/llmadapt-runs.sqlite``) is an index over them that
keeps itself up to date: each time it is opened it indexes the folders that are new or changed since (a folder's
fingerprint: its summary's, or launch file's and records', size and modification time) and forgets the ones that
are gone. Deleted or damaged, it is rebuilt from the folders. Runs made elsewhere (another machine, a cluster)
join with ``import_runs``, which copies their folders under the root: importing twice adds nothing.

Each run is a row of ``runs`` (who ran what, where, when: workload and problem hash, adapter and version,
layout, machine, device, status, and the whole summary as JSON) and a set of named figures in ``metrics``
(``METRICS``: step time, throughput, memory, loss, serving latencies and goodput, breakdown classes). Every write
is one transaction, so a crash while indexing leaves the store as it was before; two processes may index at
once (SQLite's locking, a busy timeout).

Queries select runs by ``key=value`` terms (``Query``): adapter, status, machine, workload (hash prefix or name),
problem, run (id prefix), since/until (dates), kind, or any workload field by its dotted path
(``optimizations.zero_stage=3``).

It is over 400 lines because the index's schema, what it records of a run, how it stays up to date, imports and
queries change together: one file to read for the store.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import attrs

from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError

DB_NAME = "llmadapt-runs.sqlite"
STORE_VERSION = "2"
"""The index's own layout: a store of another version is rebuilt from the folders."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, folder TEXT NOT NULL, fingerprint TEXT NOT NULL, status TEXT NOT NULL,
    kind TEXT, name TEXT, workload_hash TEXT, problem_hash TEXT, adapter TEXT, adapter_version TEXT,
    framework TEXT, framework_version TEXT, launcher TEXT, world_size INTEGER, layout TEXT, machine TEXT,
    device_kind TEXT, device_name TEXT, created TEXT, fault TEXT, workload TEXT NOT NULL, summary TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE, name TEXT NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (run_id, name)
);
CREATE INDEX IF NOT EXISTS runs_workload ON runs(workload_hash);
CREATE INDEX IF NOT EXISTS runs_problem ON runs(problem_hash);
"""

RUN_COLUMNS = ("run_id", "folder", "status", "kind", "name", "workload_hash", "problem_hash", "adapter",
               "adapter_version", "framework", "framework_version", "launcher", "world_size", "layout", "machine",
               "device_kind", "device_name", "created", "fault")

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
_KEYS = ("adapter", "status", "machine", "workload", "problem", "run", "since", "until", "kind", "layout", "device")


@attrs.frozen
class Query:
    """Runs selected by ``key=value`` terms (all must hold): adapter, status, machine, device, kind, layout
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
        for key, value in self.terms:
            if key == "adapter" and run.adapter != value:
                return False
            if key == "status" and run.status != value:
                return False
            if key == "machine" and run.machine != value:
                return False
            if key == "device" and value.lower() not in (run.row.get("device_name") or "").lower():
                return False
            if key == "kind" and run.row.get("kind") != value:
                return False
            if key == "layout" and value not in run.layout:
                return False
            if key == "workload" and not (run.workload_hash.startswith(value) or run.row.get("name") == value):
                return False
            if key == "problem" and not run.problem_hash.startswith(value):
                return False
            if key == "run" and not run.run_id.startswith(value):
                return False
            if key == "since" and run.created[:10] < value[:10]:
                return False
            if key == "until" and run.created[:10] > value[:10]:
                return False
            if "." in key and not _field_equals(run.workload, key, value):
                return False
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
    """The index of the run folders under ``root``. Open it with ``RunStore(root)``; it refreshes itself."""

    def __init__(self, root: str | Path = "runs", *, refresh: bool = True,
                 warn: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        self.path = self.root / DB_NAME
        self.warn = warn or (lambda message: None)
        self.skipped: list[str] = []
        """Folders the last refresh could not index, each with why (damaged, not a run)."""
        self._conn = self._open()
        if refresh:
            self.refresh()

    # opening, and rebuilding what cannot be opened
    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA journal_mode = WAL")  # readers do not wait for a writer
        return conn

    def _open(self) -> sqlite3.Connection:
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
    def refresh(self) -> int:
        """Index the folders that are new or changed, forget the ones that are gone: how many were indexed."""
        known = dict(self._conn.execute("SELECT folder, fingerprint FROM runs").fetchall())
        present = set()
        indexed = 0
        self.skipped = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            if not RunDir(folder).launch_file.is_file():
                continue  # not a run folder (a figures folder, a profile): nothing to index
            present.add(folder.name)
            fingerprint = _fingerprint(folder)
            if known.get(folder.name) == fingerprint:
                continue
            try:
                self._index(folder, fingerprint)
                indexed += 1
            except LlmadaptError as exc:
                self.skipped.append(str(exc))
        gone = set(known) - present
        if gone:
            with self._conn:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.executemany("DELETE FROM runs WHERE folder = ?", [(g,) for g in sorted(gone)])
        for line in self.skipped:
            self.warn(f"not indexed: {line}")
        return indexed

    def _index(self, folder: Path, fingerprint: str) -> None:
        row, metrics = describe_run(folder)
        row = {**row, "folder": folder.name, "fingerprint": fingerprint}
        names = list(row)
        with self._conn:  # one transaction: the run and its metrics, or nothing
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("DELETE FROM runs WHERE run_id = ? OR folder = ?", (row["run_id"], folder.name))
            self._conn.execute(f"INSERT INTO runs ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                               [row[n] for n in names])
            self._conn.executemany("INSERT INTO metrics VALUES (?, ?, ?)",
                                   [(row["run_id"], k, v) for k, v in metrics.items()])

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
            self._index(target, fingerprint)
            added.append(run_id)
            if log:
                log(f"{source.name}: imported")
        return added

    # reading
    def runs(self, query: Query | str | None = None) -> list[StoredRun]:
        """The indexed runs that match, oldest first."""
        query = query if isinstance(query, Query) else Query.parse(query)
        rows = self._conn.execute(f"SELECT {', '.join(RUN_COLUMNS)}, workload, summary FROM runs "
                                  "ORDER BY created, run_id").fetchall()
        metrics: dict[str, dict[str, float]] = {}
        for run_id, name, value in self._conn.execute("SELECT run_id, name, value FROM metrics"):
            metrics.setdefault(run_id, {})[name] = value
        out = []
        for values in rows:
            row = dict(zip(RUN_COLUMNS, values[:len(RUN_COLUMNS)]))
            run = StoredRun(
                run_id=row["run_id"], folder=self.root / row["folder"], status=row["status"],
                adapter=row["adapter"] or "", layout=row["layout"] or "", workload_hash=row["workload_hash"] or "",
                problem_hash=row["problem_hash"] or "", machine=row["machine"] or "", created=row["created"] or "",
                workload=json.loads(values[-2]), summary=json.loads(values[-1]),
                metrics=metrics.get(row["run_id"], {}), row=row)
            if query.matches(run):
                out.append(run)
        return out

    def frame(self, query: Query | str | None = None):
        """The matching runs as a pandas DataFrame: a row per run, its columns and its metrics."""
        try:
            import pandas as pd
        except ImportError:
            raise LlmadaptError("a DataFrame needs pandas: pip install pandas") from None
        return pd.DataFrame([{**r.row, **r.metrics} for r in self.runs(query)])

    def to_parquet(self, path: str | Path, query: Query | str | None = None) -> Path:
        try:
            self.frame(query).to_parquet(path, index=False)
        except ImportError as exc:
            raise LlmadaptError(f"Parquet needs pyarrow: pip install pyarrow ({exc})") from None
        return Path(path)


def describe_run(folder: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """The index row and metrics of one run folder; a folder that cannot be read is one clear error."""
    from llmadapt.analysis.cells import layout_label
    from llmadapt.analysis.report import read_summary
    from llmadapt.spec import Workload

    rundir = RunDir(folder)
    try:
        launch = rundir.read_launch()
        summary = read_summary(folder)
        workload = Workload.from_dict(launch["workload"])
    except LlmadaptError as exc:
        raise LlmadaptError(f"{folder}: damaged run folder ({exc})") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LlmadaptError(f"{folder}: damaged run folder ({type(exc).__name__}: {str(exc)[:160]})") from None
    device = summary.get("device") or {}
    created = launch.get("created")
    row = {
        "run_id": summary["run_id"], "status": summary["status"], "kind": workload.kind, "name": workload.name,
        "workload_hash": summary["workload_hash"], "problem_hash": summary["problem_hash"],
        "adapter": summary["adapter"], "adapter_version": launch.get("adapter_version", ""),
        "framework": summary["framework"], "framework_version": summary["framework_version"],
        "launcher": summary["launcher"], "world_size": summary["world_size"],
        "layout": layout_label(summary["adapter"], workload), "machine": _machine(folder),
        "device_kind": device.get("kind"), "device_name": device.get("name"),
        "created": (dt.datetime.fromtimestamp(created, dt.timezone.utc).isoformat(timespec="seconds")
                    if isinstance(created, (int, float)) else ""),
        "fault": json.dumps(launch["fault"]) if launch.get("fault") else None,
        "workload": json.dumps(launch["workload"]), "summary": json.dumps(summary),
    }
    return row, metrics_of(summary)


def _machine(folder: Path) -> str:
    """The node of rank 0 (or of the serving client): its header's first line."""
    for path in [RunDir(folder).rank_file(0), *sorted(folder.glob("*.jsonl"))]:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                first = json.loads(f.readline() or "{}")
            if first.get("type") == "header":
                return first.get("node", "")
        except (OSError, json.JSONDecodeError):
            continue
    return ""


def _fingerprint(folder: Path, *, content: bool = False) -> str:
    """What changes when a run folder does: sizes and times of its summary, launch file and records (with
    ``content``, sizes only: a copy has new times)."""
    parts = []
    for path in sorted([*folder.glob("*.json"), *folder.glob("*.jsonl")]):
        try:
            stat = path.stat()
        except OSError:
            continue
        parts.append(f"{path.name}:{stat.st_size}" + ("" if content else f":{stat.st_mtime_ns}"))
    return "|".join(parts)
