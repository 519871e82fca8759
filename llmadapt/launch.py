"""The orchestrator: check, make the run directory, start workers, supervise them, summarise.

Launchers: ``inline`` (in this process, for embedding and debugging; one rank), ``subprocess``
(one rank in the adapter's environment), ``torchrun`` (several ranks on this machine: gloo on
CPU, NCCL on GPU, 127.0.0.1 and a free port). ``auto`` picks subprocess or torchrun by world
size. Workers run in their own process group; whatever happens (crash, kill, timeout, Ctrl-C)
the group is gone afterwards, and the records made before plus a failure record remain.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from .contract import Failure, JsonlWriter, Summary, read_jsonl, to_json
from .environments import python_for
from .errors import LlmadaptError
from .plugins import check_supported, get_adapter
from .prepare import ensure_checkpoint
from .spec import Workload
from .stats import aggregate

LAUNCHERS = ("auto", "inline", "subprocess", "torchrun")
KILL_GRACE_S = 10.0


@attrs.frozen
class RunResult:
    run_dir: Path
    summary: Summary

    @property
    def ok(self) -> bool:
        return self.summary.status == "ok"

    @property
    def losses(self) -> list[float | None]:
        return self.summary.losses


def make_run_id(adapter: str, workload: Workload) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{adapter}-{workload.content_hash[:8]}-{secrets.token_hex(2)}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    workload: Workload | str | Path,
    adapter: str = "torch",
    *,
    launcher: str = "auto",
    out: str | Path = "runs",
    run_id: str | None = None,
    timeout: float | None = None,
    fault: dict[str, Any] | None = None,
    memory_limit_bytes: int | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:
    """Run one workload on one adapter; returns when the workers are gone, with the summary.

    ``progress`` receives a ``{"type": "start", ...}`` event once the run directory exists,
    then rank 0's records as they are written.

    A failed run is a result (``summary.status == 'failed'`` with its failures), not an
    exception. Exceptions are for bad input, raised before any process starts.
    """
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    info = get_adapter(adapter)
    check_supported(info, workload)
    if launcher not in LAUNCHERS:
        raise LlmadaptError(f"unknown launcher {launcher!r}; known: {', '.join(LAUNCHERS)}")
    world = workload.world_size
    if workload.kind == "serve":
        return _run_serve(workload, info, out, run_id, timeout, progress)
    if launcher == "auto":
        launcher = "torchrun" if world > 1 else "subprocess"
    if launcher in ("inline", "subprocess") and world > 1:
        raise LlmadaptError(f"launcher {launcher!r} runs one rank, but the workload needs world size {world}: "
                            "use --launcher torchrun (or auto)")
    python = None if launcher == "inline" else python_for(info.environment)  # fails before anything is written
    if python is not None:
        ensure_checkpoint(workload, info.environment)

    run_id = run_id or make_run_id(adapter, workload)
    run_dir = Path(out) / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    launch = {
        "run_id": run_id, "adapter": adapter, "framework": info.framework, "role": workload.kind,
        "launcher": launcher, "world_size": world, "workload": workload.to_dict(),
        "workload_hash": workload.content_hash, "fault": fault, "memory_limit_bytes": memory_limit_bytes,
        "python": str(python) if python else None, "created": time.time(),
    }
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=2))
    if progress:
        progress({"type": "start", "run_dir": str(run_dir), "adapter": adapter, "label": workload.label,
                  "world_size": world, "launcher": launcher})

    failures: list[Failure] = []
    interrupted = False
    if launcher == "inline":
        from .runtime import Place, run_worker  # imports torch: only on this path

        # The worker records its own failures; an interrupt is re-raised once the summary is written.
        interrupted = run_worker(run_dir, Place(0, 0, 1, 0, "inline")) == 130
    else:
        cmd = [str(python), "-m", "llmadapt.worker", str(run_dir)]
        if launcher == "torchrun":
            cmd = [str(python), "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={world}",
                   "--rdzv-backend=static", "--node-rank=0", "--master-addr=127.0.0.1",
                   f"--master-port={free_port()}", "--max-restarts=0", "-m", "llmadapt.worker", str(run_dir)]
        try:
            failures += _supervise(cmd, run_dir, world, timeout, memory_limit_bytes, progress)
        except KeyboardInterrupt:
            interrupted = True
            failures.append(Failure(cause="interrupted", message="interrupted (Ctrl-C) in the orchestrator"))

    summary = summarise(run_dir, failures)
    if interrupted:
        raise KeyboardInterrupt
    return RunResult(run_dir=run_dir, summary=summary)


def _run_serve(workload: Workload, info, out, run_id, timeout, progress) -> RunResult:
    from .serving import run_serve

    attach = workload.serve.url is not None
    if not attach and info.environment is None:
        raise LlmadaptError(f"adapter {info.name!r} only attaches to a running engine: set serve.url")
    python = None if attach else python_for(info.environment)  # fails before anything is written
    launcher = "attach" if attach else "subprocess"
    run_id = run_id or make_run_id(info.name, workload)
    run_dir = Path(out) / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    launch = {
        "run_id": run_id, "adapter": info.name, "framework": info.framework, "role": "serve", "launcher": launcher,
        "world_size": 1, "workload": workload.to_dict(), "workload_hash": workload.content_hash,
        "python": str(python) if python else None, "created": time.time(),
    }
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=2))
    if progress:
        progress({"type": "start", "run_dir": str(run_dir), "adapter": info.name, "label": workload.label,
                  "world_size": 1, "launcher": launcher})
    failures: list[Failure] = []
    try:
        failures = run_serve(workload, info, run_id, run_dir, launcher, python, timeout, progress)
    except KeyboardInterrupt:
        summarise(run_dir, [Failure(cause="interrupted", message="interrupted (Ctrl-C) in the orchestrator")])
        raise
    return RunResult(run_dir=run_dir, summary=summarise(run_dir, failures))


def summarise(run_dir: Path, launcher_failures: list[Failure] = ()) -> Summary:
    """(Re)build summary.json from the records on disk; launcher failures are appended to launcher.jsonl."""
    launch = json.loads((run_dir / "launch.json").read_text())
    if launcher_failures:
        with JsonlWriter(run_dir / "launcher.jsonl") as w:
            for f in launcher_failures:
                w.write(f)
    records = load_records(run_dir)
    worker_failed = any(r["type"] == "failure" and r["rank"] is not None for r in records)
    if worker_failed:
        # Keep the launcher's view only where it adds something (timeout, interrupt).
        records = [r for r in records if not (r["type"] == "failure" and r["rank"] is None
                                                 and r["cause"] in ("crash", "killed"))]
    summary = aggregate(launch["run_id"], records, launch)
    (run_dir / "summary.json").write_text(json.dumps(to_json(summary), indent=2))
    return summary


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in sorted(run_dir.glob("rank-*.jsonl")) + [run_dir / "launcher.jsonl"]:
        if path.is_file():
            records += read_jsonl(path)
    return records


def _worker_env(world: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # an orchestrator running under torchrun must not leak its own place
    return env


def _supervise(cmd, run_dir, world, timeout, memory_limit_bytes, progress) -> list[Failure]:
    preexec = None
    if memory_limit_bytes:
        def preexec() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))

    log = open(run_dir / "worker.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(world),
                            start_new_session=True, preexec_fn=preexec)
    deadline = None if timeout is None else time.monotonic() + timeout
    tail = _Tail(run_dir / "rank-00000.jsonl", progress)
    failures: list[Failure] = []
    try:
        while proc.poll() is None:
            tail.poll()
            if deadline is not None and time.monotonic() > deadline:
                _stop_group(proc)
                failures.append(Failure(cause="timeout", message=f"the run exceeded its timeout of {timeout:g} s"))
                break
            time.sleep(0.1)
    except BaseException:
        _stop_group(proc)
        raise
    finally:
        _kill_group(proc)
        log.close()
    tail.poll()
    code = proc.returncode
    if code and not failures:
        failures.append(_exit_failure(code, run_dir / "worker.log"))
    return failures


def _exit_failure(code: int, log: Path) -> Failure:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (SIGKILL: the kernel's out-of-memory killer or an external kill)" if name == "SIGKILL" else ""
        return Failure(cause="killed", message=f"worker killed by {name}{hint}", exit_code=code)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    last = lines[-1][:300] if lines else "no output"
    return Failure(cause="crash", message=f"worker exited with code {code} without a failure record; "
                                          f"last output: {last}", exit_code=code)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the whole group (workers record why they stop), then SIGKILL after a grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class _Tail:
    """Follows rank 0's records as they are flushed, for progress reports."""

    def __init__(self, path: Path, callback) -> None:
        self.path, self.callback, self.offset, self.partial = path, callback, 0, b""

    def poll(self) -> None:
        if self.callback is None or not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        data = self.partial + chunk
        lines = data.split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if line.strip():
                try:
                    self.callback(json.loads(line))
                except json.JSONDecodeError:
                    pass
