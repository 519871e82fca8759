"""The hooks an adapter package implements. Entry-point group: ``llmadapt``."""

from __future__ import annotations

from typing import Any, Callable

import pluggy

hookspec = pluggy.HookspecMarker("llmadapt")


hookimpl = pluggy.HookimplMarker("llmadapt")


@hookspec
def llmadapt_register_adapters(register: Callable[..., None]) -> None:
    """Register adapters by calling ``register(AdapterInfo(...))`` once per adapter.

    Runs in the orchestrator, which must stay light: import no framework here. The classes
    that do the work are named by import path in ``AdapterInfo.roles`` and imported only
    inside the adapter's own environment, in the worker process.

    :param register: call with an :class:`llmadapt.AdapterInfo`; registering a name twice
        raises an error naming both plugins.

    .. versionadded:: 0.1
    """


@hookspec
def llmadapt_record_sink(run: dict[str, Any]) -> Any:
    """A sink for one run's records (a tracking tool: TensorBoard, MLflow, ...), or None to stay out of it.

    Called in the orchestrator when a run starts. ``run`` holds ``run_id``, ``run_dir``, ``adapter``,
    ``label``, ``world_size`` and ``workload`` (its dict). The sink's ``write(record)`` then receives each
    record as the orchestrator sees it (rank 0's steps, breakdowns, telemetry, metrics and failures; a serving
    run's requests; an inline run's at its end), as a dict in the metrics contract, and ``close(summary)`` the
    summary once the run is over. Keep it light and quick: it runs beside the measurement. A sink that raises
    is dropped with a warning; the run goes on.

    :param run: what the run is, as above.
    :returns: an object with ``write(record)`` and ``close(summary)``, or None.

    .. versionadded:: 0.2
    """


@hookspec
def llmadapt_experiment_sink(experiment: dict[str, Any]) -> Any:
    """A sink for one experiment (several runs planned together: a comparison), or None to stay out of it.

    Called in the orchestrator before the experiment's first run. ``experiment`` holds ``kind`` ('compare'),
    ``name``, ``out`` (the folder its runs go to) and ``cells`` (their titles). The runs made until it closes
    are made in the same thread, so a sink may group their record sinks under it (MLflow: a parent run). Its
    ``close(result, status)`` receives the experiment's result as a dict (a comparison's ``to_dict()``: each
    row's runs, status and metrics, the parity delta among them) and ``status``: 'FINISHED', 'FAILED' (the
    experiment raised) or 'KILLED' (interrupted; the result then holds the runs made so far). A sink that raises
    is dropped with a warning; the experiment goes on.

    :param experiment: what the experiment is, as above.
    :returns: an object with ``close(result, status)``, or None.

    .. versionadded:: 0.2
    """
