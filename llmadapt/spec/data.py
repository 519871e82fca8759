"""The data section: where training's tokens come from."""

from __future__ import annotations

import attrs

from llmadapt.dataformats import FORMATS as DATA_FORMATS
from llmadapt.spec.fields import choice

DATA_SOURCES = ("synthetic", "jsonl")


@attrs.frozen
class DataSpec:
    """Where tokens come from. Every stack and every layout sees the same tokens at the same global step."""

    source: str = attrs.field(default="synthetic", validator=choice(DATA_SOURCES))
    """'synthetic': seeded token sequences a model can learn; 'jsonl': a file of instruction/answer pairs or
    conversations."""
    path: str | None = None
    """The file (source='jsonl'): JSONL, one object per line with the fields of ``format``; for format 'sharegpt',
    one JSON list of conversations."""
    prompt_field: str = "instruction"
    answer_field: str = "answer"
    format: str = attrs.field(default="prompt-answer", validator=choice(DATA_FORMATS))
    """The file's layout (llmadapt.dataformats, docs/workloads.md): 'prompt-answer' (prompt_field, answer_field),
    'instruction-input-output' (commonsense_15k, math_14k), 'hellaswag' (ctx, endings, label), 'gsm8k' (question,
    answer ending '#### <number>'), 'sharegpt' (ShareGPT V3's JSON list of conversations, each rendered in the model's
    chat template, its answers alone in the loss; a conversation with no answer token within train.seq_len is left
    out). Left out of the hashes at its default."""
    packing: bool = False
    """Pack samples into rows of train.seq_len tokens: whole samples in dataset order, as many as fit (none split
    across rows), attention kept inside each sample (a block-diagonal causal mask) and positions restarting at 0
    per sample; padding only at a row's end. train.global_batch and micro_batch then count rows, the step's
    samples (queries) vary. The same rows on every stack (llmadapt.runtime.data). Needs source='jsonl'. Left out
    of the hashes when false."""
