"""What runs inside a worker process (``python -m llmadapt.runtime RUN_DIR``: training, the micro-benchmarks,
offline serving; llmadapt.runtime.kinds) and the client-side load generator.

- worker: the training/fine-tuning worker: its loop, its records, how it ends
- microbench: the micro-benchmark worker (operators, peak, collectives)
- offline: the offline-serving worker (serve.mode = "offline": the engine's offline API over the request plan)
- lifecycle: how every worker process starts and stops, and WorkerProcess, the shell all three run in (stop
  signal, orphan watch, the End or failure record, teardown, gloo-safe exit)
- device: the rank's place, its device, memory snapshots, the software it runs
- data: the synthetic and file token data, in the same global order on every layout
- requests, loadgen: the request plan of a serving run and the load generator that sends it

Kept light on import: torch is imported inside functions, so the orchestrator can run the load generator.
"""

from llmadapt.adapter.context import WorkerContext  # noqa: E402 - its old path (0.1), kept for one release

__all__ = ["WorkerContext"]
