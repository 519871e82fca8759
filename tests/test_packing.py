"""Packed sequences (data.packing): whole samples in dataset order, as many as fit in a row of train.seq_len, each
sample attending only to itself (a block-diagonal causal mask, positions restarting at 0); the same rows on every
stack, with the same losses; tokens and samples per step count real tokens and queries; one-line refusals.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from llmadapt import Workload, run
from llmadapt.adapter.plugins import adapters
from llmadapt.analysis.paritycheck import loss_parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.errors import UnsupportedError, WorkloadError
from llmadapt.testing import environments_unready

DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "tiny-instructions.jsonl"
PACKED = ["kind=finetune", "data.source=jsonl", f"data.path={DATA}", "data.packing=true", "train.seq_len=48",
          "train.global_batch=4", "train.micro_batch=2", "train.steps=3", "train.warmup_steps=1", "train.lr=0.003",
          "telemetry.interval_s=0"]


@pytest.fixture(scope="module")
def data():
    from llmadapt.models import build_tokenizer
    from llmadapt.runtime.data import TokenData

    return TokenData(Workload().with_overrides(PACKED), build_tokenizer(512, Path(tempfile.mkdtemp())))


# -- the rows ------------------------------------------------------------------------------------------------------
def test_rows_hold_whole_samples_in_order_with_their_own_positions_and_labels(data):
    from llmadapt.adapter.context import IGNORE

    seq, rows, row_samples = data.seq_len, 24, []
    batches = [data.step_batch(step, 0, 1) for step in range(rows // 4)]
    for batch in batches:
        for mb in batch.micro_batches:
            for r in range(mb.input_ids.shape[0]):
                ids, labels = mb.input_ids[r].tolist(), mb.labels[r].tolist()
                pos, seg = mb.position_ids[r].tolist(), mb.segment_ids[r].tolist()
                samples, start = [], 0
                for n in range(1, max(seg) + 1):
                    length = seg.count(n)
                    assert seg[start:start + length] == [n] * length  # contiguous, in order
                    assert pos[start:start + length] == list(range(length))  # positions restart per sample
                    samples.append((ids[start:start + length], labels[start:start + length]))
                    start += length
                assert set(seg[start:]) <= {0} and set(labels[start:]) <= {IGNORE}  # padding only at the end
                row_samples.append(samples)
    # The rows, read in order, are the unpacked samples in their global order: none split, none skipped.
    flat = [s for row in row_samples for s in row]
    for i, (ids, labels) in enumerate(flat):
        alone = data.sample(i)
        assert ids == alone.input_ids[:alone.length] and labels == alone.labels[:alone.length]
    # Greedy: a row's next sample would not have fitted.
    for row, nxt in zip(row_samples, row_samples[1:]):
        assert sum(len(ids) for ids, _ in row) + len(nxt[0][0]) > seq
    assert len(flat) > rows  # several samples per row: something was packed
    # Tokens count real tokens, samples the queries; the loss normaliser the loss-bearing labels.
    first = batches[0]
    assert first.tokens == sum(len(ids) for row in row_samples[:4] for ids, _ in row) < 4 * seq
    assert first.samples == sum(len(row) for row in row_samples[:4])
    assert first.loss_tokens_global == sum(t != IGNORE for row in row_samples[:4] for _, labels in row for t in labels)


def test_every_data_parallel_rank_gets_its_share_of_the_same_rows(data):
    whole = data.step_batch(1, 0, 1)
    halves = [data.step_batch(1, rank, 2) for rank in (0, 1)]
    import torch

    for key in ("input_ids", "labels", "position_ids", "segment_ids"):
        assert torch.equal(torch.cat([getattr(mb, key) for mb in whole.micro_batches]),
                           torch.cat([getattr(mb, key) for h in halves for mb in h.micro_batches]))
    assert sum(h.samples for h in halves) == whole.samples and sum(h.tokens for h in halves) == whole.tokens
    assert {h.loss_tokens_global for h in halves} == {whole.loss_tokens_global}


def test_the_mask_is_causal_and_block_diagonal():
    import torch

    from llmadapt.adapter.context import MicroBatch

    seg = torch.tensor([[1, 1, 2, 2, 2, 0]])
    mb = MicroBatch(input_ids=torch.zeros(1, 6, dtype=torch.long), labels=torch.zeros(1, 6, dtype=torch.long),
                    position_ids=torch.tensor([[0, 1, 0, 1, 2, 0]]), segment_ids=seg)
    allowed = mb.attention_allowed()[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0],
                       [0, 0, 1, 0, 0, 0],
                       [0, 0, 1, 1, 0, 0],
                       [0, 0, 1, 1, 1, 0],
                       [0, 0, 0, 0, 0, 1]]  # padding attends to itself: no row of the softmax is empty
    inputs = mb.model_inputs("cpu", torch.bfloat16)
    assert inputs["attention_mask"].dtype == torch.bfloat16 and inputs["attention_mask"].shape == (1, 1, 6, 6)
    assert ((inputs["attention_mask"][0, 0] == 0).int().tolist()) == allowed
    assert MicroBatch(mb.input_ids, mb.labels).attention_allowed() is None
    assert set(MicroBatch(mb.input_ids, mb.labels).model_inputs("cpu", torch.float32)) == {"input_ids"}


# -- attention stays inside a sample ---------------------------------------------------------------------------------
def _worst_difference(data, implementation: str, drop_mask: bool = False) -> float:
    """Largest |logit difference| between each sample's tokens in its packed row and the sample run alone."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation=implementation)).eval()
    mb = data.step_batch(0, 0, 1).micro_batches[0]
    inputs = {"input_ids": mb.input_ids} if drop_mask else mb.model_inputs("cpu", torch.float32)
    worst = 0.0
    with torch.no_grad():
        packed = model(**inputs).logits
        for r in range(mb.input_ids.shape[0]):
            start = 0
            for sample in data.row_samples(r):
                alone = model(input_ids=torch.tensor([sample.input_ids[:sample.length]])).logits[0]
                worst = max(worst, (packed[r, start:start + sample.length] - alone).abs().max().item())
                start += sample.length
    return worst


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_each_sample_in_a_packed_row_has_the_logits_it_has_alone(data, implementation):
    """fp32, within 1e-5 (measured 2e-7): the same arithmetic on matrices of another shape (a row, a sample) sums in
    another order; the masked keys add exactly nothing (exp of the dtype's minimum is 0)."""
    assert _worst_difference(data, implementation) < 1e-5


def test_without_the_mask_a_sample_sees_the_one_before_it(data):
    """What the check above guards against: the packed row as plain causal input, samples attend to earlier ones."""
    assert _worst_difference(data, "sdpa", drop_mask=True) > 0.1


# -- every stack, the same losses ------------------------------------------------------------------------------------
STACKS = {
    "deepspeed": ["parallelism.dp=2", "train.micro_batch=1", "optimizations.zero_stage=2"],
    "megatron": ["parallelism.tp=2"],  # local attention with our mask; RoPE positions from a hook
    "colossalai": ["parallelism.pp=2"],  # HybridParallelPlugin 1F1B: the mask rides in the pipeline's batch
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if environments_unready("torch"):
        pytest.skip(environments_unready("torch"))
    result = run(Workload().with_overrides(PACKED), "torch", out=tmp_path_factory.mktemp("ref"))
    assert result.ok, result.summary.failures
    return result


def test_the_reference_counts_real_tokens_and_queries(reference, data):
    """The step records carry the rows' real tokens and their samples (samples/s is queries/s), not rows x seq_len."""
    steps = [r for r in read_jsonl(reference.run_dir / "rank-00000.jsonl") if r["type"] == "step"]
    for record in steps:
        batch = data.step_batch(record["step"], 0, 1)
        assert (record["tokens"], record["samples"]) == (batch.tokens, batch.samples)
        assert record["tokens"] < 4 * 48 and record["samples"] > 4
    assert reference.summary.tokens_per_step == steps[-1]["tokens"]
    unpacked = run(Workload().with_overrides([*PACKED, "data.packing=false"]), "torch",
                   out=reference.run_dir.parent / "unpacked")
    assert unpacked.ok and abs(unpacked.losses[1] - reference.losses[1]) > 1e-3  # other batches: other losses


def test_the_flop_count_takes_each_samples_own_context(reference, data):
    """The attention term's T is sum(L^2) / sum(L) over the measured steps' samples, not the row's seq_len: what
    the model computes for a packed row is its samples' attention, each within itself (llmadapt.contract.flops)."""
    from llmadapt.contract.flops import training_flops

    w = reference.summary
    workload = Workload().with_overrides(PACKED)
    measured = [data.step_batch(step, 0, 1) for step in range(workload.train.warmup_steps, workload.train.total_steps)]
    lengths = [s.length for b in measured for r in range(b.step * 4, b.step * 4 + 4) for s in data.row_samples(r)]
    context = sum(n * n for n in lengths) / sum(lengths)
    assert context < 0.5 * workload.train.seq_len  # several samples a row: far below the row's length
    assert w.model_flops_per_token == pytest.approx(training_flops(workload, context)[0], rel=1e-12)
    assert w.model_flops_per_token < training_flops(workload)[0]
    assert w.hardware_flops_per_token == pytest.approx(training_flops(workload, context)[1], rel=1e-12)


@pytest.mark.parametrize("adapter", list(STACKS))
def test_every_training_stack_packs_with_the_same_losses(adapter, reference, tmp_path):
    """fp32: the default parity tolerance holds with packing on (measured: 5e-7 at most over 4 steps)."""
    if adapter not in adapters():
        pytest.skip(f"the {adapter} adapter is not installed")
    if environments_unready(adapter):
        pytest.skip(environments_unready(adapter))
    result = run(Workload().with_overrides([*PACKED, *STACKS[adapter]]), adapter, out=tmp_path, timeout=600)
    assert result.ok, result.summary.failures
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.text()
    assert result.summary.grad_norms[0] == pytest.approx(reference.summary.grad_norms[0], rel=1e-5)
    if adapter == "megatron":  # the RoPE positions come from a hook: every rank's trace says so
        for path in sorted(result.run_dir.glob("rank-*.jsonl")):
            header = next(r for r in read_jsonl(path) if r["type"] == "header")
            assert {"name": "packed-rope-positions", "kind": "shim"}.items() <= next(
                p for p in header["patches"] if p["name"] == "packed-rope-positions").items()


# -- refusals ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["data.source=synthetic"], "needs data.source = 'jsonl'"),
    (["model.preset=tiny-jamba"], "family 'jamba' cannot keep a packed row's samples apart"),
    (["kind=serve"], "packing is for train and finetune workloads"),
])
def test_what_cannot_pack_is_one_line_before_launch(overrides, message):
    with pytest.raises(WorkloadError, match="data.packing") as caught:
        Workload().with_overrides([*PACKED, *overrides])
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_an_adapter_that_does_not_declare_packing_is_refused_before_launch(tmp_path):
    from llmadapt.adapter.declaration import Supports

    w = Workload().with_overrides(PACKED)
    assert [field for field, _, _ in Supports().problems(w)] == ["data.packing"]
    assert Supports(packing=True).problems(w) == []
    if "plain" in adapters():
        with pytest.raises(UnsupportedError, match="data.packing") as caught:
            run(w, "plain", out=tmp_path)
        assert "\n" not in str(caught.value) and not any(tmp_path.iterdir())


def test_packing_off_leaves_the_hashes_as_they_were():
    w = Workload()
    assert w.content_hash == "c3d5055d851794e65ff5fa4ce3aa7f652e90a93d698f2558c5eeb2e3d51d6c12"
    packed = Workload().with_overrides(PACKED)
    assert packed.problem_hash != packed.with_overrides(["data.packing=false"]).problem_hash


@pytest.mark.parametrize("packing", ["true", "false"])
def test_a_seq_len_that_every_prompt_fills_is_refused_before_launch(packing, tmp_path):
    """train.seq_len shorter than every prompt: no step has an answer token to train on. Refused before anything is
    written, naming the field and the first step that cannot train (not a failure at step 0)."""
    if environments_unready("torch"):
        pytest.skip(environments_unready("torch"))
    w = Workload().with_overrides([*PACKED, "train.seq_len=4", f"data.packing={packing}"])
    with pytest.raises(WorkloadError, match=r"train.seq_len.* 4; no answer token of step 0's samples fits") as caught:
        run(w, "torch", out=tmp_path)
    assert "\n" not in str(caught.value) and not any(tmp_path.iterdir())


def test_the_check_before_launch_reads_the_samples_the_workers_read():
    """The launcher's tokenizer (tokenizer.json through `tokenizers`, no torch) gives the workers' samples."""
    from transformers import PreTrainedTokenizerFast

    from llmadapt.launch.prepare import CheckpointTokenizer
    from llmadapt.models import build_tokenizer
    from llmadapt.runtime.data import TokenData

    folder = Path(tempfile.mkdtemp())
    build_tokenizer(512, folder)
    w = Workload().with_overrides(PACKED)
    ours, workers = TokenData(w, CheckpointTokenizer(folder)), TokenData(w, PreTrainedTokenizerFast.from_pretrained(
        str(folder)))
    assert [ours.sample(i) for i in range(16)] == [workers.sample(i) for i in range(16)]
    assert [ours.loss_tokens(s) for s in range(3)] == [workers.loss_tokens(s) for s in range(3)] != [0, 0, 0]


def test_held_out_examples_that_seq_len_cuts_to_their_prompts_are_refused_before_launch(tmp_path):
    """eval.path whose every prompt fills train.seq_len: no answer token would be scored (a NaN loss). Refused
    before launch; the training data alone fits."""
    if environments_unready("torch"):
        pytest.skip(environments_unready("torch"))
    import json

    long = tmp_path / "long.jsonl"
    long.write_text("\n".join(json.dumps({"instruction": " ".join(["river stone apple"] * 40) + f" {i}?",
                                          "answer": "yes"}) for i in range(3)))
    w = Workload().with_overrides([*PACKED, "data.packing=false", f"eval.path={long}", "eval.examples=3"])
    out = tmp_path / "runs"
    with pytest.raises(WorkloadError, match=r"no answer token of the 3 held-out examples \(eval\) fits") as caught:
        run(w, "torch", out=out)
    assert "\n" not in str(caught.value) and not (out.exists() and any(out.iterdir()))
