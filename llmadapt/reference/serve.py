"""The reference server ``hf``: transformers' own OpenAI-compatible server (`transformers serve`,
continuous batching) on the canonical checkpoint, as a subprocess in the reference environment. With
``serve.profile`` the same command runs under ``llmadapt.reference.profiled_serve`` (a torch profiler in the
engine's process, started and stopped by the client).

Runs in the orchestrator (no torch import here): the engine is the subprocess.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from llmadapt.adapter import LlmadaptError, RunDir, engine_popen_options, stop_engine
from llmadapt.adapter.sse import OpenAICompatibleServer

STOP_GRACE_S = 30.0
CB_NUM_BLOCKS = 64  # blocks of 256 tokens: 16384 tokens of KV cache
CB_MAX_BATCH_TOKENS = 2048


class HFServer(OpenAICompatibleServer):
    supports_ignore_eos = False  # transformers serve rejects ignore_eos: output lengths are recorded, not forced

    def start(self) -> None:
        ctx = self.ctx
        if ctx.workload.serve.url:
            self.proc = None
            return
        cli, base = [str(Path(ctx.python).parent / "transformers")], os.environ
        if ctx.workload.serve.profile:
            # the same command in a launcher that holds the profiler: it imports llmadapt (PYTHONPATH in ctx.env)
            cli = [str(Path(ctx.python).absolute()), "-m", "llmadapt.reference.profiled_serve", str(self.profile_dir())]
            base = ctx.env or os.environ
            self.notes.append("the reference server ran under llmadapt's profiler launcher "
                              "(llmadapt.reference.profiled_serve: transformers serve in one process with a torch "
                              "profiler, its continuous-batching steps wrapped in profiler ranges)")
        env = {**base, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        cmd = [*cli, "serve", str(ctx.checkpoint), "--continuous-batching", "--device", "auto",
               "--host", "127.0.0.1", "--port", str(ctx.port), "--log-level", "warning",
               # a sized KV cache: unsized, transformers sizes it (and its batch) from the device's free memory,
               # which on CPU is the machine's RAM: 17 GB resident on a 23 GB machine, OOM-killed in CI
               "--cb-num-blocks", str(CB_NUM_BLOCKS), "--cb-max-batch-tokens",
               str(ctx.workload.serve.engine.max_batched_tokens or CB_MAX_BATCH_TOKENS)]
        self.log = open(RunDir(ctx.run_dir).engine_log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, **engine_popen_options())
        RunDir(ctx.run_dir).engine_pid.write_text(str(self.proc.pid))  # its own process group, for tools and tests

    def profile_dir(self) -> Path:
        """Where the launcher writes the profiler's traces (absolute: the engine's working folder may differ)."""
        return RunDir(self.ctx.run_dir).engine_profile_dir.absolute()

    async def start_profile(self, session) -> None:
        async with session.post(self.ctx.base_url + "/start_profile", headers=self.headers()) as r:
            if r.status != 200:
                raise LlmadaptError(f"transformers serve did not start its profiler: POST /start_profile answered "
                                    f"HTTP {r.status} (an attached server must run under "
                                    "llmadapt.reference.profiled_serve)")

    async def stop_profile(self, session) -> list[Path]:
        async with session.post(self.ctx.base_url + "/stop_profile", headers=self.headers()) as r:
            if r.status != 200:
                raise LlmadaptError(f"transformers serve did not stop its profiler: POST /stop_profile answered "
                                    f"HTTP {r.status}")
            trace = Path((await r.json())["trace"])  # written before the answer
        return [trace] if trace.is_file() else []

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def model_name(self) -> str:
        """A `transformers serve` started on a model answers only requests that name it as it was started: the
        checkpoint it was given. Attached, that is model.path if the workload has one, else where this machine
        keeps the workload's canonical checkpoint (its /v1/models lists the hub cache, not the pinned model)."""
        if self.ctx.checkpoint is not None:
            return str(self.ctx.checkpoint)
        m = self.ctx.workload.model
        if m.path:
            return m.path
        from llmadapt.adapter import checkpoint_key, state_dir

        return str(state_dir() / "checkpoints" / checkpoint_key(m, self.ctx.workload.seed))

    def stop(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is None:
            return
        stop_engine(proc, STOP_GRACE_S)
        self.log.close()

    def engine_version(self) -> str:
        from importlib import metadata

        try:  # the orchestrator's view; the header's software block has the client side
            return "transformers " + metadata.version("transformers")
        except metadata.PackageNotFoundError:
            return "transformers (see the reference environment)"
