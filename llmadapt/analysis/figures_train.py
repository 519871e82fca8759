"""The report's figures that answer "which configuration, and is the comparison fair": the headline (each
problem's rows sorted by their headline figure, with 95% intervals), loss curves per problem (one line where the
runs coincide), step time over steps (small multiples for many runs), and throughput against batch with Study B's
Eq. 2 fitted over runs that differ in batch alone. Drawn as analysis.figures draws the others.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from llmadapt.analysis.figures import COLORS, ReportRun, pyplot

LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "x", "P", "*"]
SMALL_MULTIPLES_FROM = 7
"""Step time over steps: this many runs or more get one panel each, fewer share one axis."""

# (estimate key, axis label, scale to the axis's unit) of a headline panel, per kind
HEADLINE_PANELS = {
    "train": [("step_p50_s", "step time p50, ms (lower is better)", 1e3),
              ("tokens_per_s", "tokens/s (higher is better)", 1.0)],
    "serve": [("ttft_p50_ms", "TTFT p50, ms (lower is better)", 1.0),
              ("output_throughput", "output tokens/s (higher is better)", 1.0)],
}


def titled(runs: list[ReportRun]) -> list[str]:
    """Each run's label, led by its problem ('P2 torch dp2') when the runs pose more than one problem."""
    several = len({r.problem for r in runs}) > 1
    return [f"{r.problem} {r.label}" if several and r.problem else r.label for r in runs]


def _value(row, key: str) -> tuple[float, float, float] | None:
    """(median, low, high) of a row's figure: its estimate's, or the plain value with no interval."""
    estimate = row.estimates.get(key)
    if estimate is not None:
        return estimate.median, estimate.low, estimate.high
    value = row.metrics.get(key)
    return (float(value),) * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _plain_log(axis) -> None:
    """Tick labels of a log axis as plain numbers ('20', '50'), not powers ('2x10^1')."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))


def _unlike(difference: str, room: int = 90) -> str:
    """' (unlike P1 in train.global_batch (4 vs 8))': Comparison.difference's fields, as many whole as fit."""
    head, _, fields = difference.lstrip(", ").partition(" in ")
    if not fields:
        return ""
    parts = fields.split(" and ")[0].split("; ")
    kept = []
    for part in parts:
        if len(f"{head} in {'; '.join(kept + [part])}") > room and kept:
            break
        kept.append(part)
    more = len(parts) - len(kept) + (int(fields.split(" and ")[1].split()[0]) if " and " in fields else 0)
    return f" ({head} in {'; '.join(kept)}" + (f" and {more} more" if more else "") + ")"


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def headline(rows: list[Any], problems: dict[str, str], differences: dict[str, str] | None = None):
    """Per problem (a row of two panels each): its rows that ran ok, sorted by the headline figure (step time p50
    for training, TTFT p50 for serving; fastest on top), as bars with the 95% interval as error bars, and the
    throughput beside it in the same order. Rows whose machine was disturbed are hatched and say so.
    ``differences``: per problem, how it differs from the first (Comparison.difference), for its title."""
    groups = []
    for problem, name in problems.items():
        mine = [r for r in rows if r.problem_hash == problem and r.status == "ok"]
        kind = "serve" if any("request_throughput" in r.metrics for r in mine) else "train"
        key = HEADLINE_PANELS[kind][0][0]
        mine = sorted((r for r in mine if _value(r, key)), key=lambda r: _value(r, key)[0])
        if mine:
            groups.append((name, kind, mine))
    if not groups:
        return None
    plt = pyplot()
    heights = [len(g[2]) * 0.34 + 0.7 for g in groups]
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, sum(heights) + 0.4), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, layout="constrained")
    for (name, kind, mine), pair in zip(groups, axes):
        labels = [r.label + (" (disturbed)" if r.disturbed else "") for r in mine]
        for ax, (key, axis, scale), color in zip(pair, HEADLINE_PANELS[kind], (COLORS[0], COLORS[2])):
            values = [_value(r, key) for r in mine]
            ys = list(range(len(mine)))
            medians = [v[0] * scale if v else 0.0 for v in values]
            bars = ax.barh(ys, medians, color=color, alpha=0.75, height=0.6)
            for bar, r in zip(bars, mine):
                if r.disturbed:  # hatched in the panel's colour on white: measured, but not to be trusted
                    bar.set(hatch="///", facecolor="white", edgecolor=color, alpha=1.0)
            err = [[(v[0] - v[1]) * scale if v else 0 for v in values],
                   [(v[2] - v[0]) * scale if v else 0 for v in values]]
            ax.errorbar(medians, ys, xerr=err, fmt="none", ecolor="#222", elinewidth=1, capsize=3)
            top = max((v[2] * scale for v in values if v), default=1.0)
            for y, v in zip(ys, values):
                if v:
                    ax.text(v[2] * scale + top * 0.01, y, _number(v[0] * scale), va="center", fontsize=7)
            ax.set_xlim(0, top * 1.18)
            ax.set_yticks(ys, labels if ax is pair[0] else [""] * len(ys))
            ax.invert_yaxis()
            ax.set_xlabel(axis)
            ax.grid(axis="y", visible=False)
        problem = next(h for h, n in problems.items() if n == name)
        pair[0].set_title(f"{name}: sorted by {HEADLINE_PANELS[kind][0][1].split(',')[0]}, 95% intervals"
                          + _unlike((differences or {}).get(problem, "")), fontsize=8, loc="left")
    return fig


def _agreement(losses: list[list[float]]) -> tuple[bool, float]:
    """Whether loss curves coincide (same length; at every step the spread across runs within the parity
    tolerance, atol + rtol x |loss|), and their largest spread at any step."""
    from llmadapt.analysis.paritycheck import PARITY_ATOL, PARITY_RTOL

    steps = min(len(x) for x in losses)
    spreads = [(max(col) - min(col), max(abs(v) for v in col)) for col in
               ([x[i] for x in losses] for i in range(steps))]
    widest = max((s for s, _ in spreads), default=0.0)
    same = len({len(x) for x in losses}) == 1 and all(s <= PARITY_ATOL + PARITY_RTOL * m for s, m in spreads)
    return same, widest


def loss_curves(runs: list[ReportRun]):
    """One axis per problem (runs of different problems never share one). Where a problem's runs coincide, one
    line says so ('10 runs agree within 4.8e-07'); otherwise a line each, in differing styles, so that curves
    drawn over one another still show."""
    train = [r for r in runs if not r.serving and r.summary.get("losses")]
    if not train:
        return None
    by_problem: dict[str, list[tuple[str, ReportRun]]] = {}
    for name, r in zip(titled(train), train):
        by_problem.setdefault(r.problem, []).append((r.label, r))
    plt = pyplot()
    cols = min(len(by_problem), 3)
    grid = math.ceil(len(by_problem) / cols)
    fig, axes = plt.subplots(grid, cols, figsize=(4.6 * cols + (1.8 if cols == 1 else 0.4), 3.1 * grid),
                             squeeze=False, layout="constrained")
    for ax, (problem, members) in zip(axes.flat, by_problem.items()):
        losses = [r.summary["losses"] for _, r in members]
        same, widest = _agreement(losses)
        if same:
            agree = f"agree within {widest:.2g}" if widest else "agree exactly"
            text = f"{len(members)} runs {agree}" if len(members) > 1 else f"1 run ({members[0][0]})"
            ax.plot(range(len(losses[0])), losses[0], marker="o", ms=2.5, lw=1.4, color=COLORS[0], label=text)
            ax.set_title(f"{problem}: {text}", fontsize=8, loc="left")
        else:
            for i, (label, r) in enumerate(members):
                ax.plot(range(len(losses[i])), losses[i], ls=LINESTYLES[i % 4], marker=MARKERS[i % 8], ms=3,
                        lw=1.2, color=COLORS[i % 20], label=label, alpha=0.85, markerfacecolor="none")
            ax.set_title(f"{problem}: {len(members)} runs differ by up to {widest:.2g}", fontsize=8, loc="left")
            ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (global batch)")
        _integer_steps(ax)
    for ax in axes.flat[len(by_problem):]:
        ax.set_visible(False)
    return fig


def step_times(runs: list[ReportRun]):
    """Step time over the measured steps (slowest rank; profiled steps circled). Up to six runs share one axis,
    with the legend outside it; more get a panel each on a shared y axis. A log axis where the times span more
    than a factor of eight."""
    train = [r for r in runs if not r.serving and r.steps()]
    if not train:
        return None
    series = []
    for name, r in zip(titled(train), train):
        steps = r.steps()
        xs = [s for s in steps if s >= r.workload.train.warmup_steps]
        if xs:
            series.append((name, xs, [steps[s] * 1e3 for s in xs], sorted(set(r.workload.profile.steps) & set(xs))))
    if not series:
        return None
    values = [v for _, _, ys, _ in series for v in ys if v > 0]
    log = bool(values) and max(values) / min(values) > 8
    plt = pyplot()
    if len(series) < SMALL_MULTIPLES_FROM:
        fig, ax = plt.subplots(figsize=(8, 3.4), layout="constrained")
        for i, (name, xs, ys, profiled) in enumerate(series):
            ax.plot(xs, ys, ls=LINESTYLES[i % 4], marker=MARKERS[i % 8], ms=3, lw=1.2, color=COLORS[i % 20],
                    label=name, markerfacecolor="none")
            if profiled:
                ax.scatter(profiled, [ys[xs.index(s)] for s in profiled], s=60, facecolors="none",
                           edgecolors=COLORS[i % 20], lw=1.5, label=f"{name}: profiled")
        ax.set_xlabel("step (after warm-up)")
        ax.set_ylabel("step time, ms (slowest rank)")
        _integer_steps(ax)
        if log:
            ax.set_yscale("log")
            _plain_log(ax.yaxis)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        return fig
    cols = 4 if len(series) <= 16 else 5
    grid = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(grid, cols, figsize=(2.45 * cols, 1.75 * grid + 0.5), sharex=True, sharey=True,
                             squeeze=False, layout="constrained")
    for i, (ax, (name, xs, ys, profiled)) in enumerate(zip(axes.flat, series)):
        ax.plot(xs, ys, marker="o", ms=2, lw=1, color=COLORS[0])
        if profiled:
            ax.scatter(profiled, [ys[xs.index(s)] for s in profiled], s=40, facecolors="none", edgecolors=COLORS[1])
        ax.set_title(name, fontsize=7)
        ax.tick_params(labelsize=7, which="both")
        _integer_steps(ax)
        if log:
            ax.set_yscale("log")
            _plain_log(ax.yaxis)
    for ax in axes.flat[len(series):]:
        ax.set_visible(False)
    fig.supxlabel("step (after warm-up)", fontsize=8)
    fig.supylabel("step time, ms (slowest rank)", fontsize=8)
    fig.suptitle(f"{len(series)} runs, one panel each, one y axis; red circles: profiled steps", fontsize=8)
    return fig


def _batch_group(r: ReportRun) -> str:
    """What runs that differ in batch alone share: the stack, the problem less its batch, the layout and memory
    techniques (the micro-batch, a batch field, left out)."""
    w = r.workload
    problem = w.problem_dict()
    problem["train"] = {k: v for k, v in problem["train"].items() if k != "global_batch"}
    layout = {"parallelism": {k: v for k, v in w.to_dict()["parallelism"].items() if k != "threads_per_rank"},
              "optimizations": w.to_dict()["optimizations"], "optimizer_impl": w.train.optimizer_impl}
    return json.dumps([r.summary["adapter"], problem, layout], sort_keys=True, default=str)


def _series_names(groups: dict[str, list[tuple[ReportRun, Any]]]) -> list[str]:
    """Each group's name: its stack and layout less the micro-batch, and whatever else sets it apart from the other
    groups but the batch it varies ('torch dp1 tiny-mixtral experts_per_token=2'; cells.distinct_labels)."""
    from llmadapt.analysis.labels import distinct_labels, run_label

    firsts = [members[0][0] for members in groups.values()]
    return distinct_labels([(re.sub(r" mb\d+", "", f"{run_label(r.summary, r.workload)} {r.workload.model.name}"),
                             r.workload) for r in firsts], ignore=("train.global_batch", "train.micro_batch"))


def throughput_vs_batch(runs: list[ReportRun]):
    """Samples/s against global batch, per group of runs that differ in batch size alone (one stack, one problem
    but for its batch, one layout), with Study B's Eq. 2 fitted over each group of three batch sizes or more.
    None when no group has three."""
    from llmadapt.analysis.perf.studyb import MOE_ATTENUATION, fit_throughput, sparsity_of, throughput
    from llmadapt.errors import LlmadaptError

    groups: dict[str, list[tuple[ReportRun, tuple[float, float, float]]]] = {}
    for r in runs:
        if r.serving or r.summary.get("status") != "ok" or not r.summary.get("samples_per_s"):
            continue
        point = (float(r.workload.train.global_batch), sparsity_of(r.workload.model),
                 float(r.summary["samples_per_s"]["mean"]))
        groups.setdefault(_batch_group(r), []).append((r, point))
    groups = {k: v for k, v in groups.items() if len({p[0] for _, p in v}) >= 3}
    if not groups:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
    for i, (members, name) in enumerate(zip(groups.values(), _series_names(groups))):
        color, points = COLORS[i % 10], [p for _, p in members]
        ax.scatter([b for b, _, _ in points], [q for _, _, q in points], color=color, s=18, marker=MARKERS[i % 8],
                   label=f"{name} ({len(points)} runs)")
        try:
            fit = fit_throughput(points, MOE_ATTENUATION["mixtral"], source="report")
        except LlmadaptError:
            continue
        lo, hi = min(b for b, _, _ in points), max(b for b, _, _ in points)
        xs = [lo * (hi / lo) ** (k / 40) for k in range(41)]
        s = points[0][1]
        ax.plot(xs, [throughput(x, s, fit.coefficients["C4"], fit.coefficients["C2"], fit.fixed["C3"]) for x in xs],
                color=color, lw=1, ls=LINESTYLES[i % 4], label=f"Eq. 2 fit (MAPE {fit.mape:.1%})")
    ax.set_xscale("log", base=2)
    batches = sorted({p[0] for members in groups.values() for _, p in members})
    ax.set_xticks(batches, [f"{b:g}" for b in batches])
    ax.minorticks_off()
    ax.set_xlabel("global batch (samples)")
    ax.set_ylabel("samples/s")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              title="runs that differ in batch alone", title_fontsize=7)
    return fig


def scaling_efficiency(points: list[Any]):
    """Scaling efficiency against the devices, a line per stack and technique (``verdict.ScalingPoint``s of one
    problem and kind of scaling); 100% is linear. A point measured on a disturbed machine is hollow. None without
    points."""
    if not points:
        return None
    series: dict[tuple[str, str, str], list[Any]] = {}
    for p in points:
        series.setdefault((p.problem, p.stack, p.scaling), []).append(p)
    several = len({p.problem for p in points}) > 1
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.4), layout="constrained")
    for i, ((problem, stack, kind), members) in enumerate(series.items()):
        members = sorted(members, key=lambda p: p.devices)
        color = COLORS[i % 10]
        name = f"{problem} {stack}, {kind}" if several else f"{stack}, {kind}"
        ax.plot([p.devices for p in members], [p.efficiency * 100 for p in members], color=color,
                ls=LINESTYLES[i % 4], lw=1.2, label=name)
        for p in members:
            ax.scatter([p.devices], [p.efficiency * 100], s=26, marker=MARKERS[i % 8], zorder=3, color=color,
                       facecolors="none" if p.disturbed else color)
    if any(p.disturbed for p in points):
        ax.scatter([], [], s=26, color="#777", facecolors="none", label="hollow: measured on a disturbed machine")
    ax.axhline(100, color="#999", lw=0.8, ls="--", label="linear (100%)")
    devices = sorted({p.devices for p in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(devices, [str(d) for d in devices])
    ax.minorticks_off()
    ax.set_xlabel("devices (ranks)")
    ax.set_ylabel("scaling efficiency, %")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig
