"""Aligned text tables, as every command prints them: rich's table layout, plain ASCII, no colour.

Cells are text, never markup (the console has markup off) (a run label such as ``torch [dp=2]`` stays as it is);
columns whose cells are all numbers (or "-") are right-aligned. A table of printable ASCII cells (one line each, no
space at either end, no column all empty) is laid out here as rich lays it out (each column as wide as its widest
cell, three spaces between columns); any other goes through rich, whose import alone takes longer than `llmadapt
adapters` has to list the adapters.
"""

from __future__ import annotations

import io
import re
from typing import Any, Iterable

_NUMBER = re.compile(r"^[+-]?[\d,]*\.?\d+(e[+-]?\d+)?%?$|^-$", re.IGNORECASE)
_PRINTABLE_ASCII = re.compile(r"([!-~]([ -~]*[!-~])?)?")  # no space at either end: rich trims it


def text_table(head: list[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    """The table's lines: the head, a rule, one line per row."""
    body = [["-" if c is None else str(c) for c in row] for row in rows]
    right = [bool(body) and all(_NUMBER.match(r[i]) for r in body) and any(r[i] != "-" for r in body)
             for i in range(len(head))]
    columns = list(zip(head, *body))
    if (head and all(len(r) == len(head) for r in body) and all(any(column) for column in columns)
            and all(_PRINTABLE_ASCII.fullmatch(c) for column in columns for c in column)):
        return _ascii_lines(head, body, right)
    return _rich_lines(head, body, right)


def _ascii_lines(head: list[str], body: list[list[str]], right: list[bool]) -> list[str]:
    widths = [max(map(len, column)) for column in zip(head, *body)]

    def line(cells: list[str]) -> str:
        return "   ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    lines = [line(head), "-" * (sum(widths) + 3 * (len(widths) - 1)), *map(line, body)]
    return [text for text in lines if text.strip()]


def _rich_lines(head: list[str], body: list[list[str]], right: list[bool]) -> list[str]:
    from rich.box import Box  # here, not at import: `llmadapt --help` stays quick
    from rich.console import Console
    from rich.table import Table

    rule = Box("    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True)  # one dashed rule under the head
    table = Table(box=rule, show_edge=False, pad_edge=False, header_style=None, highlight=False)
    for title, numeric in zip(head, right):
        table.add_column(title, justify="right" if numeric else "left", no_wrap=True)
    for row in body:
        table.add_row(*row)
    out = io.StringIO()
    Console(file=out, width=100_000, color_system=None, force_terminal=False, highlight=False,
            emoji=False, markup=False).print(table)
    return [line.rstrip() for line in out.getvalue().splitlines() if line.strip()]
