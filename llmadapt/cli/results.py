"""Commands that read what runs left: show, export, runs (the run store, and imports into it), regress, report,
trace, hta. Each command's options are registered beside its handler (``register_<command>``, found by cli/main.py's
table of commands), as in every group of cli/."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from llmadapt.cli.common import Once, add_command, emit, printable, printable_lines
from llmadapt.errors import LlmadaptError


def cmd_show(args) -> int:
    from llmadapt.analysis.report import render_summary, show

    summary = show(args.run)
    emit(args, summary, render_summary(summary))
    return 0


def cmd_export(args) -> int:
    from llmadapt.analysis.report import export

    text = export(args.run, args.format)
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text)
        except OSError as exc:
            raise LlmadaptError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def cmd_hta(args) -> int:
    from llmadapt.experiments.hta import hta_analysis, render

    result = hta_analysis(args.run, args.step)
    emit(args, result, render(result))
    return 0


def cmd_trace(args) -> int:
    import attrs

    from llmadapt.analysis.traces import analyse_traces, render

    result = analyse_traces(args.paths, include_last_step=args.include_last_step)
    emit(args, attrs.asdict(result), render(result))
    return 0


def cmd_runs(args) -> int:
    """`llmadapt runs [QUERY...]` lists; `llmadapt runs import FOLDER...` imports."""
    from llmadapt.analysis.store import RunStore

    def warn(message: str) -> None:
        print(f"warning: {printable_lines(message)}", file=sys.stderr)

    terms = list(args.terms or [])
    if getattr(args, "workload", None) and not (terms and terms[0] == "import" and any(
            not Path(p).is_dir() for p in terms[1:])):
        raise LlmadaptError("--workload names the stream of other tools' result files: llmadapt runs import FILE... "
                            "--workload PATH")
    if terms and terms[0] == "import":
        return _import_runs(args, terms[1:], warn)
    from llmadapt.analysis.store import Query

    query = Query.parse(terms)
    limit, page = _page_of(args)
    with RunStore(args.root, warn=warn, rescan=args.rescan) as store:
        total = store.count(query)
        if limit is None:
            found = store.runs(query)
        else:  # the newest page, listed oldest first as the whole list is
            found = store.runs(query, limit=limit, offset=(page - 1) * limit, newest_first=True)[::-1]
            if not found and total:
                raise LlmadaptError(f"--page {page}: the {total} run(s) matching {query} fill "
                                    f"{-(-total // limit)} page(s) of {limit}")
        if args.parquet:
            store.to_parquet(args.parquet, query, frame=args.frame)
            print(f"wrote {args.parquet} ({args.frame} of {total} runs)", file=sys.stderr)
    for r in found:
        if r.status == "damaged":
            why = (r.summary.get("warnings") or ["summary.json cannot be read"])[0].partition(";")[0]
            warn(f"run {printable(r.run_id)} in {printable(r.folder)} is damaged: {printable(why)} (its figures "
                 "are from its records)")
    rows = [{**r.row, "metrics": r.metrics} for r in found]
    emit(args, rows, _runs_table(found) + "\n" + _page_line(len(found), total, limit, page, query))
    return 0


def _import_runs(args, paths: list[str], warn) -> int:
    """`llmadapt runs import PATH...`: run folders, and other tools' result files as serving runs."""
    from llmadapt.analysis.store import RunStore
    from llmadapt.contract.rundir import RunDir

    if not paths:
        raise LlmadaptError("llmadapt runs import PATH...: name the run folders or result files to import")
    folders = [p for p in paths if Path(p).is_dir()]
    files = [p for p in paths if not Path(p).is_dir()]
    for path in files:
        if not Path(path).exists():
            raise LlmadaptError(f"{path}: no such file or folder: nothing imported")
    if files and getattr(args, "workload", None):
        from llmadapt.contract.foreign import stream_workload

        stream = stream_workload(args.workload)
    else:
        stream = None
    new = not Path(args.root).exists()
    log = lambda m: print(printable(m), file=sys.stderr)  # noqa: E731
    try:  # a store root that does not exist yet is made; refused imports leave none behind
        if files:  # every file read before the store is touched
            from llmadapt.contract.foreign import read_result
            from llmadapt.experiments.imports import import_files

            for path in files:
                read_result(path)
        with RunStore(args.root, warn=warn, create=True) as store:
            if files:  # converted first, then imported with the folders in one go (all checked, then copied)
                added = import_files(store, files, workload=stream, folders=folders, log=log,
                                     tool_version=getattr(args, "tool_version", None))
            else:
                added = store.import_runs(folders, log=log)
    except LlmadaptError:
        if new and Path(args.root).is_dir() and not any(RunDir(p).launch_file.is_file()
                                                        for p in Path(args.root).iterdir()):
            shutil.rmtree(args.root, ignore_errors=True)
        raise
    emit(args, {"imported": added}, f"{len(added)} run(s) imported into {args.root}")
    return 0


PAGE = 50
"""Runs `llmadapt runs` lists by default: the newest (a team's store holds thousands)."""


def _page_of(args) -> tuple[int | None, int]:
    """(runs per page, page number) from --limit, --page and --all; (None, 1): every matching run, which is also
    what --json gives unless a page is asked for (a script reading it expects them all)."""
    for flag, value in (("--limit", args.limit), ("--page", args.page)):
        if value is not None and value < 1:
            raise LlmadaptError(f"{flag} {value}: give a number of at least 1")
    if args.all:
        if args.limit is not None or args.page is not None:
            raise LlmadaptError("--all lists every matching run: not with --limit or --page")
        return None, 1
    if args.limit is None and args.page is None and getattr(args, "json", False):
        return None, 1
    return args.limit or PAGE, args.page or 1


def _page_line(shown: int, total: int, limit: int | None, page: int, query) -> str:
    """How many runs match, and when the listing is a page of them, which page and how to see the others."""
    if shown == total:
        return f"{total} run(s) matching {query}"
    first = (page - 1) * (limit or 0)
    older = total - first - shown
    where = f"the newest {shown}" if first == 0 else f"runs {first + 1}-{first + shown} (newest first)"
    more = f"; {older} older: --page {page + 1} (or --limit N, --all)" if older > 0 else ", the oldest"
    return f"{where} of {total} run(s) matching {query}{more}"


def _runs_table(found) -> str:
    from llmadapt.texttable import text_table

    def f(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    from llmadapt.analysis.labels import distinct_labels, labelled_by

    head = ["run", "made", "status", "layout", "workload", "machine", "step p50 s", "tokens/s", "TTFT p50 ms",
            "last loss"]
    labels = distinct_labels([(r.layout, labelled_by(r.summary, r.workload)) for r in found])  # what sets each apart
    body = [[printable(cell) for cell in (  # names from workload files and other machines, escaped
        r.run_id, r.created[:16].replace("T", " "), r.status, label,
        f"{r.row.get('name') or ''} {r.workload_hash[:8]}", r.machine, f(r.metrics.get("step_p50_s"), ".4f"),
        f(r.metrics.get("tokens_per_s"), ",.0f"), f(r.metrics.get("ttft_p50_ms"), ".1f"),
        f(r.metrics.get("last_loss"), ".4f"))] for r, label in zip(found, labels)]
    return "\n".join(text_table(head, body))


def cmd_regress(args) -> int:
    from llmadapt.analysis.regress import regress

    report = regress(args.baseline, args.candidate, root=args.root, threshold=args.threshold / 100,
                     alpha=args.alpha, metrics=args.metric)
    emit(args, report.to_dict(), report.table())
    return 0 if report.ok else 1


def cmd_report(args) -> int:
    from llmadapt.analysis.htmlreport import report

    path = report(args.runs or [], args.output, query=args.query, root=args.root, figures_dir=args.figures,
                  title=args.title, log=lambda m: print(m, file=sys.stderr))
    emit(args, {"report": str(path), "figures": args.figures}, f"report: {path}")
    return 0


# -- registration: each command's options, in the order its --help lists them ----------------------------------
def register_show(sub) -> None:
    p = add_command(sub, "show", cmd_show, "show a run's summary")
    p.add_argument("run", help="run directory")


def register_export(sub) -> None:
    p = add_command(sub, "export", cmd_export, "export a run as JSON, CSV, a Chrome trace (Perfetto) or vLLM-bench "
                    "keys")
    p.add_argument("run", help="run directory")
    p.add_argument("--format", required=True, choices=["json", "csv", "breakdown-csv", "evaluation-csv", "chrome-trace",
                                                         "vllm-bench"],
                   action=Once, help="csv: steps (requests for serving); breakdown-csv: the profiled steps' classes, "
                   "layers, collectives; evaluation-csv: the held-out figures per evaluation (and expert loads); "
                   "vllm-bench: a serving run's summary under `vllm bench serve`'s result keys")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")


def register_runs(sub) -> None:
    p = add_command(sub, "runs", cmd_runs, "list the runs in a folder (its run store), filtered by key=value terms; "
                    "`llmadapt runs import PATH...` adds run folders made elsewhere, and the result files of vllm bench "
                    "serve, AIPerf and guidellm as serving runs")
    p.add_argument("terms", nargs="*", metavar="QUERY",
                   help="adapter=torch status=ok since=2026-12-01 machine=NODE workload=HASH|NAME "
                        "optimizations.zero_stage=3 ...; or: import PATH... (run folders, other tools' result files)")
    p.add_argument("--root", default="runs", help="the folder of runs (default: ./runs)")
    p.add_argument("--parquet", metavar="FILE", help="also write the matching runs to a Parquet file")
    p.add_argument("--frame", choices=("runs", "steps", "requests", "breakdown", "telemetry"), default="runs",
                   help="what --parquet writes: a row per run (default), or the runs' steps, requests, breakdown "
                        "classes or telemetry samples (llmadapt.analysis.frames)")
    p.add_argument("--limit", type=int, metavar="N", help="list the newest N matching runs (default 50; --json: all)")
    p.add_argument("--page", type=int, metavar="P", help="the P-th page of --limit runs, newest first (default 1)")
    p.add_argument("--all", action="store_true", help="list every matching run")
    p.add_argument("--rescan", action="store_true", help="read every run folder again: see changes to finished runs")
    p.add_argument("--workload", metavar="PATH", help="import of result files: the workload (file or run folder) whose "
                   "stream the tool sent, checked against the file; without it the problem is as the file states")
    p.add_argument("--tool-version", metavar="V", help="import of result files: the tool's version, where they lack it")


def register_regress(sub) -> None:
    p = add_command(sub, "regress", cmd_regress, "did the candidate runs get worse than the baseline runs? Stored "
                    "runs, matched cell by cell, tested metric by metric; exit 1 on a regression")
    p.add_argument("baseline", help="store query of the baseline runs, e.g. 'adapter=deepspeed until=2026-12-01'")
    p.add_argument("candidate", help="store query of the candidate runs")
    p.add_argument("--root", default="runs", help="the folder of runs (default: ./runs)")
    p.add_argument("--threshold", type=float, default=5.0, metavar="PERCENT",
                   help="a change worse than this (and beyond noise) is a regression (default: 5)")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the t-test (default: 0.05)")
    p.add_argument("--metric", action="append", help="only this metric (repeat); default: every shared one")


def register_report(sub) -> None:
    p = add_command(sub, "report", cmd_report, "a self-contained HTML report of runs: the comparison table and every "
                    "figure their records hold (one file, no network needed)")
    p.add_argument("runs", nargs="*", metavar="RUN", help="run folders, or folders of runs")
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default: report.html)")
    p.add_argument("--runs", dest="query", metavar="QUERY", help="also the stored runs in --root matching QUERY")
    p.add_argument("--root", default="runs", help="the folder of runs for --runs (default: ./runs)")
    p.add_argument("--figures", metavar="DIR", help="also write each figure as PNG and SVG into DIR")
    p.add_argument("--title", default="llmadapt report")


def register_trace(sub) -> None:
    p = add_command(sub, "trace", cmd_trace, "the kernel-basis breakdown of torch.profiler (Kineto) traces of any GPU "
                    "job: per rank operator classes, collectives, overlap, idle, annotations; stragglers across ranks")
    p.add_argument("paths", nargs="+", metavar="TRACE", help="trace files (.json, .json.gz), or folders of them")
    p.add_argument("--include-last-step", action="store_true",
                   help="also what was launched in the trace's last ProfilerStep (left out by default, as HTA does: "
                        "the profiler may stop inside it)")


def register_hta(sub) -> None:
    p = add_command(sub, "hta", cmd_hta, "Holistic Trace Analysis on a run's profiler traces (profile.level = full; "
                    "its own environment: llmadapt env create hta)")
    p.add_argument("run", help="run directory")
    p.add_argument("--step", type=int, help="profiled step (default: the first traced)")
