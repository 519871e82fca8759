"""Compare runs, check loss parity, show and export traces. Reads only what is on disk."""

from __future__ import annotations

import csv
import io
import itertools
import json
from pathlib import Path
from typing import Any, Callable

import attrs

from llmadapt.errors import LlmadaptError, TraceMismatchError
from llmadapt.launch import RunResult, load_records, run
from llmadapt.plugins import check_supported, get_adapter
from llmadapt.spec import Workload

# fp32 loss trajectories of two correct stacks differ only by floating-point reduction order
# (summation order in matmuls, all-reduce order across ranks), which the optimizer carries
# forward. On the tiny presets over tens of steps that stays below 1e-5 relative; the
# tolerance leaves a 10x margin yet catches a wrong loss normalisation, a skipped micro-batch
# or different data (all >= 1e-3 relative).
PARITY_RTOL = 1e-4
PARITY_ATOL = 1e-5


@attrs.frozen
class ParityReport:
    ok: bool
    rtol: float
    atol: float
    steps: int
    first_divergence: int | None
    """First step whose losses differ by more than atol + rtol * |reference|; None when all agree."""
    max_abs_delta: float
    reference: list[float | None]
    candidate: list[float | None]

    def describe(self, names: tuple[str, str] = ("reference", "candidate")) -> str:
        if self.ok:
            return (f"parity ok: {names[1]} matches {names[0]} at all {self.steps} steps "
                    f"(max |delta| {self.max_abs_delta:.3g}; tolerance atol {self.atol:g} + rtol {self.rtol:g})")
        if self.first_divergence is None:
            return f"parity failed: {names[0]} has {len(self.reference)} steps, {names[1]} {len(self.candidate)}"
        i = self.first_divergence
        return (f"parity failed at step {i}: {names[0]} loss {self.reference[i]!r}, {names[1]} loss "
                f"{self.candidate[i]!r} (|delta| {abs((self.reference[i] or 0) - (self.candidate[i] or 0)):.3g} > "
                f"atol {self.atol:g} + rtol {self.rtol:g} x |loss|)")


def loss_parity(reference: list[float | None], candidate: list[float | None], *,
                rtol: float = PARITY_RTOL, atol: float = PARITY_ATOL) -> ParityReport:
    import math

    for name, value in (("rtol", rtol), ("atol", atol)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise LlmadaptError(f"parity {name}: got {value!r}; must be a finite number >= 0 (NaN passes everything)")
    first, worst = None, 0.0
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a is None or b is None:
            first = i if first is None else first
            continue
        delta = abs(a - b)
        worst = max(worst, delta)
        if delta > atol + rtol * abs(a) and first is None:
            first = i
    same_length = len(reference) == len(candidate) and len(reference) > 0
    return ParityReport(ok=first is None and same_length, rtol=rtol, atol=atol, steps=min(len(reference),
                        len(candidate)), first_divergence=first, max_abs_delta=worst,
                        reference=list(reference), candidate=list(candidate))


@attrs.frozen
class ExpertLoadReport:
    """Two runs' expert loads, step by step and layer by layer.

    Exact where the routers' choices are clear; where a layer had near-ties (tokens whose k-th and
    (k+1)-th logits were within fp noise, llmadapt.moe), at most that many tokens may have moved
    between experts: moved = sum |a - b| / 2 (each moved token leaves one expert for another).
    """

    ok: bool
    steps: int
    first_mismatch: tuple[int, int] | None
    """(step, layer) of the first disagreement beyond the near-ties; None when all agree."""
    moved: int
    """At that (step, layer), the tokens that went elsewhere; 0 when all agree."""
    allowed: int
    """At that (step, layer), the near-ties (the larger of the two runs' counts)."""
    near_ties: int
    """Near-ties over all steps and layers (the larger run's, per layer)."""

    def describe(self, names: tuple[str, str] = ("reference", "candidate")) -> str:
        if self.ok:
            return (f"expert load ok: {names[1]} routes as {names[0]} at all {self.steps} steps "
                    f"({self.near_ties} near-tie tokens allowed to move)")
        if self.first_mismatch is None:
            return f"expert load failed: {names[0]} and {names[1]} report different steps or layers"
        step, layer = self.first_mismatch
        return (f"expert load failed at step {step}, layer {layer}: {self.moved} tokens routed differently, "
                f"{self.allowed} near-ties")


def expert_load_parity(reference: list[dict[str, Any]], candidate: list[dict[str, Any]]) -> ExpertLoadReport:
    """Compare the step records (rank 0's, which carry the global counts) of two MoE runs."""

    def by_step(records):
        return {r["step"]: r for r in records if r.get("type") == "step" and r.get("expert_load") is not None}

    a, b = by_step(reference), by_step(candidate)
    total_ties = 0
    if not a or a.keys() != b.keys():
        return ExpertLoadReport(False, min(len(a), len(b)), None, 0, 0, 0)
    for step in sorted(a):
        la, lb = a[step]["expert_load"], b[step]["expert_load"]
        ta = a[step].get("expert_near_ties") or [0] * len(la)
        tb = b[step].get("expert_near_ties") or [0] * len(lb)
        if len(la) != len(lb) or any(len(x) != len(y) for x, y in zip(la, lb)):
            return ExpertLoadReport(False, len(a), None, 0, 0, total_ties)
        for layer, (x, y) in enumerate(zip(la, lb)):
            moved = sum(abs(i - j) for i, j in zip(x, y)) // 2
            allowed = max(ta[layer], tb[layer])
            total_ties += allowed
            if moved > allowed or sum(x) != sum(y):
                return ExpertLoadReport(False, len(a), (step, layer), moved, allowed, total_ties)
    return ExpertLoadReport(True, len(a), None, 0, 0, total_ties)


def read_summary(run_dir: str | Path, needs: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The run's summary.json; for a run whose orchestrator never wrote one (killed, disk full), the summary
    the records on disk give, with a warning saying so. ``needs``: the keys the caller reads (default: what
    `show` prints); a summary without one of them counts as damaged."""
    path = Path(run_dir) / "summary.json"
    problem = "incomplete run: no summary.json (its orchestrator did not finish)"
    if path.is_file():
        try:
            summary = json.loads(path.read_bytes())
            missing = [k for k in (needs or _SUMMARY_KEYS) if not isinstance(summary, dict) or k not in summary]
            if not missing:
                return summary
            problem = f"summary.json lacks {', '.join(missing[:4])}"
        except (json.JSONDecodeError, UnicodeDecodeError):
            problem = "summary.json is not JSON"
    if not (Path(run_dir) / "launch.json").is_file():
        raise LlmadaptError(f"{run_dir} is not a run directory" +
                            (f" ({problem}, and no launch.json to rebuild it from)" if path.is_file() else
                             " (no summary.json, no launch.json)"))
    from llmadapt.contract import to_json
    from llmadapt.launch import summarise

    try:
        summary = to_json(summarise(run_dir, write=False))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise LlmadaptError(f"{run_dir}: {problem}, and its launch.json cannot be read ({exc})") from None
    summary["warnings"] = [f"{problem}; this summary is built from the records on disk",
                           *summary.get("warnings", [])]
    return summary


# What show, compare and parity read from a summary: one missing means the file is damaged.
_SUMMARY_KEYS = ("run_id", "status", "adapter", "framework", "framework_version", "launcher", "workload_hash",
                 "problem_hash", "world_size", "steps_completed", "measured_steps", "losses")


def parity_of_runs(reference: str | Path, candidate: str | Path, *, rtol: float = PARITY_RTOL,
                   atol: float = PARITY_ATOL, allow_mismatch: bool = False) -> ParityReport:
    a, b = (read_summary(r, needs=("problem_hash", "losses")) for r in (reference, candidate))
    if a["problem_hash"] != b["problem_hash"] and not allow_mismatch:
        raise TraceMismatchError(
            f"{reference} and {candidate} ran different problems (problem hash {a['problem_hash'][:12]} vs "
            f"{b['problem_hash'][:12]}): their losses are not comparable (pass allow_mismatch to compare anyway)"
        )
    return loss_parity(a["losses"], b["losses"], rtol=rtol, atol=atol)


# -- compare ----------------------------------------------------------------------------------
@attrs.frozen
class Row:
    label: str
    adapter: str
    variant: str
    run_dir: str | None
    status: str
    metrics: dict[str, float | int | str | None]
    """TRAIN_COLUMNS or SERVE_COLUMNS keys, by the workload's kind."""
    note: str = ""


# (key, heading, format) of the comparison table, per kind
TRAIN_COLUMNS = [
    ("step_p50_s", "step p50 s", ".4f"), ("step_p90_s", "step p90 s", ".4f"), ("tokens_per_s", "tokens/s", ",.0f"),
    ("samples_per_s", "samples/s", ",.1f"), ("peak_memory_mib", "peak mem MiB", ",.0f"),
    ("first_loss", "first loss", ".4f"), ("last_loss", "last loss", ".4f"), ("parity_delta", "parity delta", ".2e"),
]
SERVE_COLUMNS = [
    ("request_throughput", "req/s", ".2f"), ("output_throughput", "out tok/s", ",.1f"),
    ("ttft_p50_ms", "TTFT p50 ms", ".1f"), ("ttft_p99_ms", "TTFT p99 ms", ".1f"),
    ("tpot_p50_ms", "TPOT p50 ms", ".1f"), ("tpot_p99_ms", "TPOT p99 ms", ".1f"),
    ("itl_p50_ms", "ITL p50 ms", ".1f"), ("itl_p99_ms", "ITL p99 ms", ".1f"),
    ("e2el_p50_ms", "E2EL p50 ms", ".1f"), ("e2el_p99_ms", "E2EL p99 ms", ".1f"),
    ("goodput", "goodput req/s", ".2f"), ("failed", "failed", "d"), ("valid", "valid", ""),
]


def row_metrics(summary, baseline_losses: list[float | None] | None) -> dict[str, float | int | str | None]:
    """The comparison columns of one run, from its summary."""
    s = summary
    if s.serving is not None:
        v = s.serving
        out: dict[str, float | int | str | None] = {
            "request_throughput": v.request_throughput, "output_throughput": v.output_throughput,
            "goodput": v.request_goodput, "failed": v.failed, "valid": "yes" if v.valid else "NO",
            "failures_by_cause": ", ".join(f"{k}={n}" for k, n in sorted(v.failures_by_cause.items())) or None,
        }
        for metric in ("ttft", "tpot", "itl", "e2el"):
            st = getattr(v, f"{metric}_ms")
            out[f"{metric}_p50_ms"] = st.p50 if st else None
            out[f"{metric}_p99_ms"] = st.p99 if st else None
        return out
    delta = loss_parity(baseline_losses, s.losses).max_abs_delta if s.losses and baseline_losses else None
    return {
        "step_p50_s": s.step_time_s.p50 if s.step_time_s else None,
        "step_p90_s": s.step_time_s.p90 if s.step_time_s else None,
        "tokens_per_s": s.tokens_per_s.mean if s.tokens_per_s else None,
        "samples_per_s": s.samples_per_s.mean if s.samples_per_s else None,
        "peak_memory_mib": s.peak_memory_bytes / 2**20 if s.peak_memory_bytes else None,
        "first_loss": s.losses[0] if s.losses else None, "last_loss": s.losses[-1] if s.losses else None,
        "parity_delta": delta,
    }


@attrs.frozen
class Comparison:
    rows: list[Row]

    def table(self) -> str:
        serve = any("request_throughput" in r.metrics for r in self.rows)
        columns = SERVE_COLUMNS if serve else TRAIN_COLUMNS
        head = ["run", "status"] + [title for _, title, _ in columns]
        body = [[r.label, r.status] + [_f(r.metrics.get(key), fmt) for key, _, fmt in columns] for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        notes = [f"{r.label}: {r.note}" for r in self.rows if r.note]
        return "\n".join(lines + notes)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [attrs.asdict(r) for r in self.rows]}


def _f(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt) if fmt else str(value)


def matrix_variants(workload: Workload, matrix: dict[str, list[Any]]) -> list[tuple[str, Workload]]:
    """Every combination of the matrix values, applied as overrides; labels like 'dp=2,recompute=full'.

    A key naming several comma-separated paths is one axis whose values are tuples, one value per
    path, taken together (zipped, not crossed): {"optimizations.zero_stage,optimizations.offload":
    [(0, "none"), (2, "optimizer")]} is two variants. That names configurations a cross product
    cannot, because some combinations are invalid (offload without ZeRO).
    """
    if not matrix:
        return [("", workload)]
    axes = []
    for key, values in matrix.items():
        paths = [p.strip() for p in key.split(",")]
        if not values:
            raise LlmadaptError(f"matrix {key!r}: no values")
        options = []
        for v in values:
            v = tuple(v) if len(paths) > 1 and isinstance(v, (list, tuple)) else (v,)
            if len(v) != len(paths):
                raise LlmadaptError(f"matrix {key!r}: value {v!r} needs {len(paths)} parts, one per path")
            options.append(list(zip(paths, v)))
        axes.append(options)
    out = []
    for combination in itertools.product(*axes):
        pairs = [pair for option in combination for pair in option]
        sets = [f"{k}={_yaml_scalar(v)}" for k, v in pairs]
        label = ",".join(f"{k.split('.')[-1]}={_yaml_scalar(v)}" for k, v in pairs)
        out.append((label, workload.with_overrides(sets)))
    return out


def _yaml_scalar(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def parse_matrix(items: list[str]) -> dict[str, list[Any]]:
    """['optimizations.recompute=none,full', 'parallelism.dp=1,2'] -> {path: [values]}.

    Several paths zip into one axis: 'optimizations.zero_stage,optimizations.offload=0,none;2,optimizer'
    -> {"optimizations.zero_stage,optimizations.offload": [(0, "none"), (2, "optimizer")]} (values of
    one variant separated by ',', variants by ';').
    """
    import yaml

    from llmadapt.spec import load_yaml

    def load_yaml_value(text: str, item: str):
        try:
            return load_yaml(text)
        except yaml.YAMLError:
            raise LlmadaptError(f"--matrix {item[:80]!r}: value {text[:40]!r} is not a YAML scalar") from None

    matrix: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if key.strip() in matrix:
            raise LlmadaptError(f"--matrix {key.strip()[:80]!r} is given twice: give each axis once")
        if not sep or not values:
            raise LlmadaptError(f"--matrix {item!r}: use path=v1,v2 (e.g. parallelism.dp=1,2), or "
                                "path1,path2=a1,a2;b1,b2 for variants that set several fields together")
        paths = [p.strip() for p in key.split(",")]
        if len(paths) == 1:
            matrix[key.strip()] = [load_yaml_value(v, item) for v in values.split(",")]
            continue
        variants = []
        for variant in values.split(";"):
            parts = [load_yaml_value(v, item) for v in variant.split(",")]
            if len(parts) != len(paths):
                raise LlmadaptError(f"--matrix {item!r}: variant {variant!r} has {len(parts)} values for "
                                    f"{len(paths)} paths ({', '.join(paths)})")
            variants.append(tuple(parts))
        matrix[",".join(paths)] = variants
    return matrix


def compare(workload: Workload | str | Path, adapters: list[str], *, matrix: dict[str, list[Any]] | None = None,
            log: Callable[[str], None] | None = None, **run_options: Any) -> Comparison:
    """Run every adapter on every matrix variant, side by side; one row each.

    Every (adapter, variant) pair is checked before the first run starts, so a bad
    combination fails at once instead of after an hour of measurements.
    """
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    plan = []
    for label, variant in matrix_variants(workload, matrix or {}):
        for name in adapters:
            check_supported(get_adapter(name), variant)
            plan.append((name, label, variant))
    rows: list[Row] = []
    baselines: dict[str, list[float | None]] = {}
    for i, (name, label, variant) in enumerate(plan, 1):
        title = f"{name}" + (f" [{label}]" if label else "")
        if log:
            log(f"[{i}/{len(plan)}] {title}")
        result: RunResult = run(variant, name, **run_options)
        s = result.summary
        base = baselines.setdefault(s.problem_hash, s.losses)
        notes = [f"{f.cause}: {f.message}" for f in s.failures] + [f"warning: {w}" for w in s.warnings]
        if s.serving is not None and s.serving.failures_by_cause:
            notes.append("failed requests: " + ", ".join(f"{k}={n}" for k, n in sorted(s.serving.failures_by_cause.items())))
        if s.serving is not None and not s.serving.valid:
            notes.append(s.serving.validity)
        rows.append(Row(label=title, adapter=name, variant=label, run_dir=str(result.run_dir), status=s.status,
                        metrics=row_metrics(s, base), note="; ".join(notes)[:400]))
    return Comparison(rows=rows)


def parity(workload: Workload | str | Path, adapters: list[str], *, rtol: float = PARITY_RTOL,
           atol: float = PARITY_ATOL, **run_options: Any) -> ParityReport:
    """Run the workload on two adapters (fp32) and check their loss trajectories agree at every step."""
    if not isinstance(workload, Workload):
        workload = Workload.from_file(workload)
    if len(adapters) != 2:
        raise LlmadaptError(f"parity compares exactly two adapters, got {len(adapters)}: {', '.join(adapters)}")
    if workload.precision != "fp32":
        raise LlmadaptError(f"parity needs precision fp32 (got {workload.precision}): lower precisions are not "
                            "expected to agree step by step")
    for name in adapters:
        check_supported(get_adapter(name), workload)
    results = [run(workload, name, **run_options) for name in adapters]
    for r in results:
        if not r.ok:
            f = r.summary.failures[0] if r.summary.failures else None
            raise LlmadaptError(f"parity: the {r.summary.adapter} run failed ({f.cause}: {f.message}) - see {r.run_dir}"
                                if f else f"parity: the {r.summary.adapter} run failed - see {r.run_dir}")
    return loss_parity(results[0].losses, results[1].losses, rtol=rtol, atol=atol)


# -- show and export --------------------------------------------------------------------------
def show(run_dir: str | Path) -> dict[str, Any]:
    """The run's summary (as stored), for display or further processing."""
    return read_summary(run_dir)


def render_summary(s: dict[str, Any]) -> str:
    st, tok = s.get("step_time_s"), s.get("tokens_per_s")
    lines = [
        f"run        {s['run_id']}  [{s['status']}]",
        f"adapter    {s['adapter']} ({s['framework']} {s['framework_version']}), launcher {s['launcher']}, "
        f"world size {s['world_size']}",
        f"workload   {s['workload_hash'][:12]} (problem {s['problem_hash'][:12]})",
        f"device     {s['device']['kind']}: {s['device']['name']}" if s.get("device") else "device     -",
        f"steps      {s['steps_completed']} completed, {s['measured_steps']} measured",
    ]
    if st:
        lines.append(f"step time  p50 {st['p50']:.4f} s  p90 {st['p90']:.4f} s  mean {st['mean']:.4f} s "
                     f"(std {st['std']:.4f}, n={st['count']})")
    if tok:
        lines.append(f"throughput {tok['mean']:,.0f} tokens/s, {s['samples_per_s']['mean']:.2f} samples/s")
    if s.get("peak_memory_bytes"):
        lines.append(f"memory     peak {s['peak_memory_bytes'] / 2**20:,.0f} MiB ({s['memory_kind']}), per rank: "
                     + ", ".join("-" if m is None else f"{m / 2**20:,.0f}" for m in s["peak_memory_per_rank"]))
    if s.get("losses"):
        lines.append(f"loss       {s['losses'][0]:.4f} -> {s['losses'][-1]:.4f}")
    v = s.get("serving")
    if v:
        lines.append(f"requests   {v['completed']} completed, {v['failed']} failed "
                     + (f"({', '.join(f'{k}={n}' for k, n in sorted(v['failures_by_cause'].items()))})"
                        if v["failures_by_cause"] else "") + f" in {v['duration_s']:.2f} s")
        lines.append(f"throughput {v['request_throughput']:.2f} req/s, {v['output_throughput']:,.1f} output tok/s"
                     + (f", goodput {v['request_goodput']:.2f} req/s" if v["request_goodput"] is not None else ""))
        for metric in ("ttft", "tpot", "itl", "e2el"):
            st = v[f"{metric}_ms"]
            if st:
                lines.append(f"{metric.upper():<10} p50 {st['p50']:.1f} ms  p90 {st['p90']:.1f}  p99 {st['p99']:.1f}  "
                             f"mean {st['mean']:.1f} (n={st['count']})")
        lines.append(f"output     {'forced (ignore_eos)' if v['output_length_forced'] else 'not forced: lengths as the engine chose'}")
        lines.append(f"validity   {v['validity']}")
        if v.get("loop_lag_ms"):
            lag = v["loop_lag_ms"]
            line = (f"client     event-loop lag p50 {lag['p50']:.2f} ms  p99 {lag['p99']:.2f}  max {lag['max']:.1f}; "
                    f"CPU {v['client_cpu_s']:.2f} s ({v['client_cpu_ms_per_request']:.2f} ms per request)")
            if v.get("bunched_share") is not None:
                line += f"; bunched chunks {v['bunched_share']:.0%} (engine ITL {v['engine_itl_ms']:.2f} ms)"
            lines.append(line)
    if s.get("mfu") is not None:
        lines.append(f"mfu        {s['mfu']:.1%}")
    for failure in s.get("failures", []):
        where = f"rank {failure['rank']}" if failure.get("rank") is not None else "launcher"
        lines.append(f"failure    {failure['cause']} ({where}): {failure['message'][:300]}")
    for warning in s.get("warnings", []):
        lines.append(f"warning    {warning}")
    for name, secs in s.get("phase_means_s", {}).items():
        lines.append(f"phase      {name:<24} {secs:.4f} s")
    for p in s.get("patches", []):
        lines.append(f"patch      {p['framework']}: {p['name']} ({p['kind']}) - {p['description']}")
    for f in s.get("failures", []):
        where = f"rank {f['rank']}" if f.get("rank") is not None else "launcher"
        lines.append(f"failure    {f['cause']} ({where}, step {f.get('step')}): {f['message']}")
    return "\n".join(lines)


EXPORT_FORMATS = ("json", "csv", "chrome-trace", "vllm-bench")


def export(run_dir: str | Path, fmt: str) -> str:
    run_dir = Path(run_dir)
    if fmt not in EXPORT_FORMATS:
        raise LlmadaptError(f"unknown export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")
    summary = read_summary(run_dir)
    records = load_records(run_dir)
    if fmt == "json":
        return json.dumps({"summary": summary, "records": records}, indent=2)
    if fmt == "vllm-bench":
        if not summary.get("serving"):
            raise LlmadaptError("vllm-bench export is for serving runs")
        from llmadapt.serving import vllm_bench_keys

        return json.dumps(vllm_bench_keys(summary), indent=2)
    if fmt == "csv" and summary.get("serving"):
        return _requests_csv([r for r in records if r["type"] == "request"])
    steps = [r for r in records if r["type"] == "step"]
    if fmt == "csv":
        phase_names = sorted({f"{p['source']}:{p['name']}" for s in steps for p in s["phases"]})
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(["rank", "step", "warmup", "seconds", "tokens", "samples", "loss", "peak_memory_bytes",
                         *[f"phase_s[{n}]" for n in phase_names]])
        for s in sorted(steps, key=lambda s: (s["step"], s["rank"])):
            phases = {f"{p['source']}:{p['name']}": p["seconds"] for p in s["phases"]}
            mem = s["memory"] or {}
            peak = mem.get("peak_allocated_bytes") if mem.get("kind") == "cuda" else mem.get("peak_rss_bytes")
            writer.writerow([s["rank"], s["step"], s["warmup"], s["seconds"], s["tokens"], s["samples"], s["loss"],
                             peak, *[phases.get(n, "") for n in phase_names]])
        return buf.getvalue()
    return json.dumps(chrome_trace(records), indent=1)


def _requests_csv(requests: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["index", "warmup", "status", "error_cause", "input_tokens", "output_tokens", "send_lag_ms",
                     "ttft_ms", "e2el_ms", "chunks", "finish_reason"])
    for r in sorted(requests, key=lambda r: r["index"]):
        sent = r["sent_ns"]

        def ms(t):
            return "" if t is None or sent is None else f"{(t - sent) / 1e6:.3f}"

        lag = "" if sent is None else f"{(sent - r['scheduled_ns']) / 1e6:.3f}"
        writer.writerow([r["index"], r["warmup"], r["status"], r["error_cause"] or "", r["input_tokens"],
                         r["output_tokens"] if r["output_tokens"] is not None else "", lag, ms(r["first_token_ns"]),
                         ms(r["end_ns"]), len(r["chunk_ns"]), r["finish_reason"] or ""])
    return buf.getvalue()


def chrome_trace(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace events (Perfetto): one track per rank, steps and spans on wall-clock time."""
    anchors = {r["rank"]: (r["wall_anchor_ns"], r["mono_anchor_ns"], r["node"]) for r in records
               if r["type"] == "header"}
    events: list[dict[str, Any]] = []

    def us(rank: int, mono_ns: int) -> float:
        wall, mono, _ = anchors[rank]
        return (mono_ns - mono + wall) / 1000.0

    for rank, (_, _, node) in anchors.items():
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} ({node})"}})
    for r in records:
        if r["type"] != "step" or r["rank"] not in anchors:
            continue
        rank = r["rank"]
        args = {"loss": r["loss"], "tokens": r["tokens"], "warmup": r["warmup"],
                **{f"{p['source']}:{p['name']}_s": p["seconds"] for p in r["phases"]}}
        events.append({"ph": "X", "name": f"step {r['step']}", "cat": "step", "pid": rank, "tid": 0,
                       "ts": us(rank, r["start_ns"]), "dur": (r["end_ns"] - r["start_ns"]) / 1000.0, "args": args})
        for sp in r["spans"]:
            events.append({"ph": "X", "name": sp["name"], "cat": sp["source"], "pid": rank, "tid": 1,
                           "ts": us(rank, sp["start_ns"]), "dur": (sp["end_ns"] - sp["start_ns"]) / 1000.0})
    return {"traceEvents": events, "displayTimeUnit": "ms"}

