"""The layouts of the JSONL files users bring (data.format, eval.format): which fields each needs, and the text a
row becomes: a prompt, the answer trained on and scored, the choices of a multiple-choice item and the number an
exact match on the final number compares. Text only, no tokenizer: the workload checks every row with it before
launch (llmadapt.spec), the workers tokenize what it returns (llmadapt.runtime.data).

- ``prompt-answer``: data.prompt_field / data.answer_field, an optional ``choices`` list holding the answer.
- ``instruction-input-output``: commonsense_15k and math_14k (study B): ``instruction``, ``input`` (may be empty),
  ``output`` (what is trained on), ``answer`` (the bare answer: 'answer1', 'true', '42'). The prompt is the
  Alpaca template those sets were made for. An instruction that ends 'Answer format: a/b/c' is a multiple-choice
  item: its choices are the output with the answer replaced by each option.
- ``hellaswag``: ``ctx`` (or ``ctx_a`` and ``ctx_b``), ``endings`` (a list), ``label`` (the right ending's index,
  a number or its text as the published files have it); the prompt is the context, each ending a continuation.
- ``gsm8k``: ``question``, ``answer`` whose last line is '#### <number>' (the reasoning before it is trained on
  too); exact match compares that number with the last number of the generated text.
- ``sharegpt``: not JSONL but one JSON list of ShareGPT conversations (llmadapt.streamfiles.read_sharegpt), each
  rendered in the model's chat template with its answers trained on (llmadapt.chattemplate); no row functions.

``held_out``: the content-hash split (eval.share): whether a row or conversation is held out depends on its text
alone, not on the file's order or on which other rows are there.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import NamedTuple

FORMATS = ("prompt-answer", "instruction-input-output", "hellaswag", "gsm8k", "sharegpt")
WHOLE_FILE = ("sharegpt",)
"""Formats read as one JSON document, not line by line: ``problem`` and ``parse`` do not apply."""

TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
TEMPLATE_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                  "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                  "{instruction}\n\n### Input:\n{input}\n\n### Response:\n")

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_OPTIONS = re.compile(r"Answer format:\s*([^\s/]+(?:/[^\s/]+)+)\s*$")


class Row(NamedTuple):
    prompt: str
    """The text before the answer, separator included (a sample is <s> prompt answer </s>)."""
    answer: str
    """What is trained on and scored (the loss and the teacher-forced exact match)."""
    choices: list[str] | None = None
    """Multiple choice: every option as an answer text; ``answer_index`` is the right one."""
    answer_index: int | None = None
    number: str | None = None
    """The number exact match on the final number compares (None: the row has none)."""


def problem(row: object, fmt: str, prompt_field: str = "instruction", answer_field: str = "answer",
            choices: bool = False) -> str | None:
    """What is wrong with one parsed JSON line for FMT, as the end of a sentence ('needs a text field 'output''),
    or None. ``choices``: a prompt-answer row may carry a ``choices`` list (evaluation files)."""
    if not isinstance(row, dict):
        return f"is not a JSON object with the {fmt} fields"
    if fmt == "prompt-answer":
        for field in (prompt_field, answer_field):
            if not isinstance(row.get(field), str):
                return (f"needs a text field {field!r} (set data.prompt_field / data.answer_field to the file's "
                        "names, or data.format to its layout)")
        if choices and "choices" in row:
            options = row["choices"]
            if not isinstance(options, list) or len(options) < 2 or not all(isinstance(c, str) for c in options):
                return "choices must be a list of two or more texts"
            if row[answer_field] not in options:
                return "the answer is not one of its choices"
        return None
    if fmt == "instruction-input-output":
        for field in ("instruction", "output", "answer"):
            if not isinstance(row.get(field), str):
                return f"needs a text field {field!r} ({fmt}: instruction, input, output, answer)"
        if not isinstance(row.get("input", ""), str):
            return "needs 'input' as text (it may be empty)"
        return None
    if fmt == "hellaswag":
        if not isinstance(row.get("ctx"), str) and not (isinstance(row.get("ctx_a"), str)
                                                       and isinstance(row.get("ctx_b"), str)):
            return "needs a text field 'ctx' (or 'ctx_a' and 'ctx_b') (hellaswag: ctx, endings, label)"
        endings = row.get("endings")
        if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
            return "needs a field 'endings', a list of two or more texts (hellaswag: ctx, endings, label)"
        label = _label(row.get("label"))
        if label is None:
            return "needs a field 'label', the right ending's index (hellaswag: ctx, endings, label)"
        if not 0 <= label < len(endings):
            return f"label {label} is not an index of its {len(endings)} endings"
        return None
    if fmt == "gsm8k":
        for field in ("question", "answer"):
            if not isinstance(row.get(field), str):
                return f"needs a text field {field!r} (gsm8k: question, answer ending '#### <number>')"
        if gsm8k_number(row["answer"]) is None:
            return "needs an answer that ends with '#### <number>' (gsm8k)"
        return None
    raise ValueError(f"unknown data format {fmt!r}")


def parse(row: dict, fmt: str, prompt_field: str = "instruction", answer_field: str = "answer") -> Row:
    """The texts of a row that ``problem`` passed."""
    if fmt == "prompt-answer":
        answer = row[answer_field]
        options = row.get("choices") if isinstance(row.get("choices"), list) else None
        return Row(row[prompt_field] + "\n", answer, options, options.index(answer) if options else None,
                   final_number(answer))
    if fmt == "instruction-input-output":
        text = row.get("input") or ""
        prompt = (TEMPLATE_INPUT if text.strip() else TEMPLATE).format(instruction=row["instruction"], input=text)
        output, answer = row["output"], row["answer"]
        choices = index = None
        found = _OPTIONS.search(row["instruction"].strip())
        if found and answer in found.group(1).split("/"):
            options = found.group(1).split("/")
            index = options.index(answer)
            # the output is what is trained on ('the correct answer is answer2'): a choice is the same sentence
            # with another option in it, or the bare option where the output does not name the answer
            choices = ([output.replace(answer, o) for o in options] if answer and answer in output else options)
            if len(set(choices)) < len(choices):
                choices = index = None
        bare = answer.strip()  # math_14k's answer is the bare number; commonsense's 'answer1' is not one
        return Row(prompt, output, choices, index, bare if _NUMBER.fullmatch(bare) else None)
    if fmt == "hellaswag":
        context = row["ctx"] if isinstance(row.get("ctx"), str) else f"{row['ctx_a']} {row['ctx_b']}".strip()
        endings = [" " + e.strip() for e in row["endings"]]
        label = _label(row["label"])
        return Row(context.strip(), endings[label], endings, label, None)
    if fmt == "gsm8k":
        return Row(row["question"] + "\n", row["answer"], None, None, gsm8k_number(row["answer"]))
    raise ValueError(f"unknown data format {fmt!r}")


def content_hash(content: object) -> float:
    """Where CONTENT (a parsed row, a conversation's exchanges) falls in [0, 1): the first 64 bits of the sha256 of
    its canonical JSON. The same for the same text whatever file, order or machine."""
    text = json.dumps(content, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def held_out(content: object, share: float) -> bool:
    """The content-hash split: CONTENT is held out of training when its hash falls below SHARE."""
    return content_hash(content) < share


def split_rule(share: float) -> str:
    """The content-hash split's rule, as the trace records it."""
    return (f"content hash: held out where sha256 of its canonical JSON (first 64 bits / 2^64) < eval.share = "
            f"{share:g}; evaluated in hash order")


def _label(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def gsm8k_number(answer: str) -> str | None:
    """The number after the last '####' of a GSM8K answer, or None."""
    if "####" not in answer:
        return None
    found = _NUMBER.findall(answer.rsplit("####", 1)[1])
    return found[0] if found else None


def final_number(text: str) -> str | None:
    """The last number in TEXT ('... so she has 1,250 apples.' -> '1,250'), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def same_number(a: str | None, b: str | None) -> bool:
    """Whether two numbers as written are equal: thousands separators and a trailing '.0' do not matter; None
    equals nothing."""
    if a is None or b is None:
        return False
    return float(a.replace(",", "")) == float(b.replace(",", ""))


def number_match(generated: str, expected: str | None) -> bool:
    """Exact match on the final number: the last number in the generated text equals the expected one."""
    return same_number(final_number(generated), expected)
