"""Offline throughput (``serve.mode = "offline"``): the whole request set handed to an engine's offline API at once,
in the adapter's environment; tokens per second, beside the online numbers of the same request plan.

``python -m llmadapt.runtime.offline RUN_DIR``: builds the run's request plan (the same prompts and output lengths
the load generator would send), loads the adapter's offline engine (its ``offline`` role: a class with
``__init__(workload, checkpoint)``, ``generate(requests)`` -> per request its output token count or a
``Generated``, ``version()`` and
``forces_length``: whether the requested output lengths are forced), generates the warm-up
requests, then times one ``generate`` over every measured request: one request record each (sent at the call), a
header and an end record. An engine whose API says when each request's tokens came returns ``Generated`` (the
count and each token's time): the request then ends at its last token, and the summary has TTFT (from the call:
the wait for its batch and its prefill), TPOT and ITL. A bare count ends the request at the call's return, and
TTFT, TPOT, ITL and E2EL are left out; the throughputs are the offline figures either way. Stopped as a training rank is: SIGTERM, or its orchestrator gone, leaves a failure
record (killed, exit code 143).
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.launch import run_header
from llmadapt.contract.records import Request
from llmadapt.contract.rundir import RunDir
from llmadapt.runtime import lifecycle
from llmadapt.runtime.device import Place
from llmadapt.runtime.requests import plan_requests
from llmadapt.runtime.streams import request_source
from llmadapt.spec import Workload


def run_offline(run_dir: Path) -> int:
    """The offline run in RUN_DIR; returns the process exit code. Its shell (llmadapt.runtime.lifecycle's
    WorkerProcess) stops it on SIGTERM or when its orchestrator is gone, and writes its End or failure record."""
    launch = RunDir(run_dir).read_launch()
    writer = JsonlWriter(RunDir(run_dir).rank_file(0))
    place = Place(0, 0, 1, 0, "single")  # one process, whatever its environment says
    with lifecycle.WorkerProcess(writer, place, "offline worker", describe=_described) as worker:
        workload = Workload.from_dict(launch.workload)
        checkpoint = Path(launch.checkpoint)
        from tokenizers import Tokenizer

        from llmadapt.models import recorded_source

        plan = plan_requests(workload, Tokenizer.from_file(str(checkpoint / "tokenizer.json")))
        module, _, name = launch.offline_class.partition(":")
        engine = getattr(importlib.import_module(module), name)(workload, checkpoint)
        writer.write(run_header(launch, framework_version=engine.version(), workload=workload,
                                checkpoint_hash=launch.checkpoint_hash, device=None, software={}, patches=[],
                                model_source=recorded_source(checkpoint), request_source=request_source(workload)))
        warmup = [r for r in plan if r.warmup]
        measured = [r for r in plan if not r.warmup]
        if warmup:
            engine.generate(warmup)
        start = time.monotonic_ns()
        outputs = engine.generate(measured)
        end = time.monotonic_ns()
        for r, out in zip(measured, outputs):
            times = list(getattr(out, "token_ns", None) or [])  # a Generated; a bare count says nothing of time
            first = getattr(out, "first_token_ns", None) or (times[0] if times else None)
            last = getattr(out, "last_token_ns", None) or (times[-1] if times else None)
            writer.write(Request(
                index=r.index, warmup=False, scheduled_ns=start, sent_ns=start,
                first_token_ns=first, end_ns=last if first is not None and last is not None else end,
                chunk_ns=times, chunk_tokens=[1] * len(times), input_tokens=r.input_tokens,
                output_tokens=getattr(out, "tokens", out), requested_output_tokens=r.output_tokens,
                output_forced=engine.forces_length, finish_reason="length", status="ok"))
    return worker.code


def _described(exc: BaseException) -> str:
    """An error in one line (an engine's can be long: the record keeps its first 2000 characters)."""
    return lifecycle.short_trace(exc)[:2000]


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m llmadapt.runtime.offline RUN_DIR", file=sys.stderr)
        raise SystemExit(2)
    code = run_offline(Path(sys.argv[1]))
    sys.stdout.flush()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
