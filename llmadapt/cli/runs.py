"""Commands that make or read runs: run, compare, parity, show, export, hta."""

from __future__ import annotations

import sys
from typing import Any

from llmadapt.cli.common import emit, name_list, run_options, workload_of
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError


def cmd_run(args) -> int:
    import attrs

    from llmadapt.analysis.report import render_summary
    from llmadapt.launch.run import run

    result = run(workload_of(args), args.adapter, **run_options(args), **_node_options(args))
    summary = attrs.asdict(result.summary)
    nodes = RunDir(result.run_dir).read_launch().get("nodes", {}).get("seen")
    where = "".join(f"\nnode {n['node_rank']:<6} {n['node']}, ranks {', '.join(map(str, n['ranks']))}"
                    for n in nodes or [])
    emit(args, {"run_dir": str(result.run_dir), "summary": summary},
          render_summary(summary) + where + f"\ntrace      {result.run_dir}")
    return 0 if result.ok else 1


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
    from llmadapt.analysis.compare import compare, parse_matrix

    comparison = compare(workload_of(args), _adapter_names(args), cells=args.cell, matrix=parse_matrix(args.matrix or []),
                         refuse_unsupported=args.refuse_unsupported,
                         log=lambda m: print(m, file=sys.stderr, flush=True),  # stderr: --json's stdout stays JSON
                         **run_options(args))
    text = comparison.table()
    if args.breakdown:
        text += "\n\n" + comparison.breakdown_table()
    emit(args, comparison.to_dict(), text)
    return 0 if all(r.status in ("ok", "unsupported") for r in comparison.rows) else 1


def cmd_parity(args) -> int:
    import attrs

    from llmadapt.analysis.cells import as_cells
    from llmadapt.analysis.parity import parity

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
