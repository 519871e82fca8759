"""Offline throughput (``serve.mode = "offline"``): the whole request set handed to an engine's offline API at once,
in the adapter's environment; tokens per second, beside the online numbers of the same request plan.

``python -m llmadapt.runtime.offline RUN_DIR``: builds the run's request plan (the same prompts and output lengths
the load generator would send), loads the adapter's offline engine (its ``offline`` role: a class with
``__init__(workload, checkpoint)``, ``generate(requests) -> output token counts``, ``version()`` and
``forces_length``: whether the requested output lengths are forced), generates the warm-up
requests, then times one ``generate`` over every measured request: one request record each (sent at the call,
ended at its return: an offline API says nothing of when each request's tokens came), a header and an end record.
There is no first token to time, so TTFT, TPOT, ITL and E2EL are left out of the summary; its throughputs are the
offline figures.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.records import End, Failure, Header, Request
from llmadapt.contract.rundir import RunDir
from llmadapt.host import utc_now
from llmadapt.runtime import lifecycle
from llmadapt.runtime.requests import plan_requests
from llmadapt.spec import Workload


def run_offline(run_dir: Path) -> int:
    launch = RunDir(run_dir).read_launch()
    workload = Workload.from_dict(launch["workload"])
    checkpoint = Path(launch["checkpoint"])
    with JsonlWriter(RunDir(run_dir).rank_file(0)) as writer:
        try:
            from tokenizers import Tokenizer

            plan = plan_requests(workload, Tokenizer.from_file(str(checkpoint / "tokenizer.json")))
            module, _, name = launch["offline_class"].partition(":")
            engine = getattr(importlib.import_module(module), name)(workload, checkpoint)
            writer.write(Header.starting_now(
                run_id=launch["run_id"], rank=0, local_rank=0, world_size=1, role="serve", adapter=launch["adapter"],
                adapter_version=launch["adapter_version"], framework=launch["framework"],
                framework_version=engine.version(), launcher="offline", workload_hash=workload.content_hash,
                problem_hash=workload.problem_hash, workload=workload.to_dict(),
                checkpoint_hash=launch.get("checkpoint_hash"), device=None, software={}, patches=[],
            ))
            warmup = [r for r in plan if r.warmup]
            measured = [r for r in plan if not r.warmup]
            if warmup:
                engine.generate(warmup)
            start = time.monotonic_ns()
            outputs = engine.generate(measured)
            end = time.monotonic_ns()
            for r, tokens in zip(measured, outputs):
                writer.write(Request(
                    index=r.index, warmup=False, scheduled_ns=start, sent_ns=start, first_token_ns=None, end_ns=end,
                    chunk_ns=[], chunk_tokens=[], input_tokens=r.input_tokens, output_tokens=tokens,
                    requested_output_tokens=r.output_tokens, output_forced=engine.forces_length,
                    finish_reason="length", status="ok"))
            writer.write(End(rank=0, time=utc_now()))
            return 0
        except BaseException as exc:  # noqa: BLE001 - every way out leaves a failure record
            cause, code, message = lifecycle.failure_cause(exc, lifecycle.short_trace)
            writer.write(Failure(cause=cause, message=message[:2000], rank=0, exit_code=code, time=utc_now()))
            traceback.print_exc()
            return code


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m llmadapt.runtime.offline RUN_DIR", file=sys.stderr)
        raise SystemExit(2)
    code = run_offline(Path(sys.argv[1]))
    sys.stdout.flush()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
