"""ShareGPT conversations as training examples (data.format 'sharegpt'): each conversation rendered in the model's
chat template (llmadapt.chattemplate), its answers alone in the loss, cut to train.seq_len + 1 tokens.

A file can hold tens of thousands of conversations and a run reads a few: a conversation is rendered and tokenized
when first asked for, and only its exchanges up to train.seq_len + 1 tokens. A conversation with no answer token
within that window trains nothing and is passed over, in training's order and in evaluation's alike, so every
stack and layout sees the same samples.
"""

from __future__ import annotations

from typing import Callable

from llmadapt.chattemplate import ChatTemplate, pieces

Pairs = list[tuple[str, str]]


class ChatExamples:
    """Conversations built into examples on demand. ``example(i)`` is conversation i's Example, or None where no
    answer token fits; ``nth(index, order)`` the index-th fitting conversation of the global order."""

    def __init__(self, conversations: list[Pairs], tokenizer, chat: ChatTemplate, seq_len: int, example_type) -> None:
        self.conversations = conversations
        self._tokenizer, self._chat, self._limit, self._type = tokenizer, chat, seq_len + 1, example_type
        self._built: dict[int, object] = {}
        self._walks: dict[int, tuple[list[int], int]] = {}  # epoch: (fitting indices found, next position)
        self.passed_over = 0

    def __len__(self) -> int:
        return len(self.conversations)

    def example(self, i: int):
        if i not in self._built:
            self._built[i] = self._build(self.conversations[i])
        return self._built[i]

    def _build(self, pairs: Pairs):
        """<prompt pieces> then the rest, with which of the rest's tokens are trained; None if none fits."""
        tokens: list[int] = []
        trained: list[bool] = []
        for text, is_answer in pieces(self._chat, pairs):
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            tokens += ids
            trained += [is_answer] * len(ids)
            if len(tokens) >= self._limit:
                break
        tokens, trained = tokens[: self._limit], trained[: self._limit]
        if True not in trained[1:]:  # the first token is never a label
            return None
        first = trained.index(True)
        return self._type(tokens[:first], tokens[first:], loss_mask=tuple(trained[first:]))

    def fitting(self, candidates: list[int], count: int) -> list:
        """The first COUNT examples of CANDIDATES (indices, in order) that fit."""
        out = []
        for i in candidates:
            if len(out) == count:
                break
            example = self.example(i)
            if example is None:
                self.passed_over += 1
            else:
                out.append(example)
        return out

    def nth(self, index: int, order: Callable[[int], list[int]]):
        """The index-th fitting conversation of the global order: epoch after epoch of ``order(epoch)`` (a
        permutation of the conversations' indices), conversations that do not fit passed over."""
        found = self._walk(0, index, order)
        if index < len(found):
            return self.example(found[index])
        if not found:
            raise ValueError("no conversation has an answer token within train.seq_len: raise train.seq_len")
        epoch, pos = divmod(index, len(found))  # epoch 0 walked to its end: every epoch has this many
        return self.example(self._walk(epoch, pos, order)[pos])

    def _walk(self, epoch: int, upto: int, order: Callable[[int], list[int]]) -> list[int]:
        found, at = self._walks.get(epoch, ([], 0))
        permutation = order(epoch)
        while len(found) <= upto and at < len(permutation):
            if self.example(permutation[at]) is not None:
                found.append(permutation[at])
            at += 1
        self._walks[epoch] = (found, at)
        return found
