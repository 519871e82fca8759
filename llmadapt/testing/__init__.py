"""The adapter conformance suites: import them in your adapter's tests, first- or third-party.

    from llmadapt.testing import AdapterConformance

    class TestMyAdapter(AdapterConformance):
        adapter = "mine"

Every test runs the standard tiny workloads for real, through the same launcher users get,
in the adapter's own environment (build it first: ``llmadapt env create NAME``). It checks
that every record validates against the contract, that the fp32 loss trajectory matches the
reference adapter's on the canonical checkpoint, and that failures (an exception, a killed
worker, a hang) leave every record made before them plus a failure record with the cause.
Tests for what the adapter does not declare (fine-tuning, MoE, data parallel) are skipped.

Server adapters have their own suite, imported the same way::

    from llmadapt.testing import ServerConformance

    class TestMyServer(ServerConformance):
        adapter = "mine"

It starts the engine once (or attaches to a URL) through the serving launcher and checks the request plan, token
counts, streaming shape, refused and truncated requests, and the clean stop (see ``ServerConformance``).

The training suite is ``llmadapt.testing.training``, the serving suite ``llmadapt.testing.serving``; what both use
(a skip reason for an environment not built, a Ctrl-C-able child) is ``llmadapt.testing.common``.
"""

from llmadapt.testing.common import environments_unready, interruptible
from llmadapt.testing.serving import (MARK, REJECTION_CAUSES, SERVE_MODEL, CuttingProxy, ServerConformance,
                                      ServingOutcome, marked_processes, serve_workload)
from llmadapt.testing.training import INSTRUCTIONS, AdapterConformance, standard_workloads

__all__ = ["INSTRUCTIONS", "MARK", "REJECTION_CAUSES", "SERVE_MODEL", "AdapterConformance", "CuttingProxy",
           "ServerConformance", "ServingOutcome", "environments_unready", "interruptible", "marked_processes",
           "serve_workload", "standard_workloads"]
