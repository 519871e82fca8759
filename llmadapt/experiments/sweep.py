"""Sweeps: a comparison's grid as an object that survives interruptions and spreads over a Slurm cluster.

A sweep file names a workload file, the adapters or cells, settings, a matrix and how often to repeat each cell:

    workload = "tiny-llama.toml"          # relative to the sweep file
    adapters = ["torch"]                  # and/or cells = ["deepspeed:parallelism.dp=2,optimizations.zero_stage=3"]
    set = ["train.steps=4"]
    repeat = 1                            # runs per cell
    retries = 1                           # further attempts of a cell that failed
    [matrix]
    "optimizations.recompute" = ["none", "full"]
    [maxbatch]                            # optional: each cell's largest batch that fits (llmadapt maxbatch)
    memory_limit = "4G"                   # per-worker cap on CPU; on GPUs leave it out (the device's memory)
    max_batch = 256

It expands (`llmadapt.experiments.cells.plan`, as `compare` does) to cells with stable ids: a hash of the adapter,
the cell's resolved workload and the repeat's number, the same wherever and whenever the file is read. A sweep's
state lives in OUT/sweep-NAME-ID/: sweep.json (the cells) and one file per cell (cells/ID.json: pending, running,
done or failed, with every attempt's run folder), each written atomically as the cell moves, and results.json (every
cell's status, run folder and maximum batch, with a text table), rewritten as each cell ends and when the sweep is
interrupted (then ``"partial": true``, with what stopped it). Running the sweep
again skips the cells already done, if their run is still there, finished ok on the same adapter version and
machine; it retries failed cells up to ``retries`` more times, after which they stay failed, with their runs.
Each cell's run is an ordinary run folder in OUT, which the run store, compare --runs and the report read.

``llmadapt sweep run SWEEP --slurm`` submits the sweep as one Slurm job array, one cell per array task (each task
runs ``llmadapt sweep run SWEEP --index I`` on its node, with the local launchers), and follows it; the cell files
say what each task did, so a cancelled array is resumed by running the sweep again.

It is over 400 lines because a sweep's file, its cells' state, its results and its Slurm array are one object.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.experiments.cells import PlannedCell, as_cells, plan
from llmadapt.contract.launch import new_run_id
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, not_a_file
from llmadapt.host import node_name, utc_now
from llmadapt.spec import Workload, read_document

STATES = ("pending", "running", "done", "failed")


@attrs.frozen
class SweepCell:
    id: str
    planned: PlannedCell
    repeat: int

    @property
    def title(self) -> str:
        return self.planned.title + (f" #{self.repeat + 1}" if self.repeat else "")


@attrs.frozen
class Sweep:
    file: Path
    name: str
    workload: Workload
    cells: list[SweepCell]
    retries: int
    maxbatch: dict[str, Any] | None
    """Per cell, also search the largest per-rank batch that fits (llmadapt.experiments.maxbatch): its options."""
    folder: Path
    """OUT/sweep-NAME-ID: sweep.json and the cells' state."""
    out: Path

    # -- state ------------------------------------------------------------------------------------------------
    def state_file(self, cell: SweepCell) -> Path:
        return self.folder / "cells" / f"{cell.id}.json"

    def state(self, cell: SweepCell) -> dict[str, Any]:
        path = self.state_file(cell)
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):  # none yet (or unreadable): nothing is known of it
            return {"status": "pending", "attempts": []}

    def _write_state(self, cell: SweepCell, state: dict[str, Any]) -> None:
        path = self.state_file(cell)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"id": cell.id, "title": cell.title, "adapter": cell.planned.cell.adapter,
                                   **state}, indent=1))
        os.replace(tmp, path)

    def finished(self, cell: SweepCell, machine: str | None = None) -> str | None:
        """The run folder that finished this cell, if it still counts: there, ok, same workload, adapter version
        and machine (``machine``, default this one: its node name, or 'slurm:CLUSTER' inside a Slurm job)."""
        from llmadapt.adapter.plugins import get_adapter
        from llmadapt.analysis.report import read_summary

        state = self.state(cell)
        if state["status"] != "done":
            return None
        run_dir = Path(state["attempts"][-1]["run_dir"])
        try:
            summary = read_summary(run_dir)
            launch = RunDir(run_dir).read_launch()
        except (LlmadaptError, OSError, json.JSONDecodeError):
            return None
        same = (summary.get("status") == "ok" and launch.workload_hash == cell.planned.workload.content_hash
                and launch.adapter_version == get_adapter(cell.planned.cell.adapter).version
                and state.get("machine") == (machine or this_machine()))
        return str(run_dir) if same else None

    def status(self, machine: str | None = None) -> list[tuple[SweepCell, str, dict[str, Any]]]:
        """Every cell with its status now: done (its run still counts on ``machine``), running, failed or
        pending."""
        out = []
        for cell in self.cells:
            state = self.state(cell)
            status = state["status"]
            if status == "done" and self.finished(cell, machine) is None:
                status = "pending"  # its run is gone, failed, or from another version or machine
            if status == "running" and not _alive(state):
                status = "failed" if _tries(state["attempts"]) > self.retries else "pending"
            out.append((cell, status, state))
        return out

    # -- running ----------------------------------------------------------------------------------------------
    def run_cell(self, cell: SweepCell, *, log: Callable[[str], None] = lambda m: None,
                 **run_options: Any) -> dict[str, Any]:
        """Run one cell unless it is done: up to 1 + retries attempts, each recorded as it starts and ends."""
        from llmadapt.launch.runner import run

        done = self.finished(cell)
        if done:
            log(f"{cell.title}: done already ({done})")
            return self.state(cell)
        state = self.state(cell)
        # An attempt still marked running is one whose process was killed mid-run (this one runs the cell now)
        attempts = [a if a.get("status") != "running" else
                    {**a, "status": "interrupted", "failure": "its process ended mid-run (killed)"}
                    for a in state.get("attempts", []) if a.get("status") != "running" or Path(a["run_dir"]).exists()]
        earlier = state.get("earlier", [])
        if state["status"] == "done":  # done, but its run no longer counts (gone, another version or machine)
            earlier, attempts = earlier + attempts, []
        if state["status"] == "failed" and _tries(attempts) > self.retries:
            log(f"{cell.title}: failed {_tries(attempts)} times, not retried (retries = {self.retries})")
            return state
        while _tries(attempts) <= self.retries:
            record = {"status": "running", "attempts": attempts, "earlier": earlier, "machine": this_machine(),
                      "node": node_name(),
                      "pid": os.getpid(), "started": utc_now(),
                      "slurm_job": _slurm_task_id()}
            # Its folder named before it starts, among the attempts: a kill mid-run leaves it there, marked
            run_id = new_run_id(cell.planned.cell.adapter, cell.planned.workload.content_hash[:8])
            current = {"run_dir": str(Path(run_options.get("out", "runs")) / run_id), "status": "running",
                       "started": record["started"]}
            self._write_state(cell, {**record, "attempts": [*attempts, current]})
            log(f"{cell.title}: attempt {_tries(attempts) + 1} of {self.retries + 1}")
            try:
                result = run(cell.planned.workload, cell.planned.cell.adapter, run_id=run_id, **run_options)
            except KeyboardInterrupt as exc:  # stopped, not failed: run it again
                from llmadapt.launch.supervise import interrupt_text

                if Path(current["run_dir"]).exists():  # else stopped before its folder was made: nothing to keep
                    attempts = [*attempts, {**current, "status": "interrupted", "ended": utc_now(),
                                            "failure": interrupt_text(exc)}]
                self._write_state(cell, {**record, "status": "pending", "attempts": attempts})
                raise
            attempts = [*attempts, {"run_dir": str(result.run_dir), "status": "ok" if result.ok else "failed",
                                    "started": current["started"], "ended": utc_now(),
                                    "failure": "; ".join(f.message for f in result.summary.failures)[:500]}]
            if result.ok:
                break
        if attempts[-1]["status"] == "ok" and self.maxbatch is not None:
            attempts[-1]["maxbatch"] = self._max_batch(cell, log, run_options)
        final = {"status": attempts[-1]["status"].replace("ok", "done"), "attempts": attempts, "earlier": earlier,
                 "machine": this_machine(), "node": node_name()}
        self._write_state(cell, final)
        return final

    def _max_batch(self, cell: SweepCell, log: Callable[[str], None], run_options: dict[str, Any]) -> dict[str, Any]:
        """The cell's largest per-rank batch that completes, probed in isolated workers (grow, then bisect)."""
        from llmadapt.experiments.maxbatch import maxbatch
        from llmadapt.contract.schema import to_json

        options = dict(self.maxbatch or {})
        log(f"{cell.title}: maximum batch search")
        found = maxbatch(cell.planned.workload, cell.planned.cell.adapter, out=run_options.get("out", self.out),
                         timeout=run_options.get("timeout"), launcher=run_options.get("launcher", "auto"),
                         memory_limit_bytes=options.get("memory_limit_bytes"),
                         max_batch=options.get("max_batch", 1024), steps=options.get("steps", 2))
        return {"search_dir": str(found.search_dir), **to_json(found.result)}

    def run(self, *, log: Callable[[str], None] = lambda m: None, **run_options: Any) -> None:
        """Every cell in turn (those done skipped); results.json rewritten as each cell ends, and when a stop
        signal ends the sweep early (marked partial: cells still pending)."""
        from llmadapt.launch.supervise import interrupt_text

        try:
            for cell in self.cells:
                self.run_cell(cell, log=log, **run_options)
                self.write_results()
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (llmadapt.errors.Terminated)
            path = self.write_results(interrupted=interrupt_text(exc))
            if path is not None:
                done = sum(1 for c in json.loads(path.read_text())["cells"] if c["status"] == "done")
                log(f"{interrupt_text(exc)}: the sweep's results so far ({done} of {len(self.cells)} cells done) are "
                    f"in {path}; run the sweep again to resume (the cells done are skipped)")
            raise

    # -- results ----------------------------------------------------------------------------------------------
    @property
    def results_file(self) -> Path:
        return self.folder / "results.json"

    def results(self, machine: str | None = None) -> dict[str, Any]:
        """Every cell's status now (``status``), its attempts, last run folder and maximum batch; the counts, a
        text table, and ``partial`` while some cell is neither done nor failed."""
        from llmadapt.texttable import text_table

        rows = self.status(machine)
        cells = [{"index": i, "id": c.id, "title": c.title, "status": status,
                  "attempts": len(state.get("attempts", [])),
                  "run_dir": (state.get("attempts") or [{}])[-1].get("run_dir"),
                  "max_batch": ((state.get("attempts") or [{}])[-1].get("maxbatch") or {}).get("max_batch")}
                 for i, (c, status, state) in enumerate(rows)]
        counts = {s: sum(1 for _, status, _ in rows if status == s) for s in STATES}
        head = ["#", "cell", "id", "status", "attempts", *(["max batch"] if self.maxbatch is not None else []), "run"]
        table = [*text_table(head, [[str(d["index"]), d["title"], d["id"], d["status"], str(d["attempts"]),
                                     *([str(d["max_batch"] or "-")] if self.maxbatch is not None else []),
                                     d["run_dir"] or "-"] for d in cells]),
                 f"{len(rows)} cells: " + ", ".join(f"{n} {s}" for s, n in counts.items())]
        return {"folder": str(self.folder), "cells": cells, "counts": counts,
                "partial": counts["done"] + counts["failed"] < len(rows), "table": "\n".join(table)}

    def write_results(self, **extra: Any) -> Path | None:
        """results.json in the sweep's folder, written atomically; None (with the reason on stderr) when the disk
        refuses it: the cells' own files still say what ran."""
        tmp = self.results_file.with_name(f".results.json.{os.getpid()}")
        try:
            tmp.write_text(json.dumps({**self.results(), **extra}, indent=1) + "\n")
            os.replace(tmp, self.results_file)
        except OSError as exc:
            print(f"warning: could not write {self.results_file}: {exc.strerror or exc}", file=sys.stderr)
            tmp.unlink(missing_ok=True)
            return None
        return self.results_file

    def array_script(self, python: str, slurm_options: list[str], indices: list[int],
                     run_args: list[str] | tuple[str, ...] = ()) -> str:
        """The Slurm job array of the cells at ``indices``: task I runs cell I with this machine's llmadapt (the
        folders must be shared), with ``run_args`` (`sweep run`'s --timeout, --launcher)."""
        cli = [python, "-m", "llmadapt.cli", "sweep", "run", str(self.file.resolve()), "--out", str(self.out.resolve()),
               "--index", "$SLURM_ARRAY_TASK_ID", *run_args]
        lines = ["#!/bin/bash", f"# llmadapt sweep {self.name}: one cell per array task. Resubmit with: sbatch <this>",
                 f"#SBATCH --job-name=llmadapt-sweep-{self.name}", f"#SBATCH --array={','.join(map(str, indices))}",
                 "#SBATCH --ntasks=1", f"#SBATCH --output={self.folder.resolve()}/slurm-%A_%a.out",
                 *(f"#SBATCH {o}" for o in slurm_options), f"cd {shlex.quote(str(Path.cwd()))}",
                 " ".join(shlex.quote(c) if not c.startswith("$") else c for c in cli)]
        return "\n".join(lines) + "\n"


def _tries(attempts: list[dict[str, Any]]) -> int:
    """The attempts that count against the retries: those that ran to an end (ok or failed), not those a stop
    signal or a kill cut short."""
    return sum(1 for a in attempts if a.get("status") in ("ok", "failed"))


def _slurm_task_id() -> str | None:
    job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{job}_{task}" if job and task else os.environ.get("SLURM_JOB_ID")


def this_machine() -> str:
    """What a finished cell must have run on to count: this node, or inside a Slurm job its cluster (a sweep's cells
    run on whichever nodes the array tasks get)."""
    cluster = os.environ.get("SLURM_CLUSTER_NAME")
    return f"slurm:{cluster}" if cluster else node_name()


def slurm_machine() -> str:
    """'slurm:CLUSTER' for the cluster this machine submits to (what its array tasks record)."""
    import subprocess

    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            return f"slurm:{value.strip()}"
    return "slurm:"


def _alive(state: dict[str, Any]) -> bool:
    """A cell marked running whose process is gone (killed with its node, scancelled) is not running."""
    if state.get("node") != node_name():
        return _slurm_task_alive(state)
    try:
        os.kill(int(state.get("pid", 0)), 0)
        return True
    except (OSError, ValueError):
        return False


def write(path: str | Path, data: dict[str, Any]) -> Path:
    """A sweep file from its keys (workload, adapters, cells, set, matrix, repeat, retries): TOML, YAML or JSON by
    the file's suffix. What `compare --save-sweep` writes."""
    path = Path(path)
    data = {k: v for k, v in data.items() if v not in (None, [], {})}
    if path.suffix == ".json":
        text = json.dumps(data, indent=1) + "\n"
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        text = yaml.safe_dump(data, sort_keys=False)
    elif path.suffix == ".toml":
        def value(v: Any) -> str:  # TOML's strings, numbers, booleans and arrays read as JSON writes them
            if v is None:
                raise LlmadaptError(f"{path}: a null value cannot be written to TOML: use .yaml or .json")
            return json.dumps([list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, list) else v)

        lines = [f"{k} = {value(v)}" for k, v in data.items() if k != "matrix"]
        if "matrix" in data:
            lines += ["", "[matrix]", *(f"{json.dumps(k)} = {value(v)}" for k, v in data["matrix"].items())]
        text = "# written by llmadapt compare --save-sweep; run with: llmadapt sweep run " + path.name + "\n" \
            + "\n".join(lines) + "\n"
    else:
        raise LlmadaptError(f"sweep file {path}: use .toml, .yaml or .json")
    path.write_text(text)
    return path


def load(path: str | Path, out: str | Path = "runs", overrides: list[str] | None = None, *,
         create: bool = True, index: int | None = None) -> Sweep:
    """A sweep file, expanded and checked (every cell resolved before anything runs); one line when it cannot be.
    ``create``: also make its state folder under OUT (sweep.json), as running it does. ``index``: the one cell
    to run (--index), refused before anything is written when the sweep has no such cell."""
    path = Path(path)
    if not path.is_file():
        raise LlmadaptError(f"sweep file {path}: {not_a_file(path)}")
    try:
        data = read_document(path)
    except ValueError as exc:
        raise LlmadaptError(f"sweep file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise LlmadaptError(f"sweep file {path}: the top level must be a table")
    known = {"name", "workload", "adapters", "cells", "set", "matrix", "repeat", "retries", "maxbatch"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise LlmadaptError(f"sweep file {path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    if not isinstance(data.get("workload"), str):
        raise LlmadaptError(f"sweep file {path}: 'workload' must name a workload file")
    for key, kind in (("adapters", list), ("cells", list), ("set", list), ("matrix", dict), ("maxbatch", dict)):
        if key in data and not isinstance(data[key], kind):
            raise LlmadaptError(f"sweep file {path}: {key!r} must be a {'list' if kind is list else 'table'}")
    repeat, retries = data.get("repeat", 1), data.get("retries", 0)
    if not isinstance(repeat, int) or repeat < 1:
        raise LlmadaptError(f"sweep file {path}: 'repeat' must be a whole number >= 1")
    if not isinstance(retries, int) or retries < 0:
        raise LlmadaptError(f"sweep file {path}: 'retries' must be a whole number >= 0")
    maxbatch = _maxbatch_options(path, data.get("maxbatch"))
    workload_path = (path.parent / data["workload"]).resolve()
    workload = Workload.from_file(workload_path).with_overrides([*data.get("set", []), *(overrides or [])],
                                                                source="--set")
    matrix = {k: v if isinstance(v, list) else [v] for k, v in (data.get("matrix") or {}).items()}
    try:
        planned = plan(workload, as_cells(data.get("adapters"), data.get("cells")), matrix)
    except LlmadaptError as exc:
        raise LlmadaptError(f"sweep file {path}: {exc}") from None
    planned = [p for p in planned if not p.unsupported]
    if not planned:
        raise LlmadaptError(f"sweep file {path}: no cell that its adapter can run")
    cells = [SweepCell(_cell_id(p, r), p, r) for p in planned for r in range(repeat)]
    name = str(data.get("name") or path.stem)
    sweep_id = hashlib.sha256("".join(c.id for c in cells).encode()).hexdigest()[:8]
    folder = Path(out) / f"sweep-{name}-{sweep_id}"
    sweep = Sweep(path, name, workload, cells, retries, maxbatch, folder, Path(out))
    if index is not None and not 0 <= index < len(cells):
        raise LlmadaptError(f"--index {index}: the sweep has cells 0 to {len(cells) - 1}")
    if not create:
        return sweep
    folder.mkdir(parents=True, exist_ok=True)
    description = {"name": name, "file": str(path.resolve()), "workload": str(workload_path), "retries": retries,
                   "cells": [{"index": i, "id": c.id, "title": c.title, "adapter": c.planned.cell.adapter,
                              "variant": c.planned.variant, "repeat": c.repeat,
                              "workload_hash": c.planned.workload.content_hash} for i, c in enumerate(cells)]}
    if not (folder / "sweep.json").is_file() or json.loads((folder / "sweep.json").read_text()) != description:
        tmp = folder / f".sweep.json.{os.getpid()}"
        tmp.write_text(json.dumps(description, indent=1))
        os.replace(tmp, folder / "sweep.json")
    return sweep


def _maxbatch_options(path: Path, given: dict[str, Any] | None) -> dict[str, Any] | None:
    if given is None:
        return None
    from llmadapt.experiments.micro import parse_size

    unknown = sorted(set(given) - {"memory_limit", "max_batch", "steps"})
    if unknown:
        raise LlmadaptError(f"sweep file {path}: unknown maxbatch key {unknown[0]!r}; known: max_batch, memory_limit, "
                            "steps")
    out: dict[str, Any] = {}
    if "memory_limit" in given:
        out["memory_limit_bytes"] = parse_size(str(given["memory_limit"]))
    for key in ("max_batch", "steps"):
        if key in given:
            if not isinstance(given[key], int) or given[key] < 1:
                raise LlmadaptError(f"sweep file {path}: maxbatch.{key} must be a whole number >= 1")
            out[key] = given[key]
    return out


def _slurm_task_alive(state: dict[str, Any]) -> bool:
    """A cell run by a Slurm array task on another node: running while its job is in the queue."""
    import shutil

    job = state.get("slurm_job")
    if not job or shutil.which("squeue") is None:
        return True  # nothing to ask: trust the file
    return _queued(job)


def _queued(job: str) -> bool:
    """The job (or array task, JOB_TASK) is still in Slurm's queue."""
    import subprocess

    q = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True)
    return q.returncode == 0 and bool(q.stdout.strip())


def _cell_id(p: PlannedCell, repeat: int) -> str:
    return hashlib.sha256(f"{p.cell.adapter}:{p.workload.content_hash}:{repeat}".encode()).hexdigest()[:12]


def run_on_slurm(sweep: Sweep, slurm_options: list[str], *, log: Callable[[str], None], timeout: float | None = None,
                 poll_s: float = 1.0, run_args: list[str] | tuple[str, ...] = ()) -> str:
    """Submit the sweep's cells that are not done as one job array and wait for it; returns the job id. The cells'
    files say how each ended (a task that died leaves its cell running: pending or failed once seen gone)."""
    from llmadapt.launch.slurm import cancel, require_slurm, submit

    require_slurm()
    todo = [i for i, (cell, status, _) in enumerate(sweep.status(slurm_machine())) if status != "done"]
    if not todo:
        log("every cell is done")
        return ""
    path = sweep.folder / "sweep.sbatch"
    path.write_text(sweep.array_script(sys.executable, slurm_options, todo, run_args))
    job = submit(path, dict(os.environ))
    log(f"submitted job array {job}: {len(todo)} cell(s); its script is {path}")
    (sweep.folder / "slurm-job").write_text(job)
    started = time.monotonic()
    while True:
        if not _queued(job):
            break
        if timeout is not None and time.monotonic() - started > timeout:
            cancel(job)
            log(f"job {job} cancelled after {timeout:g} s")
            break
        time.sleep(poll_s)
    return job
