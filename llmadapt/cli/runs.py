"""Commands that make or read runs: run, compare, parity, show, export, hta, trace."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import attrs

from llmadapt.cli.common import (cells_progress, emit, name_list, printable, printable_lines, run_options,
                                 workload_of)
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError


def cmd_run(args) -> int:
    import attrs

    from llmadapt.analysis.report import render_summary
    from llmadapt.launch.run import run

    workload = workload_of(args)
    adapter = args.adapter or ("hf" if workload.kind == "serve" else "torch")  # each kind's documented default
    result = run(workload, adapter, **run_options(args), **_node_options(args))
    summary = attrs.asdict(result.summary)
    launch = RunDir(result.run_dir).read_launch()
    nodes = launch.nodes.seen if launch.nodes else None
    where = "".join(f"\nnode {n['node_rank']:<6} {n['node']}, ranks {', '.join(map(str, n['ranks']))}"
                    for n in nodes or [])
    saved = launch.workload.save.path if launch.workload else None
    if saved and result.ok:
        where += f"\nsaved      {saved} (a Hugging Face model folder: serve it with --set model.path={saved})"
    emit(args, {"run_dir": str(result.run_dir), "summary": summary, "saved": saved if result.ok else None},
          render_summary(summary) + where + f"\ntrace      {result.run_dir}" + _requests_line(result.summary))
    return 0 if result.ok else 1


def _requests_line(summary) -> str:
    """A serving run with failed or truncated requests says how many on its last line, and what that made it
    (serve.max_failed_share decides between 'ok' and 'degraded': docs/serving.md)."""
    from llmadapt.contract.stats import failed_requests

    v = summary.serving
    if v is None or not v.failed:
        return ""
    return f"\n{summary.status:<10} {failed_requests(v)}" + ("" if summary.status == "ok" else " (exit 1; "
                                                            "serve.max_failed_share sets how many may fail)")


def _has_result(row) -> bool:
    """A comparison's row has a result unless its runs failed: a serving run that is 'degraded' (some requests
    failed) is reported in its row, not an error of the comparison."""
    from llmadapt.analysis.report import read_summary

    if row.status in ("ok", "unsupported"):
        return True
    try:
        return bool(row.run_dirs) and all(read_summary(d).get("status") == "degraded" for d in row.run_dirs)
    except Exception:  # a run without a readable summary has no result
        return False


def _node_options(args) -> dict[str, Any]:
    """Multi-node torchrun or Slurm settings from the `run` options; only what was given."""
    if args.launcher == "slurm":
        from llmadapt.launch.slurm import SlurmSettings

        return {"slurm": SlurmSettings(
            nnodes=args.nnodes, ntasks_per_node=args.nproc_per_node, partition=args.partition, time=args.time,
            options=tuple(args.sbatch_option or ()), collect_addr=args.collect_addr, master_port=args.master_port)}
    if args.nnodes == 1 and not (args.master_addr or args.rdzv_endpoint or args.nproc_per_node):
        return {}
    from llmadapt.launch.settings import NodeSettings

    return {"nodes": NodeSettings(
        nnodes=args.nnodes, node_rank=args.node_rank, nproc_per_node=args.nproc_per_node,
        master_addr=args.master_addr, master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint,
        local_addr=args.local_addr, ifname=args.ifname, collect_port=args.collect_port)}


def cmd_compare(args) -> int:
    from llmadapt.analysis.comparison import compare_stored, parse_matrix
    from llmadapt.experiments.compare import compare

    if args.report:  # before the runs: a report that cannot be written is found now, not after them
        from llmadapt.analysis.htmlreport import check_output

        check_output(args.report)
    if args.columns is not None:  # a misspelt column is found now too
        from llmadapt.analysis.comparison import column_keys

        column_keys(args.columns)

    if args.runs is not None:
        given = [flag for flag, on in (("a workload file", args.workload), ("--adapters", args.adapters),
                                       ("--attach", args.attach),
                                       ("--cell", args.cell), ("--matrix", args.matrix), ("--reuse", args.reuse),
                                       ("--repeat", args.repeat != 1), ("--settle", args.settle is not None),
                                       ("--seed", args.seed is not None)) if on]
        if given:
            raise LlmadaptError(f"compare --runs reads stored runs: it takes no {', '.join(given)}")
        comparison = compare_stored(args.runs, root=args.out)
        if args.baseline is not None:
            if not any(args.baseline in (r.cell, r.label) for r in comparison.rows):
                raise LlmadaptError(f"baseline {args.baseline!r} names no row of these runs; their rows: "
                                    + ", ".join(r.label for r in comparison.rows))
            comparison = attrs.evolve(comparison, baseline=args.baseline)
    else:
        if args.workload is None:
            raise LlmadaptError("name a workload file to run, or --runs QUERY to compare stored runs")
        from llmadapt.cli.serving import attach_settings

        names = _adapter_names(args)
        named = names + [c.partition(":")[0] for c in args.cell or []]
        workload = workload_of(args).with_overrides(attach_settings(args.attach, named), source="--set")
        if args.save_sweep:
            return _save_sweep(args, names)
        with cells_progress(args) as on_cell:
            comparison = compare(workload, names, cells=args.cell,
                                 matrix=parse_matrix(args.matrix or []), refuse_unsupported=args.refuse_unsupported,
                                 repeat=args.repeat, reuse=args.reuse, baseline=args.baseline, settle=args.settle,
                                 max_rounds=args.max_rounds, seed=args.seed, on_cell=on_cell,
                                 log=None if on_cell else lambda m: print(m, file=sys.stderr, flush=True),
                                 **run_options(args))
    shown = _printable_rows(comparison)
    # A terminal narrower than the table gets the columns read most; a file or pipe gets every column
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() and not args.json else None
    text = shown.table(columns=args.columns, width=width)
    if args.breakdown:
        text += "\n\n" + shown.breakdown_table()
    data = comparison.to_dict()
    if args.report:
        from llmadapt.analysis.htmlreport import report

        folders = [d for r in comparison.rows for d in r.run_dirs]
        if folders:
            data["report"] = str(report(folders, args.report, baseline=comparison.baseline))
            text += f"\nreport: {data['report']}"
    emit(args, data, text)
    if comparison.saved and not getattr(args, "json", False):  # beside the table, not in it (as progress is)
        print(f"table      {printable(comparison.saved)}", file=sys.stderr)
    return 0 if all(_has_result(r) for r in comparison.rows) else 1


def _printable_rows(comparison):
    """The comparison with its rows' labels, notes and machines escaped for the console (a label holding a newline
    would split its row); the JSON keeps them as they are."""
    def safe(text):
        return printable(text) if isinstance(text, str) else text

    rows = [attrs.evolve(r, label=safe(r.label), note=safe(r.note), machine=safe(r.machine), variant=safe(r.variant))
            for r in comparison.rows]
    return attrs.evolve(comparison, rows=rows, baseline=safe(comparison.baseline))


def _save_sweep(args, names: list[str]) -> int:
    """compare --save-sweep FILE: this comparison as a sweep file (checked by expanding it), not run."""
    import os
    from pathlib import Path

    from llmadapt.experiments import sweep as sweeps
    from llmadapt.analysis.comparison import parse_matrix

    if args.attach or args.reuse or args.report or args.breakdown:
        raise LlmadaptError("--save-sweep writes the comparison's cells only: not with --attach, --reuse, --report "
                            "or --breakdown")
    target = Path(args.save_sweep)
    if target.exists():
        raise LlmadaptError(f"--save-sweep {target}: exists; name a new file")
    workload = os.path.relpath(Path(args.workload).resolve(), target.resolve().parent)
    data = {"workload": workload, "adapters": names, "cells": args.cell or [], "set": args.set or [],
            "repeat": args.repeat if args.repeat != 1 else None,
            "matrix": {k: [list(v) if isinstance(v, tuple) else v for v in values]
                       for k, values in parse_matrix(args.matrix or []).items()}}
    sweeps.write(target, data)
    try:
        sweep = sweeps.load(target, args.out, create=False)
    except LlmadaptError:
        target.unlink()
        raise
    emit(args, {"sweep": str(target), "cells": len(sweep.cells)},
         f"wrote {target}: {len(sweep.cells)} cells; run it with: llmadapt sweep run {target}")
    return 0


def cmd_parity(args) -> int:
    import attrs

    from llmadapt.analysis.cells import as_cells
    from llmadapt.experiments.parity import parity

    if args.runs is not None:
        if args.workload or args.adapters or args.cell:
            raise LlmadaptError("parity --runs checks two stored runs: it takes no workload file, --adapters or --cell")
        from llmadapt.analysis.paritycheck import parity_of_stored

        report = parity_of_stored(args.runs, root=args.out, rtol=args.rtol, atol=args.atol)
        emit(args, attrs.asdict(report), report.describe())
        return 0 if report.ok else 1
    if args.workload is None:
        raise LlmadaptError("name a workload file to run, or --runs QUERY to check two stored runs")
    cells = as_cells(_adapter_names(args, distinct=False), args.cell)
    report = parity(workload_of(args), cells=cells, rtol=args.rtol, atol=args.atol, **run_options(args))
    emit(args, attrs.asdict(report), report.describe())
    return 0 if report.ok else 1


def _adapter_names(args, distinct: bool = True) -> list[str]:
    if args.adapters is None and not args.cell:
        raise LlmadaptError("name what to run: --adapters torch,deepspeed, or cells such as "
                            "--cell 'megatron:parallelism.tp=2' (repeat)")
    return name_list(args.adapters, distinct=distinct) if args.adapters is not None else []


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
    from llmadapt.analysis.hta import hta_analysis, render

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
        paths = terms[1:]
        if not paths:
            raise LlmadaptError("llmadapt runs import PATH...: name the run folders or result files to import")
        folders = [p for p in paths if Path(p).is_dir()]
        files = [p for p in paths if not Path(p).is_dir()]
        for path in files:
            if not Path(path).exists():
                raise LlmadaptError(f"{path}: no such file or folder: nothing imported")
        if files and getattr(args, "workload", None):
            from llmadapt.analysis.foreign import stream_workload

            stream = stream_workload(args.workload)
        else:
            stream = None
        new = not Path(args.root).exists()
        log = lambda m: print(printable(m), file=sys.stderr)  # noqa: E731
        try:  # a store root that does not exist yet is made; refused imports leave none behind
            if files:  # every file read before the store is touched
                from llmadapt.analysis.foreign import import_files, read_result

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

    from llmadapt.analysis.cells import distinct_labels, labelled_by

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
