"""Serving with output lengths not forced (serve.ignore_eos = false): each engine's output-length distribution and
the share of answers that ended at end-of-sequence or at the cap, in the summary, compare's table and show."""

from __future__ import annotations

import attrs

from llmadapt import Workload
from llmadapt.analysis.comparison import Comparison, Row, row_metrics
from llmadapt.analysis.report import render_summary
from llmadapt.contract.records import Summary
from llmadapt.contract.stats import serving_stats


def request(index, output, asked, reason, *, status="ok", forced=False):
    ns = [int((index + 1 + i) * 1e6) for i in range(max(output, 1))]
    return {"type": "request", "index": index, "warmup": False, "status": status, "error_cause": None,
            "scheduled_ns": 0, "sent_ns": 0, "first_token_ns": ns[0], "end_ns": ns[-1], "chunk_ns": ns,
            "chunk_tokens": [1] * len(ns), "output_tokens": output, "requested_output_tokens": asked,
            "input_tokens": 4, "output_forced": forced, "finish_reason": reason}


WORKLOAD = Workload.from_dict({"kind": "serve", "serve": {"ignore_eos": False,
                                                          "arrival": {"process": "closed", "concurrency": 1}}})


def free_records():
    """Two answers end at the cap (one says 'length', one gives no reason but has every token asked), two before it
    (one says 'stop', one gives no reason and is short); a failed request is not counted."""
    return [request(0, 10, 10, "length"), request(1, 3, 10, "stop"), request(2, 20, 20, None),
            request(3, 5, 20, None), request(4, 7, 10, None, status="error")]


def test_the_summary_has_the_output_length_distribution_and_how_answers_ended():
    s = serving_stats(free_records(), WORKLOAD)
    assert (s.output_tokens.count, s.output_tokens.min, s.output_tokens.max) == (4, 3, 20)
    assert s.output_tokens.mean == 38 / 4  # whole token counts: exact
    assert (s.stopped_at_eos_share, s.hit_cap_share) == (0.5, 0.5)
    assert s.total_output_tokens == 38 and not s.output_length_forced


def _summary(records, workload=WORKLOAD) -> Summary:
    return Summary(run_id="r", status="ok", role="serve", adapter="hf", framework="transformers",
                   framework_version="", launcher="subprocess", workload_hash="w", problem_hash="p", world_size=1,
                   device=None, patches=[], steps_completed=0, measured_steps=0, losses=[], step_time_s=None,
                   tokens_per_s=None, samples_per_s=None, tokens_per_step=None, peak_memory_bytes=None,
                   peak_memory_per_rank=[], memory_kind=None, model_flops_per_token=None,
                   achieved_flops_per_s=None, mfu=None, phase_means_s={}, failures=[],
                   serving=serving_stats(records, workload))


def test_compare_and_show_print_them_only_where_lengths_were_not_forced():
    free = _summary(free_records())
    forced = _summary([request(i, 10, 10, "length", forced=True) for i in range(3)])
    metrics = row_metrics(free, None)
    assert (metrics["out_tokens_max"], metrics["eos_share"], metrics["cap_share"]) == (20, 0.5, 0.5)
    assert "out_tokens_p50" not in row_metrics(forced, None)

    def row(label, summary):
        return Row(label=label, adapter=label, variant="", run_dir=None, status="ok", problem_hash="p",
                   metrics=row_metrics(summary, None), cell=label)

    table = Comparison(rows=[row("vllm", forced), row("hf", free)]).table()
    head = table.splitlines()[0]
    assert "out tok p50" in head and "EOS share" in head and "cap share" in head
    vllm, hf = (next(line.split() for line in table.splitlines() if line.split()[1:2] == [name])
                for name in ("vllm", "hf"))
    assert hf[-6:] == ["8", "17", "9.5", "20", "50%", "50%"] and vllm[-6:] == ["-"] * 6
    assert "EOS share" not in Comparison(rows=[row("vllm", forced)]).table()
    text = render_summary(attrs.asdict(free))
    assert "50% stopped at end-of-sequence, 50% at the cap" in text and "max 20" in text
    assert "stopped at end-of-sequence" not in render_summary(attrs.asdict(forced))


def test_offline_runs_which_force_every_length_refuse_natural_stopping():
    """The offline engines (vLLM's LLM.generate, transformers' generate) force the lengths and record them forced:
    asked to stop at end-of-sequence, the run would be forced lengths read as free ones."""
    import pytest

    from llmadapt.errors import WorkloadError

    with pytest.raises(WorkloadError, match="serve.ignore_eos.*forces every output length") as err:
        Workload.from_dict({"kind": "serve", "serve": {"mode": "offline", "ignore_eos": False}})
    assert "\n" not in str(err.value)
    assert Workload.from_dict({"kind": "serve", "serve": {"mode": "offline"}}).serve.ignore_eos
