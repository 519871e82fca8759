"""Cells: what a comparison runs. A cell is one adapter with settings of its own ("megatron:parallelism.tp=2");
a plan crosses the cells with the matrix's variants, resolves each to the workload it runs, checks each before
anything starts, and labels each by its layout.

Settings apply in this order, the last setting of a field winning: the workload file, its ``[adapters.NAME]``
section, ``--set`` (``--set NAME:path=value`` for one adapter), the cell's own settings, the matrix variant.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import attrs

from llmadapt.adapter.plugins import check_supported, get_adapter
from llmadapt.analysis.labels import distinct_labels, layout_label, matrix_settings
from llmadapt.errors import LlmadaptError, UnsupportedError, WorkloadError
from llmadapt.launch.settings import check_adapter_settings
from llmadapt.spec import Workload

# a comma starts a new setting only where "path=" follows: list values keep theirs ("lora.target_modules=[a,b]")
_NEXT_SETTING = re.compile(r",(?=\s*[A-Za-z_][\w.]*\s*=)")


@attrs.frozen
class Cell:
    """One adapter and the settings it runs with, on top of the workload's."""

    adapter: str
    settings: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """``path=value`` assignments, as ``--set`` takes them."""

    @classmethod
    def parse(cls, text: str) -> Cell:
        """'megatron:parallelism.tp=2,optimizations.recompute=full' (or a bare adapter name, 'torch')."""
        name, sep, rest = text.partition(":")
        name = name.strip()
        settings = [s.strip() for s in _NEXT_SETTING.split(rest) if s.strip()] if sep else []
        if not name or "=" in name or (sep and not settings) or any("=" not in s for s in settings):
            raise LlmadaptError(f"cell {text[:80]!r}: use ADAPTER or ADAPTER:path=value[,path=value...], "
                                "e.g. megatron:parallelism.tp=2,parallelism.dp=1")
        return cls(name, tuple(settings))

    def __str__(self) -> str:
        return self.adapter + (":" + ",".join(self.settings) if self.settings else "")


@attrs.frozen
class PlannedCell:
    cell: Cell
    variant: str
    """The matrix variant's label ('dp=2,recompute=full'); '' without a matrix."""
    workload: Workload
    """What the run gets: the adapter's own settings, the cell's and the variant's applied."""
    layout: str
    """A compact label of the layout: 'megatron tp2', 'deepspeed dp2 zero3 offload=optimizer'."""
    unsupported: str | None = None
    """Why the adapter declares it cannot run this cell; None when it can."""
    distinct: str = ""
    """The fields that set this cell apart from the others of its plan and its layout does not name
    ('global_batch=4 experts_per_token=2'; ``distinct_labels``)."""

    @property
    def title(self) -> str:
        base = self.layout if not self.variant or self.workload.kind != "serve" else f"{self.layout} [{self.variant}]"
        return f"{base} {self.distinct}" if self.distinct else base


def _distinguished(planned: list[PlannedCell]) -> list[PlannedCell]:
    """The cells with ``distinct`` set anew: what tells each apart from the others (``distinct_labels``)."""
    bare = [attrs.evolve(p, distinct="") for p in planned]
    titles = distinct_labels([(p.title, p.workload) for p in bare])
    return [attrs.evolve(p, distinct=t[len(p.title):].strip()) for p, t in zip(bare, titles)]


def as_cells(adapters: Iterable[str] | None, cells: Iterable[Cell | str] | None) -> list[Cell]:
    """Cells from a list of adapter names (one plain cell each) and explicit cells (Cell or 'adapter:settings')."""
    out = [Cell(name) for name in adapters or ()]
    out += [c if isinstance(c, Cell) else Cell.parse(c) for c in cells or ()]
    if not out:
        raise LlmadaptError("nothing to run: name adapters (--adapters torch,deepspeed) or cells "
                            "(--cell 'megatron:parallelism.tp=2')")
    return out


def plan(workload: Workload, cells: list[Cell], matrix: dict[str, list[Any]] | None = None, *,
         refuse_unsupported: bool = False, distinct: bool = True) -> list[PlannedCell]:
    """Every cell on every matrix variant, resolved and checked; nothing is run.

    Bad input (an unknown adapter or field, a layout its workload cannot have) is an error naming the cell. A
    cell its adapter declares it cannot run, given explicitly or made by the matrix alike, is planned as
    unsupported, with the reason, and not run; it is an error with ``refuse_unsupported``, or where no cell of the
    plan can run. Two cells
    that run the same workload on the same adapter are an error unless ``distinct`` is off (parity of a run
    with itself checks determinism).
    """
    for cell in cells:
        get_adapter(cell.adapter)
    check_adapter_settings(workload, [c.adapter for c in cells], scope="comparison")
    variants = matrix_settings(matrix or {})
    planned: list[PlannedCell] = []
    for cell in cells:
        for label, sets in variants:
            where = f"cell {cell}" + (f" [{label}]" if label else "")
            try:
                w = workload.for_adapter(cell.adapter).with_overrides(cell.settings, source="cell")
                w = w.with_overrides(sets, source="matrix")
            except WorkloadError as exc:
                raise LlmadaptError(f"{where}: {exc}") from None
            if w.adapters:  # 'other:path=value' inside a cell
                raise LlmadaptError(f"{where}: a cell's settings are its own adapter's; write path=value, not "
                                    f"{next(iter(w.adapters))}:path=value")
            try:
                check_supported(get_adapter(cell.adapter), w)
                reason = None
            except UnsupportedError as exc:
                if refuse_unsupported:
                    raise UnsupportedError(f"{where}: {exc}") from None
                reason = str(exc)
            planned.append(PlannedCell(cell, label, w, layout_label(cell.adapter, w), reason))
    if all(p.unsupported for p in planned):  # nothing would run: the first reason is the answer
        first = planned[0]
        more = f" (nor can the other {len(planned) - 1} cell(s) run)" if len(planned) > 1 else ""
        raise UnsupportedError(f"cell {first.cell}{f' [{first.variant}]' if first.variant else ''}: "
                               f"{first.unsupported}{more}")
    planned = _distinguished(planned)
    seen: dict[tuple[str, str], PlannedCell] = {}
    for p in planned if distinct else ():
        first = seen.setdefault((p.cell.adapter, p.workload.content_hash), p)
        if first is not p:
            raise LlmadaptError(f"cells {first.cell}{f' [{first.variant}]' if first.variant else ''} and "
                                f"{p.cell}{f' [{p.variant}]' if p.variant else ''} run the same workload on "
                                f"{p.cell.adapter}: give each once")
    return planned


def same_threads(planned: list[PlannedCell], ranks_per_node=None) -> tuple[list[PlannedCell], str | None]:
    """The training cells of one comparison with the same CPU threads per rank: a cell that leaves
    parallelism.threads_per_rank unset gets the fewest any cell would get by default (1-rank and 2-rank cells on
    two cores: one thread each, not two against one), and where cells still differ (set by the user), their
    labels say thrN. Returns the cells and a line saying what was chosen (None when nothing was)."""
    from llmadapt.launch.supervise import default_threads

    ranks_per_node = ranks_per_node or (lambda w: w.world_size)
    train = [p for p in planned if p.workload.kind != "serve"]
    unset = [p for p in train if not p.workload.parallelism.threads_per_rank]
    chosen = min((default_threads(ranks_per_node(p.workload)) for p in unset), default=0)
    if unset and len({default_threads(ranks_per_node(p.workload)) for p in unset}) == 1 and len(unset) == len(train):
        return planned, None  # every cell gets the same without being told
    out, line = [], None
    for p in planned:
        if p in unset:
            w = p.workload.with_overrides([f"parallelism.threads_per_rank={chosen}"], source="comparison")
            p = attrs.evolve(p, workload=w)
        out.append(p)
    counts = {p.workload.parallelism.threads_per_rank for p in out if p.workload.kind != "serve"}
    if len(counts) > 1:
        out = [attrs.evolve(p, layout=f"{p.layout} thr{p.workload.parallelism.threads_per_rank}")
               if p.workload.kind != "serve" else p for p in out]
    out = _distinguished(out)
    if unset:
        line = (f"threads per rank: {chosen} for the {len(unset)} cell(s) that leave it unset, the fewest any of "
                "them gets by default (set parallelism.threads_per_rank to choose)")
    return out, line


