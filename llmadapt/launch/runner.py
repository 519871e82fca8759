"""The orchestrator: check, make the run directory, start workers, supervise them, summarise.

Launchers: ``inline`` (in this process, for embedding and debugging; one rank), ``subprocess``
(one rank in the adapter's environment), ``torchrun`` (several ranks on this machine: gloo on
CPU, NCCL on GPU, 127.0.0.1 and a free port; or several machines, with ``NodeSettings``: the
same ``llmadapt run`` on every node, node 0 gathers the records), ``slurm`` (a batch job, see
llmadapt.launch.slurm). ``auto`` picks subprocess or torchrun by world size. Workers run in their own
process group; whatever happens (crash, kill, timeout, Ctrl-C) the group is gone afterwards,
and the records made before plus a failure record remain. Across nodes, records are streamed
to the orchestrator as they are written (llmadapt.launch.collect), so no shared disk is needed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.launch import Fault, LaunchRequest, MicroSpec, NodeLayout, new_run_id
from llmadapt.contract.records import Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.contract.schema import to_json
from llmadapt.errors import ExitCode, LlmadaptError, StorageError, exit_code_of
from llmadapt.host import free_port
from llmadapt.launch.collect import Collector
from llmadapt.launch.environments import TOOLS_ENVIRONMENT, python_for
from llmadapt.launch.multinode import gather, run_node_agent, run_node_zero, warn_loopback
from llmadapt.launch.prepare import check_data_fits, check_save_folder, ensure_checkpoint
from llmadapt.launch.serve import run_serving
from llmadapt.launch.settings import LAUNCHERS, NodeSettings, check_run_options, launch_request, resolve
from llmadapt.launch.sinks import RecordSinks
from llmadapt.launch.slurm import SlurmSettings, require_slurm, run_slurm_job, slurm_job
from llmadapt.contract.readback import RunResult, summarise, write_launcher_failures
from llmadapt.launch.supervise import StallWatch, interrupt_text, supervise, worker_command, worker_env
from llmadapt.spec import Workload


def run(
    workload: Workload | str | Path,
    adapter: str = "torch",
    *,
    launcher: str = "auto",
    out: str | Path = "runs",
    run_id: str | None = None,
    timeout: float | None = None,
    stall_timeout: float | None = None,
    fault: dict[str, Any] | Fault | None = None,
    memory_limit_bytes: int | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    nodes: NodeSettings | None = None,
    slurm: SlurmSettings | None = None,
) -> RunResult:
    """Run one workload on one adapter; returns when the workers are gone, with the summary.

    ``progress`` receives a ``{"type": "start", ...}`` event once the run directory exists,
    then rank 0's records as they are written (and ``warning``, ``node`` and ``slurm`` events).
    ``on_record`` receives those records only, as do the record sinks plugins provide
    (``llmadapt_record_sink``; llmadapt.launch.sinks); an inline run's reach them when it ends.

    ``nodes``: several machines under torchrun, the same call on each (see NodeSettings);
    on node 0 it returns the run's result, on the others a copy of node 0's summary.
    ``slurm``: the layout and options of the Slurm job (``launcher="slurm"``).

    ``stall_timeout``: stop a training run whose rank 0 recorded no step for this many seconds after its first
    (llmadapt.launch.supervise.StallWatch): a hung collective found in a step's time, not at ``timeout``.

    A failed run is a result (``summary.status == 'failed'`` with its failures), not an
    exception. Exceptions are for bad input, raised before any process starts.
    """
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    sinks = RecordSinks(progress, on_record, workload.to_dict())
    try:
        result = _run(workload, adapter, launcher, out, run_id, timeout, stall_timeout, fault, memory_limit_bytes,
                      sinks, nodes, slurm)
    except BaseException:
        sinks.close({})
        raise
    if launcher == "inline" and (sinks.sinks or on_record):  # no tail follows an inline run: its records now
        for record in read_jsonl(RunDir(result.run_dir).rank_file(0), check=False):
            sinks.record(record)
    sinks.close(to_json(result.summary))
    return result


def _run(workload: Workload, adapter: str, launcher: str, out: str | Path, run_id: str | None, timeout: float | None,
         stall_timeout: float | None, fault: dict[str, Any] | Fault | None, memory_limit_bytes: int | None,
         progress: Callable[[dict[str, Any]], None], nodes: NodeSettings | None,
         slurm: SlurmSettings | None) -> RunResult:
    info, workload = resolve(workload, adapter)
    check_save_folder(workload)
    if launcher not in LAUNCHERS and launcher not in info.launchers:
        known = ", ".join([*LAUNCHERS, *info.launchers])
        raise LlmadaptError(f"unknown launcher {launcher!r} for adapter {adapter!r}; known: {known}")
    fault = check_run_options(fault, timeout, memory_limit_bytes, stall_timeout, workload.kind)
    world = workload.world_size
    if workload.kind == "serve":
        return run_serving(workload, info, out, run_id, timeout, progress)
    nodes = nodes or NodeSettings()
    if launcher == "auto":
        launcher = "slurm" if slurm else "torchrun" if world > 1 or nodes.nnodes > 1 else "subprocess"
    if launcher in ("inline", "subprocess") and world > 1:
        raise LlmadaptError(f"launcher {launcher!r} runs one rank, but the workload needs world size {world}: "
                            "use --launcher torchrun (or auto)")
    if nodes.nnodes > 1 and launcher != "torchrun":
        raise LlmadaptError(f"--nnodes {nodes.nnodes} needs --launcher torchrun (or auto), not {launcher!r}")
    # Every check before anything is written or submitted.
    if launcher == "slurm":
        slurm = slurm or SlurmSettings()
        per_node = slurm.tasks_per_node(world)
        require_slurm()
    else:
        per_node = nodes.procs_per_node(world)
    python = None if launcher == "inline" else python_for(info.environment)
    if python is not None or workload.model.path:
        check_data_fits(workload, ensure_checkpoint(workload, info.environment))
    multinode = launcher == "torchrun" and nodes.nnodes > 1
    if multinode:
        warn_loopback(nodes, progress)
    if multinode and nodes.node_rank > 0:
        return run_node_agent(workload, python, info.environment, nodes, per_node, out, timeout, memory_limit_bytes,
                               progress)

    launch = launch_request(workload, info, launcher, python, run_id, fault=fault,
                            memory_limit_bytes=memory_limit_bytes)
    # Other nodes' records arrive here. Bound before anything is written, so a taken port fails cleanly.
    collector = None
    if launcher == "slurm":
        collector = Collector(("0.0.0.0", 0))
    elif multinode:
        collector = Collector(("0.0.0.0", nodes.collect_address()[1]))
        launch = attrs.evolve(launch, nodes=NodeLayout(nnodes=nodes.nnodes, nproc_per_node=per_node,
                                                       rendezvous="c10d" if nodes.rdzv_endpoint else "static"))
    try:  # the collector's socket is closed on every way out, an early error included
        return _run_launched(workload, info, launcher, launch, python, per_node, nodes, collector, out, timeout,
                             stall_timeout, memory_limit_bytes, progress, slurm)
    finally:
        if collector:
            collector.close()


def _run_launched(workload, info, launcher, launch, python, per_node, nodes, collector, out, timeout, stall_timeout,
                  memory_limit_bytes, progress, slurm) -> RunResult:
    """From the checked request to the summary: the run directory, the workers, their supervision."""
    world, multinode, run_id = workload.world_size, collector is not None and launcher == "torchrun", launch.run_id
    job = None
    if launcher == "slurm":
        job, launch = slurm_job(slurm, launch, python, info.environment, per_node, collector, progress)
    run_dir = Path(out) / run_id
    adapter_cmd = None
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
        if launcher in info.launchers:  # the adapter's own launcher; its command goes into the trace
            adapter_cmd = info.launchers[launcher](python, run_dir, world, free_port())
            launch = attrs.evolve(launch, command=adapter_cmd)
        RunDir(run_dir).write_launch(launch)
    except OSError as exc:  # before any worker: nothing measured yet, nothing lost
        # --out naming a file is bad input; a full or read-only disk, a folder not ours, the machine's (I/O)
        error = StorageError if exit_code_of(exc) == ExitCode.IO else LlmadaptError
        raise error(f"cannot write the run directory {run_dir}: {exc.strerror or exc}") from None
    if progress:
        progress({"type": "start", "run_dir": str(run_dir), "adapter": info.name, "label": workload.label,
                  "world_size": world, "launcher": launcher})

    failures: list[Failure] = []
    interrupted: KeyboardInterrupt | None = None
    stalled = (StallWatch(stall_timeout, RunDir(run_dir).rank_file(0), workload.train.total_steps - 1).check
               if stall_timeout else lambda: None)
    if collector:
        collector.start(run_dir, launch, nodes.nnodes if multinode else 1)
    try:
        if launcher == "inline":
            from llmadapt.runtime.device import Place
            from llmadapt.runtime.worker import run_worker

            # The worker records its own failures; an interrupt is re-raised once the summary is written.
            if run_worker(run_dir, Place(0, 0, 1, 0, "inline")) == 130:
                interrupted = KeyboardInterrupt()
        elif launcher == "slurm":
            failures += run_slurm_job(job, run_dir, timeout, memory_limit_bytes, progress, stalled)
        elif multinode:
            failures += run_node_zero(python, info.environment, nodes, per_node, run_dir, collector, timeout, memory_limit_bytes,
                                       progress, stalled)
        else:
            cmd = adapter_cmd or worker_command(launcher, python, run_dir, per_node=world)
            failures += supervise(cmd, env=worker_env(world, info.environment, workload.parallelism.threads_per_rank), log=RunDir(run_dir).worker_log,
                                   tail=RunDir(run_dir).rank_file(0), timeout=timeout,
                                   memory_limit_bytes=memory_limit_bytes, progress=progress, should_stop=stalled)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM from a scheduler (llmadapt.errors.Terminated)
        interrupted = exc
        failures.append(Failure(cause="interrupted", message=f"{interrupt_text(exc)} in the orchestrator"))
    finally:
        if collector:
            gather(collector, run_dir, failures, progress)

    summary = summarise(run_dir, failures)
    if collector:
        collector.send_summary(to_json(summary))
    if interrupted is not None:
        raise interrupted
    return RunResult(run_dir=run_dir, summary=summary)


def run_micro(suite: str, spec: MicroSpec, workload: Workload | None = None, *, world: int = 1, out: str | Path = "runs",
              timeout: float | None = None, progress: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Run one micro-benchmark suite ('ops', 'peak' or 'comm', as ``spec`` describes it) as a worker of kind
    ``micro`` (``llmadapt.runtime.microbench``) in the core's tools environment, one process (or torchrun with
    ``world`` ranks), supervised; ``workload``: the one the operators come from; what the launcher saw go wrong goes to launcher.jsonl. Returns the run folder
    (``llmadapt.analysis.perf.micro.read_micro`` reads it)."""
    python = python_for(TOOLS_ENVIRONMENT)  # fails before anything is written
    launcher = "torchrun" if world > 1 else "subprocess"
    # The micro-benchmark's header names torch as its adapter and framework, and the workload it was derived from.
    launch = LaunchRequest(
        run_id=new_run_id("micro", suite), launcher=launcher, world_size=world, kind="micro", role=f"micro-{suite}",
        adapter="torch", framework="torch", workload=workload,
        workload_hash=workload.content_hash if workload else "", problem_hash=workload.problem_hash if workload else "",
        python=str(python),
        suite=suite, spec=spec, created=time.time())
    run_dir = Path(out) / launch.run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    RunDir(run_dir).write_launch(launch)
    if progress:
        progress({"type": "start", "run_dir": str(run_dir), "suite": suite, "world_size": world})
    cmd = worker_command(launcher, python, run_dir, per_node=world)
    failures: list[Failure] = []
    try:
        failures = supervise(cmd, env=worker_env(world, TOOLS_ENVIRONMENT), log=RunDir(run_dir).worker_log,
                             tail=RunDir(run_dir).rank_file(0), timeout=timeout, memory_limit_bytes=None,
                             progress=progress)
    except KeyboardInterrupt:
        failures = [Failure(cause="interrupted", message="interrupted (Ctrl-C) in the orchestrator")]
        write_launcher_failures(run_dir, failures)
        raise
    write_launcher_failures(run_dir, failures)
    return run_dir
