"""`llmadapt runs import FILE...`: other tools' result files read (llmadapt.contract.foreign), written as run
folders by the launcher of kind "import" (llmadapt.launch.importer) and imported into the run store."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from llmadapt.contract.foreign import read_result, with_version
from llmadapt.launch.importer import write_run
from llmadapt.spec import Workload


def import_files(store, files: list[str | Path], *, workload: Workload | None = None,
                 folders: list[str | Path] = (), tool_version: str | None = None,
                 log: Callable[[str], None] | None = None) -> list[str]:
    """Each file converted to a run folder and imported into ``store`` (a RunStore), with ``folders`` (run
    folders, imported as they are); every file is read and converted before anything is imported, and the store's
    import checks every folder before it copies one, so a file or folder that fails leaves the store as it was."""
    measured = [with_version(read_result(f), tool_version) for f in files]
    with tempfile.TemporaryDirectory(prefix="llmadapt-import-") as tmp:
        made = []
        for i, m in enumerate(measured):
            folder = write_run(m, Path(tmp) / str(i), workload)
            if log:
                log(f"{m.path}: {m.measured_by}, " + (f"{len(m.sent)} requests" if m.sent is not None else
                                                       "aggregate figures only (a summary-only run)"))
            made.append(folder)
        return store.import_runs([*folders, *made], log=log)
