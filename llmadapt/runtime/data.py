"""Token data for training workers: synthetic or from a file, cut into the same global batches in the same
order whatever the data-parallel layout (each rank takes its share of every global step); and the held-out
examples evaluation reads (workload.eval), the same on every stack. Files are read in their layout
(data.format, eval.format: llmadapt.dataformats), already checked row by row when the workload was built;
ShareGPT conversations in the model's chat template (llmadapt.runtime.conversations). Which rows are held out, and
how many on each side, is ``split_rule`` and ``split_counts`` (the evaluation records carry them).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple

import attrs

from llmadapt.adapter.context import IGNORE, MicroBatch, Sample, StepBatch
from llmadapt.dataformats import content_hash, parse, split_rule
from llmadapt.runtime.conversations import ChatExamples
from llmadapt.spec import Workload

RESERVED = 4  # token ids below this are special tokens; synthetic data avoids them


class Example(NamedTuple):
    """One row as tokens: the prompt (with <s>), the answer trained on (with </s>), for multiple choice every
    choice as an answer and the right one's index, and the number exact match on the final number compares."""

    prompt: list[int]
    answer: list[int]
    choices: list[list[int]] | None = None
    answer_index: int | None = None
    number: str | None = None
    loss_mask: tuple[bool, ...] | None = None
    """Which answer tokens are trained on (a conversation: its answers, not the user's turns between them); None:
    all of them."""


@attrs.frozen
class EvalExample:
    """One held-out example: the prompt with its answer as a sample (labels on the answer, or on every token for
    synthetic data), and for multiple choice a sample per choice with the index of the right one."""

    sample: Sample
    choices: list[Sample] | None = None
    answer_index: int | None = None
    prompt: list[int] | None = None
    """The prompt's tokens (<s> included), what generation starts from; None for synthetic data."""
    number: str | None = None
    """The answer's final number (exact match on the final number), None where it has none."""


class TokenData:
    def __init__(self, workload: Workload, tokenizer=None, chat=None) -> None:
        """``chat``: the model's chat template (llmadapt.chattemplate.read_chat_template), for conversations."""
        self.w = workload
        self.seq_len = workload.train.seq_len
        self._examples: list[Example] | None = None
        self._held: list[Example] | None = None
        self._tokenizer = tokenizer
        self._orders: dict[int, list[int]] = {}
        self._row_starts = [0]  # packing: the global index of each packed row's first sample, and the next row's
        self._chat = chat
        self._chats: ChatExamples | None = None
        self.split_rule: str | None = None
        self.split_counts: dict[str, int] | None = None
        e = workload.eval
        if workload.data.source == "jsonl" or e.path:
            if tokenizer is None:
                raise ValueError("jsonl data needs the canonical tokenizer")
            # Many published tokenizers (Llama's) have no pad token: padding is masked out of the loss anyway.
            self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
        if workload.data.source == "jsonl":
            self._load_training(Path(workload.data.path), tokenizer)
        if e.examples and e.path:
            fmt = e.format or workload.data.format
            if fmt == "sharegpt":
                conversations = [p for p in self._conversations(Path(e.path)) if p]
                self._held = ChatExamples(conversations, tokenizer, self._need_chat(), self.seq_len,
                                          Example).fitting(range(len(conversations)), e.examples)
            else:
                self._held = self._load_jsonl(Path(e.path), tokenizer, fmt)[: e.examples]
            self.split_rule = f"eval.path: its first {e.examples} examples"
            self.split_counts = {"held_out": len(self._held), "evaluated": len(self._held)}

    def _load_training(self, path: Path, tokenizer) -> None:
        """data.path's examples, less the held-out ones: by content hash (eval.share), or the file's last rows."""
        e, sharegpt = self.w.eval, self.w.data.format == "sharegpt"
        if sharegpt:
            everything = self._conversations(path)
            contents = examples = [pairs for pairs in everything if pairs]
        else:
            examples = self._load_jsonl(path, tokenizer, self.w.data.format)
            contents = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        held: list = []
        if e.examples and e.share:
            hashes = [content_hash(c) for c in contents]
            # in hash order: the same examples evaluated whatever the file's order
            held = [examples[i] for i in sorted((i for i, h in enumerate(hashes) if h < e.share),
                                                key=hashes.__getitem__)]
            examples = [x for x, h in zip(examples, hashes) if h >= e.share]
            self.split_rule = split_rule(e.share)
        elif e.examples and not e.path:
            examples, held = examples[: -e.examples], examples[-e.examples:]
            self.split_rule = f"the file's last {e.examples} examples"
        if sharegpt:
            self._chats = ChatExamples(examples, tokenizer, self._need_chat(), self.seq_len, Example)
            self._examples = self._chats
        else:
            self._examples = examples
        if not self.split_rule:
            return
        counts = {"train": len(examples), "held_out": len(held)}
        if sharegpt:
            chats = ChatExamples(held, tokenizer, self._need_chat(), self.seq_len, Example)
            self._held = chats.fitting(range(len(held)), e.examples)
            counts.update(without_exchange=len(everything) - len(contents), held_out_too_long=chats.passed_over)
        else:
            self._held = held[: e.examples]
        self.split_counts = {**counts, "evaluated": len(self._held)}

    def _need_chat(self):
        if self._chat is None:
            m = self.w.model
            raise ValueError(f"renders conversations in the model's chat template, and {m.path or repr(m.name)} has "
                             "none (chat_template.jinja or tokenizer_config.json's chat_template)")
        return self._chat

    @staticmethod
    def _conversations(path: Path) -> list:
        from llmadapt.streamfiles import read_sharegpt

        return read_sharegpt(str(path))

    # -- global order ---------------------------------------------------------------
    def sample(self, index: int) -> Sample:
        if self._examples is None:
            return self._synthetic(index)
        if self._chats is not None:
            example = self._chats.nth(index, self._order)
        else:
            epoch, pos = divmod(index, len(self._examples))
            example = self._examples[self._order(epoch)[pos]]
        return self._pack(example.prompt, example.answer, example.loss_mask)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self._examples)))
            random.Random(f"{self.w.seed}:epoch:{epoch}").shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def global_samples(self, step: int) -> list[Sample]:
        g = self.w.train.global_batch
        return [self.sample(step * g + j) for j in range(g)]

    def step_batch(self, step: int, dp_rank: int, dp_size: int) -> StepBatch:
        import torch

        if self.w.data.packing:
            return self._packed_step_batch(step, dp_rank, dp_size)
        g = self.w.train.global_batch
        per_rank = g // dp_size
        first = step * g + dp_rank * per_rank
        mine = [self.sample(i) for i in range(first, first + per_rank)]
        if self._examples is None:  # synthetic: every label counts, so no need to build the other ranks' samples
            loss_tokens = g * self.seq_len
        else:
            loss_tokens = self.loss_tokens(step)
            if not loss_tokens:
                shortest = min(len(self._examples[self._order(i // len(self._examples))[i % len(self._examples)]]
                                   .prompt) for i in range(step * g, step * g + g))
                raise ValueError(f"step {step}: no answer token within train.seq_len={self.seq_len} in any of the "
                                 f"step's {g} samples (their prompts take {shortest} tokens or more): raise "
                                 "train.seq_len")
        mb = self.w.train.micro_batch or per_rank
        micro = []
        for i in range(0, per_rank, mb):
            chunk = mine[i : i + mb]
            micro.append(
                MicroBatch(
                    input_ids=torch.tensor([s.input_ids for s in chunk], dtype=torch.long),
                    labels=torch.tensor([s.labels for s in chunk], dtype=torch.long),
                )
            )
        return StepBatch(
            step=step,
            micro_batches=micro,
            loss_tokens_global=loss_tokens,
            tokens=sum(s.length for s in mine),
            samples=len(mine),
            sample_length_squares=sum(s.length ** 2 for s in mine),
        )

    def loss_tokens(self, step: int) -> int:
        """The answer tokens of global step ``step``, every rank's (its loss is their mean): 0 where every prompt
        of the step fills train.seq_len, a step that cannot train. The launcher checks each step before launch."""
        g = self.w.train.global_batch
        if self.w.data.packing:
            samples = [s for r in range(step * g, step * g + g) for s in self.row_samples(r)]
        else:
            samples = self.global_samples(step)
        return sum(t != IGNORE for s in samples for t in s.labels)

    # -- packing (data.packing) -------------------------------------------------------
    def row_samples(self, row: int) -> list[Sample]:
        """The samples of packed row ``row`` of the global order: whole samples, in order, as many as fit in
        seq_len (greedy: a sample that does not fit starts the next row). Rows depend on every earlier sample's
        length only, so every stack and layout gets the same rows."""
        while len(self._row_starts) <= row + 1:
            i, used = self._row_starts[-1], 0
            while True:
                length = self.sample(i).length
                if used and used + length > self.seq_len:
                    break
                used, i = used + length, i + 1
            self._row_starts.append(i)
        return [self.sample(i) for i in range(self._row_starts[row], self._row_starts[row + 1])]

    def _packed_step_batch(self, step: int, dp_rank: int, dp_size: int) -> StepBatch:
        import torch

        g = self.w.train.global_batch  # rows
        per_rank = g // dp_size
        rows = [self.row_samples(r) for r in range(step * g, step * g + g)]
        loss_tokens = self.loss_tokens(step)
        if not loss_tokens:
            raise ValueError(f"step {step}: no answer token within train.seq_len={self.seq_len} in any of the "
                             f"step's samples: raise train.seq_len")
        mine = rows[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        mb = self.w.train.micro_batch or per_rank
        micro = []
        for i in range(0, per_rank, mb):
            packed = [self._packed_row(row) for row in mine[i:i + mb]]
            micro.append(MicroBatch(*(torch.tensor([r[k] for r in packed], dtype=torch.long) for k in range(4))))
        return StepBatch(step=step, micro_batches=micro, loss_tokens_global=loss_tokens,
                         tokens=sum(s.length for row in mine for s in row), samples=sum(len(row) for row in mine),
                         sample_length_squares=sum(s.length ** 2 for row in mine for s in row))

    def _packed_row(self, samples: list[Sample]) -> tuple[list[int], list[int], list[int], list[int]]:
        """input ids, labels, position ids and segment ids of one row: each sample's own tokens and labels (its
        last label is its own last token, so no label crosses into the next sample), then padding (segment 0)."""
        ids, labels, positions, segments = [], [], [], []
        for n, s in enumerate(samples, 1):
            ids += s.input_ids[:s.length]
            labels += s.labels[:s.length]
            positions += range(s.length)
            segments += [n] * s.length
        pad = self.seq_len - len(ids)
        return (ids + [self._pad] * pad, labels + [IGNORE] * pad, positions + list(range(pad)),
                segments + [0] * pad)

    # -- held-out examples -----------------------------------------------------------
    @property
    def has_answers(self) -> bool:
        """The held-out examples are prompts with answers (not synthetic sequences): exact match applies."""
        return self._held is not None

    @property
    def match(self) -> str:
        """What exact match compares for these held-out examples: 'tokens' or 'number' (workload.eval.match)."""
        return self.w.eval.resolved_match(self.w.data.format) if self._held is not None else "tokens"

    @property
    def max_new_tokens(self) -> int:
        """Generation's budget, prompt included: the tokens a training sample holds (prompt and answer cut to
        seq_len + 1), within the model's positions."""
        return min(self.seq_len + 1, self.w.model.max_position_embeddings)

    def decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True)

    @property
    def end_token(self) -> int | None:
        return self._tokenizer.eos_token_id if self._tokenizer is not None else None

    @property
    def pad_token(self) -> int:
        return self._pad

    def eval_examples(self) -> list[EvalExample]:
        """workload.eval's examples in file order: jsonl rows held out of training or read from eval.path, or
        synthetic sequences from seeds training never uses."""
        if self._held is None:
            return [EvalExample(self._synthetic(i, "eval")) for i in range(self.w.eval.examples)]
        out = []
        for x in self._held:
            options = [self._pack(x.prompt, c) for c in x.choices] if x.choices else None
            out.append(EvalExample(self._pack(x.prompt, x.answer, x.loss_mask), options,
                                   x.answer_index if x.choices else None,
                                   x.prompt, x.number))
        return out

    # -- sources ----------------------------------------------------------------------
    def _synthetic(self, index: int, stream: str = "sample") -> Sample:
        rng = random.Random(f"{self.w.seed}:{stream}:{index}")
        vocab = self.w.model.vocab_size - RESERVED
        start, stride = rng.randrange(vocab), rng.randrange(1, 17)
        x = [RESERVED + (start + stride * t) % vocab for t in range(self.seq_len + 1)]
        for t in range(len(x)):
            if rng.random() < 0.1:
                x[t] = RESERVED + rng.randrange(vocab)
        return Sample(input_ids=x[:-1], labels=x[1:], length=self.seq_len)

    def _load_jsonl(self, path: Path, tokenizer, fmt: str) -> list[Example]:
        """Each row of PATH in layout FMT as tokens: <s> prompt, then answer </s> (llmadapt.dataformats decides
        the texts; the workload checked every row's fields before launch)."""
        d = self.w.data
        bos = [tokenizer.bos_token_id] * (tokenizer.bos_token_id is not None)
        eos = [tokenizer.eos_token_id] * (tokenizer.eos_token_id is not None)
        examples = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = parse(json.loads(line), fmt, d.prompt_field, d.answer_field)
            except (KeyError, TypeError, ValueError, IndexError) as exc:  # a file changed since the check
                raise ValueError(f"{path}:{number}: not a {fmt} row ({exc!r})") from None
            prompt = bos + tokenizer.encode(row.prompt, add_special_tokens=False)
            answer = tokenizer.encode(row.answer, add_special_tokens=False) + eos
            choices = ([tokenizer.encode(c, add_special_tokens=False) + eos for c in row.choices]
                       if row.choices else None)
            examples.append(Example(prompt, answer, choices, row.answer_index, row.number))
        if not examples:
            raise ValueError(f"{path}: no examples")
        return examples

    def _pack(self, prompt: list[int], answer: list[int], mask: tuple[bool, ...] | None = None) -> Sample:
        x = (prompt + answer)[: self.seq_len + 1]
        # label position t predicts x[t+1]: no loss while x[t+1] is still part of the prompt, nor where the answer's
        # mask leaves it out (a conversation's user turns)
        n = len(prompt)
        labels = [tok if t + 1 >= n and (mask is None or mask[t + 1 - n]) else IGNORE for t, tok in enumerate(x[1:])]
        length = len(x) - 1
        pad = self.seq_len - length
        return Sample(input_ids=x[:-1] + [self._pad] * pad, labels=labels + [IGNORE] * pad, length=length)

