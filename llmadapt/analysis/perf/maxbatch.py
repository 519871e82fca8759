"""A max-batch search as read from its folder (``probes.jsonl``): its probes and its result, as a table or CSV.
``llmadapt.experiments.maxbatch`` runs the search.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from llmadapt.contract.jsonl import read_jsonl
from llmadapt.contract.perf import MaxBatch, Probe
from llmadapt.contract.schema import to_json
from llmadapt.errors import LlmadaptError
from llmadapt.texttable import text_table


@attrs.frozen
class MaxBatchResult:
    search_dir: Path
    result: MaxBatch
    probes: list[Probe]

    @property
    def ok(self) -> bool:
        return self.result.status == "ok"

    def to_dict(self) -> dict:
        return {"search_dir": str(self.search_dir), "result": to_json(self.result),
                "probes": [to_json(p) for p in self.probes]}

    def table(self) -> str:
        head = ["batch", "outcome", "steps", "peak mem MiB", "step s", "samples/s", "probe s", "message"]
        body = []
        for p in self.probes:
            body.append([str(p.batch), p.outcome, str(p.steps_completed),
                         "-" if p.peak_memory_bytes is None else f"{p.peak_memory_bytes / 2**20:,.0f}",
                         "-" if p.step_time_s is None else f"{p.step_time_s:.4f}",
                         "-" if p.samples_per_s is None else f"{p.samples_per_s:,.1f}", f"{p.seconds:.1f}",
                         (p.message or "")[:90]])
        lines = text_table(head, body)
        r = self.result
        cap = (f"per-worker cap {r.memory_limit_bytes / 2**30:.2f} GiB ({r.memory_limit_kind})"
               if r.memory_limit_bytes else "no cap (the device's memory)")
        lines.append(f"result     {r.message}")
        lines.append(f"limit      {cap}; {r.probes} probes; trace {self.search_dir}")
        return "\n".join(lines)

    def csv(self) -> str:
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf)
        keys = ["batch", "outcome", "steps_completed", "peak_memory_bytes", "step_time_s", "samples_per_s",
                "memory_limit_bytes", "memory_limit_kind", "seconds", "run_dir", "message"]
        w.writerow(keys)
        for p in self.probes:
            w.writerow([getattr(p, k) for k in keys])
        return buf.getvalue()


def read_maxbatch(search_dir: str | Path) -> MaxBatchResult:
    path = Path(search_dir) / "probes.jsonl"
    if not path.is_file():
        raise LlmadaptError(f"{search_dir} is not a maxbatch result (no probes.jsonl)")
    records = read_jsonl(path)
    probes = [Probe(**{k: v for k, v in r.items() if k != "type"}) for r in records if r["type"] == "probe"]
    results = [r for r in records if r["type"] == "maxbatch"]
    if not results:
        raise LlmadaptError(f"{search_dir}: the search has no result record (it was interrupted)")
    return MaxBatchResult(search_dir=Path(search_dir), result=MaxBatch(**{k: v for k, v in results[-1].items()
                                                                          if k != "type"}), probes=probes)
