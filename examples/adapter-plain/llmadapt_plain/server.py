"""The `plain` adapter's Server: starts engine.py in the adapter's environment and streams from it through
llmadapt's OpenAI client. Runs in the orchestrator (no torch here): the engine is the subprocess."""

from __future__ import annotations

import subprocess
from pathlib import Path

from llmadapt.adapter import RunDir, engine_popen_options, stop_engine
from llmadapt.adapter.sse import OpenAICompatibleServer

ENGINE = Path(__file__).with_name("engine.py")


class PlainServer(OpenAICompatibleServer):
    supports_ignore_eos = True  # engine.py honours ignore_eos: forced output lengths are exact
    done_required = True  # its streams always end with data: [DONE]

    def start(self) -> None:
        ctx = self.ctx
        if ctx.workload.serve.url:  # attached to an engine already running
            self.proc = None
            return
        run = RunDir(ctx.run_dir)
        self.log = open(run.engine_log, "wb")
        self.proc = subprocess.Popen([ctx.python, str(ENGINE), str(ctx.checkpoint), str(ctx.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, **engine_popen_options())
        run.engine_pid.write_text(str(self.proc.pid))

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        stop_engine(self.proc, 10.0)
        self.log.close()

    def engine_version(self) -> str:
        from . import __version__

        return f"llmadapt-plain engine {__version__}"
