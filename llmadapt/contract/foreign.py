"""Other tools' serving results, read: `vllm bench serve`'s result JSON, AIPerf's profile export
(``profile_export.jsonl``, or the aggregate ``profile_export_aiperf.json``) and guidellm's ``benchmarks.json``
report, each recognised by its content. The launcher of kind "import" (llmadapt.launch.importer) writes what is read
here as a serving run folder that the run store indexes like any other (``llmadapt runs import FILE...``;
docs/runs.md); analysis reads the marks it leaves (``AS_FILE_STATES``, ``SUMMARY_ONLY``).

A file with per-request times (vllm bench with ``--save-detailed``, AIPerf's JSONL, guidellm's report) becomes
request records, and the summary is computed from them by llmadapt's own definitions (``contract.stats``); an
aggregate-only file becomes a summary-only run holding the figures as the file reports them. Either way every
figure the file reports is kept beside ours as a ``metric`` record whose source is the tool, and the summary's
``measured_by`` names the tool and its version: the run was measured by that tool's client, not llmadapt's load
generator, so its send lag and client health are unknown (its validity says so, and is not judged).

Units, explicitly: vllm bench writes per-request times in seconds and its aggregates in ms (``*_ms``); AIPerf
writes ms (``unit`` beside each value) and nanosecond timestamps; guidellm writes times in seconds (Unix
timestamps, ``request_latency``) and ``*_ms`` figures in ms. Request records hold nanoseconds.

The problem: given the workload the tool's stream was (``workload``: an llmadapt workload, e.g. the run folder of
llmadapt's run of that stream), every fact the file states (request count, input and output lengths, concurrency
or rate) is checked against it, and the imported run takes its workload and problem hash, so `compare --runs`
puts it in the same problem as llmadapt's runs of that workload. Without one, its workload is built from what the
file states and its problem hash from those facts alone (``as the file states``): the prompts, seed and client
settings are not known, so it is never taken for an llmadapt run's problem.

It is over 400 lines because each tool's format (its keys, its units, its percentile conventions) belongs with the
others: one file to read for what each tool's file says.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
from pathlib import Path
from typing import Any

import attrs

from llmadapt.contract.rundir import RunDir
from llmadapt.errors import LlmadaptError
from llmadapt.spec import Workload

__all__ = ["AS_FILE_STATES", "SUMMARY_ONLY", "TOOLS", "Measured", "Sent", "check_against", "facts_line", "stated_facts",
           "read_result", "stream_workload", "with_version", "workload_from_file"]

SUMMARY_ONLY = "summary only"
"""How a run imported from an aggregate-only file is marked: its validity starts with it, its label ends with it."""

AS_FILE_STATES = "as the file states"
"""How an imported run's problem is marked when no workload was given: built from the file's facts alone."""

TOOLS = {"vllm-bench": "vllm bench serve", "aiperf": "AIPerf", "guidellm": "guidellm"}
"""Adapter name of an imported run (the tool that drove it) -> the tool's own name."""


@attrs.frozen
class Sent:
    """One request as the tool measured it, in seconds from an origin of the tool's clock."""

    start_s: float
    ttft_s: float | None
    end_s: float | None
    chunk_s: list[float]
    """Arrival of every content chunk the tool timed (the first is the first token); [] where it kept none."""
    input_tokens: int
    output_tokens: int | None
    error: str | None = None


@attrs.frozen
class Measured:
    """What one tool's file says: the tool, the stream's facts, the requests (None: aggregate only), its figures."""

    tool: str
    version: str | None
    path: Path
    created: float | None
    """Unix seconds the benchmark ran (None: the file does not say)."""
    model: str | None
    url: str | None
    requests_asked: int | None
    arrival: dict[str, Any]
    """{'process': 'closed', 'concurrency': N} or {'process': 'poisson'|'gamma'|'constant', 'rate': R, ...}."""
    sent: list[Sent] | None
    reported: dict[str, tuple[float, str]]
    """Figures as the file reports them: name -> (value, unit)."""
    completed: int
    failed: int
    per_chunk: bool = True
    """The requests' chunk times are every content chunk's (vllm bench, AIPerf); False: first and last only."""

    @property
    def measured_by(self) -> str:
        return f"{TOOLS[self.tool]} {self.version}" if self.version else f"{TOOLS[self.tool]} (version not stated)"


def _need(data: dict[str, Any], path: Path, what: str, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise LlmadaptError(f"{path}: a {what} without {', '.join(missing)}: nothing imported")


# -- recognising a file --------------------------------------------------------------------------
def read_result(path: str | Path) -> Measured:
    """The tool's result in ``path``, recognised by its content; anything else is one line naming the file."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LlmadaptError(f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc}): nothing imported")
    data: Any
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            data = [json.loads(line) for line in lines]
        except json.JSONDecodeError:
            raise LlmadaptError(f"{path}: neither JSON nor JSON lines: not a result file of vllm bench serve, AIPerf "
                                "or guidellm (nor a run folder): nothing imported") from None
    if isinstance(data, list) and data and all(isinstance(r, dict) and "metadata" in r and "metrics" in r
                                               for r in data):
        return _held_requests(_aiperf_records(data, path))
    if isinstance(data, dict):
        if "benchmarks" in data and isinstance(data.get("metadata"), dict) and "guidellm_version" in data["metadata"]:
            return _held_requests(_guidellm(data, path))
        if "input_config" in data and ("time_to_first_token" in data or "request_latency" in data):
            return _aiperf_aggregate(data, path)
        if "completed" in data and any(k in data for k in ("median_ttft_ms", "mean_ttft_ms", "ttfts")):
            return _held_requests(_vllm_bench(data, path))
    raise LlmadaptError(f"{path}: not a result file of vllm bench serve (completed, *_ttft_ms), AIPerf "
                        "(profile_export.jsonl records or profile_export_aiperf.json) or guidellm (benchmarks.json "
                        "with metadata.guidellm_version): nothing imported")


def _held_requests(m: Measured) -> Measured:
    """A file with per-request times holds the requests it counts as completed: lists left empty or cut short
    would make a run of fewer requests (or none) than the tool measured."""
    if m.sent is None:
        return m
    done = sum(s.error is None for s in m.sent)
    if not m.sent or done != m.completed:
        raise LlmadaptError(f"{m.path}: its per-request lists hold {len(m.sent)} requests ({done} completed), its "
                            f"count says {m.completed} completed: nothing imported")
    return m


def _date(text: Any, fmt: str) -> float | None:
    try:
        return dt.datetime.strptime(str(text), fmt).timestamp()
    except ValueError:
        return None


_LARGEST = 1e19
"""No figure of these files reaches it (AIPerf's nanosecond Unix times are about 1.8e18): a larger one is not a
measurement, and would overflow the nanoseconds a request record holds."""


def _shown(value: Any) -> str:
    return json.dumps(value, default=str)[:40]


def _number(value: Any, path: Path, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LlmadaptError(f"{path}: {what} is {_shown(value)}, not a number: nothing imported")
    if abs(value) >= _LARGEST:
        raise LlmadaptError(f"{path}: {what} is {value:g}, out of range (a figure below {_LARGEST:g}): nothing "
                            "imported")
    return float(value)


def _count(value: Any, path: Path, what: str) -> int:
    """A whole number >= 0: a count of requests or tokens, a concurrency."""
    number = _number(value, path, what)
    if number < 0 or not number.is_integer():
        raise LlmadaptError(f"{path}: {what} is {_shown(value)}, expected a whole number >= 0: nothing imported")
    return int(number)


def _object(value: Any, path: Path, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise LlmadaptError(f"{path}: {what} is {_shown(value)}, expected an object: nothing imported")
    return value


def _list(value: Any, path: Path, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise LlmadaptError(f"{path}: {what} is {_shown(value)}, expected a list: nothing imported")
    return value


def _text(value: Any, path: Path, what: str) -> str | None:
    """An optional text (a model's name, a URL, a version)."""
    if value is not None and not isinstance(value, str):
        raise LlmadaptError(f"{path}: {what} is {_shown(value)}, expected a text: nothing imported")
    return value


# -- vllm bench serve --------------------------------------------------------------------------------
VLLM_DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors")
"""Per-request lists `vllm bench serve --save-detailed` writes (times in seconds)."""


def _vllm_bench(data: dict[str, Any], path: Path) -> Measured:
    what = "vllm bench serve result"
    _need(data, path, what, ("completed", "duration", "num_prompts", "request_rate", "max_concurrency"))
    rate, prompts = data["request_rate"], _count(data["num_prompts"], path, "num_prompts")
    most = _count(data["max_concurrency"], path, "max_concurrency") if data["max_concurrency"] is not None else None
    if most and rate in ("inf", None):
        arrival = {"process": "closed", "concurrency": most}
    elif rate in ("inf", None):
        arrival = {"process": "closed", "concurrency": prompts}  # every request at once
    else:
        burst = _number(data.get("burstiness", 1.0), path, "burstiness")
        arrival = {"process": "poisson" if burst == 1.0 else "gamma", "rate": _number(rate, path, "request_rate"),
                   **({"burstiness": burst} if burst != 1.0 else {})}
        if most:
            arrival["max_concurrency"] = most
    reported: dict[str, tuple[float, str]] = {"duration": (_number(data["duration"], path, "duration"), "s")}
    for key, unit in (("completed", "requests"), ("failed", "requests"), ("request_throughput", "req/s"),
                      ("request_goodput", "req/s"), ("output_throughput", "tok/s"), ("total_token_throughput", "tok/s"),
                      ("total_input_tokens", "tokens"), ("total_output_tokens", "tokens")):
        if data.get(key) is not None:
            reported[key] = (_number(data[key], path, key), unit)
    for key, value in data.items():
        if key.endswith("_ms") and key.split("_")[0] in ("mean", "median", "std") or key[:1] == "p" and \
                key.endswith(("_ttft_ms", "_tpot_ms", "_itl_ms", "_e2el_ms")):
            if value is not None:
                reported[key] = (_number(value, path, key), "ms")
    sent = None
    if any(k in data for k in VLLM_DETAILED):
        _need(data, path, what + " saved with --save-detailed", VLLM_DETAILED)
        lists = {k: _list(data[k], path, k) for k in VLLM_DETAILED}
        n = len(lists["ttfts"])
        if any(len(lists[k]) != n for k in VLLM_DETAILED):
            raise LlmadaptError(f"{path}: its per-request lists ({', '.join(VLLM_DETAILED)}) differ in length: "
                                "nothing imported")
        sent = []
        for i in range(n):
            start = _number(data["start_times"][i], path, f"start_times[{i}]")
            error = data["errors"][i] or None
            inputs = _count(data["input_lens"][i], path, f"input_lens[{i}]")
            if error:
                sent.append(Sent(start, None, None, [], inputs, None, error=str(error)))
                continue
            ttft = _number(data["ttfts"][i], path, f"ttfts[{i}]")  # seconds
            chunks = [start + ttft]
            for gap in _list(data["itls"][i], path, f"itls[{i}]"):  # seconds between chunks after the first
                chunks.append(chunks[-1] + _number(gap, path, f"itls[{i}]"))
            sent.append(Sent(start, ttft, start + _number(data["latencies"][i], path, f"latencies[{i}]"), chunks,
                             inputs, _count(data["output_lens"][i], path, f"output_lens[{i}]")))
    return Measured(tool="vllm-bench", version=_text(data.get("vllm_version"), path, "vllm_version"), path=path,
                    created=_date(data.get("date"), "%Y%m%d-%H%M%S"),
                    model=_text(data.get("model_id"), path, "model_id"),
                    url=_text(data.get("base_url"), path, "base_url"), requests_asked=prompts, arrival=arrival,
                    sent=sent, reported=reported, completed=_count(data["completed"], path, "completed"),
                    failed=_count(data.get("failed") or 0, path, "failed"))


# -- guidellm -------------------------------------------------------------------------------------------
def _guidellm(data: dict[str, Any], path: Path) -> Measured:
    what = "guidellm report"
    benchmarks = data.get("benchmarks")
    if not isinstance(benchmarks, list) or len(benchmarks) != 1:
        raise LlmadaptError(f"{path}: a {what} with {len(benchmarks) if isinstance(benchmarks, list) else 'no'} "
                            "benchmarks; import one at a time (one load point: `guidellm run` with one profile rate "
                            "or stream count): nothing imported")
    b = _object(benchmarks[0], path, "benchmarks[0]")
    _need(b, path, what + "'s benchmark", ("config", "requests", "metrics", "start_time"))
    config = _object(b["config"], path, "benchmarks[0].config")
    strategy = _object(config.get("strategy") or {}, path, "benchmarks[0].config.strategy")
    kind = strategy.get("type_")
    if kind == "concurrent":
        arrival = {"process": "closed", "concurrency": _count(strategy.get("streams") or strategy.get(
            "max_concurrency"), path, "config.strategy.streams")}
    elif kind == "synchronous":
        arrival = {"process": "closed", "concurrency": 1}
    elif kind in ("constant", "poisson"):
        arrival = {"process": kind, "rate": _number(strategy.get("rate"), path, "config.strategy.rate")}
    else:
        raise LlmadaptError(f"{path}: a {what} of strategy {kind!r}: llmadapt's arrival processes take concurrent, "
                            "synchronous, constant and poisson: nothing imported")
    requests = _object(b["requests"], path, "benchmarks[0].requests")
    sent = []
    for status in ("successful", "errored", "incomplete"):
        for i, r in enumerate(_list(requests.get(status) or [], path, f"requests.{status}")):
            where = f"requests.{status}[{i}]"
            _need(_object(r, path, where), path, f"{what}'s request", ("request_start_time", "prompt_tokens"))
            start = _number(r["request_start_time"], path, where + ".request_start_time")  # Unix seconds
            inputs = _count(r["prompt_tokens"] or 0, path, where + ".prompt_tokens")
            if status != "successful":
                info = r.get("info")
                error = (info.get("error") if isinstance(info, dict) else None) or status
                sent.append(Sent(start, None, None, [], inputs, None, error=str(error)))
                continue
            _need(r, path, f"{what}'s request", ("time_to_first_token_ms", "request_end_time", "output_tokens"))
            ttft = _number(r["time_to_first_token_ms"], path, where + ".time_to_first_token_ms") / 1e3  # ms -> s
            end = _number(r["request_end_time"], path, where + ".request_end_time")
            sent.append(Sent(start, ttft, end, [start + ttft], inputs,
                             _count(r["output_tokens"], path, where + ".output_tokens")))
    sent.sort(key=lambda s: s.start_s)
    reported: dict[str, tuple[float, str]] = {"duration": (_number(b.get("duration", 0.0), path, "duration"), "s")}
    metrics = _object(b["metrics"], path, "benchmarks[0].metrics")
    for name, key, scale, unit in (("ttft", "time_to_first_token_ms", 1.0, "ms"),
                                   ("tpot", "inter_token_latency_ms", 1.0, "ms"),
                                   ("e2el", "request_latency", 1e3, "ms")):  # guidellm's latency is in seconds
        figures = _object(metrics.get(key) or {}, path, f"metrics.{key}").get("successful")
        if figures:
            figures = _object(figures, path, f"metrics.{key}.successful")
            reported[f"mean_{name}_ms"] = (_number(figures.get("mean"), path, f"{key}.mean") * scale, unit)
            reported[f"median_{name}_ms"] = (_number(figures.get("median"), path, f"{key}.median") * scale, unit)
            percentiles = _object(figures.get("percentiles") or {}, path, f"metrics.{key}.successful.percentiles")
            for q in ("p90", "p99"):
                if q in percentiles:
                    reported[f"{q}_{name}_ms"] = (_number(percentiles[q], path, f"{key}.{q}") * scale, unit)
    totals = _object(metrics.get("request_totals") or {}, path, "metrics.request_totals")
    backend = _object(config.get("backend") or {}, path, "config.backend")
    return Measured(tool="guidellm", version=_text(data["metadata"].get("guidellm_version"), path,
                                                   "metadata.guidellm_version"), path=path,
                    created=_number(b["start_time"], path, "start_time"),
                    model=_text(backend.get("model"), path, "config.backend.model"),
                    url=_text(backend.get("target"), path, "config.backend.target"),
                    requests_asked=_max_requests(config, path), arrival=arrival, sent=sent, reported=reported,
                    completed=_count(totals.get("successful", len(requests.get("successful") or [])), path,
                                     "metrics.request_totals.successful"),
                    failed=sum(_count(totals.get(k, 0), path, f"metrics.request_totals.{k}")
                               for k in ("errored", "incomplete")), per_chunk=False)


def _max_requests(config: dict[str, Any], path: Path) -> int | None:
    where = "config.constraints.max_requests.args"
    limit = _object(_object(_object(config.get("constraints") or {}, path, "config.constraints").get(
        "max_requests") or {}, path, "config.constraints.max_requests").get("args") or {}, path, where)
    count = limit.get("count")
    return _count(count, path, where + ".count") if count is not None else None


# -- AIPerf -----------------------------------------------------------------------------------------------
AIPERF_AGGREGATE = "profile_export_aiperf.json"
"""AIPerf's aggregate export, written beside its per-request ``profile_export.jsonl``: the run's configuration."""

AIPERF_FIGURES = {"ttft": "time_to_first_token", "tpot": "inter_token_latency", "itl": "inter_chunk_latency",
                  "e2el": "request_latency"}
"""llmadapt's names -> AIPerf's: its 'inter token latency' is (latency - TTFT) / (output tokens - 1), our TPOT; its
'inter chunk latency', the gaps between content chunks, is our ITL."""

_MS = {"ms": 1.0, "sec": 1e3, "s": 1e3, "ns": 1e-6, "us": 1e-3}
"""AIPerf's time units -> milliseconds."""


def _aiperf_ms(entry: Any, path: Path, what: str, *, many: bool = False) -> Any:
    """An AIPerf metric ({'value': ..., 'unit': 'ms'}) in ms: a number, or (``many``) a list of them."""
    if not isinstance(entry, dict) or "value" not in entry or _unit(entry) not in _MS:
        raise LlmadaptError(f"{path}: {what} is {json.dumps(entry, default=str)[:60]}, not a time with a unit AIPerf "
                            f"writes ({', '.join(_MS)}): nothing imported")
    scale, value = _MS[entry["unit"]], entry["value"]
    if many:
        return [_number(v, path, what) * scale for v in _list(value, path, what + " value")]
    return _number(value, path, what) * scale


def _unit(entry: dict[str, Any]) -> str | None:
    """An AIPerf metric's unit where it is a text (a key of _MS or not), else None."""
    unit = entry.get("unit")
    return unit if isinstance(unit, str) else None


def _aiperf_tokens(metrics: dict[str, Any], names: tuple[str, ...], path: Path, what: str) -> int | None:
    """The first of NAMES that the record holds, a count of tokens ({'value': N, 'unit': 'tokens'})."""
    for name in names:
        if metrics.get(name):
            value = _object(metrics[name], path, f"{what} {name}").get("value")
            return _count(value, path, f"{what} {name}") if value is not None else None
    return None


def _aiperf_config(config: dict[str, Any], path: Path) -> tuple[dict[str, Any], int | None, str | None, str | None]:
    """(arrival, requests, model, url) from an AIPerf input_config."""
    config = _object(config, path, "input_config")
    phases = [p for i, p in enumerate(_list(config.get("phases") or [], path, "input_config.phases"))
              if _object(p, path, f"input_config.phases[{i}]").get("kind", "profiling") == "profiling"]
    if len(phases) != 1:
        raise LlmadaptError(f"{path}: an AIPerf export of {len(phases)} profiling phases; one is a run: nothing "
                            "imported")
    phase = phases[0]
    if phase.get("type") == "concurrency" and not phase.get("rate"):
        arrival: dict[str, Any] = {"process": "closed", "concurrency": _count(
            phase.get("concurrency") or 1, path, "input_config.phases[].concurrency")}
    elif phase.get("rate"):
        pattern = phase.get("arrival_pattern") or phase.get("request_rate_mode") or "poisson"
        arrival = {"process": pattern if pattern in ("constant", "poisson", "gamma") else "poisson",
                   "rate": _number(phase["rate"], path, "input_config.phases[].rate")}
        if phase.get("concurrency"):
            arrival["max_concurrency"] = _count(phase["concurrency"], path, "input_config.phases[].concurrency")
    else:
        raise LlmadaptError(f"{path}: an AIPerf phase of type {phase.get('type')!r} without a rate: llmadapt's "
                            "arrivals take a concurrency or a request rate: nothing imported")
    items = _object(config.get("models") or {}, path, "input_config.models").get("items") or []
    models = [_text(_object(m, path, "input_config.models.items[]").get("name"), path,
                    "input_config.models.items[].name") for m in _list(items, path, "input_config.models.items")]
    urls = _list(_object(config.get("endpoint") or {}, path, "input_config.endpoint").get("urls") or [None], path,
                 "input_config.endpoint.urls")
    requests = phase.get("requests")
    requests = _count(requests, path, "input_config.phases[].requests") if requests is not None else None
    url = _text(urls[0], path, "input_config.endpoint.urls[0]")
    return arrival, requests, ", ".join(filter(None, models)) or None, url


def _aiperf_reported(data: dict[str, Any], path: Path) -> dict[str, tuple[float, str]]:
    """AIPerf's aggregate figures, under vllm bench's names where one means the same (mean/median/p90/p99 ms)."""
    out: dict[str, tuple[float, str]] = {}
    for ours, theirs in AIPERF_FIGURES.items():
        entry = data.get(theirs)
        if not isinstance(entry, dict):
            continue
        scale = _MS.get(_unit(entry))
        if scale is None:
            raise LlmadaptError(f"{path}: {theirs} has unit {entry.get('unit')!r}, not one AIPerf writes for times: "
                                "nothing imported")
        for key, name in (("avg", "mean"), ("p50", "median"), ("std", "std"), ("min", "min"), ("p90", "p90"),
                          ("p95", "p95"), ("p99", "p99"), ("max", "max"), ("count", "count")):
            if entry.get(key) is not None:
                if key == "count":  # values measured (ITL: gaps), not a time
                    out[f"count_{ours}"] = (_number(entry[key], path, f"{theirs}.count"), "values")
                else:
                    out[f"{name}_{ours}_ms"] = (_number(entry[key], path, f"{theirs}.{key}") * scale, "ms")
    for key, name, unit in (("request_throughput", "request_throughput", "req/s"),
                            ("output_token_throughput", "output_throughput", "tok/s"),
                            ("total_token_throughput", "total_token_throughput", "tok/s")):
        if isinstance(data.get(key), dict) and data[key].get("avg") is not None:
            out[name] = (_number(data[key]["avg"], path, key), unit)
    if isinstance(data.get("benchmark_duration"), dict):
        out["duration"] = (_number(data["benchmark_duration"].get("avg"), path, "benchmark_duration") *
                           _MS.get(_unit(data["benchmark_duration"]), 1e3) / 1e3, "s")
    return out


def _aiperf_aggregate(data: dict[str, Any], path: Path) -> Measured:
    """profile_export_aiperf.json alone: aggregate figures, a summary-only run."""
    arrival, requests, model, url = _aiperf_config(data["input_config"], path)
    reported = _aiperf_reported(data, path)
    count = _object(data.get("request_count") or {}, path, "request_count").get("avg")
    errors = sum(_count(e.get("count", 0), path, "error_summary[].count")
                 for e in _list(data.get("error_summary") or [], path, "error_summary") if isinstance(e, dict))
    completed = _count(count, path, "request_count.avg") if count is not None else 0
    return Measured(tool="aiperf", version=_text(data.get("aiperf_version"), path, "aiperf_version"), path=path,
                    created=_iso(data.get("start_time")), model=model, url=url, requests_asked=requests,
                    arrival=arrival, sent=None, reported=reported, completed=completed, failed=errors)


def _iso(text: Any) -> float | None:
    try:
        return dt.datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return None


def _aiperf_records(records: list[dict[str, Any]], path: Path) -> Measured:
    """profile_export.jsonl: a record per request (times in ms, timestamps in ns); the run's configuration and
    AIPerf's version from profile_export_aiperf.json beside it."""
    beside = path.parent / AIPERF_AGGREGATE
    try:
        aggregate = json.loads(beside.read_text())
        config = aggregate["input_config"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        raise LlmadaptError(f"{path}: AIPerf's per-request records need {AIPERF_AGGREGATE} beside them (the run's "
                            "concurrency or rate, model and AIPerf version), and there is none readable: nothing "
                            "imported") from None
    arrival, requests, model, url = _aiperf_config(config, beside)
    sent = []
    for i, r in enumerate(records):
        where = f"line {i + 1}"
        meta = _object(r["metadata"], path, f"{where} metadata")
        metrics = _object(r["metrics"], path, f"{where} metrics")
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue  # warm-up requests
        if "request_start_ns" not in meta:
            raise LlmadaptError(f"{path}: {where}: a record without metadata.request_start_ns: nothing imported")
        start = _number(meta["request_start_ns"], path, f"{where} request_start_ns") / 1e9  # ns -> s
        inputs = _aiperf_tokens(metrics, ("usage_prompt_tokens", "input_sequence_length"), path, where) or 0
        if r.get("error") or "time_to_first_token" not in metrics:
            error = r.get("error") or "no time to first token recorded"
            sent.append(Sent(start, None, None, [], inputs, None,
                             error=str(error.get("message", error) if isinstance(error, dict) else error)))
            continue
        for key in ("time_to_first_token", "request_latency"):
            if key not in metrics:
                raise LlmadaptError(f"{path}: {where}: a record without metrics.{key}: nothing imported")
        ttft = _aiperf_ms(metrics["time_to_first_token"], path, f"{where} time_to_first_token") / 1e3  # ms -> s
        chunks = [start + ttft]
        for gap in _aiperf_ms(metrics.get("inter_chunk_latency", {"value": [], "unit": "ms"}), path,
                              f"{where} inter_chunk_latency", many=True):
            chunks.append(chunks[-1] + gap / 1e3)
        latency = _aiperf_ms(metrics["request_latency"], path, f"{where} request_latency") / 1e3
        # the engine's count (usage) where AIPerf recorded it; else AIPerf's own count of the text, re-tokenized
        outputs = _aiperf_tokens(metrics, ("usage_completion_tokens", "output_sequence_length"), path, where)
        sent.append(Sent(start, ttft, start + latency, chunks, inputs, outputs))
    sent.sort(key=lambda s: s.start_s)
    return Measured(tool="aiperf", version=_text(aggregate.get("aiperf_version"), path, "aiperf_version"), path=path,
                    created=_iso(aggregate.get("start_time")), model=model, url=url, requests_asked=requests,
                    arrival=arrival, sent=sent, reported=_aiperf_reported(aggregate, beside),
                    completed=sum(1 for s in sent if s.error is None), failed=sum(1 for s in sent if s.error))


# -- the run folder -------------------------------------------------------------------------------------
def stated_facts(m: Measured) -> dict[str, Any]:
    """What the file states about its stream, the input of a problem built from the file alone."""
    inputs = sorted({s.input_tokens for s in m.sent}) if m.sent else None
    outputs = sorted({s.output_tokens for s in m.sent if s.output_tokens is not None}) if m.sent else None
    return {"tool": m.tool, "model": m.model, "requests": m.requests_asked or m.completed + m.failed,
            "arrival": m.arrival, "input_tokens": inputs, "output_tokens": outputs}


def workload_from_file(m: Measured) -> Workload:
    """A serve workload of the facts the file states (a label: its problem hash is the facts', not this one's)."""
    facts = stated_facts(m)

    def lengths(values: list[int] | None, default: int) -> dict[str, Any]:
        if not values:
            return {"dist": "fixed", "mean": default}
        if len(values) == 1:
            return {"dist": "fixed", "mean": values[0]}
        return {"dist": "uniform", "low": values[0], "high": values[-1], "mean": round(statistics.mean(values))}

    arrival = {k: v for k, v in m.arrival.items() if k != "max_concurrency"}
    serve = {"requests": facts["requests"], "warmup_requests": 0, "arrival": arrival, "ignore_eos": False,
             "input_len": lengths(facts["input_tokens"], 32), "output_len": lengths(facts["output_tokens"], 16)}
    if "max_concurrency" in m.arrival:
        serve["max_concurrency"] = m.arrival["max_concurrency"]
    name = f"{m.tool}: {Path(m.model).name if m.model else 'model not stated'}"[:120]
    return Workload.from_dict({"kind": "serve", "name": name, "serve": serve})


def check_against(m: Measured, workload: Workload) -> None:
    """Every fact the file states, against the workload said to be its stream; a disagreement is one line."""
    s = workload.serve
    wrong = []
    total = m.completed + m.failed if m.sent is None else len(m.sent)
    if total != s.requests:
        wrong.append(f"{total} requests measured, the workload has serve.requests={s.requests}")
    a = s.arrival
    if m.arrival["process"] == "closed":
        if a.process != "closed" or a.concurrency != m.arrival["concurrency"]:
            wrong.append(f"a closed loop of {m.arrival['concurrency']} in flight, the workload has "
                         + (f"serve.arrival.concurrency={a.concurrency}" if a.process == "closed" else
                            f"serve.arrival.process={a.process!r}"))
    elif a.process != m.arrival["process"] or not math.isclose(a.rate, m.arrival["rate"]):
        wrong.append(f"{m.arrival['process']} arrivals at {m.arrival['rate']:g} req/s, the workload has "
                     f"serve.arrival.process={a.process!r} at rate {a.rate:g}")
    for name, spec, values in (("input", s.input_len, [x.input_tokens for x in m.sent or []]),
                               ("output", s.output_len, [x.output_tokens for x in m.sent or []
                                                         if x.output_tokens is not None and x.error is None])):
        if name == "output" and not s.ignore_eos:
            continue  # lengths as the engine chose: nothing to hold them to
        low, high = (spec.mean, spec.mean) if spec.dist == "fixed" else (spec.low, spec.high)
        outside = [v for v in values if not low <= v <= high]
        if spec.dist in ("fixed", "uniform") and outside:
            wrong.append(f"{len(outside)} request(s) of {outside[0]} {name} tokens, the workload's serve.{name}_len is "
                         + (f"{low}" if low == high else f"{low}..{high}"))
    if wrong:
        raise LlmadaptError(f"{m.path}: not the stream of the workload given: {'; '.join(wrong)}: nothing imported")


def facts_line(m: Measured) -> str:
    f = stated_facts(m)
    arrival = (f"closed loop of {m.arrival['concurrency']}" if m.arrival["process"] == "closed" else
               f"{m.arrival['process']} {m.arrival['rate']:g} req/s")
    lengths = "".join(f", {k.split('_')[0]} {v[0] if len(v) == 1 else f'{v[0]}..{v[-1]}'} tokens"
                      for k, v in (("input_tokens", f["input_tokens"]), ("output_tokens", f["output_tokens"])) if v)
    return f"model {m.model or 'not stated'}, {f['requests']} requests, {arrival}{lengths}"


def with_version(m: Measured, version: str | None) -> Measured:
    """The tool's version as the user states it, for a file that does not say (vllm bench's result has none); a
    file that states its own keeps it."""
    return m if version is None or m.version is not None else attrs.evolve(m, version=version)


def stream_workload(path: str | Path) -> Workload:
    """The workload named by `runs import --workload`: a workload file, or a run folder (its launch.json's)."""
    if Path(path).is_dir():
        if not RunDir(path).launch_file.is_file():
            raise LlmadaptError(f"--workload {path}: a folder that is not a run folder (no launch.json)")
        workload = RunDir(path).read_launch().require_workload()
    else:
        workload = Workload.from_file(path)
    if workload.kind != "serve":
        raise LlmadaptError(f"--workload {path}: a {workload.kind} workload; result files of serving tools need a "
                            "serve workload")
    return workload


