"""Old path of the serving types and helpers (before 0.2), kept for one release for adapters written against it.

New code imports ``ServeContext``, ``PlannedRequest``, ``Chunk``, ``RequestFailed``, ``WrongServer`` and
``engine_popen_options`` from ``llmadapt.adapter``; the load generator is ``llmadapt.runtime.loadgen``, the
request plan ``llmadapt.runtime.requests``, the serving statistics ``llmadapt.contract.stats``. Nothing inside
llmadapt imports this module."""

from llmadapt.adapter.context import (
           Chunk,
           PlannedRequest,
           RequestFailed,
           ServeContext,
           WrongServer,
           engine_popen_options,
)
from llmadapt.compat import moved
from llmadapt.contract.stats import serving_stats, vllm_bench_keys
from llmadapt.runtime.loadgen import LoadGenerator
from llmadapt.runtime.requests import plan_requests

moved("llmadapt.serving", "llmadapt.adapter (and llmadapt.runtime.loadgen, llmadapt.runtime.requests, "
      "llmadapt.contract.stats)", __name__)

__all__ = ["Chunk", "LoadGenerator", "PlannedRequest", "RequestFailed", "ServeContext", "WrongServer",
           "engine_popen_options", "plan_requests", "serving_stats", "vllm_bench_keys"]
