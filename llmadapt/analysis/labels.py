"""Labels: what names a run's row (its layout: 'zero3 dp2 mb4'), what tells rows apart where their layouts are
the same (the settings that differ), and the ``--matrix`` settings' variants with their labels. Read from a workload
or a stored run; nothing here plans or starts a run (llmadapt.experiments.cells does).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Iterable

from llmadapt.errors import LlmadaptError
from llmadapt.spec import Workload, varied_fields
from llmadapt.spec.loading import flatten


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
    from its file: llmadapt.contract.foreign) the tool and its version, 'vllm bench serve 0.32.0'."""
    if summary.get("measured_by"):
        only = ((summary.get("serving") or {}).get("validity") or "").startswith("summary only")
        return summary["measured_by"] + (" (summary only)" if only else "")
    return layout_label(summary["adapter"], w)


# The fields a training row's layout label names in a form of its own ('dp2', 'zero3', 'mb4'; ``layout_label``)
_LAYOUT_NAMED = frozenset({
    "parallelism.tp", "parallelism.pp", "parallelism.dp", "parallelism.ep", "optimizations.zero_stage",
    "optimizations.offload", "optimizations.recompute", "optimizations.flash_attention", "optimizations.quantization",
    "train.micro_batch", "train.optimizer_impl"})


# Where a run writes what it trained: not what a row measures, so never what tells rows apart (two stacks each
# saving to a folder of their own would otherwise read 'path=/home/me/runs/lora-torch')
_OUTPUTS = frozenset({"save.path"})


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
        paths = [p for p in varied_fields(workloads) if p not in set(ignore) and p not in _OUTPUTS
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
