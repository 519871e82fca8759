"""Cells: what a comparison runs. A cell is one adapter with settings of its own ("megatron:parallelism.tp=2");
a plan crosses the cells with the matrix's variants, resolves each to the workload it runs, checks each before
anything starts, and labels each by its layout.

Settings apply in this order, the last setting of a field winning: the workload file, its ``[adapters.NAME]``
section, ``--set`` (``--set NAME:path=value`` for one adapter), the cell's own settings, the matrix variant.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Iterable

import attrs

from llmadapt.adapter.plugins import check_supported, get_adapter
from llmadapt.errors import LlmadaptError, UnsupportedError, WorkloadError
from llmadapt.launch.settings import check_adapter_settings
from llmadapt.spec import Workload, varied_fields
from llmadapt.spec.loading import flatten

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


def layout_label(adapter: str, w: Workload) -> str:
    """'deepspeed dp2 zero3 offload=optimizer recompute=full': the adapter and every layout or memory setting
    that is not the default (dp1 when nothing is parallel)."""
    if w.kind == "serve":
        return adapter
    p, o, t = w.parallelism, w.optimizations, w.train
    parts = [f"{n}{v}" for n, v in (("tp", p.tp), ("pp", p.pp), ("dp", p.dp), ("ep", p.ep)) if v > 1] or ["dp1"]
    if o.zero_stage:
        parts.append(f"zero{o.zero_stage}")
    if o.offload != "none":
        parts.append(f"offload={o.offload}")
    if o.recompute != "none":
        parts.append(f"recompute={o.recompute}")
    if o.quantization != "none":
        parts.append(f"quantization={o.quantization}")
    if o.flash_attention:
        parts.append("flash")
    if t.micro_batch and t.micro_batch != w.per_rank_batch:
        parts.append(f"mb{t.micro_batch}")
    if t.optimizer_impl != "torch":
        parts.append(t.optimizer_impl)
    return " ".join([adapter, *parts])


def run_label(summary: dict[str, Any], w: Workload) -> str:
    """A stored run's row label: its layout (``layout_label``), or for a result another tool measured (imported
    from its file: llmadapt.analysis.foreign) the tool and its version, 'vllm bench serve 0.32.0'."""
    if summary.get("measured_by"):
        only = ((summary.get("serving") or {}).get("validity") or "").startswith("summary only")
        return summary["measured_by"] + (" (summary only)" if only else "")
    return layout_label(summary["adapter"], w)


# The fields a training row's layout label names in a form of its own ('dp2', 'zero3', 'mb4'; ``layout_label``)
_LAYOUT_NAMED = frozenset({
    "parallelism.tp", "parallelism.pp", "parallelism.dp", "parallelism.ep", "optimizations.zero_stage",
    "optimizations.offload", "optimizations.recompute", "optimizations.flash_attention", "optimizations.quantization",
    "train.micro_batch", "train.optimizer_impl"})


# Sections that do not describe a row of the kind: a serving run takes no training settings, a training run no serving
_NOT_OF_KIND = {"serve": ("data", "train", "lora", "eval", "save", "profile", "parallelism", "optimizations"),
                "train": ("serve",)}


def distinct_labels(labelled: list[tuple[str, Workload | dict[str, Any] | None]],
                    ignore: Iterable[str] = ()) -> list[str]:
    """Each (label, workload) pair's label followed by every workload field that differs among the pairs and the
    label does not name yet, as name=value in its shortest unambiguous form: the path's last component
    ('global_batch=4', 'experts_per_token=2'), or as many components as tell it from the other fields named; a
    model that differs in its preset is named once ('model=tiny-mixtral'). Serving and training rows sit in tables
    of their own, so each is told apart from those of its own kind, by the sections that kind uses. The one place a
    label that tells rows apart is made: compare's rows, a sweep's cells, the report's rows and series, ``runs``.
    ``ignore``: paths the rows are meant to differ in (a series over batch sizes). A workload may be given as its
    dict (a stored run's); a pair without one, or whose dict does not read as one, keeps its label."""
    labelled = [(label, _as_workload(w)) for label, w in labelled]
    out = [label for label, _ in labelled]
    for kind in ("train", "serve"):
        mine = [i for i, (_, w) in enumerate(labelled) if w is not None and (w.kind == "serve") == (kind == "serve")]
        workloads = [labelled[i][1] for i in mine]
        paths = [p for p in varied_fields(workloads) if p not in set(ignore)
                 and p.split(".")[0] not in _NOT_OF_KIND[kind]] if len(mine) > 1 else []
        if "model.name" in paths:  # another model: its name says it, not each of its fields
            paths = [p for p in paths if not p.startswith("model.") or p == "model.name"]
        names = _short_names(paths)
        for i, w in zip(mine, workloads):
            out[i] = " ".join([out[i], *(f"{names[p]}={v}" for p, v in _unnamed(out[i], w, paths))])
    return out


def _unnamed(label: str, w: Workload, paths: list[str]) -> list[tuple[str, str]]:
    """(path, value) of the PATHS whose value the label does not say yet (in its layout's words, or as name=value)."""
    tokens = set(re.split(r"[\s,\[\]]+", label))
    flat = flatten(w.to_dict())
    out = []
    for path in paths:
        value = _yaml_scalar(flat.get(path))
        if not ((w.kind != "serve" and path in _LAYOUT_NAMED) or f"{path.split('.')[-1]}={value}" in tokens
                or (path == "parallelism.threads_per_rank" and f"thr{value}" in tokens)
                or (path == "model.name" and value in tokens)):
            out.append((path, value))
    return out


def labelled_by(summary: dict[str, Any], w: Workload | dict[str, Any] | None) -> Workload | None:
    """The workload a run is told apart from others by (``distinct_labels``): its own; None for a result another
    tool measured, imported without the workload it ran (its workload then states nothing of what ran)."""
    w = _as_workload(w)
    if w is not None and summary.get("measured_by") and w.problem_hash != summary.get("problem_hash"):
        return None
    return w


def _as_workload(w: Workload | dict[str, Any] | None) -> Workload | None:
    if w is None or isinstance(w, Workload):
        return w
    try:
        return Workload.from_dict(w)
    except (LlmadaptError, ValueError, TypeError, KeyError):
        return None


def _short_names(paths: list[str]) -> dict[str, str]:
    """Each path's shortest tail of components that no other path of PATHS ends with ('model.name': 'model')."""
    out = {}
    for path in paths:
        parts = path.split(".")[:-1] if path == "model.name" else path.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(q != path and (q == tail or q.endswith("." + tail)) for q in paths):
                break
        out[path] = tail
    return out


def matrix_settings(matrix: dict[str, list[Any]]) -> list[tuple[str, list[str]]]:
    """Every combination of the matrix values as (label, assignments); labels like 'dp=2,recompute=full'.

    A key naming several comma-separated paths is one axis whose values are tuples, one value per
    path, taken together (zipped, not crossed): {"optimizations.zero_stage,optimizations.offload":
    [(0, "none"), (2, "optimizer")]} is two variants. That names configurations a cross product
    cannot, because some combinations are invalid (offload without ZeRO).
    """
    if not matrix:
        return [("", [])]
    axes = []
    for key, values in matrix.items():
        paths = [p.strip() for p in key.split(",")]
        if not values:
            raise LlmadaptError(f"matrix {key!r}: no values")
        options = []
        for v in values:
            v = tuple(v) if len(paths) > 1 and isinstance(v, (list, tuple)) else (v,)
            if len(v) != len(paths):
                raise LlmadaptError(f"matrix {key!r}: value {v!r} needs {len(paths)} parts, one per path")
            options.append(list(zip(paths, v)))
        axes.append(options)
    out = []
    for combination in itertools.product(*axes):
        pairs = [pair for option in combination for pair in option]
        sets = [f"{k}={_yaml_scalar(v)}" for k, v in pairs]
        label = ",".join(f"{k.split('.')[-1]}={_yaml_scalar(v)}" for k, v in pairs)
        out.append((label, sets))
    return out


def _yaml_scalar(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v
