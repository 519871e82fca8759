"""The largest batch that fits, found by real runs in isolated workers (``llmadapt maxbatch``).

Each probe is an ordinary ``llmadapt.run`` of the workload at one per-rank batch (micro-batch
= per-rank batch, no accumulation), in its own worker process(es): it either completes its
steps (fits) or fails out of memory. The search grows the batch (doubling from ``start``)
until the first out-of-memory, then bisects between the largest batch that fitted and the
smallest that did not. A probe that fails for any other reason (an exception, a crash, a
kill, a timeout) stops the search and is reported as what it was, never as out of memory.

On CPU, running out of memory is made real by a per-worker address-space cap (RLIMIT_AS,
``memory_limit_bytes``); each probe's ``launch.json`` and every probe record say a cap was
used. On GPU the device's own memory is the limit.

The search directory holds ``probes.jsonl`` (a ``probe`` record per probe, written as it
ends, then a ``maxbatch`` record) and each probe's run directory under ``probes/``. A search
ended by Ctrl-C or SIGTERM still ends the file with its ``maxbatch`` record: status failed,
its message starting "partial:", with the largest batch that fitted so far. Run the same search again (same
``out``) and it resumes: a search folder there whose file ends partial (or with no result), of the same workload,
adapter and version, cap, steps, launcher and machine (its ``search.json``), goes on, its probes that fitted or ran
out of memory not run again; the file then holds the earlier probes, the partial result, the new probes and the
final result.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import attrs

from llmadapt.adapter.plugins import check_supported, get_adapter
from llmadapt.analysis.perf.studyb import sparsity_of
from llmadapt.analysis.perf.maxbatch import MaxBatchResult
from llmadapt.contract.jsonl import JsonlWriter, read_jsonl
from llmadapt.contract.launch import new_run_id
from llmadapt.contract.perf import MaxBatch, Probe
from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.host import gpu_visible, node_name
from llmadapt.launch.settings import check_adapter_settings
from llmadapt.spec import Workload

CAP_KIND = "RLIMIT_AS"


def classify(summary) -> tuple[str, str | None]:
    """A probe's outcome from its run summary: fits, oom, or what else stopped it."""
    if summary.status == "ok":
        return "fits", None
    causes = [f.cause for f in summary.failures]
    first = next((f for f in summary.failures if f.cause == "oom"), None) or (
        summary.failures[0] if summary.failures else None)
    message = first.message if first else "the run ended early"
    for cause in ("oom", "timeout", "error", "crash", "killed", "interrupted", "unsupported"):
        if cause in causes:
            return cause, message[:400]
    return "crash", message[:400]


def maxbatch(workload: Workload | str | Path, adapter: str = "torch", *, memory_limit_bytes: int | None = None,
             start: int = 1, max_batch: int = 1024, steps: int = 2, warmup_steps: int = 0, out: str | Path = "runs",
             timeout: float | None = None, launcher: str = "auto", fault: dict | None = None,
             log: Callable[[str], None] | None = None,
             probe: Callable[[Workload, int, Path], Probe] | None = None) -> MaxBatchResult:
    """Find the largest per-rank batch whose run completes, probing in isolated workers (grow, then bisect).

    ``probe`` replaces the real probe (for testing the search); ``fault`` is passed to every
    probe's run (fault injection, for testing how non-memory failures are reported).
    """
    w = workload if isinstance(workload, Workload) else Workload.from_file(workload)
    check_adapter_settings(w, [adapter])
    w = w.for_adapter(adapter)
    info = _check_search(w, adapter, start, max_batch, steps, memory_limit_bytes, probe is None)
    probe_of = lambda b: _probe_workload(w, b, steps, warmup_steps)  # noqa: E731
    check_supported(info, probe_of(start))
    if w.profile.steps and log:
        log(f"maxbatch: the probes run unprofiled (profile.steps {list(w.profile.steps)} left out)")
    identity = json.loads(json.dumps({"workload_hash": w.content_hash, "adapter": adapter,
                                      "adapter_version": info.version, "memory_limit_bytes": memory_limit_bytes,
                                      "steps": steps, "warmup_steps": warmup_steps, "launcher": launcher,
                                      "fault": fault, "machine": node_name()}))
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    search_dir, recorded = _search_dir(Path(out), identity, say, w.content_hash)
    cap_kind = CAP_KIND if memory_limit_bytes else None

    run_probe = probe or _real_probe(adapter, launcher, timeout, fault, memory_limit_bytes, cap_kind)
    probes: list[Probe] = []
    capacity: list[int | None] = [memory_limit_bytes]
    writer = JsonlWriter(search_dir / "probes.jsonl")

    def try_batch(b: int) -> str:
        p = recorded.pop(b, None)
        before = p is not None
        if p is None:
            p = run_probe(probe_of(b), b, search_dir / "probes")
        probes.append(p)
        if not before:  # a probe resumed from the file is there already
            writer.write(p)
        if capacity[0] is None and p.run_dir and RunDir(p.run_dir).summary_file.is_file():
            dev = json.loads(RunDir(p.run_dir).summary_file.read_text()).get("device") or {}
            capacity[0] = dev.get("memory_bytes")
        if log:
            extra = (f" (peak {p.peak_memory_bytes / 2**20:,.0f} MiB)" if p.peak_memory_bytes else "") + \
                (" (probed before)" if before else "")
            log(f"  batch {b:>6}: {p.outcome}{extra}" + (f" - {p.message[:160]}" if p.message and p.outcome != "fits"
                                                         else ""))
        return p.outcome

    def outcome_record(status: str, message: str) -> MaxBatch:
        return MaxBatch(workload_hash=w.content_hash, label=w.label, adapter=adapter, status=status,
                        max_batch=fits or None, first_failing=fails,
                        max_tried=max((p.batch for p in probes), default=0), probes=len(probes),
                        seq_len=w.train.seq_len, sparsity=sparsity_of(w.model), memory_limit_bytes=memory_limit_bytes,
                        memory_limit_kind=cap_kind, capacity_bytes=capacity[0], message=message)

    fits, fails, stop = 0, None, None
    try:
        b = start
        while True:
            outcome = try_batch(b)
            if outcome == "fits":
                fits = b
                if b >= max_batch:
                    break
                b = min(b * 2, max_batch)
            elif outcome == "oom":
                fails = b
                break
            else:
                stop = probes[-1]
                break
        while stop is None and fails is not None and fails - fits > 1:
            mid = (fits + fails) // 2
            outcome = try_batch(mid)
            if outcome == "fits":
                fits = mid
            elif outcome == "oom":
                fails = mid
            else:
                stop = probes[-1]
        status, message = _verdict(w, stop, fits, fails, probes, memory_limit_bytes, max_batch)
        result = outcome_record(status, message)
        writer.write(result)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the probes so far, and a result that says it is partial
        from llmadapt.launch.supervise import interrupt_text

        known = (f"max batch >= {fits} per rank so far" if fits else "no batch fitted so far") + \
            (f", batch {fails} ran out of memory" if fails is not None else "")
        writer.write(outcome_record("failed", f"partial: the search was interrupted ({interrupt_text(exc)}) after "
                                              f"{len(probes)} probe(s); {known}"))
        say(f"{interrupt_text(exc)}: the search so far ({len(probes)} probe(s); {known}) is in "
            f"{search_dir / 'probes.jsonl'}; the same command again (same --out) resumes it")
        raise
    finally:
        writer.close()
    return MaxBatchResult(search_dir=search_dir, result=result, probes=probes)


def _check_search(w: Workload, adapter: str, start: int, max_batch: int, steps: int, memory_limit_bytes: int | None,
                  real: bool):
    """The search's options, before anything runs: one line naming what is wrong. Returns the adapter's info."""
    if w.kind == "serve":
        raise LlmadaptError("maxbatch searches training or fine-tuning batches; a serve workload has none "
                            "(llmadapt estimate reports the KV-cache bound on concurrent sequences)")
    if start < 1 or max_batch < start:
        raise LlmadaptError(f"need 1 <= --start ({start}) <= --max-batch ({max_batch})")
    if steps < 1:
        raise LlmadaptError("--steps must be >= 1")
    if memory_limit_bytes is not None and memory_limit_bytes <= 0:
        raise LlmadaptError("--memory-limit must be positive")
    info = get_adapter(adapter)
    if real and memory_limit_bytes is not None and gpu_visible():
        raise LlmadaptError("--memory-limit caps a worker's address space, which CUDA cannot start under: on a GPU "
                            "the device's memory is the limit (set LLMADAPT_DEVICE=cpu to search on the CPU)")
    if real and memory_limit_bytes is None and not gpu_visible():
        raise LlmadaptError("no GPU visible: on CPU, maxbatch needs --memory-limit SIZE, a per-worker address-space "
                            "cap (RLIMIT_AS) that makes running out of memory real (e.g. --memory-limit 2G)")
    return info


def _real_probe(adapter: str, launcher: str, timeout: float | None, fault: dict | None, memory_limit_bytes: int | None,
                cap_kind: str | None) -> Callable[[Workload, int, Path], Probe]:
    """A probe that runs the batch for real: one run of the workload, classified."""
    def real_probe(pw: Workload, b: int, where: Path) -> Probe:
        from llmadapt.launch.runner import run

        t0 = time.monotonic()
        result = run(pw, adapter, launcher=launcher, out=where, timeout=timeout, fault=fault,
                     memory_limit_bytes=memory_limit_bytes)
        s = result.summary
        outcome, message = classify(s)
        return Probe(batch=b, outcome=outcome, run_dir=str(result.run_dir), message=message,
                     steps_completed=s.steps_completed, peak_memory_bytes=s.peak_memory_bytes,
                     step_time_s=s.step_time_s.p50 if s.step_time_s else None,
                     samples_per_s=s.samples_per_s.mean if s.samples_per_s else None,
                     memory_limit_bytes=memory_limit_bytes, memory_limit_kind=cap_kind,
                     seconds=time.monotonic() - t0)

    return real_probe


def _verdict(w: Workload, stop: Probe | None, fits: int, fails: int | None, probes: list[Probe],
             memory_limit_bytes: int | None, max_batch: int) -> tuple[str, str]:
    """(status, message) of a finished search."""
    cap = (f" under a {memory_limit_bytes / 2**30:.2f} GiB per-worker cap ({CAP_KIND})"
           if memory_limit_bytes else "")
    if stop is not None:
        status, message = "failed", (f"probe at batch {stop.batch} failed for a reason other than memory "
                                     f"({stop.outcome}: {stop.message}); not counted as out of memory; "
                                     f"see {stop.run_dir}")
    elif fits == 0:
        status, message = "failed", (f"{w.label} does not fit at batch 1{cap}: the probe at batch 1 ran out of "
                                     f"memory (see {probes[-1].run_dir})")
    elif fails is None:
        status, message = "ok", (f"max batch >= {fits} per rank{cap}: every probe up to --max-batch "
                                 f"{max_batch} fitted")
    else:
        status, message = "ok", f"max batch {fits} per rank{cap} (batch {fails} ran out of memory)"
    return status, message


def _search_dir(out: Path, identity: dict, say: Callable[[str], None], content_hash: str
                ) -> tuple[Path, dict[int, Probe]]:
    """(the search's folder, the probes it holds already): an unfinished search of the same identity resumed, or a
    new folder with its search.json."""
    search_dir, recorded = _resumable(out, identity, say)
    if search_dir is None:
        search_dir = out / new_run_id("maxbatch", content_hash[:8])
        search_dir.mkdir(parents=True, exist_ok=False)
        (search_dir / "search.json").write_text(json.dumps(identity, indent=1))
    return search_dir, recorded


def _resumable(out: Path, identity: dict, say: Callable[[str], None]) -> tuple[Path | None, dict[int, Probe]]:
    """The newest search folder in OUT of this identity whose file ends partial (or has no result), and its probes
    that fitted or ran out of memory by batch; else (None, {}). One of other settings is left as it is, said so."""
    for path in sorted(out.glob(f"*-maxbatch-{identity['workload_hash'][:8]}-*/search.json"), reverse=True):
        try:
            theirs = json.loads(path.read_text())
            records = read_jsonl(path.with_name("probes.jsonl"), check=False)
        except (OSError, ValueError):
            continue
        results = [r for r in records if r.get("type") == "maxbatch"]
        if not isinstance(theirs, dict) or (results and not str(results[-1].get("message")).startswith("partial:")):
            continue
        differs = [k for k, v in identity.items() if theirs.get(k) != v]
        if differs:
            say(f"{path.parent}: an interrupted search with another {', '.join(differs)}: left as it is")
            continue
        probes = {r["batch"]: Probe(**{k: v for k, v in r.items() if k != "type"}) for r in records
                  if r.get("type") == "probe" and r.get("outcome") in ("fits", "oom")}
        say(f"resuming {path.parent}: {len(probes)} probe(s) made there are not made again")
        return path.parent, probes
    return None, {}


def _probe_workload(w: Workload, b: int, steps: int, warmup: int) -> Workload:
    """The probe of batch b: a short run of the workload, unprofiled (profiling is a cost of its own, and the
    probes' few steps may not hold the profiled ones)."""
    dp = w.parallelism.dp
    w = attrs.evolve(w, profile=attrs.evolve(w.profile, steps=()))
    probe = w.with_overrides([f"train.global_batch={b * dp}", f"train.micro_batch={b}", f"train.steps={steps}",
                              f"train.warmup_steps={warmup}"])
    return attrs.evolve(probe, name=f"{w.label}-maxbatch-b{b}")
