"""The old home of a run folder's read-back (``summarise``, ``load_records``, ``RunResult``), which is the
contract's now: llmadapt.contract.readback. Kept for code that imports it from here; removed in 0.3.0."""

from llmadapt.contract.readback import RunResult, load_records, summarise, write_launcher_failures

__all__ = ["RunResult", "load_records", "summarise", "write_launcher_failures"]
