"""The report's figures, drawn with matplotlib from what runs recorded: one function per figure, each returning a
Figure or None when the runs hold nothing for it. Why matplotlib: one library gives the same figure as inline SVG
in a self-contained page (no script to load, text drawn as paths, so no font is fetched) and as PNG and SVG files;
the page stays small and opens without a network.

``ReportRun`` is what a figure reads of one run: its label, workload, summary and records. The figures that answer
"which configuration" (the headline, loss and step time over steps, throughput against batch) are in
analysis.figures_train.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.spec import Workload

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#aec7e8", "#ff9896", "#98df8a", "#ffbb78", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
           "#dbdb8d", "#9edae5", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#6b6ecf", "#b5cf6b",
           "#e7ba52", "#d6616b", "#ce6dbd"]  # matplotlib's tab10, tab20's light halves, tab20b: 30 classes apart


@attrs.frozen
class ReportRun:
    label: str
    """The row's label (its layout, with '#2' for a repeat)."""
    folder: Path
    workload: Workload
    summary: dict[str, Any]
    records: list[dict[str, Any]] = attrs.field(repr=False)
    problem: str = ""
    """The problem's name in the report ('P2'): runs of different problems are never drawn on one axis."""

    @property
    def serving(self) -> bool:
        return self.workload.kind == "serve"

    def steps(self) -> dict[int, float]:
        """Each complete step's time: the slowest rank's."""
        by_step: dict[int, list[float]] = {}
        for r in self.records:
            if r["type"] == "step":
                by_step.setdefault(r["step"], []).append(r["seconds"])
        return {i: max(v) for i, v in sorted(by_step.items()) if len(v) == self.workload.world_size}


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "path", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
                         "figure.dpi": 100, "savefig.bbox": "tight"})
    return plt


def legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")


def memory(rows: list[tuple[str, float]]):
    """Peak memory per row: (label, MiB)."""
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    ax.barh([label for label, _ in rows], [mib for _, mib in rows], color=COLORS[0])
    ax.invert_yaxis()
    ax.set_xlabel("peak memory, MiB (device allocated on GPU, RSS on CPU; max over ranks)")
    return fig


def breakdown_bars(rows: list[tuple[str, dict[str, Any]]], key: str, order: tuple[str, ...]):
    """Each row's breakdown classes (``key``: modules or operators) as stacked bars twice: ms per profiled step
    (left: which row spends more) and shares of its step, 100% each (right: where each row's time goes)."""
    rows = [(label, b) for label, b in rows if b.get(key)]
    if not rows:
        return None
    present = {c["name"] for _, b in rows for c in b[key]}
    names = [n for n in order if n in present] + sorted(present - set(order))
    seconds = [[next((c["seconds"] * 1e3 for c in b[key] if c["name"] == name), 0.0) for name in names]
               for _, b in rows]
    plt = pyplot()
    fig, (absolute, share) = plt.subplots(1, 2, figsize=(10, 0.4 * len(rows) + 1.9), sharey=True,
                                          layout="constrained")
    labels = [label for label, _ in rows]
    for ax, scale in ((absolute, [1.0] * len(rows)), (share, [100 / (sum(v) or 1) for v in seconds])):
        left = [0.0] * len(rows)
        for j, name in enumerate(names):
            values = [v[j] * k for v, k in zip(seconds, scale)]
            ax.barh(labels, values, left=left, color=COLORS[j % len(COLORS)], label=name if ax is share else None)
            left = [a + v for a, v in zip(left, values)]
    absolute.invert_yaxis()
    what = "module" if key == "modules" else "operator"
    absolute.set_xlabel(f"ms per profiled step and rank, by {what} class")
    share.set_xlabel(f"share of the profiled step, % (each row 100%), by {what} class")
    share.set_xlim(0, 100)
    fig.legend(fontsize=7, ncol=min(len(names), 6), loc="outside lower center")
    return fig


def module_operator_bars(rows: list[tuple[str, dict[str, Any]]], modules: tuple[str, ...],
                         operators: tuple[str, ...]):
    """The module x operator matrix, one panel per row: each module class's time (ms per profiled step and rank)
    stacked by operator class, so that which operators a module spends its time on can be read off."""
    rows = [(label, {tuple(c["name"].rsplit("/", 1)): c["seconds"] * 1e3 for c in b["module_operators"]})
            for label, b in rows if b.get("module_operators")]
    if not rows:
        return None
    present_modules = {m for _, cells in rows for m, _ in cells}
    present_ops = {o for _, cells in rows for _, o in cells}
    names = [m for m in modules if m in present_modules] + sorted(present_modules - set(modules))
    ops = [o for o in operators if o in present_ops] + sorted(present_ops - set(operators))
    plt = pyplot()
    cols = min(len(rows), 3)
    grid = math.ceil(len(rows) / cols)
    fig, axes = plt.subplots(grid, cols, figsize=(3.6 * cols + 1.2, (0.2 * len(names) + 1.0) * grid + 0.8),
                             sharey=True, squeeze=False)
    for ax, (label, cells) in zip(axes.flat, rows):
        left = [0.0] * len(names)
        for j, op in enumerate(ops):
            values = [cells.get((m, op), 0.0) for m in names]
            ax.barh(range(len(names)), values, left=left, color=COLORS[j % len(COLORS)],
                    label=op if ax is axes.flat[0] else None)
            left = [a + v for a, v in zip(left, values)]
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("ms per profiled step and rank")
    for ax in axes.flat[len(rows):]:
        ax.set_visible(False)
    axes[0][0].set_yticks(range(len(names)), names)
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    fig.legend(fontsize=7, ncol=min(len(ops), 7), loc="lower center", bbox_to_anchor=(0.5, 1.0))  # above the panels
    return fig


def expert_heatmaps(runs: list[ReportRun]):
    """Per MoE run: tokens per expert and layer (mean over the steps after warm-up, share of the layer's)."""
    panels = []
    for r in runs:
        loads = [rec["expert_load"] for rec in r.records if rec["type"] == "step" and rec.get("expert_load")
                 and not rec["warmup"] and rec["rank"] == 0]
        if loads:
            layers, experts = len(loads[0]), len(loads[0][0])
            grid = [[sum(step[layer][e] for step in loads) for e in range(experts)] for layer in range(layers)]
            imb = r.summary.get("expert_imbalance") or []
            cv = f"CV {sum(x['cv'] for x in imb) / len(imb):.2f}" if imb else ""
            panels.append((f"{r.label}\n{cv}", grid))
    return _heatmaps(panels[:6])


def eval_expert_heatmaps(runs: list[ReportRun]):
    """Per MoE run with evaluations: tokens per expert and layer on the held-out examples before training and
    after the last step, side by side (study B's shift in routing)."""
    from llmadapt.contract.breakdowns import imbalance

    panels = []
    for r in runs:
        points = [e for e in r.summary.get("evaluations") or [] if e.get("expert_load")]
        if len(points) < 2:
            continue
        for when, e in (("before", points[0]), (f"step {points[-1]['step']}", points[-1])):
            cvs = [f[0] for f in map(imbalance, e["expert_load"]) if f is not None]
            panels.append((f"{r.label}, {when}\nCV {sum(cvs) / max(len(cvs), 1):.2f}", e["expert_load"]))
    return _heatmaps(panels[:6])


def _heatmaps(panels: list[tuple[str, list[list[int]]]]):
    """One heatmap per (title, tokens[layer][expert]) panel, as shares of each layer's tokens, on one colour scale."""
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(2.9 * len(panels) + 1.2, 2.9), squeeze=False,
                             layout="constrained")
    grids = [[[v / (sum(row) or 1) for v in row] for row in grid] for _, grid in panels]
    top = max(v for g in grids for row in g for v in row)
    image = None
    for ax, (title, _), shares in zip(axes[0], panels, grids):
        image = ax.imshow(shares, aspect="auto", cmap="viridis", vmin=0, vmax=top)
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_xticks(range(len(shares[0])))
        ax.set_yticks(range(len(shares)))
        ax.grid(False)
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.04, label="share of the layer's tokens")
    return fig


def evaluation_curves(runs: list[ReportRun]):
    """Held-out loss, and accuracy: exact match (solid; per-token accuracy, dashed, for synthetic data without
    answers) and choice accuracy (dotted, multiple-choice sets such as HellaSwag), against the steps trained, per
    run with evaluations: study B's accuracy per epoch when eval.every is an epoch's steps."""
    evaluated = [(r, r.summary["evaluations"]) for r in runs if r.summary.get("evaluations")]
    if not evaluated:
        return None
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    losses = [e["loss"] for _, points in evaluated for e in points]
    for i, (r, points) in enumerate(evaluated):
        steps = [e["step"] for e in points]
        style = dict(marker="o", ms=3, lw=1.2, color=COLORS[i % 20], label=r.label, alpha=0.85)
        left.plot(steps, [e["loss"] for e in points], **style)
        exact = points[0].get("exact_match") is not None
        right.plot(steps, [e["exact_match" if exact else "token_accuracy"] for e in points],
                   ls="-" if exact else "--", **style)
        if any(e.get("choice_accuracy") is not None for e in points):
            choice = [(s, e["choice_accuracy"]) for s, e in zip(steps, points) if e.get("choice_accuracy") is not None]
            right.plot([s for s, _ in choice], [a for _, a in choice], ls=":", **{**style, "label": None})
    if min(losses) > 0 and max(losses) / min(losses) > 20:
        left.set_yscale("log")
    left.set_xlabel("steps trained")
    left.set_ylabel("held-out loss (nats per token)")
    right.set_xlabel("steps trained")
    right.set_ylabel("exact match (dashed: per token;\ndotted: choice accuracy)")
    right.set_ylim(-0.02, 1.02)
    legend(right)
    return fig


def _request_latencies(r: ReportRun, what: str) -> list[float]:
    out = []
    for q in r.records:
        if q["type"] != "request" or q["warmup"] or q["status"] != "ok" or q.get("sent_ns") is None:
            continue
        end = q["first_token_ns"] if what == "ttft" else q["end_ns"]
        if end is not None:
            out.append((end - q["sent_ns"]) / 1e6)
    return sorted(out)


def latency_cdfs(runs: list[ReportRun]):
    serve = [r for r in runs if r.serving and _request_latencies(r, "ttft")]
    if not serve:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.3))
    for what, ax in zip(("ttft", "e2el"), axes):
        for i, r in enumerate(serve):
            values = _request_latencies(r, what)
            ax.step(values, [(k + 1) / len(values) for k in range(len(values))], where="post", color=COLORS[i % 20],
                    label=r.label)
        ax.set_xlabel(f"{what.upper()}, ms")
        ax.set_ylabel("share of requests")
    legend(axes[0])
    return fig


def engine_config(r: ReportRun) -> str:
    """A serving run's engine configuration: its adapter and the engine settings it was given."""
    return f"{r.summary['adapter']} {r.workload.serve.engine.label()}".strip()


def _timed_serving(runs: list[ReportRun]) -> list[ReportRun]:
    """Serving runs with latencies (offline runs have throughput only)."""
    return [r for r in runs if r.serving and r.summary.get("serving") and r.summary["serving"].get("ttft_ms")]


def latency_vs_load(runs: list[ReportRun]):
    """Serving runs of one engine configuration at several loads: TTFT and TPOT percentiles against achieved
    request rate."""
    groups: dict[str, list[ReportRun]] = {}
    for r in _timed_serving(runs):
        groups.setdefault(engine_config(r), []).append(r)
    groups = {k: v for k, v in groups.items() if len({x.summary["serving"]["request_throughput"] for x in v}) >= 2}
    if not groups:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.3))
    for i, (engine, group) in enumerate(sorted(groups.items())):
        group = sorted(group, key=lambda x: x.summary["serving"]["request_throughput"])
        xs = [x.summary["serving"]["request_throughput"] for x in group]
        for ax, metric in zip(axes, ("ttft", "tpot")):
            for q, style in (("p50", "-o"), ("p99", "--s")):
                ys = [(x.summary["serving"][f"{metric}_ms"] or {}).get(q) for x in group]
                ax.plot(xs, ys, style, ms=3, color=COLORS[i % 20], label=f"{engine} {q}")
                ax.set_xlabel("achieved requests/s")
                ax.set_ylabel(f"{metric.upper()}, ms")
    legend(axes[0])
    return fig


def throughput_vs_latency(runs: list[ReportRun], latency: str = "e2el", quantile: str = "p99"):
    """Every valid serving run as a point, output tokens/s against a latency percentile, coloured by engine
    configuration; the frontier (the points no other beats on both, llmadapt.analysis.pareto) joined by a line."""
    from llmadapt.analysis.pareto import on_frontier

    serve = [r for r in _timed_serving(runs) if r.summary["serving"].get("valid")
             and (r.summary["serving"][f"{latency}_ms"] or {}).get(quantile) is not None]
    if len(serve) < 2:
        return None
    xy = [(r.summary["serving"][f"{latency}_ms"][quantile], r.summary["serving"]["output_throughput"]) for r in serve]
    marks = on_frontier(xy)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    configs = sorted({engine_config(r) for r in serve})
    for i, config in enumerate(configs):
        mine = [p for r, p in zip(serve, xy) if engine_config(r) == config]
        ax.scatter([x for x, _ in mine], [y for _, y in mine], s=22, color=COLORS[i % 20], label=config, zorder=3)
    front = sorted(p for p, on in zip(xy, marks) if on)
    ax.step([x for x, _ in front], [y for _, y in front], where="post", color="#333", lw=1, zorder=2,
            label=f"frontier ({len(front)} of {len(xy)} points)")
    ax.scatter([x for x, _ in front], [y for _, y in front], s=70, facecolors="none", edgecolors="#333", zorder=4)
    ax.set_xlabel(f"{latency.upper()} {quantile}, ms")
    ax.set_ylabel("output tokens/s")
    legend(ax)
    return fig


def estimate_vs_measured(points: list[tuple[str, float, float]]):
    """(label, estimated s, measured s) per run whose device the catalog knows."""
    if not points:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    for i, (label, est, meas) in enumerate(points):
        ax.scatter([meas * 1e3], [est * 1e3], color=COLORS[i % 20], label=label, s=22)
    top = max(max(e, m) for _, e, m in points) * 1e3 * 1.15
    ax.plot([0, top], [0, top], color="#999", lw=0.8, ls="--", label="estimate = measured")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step time, ms (median)")
    ax.set_ylabel("estimated step time, ms")
    legend(ax)
    return fig


FigureMaker = Callable[..., Any]


def save(fig, stem: Path) -> list[Path]:
    """FIG as STEM.png and STEM.svg."""
    out = []
    for suffix in (".png", ".svg"):
        path = stem.with_suffix(suffix)
        fig.savefig(path, dpi=110 if suffix == ".png" else None)
        out.append(path)
    return out


def svg_text(fig) -> str:
    import io

    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # the XML prolog and doctype have no place inside HTML


def close(fig) -> None:
    pyplot().close(fig)


def fmt_mib(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.0f}"
