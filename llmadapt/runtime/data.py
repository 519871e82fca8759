"""Token data for training workers: synthetic or from a file, cut into the same global batches in the same
order whatever the data-parallel layout (each rank takes its share of every global step); and the held-out
examples evaluation reads (workload.eval), the same on every stack.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import attrs

from llmadapt.adapter.context import IGNORE, MicroBatch, Sample, StepBatch
from llmadapt.spec import Workload

RESERVED = 4  # token ids below this are special tokens; synthetic data avoids them
Example = tuple[list[int], list[int], list[list[int]] | None]  # prompt, answer, choices (answer tokens each)


@attrs.frozen
class EvalExample:
    """One held-out example: the prompt with its answer as a sample (labels on the answer, or on every token for
    synthetic data), and for multiple choice a sample per choice with the index of the right one."""

    sample: Sample
    choices: list[Sample] | None = None
    answer_index: int | None = None


class TokenData:
    def __init__(self, workload: Workload, tokenizer=None) -> None:
        self.w = workload
        self.seq_len = workload.train.seq_len
        self._examples: list[Example] | None = None
        self._held: list[Example] | None = None
        self._orders: dict[int, list[int]] = {}
        e = workload.eval
        if workload.data.source == "jsonl" or e.path:
            if tokenizer is None:
                raise ValueError("jsonl data needs the canonical tokenizer")
            # Many published tokenizers (Llama's) have no pad token: padding is masked out of the loss anyway.
            self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
        if workload.data.source == "jsonl":
            self._examples = self._load_jsonl(Path(workload.data.path), tokenizer)
            if e.examples and not e.path:  # the file's last rows are held out of training
                self._examples, self._held = self._examples[: -e.examples], self._examples[-e.examples:]
        if e.examples and e.path:
            self._held = self._load_jsonl(Path(e.path), tokenizer)[: e.examples]

    # -- global order ---------------------------------------------------------------
    def sample(self, index: int) -> Sample:
        if self._examples is None:
            return self._synthetic(index)
        epoch, pos = divmod(index, len(self._examples))
        prompt, answer, _ = self._examples[self._order(epoch)[pos]]
        return self._pack(prompt, answer)

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

        g = self.w.train.global_batch
        per_rank = g // dp_size
        first = step * g + dp_rank * per_rank
        mine = [self.sample(i) for i in range(first, first + per_rank)]
        if self._examples is None:  # synthetic: every label counts, so no need to build the other ranks' samples
            loss_tokens = g * self.seq_len
        else:
            loss_tokens = sum(sum(1 for t in s.labels if t != IGNORE) for s in self.global_samples(step))
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
        )

    # -- held-out examples -----------------------------------------------------------
    @property
    def has_answers(self) -> bool:
        """The held-out examples are prompts with answers (not synthetic sequences): exact match applies."""
        return self._held is not None

    def eval_examples(self) -> list[EvalExample]:
        """workload.eval's examples in file order: jsonl rows held out of training or read from eval.path, or
        synthetic sequences from seeds training never uses."""
        if self._held is None:
            return [EvalExample(self._synthetic(i, "eval")) for i in range(self.w.eval.examples)]
        out = []
        for prompt, answer, choices in self._held:
            options = [self._pack(prompt, c) for c in choices] if choices else None
            out.append(EvalExample(self._pack(prompt, answer), options,
                                   choices.index(answer) if choices else None))
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

    def _load_jsonl(self, path: Path, tokenizer) -> list[Example]:
        d = self.w.data
        examples = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if d.prompt_field not in row or d.answer_field not in row:
                raise ValueError(f"{path}:{number}: needs fields {d.prompt_field!r} and {d.answer_field!r}")
            prompt = [tokenizer.bos_token_id] * (tokenizer.bos_token_id is not None) + tokenizer.encode(row[d.prompt_field] + "\n", add_special_tokens=False)
            eos = [tokenizer.eos_token_id] * (tokenizer.eos_token_id is not None)
            answer = tokenizer.encode(row[d.answer_field], add_special_tokens=False) + eos
            choices = ([tokenizer.encode(c, add_special_tokens=False) + eos for c in row["choices"]]
                       if isinstance(row.get("choices"), list) else None)
            examples.append((prompt, answer, choices))
        if not examples:
            raise ValueError(f"{path}: no examples")
        return examples

    def _pack(self, prompt: list[int], answer: list[int]) -> Sample:
        x = (prompt + answer)[: self.seq_len + 1]
        # label position t predicts x[t+1]: no loss while x[t+1] is still part of the prompt
        labels = [tok if t + 1 >= len(prompt) else IGNORE for t, tok in enumerate(x[1:])]
        length = len(x) - 1
        pad = self.seq_len - length
        return Sample(input_ids=x[:-1] + [self._pad] * pad, labels=labels + [IGNORE] * pad, length=length)
