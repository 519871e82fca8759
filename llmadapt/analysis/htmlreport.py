"""A self-contained HTML report of runs: one file, every style, script and figure inline, nothing fetched when it
opens. The comparison tables (sortable, medians with their intervals, each row's headline against its problem's
first, the verdict per problem; laid out to fit a 1400 px window), then each figure the runs hold data for
(analysis.figures, analysis.figures_train): the headline (rows sorted by step time or TTFT, with intervals and the
verdict), loss curves per problem, step time over steps, peak memory, the module and operator breakdowns (absolute
and 100%), expert load per layer, serving latency CDFs and latency against load, throughput against batch with
Study B's fit over runs that differ in batch alone, the estimate against the measurement. ``--figures DIR`` writes
the same figures as PNG and SVG.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from llmadapt.analysis import figures as F
from llmadapt.analysis import figures_train as T
from llmadapt.analysis.comparison import Comparison, row_of_runs, versus
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError, StorageError
from llmadapt.host import VERSION, utc_now
from llmadapt.spec import Workload

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1300px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 2em; }
.meta { color: #666; font-size: 0.9em; }
.wide { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; font-size: 12px; margin: 1em 0; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 5px; text-align: right; white-space: nowrap; }
th { white-space: normal; vertical-align: bottom; min-width: 3.5em; max-width: 7em; }
td:nth-child(2) { white-space: normal; min-width: 9em; max-width: 16em; }
th:nth-child(-n+3), td:nth-child(-n+3) { text-align: left; }
td .ci { display: block; color: #777; font-size: 0.88em; }
th { cursor: pointer; background: #f4f4f4; user-select: none; } th.sorted-asc::after { content: " \\25B2"; }
th.sorted-desc::after { content: " \\25BC"; }
figure.chart { margin: 1em 0 2em; } figure.chart svg { max-width: 100%; height: auto; }
figcaption { color: #555; font-size: 0.9em; } figcaption b { color: #222; }
ul.verdict { margin: 0.3em 0 0.6em; padding-left: 1.3em; font-size: 0.92em; } ul.verdict li { margin: 0.15em 0; }
.note { color: #555; font-size: 0.85em; overflow-wrap: anywhere; }
"""

# Sort a table by the clicked column: numbers by their data-value, the rest as text.
_SCRIPT = """
document.querySelectorAll("table.sortable th").forEach(function (th, column) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0];
    var ascending = !th.classList.contains("sorted-asc");
    table.querySelectorAll("th").forEach(function (h) { h.classList.remove("sorted-asc", "sorted-desc"); });
    th.classList.add(ascending ? "sorted-asc" : "sorted-desc");
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = a.cells[column].dataset.value, y = b.cells[column].dataset.value;
      var nx = parseFloat(x), ny = parseFloat(y), c;
      if (!isNaN(nx) && !isNaN(ny)) { c = nx - ny; } else { c = String(x).localeCompare(String(y)); }
      return ascending ? c : -c;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  });
});
"""


def collect(sources: Iterable[str | Path], *, query: str | None = None, root: str | Path = "runs") -> list[Path]:
    """The run folders named (a run folder, or a folder of runs: every run in it), or matching QUERY in ROOT."""
    folders: list[Path] = []
    for source in map(Path, sources):
        if RunDir(source).launch_file.is_file():
            folders.append(source)
        elif source.is_dir() and any(RunDir(p).launch_file.is_file() for p in source.iterdir() if p.is_dir()):
            folders += sorted(p for p in source.iterdir() if p.is_dir() and RunDir(p).launch_file.is_file())
        else:
            raise LlmadaptError(f"{source} is not a run folder nor a folder of runs")
    if query is not None:
        from llmadapt.analysis.store import RunStore

        with RunStore(root) as store:
            folders += [r.folder for r in store.runs(query)]
    unique = list(dict.fromkeys(f.resolve() for f in folders))
    if not unique:
        raise LlmadaptError("no runs to report on: name run folders, or --runs QUERY")
    return unique


def _load(folder: Path) -> tuple[dict[str, Any], Workload, list[dict[str, Any]]]:
    from llmadapt.analysis.report import read_summary
    from llmadapt.contract.readback import load_records

    try:
        summary = read_summary(folder)
        workload = RunDir(folder).read_launch().require_workload()
        records = load_records(folder)
    except LlmadaptError as exc:
        raise LlmadaptError(f"{folder}: damaged run folder ({exc})") from None
    except (OSError, ValueError, KeyError) as exc:
        raise LlmadaptError(f"{folder}: damaged run folder ({type(exc).__name__}: {str(exc)[:160]})") from None
    return summary, workload, records


def build(folders: list[Path], *, title: str = "llmadapt report", keep_figures: bool = False,
          log: Callable[[str], None] | None = None, baseline: str | None = None
          ) -> tuple[str, dict[str, Any], Comparison]:
    """The report: (HTML text, the figures by name as (title, figure), the comparison its tables show). The
    figures are closed once drawn into the page unless ``keep_figures`` (then close them with figures.close).
    ``baseline``: the row (a label) each problem's others are set against; default each problem's first."""
    from llmadapt.analysis.labels import distinct_labels, labelled_by, run_label

    loaded = [(folder, *_load(folder)) for folder in folders]
    cells: dict[tuple[str, str, str], list[tuple[Path, dict, Workload, list]]] = {}
    for folder, summary, workload, records in loaded:
        key = (summary["problem_hash"], run_label(summary, workload), summary["workload_hash"])
        cells.setdefault(key, []).append((folder, summary, workload, records))
    problems = list(dict.fromkeys(k[0] for k in cells))
    rows, runs, baselines = [], [], {}
    keys = sorted(cells, key=lambda k: problems.index(k[0]))
    labels = distinct_labels([(k[1], labelled_by(cells[k][0][1], cells[k][0][2])) for k in keys])
    for key, row_title in zip(keys, labels):
        group = cells[key]
        rows.append(row_of_runs(row_title, group[0][1]["adapter"], group[0][2].name, key[1],
                                [(str(f), s) for f, s, _, _ in group], baselines, layout=key[1]))
        for n, (folder, summary, workload, records) in enumerate(group):
            label = row_title + (f" #{n + 1}" if len(group) > 1 else "")
            runs.append(F.ReportRun(label, folder, workload, summary, records,
                                    problem=f"P{problems.index(key[0]) + 1}"))
    comparison = Comparison(rows=rows, workloads={k[0]: cells[k][0][2] for k in cells}, baseline=baseline)
    figs = _figures(runs, comparison, log)
    text = _html(title, comparison, runs, figs)
    if not keep_figures:
        for _, fig in figs.values():
            F.close(fig)
    return text, figs, comparison


def _figures(runs: list[F.ReportRun], comparison: Comparison, log) -> dict[str, Any]:
    from llmadapt.adapter.breakdown import MODULE_CLASSES, OPERATOR_CLASSES
    from llmadapt.analysis.report import read_summary

    problems = _problem_names(comparison)
    several = len(problems) > 1

    def name(r) -> str:  # a row's label, led by its problem where the report has several
        return f"{problems[r.problem_hash]} {r.label}" if several else r.label

    rows = comparison.rows
    breakdowns = []
    for r in rows:
        b = read_summary(r.run_dir).get("breakdown") if r.run_dir else None
        if b and b.get("profiled_steps"):
            breakdowns.append((name(r), b))
    made = {
        "headline": ("Which configuration: each problem's rows sorted by their headline figure, medians with 95% "
                     "intervals", T.headline(rows, problems, {h: comparison.difference(h) for h in problems})),
        "loss": ("Loss per step, one panel per problem", T.loss_curves(runs)),
        "step_time": ("Step time over steps", T.step_times(runs)),
        "memory": ("Peak memory per configuration",
                   F.memory([(name(r), r.metrics["peak_memory_mib"]) for r in rows
                             if r.metrics.get("peak_memory_mib")])),
        "breakdown_modules": ("Where the step's time goes, by module class: absolute and 100%",
                              F.breakdown_bars(breakdowns, "modules", MODULE_CLASSES)),
        "breakdown_operators": ("Where the step's time goes, by operator class: absolute and 100%",
                                F.breakdown_bars(breakdowns, "operators", OPERATOR_CLASSES)),
        "breakdown_module_operators": ("Which operators each module class spends its time on",
                                       F.module_operator_bars(breakdowns, MODULE_CLASSES, OPERATOR_CLASSES)),
        "expert_load": ("Expert load per layer (MoE)", F.expert_heatmaps(runs)),
        "evaluation": ("Held-out loss and accuracy against the steps trained", F.evaluation_curves(runs)),
        "eval_expert_load": ("Expert load on the held-out examples, before and after training (MoE)",
                             F.eval_expert_heatmaps(runs)),
        "latency_cdf": ("Serving latency distributions", F.latency_cdfs(runs)),
        "latency_vs_load": ("Serving latency against load", F.latency_vs_load(runs)),
        "throughput_vs_latency": ("Serving throughput against E2EL p99, every valid run a point: the frontier joins "
                                  "the configurations no other beats on both", F.throughput_vs_latency(runs)),
        "throughput_vs_batch": ("Throughput against batch size, with Study B's Eq. 2 fitted over runs that differ "
                                "in batch alone", T.throughput_vs_batch(runs)),
        "estimate_vs_measured": ("Estimated against measured step time", F.estimate_vs_measured(_estimates(runs))),
        "scaling": ("Scaling efficiency against the devices, per stack and technique (strong: one problem on more "
                    "devices; weak: the global batch grown with them)", T.scaling_efficiency(comparison.scaling())),
    }
    out = {name: (title, fig) for name, (title, fig) in made.items() if fig is not None}
    if log:
        log(f"figures: {', '.join(out) or 'none'}")
    return out


def _problem_names(comparison: Comparison) -> dict[str, str]:
    return {h: f"P{i}" for i, h in enumerate(comparison.problems(), 1)}


def _verdicts(comparison: Comparison, problems: dict[str, str]) -> list[str]:
    """The lines of Comparison.verdicts: the fastest row of each problem, the rows within noise of it, the rest."""
    return [v.text() for v in comparison.verdicts()]


def _answers(comparison: Comparison) -> str:
    """The comparison's answers as data in the page (as ``compare --json`` has them): verdicts, scaling, the
    topology of each row's runs."""
    data = comparison.to_dict()
    return html.escape(json.dumps({"verdicts": data["verdicts"], "scaling": data["scaling"],
                                   "topology": {r["label"]: r.get("topology") for r in data["rows"]}}, default=str))


def _estimates(runs: list[F.ReportRun]) -> list[tuple[str, float, float]]:
    """(label, estimate, measured median) for the training runs whose device the catalog knows."""
    from llmadapt.analysis.perf.estimate import estimate
    from llmadapt.contract.catalog import device_for_reported

    out = []
    for r in runs:
        device = (r.summary.get("device") or {}).get("name")
        step = (r.summary.get("step_time_s") or {}).get("p50")
        if r.serving or not device or not step:
            continue
        spec = device_for_reported(device)
        if spec is None:
            continue
        try:
            out.append((r.label, estimate(r.workload, spec).step_time_s, step))
        except LlmadaptError:
            continue
    return out


def _cell(text: str, value: Any = None) -> str:
    data = text if value is None else value
    return f'<td data-value="{html.escape(str(data))}">{html.escape(text)}</td>'


def _estimate_cell(estimate) -> str:
    """The median, its interval on a line of its own below (narrower columns than '0.0141 (0.0137-0.0152)')."""
    median, _, interval = estimate.text().partition(" (")
    below = f'<span class="ci">{html.escape(interval.rstrip(")"))}</span>' if interval else ""
    return f'<td data-value="{estimate.median!r}">{html.escape(median)}{below}</td>'


def _table(table_id: str, rows, columns, comparison: Comparison, headline: str) -> str:
    from llmadapt.analysis.comparison import format_value

    problems = _problem_names(comparison)
    against = "vs baseline" if comparison.baseline else "vs first"
    titles = ["problem", "run", "status", columns[0][1], against, *[c for _, c, _ in columns[1:]], "runs"]
    head = "".join(f"<th>{html.escape(t)}</th>" for t in titles)
    body = []
    for r in rows:
        cells = [_cell(problems[r.problem_hash]), _cell(r.label + (" (disturbed)" if r.disturbed else "")),
                 _cell(r.status)]
        for n, (key, _, fmt) in enumerate(columns):
            estimate = r.estimates.get(key)
            value = r.metrics.get(key)
            text = format_value(value, fmt)
            cells.append(_estimate_cell(estimate) if estimate else
                         _cell(text, value if isinstance(value, (int, float)) else text))
            if n == 0:
                reference = comparison.reference(r.problem_hash) if r.status == "ok" else None
                change = versus(r, reference, headline)
                number = change.rstrip("%?").replace("+", "")
                cells.append(_cell(change, number if number.lstrip("-").isdigit() else change))
        cells.append(_cell(str(len(r.run_dirs) or 1), len(r.run_dirs) or 1))
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<div class="wide"><table class="sortable" id="{table_id}"><thead><tr>{head}</tr></thead><tbody>\n'
            + "\n".join(body) + "\n</tbody></table></div>")


def _columns(rows, base) -> list:
    from llmadapt.analysis.comparison import EVAL_COLUMNS, EXPERT_COLUMNS, QUALITY_COLUMNS, UTILISATION_COLUMNS

    extra = EXPERT_COLUMNS if any("expert_cv" in r.metrics for r in rows) else []
    extra = extra + [c for c in EVAL_COLUMNS + UTILISATION_COLUMNS + QUALITY_COLUMNS if any(r.metrics.get(c[0]) is not None
                                                                         for r in rows)]
    return base + extra


def _html(title: str, comparison: Comparison, runs: list[F.ReportRun], figs: dict[str, Any]) -> str:
    from llmadapt.analysis.comparison import HEADLINE, SERVE_COLUMNS, TRAIN_COLUMNS

    problems = _problem_names(comparison)
    serving = [r for r in comparison.rows if "request_throughput" in r.metrics]
    training = [r for r in comparison.rows if r not in serving]
    tables = []
    if training:
        tables.append("<h2>Training</h2>" + _table("comparison", training, _columns(training, TRAIN_COLUMNS),
                                                   comparison, HEADLINE["train"]))
    if serving:
        tables.append("<h2>Serving</h2>" + _table("comparison-serve", serving, _columns(serving, SERVE_COLUMNS),
                                                  comparison, HEADLINE["serve"]))
    verdicts = _verdicts(comparison, problems)
    verdict_list = ('<ul class="verdict" id="verdict">' + "".join(f"<li>{html.escape(v)}</li>" for v in verdicts)
                    + "</ul>") if verdicts else ""
    notes = [f"{problems[h]}: problem {h[:12]}{comparison.difference(h)}" for h in problems]
    notes += [f"{problems[r.problem_hash]} {r.label}: {r.note}" for r in comparison.rows if r.note]
    scaling = comparison.scaling_lines(problems)
    if scaling:  # the scaling table as the terminal shows it
        tables.append('<pre class="scaling" id="scaling-table">' + html.escape("\n".join(scaling).strip()) + "</pre>")
    if any(r.estimates for r in comparison.rows):
        against = "the baseline row" if comparison.baseline else "the first row of its problem that ran ok"
        notes.append("Medians with 95% percentile-bootstrap intervals (2000 resamples; the interval under each "
                     "median) over a row's runs, or over the measured steps of its one run. "
                     f"{'vs baseline' if comparison.baseline else 'vs first'}: the headline (step p50; TTFT p50 for "
                     f"serving) against {against}; '≈' where the intervals overlap (within noise), '?' where "
                     "either side has a single sample, 'disturbed' where either ran on a disturbed machine.")
    sections = []
    for name, (fig_title, fig) in figs.items():
        caption = f"<b>{html.escape(fig_title)}</b>" + (verdict_list if name == "headline" else "")
        sections.append(f'<figure class="chart" id="{name}"><figcaption>{caption}</figcaption>'
                        f"{F.svg_text(fig)}</figure>")
    machines = sorted({(r.summary.get("device") or {}).get("name") or "-" for r in runs})
    cpu_only = all((r.summary.get("device") or {}).get("kind", "cpu") == "cpu" for r in runs)
    meta = (f"{len(runs)} run(s) on {', '.join(machines)}; made {utc_now()[:19]} UTC by llmadapt {VERSION}"
            + ("; every figure here came from a CPU" if cpu_only else ""))
    runs_json = html.escape(json.dumps([{"label": r.label, "run_id": r.summary["run_id"], "folder": str(r.folder)}
                                        for r in runs]))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="meta">{html.escape(meta)}</p>
{chr(10).join(tables)}
{verdict_list.replace('id="verdict"', 'id="verdict-tables"')}
{''.join(f'<p class="note">{html.escape(n)}</p>' for n in notes)}
{chr(10).join(sections)}
<script type="application/json" id="runs">{runs_json}</script>
<script type="application/json" id="answers">{_answers(comparison)}</script>
<script>{_SCRIPT}</script>
</body></html>
"""


def report(sources: Iterable[str | Path], output: str | Path, *, query: str | None = None, root: str | Path = "runs",
           figures_dir: str | Path | None = None, title: str = "llmadapt report",
           log: Callable[[str], None] | None = None, baseline: str | None = None) -> Path:
    """Write the HTML report of the runs to OUTPUT (and, with ``figures_dir``, each figure as PNG and SVG). Where
    they cannot be written is found before anything is drawn: one line naming the path."""
    check_output(output, figures_dir)
    folders = collect(sources, query=query, root=root)
    text, figs, _ = build(folders, title=title, keep_figures=figures_dir is not None, log=log,
                          baseline=baseline)
    output = Path(output)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
        if figures_dir is not None:
            Path(figures_dir).mkdir(parents=True, exist_ok=True)
            for name, (_, fig) in figs.items():
                F.save(fig, Path(figures_dir) / name)
    except OSError as exc:
        raise LlmadaptError(f"cannot write the report {exc.filename or output}: {exc.strerror or exc}") from None
    finally:
        if figures_dir is not None:
            for _, fig in figs.values():
                F.close(fig)
    return output


def check_output(output: str | Path, figures_dir: str | Path | None = None) -> None:
    """Refuse, before minutes of drawing, a report that cannot be written, in one line naming the path: a folder
    given as the file, a path under a file, a folder this user may not write in. (Missing folders are made.)"""
    output = Path(output)
    if output.is_dir():
        raise LlmadaptError(f"report -o {output}: is a folder, expected a file (name the HTML file to write, e.g. "
                            f"{output / 'report.html'})")
    _writable_folder(output.parent, f"report -o {output}")
    if output.exists() and not os.access(output, os.W_OK):
        raise StorageError(f"report -o {output}: not writable (permission denied)")
    if figures_dir is not None:
        figures = Path(figures_dir)
        if figures.exists() and not figures.is_dir():
            raise LlmadaptError(f"--figures {figures}: is a file, expected a folder")
        _writable_folder(figures, f"--figures {figures}")


def _writable_folder(folder: Path, what: str) -> None:
    """The folder, or the nearest of its parents that exists (the rest is made), is a folder this user may
    write in."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise LlmadaptError(f"{what}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StorageError(f"{what}: cannot write in {existing} (permission denied)")
