"""Inside a worker process: find our place, build the adapter's role class, and drive the measured loop.

The core owns the clock: it synchronises the device before reading it, runs warm-up steps
(recorded, flagged, excluded from statistics), takes memory snapshots, and streams one record
per step to this rank's JSONL file. The adapter only does one global step.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from pathlib import Path

import attrs

from llmadapt.adapter.context import StepBatch, WorkerContext
from llmadapt.adapter.declaration import load_role
from llmadapt.adapter.interfaces import Trainer
from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.launch import Fault, run_header
from llmadapt.contract.records import Failure, Metric, Phase, Step
from llmadapt.contract.rundir import RunDir
from llmadapt.contract.stream import StreamingWriter
from llmadapt.errors import LlmadaptError
from llmadapt.host import node_name, utc_now
from llmadapt.runtime import interference, lifecycle
from llmadapt.runtime.data import TokenData
from llmadapt.runtime.device import (
    Place,
    apply_thread_policy,
    describe_device,
    describe_topology,
    memory_snapshot,
    nvml_index,
    pick_device,
    reset_peak_memory,
    software_versions,
)
from llmadapt.runtime.profile import StepProfiler
from llmadapt.runtime.telemetry import Sampler
from llmadapt.spec import Workload


def _open_records(run_dir: Path, place: Place, run_id: str):
    """This rank's record file; with LLMADAPT_COLLECT=host:port each record is also sent to the orchestrator."""
    path = RunDir(run_dir).rank_file(place.rank)
    address = os.environ.get("LLMADAPT_COLLECT")
    if not address:
        return JsonlWriter(path)
    try:
        return StreamingWriter(path, address, {"run_id": run_id, "rank": place.rank, "node_rank": place.node_rank,
                                               "node": node_name()})
    except LlmadaptError as exc:  # the orchestrator is unreachable: say so here, on the node, and stop
        with JsonlWriter(path) as writer:
            writer.write(Failure(cause="error", message=str(exc), rank=place.rank, exit_code=1, time=utc_now()))
        print(f"llmadapt worker: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def run_worker(run_dir: Path, place: Place | None = None) -> int:
    """Worker entry point: returns the process exit code. Every outcome leaves a record.

    ``place`` is given by the inline launcher (one rank, whatever the caller's environment says); an inline run
    may be called from any thread, so it leaves the signals to its caller. A rank that finished writes an ``End``
    record last; what happens after it (synchronising the ranks, the adapter's teardown) can no longer fail the
    run, only warn. llmadapt.runtime.lifecycle.WorkerProcess is the shell that does both.
    """
    run_dir = Path(run_dir)
    launch = lifecycle.launch_record(run_dir)
    inline = place is not None
    place = place or Place.from_env()
    writer = _open_records(run_dir, place, launch.run_id)
    with lifecycle.WorkerProcess(writer, place, "worker", signals=not inline) as worker:
        workload = launch.require_workload()
        if not inline:
            apply_thread_policy(workload.parallelism.threads_per_rank)
        device = pick_device(place)
        if not workload.parallelism.p2p:  # read by NCCL when its communicators start
            os.environ["NCCL_P2P_DISABLE"] = "1"
        worker.join_group(device)

        from llmadapt.chattemplate import read_chat_template
        from llmadapt.models import canonical_checkpoint, recorded_source, recorded_weights_hash

        checkpoint = canonical_checkpoint(workload.model, workload.seed)
        # Named by the orchestrator: adapters are found through installed entry points there, not here
        # (the environment holds no llmadapt packages; they come on PYTHONPATH).
        cls = load_role(launch.worker_class)
        ctx = WorkerContext(workload, place.rank, place.local_rank, place.world_size, device, checkpoint, run_dir)
        trainer = cls(ctx)
        worker.role = lambda: trainer.rank_role()  # looked up when a failure is written, as the layout may not exist
        worker.at_teardown(lambda: _maybe_fault(launch.fault, place.rank, "teardown"))
        worker.at_teardown(lambda: trainer.teardown())
        setup = _set_up(trainer, place.rank, ctx.is_cuda)
        data = TokenData(workload, _tokenizer(workload, checkpoint), read_chat_template(checkpoint))
        dp_rank, dp_size = trainer.data_rank()

        writer.write(run_header(
            launch, rank=place.rank, local_rank=place.local_rank, world_size=place.world_size, workload=workload,
            framework_version=trainer.framework_version(),
            checkpoint_hash=workload.model.checksum or recorded_weights_hash(checkpoint), device=describe_device(device),
            software=software_versions(), patches=list(trainer.patches), topology=describe_topology(device),
            notes=list(getattr(trainer, "notes", [])),  # an adapter written before notes may not call our __init__
            model_source=recorded_source(checkpoint),
            weights=list(getattr(trainer, "weights", [])),
        ))

        for metric in setup:
            writer.write(metric)
        _train(worker, launch.fault, workload, trainer, ctx, data, (dp_rank, dp_size), run_dir)
        if workload.save.path:
            writer.write(_save(trainer, workload, checkpoint, place.rank))
        for extra in trainer.final_records():
            writer.write(extra)
    return worker.code


def _train(worker: lifecycle.WorkerProcess, fault: Fault | None, workload: Workload, trainer: Trainer,
           ctx: WorkerContext, data: TokenData, dp: tuple[int, int], run_dir: Path) -> None:
    """The measured loop: warm-up and measured steps, one record each with what the adapter reported, the
    telemetry and interference beside them, and the evaluations workload.eval asks for. What a step does between
    two clock readings is the loop's own cost: benchmarks/profile_overhead.py measures it."""
    writer, place, dist_started = worker.writer, worker.place, worker.distributed
    dp_rank, dp_size = dp
    slow = fault.seconds if fault and fault.kind == "slow" else 0  # decided here, not in the clock
    delay = interference.StepDelay()  # this thread's waits for a core, per step
    worker.at_close(delay.close)
    profiled = set(workload.profile.steps)
    sampler = Sampler(place.rank, workload.telemetry.interval_s,
                      (ctx.device.index or 0) if ctx.is_cuda else None).start()
    worker.at_close(lambda: _drain(sampler, writer))  # stopped already on success; a failed run keeps its samples
    energy_start = quiet_start = nonfinite_at = None
    gpu_index = nvml_index(ctx.device, dict(os.environ)) if ctx.is_cuda else None
    evaluate = _evaluator(workload, trainer, data, run_dir, dist_started)
    evaluate(0, writer)
    for step_index in worker.steps(workload.train.total_steps):
        _maybe_fault(fault, place.rank, step_index)
        data_start = time.perf_counter()
        batch: StepBatch = data.step_batch(step_index, dp_rank, dp_size)
        data_seconds = time.perf_counter() - data_start
        if step_index == workload.train.warmup_steps:
            energy_start = sampler.energy_j()
            quiet_start = interference.snapshot(gpu_index)
        reset_peak_memory(ctx)
        probe = (StepProfiler(trainer, rank=place.rank, world_size=place.world_size, step=step_index,
                              level=workload.profile.level, cuda=ctx.is_cuda, run_dir=run_dir,
                              sync=_barrier if dist_started else None)
                 if step_index in profiled else contextlib.nullcontext())
        with probe:  # started before the clock is read, stopped after
            ctx.synchronize()
            waited_before = delay.read()
            start = time.monotonic_ns()
            result = trainer.step(batch)
            if slow:
                time.sleep(slow)
            ctx.synchronize()
            end = time.monotonic_ns()
            waited_after = delay.read()
        breakdown = getattr(probe, "breakdown", None)
        writer.write(Step(
            rank=place.rank, step=step_index, warmup=step_index < workload.train.warmup_steps,
            start_ns=start, end_ns=end, seconds=(end - start) / 1e9, tokens=batch.tokens,
            samples=batch.samples, loss=(loss := float(result.loss)),
            phases=[Phase("data", data_seconds, "llmadapt"), *result.phases],
            memory=memory_snapshot(ctx), expert_load=result.expert_load, spans=list(result.spans),
            expert_near_ties=result.expert_near_ties, profiled=step_index in profiled,
            run_delay_s=None if None in (waited_before, waited_after) else (waited_after - waited_before) / 1e9,
            grad_norm=(grad_norm := None if result.grad_norm is None else float(result.grad_norm)),
            sample_length_squares=batch.sample_length_squares,
        ))
        for extra in (*([breakdown] if breakdown else []), *result.comms, *result.metrics):
            writer.write(extra if extra is breakdown else attrs.evolve(extra, step=step_index))
        what = next(((name, value) for name, value in (("loss", loss), ("gradient norm", grad_norm))
                     if value is not None and not math.isfinite(value)), None)
        if what and nonfinite_at is None:
            nonfinite_at = step_index
            if workload.train.on_nonfinite == "stop":
                raise lifecycle.Diverged(f"the {what[0]} is {what[1]} at step {step_index} on rank {place.rank} "
                                         "(train.on_nonfinite = \"continue\" runs every step)")
        if step_index in profiled and dist_started:
            # Reading the profiler's events takes each rank its own time, after the clock stopped: the
            # ranks start the next step together, or the quickest would wait for the others inside it.
            _barrier()
        for sample in sampler.drain():
            writer.write(sample)
        if workload.eval.every and (step_index + 1) % workload.eval.every == 0 \
                and step_index + 1 < workload.train.total_steps:
            evaluate(step_index + 1, writer)
    energy_end = sampler.energy_j()
    if quiet_start is not None:
        writer.write(interference.interference(place.rank, quiet_start, interference.snapshot(gpu_index),
                                               node_name()))
    for sample in sampler.stop():
        writer.write(sample)
    if energy_start is not None and energy_end is not None:
        writer.write(Metric(rank=place.rank, name="energy_measured_steps", value=energy_end - energy_start,
                            unit="J", source="nvml"))
    worker.step = None
    evaluate(workload.train.total_steps, writer)


def _drain(sampler: Sampler, writer) -> None:
    with contextlib.suppress(Exception):
        for sample in sampler.stop():
            writer.write(sample)


def _set_up(trainer: Trainer, rank: int, cuda: bool) -> list[Metric]:
    """``trainer.setup()``, and what it cost this rank: time, and peak memory so far (the process's high-water
    mark, imports included, so loading is in it: what memory-bounded loading bounds); the loading itself when
    the adapter marked when its weights were in place (``loaded_at``)."""
    import resource

    setup_start = time.perf_counter()
    trainer.setup()
    seconds = time.perf_counter() - setup_start
    metrics = [Metric(rank=rank, name="setup_seconds", value=seconds, unit="s", source="llmadapt"),
               Metric(rank=rank, name="setup_peak_rss_bytes", value=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      * 1024.0, unit="B", source="getrusage")]
    if cuda:
        import torch

        metrics.append(Metric(rank=rank, name="setup_peak_device_bytes", value=float(torch.cuda.max_memory_allocated()),
                              unit="B", source="torch.cuda"))
    loaded = getattr(trainer, "loaded_at", None)
    if loaded is not None:
        metrics += [Metric(rank=rank, name="load_seconds", value=loaded[0] - setup_start, unit="s", source="llmadapt"),
                    Metric(rank=rank, name="load_peak_rss_bytes", value=loaded[1], unit="B", source="getrusage")]
    return metrics


def _tokenizer(workload: Workload, checkpoint: Path):
    """The canonical tokenizer when the data or the evaluation is text; else None."""
    if workload.data.source != "jsonl" and not workload.eval.path:
        return None
    # The class the canonical tokenizer was saved as: AutoTokenizer of older transformers
    # (ColossalAI's 4.51) cannot read what 5.x writes in tokenizer_config.json.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(checkpoint))


def _evaluator(workload: Workload, trainer: Trainer, data: TokenData, run_dir: Path, distributed: bool):
    """evaluate(steps_done, writer): workload.eval's evaluation of the model as trained so far, written by rank 0;
    a no-op when the workload evaluates nothing."""
    def evaluate(step: int, writer) -> None:
        if not workload.eval.examples:
            return
        from llmadapt.runtime.evaluation import evaluate_trained

        record = evaluate_trained(trainer, data, step, run_dir, _barrier if distributed else None)
        if record is not None:
            writer.write(record)

    return evaluate


def _save(trainer: Trainer, workload, checkpoint: Path, rank: int) -> Metric:
    """The trained model as a Hugging Face folder: the adapter writes weights and config (gathered), rank 0 adds
    the tokenizer and generation config of the checkpoint it started from; every rank waits for the folder."""
    import shutil

    from llmadapt.chattemplate import TEMPLATE_FILE
    from llmadapt.modelfolder import TOKENIZER_FILES

    start = time.perf_counter()
    folder = Path(workload.save.path)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    trainer.save_pretrained(folder, adapter_only=workload.save.lora == "adapter")
    if rank == 0:
        for name in (*TOKENIZER_FILES, TEMPLATE_FILE, "generation_config.json"):
            if (checkpoint / name).is_file():
                shutil.copyfile(checkpoint / name, folder / name)
    if workload.world_size > 1:
        _barrier()
    return Metric(rank=rank, name="save_seconds", value=time.perf_counter() - start, unit="s", source="llmadapt")


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _maybe_fault(fault: Fault | None, rank: int, step: int | str) -> None:
    """Fault injection for testing failure handling: ``fault.kind`` at ``fault.step`` of ``fault.rank``.

    ``step`` "teardown": after the rank's last record (the run is complete; the launcher must say so)."""
    if not fault or fault.step != step or fault.rank != rank:
        return
    kind = fault.kind
    if kind == "error":
        raise RuntimeError(f"injected error at step {step}")
    if kind == "exit":
        os._exit(3)  # dies without a word: the launcher must notice
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(10**6)
    if kind == "stop":  # frozen (SIGSTOP): deaf to every signal but SIGKILL
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "oom":
        hog = []
        while True:  # allocate until the address-space cap (set by the launcher) refuses
            hog.append(bytearray(256 << 20))
    raise ValueError(f"unknown fault kind {kind!r}")


def main(argv: list[str] | None = None) -> None:
    """``python -m llmadapt.runtime.worker RUN_DIR``, the name adapters' own launchers may still give (the one entry
    point, ``python -m llmadapt.runtime``, picks this worker from the launch record)."""
    from llmadapt.runtime.kinds import main as run_kind

    run_kind(argv)


if __name__ == "__main__":
    main()
