"""Aligned text tables, as every command prints them: one renderer (rich), plain ASCII, no colour.

Cells are text, never markup (the console has markup off) (a run label such as ``torch [dp=2]`` stays as it is); columns whose
cells are all numbers (or "-") are right-aligned.
"""

from __future__ import annotations

import io
import re
from typing import Any, Iterable

_NUMBER = re.compile(r"^[+-]?[\d,]*\.?\d+(e[+-]?\d+)?%?$|^-$", re.IGNORECASE)


def text_table(head: list[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """The table's lines: the head, a rule, one line per row."""
    from rich.box import Box  # here, not at import: `llmadapt --help` stays quick
    from rich.console import Console
    from rich.table import Table

    rule = Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)  # one dashed rule under the head
    body = [["-" if c is None else str(c) for c in row] for row in rows]
    table = Table(box=rule, show_edge=False, pad_edge=False, header_style=None, highlight=False)
    for i, title in enumerate(head):
        numeric = bool(body) and all(_NUMBER.match(r[i]) for r in body) and any(r[i] != "-" for r in body)
        table.add_column(title, justify="right" if numeric else "left", no_wrap=True)
    for row in body:
        table.add_row(*row)
    out = io.StringIO()
    Console(file=out, width=100_000, color_system=None, force_terminal=False, highlight=False,
            emoji=False, markup=False).print(table)
    return [line.rstrip() for line in out.getvalue().splitlines() if line.strip()]
