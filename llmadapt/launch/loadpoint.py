"""What drives load against a ready engine and writes the serving run: one load point's folder (launch.json), its
records (the header, every request, what ran beside it, the quality measured after the speed) and nothing else."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import attrs

from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.launch import LaunchRequest, run_header
from llmadapt.contract.records import Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.host import node_name, software_versions
from llmadapt.launch.engine import Engine, engine_launch
from llmadapt.launch.quality import measure as measure_quality
from llmadapt.launch.settings import launch_request
from llmadapt.runtime import interference
from llmadapt.runtime.loadgen import LoadGenerator, redact
from llmadapt.runtime.requests import plan_requests
from llmadapt.runtime.streams import completed_note, request_source
from llmadapt.spec import Workload


@attrs.frozen
class LoadPoint:
    """One serving run against an engine that may serve several in a row (llmadapt.experiments.loadsweep): the run's
    workload (its arrival process and request stream) and its folder, already holding launch.json."""

    workload: Workload
    run_id: str
    run_dir: Path
    launch: LaunchRequest


def new_point(workload: Workload, info, out, run_id: str | None, progress) -> LoadPoint:
    """A serving run's folder with its launch.json, announced to ``progress``."""
    launcher, python = engine_launch(workload, info)
    launch = launch_request(workload, info, launcher, python, run_id)
    run_dir = Path(out) / launch.run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    RunDir(run_dir).write_launch(launch)
    RunDir(run_dir).rank_file(0).touch()  # a run that fails before its header still has its (empty) record file
    if progress:
        progress({"type": "start", "run_dir": str(run_dir), "adapter": info.name, "label": workload.label,
                  "world_size": 1, "launcher": launcher})
        note = completed_note(request_source(workload))
        if note:
            progress({"type": "warning", "message": note})
    return LoadPoint(workload, launch.run_id, run_dir, launch)


async def drive(engine: Engine, point: LoadPoint, session, started: float, timeout: float | None, progress,
                failures: list[Failure]) -> None:
    """Run ``point``'s request plan against the ready engine and write its records; the failures it meets (its
    timeout, counted from ``started``; a quality measurement that could not be made) go to ``failures`` as they
    happen, so that an interrupt later keeps them."""
    from llmadapt.models import recorded_source  # None for an attached server's (no checkpoint)

    w, server = point.workload, engine.server
    writer = JsonlWriter(RunDir(point.run_dir).rank_file(0))
    try:
        writer.write(run_header(
            point.launch, framework_version=redact(server.engine_version(), engine.secrets), device=None,
            software=software_versions(("aiohttp", "tokenizers")), patches=list(server.patches), workload=w,
            checkpoint_hash=recorded_hash(w, engine.checkpoint), model_source=recorded_source(engine.checkpoint),
            request_source=request_source(w),
            notes=list(getattr(server, "notes", [])),  # a server written before notes may not call our __init__
            engine_weights=getattr(server, "engine_weights", lambda: None)()))
        run = LoadGenerator(server, w, plan_requests(w, engine.tokenizer), writer, progress).run(session)
        group = engine.group()
        quiet_start, engine_start = interference.snapshot(), interference.group_cpu_s(group)
        try:
            if timeout is None:
                await run
            else:
                try:
                    await asyncio.wait_for(run, timeout=max(1.0, timeout - (time.monotonic() - started)))
                except TimeoutError:
                    failures.append(engine.failure("timeout", f"the run exceeded its timeout of {timeout:g} s"))
        finally:  # what ran beside the run while it sent its requests, the engine's CPU counted as its own
            writer.write(interference.serving_window(quiet_start, interference.snapshot(), engine_start,
                                                     interference.group_cpu_s(group), node_name()))
        if w.serve.quality.texts and server.alive():  # after the speed measurement, outside its window
            try:
                writer.write(await measure_quality(server, session, w, engine.checkpoint, point.run_dir))
            except LlmadaptError as exc:
                failures.append(engine.failure("error", str(exc)))
    finally:
        writer.close()


def recorded_hash(workload: Workload, checkpoint: Path | None) -> str | None:
    """The header's checkpoint hash, as a training rank records it: model.checksum (a folder's content hash, a
    GGUF file's hash), else the canonical checkpoint's; none for an attached server (what it serves is its own)."""
    if checkpoint is None:
        return None
    from llmadapt.models import recorded_weights_hash

    return workload.model.checksum or recorded_weights_hash(checkpoint)
