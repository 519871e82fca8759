"""A run folder's status, one notion for every reader (`show`, the run store, sweeps): a run with its summary has
the summary's (ok, failed, diverged, degraded); one whose summary.json cannot be read is ``damaged``; one with no
summary yet is ``running`` while a process on this machine works in its folder, else ``failed`` (or
``diverged``) when its records hold a failure, else ``incomplete`` (its orchestrator did not finish).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from llmadapt.contract.rundir import RunDir


def settle_status(summary: dict[str, Any], run_dir: str | Path, problem: str, *, damaged: bool,
                  running: bool | None = None) -> dict[str, Any]:
    """SUMMARY, rebuilt from a folder's records (its summary.json ``damaged``, or missing), with the status above
    and, first in its warnings, PROBLEM (what is wrong with its summary.json). ``running``: whether a process works
    in the folder (None: look, once)."""
    if damaged:
        status = "damaged"
    else:
        if running is None:
            running = bool(live_processes([Path(run_dir)])[Path(run_dir)])
        status = "running" if running else summary["status"] if summary.get("failures") else "incomplete"
        problem = "running: no summary.json yet" if running else problem
    return {**summary, "status": status,
            "warnings": [f"{problem}; this summary is built from the records on disk", *summary.get("warnings", [])]}


def live_processes(folders: Iterable[Path]) -> dict[Path, list[int]]:
    """The processes on this machine that work in each folder: they hold a file in it open, have it as their
    working folder or an argument, or a pid file in it (``*.pid``: an engine's) names them. One look at /proc
    (Linux; elsewhere none are found)."""
    wanted = {Path(f).resolve(): Path(f) for f in folders}
    found: dict[Path, list[int]] = {f: [] for f in wanted.values()}

    def owner(path: str | Path) -> Path | None:
        target = Path(path)
        for parent in (target, *target.parents):
            if parent in wanted:
                return wanted[parent]
        return None

    for resolved, folder in wanted.items():
        for pid_file in resolved.glob(RunDir.PID_GLOB):
            try:
                pid = int(pid_file.read_text().strip().rpartition(":")[2])
            except (OSError, ValueError):
                continue
            if _alive(pid):
                found[folder].append(pid)
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    me, names = os.getpid(), [f.name.encode() for f in wanted]
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid, hits = int(entry.name), set()
        try:
            cwd = os.readlink(entry / "cwd")
            hits.add(owner(cwd))
            for arg in (entry / "cmdline").read_bytes().split(b"\0"):
                if any(name in arg for name in names):  # a worker's RUN_DIR, relative to its working folder
                    hits.add(owner(os.path.realpath(os.path.join(cwd, os.fsdecode(arg)))))
            for fd in (entry / "fd").iterdir():
                try:
                    hits.add(owner(os.readlink(fd)))
                except OSError:
                    continue
        except OSError:  # gone, or not ours to read
            continue
        for folder in hits - {None}:
            if pid not in found[folder] and _alive(pid):
                found[folder].append(pid)
    return found


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (exited, waiting for its parent to read its status)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
