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
    """'synthetic': seeded token sequences a model can learn; 'jsonl': instruction/answer pairs."""
    path: str | None = None
    """JSONL file (source='jsonl'); one object per line with the fields of ``format``."""
    prompt_field: str = "instruction"
    answer_field: str = "answer"
    format: str = attrs.field(default="prompt-answer", validator=choice(DATA_FORMATS))
    """The file's layout (llmadapt.dataformats, docs/workloads.md): 'prompt-answer' (prompt_field, answer_field),
    'instruction-input-output' (commonsense_15k, math_14k), 'hellaswag' (ctx, endings, label), 'gsm8k' (question,
    answer ending '#### <number>'). Left out of the hashes at its default."""
