"""JSONL files of records: the writer (one flushed line per record, so a crash keeps every earlier one) and
the reader (schema-checked, old names upgraded). Records read back as their attrs classes go through the one
converter (``llmadapt.contract.launch.structure``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llmadapt.contract.schema import to_json_line, upgrade, validate
from llmadapt.errors import ContractError


# -- JSONL ----------------------------------------------------------------------------------
class JsonlWriter:
    """Appends one JSON object per line, each in one write to the file, so nothing written is lost on a crash
    (and no buffer layer sits between a step's record and the disk: the worker writes one between steps)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def write(self, record: Any) -> None:
        text = json.dumps(record, separators=(",", ":")) if isinstance(record, dict) else to_json_line(record)
        line = (text + "\n").encode()
        if self._fd is None:
            raise ValueError(f"{self.path}: the writer is closed")
        written = os.write(self._fd, line)
        while written < len(line):  # a short write (a signal, a nearly full disk): the rest, or the OSError
            written += os.write(self._fd, line[written:])

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | Path, *, check: bool = True) -> list[dict[str, Any]]:
    """Read and (by default) validate every record. A torn last line (killed mid-write) is skipped."""
    records = []
    # Bytes, not text: a file with binary garbage is named by its line below, not a UnicodeDecodeError.
    lines = Path(path).read_bytes().decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the writer was killed mid-line; everything before it stands
            raise ContractError(f"{path}:{number}: not valid JSON") from None
        record = upgrade(record)
        if check:
            try:
                validate(record)
            except ContractError as exc:
                raise ContractError(f"{path}:{number}: {exc}") from None
        records.append(record)
    return records

