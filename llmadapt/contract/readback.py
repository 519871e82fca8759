"""A run folder read back: its records (rank files and the launcher's), the failures the launcher saw, and
the summary written from them. Below both the orchestrator (llmadapt.launch, which writes the summary at a run's
end) and the analysis (which reads runs back): reading a run folder is the contract's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from llmadapt.contract.jsonl import JsonlWriter, read_jsonl
from llmadapt.contract.records import Failure, Summary
from llmadapt.contract.rundir import RunDir
from llmadapt.contract.schema import to_json
from llmadapt.contract.stats import aggregate
from llmadapt.errors import ContractError, StorageError


# How the orchestrator words a worker's exit in launcher.jsonl (llmadapt.launch.supervise writes them).
EXIT_PREFIXES = ("worker was killed by", "worker exited with code", "worker killed by")  # the last: older runs


@attrs.frozen
class RunResult:
    run_dir: Path
    summary: Summary

    @property
    def ok(self) -> bool:
        return self.summary.status == "ok"

    @property
    def losses(self) -> list[float | None]:
        return self.summary.losses


def write_launcher_failures(run_dir: Path, failures: list[Failure]) -> None:
    """Append what the orchestrator saw go wrong (timeout, interrupt, exit codes) to launcher.jsonl."""
    if failures:
        with JsonlWriter(RunDir(run_dir).launcher_file) as w:
            for f in failures:
                w.write(f)


def summarise(run_dir: str | Path, launcher_failures: list[Failure] = (), *, write: bool = True,
              over: bool = True) -> Summary:
    """(Re)build the run's summary from the records on disk plus ``launcher_failures``.

    ``over``: the run is over (``aggregate``'s); False for a folder read while its run may go on.
    ``write``: append the launcher failures to launcher.jsonl and write summary.json. A disk that
    refuses them (full, read-only) is one clear error (StorageError: an I/O exit code, not bad input); every
    record already written stays readable.
    """
    run_dir = Path(run_dir)
    launch = RunDir(run_dir).read_launch()
    if launch.kind != "workload" or not launch.run_id or launch.workload is None:  # a micro-benchmark's, or hand-made
        raise ContractError(f"{RunDir(run_dir).launch_file} asks for no workload run (kind {launch.kind!r}, run id "
                            f"{launch.run_id!r}): there is no run summary to build")
    rank_records, launcher_records = load_records(run_dir, split=True)
    launcher_records += [to_json(f) for f in launcher_failures]
    view = _launcher_view(rank_records, launcher_records)
    # A rank that died without a word comes first: its peers' failures (a collective that lost it) follow from it.
    first = [r for r in view if died_unrecorded(r)]
    summary = aggregate(launch.run_id, first + rank_records + [r for r in view if r not in first], launch,
                        over=over)
    if write:
        target = RunDir(run_dir).launcher_file
        try:
            write_launcher_failures(run_dir, list(launcher_failures))
            target = RunDir(run_dir).summary_file
            target.write_text(json.dumps(to_json(summary), indent=2))
        except OSError as exc:  # the machine's (a full disk), not the input's: exit code 4 (errors.ExitCode.IO)
            raise StorageError(f"could not write {target}: {exc.strerror or exc}; every record written before is "
                               f"kept in {run_dir} (`llmadapt show {run_dir}` reads them)") from None
    return summary


def _launcher_view(rank_records: list[dict[str, Any]], launcher_records: list[dict[str, Any]]) -> list[dict]:
    """The launcher's failures that add something to what the ranks recorded themselves.

    A rank's own failure record says more than torchrun's "rank 1 exited with code 1", and a bare
    "worker exited / killed" says less than either; a timeout, an interrupt, a node or Slurm's reason stay.
    """
    failed_ranks = {r["rank"] for r in rank_records if r["type"] == "failure"}
    return [r for r in launcher_records
            if not (r["type"] == "failure" and (r["rank"] in failed_ranks or (
                failed_ranks and r["rank"] is None and r["cause"] in ("crash", "killed")
                and r["message"].startswith(EXIT_PREFIXES))))]


def load_records(run_dir: Path, *, split: bool = False):
    """Every record of the run: the ranks' files, then launcher.jsonl (``split``: as two lists)."""
    ranks: list[dict[str, Any]] = []
    for path in RunDir(run_dir).rank_files():
        ranks += read_jsonl(path)
    path = RunDir(run_dir).launcher_file
    launcher = read_jsonl(path) if path.is_file() else []
    return (ranks, launcher) if split else ranks + launcher

def died_unrecorded(record: dict) -> bool:
    """A launcher's failure record of a rank that died (killed, exited) without a failure record of its own:
    where a failed run's story starts, before its peers' errors (a collective that lost it)."""
    return (record.get("type") == "failure" and record.get("rank") is not None
            and record.get("cause") in ("killed", "crash") and record.get("message", "").startswith(
                f"rank {record['rank']} (pid"))
