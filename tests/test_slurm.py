"""The Slurm launcher, for real: a two-node Slurm on one host (slurm-wlm + munge, started and stopped here).

Both fake nodes run on this machine (slurmd -N n1, slurmd -N n2), but each worker writes its
records to its own node-local folder under /tmp and streams them to the orchestrator: nothing
relies on the run directory being visible to the nodes.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
from test_multinode import single_node  # the same one-node run, once per session

from llmadapt import LlmadaptError, run
from llmadapt.analysis.paritycheck import loss_parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.host import free_port
from llmadapt.launch.slurm import SlurmSettings
from llmadapt.testing import interruptible, standard_workloads

pytest.importorskip("torch")

WORKLOAD = standard_workloads()["train-dp2"]



def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to start slurmctld, slurmd and munged"
    missing = [tool for tool in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(tool)
               and not Path("/usr/sbin", tool).exists()]
    if missing:
        return f"needs Debian's slurm-wlm and munge ({', '.join(missing)} missing): .ci/run installs them"
    return None


SLURM_CONF = """\
ClusterName=llmadapt-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={port1} CPUs=1 RealMemory=4000
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={port2} CPUs=1 RealMemory=4000
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A controller and two slurmd "nodes" on this host; SLURM_CONF points every client at them."""
    if why := _why_not():
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("slurm")
    (folder / "state").mkdir()
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname(), dir=folder, ctld_port=free_port(),
                                      port1=free_port(), port2=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started_munge = _start_munge()
    daemons = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in (
        ["slurmctld", "-D", "-i", "-f", str(conf)],
        ["slurmd", "-D", "-f", str(conf), "-N", "n1"],
        ["slurmd", "-D", "-f", str(conf), "-N", "n2"],
    )]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        for _ in range(120):
            idle = subprocess.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], capture_output=True, text=True)
            if idle.stdout.strip() == "2":
                break
            if any(d.poll() is not None for d in daemons):
                break
            time.sleep(0.25)
        else:
            idle = None
        if idle is None or idle.stdout.strip() != "2":
            log = (folder / "slurmctld.log").read_text()[-2000:] if (folder / "slurmctld.log").exists() else ""
            pytest.fail(f"the two-node Slurm did not come up: {log}")
        yield folder
    finally:
        subprocess.run(["scontrol", "shutdown"], capture_output=True, timeout=30)
        for d in daemons:
            try:
                d.wait(15)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()
        if started_munge:
            started_munge.send_signal(signal.SIGTERM)
            started_munge.wait(10)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def _start_munge():
    """munged, unless one already answers; returns the process we started (None if we reused one)."""
    if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return None
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    proc = subprocess.Popen(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--foreground"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(40):
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return proc
        time.sleep(0.25)
    proc.kill()
    pytest.fail("munged did not start")


@pytest.fixture
def two_nodes(tmp_path):
    """Two nodes, one rank each; each node's own folder (its copy of the records, the job output) under tmp_path."""
    (tmp_path / "nodes").mkdir()
    return SlurmSettings(nnodes=2, ntasks_per_node=1, collect_addr="127.0.0.1", node_dir=str(tmp_path / "nodes"))


def test_two_node_slurm_run_matches_one_node(slurm, two_nodes, tmp_path, tmp_path_factory):
    """sbatch over two nodes: every rank's records reach the run directory, losses equal one node's."""
    events = []
    result = run(WORKLOAD, "torch", launcher="slurm", slurm=two_nodes, out=tmp_path, timeout=300,
                 progress=events.append)
    assert result.ok, (result.summary.failures, (result.run_dir / "slurm.out").read_text())
    report = loss_parity(single_node(WORKLOAD, "torch", tmp_path_factory).losses, result.losses)
    assert report.ok, report.describe(("one node", "slurm, two nodes"))
    headers = [r for p in sorted(result.run_dir.glob("rank-*.jsonl")) for r in read_jsonl(p) if r["type"] == "header"]
    assert sorted(h["node"] for h in headers) == ["n1", "n2"]
    launch = json.loads((result.run_dir / "launch.json").read_text())
    assert [(n["node"], n["ranks"]) for n in launch["nodes"]["seen"]] == [("n1", [0]), ("n2", [1])]
    # The batch script is in the run directory, readable and resubmittable; the nodes kept their own copies.
    script = (result.run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "srun" in script
    node_dir = Path(launch["slurm"]["node_dir"])
    assert sorted(p.name for p in node_dir.glob("rank-*.jsonl")) == ["rank-00000.jsonl", "rank-00001.jsonl"]
    assert any(e.get("type") == "slurm" and e["state"] == "RUNNING" for e in events)


def test_a_rank_killed_on_one_node_stops_the_job_and_keeps_the_records(slurm, two_nodes, tmp_path):
    """Rank 1 (node n2) is SIGKILLed at step 2: both ranks' steps 0-1 are kept, the failure names node and rank."""
    result = run(WORKLOAD, "torch", launcher="slurm", slurm=two_nodes, out=tmp_path, timeout=300,
                 fault={"kind": "kill", "step": 2, "rank": 1})
    assert not result.ok
    assert result.summary.steps_completed == 2
    messages = [f.message for f in result.summary.failures]
    assert any(f.rank == 1 and "[node 1 n2]" in f.message for f in result.summary.failures), messages
    assert any(m.startswith("Slurm job") and "FAILED" in m for m in messages), messages


def test_a_frozen_rank_is_found_by_the_stall_timeout_and_the_job_cancelled(slurm, two_nodes, tmp_path):
    """Rank 1 (node n2) is frozen (SIGSTOP) at step 2: rank 0's records, streamed to the orchestrator, stop; the
    stall timeout cancels the job long before the run's timeout, and the failure says so."""
    result = run(WORKLOAD, "torch", launcher="slurm", slurm=two_nodes, out=tmp_path, timeout=300, stall_timeout=10,
                 fault={"kind": "stop", "step": 2, "rank": 1})
    assert not result.ok
    assert result.summary.steps_completed == 2
    (stall,) = [f for f in result.summary.failures if f.rank is None and f.cause == "timeout"]
    assert stall.message.startswith("no progress for 10 s after step 1 (the stall timeout)"), stall.message
    assert re.search(r": Slurm job \d+ cancelled$", stall.message), stall.message


def test_a_job_that_fails_to_start_is_reported_with_slurms_reason(slurm, two_nodes, tmp_path, monkeypatch):
    """An interpreter missing on the nodes: the job fails at once and the failure carries Slurm's state."""
    monkeypatch.setenv("LLMADAPT_PYTHON_TORCH", "/nonexistent/python")
    # The checkpoint is built before submission with that same interpreter: skip that step here.
    monkeypatch.setattr("llmadapt.launch.runner.ensure_checkpoint", lambda *a: None, raising=False)
    result = run(WORKLOAD, "torch", launcher="slurm", slurm=two_nodes, out=tmp_path, timeout=120)
    assert not result.ok
    (failure,) = [f for f in result.summary.failures if f.rank is None]
    assert failure.message.startswith("Slurm job") and "FAILED (reason: NonZeroExitCode" in failure.message


def test_a_cancelled_job_is_reported_with_slurms_state_and_reason(slurm, two_nodes, tmp_path):
    """A job held in the queue and cancelled from outside: the run ends failed, naming CANCELLED and the reason."""
    def progress(event):
        if event.get("type") == "slurm" and event["state"] == "PENDING":
            subprocess.run(["scancel", event["job_id"]], check=True)

    held = attrs.evolve(two_nodes, options=("--hold",))
    result = run(WORKLOAD, "torch", launcher="slurm", slurm=held, out=tmp_path, timeout=120, progress=progress)
    assert not result.ok
    (failure,) = result.summary.failures
    assert failure.cause == "killed"
    assert re.match(r"Slurm job \d+ ended CANCELLED \(reason: JobHeldUser", failure.message), failure.message


def test_interrupting_the_orchestrator_cancels_the_job(slurm, two_nodes, tmp_path):
    """Ctrl-C in `llmadapt run --launcher slurm`: the job is cancelled and the run says it was interrupted."""
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps(WORKLOAD.to_dict()))
    cmd = [sys.executable, "-m", "llmadapt.cli", "run", str(workload), "--launcher", "slurm", "--nnodes", "2",
           "--collect-addr", "127.0.0.1", "--out", str(tmp_path / "runs"), "--sbatch-option=--hold"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, preexec_fn=interruptible)
    for line in proc.stderr:
        if "PENDING" in line:
            job_id = line.split()[2].rstrip(":")
            break
    proc.send_signal(signal.SIGINT)
    try:  # a guard against a hang, not a time limit: slurmctld answers slowly on a loaded machine
        err = proc.communicate(timeout=300)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the orchestrator did not stop within 300 s of Ctrl-C: {proc.communicate()[1][-2000:]}")
    assert proc.returncode == 130, err
    assert slurm_state(job_id) == "CANCELLED"
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [f["cause"] for f in summary["failures"]] == ["interrupted"]


def slurm_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return re.search(r"JobState=(\S+)", out).group(1)


def test_bad_input_is_one_line_before_anything_is_submitted(slurm, two_nodes, tmp_path):
    """A layout that does not fit the workload, or an option Slurm rejects: one error, nothing written."""
    with pytest.raises(LlmadaptError, match=r"2 nodes x 2 tasks per node = 4 ranks, but the workload's world size "
                                            r"is 2"):
        run(WORKLOAD, "torch", launcher="slurm", slurm=SlurmSettings(nnodes=2, ntasks_per_node=2),
            out=tmp_path / "runs")
    with pytest.raises(LlmadaptError, match=r"^Slurm rejected the job: .*Invalid partition name"):
        run(WORKLOAD, "torch", launcher="slurm", out=tmp_path / "runs",
            slurm=SlurmSettings(nnodes=2, partition="nosuch", collect_addr="127.0.0.1"))
    with pytest.raises(LlmadaptError, match=r"^Slurm rejected the job: .*unrecognized option"):
        run(WORKLOAD, "torch", launcher="slurm", out=tmp_path / "runs",
            slurm=SlurmSettings(nnodes=2, options=("--no-such-option",), collect_addr="127.0.0.1"))
    assert not (tmp_path / "runs").exists()


def test_no_slurm_on_the_machine_is_one_line(two_nodes, tmp_path, monkeypatch):
    """Without sbatch on PATH, the slurm launcher says so before doing anything."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(LlmadaptError, match=r"^launcher 'slurm' needs Slurm's sbatch"):
        run(WORKLOAD, "torch", launcher="slurm", slurm=two_nodes, out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_a_sweep_runs_as_a_job_array_and_resumes_after_the_job_is_killed(slurm, tmp_path):
    """Four cells, one per array task, on the two nodes. The array is cancelled once a cell is done: the cell files
    say what was done; running the sweep again submits only the cells not done, and the finished cell's run is
    kept, not run again."""
    import threading

    from llmadapt.experiments import sweep as sweeps

    sweep_file = tmp_path / "grid.toml"
    sweep_file.write_text(
        f'workload = "{Path(__file__).resolve().parents[1] / "examples" / "tiny-llama.toml"}"\n'
        'adapters = ["torch"]\nset = ["train.steps=3", "train.warmup_steps=0", "telemetry.interval_s=0"]\n'
        '[matrix]\n"seed" = [1, 2, 3, 4]\n')
    out = tmp_path / "runs"
    sweep = sweeps.load(sweep_file, out)
    assert len(sweep.cells) == 4 and len({c.id for c in sweep.cells}) == 4
    assert [c.id for c in sweeps.load(sweep_file, out).cells] == [c.id for c in sweep.cells]  # stable ids
    messages: list[str] = []
    submitted = threading.Thread(target=sweeps.run_on_slurm, args=(sweep, []), kwargs={"log": messages.append})
    submitted.start()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not any(s == "done" for _, s, _ in sweep.status("slurm:llmadapt-test")):
        time.sleep(0.5)
    job = (sweep.folder / "slurm-job").read_text().strip()
    subprocess.run(["scancel", job], check=True)
    submitted.join(120)
    states = [s for _, s, _ in sweep.status("slurm:llmadapt-test")]
    assert "done" in states and states != ["done"] * 4, states
    first_done = {c.id: st["attempts"][-1]["run_dir"] for c, s, st in sweep.status("slurm:llmadapt-test")
                  if s == "done"}
    again = sweeps.run_on_slurm(sweeps.load(sweep_file, out), [], log=messages.append)
    assert again and again != job
    array = (sweep.folder / "sweep.sbatch").read_text()
    todo = [str(i) for i, c in enumerate(sweep.cells) if c.id not in first_done]
    assert f"#SBATCH --array={','.join(todo)}" in array  # only what was not done
    final = sweep.status("slurm:llmadapt-test")
    assert [s for _, s, _ in final] == ["done"] * 4, [(c.title, st) for c, _, st in final]
    for c, _, st in final:
        if c.id in first_done:
            assert st["attempts"][-1]["run_dir"] == first_done[c.id] and len(st["attempts"]) == 1
        assert st["machine"] == "slurm:llmadapt-test" and st["node"] in ("n1", "n2")


def test_a_job_killed_by_a_signal_records_the_signal():
    """Slurm's ExitCode is 'status:signal': a job killed by SIGKILL reads '0:9', its failure's exit_code is -9 (as a
    process killed by a signal reads everywhere else), not 0."""
    from llmadapt.launch.slurm import final_failures

    (killed,) = final_failures("7", {"state": "FAILED", "reason": "", "exit_code": "0:9"}, None)
    assert killed.exit_code == -9
    (exited,) = final_failures("8", {"state": "FAILED", "reason": "NonZeroExitCode", "exit_code": "3:0"}, None)
    assert exited.exit_code == 3


def test_a_tune_runs_each_rounds_probes_as_one_job_array(slurm, tmp_path):
    """A two-candidate tune (recomputation the one axis left) over the two-node Slurm: each round's probes are one
    job array through the sweep machinery, the round's results are read back before the next round is decided, the
    answer has the local tune's shape, and a resumed tune runs nothing again."""
    from llmadapt.experiments.tune import tune
    from llmadapt.spec import Workload

    w = Workload.from_file(Path(__file__).resolve().parents[1] / "examples" / "tiny-llama.toml").with_overrides(
        ["train.steps=3", "train.warmup_steps=1", "train.seq_len=32", "train.global_batch=4"])
    fixed = ("parallelism.tp", "parallelism.pp", "parallelism.dp", "train.micro_batch", "optimizations.flash_attention")
    options = dict(ranks=1, fixed=fixed, budget_s=600, max_runs=2, log=lambda m: None)
    local = tune(w, ["torch"], out=tmp_path / "local", **options)
    over = tune(w, ["torch"], out=tmp_path / "slurm", slurm=[], **options)
    assert {r["label"] for r in over.rows} == {r["label"] for r in local.rows} == {"torch dp1",
                                                                                   "torch dp1 recompute=full"}
    assert set(over.to_dict()) == set(local.to_dict())
    assert [r.adapter for r in over.ranking] == [r.adapter for r in local.ranking] == ["torch"]
    best = over.ranking[0]
    assert Workload.from_file(best.workload_file).problem_hash == w.problem_hash
    assert best.parity == "the reference" or best.parity.startswith("ok"), best.parity
    folder = Path(over.folder)
    state = json.loads((folder / "tune.json").read_text())
    arrays = sorted(folder.glob("probes-*.json"))
    runs = [r["runs"] for r in over.rows]
    # round 1: both candidates in one array; round 2 (both standing, or one dropped): the survivors in another
    assert len(arrays) == max(runs) and len(state["probes"]) == sum(runs) == over.probes
    for p in state["probes"]:
        launch = json.loads((Path(p["run_dir"]) / "launch.json").read_text())
        assert p["summary"]["status"] == "ok" and p["wall_s"] > 0 and launch["adapter"] == "torch"
    sweeps = sorted((tmp_path / "slurm").glob("sweep-probes-*/sweep.sbatch"))
    assert len(sweeps) == len(arrays)
    assert "#SBATCH --array=0,1" in sweeps[0].read_text() or "#SBATCH --array=0,1" in sweeps[-1].read_text()
    cells = [json.loads(f.read_text()) for f in (tmp_path / "slurm").glob("sweep-probes-*/cells/*.json")]
    assert len(cells) == sum(runs) and all(c["machine"] == "slurm:llmadapt-test" and c["node"] in ("n1", "n2")
                                           for c in cells)

    again = tune(w, ["torch"], out=tmp_path / "slurm", slurm=[], resume=folder, **options)
    assert len(json.loads((folder / "tune.json").read_text())["probes"]) == len(state["probes"])
    assert [r.label for r in again.ranking] == [r.label for r in over.ranking]
