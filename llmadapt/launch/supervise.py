"""Workers as processes: their command lines and environments, supervision (timeouts, memory limits,
stop signals), how an exit code is read as a failure, and making sure nothing a run started outlives it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from llmadapt.adapter.declaration import EnvironmentSpec
from llmadapt.contract.readback import died_unrecorded
from llmadapt.contract.records import Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.contract.schema import to_json
from llmadapt.errors import LlmadaptError, Terminated
from llmadapt.host import exit_cause, exit_text, free_port, node_name
from llmadapt.launch.environments import process_env
from llmadapt.launch.settings import NodeSettings
from llmadapt.runtime import lifecycle

KILL_GRACE_S = 10.0


WORKER_MODULE = "llmadapt.runtime"
"""What every worker process runs: ``python -m llmadapt.runtime RUN_DIR``."""


def worker_command(launcher: str, python: Path | str, worker_dir: Path | str, *, per_node: int = 1,
                   nodes: NodeSettings | None = None, module: str | None = None) -> list[str]:
    """The command that starts one node's workers: the one place that maps a launcher to a command line. Each rank
    runs the one worker entry point, which picks its kind from the launch record (llmadapt.runtime.kinds).
    ``module``: deprecated (the entry point is one now; its old names still run it), removed in 0.3.0."""
    if module is not None:
        import warnings

        warnings.warn("worker_command's module is deprecated and will be removed in 0.3: every worker starts as "
                      f"{WORKER_MODULE}, which picks its kind from the launch record", DeprecationWarning, stacklevel=2)
    worker = ["-m", module or WORKER_MODULE, str(worker_dir)]
    if launcher == "subprocess":
        return [str(python), *worker]
    nodes = nodes or NodeSettings()
    if launcher == "slurm":  # inside the batch script: one task per rank, on every node
        return ["srun", "--kill-on-bad-exit=1", f"--nodes={nodes.nnodes}", f"--ntasks-per-node={per_node}",
                str(python), *worker]
    if launcher == "torchrun":
        cmd = [str(python), "-m", "torch.distributed.run", f"--nnodes={nodes.nnodes}",
               f"--nproc-per-node={per_node}", "--max-restarts=0"]
        if nodes.rdzv_endpoint:
            # is_host named explicitly: torchrun would guess it from the hostname, which may resolve to loopback.
            cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.rdzv_endpoint}",
                    f"--rdzv-id=llmadapt-{nodes.rendezvous()[1]}",
                    f"--rdzv-conf=is_host={int(nodes.node_rank == 0)}"]
        elif nodes.nnodes == 1 and nodes.master_addr is None:
            cmd += ["--rdzv-backend=static", "--node-rank=0", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        else:
            master_addr, master_port = nodes.rendezvous()
            cmd += ["--rdzv-backend=static", f"--node-rank={nodes.node_rank}", f"--master-addr={master_addr}",
                    f"--master-port={master_port}"]
        if nodes.local_addr:
            cmd.append(f"--local-addr={nodes.local_addr}")
        return cmd + worker
    raise LlmadaptError(f"launcher {launcher!r} has no worker command")


def interrupt_text(exc: BaseException) -> str:
    """How an interrupt is named in failure records: which signal stopped the orchestrator."""
    return str(exc) if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"


def default_threads(ranks_per_node: int) -> int:
    """The CPU threads a rank gets when nothing says otherwise: OMP_NUM_THREADS where exported, else this node's
    cores (those this process may use) shared among its ranks."""
    exported = os.environ.get("OMP_NUM_THREADS", "")
    if exported.isdigit() and int(exported) > 0:
        return int(exported)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // ranks_per_node)


def worker_env(world: int, environment: EnvironmentSpec, threads: int = 0) -> dict[str, str]:
    """What every worker process starts with; PYTHONPATH names our sources (environments.process_env).
    ``threads``: each rank's CPU threads (workload.parallelism.threads_per_rank; 0: ``default_threads``)."""
    env = process_env(environment)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("OMP_NUM_THREADS", str(default_threads(world)))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LLMADAPT_COLLECT",
                "LLMADAPT_LAUNCH"):
        env.pop(var, None)  # an orchestrator running under torchrun must not leak its own place
    env.update(lifecycle.orchestrator_env(node_name()))  # workers end themselves if this process dies
    return env


def supervise(cmd, *, env, log: Path, tail: Path | None, timeout, memory_limit_bytes, progress,
               should_stop: Callable[[], Failure | None] = lambda: None) -> list[Failure]:
    """Run one process group to its end; stop it on timeout, or when ``should_stop`` names a failure elsewhere."""
    preexec = None
    if memory_limit_bytes:
        def preexec() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))

    token = secrets.token_hex(8)
    env = {**env, lifecycle.RUN_TOKEN_VAR: token}
    log_file = open(log, "wb")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, preexec_fn=preexec)
    deadline = None if timeout is None else time.monotonic() + timeout
    # The tailed rank's failure records are held back until the group has ended: a peer that died without a word
    # (killed, exited) is the story's start, and its line comes first on the console; this rank's then.
    held: list[dict] = []

    def forward(record: dict) -> None:
        if record.get("type") == "failure":
            held.append(record)
        else:
            progress(record)

    tailer = LogTail(tail, forward if tail and progress else None)
    failures: list[Failure] = []
    try:
        while proc.poll() is None:
            tailer.poll()
            if deadline is not None and time.monotonic() > deadline:
                _stop_group(proc)
                failures.append(Failure(cause="timeout", message=f"the run exceeded its timeout of {timeout:g} s"))
                break
            if (elsewhere := should_stop()) is not None:
                _stop_group(proc)
                failures.append(elsewhere)
                break
            time.sleep(0.1)
    except BaseException:
        _stop_group(proc)
        _release(held, [], progress, tailer, log.parent)
        raise
    finally:
        _kill_group(proc)
        kill_tagged(token)
        log_file.close()
    code = proc.returncode
    if code and not failures:
        failures += _exit_failures(code, log)
    _release(held, failures, progress, tailer, log.parent)
    return failures


def _release(held: list[dict], failures: list[Failure], progress, tailer: LogTail, folder: Path) -> None:
    """The ranks that died without a failure record of their own first, then the tailed rank's held failures."""
    tailer.poll()
    if progress:
        for f in failures:
            if died_unrecorded(to_json(f)) and not _recorded_failure(RunDir(folder).rank_file(f.rank)):
                progress(to_json(f))
        for record in held:
            progress(record)
    held.clear()




# torchrun's report of each failed rank (torch.distributed.elastic's ChildFailedError, the same since 1.9).
_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)",
                            re.MULTILINE)


def _exit_failures(code: int, log: Path) -> list[Failure]:
    """What a non-zero exit of the launched process says: per rank where torchrun names them (with the step each
    was in, from its records), else one line."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    ranks: dict[int, Failure] = {}
    for rank, exit_code, pid in _TORCHRUN_RANK.findall(text):
        rank, exit_code = int(rank), int(exit_code)
        if rank in ranks:
            continue
        step, where = _where(RunDir(log.parent).rank_file(rank))
        ranks[rank] = Failure(cause=exit_cause(exit_code), rank=rank, exit_code=exit_code, step=step,
                              message=f"rank {rank} (pid {pid}) {exit_text(exit_code)}{where}{_kill_hint(exit_code)}, "
                                      "without a failure record")
    if ranks:
        return [ranks[r] for r in sorted(ranks)]
    if code < 0:
        return [Failure(cause="killed", message=f"worker {exit_text(code)}{_kill_hint(code)}", exit_code=code)]
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1][:300] if lines else "no output"
    return [Failure(cause="crash", message=f"worker {exit_text(code)} without a failure record; "
                                           f"last output: {last}", exit_code=code)]



def _recorded_failure(rank_file: Path) -> bool:
    from llmadapt.contract.jsonl import read_jsonl

    try:
        return any(r.get("type") == "failure" for r in read_jsonl(rank_file, check=False))
    except (OSError, ValueError):
        return False


def _where(rank_file: Path) -> tuple[int | None, str]:
    """Where a rank was when it died, from its records: the step after its last step record (' at step 5'),
    before its first, or after its end record; nothing where it has no records."""
    from llmadapt.contract.jsonl import read_jsonl

    try:
        records = read_jsonl(rank_file, check=False)
    except (OSError, ValueError):
        return None, ""
    if any(r.get("type") == "end" for r in records):
        return None, " after its last record"
    steps = [r["step"] for r in records if r.get("type") == "step" and isinstance(r.get("step"), int)]
    if not steps:
        return None, " before its first step ended"
    return max(steps) + 1, f" at step {max(steps) + 1}"


def _kill_hint(code: int) -> str:
    return " (the kernel's out-of-memory killer or an external kill)" if code == -signal.SIGKILL else ""


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


def kill_tagged(token: str) -> int:
    """SIGKILL every process whose environment carries this launch's token; returns how many were found.

    The process group is not enough: torchrun starts each rank in a session of its own, so a rank that
    outlives torchrun (stopped with SIGSTOP, or deaf to SIGTERM inside a collective) is in no group of
    ours. Every process a launch starts inherits the token, whatever its session or parent.
    """
    needle = f"{lifecycle.RUN_TOKEN_VAR}={token}".encode() + b"\0"
    found = 0
    for _ in range(5):  # a process may fork while we look: look again until nothing is left
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if needle in (entry / "environ").read_bytes() + b"\0":
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        found += len(pids)
        time.sleep(0.05)
    return found


class LogTail:
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


class StallWatch:
    """Stops a training run that has stopped moving: rank 0 wrote no step (or evaluation) record for ``seconds``,
    between its first step and its last. A hung collective or a stopped peer holds rank 0 too, so rank 0's records
    are enough. Start-up (imports, model build, compilation) and what follows the last step (the final evaluation, a
    save) are the run timeout's to bound: their length does not scale with a step's."""

    PROGRESS = ("step", "evaluation")

    def __init__(self, seconds: float, rank_file: Path, last_step: int) -> None:
        self.seconds, self.last_step = seconds, last_step
        self.tail = LogTail(rank_file, self._see)
        self.step: int | None = None
        self.since: float | None = None

    def _see(self, record: dict) -> None:
        if record.get("type") in self.PROGRESS:
            self.since = time.monotonic()
            if record.get("type") == "step" and isinstance(record.get("step"), int):
                self.step = record["step"]

    def check(self) -> Failure | None:
        """A failure once the stall has lasted ``seconds`` (supervise's ``should_stop``), else None."""
        self.tail.poll()
        if self.step is None or self.step >= self.last_step or time.monotonic() - self.since <= self.seconds:
            return None
        return Failure(cause="timeout", step=self.step + 1,
                       message=f"no progress for {self.seconds:g} s after step {self.step} (the stall timeout): a "
                               "hung collective or a stopped rank holds the run")
