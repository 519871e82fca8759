"""Does the run store scale to a team's history? Indexing, reopening, queries and `llmadapt runs` over 10,000 runs.

One small real run is made with `llmadapt.run` (tiny-llama, torch, 2 steps; or --template names a run folder),
then copied --runs times under a new root, each copy with its own run id, creation time, adapter and workload name
in launch.json and summary.json (records copied as they are), so that queries can select among them, and its own
workload (seed and hash; --workloads K: K workloads in turn, as repeats make). Measured, in this process unless
said otherwise:

- first indexing: ``RunStore(root)`` on the new root (every folder new);
- reopening with nothing changed: ``RunStore(root)`` again (median of --repeat);
- a query matching one run (``run=ID``) and one matching all, each with its open (median of --repeat);
- a full rescan: ``RunStore(root, rescan=True)`` (every folder's fingerprint again);
- ``llmadapt runs --root ROOT`` (the newest 50) and ``--all``, as subprocesses (interpreter start included).

    python benchmarks/store_scale.py                   # 10,000 runs
    python benchmarks/store_scale.py --runs 2000 --json
    python benchmarks/store_scale.py --smoke           # 100 runs (CI's smoke pass, seconds)

Not a test: it prints figures, with the load average, and asserts only that each query found what it should.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ("torch", "deepspeed", "megatron", "colossalai", "plain")
TINY = ["train.seq_len=32", "train.global_batch=2", "train.micro_batch=2", "train.steps=2", "train.warmup_steps=1",
        "telemetry.interval_s=0", "parallelism.threads_per_rank=1"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10_000, help="run folders to generate (default 10000)")
    p.add_argument("--workloads", type=int,
                   help="distinct workloads among the runs (default: one per run, the indexer's worst case: it "
                        "builds each workload once)")
    p.add_argument("--repeat", type=int, default=5, help="timed repeats of each reopening and query (default 5)")
    p.add_argument("--template", type=Path, help="a run folder to copy (default: make one with llmadapt.run)")
    p.add_argument("--work", type=Path, help="folder for the generated runs (default: a temporary one, removed)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest size (100 runs, 1 repeat; flags given explicitly still count): a pass that "
                        "shows the script works, in seconds; its figures mean little")
    args = p.parse_args(argv)
    if args.smoke:
        p.set_defaults(runs=100, repeat=1)
        args = p.parse_args(argv)
    args.workloads = args.runs if args.workloads is None else args.workloads
    if min(args.runs, args.repeat, args.workloads) < 1:
        p.error("--runs, --repeat and --workloads must be at least 1")
    return args


def make_template(work: Path) -> Path:
    from llmadapt import Workload, run

    workload = Workload.from_file(ROOT / "examples" / "tiny-llama.toml").with_overrides(TINY)
    result = run(workload, "torch", out=work / "template")
    if not result.ok:
        raise SystemExit(f"the template run failed: {result.run_dir}")
    return Path(result.run_dir)


def generate(template: Path, root: Path, n: int, workloads: int) -> list[str]:
    """n copies of the template under root: run ids, times (a minute apart, newest last), adapters and names
    varied, and the workload (its seed, and so its hash) one of ``workloads``. Returns the run ids, oldest first."""
    from llmadapt.contract.rundir import RunDir

    files = RunDir(template)
    launch, summary = json.loads(files.launch_file.read_text()), json.loads(files.summary_file.read_text())
    others = [p for p in template.iterdir() if p not in (files.launch_file, files.summary_file)]
    start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc).timestamp()
    root.mkdir(parents=True)
    ids = []
    for i in range(n):
        adapter = ADAPTERS[i % len(ADAPTERS)]
        run_id = f"2026-gen-{i:06d}-{adapter}"
        folder = root / run_id
        folder.mkdir()
        k = i % workloads
        digest = hashlib.sha256(f"{summary['workload_hash']}-{k}".encode()).hexdigest()[:len(summary["workload_hash"])]
        launch.update(run_id=run_id, adapter=adapter, created=start + 60 * i, workload_hash=digest)
        launch["workload"] = {**launch["workload"], "name": f"team-{i % 100}", "seed": k}
        copy = {**summary, "run_id": run_id, "adapter": adapter, "workload_hash": digest}
        RunDir(folder).launch_file.write_text(json.dumps(launch, indent=2))
        RunDir(folder).summary_file.write_text(json.dumps(copy, indent=2))
        for path in others:
            if path.is_dir():
                shutil.copytree(path, folder / path.name)
            else:
                shutil.copyfile(path, folder / path.name)
        ids.append(run_id)
    return ids


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    """Median seconds of fn() over repeat calls, and its last result."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def measure(root: Path, ids: list[str], repeat: int) -> dict[str, object]:
    from llmadapt.analysis.store import RunStore

    def open_store(**kw):
        with RunStore(root, **kw) as store:
            return store.count()

    def query(text):
        def go():
            with RunStore(root) as store:
                return store.runs(text)
        return go

    out: dict[str, object] = {}
    out["index_s"], count = timed(open_store)
    assert count == len(ids), f"indexed {count} of {len(ids)}"
    out["reopen_s"], _ = timed(open_store, repeat)
    one = ids[len(ids) // 2]
    out["query_one_s"], found = timed(query(f"run={one}"), repeat)
    assert [r.run_id for r in found] == [one], found
    out["query_name_s"], found = timed(query("workload=team-7 adapter=megatron"), repeat)
    assert all(r.row["name"] == "team-7" and r.adapter == "megatron" for r in found) and found
    out["query_field_s"], found = timed(query(f"run={one} train.seq_len=32"), repeat)
    assert len(found) == 1
    out["query_all_s"], found = timed(query(None), repeat)
    assert len(found) == len(ids)
    out["rescan_s"], _ = timed(lambda: open_store(rescan=True))
    for name, extra in (("cli_list_s", []), ("cli_list_all_s", ["--all"])):
        def cli():
            done = subprocess.run([sys.executable, "-m", "llmadapt.cli", "runs", "--root", str(root), *extra],
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            return done.stdout
        out[name], text = timed(cli, min(repeat, 3))
        out[name.replace("_s", "_lines")] = text.count("\n")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="store-scale-")) if args.work is None else args.work
    load_before = [round(x, 2) for x in os.getloadavg()]
    try:
        template = args.template or make_template(scratch)
        t0 = time.perf_counter()
        ids = generate(template, scratch / "root", args.runs, args.workloads)
        made = time.perf_counter() - t0
        figures = measure(scratch / "root", ids, args.repeat)
    finally:
        if args.work is None:
            shutil.rmtree(scratch, ignore_errors=True)
    result = {"runs": args.runs, "workloads": args.workloads, "repeat": args.repeat, "generated_s": round(made, 2),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
              "loadavg_before": load_before, "loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
              **{k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.runs} run folders of {args.workloads} workloads (generated in {made:.1f} s); {result['date']}, "
          f"load average {' '.join(map(str, load_before))} before, {' '.join(map(str, result['loadavg']))} after, "
          f"on {result['cpus']} CPUs; medians of {args.repeat}")
    for key, what in (("index_s", "first indexing"), ("reopen_s", "reopening, nothing changed"),
                      ("query_one_s", "open + query matching one run (run=ID)"),
                      ("query_name_s", "open + query workload=NAME adapter=A (1 in 100)"),
                      ("query_field_s", "open + query run=ID train.seq_len=32 (a workload field)"),
                      ("query_all_s", "open + query matching all"), ("rescan_s", "open with rescan (every folder)"),
                      ("cli_list_s", "llmadapt runs (the newest 50; a new process)"),
                      ("cli_list_all_s", "llmadapt runs --all (a new process)")):
        print(f"  {what:<58} {result[key]:8.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
