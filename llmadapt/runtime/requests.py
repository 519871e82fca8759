"""The request plan of a serving run: prompt and output lengths, arrival times and prompts, drawn from the
workload's seed so that every engine gets the same requests in the same order.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from llmadapt.adapter.context import PlannedRequest
from llmadapt.errors import LlmadaptError
from llmadapt.runtime.streams import plan_stream
from llmadapt.spec import LengthSpec, Workload


# -- the plan -----------------------------------------------------------------------------------
def sample_lengths(spec: LengthSpec, n: int, rng: random.Random, dataset: list[int] | None = None) -> list[int]:
    def clip(x: float) -> int:
        return max(spec.low, min(spec.high, int(round(x))))

    if spec.dist == "fixed":
        return [spec.mean] * n
    if spec.dist == "uniform":
        return [rng.randint(spec.low, spec.high) for _ in range(n)]
    if spec.dist == "normal":
        return [clip(rng.gauss(spec.mean, spec.std)) for _ in range(n)]
    if not dataset:
        raise ValueError("length distribution 'dataset' needs lengths from data.path")
    return [clip(rng.choice(dataset)) for _ in range(n)]


def arrival_offsets(workload: Workload, n: int, rng: random.Random) -> list[float | None]:
    """Due times (s after start) for n requests; None for every request of a closed loop."""
    a = workload.serve.arrival
    if a.process == "closed":
        return [None] * n
    if a.process == "trace":
        rows = [json.loads(line) for line in Path(a.trace).read_text().splitlines() if line.strip()]
        return [float(r["send_time_s"]) for r in rows[:n]]
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if a.process == "constant":
            gap = 1.0 / a.rate
        elif a.process == "poisson":
            gap = rng.expovariate(a.rate)
        else:  # gamma: shape = burstiness, mean gap = 1 / rate
            gap = rng.gammavariate(a.burstiness, 1.0 / (a.rate * a.burstiness))
        t += gap
    return out


def word_pool(tokenizer) -> list[str]:
    """Words that are one token each with a leading space, so a prompt of n words is exactly n tokens. The space
    is byte-level BPE's 'Ġ' (GPT-2, Llama 3) or SentencePiece's '▁' (Llama 2, Mixtral)."""
    pool = []
    for token in sorted(tokenizer.get_vocab()):
        if token[:1] in ("\u0120", "\u2581") and token[1:].isalpha() and len(token) > 2:
            word = " " + token[1:]
            if len(tokenizer.encode(word, add_special_tokens=False).ids) == 1:
                pool.append(word)
    if len(pool) < 8:
        raise LlmadaptError(f"the tokenizer has only {len(pool)} words that are one token with a leading space: "
                            "serving prompts of exact lengths cannot be built from it")
    return pool


def plan_requests(workload: Workload, tokenizer) -> list[PlannedRequest]:
    """Every request of the run, warm-up first, from the workload's seed: the same stream for every engine."""
    s = workload.serve
    rng = random.Random(f"{workload.seed}:serve" + (f":{s.stream}" if s.stream else ""))
    total = s.warmup_requests + s.requests
    trace_rows = None
    if s.arrival.process == "trace":
        trace_rows = [json.loads(line) for line in Path(s.arrival.trace).read_text().splitlines() if line.strip()]
        total = min(total, len(trace_rows))
    dataset_in = dataset_out = None
    if workload.data.source == "jsonl" and workload.data.path:
        rows = [json.loads(line) for line in Path(workload.data.path).read_text().splitlines() if line.strip()]
        dataset_in = [len(tokenizer.encode(r[workload.data.prompt_field], add_special_tokens=False).ids) or 1
                      for r in rows]
        dataset_out = [len(tokenizer.encode(r[workload.data.answer_field], add_special_tokens=False).ids) or 1
                       for r in rows]
    inputs = sample_lengths(s.input_len, total, rng, dataset_in)
    outputs = sample_lengths(s.output_len, total, rng, dataset_out)
    if trace_rows:
        inputs = [int(r.get("input_len", i)) for r, i in zip(trace_rows, inputs)]
        outputs = [int(r.get("output_len", o)) for r, o in zip(trace_rows, outputs)]
    offsets = arrival_offsets(workload, total, rng)
    pool = word_pool(tokenizer)
    if s.source.kind != "synthetic":  # a file, shared prefixes, conversations, a replayed trace
        return plan_stream(workload, tokenizer, rng, pool, inputs, outputs, offsets)
    plan = []
    for i in range(total):
        prompt = "".join(rng.choice(pool) for _ in range(inputs[i]))
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        if len(ids) != inputs[i]:
            raise ValueError(f"prompt {i}: built {len(ids)} tokens, wanted {inputs[i]}")
        plan.append(PlannedRequest(index=i, warmup=i < s.warmup_requests, offset_s=offsets[i], prompt=prompt,
                                   prompt_token_ids=ids, input_tokens=len(ids), output_tokens=outputs[i],
                                   ignore_eos=s.ignore_eos, api=s.api))
    return plan
