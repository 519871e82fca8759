"""The Slurm launcher: one batch script per run, submitted with sbatch, or run with srun inside an allocation.

The script is self-contained and written to the run directory (``job.sbatch``) so that it can
be read and resubmitted by hand: it carries the run's launch record in ``LLMADAPT_LAUNCH``
(nodes need not see the orchestrator's disk) and ``srun`` starts one worker per rank, each of
which finds its place from Slurm's variables and streams its records to the orchestrator
(llmadapt.launch.collect). Options are checked with ``sbatch --test-only`` before anything is submitted.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.adapter.declaration import EnvironmentSpec
from llmadapt.contract.launch import LaunchRequest, SlurmJob
from llmadapt.contract.records import Failure
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.launch.collect import Collector
from llmadapt.launch.settings import NodeSettings, warn
from llmadapt.launch.supervise import LogTail, supervise, worker_command, worker_env

# Final states and how they map onto the contract's failure causes.
_CAUSES = {"CANCELLED": "killed", "TIMEOUT": "timeout", "DEADLINE": "timeout", "OUT_OF_MEMORY": "oom",
           "PREEMPTED": "killed", "NODE_FAIL": "crash", "BOOT_FAIL": "crash", "FAILED": "crash"}


_ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
           "STAGE_OUT", "STOPPED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}


CANCEL_GRACE_S = 15.0


@attrs.frozen
class SlurmSettings:
    """Where and how the job runs; the names are sbatch's."""

    nnodes: int = 1
    """sbatch --nodes."""
    ntasks_per_node: int | None = None
    """sbatch --ntasks-per-node; default: the workload's world size / nnodes."""
    partition: str | None = None
    time: str | None = None
    """sbatch --time, e.g. 30 or 1:00:00."""
    options: tuple[str, ...] = ()
    """Further sbatch options, e.g. ("--account=abc", "--gres=gpu:8", "--exclusive")."""
    collect_addr: str | None = None
    """This machine's address as the compute nodes reach it (records are sent there); default: its hostname."""
    master_port: int = 29500
    """Port of the rendezvous on the first node of the allocation."""
    node_dir: str = "/tmp"
    """A node-local folder on every node: each keeps its own copy of its records there, and the job's output."""
    output: str | None = None
    """sbatch --output; default: a file in node_dir on the first node, copied into the run directory when readable."""

    def tasks_per_node(self, world: int) -> int:
        if self.nnodes < 1:
            raise LlmadaptError(f"--nnodes must be at least 1, got {self.nnodes}")
        per_node = self.ntasks_per_node or world // self.nnodes
        if per_node < 1 or per_node * self.nnodes != world:
            raise LlmadaptError(f"{self.nnodes} nodes x {per_node} tasks per node = {self.nnodes * per_node} ranks, "
                                f"but the workload's world size is {world}: choose --nnodes and --ntasks-per-node "
                                "to match")
        return per_node


def require_slurm() -> None:
    if shutil.which("sbatch") is None:
        raise LlmadaptError("launcher 'slurm' needs Slurm's sbatch, srun and squeue, and this machine has no sbatch "
                            "on PATH: run on a login node of the cluster (or install Slurm's client tools)")


def in_allocation() -> bool:
    """True inside salloc/sbatch: the launcher then runs srun itself instead of submitting a job."""
    return bool(os.environ.get("SLURM_JOB_ID"))


def batch_script(settings: SlurmSettings, *, run_id: str, per_node: int, command: list[str],
                 env: dict[str, str], output: str) -> str:
    """The batch script: sbatch options, the rendezvous address, the worker command under srun."""
    opts = [f"--job-name=llmadapt-{run_id}", f"--nodes={settings.nnodes}", f"--ntasks-per-node={per_node}",
            f"--output={output}"]
    if settings.partition:
        opts.append(f"--partition={settings.partition}")
    if settings.time:
        opts.append(f"--time={settings.time}")
    opts += settings.options
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
             f"# llmadapt run {run_id}, written by the slurm launcher. Resubmit with: sbatch <this file>",
             "# Records stream to the orchestrator at LLMADAPT_COLLECT and stay on each node in the folder given to",
             "# llmadapt.runtime.worker; without an orchestrator listening, delete the LLMADAPT_COLLECT line.",
             "set -euo pipefail",
             'first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             "# The first node's address as Slurm knows it (NodeAddr): its hostname may resolve to loopback.",
             'export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show node "$first_node" | '
             "sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')}",
             f"export MASTER_PORT={settings.master_port}",
             "# One thread per rank unless told otherwise, as torchrun does.",
             "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(shlex.join(command))
    return "\n".join(lines) + "\n"


def check(script: str, env: dict[str, str]) -> None:
    """Ask Slurm whether it would accept the job (sbatch --test-only), without submitting it."""
    proc = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True, env=env,
                          timeout=60)
    if proc.returncode != 0:
        raise LlmadaptError(f"Slurm rejected the job: {_first_error(proc.stderr or proc.stdout)}")


def _first_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "unrecognized" in line or "invalid" in line.lower()]
    return (errors or lines or ["no output"])[-1]


def submit(script_path: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True, env=env,
                          timeout=60)
    if proc.returncode != 0:
        raise LlmadaptError(f"sbatch failed: {_first_error(proc.stderr or proc.stdout)}")
    return proc.stdout.strip().split(";")[0]


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=60)


def job_state(job_id: str) -> dict[str, str]:
    """{'state', 'reason', 'exit_code'} from squeue while queued, else scontrol, else sacct; state '' if unknown."""
    proc = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0 and proc.stdout.strip():
        state, _, reason = proc.stdout.strip().splitlines()[0].partition("|")
        if state in _ACTIVE:
            return {"state": state, "reason": reason, "exit_code": ""}
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0 and "JobState=" in proc.stdout:
        fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
        return {"state": fields.get("JobState", ""), "reason": fields.get("Reason", ""),
                "exit_code": fields.get("ExitCode", "")}
    proc = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,ExitCode,Reason"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode == 0 and proc.stdout.strip():
        state, exit_code, reason = (proc.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        return {"state": state.split()[0], "reason": reason, "exit_code": exit_code, "detail": state}
    return {"state": "", "reason": "", "exit_code": ""}


def follow(job_id: str, *, timeout: float | None, output: Path | None, poll_s: float = 0.5,
           progress: Callable[[dict[str, Any]], None] | None = None, on_poll: Callable[[], None] = lambda: None,
           should_stop: Callable[[], Failure | None] = lambda: None) -> list[Failure]:
    """Wait for the job to end, reporting its state changes; cancel it on timeout, interrupt, or when
    ``should_stop`` names a failure (a stalled run)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last = None
    try:
        while True:
            on_poll()
            info = job_state(job_id)
            if (info["state"], info["reason"]) != last and progress:
                progress({"type": "slurm", "job_id": job_id, "state": info["state"], "reason": info["reason"]})
            last = (info["state"], info["reason"])
            if info["state"] not in _ACTIVE:
                break
            if deadline is not None and time.monotonic() > deadline:
                _cancel_and_wait(job_id)
                return [Failure(cause="timeout", message=f"the run exceeded its timeout of {timeout:g} s: "
                                                         f"Slurm job {job_id} cancelled")]
            if (stopped := should_stop()) is not None:
                _cancel_and_wait(job_id)
                return [attrs.evolve(stopped, message=f"{stopped.message}: Slurm job {job_id} cancelled")]
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _cancel_and_wait(job_id)
        raise
    return final_failures(job_id, info, output)


def _cancel_and_wait(job_id: str) -> None:
    cancel(job_id)
    deadline = time.monotonic() + CANCEL_GRACE_S
    while time.monotonic() < deadline and job_state(job_id)["state"] in _ACTIVE:
        time.sleep(0.5)


def final_failures(job_id: str, info: dict[str, str], output: Path | None) -> list[Failure]:
    """The launcher's view of a finished job: nothing when Slurm says COMPLETED, else Slurm's state and reason."""
    state = info["state"]
    if state == "COMPLETED":
        return []
    tail = ""
    if output is not None and output.is_file():
        lines = [line for line in output.read_text(errors="replace").splitlines() if line.strip()]
        tail = f"; last output: {lines[-1][:300]}" if lines else ""
    if not state:
        return [Failure(cause="crash", message=f"Slurm job {job_id} ended, but Slurm no longer knows how{tail}")]
    detail = info.get("detail") or state
    code = info["exit_code"]
    message = f"Slurm job {job_id} ended {detail} (reason: {info['reason'] or 'none'}, exit code {code or '?'}){tail}"
    # Slurm's ExitCode is "status:signal": a job killed by a signal has status 0 and the signal after the colon
    status, _, sig = code.partition(":")
    exit_code = -int(sig) if sig.isdigit() and int(sig) else int(status) if status.isdigit() else None
    return [Failure(cause=_CAUSES.get(state, "crash"), message=message, exit_code=exit_code)]


# Variables the batch script sets itself, so that a resubmitted script behaves the same.
_JOB_VARS = ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONUNBUFFERED", "TOKENIZERS_PARALLELISM",
             "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "LLMADAPT_DEVICE", "LLMADAPT_HOME", "PYTHONPATH")


def slurm_job(settings: SlurmSettings, launch: LaunchRequest, python, environment: EnvironmentSpec, per_node: int,
               collector: Collector, progress) -> tuple[dict[str, Any], LaunchRequest]:
    """The batch script for this run, checked by Slurm (sbatch --test-only) before anything is written, and the
    launch request that records the job."""
    addr = settings.collect_addr
    if addr is None:
        addr = socket.gethostbyname(socket.gethostname())
        if addr.startswith("127."):
            warn(f"this host's name resolves to {addr}: compute nodes on other machines cannot send records "
                  "there; set --collect-addr to this machine's address on the cluster network", progress)
    run_id = launch.run_id
    output = settings.output or f"{settings.node_dir}/llmadapt-{run_id}-%j.out"
    submit_env = worker_env(per_node, environment)
    if "OMP_NUM_THREADS" not in os.environ:
        submit_env.pop("OMP_NUM_THREADS")  # this machine's core count says nothing about the nodes': the script picks
    env = {k: v for k, v in submit_env.items() if k in _JOB_VARS}
    env.update(LLMADAPT_COLLECT=f"{addr}:{collector.port}", LLMADAPT_LAUNCH=json.dumps(launch.to_json()))
    worker_dir = f"{settings.node_dir}/llmadapt-{run_id}"
    script = batch_script(settings, run_id=run_id, per_node=per_node, output=output, env=env,
                                 command=worker_command("slurm", python, worker_dir, per_node=per_node,
                                                        nodes=NodeSettings(nnodes=settings.nnodes)))
    if not in_allocation():
        check(script, submit_env)
    launch = attrs.evolve(launch, slurm=SlurmJob(nnodes=settings.nnodes, ntasks_per_node=per_node,
                                                 script=RunDir.SLURM_SCRIPT, node_dir=worker_dir, output=output))
    return {"script": script, "env": submit_env, "output": output}, launch


def run_slurm_job(job: dict[str, Any], run_dir: Path, timeout, memory_limit_bytes, progress,
                  should_stop: Callable[[], Failure | None] = lambda: None) -> list[Failure]:
    script = RunDir(run_dir).slurm_script
    script.write_text(job["script"])
    tail = RunDir(run_dir).rank_file(0)
    if in_allocation():  # inside salloc/sbatch: run the script here, its srun uses the allocation
        return supervise(["bash", str(script)], env=job["env"], log=RunDir(run_dir).slurm_out, tail=tail,
                          timeout=timeout, memory_limit_bytes=memory_limit_bytes, progress=progress,
                          should_stop=should_stop)
    job_id = submit(script, job["env"])
    launch = RunDir(run_dir).read_launch()
    RunDir(run_dir).write_launch(attrs.evolve(launch, slurm=attrs.evolve(launch.slurm, job_id=job_id)))
    output = Path(job["output"].replace("%j", job_id))
    tailer = LogTail(tail, progress)
    try:
        return follow(job_id, timeout=timeout, output=output, progress=progress, on_poll=tailer.poll,
                      should_stop=should_stop)
    finally:
        tailer.poll()
        if output.is_file():  # readable here when the first node is this host, or on a shared disk
            RunDir(run_dir).slurm_out.write_bytes(output.read_bytes())
