"""DeepSpeed's own launcher (the ``deepspeed`` command) as an alternative to torchrun, on one machine.

Pure Python, no torch, no deepspeed: the orchestrator builds the command line and supervises it
like torchrun's. What DeepSpeed's runner does with it (deepspeed 0.19.8, ``deepspeed.launcher.runner``
then ``deepspeed.launcher.launch``), and why each argument is there:

- ``--hostfile RUN_DIR/hostfile`` holding ``localhost slots=N``: the resources are exactly N local
  ranks. Without a hostfile the runner reads ``/job/hostfile`` when a cluster has one (and goes
  multi-node over pdsh/ssh), else counts "accelerators" (on CPU: NUMA nodes, 1 here).
- ``--no_ssh_check``: a hostfile makes the runner ssh to its first host before it sees there is
  only one; with one host it then launches locally (``deepspeed.launcher.launch``), no ssh.
- ``--master_addr 127.0.0.1 --master_port P``: rendezvous on loopback, on the port llmadapt picked.
- ``--no_local_rank``: otherwise each worker gets ``--local_rank=N`` appended to its arguments;
  ``python -m llmadapt.runtime.worker`` takes exactly one (the run directory) and reads its place from the
  environment instead.
- ``--module llmadapt.runtime.worker RUN_DIR``: each rank runs ``python -u -m llmadapt.runtime.worker RUN_DIR`` with
  the same interpreter as the runner (the adapter's environment).

Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (what llmadapt's
``Place.from_env`` and ``init_process_group`` read; its place is labelled "torchrun", the variables
being torchrun's), plus LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, and CUDA_VISIBLE_DEVICES set to the
slot ids (0..N-1) by DeepSpeed's accelerator, whatever the caller had. That last one would undo
``CUDA_VISIBLE_DEVICES=""`` used to keep a run off a GPU, so a CPU run is started under ``env
LLMADAPT_DEVICE=cpu DS_ACCELERATOR=cpu``: the workers and the runner stay on CPU whatever the
launcher sets. Not used: ``--bind_cores_to_rank`` (needs ``numactl``; llmadapt already gives each
rank ``OMP_NUM_THREADS`` = cores / ranks). Every process stays in the launcher's process group, so
stopping that group stops every rank; when a rank fails, DeepSpeed's launch terminates the others
(SIGTERM, recorded by each worker) and exits with the failed rank's code.
"""

from __future__ import annotations

from pathlib import Path

from llmadapt.adapter import RunDir

from .plugin import RUN_FILES


def deepspeed_launch_command(python: str | Path, run_dir: str | Path, world: int, port: int, *,
                             cpu: bool = True, module: str = "llmadapt.runtime") -> list[str]:
    """The command that starts ``world`` ranks of ``python -m MODULE run_dir`` through DeepSpeed's launcher.

    Writes ``run_dir/hostfile`` (``localhost slots=world``), which the command names. ``cpu``: pin the
    runner and the workers to CPU (see the module docstring); pass ``cpu=not cuda_visible()``.
    ``module``: what each rank runs (llmadapt's one worker entry point, which reads the run's kind).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    hostfile = RunDir(run_dir).adapter_file("hostfile", RUN_FILES)
    hostfile.write_text(f"localhost slots={world}\n")
    cmd = [str(python), "-m", "deepspeed.launcher.runner", f"--hostfile={hostfile}", "--no_ssh_check",
           "--master_addr=127.0.0.1", f"--master_port={port}", "--no_local_rank", "--module",
           module, str(run_dir)]
    if cpu:
        cmd = ["env", "LLMADAPT_DEVICE=cpu", "DS_ACCELERATOR=cpu", *cmd]
    return cmd
