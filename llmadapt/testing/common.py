"""What both conformance suites use: a skip reason for an adapter whose environment is not built, and a child
process a test can Ctrl-C."""

from __future__ import annotations

from llmadapt.adapter.plugins import get_adapter
from llmadapt.errors import EnvironmentNotReadyError, UnknownAdapterError
from llmadapt.launch.environments import python_for


def interruptible() -> None:
    """``preexec_fn`` for a process a test will Ctrl-C: SIGINT back to its default. A shell that starts a
    job in the background (``cmd &``, nohup, some CI runners) leaves SIGINT ignored in it and every child,
    and a Ctrl-C test would then wait for nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def environments_unready(*adapters: str) -> str | None:
    """Why these adapters cannot run here (not registered, environment not built), or None: a skip reason."""
    for name in adapters:
        try:
            spec = get_adapter(name).environment
            if spec is not None:  # None: the adapter runs in this process (one that attaches to a server by URL)
                python_for(spec)
        except (UnknownAdapterError, EnvironmentNotReadyError) as exc:
            return str(exc)
    return None

