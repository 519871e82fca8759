"""Token data: one global order for every layout, pre-shifted labels, prompt masking."""

import pytest

from llmadapt import Workload
from llmadapt.adapter.context import IGNORE
from llmadapt.runtime.data import TokenData
from llmadapt.testing import INSTRUCTIONS

torch = pytest.importorskip("torch")


def concat(batches):
    return torch.cat([mb.input_ids for b in batches for mb in b.micro_batches])


def test_every_layout_sees_the_same_global_batch():
    """dp=1 with one micro-batch and dp=2 with micro-batches of 1 cover the same samples in order."""
    w = Workload().with_overrides(["train.global_batch=4"])
    one = TokenData(w).step_batch(3, 0, 1)
    w2 = w.with_overrides(["parallelism.dp=2", "train.micro_batch=1"])
    two = [TokenData(w2).step_batch(3, r, 2) for r in range(2)]
    assert torch.equal(concat([one]), concat(two))
    assert [len(b.micro_batches) for b in two] == [2, 2]
    assert one.loss_tokens_global == two[0].loss_tokens_global == two[1].loss_tokens_global == 4 * 64


def test_synthetic_labels_are_inputs_shifted_by_one():
    """labels[t] is the token after input_ids[t]; steps differ; the seed changes the data."""
    w = Workload()
    data = TokenData(w)
    s = data.sample(0)
    assert s.labels[:-1] == s.input_ids[1:]
    assert data.sample(1).input_ids != s.input_ids
    assert TokenData(w.with_overrides(["seed=1"])).sample(0).input_ids != s.input_ids
    assert min(s.input_ids) >= 4 and max(s.input_ids) < w.model.vocab_size


def test_instruction_data_masks_prompt_and_padding():
    """Only answer tokens (and the closing </s>) carry loss; padding is -100 too."""
    from transformers import AutoTokenizer

    from llmadapt.models import canonical_checkpoint

    w = Workload.from_dict({"kind": "finetune", "data": {"source": "jsonl", "path": str(INSTRUCTIONS)},
                            "train": {"seq_len": 48}})
    tok = AutoTokenizer.from_pretrained(str(canonical_checkpoint(w.model, w.seed)))
    data = TokenData(w, tok)
    s = data.sample(0)
    loss_positions = [t for t, label in enumerate(s.labels) if label != IGNORE]
    assert loss_positions and loss_positions == list(range(loss_positions[0], loss_positions[-1] + 1))
    text = tok.decode([s.labels[t] for t in loss_positions])
    assert text.endswith("</s>") and "?" not in text and "\n" not in text  # the answer, not the prompt
    assert s.input_ids[s.length:] == [tok.pad_token_id] * (48 - s.length)
    # every example is visited once per epoch
    lines = open(INSTRUCTIONS).read().splitlines()
    epoch = {tuple(data.sample(i).input_ids) for i in range(len(lines))}
    assert len(epoch) == len(set(lines))
