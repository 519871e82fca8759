"""``python -m llmadapt.reference.profiled_serve FOLDER serve <arguments>``: `transformers serve` in this process,
with a torch profiler the client starts and stops (``serve.profile`` on the reference server ``hf``).

Runs in the reference environment (torch, transformers and its serving extras; llmadapt on PYTHONPATH), started
by ``llmadapt.reference.serve`` only when a workload profiles the engine. It adds POST /start_profile and
/stop_profile to transformers serve's FastAPI app (wrapping ``build_server``); /stop_profile writes the Kineto
trace into FOLDER and answers its path. It names each continuous-batching step (wrapping the manager's
``_generation_step``) ``continuous_batching_prefill_<requests>(<tokens>)_decode_<requests>(<tokens>)``, which
``llmadapt.runtime.engine_profile`` reads as it reads vLLM's steps, and marks the engine's scheduling (the next
batch's choice and inputs) and its sampling as ``llmadapt::call::<class>`` ranges, the classes they are read in.
The engine's code is wrapped, not copied: the server runs as `transformers serve` would.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path

STEP = "continuous_batching_prefill_{}({})_decode_{}({})"
"""One engine step's range: requests and tokens in prefill and in decode (llmadapt.runtime.engine_profile.STEPS)."""
SCHEDULER, SAMPLING = "llmadapt::call::scheduler", "llmadapt::call::sampling"

_shape = threading.local()  # the batch the continuous-batching thread prepared last, for its step's name


def profiler_routes(app, folder: Path) -> None:
    """POST /start_profile and /stop_profile on ``app``; the trace of each start..stop lands in ``folder``."""
    import torch
    from fastapi.responses import JSONResponse

    lock = threading.Lock()
    state: dict = {"profiler": None}

    # Plain functions: FastAPI runs them in its thread pool, so writing the trace does not block the event loop.
    @app.post("/start_profile")
    def start_profile():
        with lock:
            if state["profiler"] is not None:
                return JSONResponse({"error": "the profiler is already running"}, status_code=409)
            # Every thread: requests are served on the event loop's thread, the engine steps on the
            # continuous-batching manager's own, and a profiler started here would otherwise see only this one.
            profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
                experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True))
            profiler.start()
            state["profiler"] = profiler
        return JSONResponse({"status": "started"})

    @app.post("/stop_profile")
    def stop_profile():
        with lock:
            profiler, state["profiler"] = state["profiler"], None
            if profiler is None:
                return JSONResponse({"error": "the profiler is not running"}, status_code=409)
            profiler.stop()
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"hf.{os.getpid()}.{time.time_ns()}.pt.trace.json.gz"
            profiler.export_chrome_trace(str(path))  # gzipped by its name
        return JSONResponse({"trace": str(path)})


def install(folder: Path) -> None:
    """Wrap transformers serve's app factory (the routes) and the continuous-batching steps (the ranges)."""
    import torch
    from transformers.cli.serving import server
    from transformers.generation.continuous_batching import continuous_api, input_outputs, model_runner

    record = torch.profiler.record_function
    build_server = server.build_server

    @functools.wraps(build_server)
    def build_with_profiler(*args, **kwargs):
        app = build_server(*args, **kwargs)
        profiler_routes(app, folder)
        return app

    server.build_server = build_with_profiler  # looked up when `Serve` starts, after this

    prepare_tensors = input_outputs.ContinuousBatchingIOs.prepare_batch_tensors

    @functools.wraps(prepare_tensors)
    def prepare_and_note(self, requests_in_batch, *args, **kwargs):
        # A request decodes once it has a generated token to feed back; until then it prefills (some of) its prompt.
        # Not its status: the scheduler marks a prompt it schedules whole DECODING before its prefill runs. (With
        # asynchronous batching, a GPU's, a request whose prefill is still in flight counts as prefilling.)
        decode = [r for r in requests_in_batch if r.state.generated_len() > 0]
        prefill = [r for r in requests_in_batch if r.state.generated_len() == 0]
        _shape.name = STEP.format(len(prefill), sum(r.query_length for r in prefill),
                                  len(decode), sum(r.query_length for r in decode))
        return prepare_tensors(self, requests_in_batch, *args, **kwargs)

    input_outputs.ContinuousBatchingIOs.prepare_batch_tensors = prepare_and_note

    step = continuous_api.ContinuousBatchingManager._generation_step

    @functools.wraps(step)
    def named_step(self):
        with record(getattr(_shape, "name", STEP.format(0, 0, 0, 0))):
            return step(self)

    continuous_api.ContinuousBatchingManager._generation_step = named_step

    prepare = continuous_api.ContinuousBatchProcessor.prepare_next_batch

    @functools.wraps(prepare)
    def scheduled(self):
        # Only when there is work: idle, the loop asks for a batch every 0.1 s, and those polls are no step's.
        queue = self.input_queue
        if not self.scheduler.has_pending_requests() and (queue is None or queue.empty()):
            return prepare(self)
        with record(SCHEDULER):
            return prepare(self)

    continuous_api.ContinuousBatchProcessor.prepare_next_batch = scheduled

    update = continuous_api.ContinuousBatchProcessor.update_batch

    @functools.wraps(update)
    def updated(self):
        with record("continuous_batching::update_batch"):  # the engine's bookkeeping: its Python, named
            return update(self)

    continuous_api.ContinuousBatchProcessor.update_batch = updated

    sample = model_runner.ModelRunner._sample

    @functools.wraps(sample)
    def sampled(self, *args, **kwargs):
        with record(SAMPLING):
            return sample(self, *args, **kwargs)

    model_runner.ModelRunner._sample = sampled


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[1] != "serve":
        sys.exit("usage: python -m llmadapt.reference.profiled_serve FOLDER serve <transformers serve arguments>")
    install(Path(argv[0]))
    from transformers.cli.transformers import main as transformers_cli

    sys.argv = ["transformers", *argv[1:]]  # the `transformers` command, as the unprofiled server is started
    transformers_cli()


if __name__ == "__main__":
    main()
