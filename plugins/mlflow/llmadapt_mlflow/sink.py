"""Each llmadapt run as an MLflow run, written through the tracking client (mlflow-skinny) as the run goes.

At the start: the run (named by its label), the workload's settings as parameters (``train.steps``,
``model.name``, ...) and tags naming the llmadapt run. Per record: metrics with their units in the name
(``step_time_s``, ``loss``, ``tokens_per_s``, ``ttft_ms``, ``telemetry/rss_bytes``, ``breakdown/<class>_s``: the
names every tracking sink uses, llmadapt.adapter.tracking), sent in batches. At the end: the summary's figures
under ``summary.``, the tags ``llmadapt.status``,
``llmadapt.problem_hash`` and ``llmadapt.workload_hash``, the run folder's files under the artifact folder
``run/`` and the text of ``llmadapt show`` as ``report.txt``; the MLflow run ends FINISHED, or FAILED for a
failed or diverged run, or KILLED when the orchestrator stopped.

A tracking server that does not answer is said once, in one line, and the run goes on recorded locally as
always (llmadapt.launch.sinks drops a sink that raises). mlflow's own HTTP client retries for minutes; this
sink keeps to seconds unless ``MLFLOW_HTTP_REQUEST_*`` say otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator

from llmadapt.adapter.tracking import RecordMetrics, summary_metrics
from llmadapt.analysis.report import summary_text

DEFAULT_EXPERIMENT = "llmadapt"
"""The experiment runs go to unless ``MLFLOW_EXPERIMENT_NAME`` names another."""
FLUSH_EVERY_S = 5.0
PROBE_TIMEOUT_S = 5.0
BATCH_METRICS = 1000  # MLflow's limits for one log_batch call
BATCH_PARAMS = 100
PARAM_VALUE_MAX = 6000
# While the sink calls the client: HTTP retries and timeouts of seconds, and no "View run at" line on stdout
# (a command's --json output is there).
QUICK_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": "15", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
PARENT_RUN_VAR = "LLMADAPT_MLFLOW_PARENT_RUN_ID"
END_STATUS = {"ok": "FINISHED", "degraded": "FINISHED", "failed": "FAILED", "diverged": "FAILED"}

current_parent: ContextVar[tuple[str, str] | None] = ContextVar("llmadapt_mlflow_parent", default=None)
"""(run id, experiment id) of the parent run that ``parent_run`` opened, if any."""


# -- helpers ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def quick_http() -> Iterator[None]:
    """mlflow's HTTP retries and timeout kept to seconds, and its printing off, while the sink calls the server
    (settings the user made win)."""
    added = {k: v for k, v in QUICK_HTTP.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def check_answers(uri: str) -> None:
    """An HTTP tracking URI must answer within seconds (any answer counts); raises ConnectionError in one line."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S)
    except requests.Timeout:
        why = f"no answer in {PROBE_TIMEOUT_S:.0f} s"
    except requests.RequestException as exc:
        why = "connection refused" if "refused" in str(exc).lower() else type(exc).__name__
    else:
        return
    raise ConnectionError(f"MLflow tracking server {uri} answers nothing ({why}); the run is recorded locally only")


def flat_params(settings: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested settings dict as MLflow parameters with dotted names: {"train": {"steps": 3}} -> {"train.steps":
    "3"}. Lists and empty tables as JSON; values cut at MLflow's limit."""
    out: dict[str, str] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[name] = text[:PARAM_VALUE_MAX]
    return out


def metric_name(text: str) -> str:
    """MLflow's metric names allow letters, digits, _ - . / : and spaces; anything else becomes _."""
    return re.sub(r"[^\w\-./: ]", "_", text)


def experiment_id(client, name: str) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # made by another process meanwhile
        return client.get_experiment_by_name(name).experiment_id


# -- the sink --------------------------------------------------------------------------------------------------------
class MlflowSink:
    """One llmadapt run's MLflow run: ``write(record)`` per record, ``close(summary)`` at the end."""

    def __init__(self, uri: str, run: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        check_answers(uri)
        self.client, self.run_dir = MlflowClient(tracking_uri=uri), Path(run["run_dir"])
        self.metrics: list[Any] = []
        self.metrics_of = RecordMetrics()
        self.flushed = time.monotonic()
        parent = current_parent.get()
        tags = {"llmadapt.run_id": run["run_id"], "llmadapt.run_dir": str(self.run_dir.resolve()),
                "llmadapt.adapter": str(run.get("adapter")), "llmadapt.world_size": str(run.get("world_size"))}
        with quick_http():
            if parent is not None:
                tags["mlflow.parentRunId"], experiment = parent
            elif os.environ.get(PARENT_RUN_VAR):
                tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_VAR]
                experiment = self.client.get_run(tags["mlflow.parentRunId"]).info.experiment_id
            else:
                experiment = experiment_id(self.client, os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT)
            made = self.client.create_run(experiment, run_name=run.get("label") or run["run_id"], tags=tags)
            self.mlflow_run_id = made.info.run_id
            params = [Param(k, v) for k, v in flat_params(run.get("workload") or {}).items()]
            for i in range(0, len(params), BATCH_PARAMS):
                self.client.log_batch(self.mlflow_run_id, params=params[i:i + BATCH_PARAMS])

    def _add(self, name: str, value: float, step: int, when_ms: int) -> None:
        from mlflow.entities import Metric

        self.metrics.append(Metric(metric_name(name), value, when_ms, step))

    def write(self, record: dict[str, Any]) -> None:
        for m in self.metrics_of(record):
            self._add(m.name, m.value, m.step, m.wall_ns // 1_000_000)
        if len(self.metrics) >= BATCH_METRICS or (self.metrics and time.monotonic() - self.flushed > FLUSH_EVERY_S):
            self.flush()

    def flush(self) -> None:
        pending, self.metrics = self.metrics, []
        with quick_http():
            for i in range(0, len(pending), BATCH_METRICS):
                self.client.log_batch(self.mlflow_run_id, metrics=pending[i:i + BATCH_METRICS])
        self.flushed = time.monotonic()

    def close(self, summary: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        status = END_STATUS.get(summary.get("status"), "KILLED") if summary else "KILLED"
        try:
            when = int(time.time() * 1000)
            for name, value in summary_metrics(summary).items():
                self._add(name, value, 0, when)
            self.flush()
            tags = {f"llmadapt.{k}": str(summary[k]) for k in ("status", "problem_hash", "workload_hash", "adapter",
                                                                "framework", "framework_version", "launcher")
                    if summary.get(k) is not None}
            with quick_http():
                if tags:
                    self.client.log_batch(self.mlflow_run_id, tags=[RunTag(k, v) for k, v in tags.items()])
                if self.run_dir.is_dir():
                    self.client.log_artifacts(self.mlflow_run_id, str(self.run_dir), artifact_path="run")
                if summary:
                    self.client.log_text(self.mlflow_run_id, summary_text(summary), "report.txt")
        finally:
            with quick_http():
                self.client.set_terminated(self.mlflow_run_id, status)


# -- several runs under one parent -----------------------------------------------------------------------------------
class ParentRun:
    """One MLflow run that the llmadapt runs made meanwhile (in this thread) become children of: opened at once,
    ``close(status)`` ends it. ``run_id`` is None when the server does not answer (said in one line)."""

    def __init__(self, uri: str, name: str, tags: dict[str, str] | None = None) -> None:
        self.run_id = self.token = None
        self.name = name
        try:
            from mlflow.tracking import MlflowClient

            check_answers(uri)
            self.client = MlflowClient(tracking_uri=uri)
            with quick_http():
                experiment = experiment_id(self.client, os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT)
                made = self.client.create_run(experiment, run_name=name[:250],
                                              tags={"llmadapt.parent": "true", **(tags or {})})
        except Exception as exc:  # noqa: BLE001 - tracking never stops the runs
            print(f"warning: MLflow parent run {name!r} not made: {exc}", file=sys.stderr)
            return
        self.run_id = made.info.run_id
        self.token = current_parent.set((made.info.run_id, experiment))

    def close(self, status: str) -> None:
        if self.token is not None:
            current_parent.reset(self.token)
            self.token = None
        if self.run_id is not None:
            with contextlib.suppress(Exception), quick_http():
                self.client.set_terminated(self.run_id, status)


@contextlib.contextmanager
def parent_run(name: str, *, tags: dict[str, str] | None = None, uri: str | None = None) -> Iterator[str | None]:
    """Every llmadapt run made inside the block (a comparison's cells, a sweep's points) becomes a child of one
    MLflow run named ``name``; yields its run id, or None when no tracking URI is set or the server does not
    answer (said in one line; the runs are made and recorded locally all the same)::

        with parent_run("recompute on/off"):
            llmadapt.compare("examples/tiny-llama.toml", ["torch"], matrix={"optimizations.recompute": ["none", "full"]})

    A comparison made outside such a block is a parent run of its own (``ComparisonRun``). Outside Python,
    ``LLMADAPT_MLFLOW_PARENT_RUN_ID`` names an existing run to put every run under.
    """
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        yield None
        return
    parent = ParentRun(uri, name, tags)
    status = "FAILED"
    try:
        yield parent.run_id
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        parent.close(status)


class ComparisonRun(ParentRun):
    """A comparison (``compare``, from Python or the command line) as a parent run, its runs the children. At its
    close: each child tagged with its row's parity delta (max |loss delta| against the first row of its problem),
    the comparison's rows as the artifact ``comparison.json``, its HTML report as ``report.html``, and its row
    count and statuses as tags."""

    def close(self, result: dict[str, Any], status: str) -> None:  # type: ignore[override]
        if self.run_id is not None:
            with contextlib.suppress(Exception), quick_http():
                self._tag_children(result)
                self.client.log_text(self.run_id, json.dumps(result, indent=1, default=str), "comparison.json")
                counts = result.get("counts") or {}
                for key, value in counts.items():
                    self.client.set_tag(self.run_id, f"llmadapt.rows_{key}", str(value))
            self._log_report(result)
        super().close(status)

    def _log_report(self, result: dict[str, Any]) -> None:
        """The comparison's HTML report (``llmadapt report`` of its runs) as the artifact report.html."""
        from llmadapt.analysis.htmlreport import report

        run_dirs = [d for row in result.get("rows") or [] for d in (row.get("run_dirs") or [row.get("run_dir")]) if d]
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = report(run_dirs, Path(tmp) / "report.html", title=self.name)
                with quick_http():
                    self.client.log_artifact(self.run_id, str(path))
        except Exception as exc:  # noqa: BLE001 - tracking never fails the comparison
            print(f"warning: MLflow run {self.name!r}: report.html not logged: {exc}", file=sys.stderr)

    def _tag_children(self, result: dict[str, Any]) -> None:
        children = {r.data.tags.get("llmadapt.run_id"): r.info.run_id for r in self.client.search_runs(
            [self.client.get_run(self.run_id).info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{self.run_id}'")}
        for row in result.get("rows") or []:
            delta = (row.get("metrics") or {}).get("parity_delta")
            for run_dir in row.get("run_dirs") or [row.get("run_dir")]:
                child = children.get(Path(run_dir).name) if run_dir else None
                if child is None:
                    continue
                self.client.set_tag(child, "llmadapt.row", str(row.get("label")))
                if delta is not None:
                    self.client.set_tag(child, "llmadapt.parity_delta", f"{delta:.3e}")
