"""The hooks an adapter package implements. Entry-point group: ``llmadapt``."""

from __future__ import annotations

from typing import Callable

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
