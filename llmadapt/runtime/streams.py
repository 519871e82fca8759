"""Request streams beyond synthetic lengths (``serve.source``): prompts and output lengths from a ShareGPT-layout
conversation file or a JSONL of prompts, a random stream within a range ratio of the mean lengths, shared-prefix
prompts, multi-turn conversations whose turns carry their history, and the replay of a Mooncake-layout trace.

Each is planned here, from the workload's seed, before the first request is sent: every engine gets the same
prompts in the same order. Lengths in tokens are the canonical tokenizer's. The files were checked when the
workload was built (llmadapt.streamfiles); what only tokenizing tells (too few entries within the length
filters) is refused here, before any request is sent.
"""

from __future__ import annotations

import random

import attrs

from llmadapt.adapter.context import PlannedRequest
from llmadapt.contract.records import RequestSource
from llmadapt.errors import LlmadaptError
from llmadapt.spec import Workload
from llmadapt.streamfiles import complete_sharegpt, read_mooncake, read_prompts, read_sharegpt


@attrs.frozen
class TurnRequest(PlannedRequest):
    """A turn of a multi-turn conversation: sent ``think_s`` after the previous turn's answer ended (its
    ``offset_s`` is None), the first turn at its conversation's arrival time."""

    conversation: int
    turn: int
    think_s: float


def plan_stream(workload: Workload, tokenizer, rng: random.Random, pool: list[str], inputs: list[int],
                outputs: list[int], offsets: list[float | None]) -> list[PlannedRequest]:
    """The plan of a serve.source other than 'synthetic'. ``inputs``, ``outputs`` and ``offsets`` are the synthetic
    draws for warm-up + measured requests (serve.input_len, serve.output_len, serve.arrival), which a stream uses
    where it has no lengths or times of its own; ``pool`` holds words that are one token each."""
    s = workload.serve
    kind = s.source.kind
    total = s.warmup_requests + s.requests

    def words(n: int, r: random.Random = rng) -> str:
        return "".join(r.choice(pool) for _ in range(n))

    def request(i: int, prompt: str, output: int, offset: float | None, **turn) -> PlannedRequest:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        cls = TurnRequest if turn else PlannedRequest
        return cls(index=i, warmup=i < s.warmup_requests, offset_s=offset, prompt=prompt, prompt_token_ids=ids,
                   input_tokens=len(ids), output_tokens=output, ignore_eos=s.ignore_eos, api=s.api, **turn)

    if kind in ("sharegpt", "prompts"):
        entries = _file_entries(workload, tokenizer, rng, outputs, total)
        return [request(i, prompt, out, offsets[i]) for i, (prompt, out) in enumerate(entries)]
    if kind == "random":
        r = s.source.range_ratio
        plan = []
        for i in range(total):
            n_in = rng.randint(*_range(s.input_len.mean, r))
            n_out = rng.randint(*_range(s.output_len.mean, r))
            plan.append(request(i, words(n_in), n_out, offsets[i]))
        return plan
    if kind == "shared_prefix":
        src = s.source
        prefixes = [words(src.prefix_len) for _ in range(src.prefixes)]
        prompts = [prefix + words(src.suffix_len) for prefix in prefixes for _ in range(src.suffixes)]
        rng.shuffle(prompts)
        return [request(i, prompts[i], outputs[i], offsets[i]) for i in range(total)]
    if kind == "mooncake":
        return _replay(workload, rng, pool, request, total)
    if kind == "multi_turn":
        plan: list[PlannedRequest] = []
        for c, turns in enumerate(_conversations(workload, tokenizer, rng, words, inputs, outputs, total)):
            history = ""
            for t, (user, answer, out) in enumerate(turns):
                sep = "\n" if history and s.source.path else ""
                prompt = history + sep + user
                plan.append(request(len(plan), prompt, out, offsets[c] if t == 0 else None, conversation=c,
                                    turn=t, think_s=s.source.think_s))
                history = prompt + ("\n" if s.source.path else "") + answer
        return plan
    raise ValueError(f"serve.source.kind {kind!r} has no planner")


def request_source(workload: Workload) -> RequestSource | None:
    """What the header records of the ShareGPT file a serve workload reads (None for other sources)."""
    src = workload.serve.source
    if src.kind not in ("sharegpt", "multi_turn") or not src.path:
        return None
    return RequestSource(**complete_sharegpt(src.path)[1])


def completed_note(source: RequestSource | None) -> str | None:
    """The line that tells the user a ShareGPT file was cut short and which copy is read instead."""
    if source is None or not source.bytes_dropped:
        return None
    return (f"serve.source.path {source.file} is cut short ({source.bytes:,} bytes, sha256 {source.sha256[:12]}): "
            f"reading its {source.conversations:,} complete conversations ({source.bytes_dropped:,} bytes of a partial "
            f"one dropped) from {source.path_used}")


def _range(mean: int, ratio: float) -> tuple[int, int]:
    """vLLM's random dataset: [mean * (1 - r), mean * (1 + r)], whole tokens, at least 1."""
    return max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))


def _fits(workload: Workload, n_in: int, n_out: int) -> bool:
    src = workload.serve.source
    return (src.min_input_len <= n_in <= (src.max_input_len or n_in)
            and src.min_output_len <= n_out <= (src.max_output_len or n_out)
            and n_in + n_out <= workload.model.max_position_embeddings)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def _file_entries(workload: Workload, tokenizer, rng: random.Random, outputs: list[int],
                  total: int) -> list[tuple[str, int]]:
    """(prompt, output length) for ``total`` entries of a ShareGPT or prompts file, drawn without replacement in
    the seed's order among those within the length filters and the model's positions."""
    src = workload.serve.source
    if src.kind == "sharegpt":
        rows: list[tuple[str, str | None]] = [conv[0] for conv in read_sharegpt(src.path) if conv]
    else:
        rows = read_prompts(src.path, src.prompt_field, src.answer_field)
    order = list(range(len(rows)))
    rng.shuffle(order)
    out: list[tuple[str, int]] = []
    for j in order:
        prompt, answer = rows[j]
        n_out = _count(tokenizer, answer) if answer is not None else outputs[len(out)]
        if _fits(workload, _count(tokenizer, prompt), n_out):
            out.append((prompt, n_out))
            if len(out) == total:
                return out
    raise LlmadaptError(_too_few(workload, len(out), len(rows), total, "entries"))


def _too_few(workload: Workload, kept: int, rows: int, total: int, what: str) -> str:
    src = workload.serve.source
    return (f"serve.source.path: {kept} of the file's {rows} {what} are within the length filters (min/max_input_len, "
            f"min/max_output_len, model.max_position_embeddings={workload.model.max_position_embeddings}), fewer "
            f"than the {total} requests (serve.requests + serve.warmup_requests): {src.path}")


def _conversations(workload: Workload, tokenizer, rng: random.Random, words, inputs: list[int],
                   outputs: list[int], total: int) -> list[list[tuple[str, str, int]]]:
    """Conversations as (new user text, answer text, answer length) per turn, ``total`` turns in all (the last
    conversation cut there). From a ShareGPT file: its conversations in the seed's order, each up to its first turn
    whose prompt (history included) or answer is outside the length filters; without one, ``turns`` turns of
    serve.input_len words answered by serve.output_len words."""
    src = workload.serve.source
    convs: list[list[tuple[str, str, int]]] = []
    n = 0
    if not src.path:
        while n < total:
            turns = []
            for _ in range(min(src.turns, total - n)):
                turns.append((words(inputs[n]), words(outputs[n]), outputs[n]))
                n += 1
            convs.append(turns)
        return convs
    rows = read_sharegpt(src.path)
    order = list(range(len(rows)))
    rng.shuffle(order)
    for j in order:
        history, turns = "", []
        for user, answer in rows[j]:
            prompt = history + ("\n" if history else "") + user
            n_out = _count(tokenizer, answer)
            if not _fits(workload, _count(tokenizer, prompt), n_out) or n + len(turns) == total:
                break
            turns.append((user, answer, n_out))
            history = prompt + "\n" + answer
        if turns:
            convs.append(turns)
            n += len(turns)
        if n == total:
            return convs
    raise LlmadaptError(_too_few(workload, n, sum(map(len, rows)), total, "turns"))


def _replay(workload: Workload, rng: random.Random, pool: list[str], request, total: int) -> list[PlannedRequest]:
    """The trace's first ``total`` requests at their timestamps (times time_scale; none in a closed loop), each
    prompt built from its hash ids' blocks: one block of block_size words per id, the same words wherever the id
    recurs (so requests sharing ids share that prefix), cut to input_length; fresh words where the ids run out."""
    s = workload.serve
    src = s.source
    rows = read_mooncake(src.path)[:total]
    blocks: dict[int, list[str]] = {}
    t0 = rows[0]["timestamp"]
    plan = []
    for i, row in enumerate(rows):
        tokens: list[str] = []
        for h in row["hash_ids"]:
            if len(tokens) >= row["input_length"]:
                break
            if h not in blocks:
                own = random.Random(f"{workload.seed}:block:{h}")
                blocks[h] = [own.choice(pool) for _ in range(src.block_size)]
            tokens += blocks[h]
        tokens = tokens[:row["input_length"]]
        tokens += [rng.choice(pool) for _ in range(row["input_length"] - len(tokens))]
        offset = None if s.arrival.process == "closed" else (row["timestamp"] - t0) / 1000 * src.time_scale
        plan.append(request(i, "".join(tokens), row["output_length"], offset))
    return plan
