"""Quality beside speed (serve.quality): after a serving run's measured requests, the same fixed held-out texts
sent to every engine, greedily, and scored against transformers' fp32 decoding of the same checkpoint.

Two requests per text, over the engine's completions API, built by the adapter's own ``payload`` (so that an
engine's settings, such as llama.cpp's repeat penalty, hold here too), not streamed:

- greedy: the text's first sentence as the prompt, ``output_tokens`` asked, the engine free to stop at its
  end-of-sequence token; the response's text and its token count (usage);
- scored: the whole text, echoed, with ``top_logprobs`` log-probabilities per position and one token asked: the
  log-probability the engine gives each true next token, and its top-k next tokens there.

The reference (``llmadapt.runtime.quality_reference``, in the tools environment, with torch) decodes and scores the
same texts and compares. Engines name their top-k tokens by text, not id: both sides are bucketed by each token's
text (U+FFFD removed, as llama-cpp-python drops an unfinished character's bytes), and the engine's mass outside its
top-k is one more bucket, and so are texts that several tokens read as (the byte pieces of one character). By the
log-sum inequality the KL over these buckets is a lower bound of the full KL.

This module runs in the orchestrator (no torch); the arithmetic here is shared with the reference.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

REPLACEMENT = "\ufffd"
TAIL = "\x00rest"
"""The bucket of everything outside the engine's top-k."""
FLOOR = 1e-12
"""Probability given to a bucket the engine leaves empty (its top-k mass rounds to 1): KL stays finite."""


def held_out_texts(n: int) -> list[dict[str, str]]:
    """The first ``n`` packaged held-out texts: {"prompt": first sentence, "text": whole passage}."""
    lines = resources.files("llmadapt.resources").joinpath("quality-texts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()][:n]


def plain(text: str) -> str:
    """A token's or a response's text as compared: without U+FFFD."""
    return text.replace(REPLACEMENT, "")


def _body(server, prompt: str, max_tokens: int, api: str) -> tuple[str, dict[str, Any]]:
    from llmadapt.adapter.context import PlannedRequest

    path, body = server.payload(PlannedRequest(index=0, warmup=False, offset_s=None, prompt=prompt,
                                               prompt_token_ids=[], input_tokens=0, output_tokens=max_tokens,
                                               ignore_eos=False, api=api))
    body["stream"] = False
    body.pop("stream_options", None)
    body.pop("ignore_eos", None)
    body.pop("min_tokens", None)
    return path, body


async def _post(server, session, path: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    async with session.post(server.ctx.base_url + path, json=body, headers=server.headers()) as r:
        text = await r.text()
        if r.status != 200:
            return None, f"HTTP {r.status}: {text[:200]}"
    try:
        return json.loads(text), None
    except ValueError:
        return None, f"not JSON: {text[:200]}"


async def probe(server, session, spec) -> list[dict[str, Any]]:
    """Each held-out text's greedy response and scored echo, as the engine answered (or why it did not)."""
    out = []
    for item in held_out_texts(spec.texts):
        entry: dict[str, Any] = {**item}
        path, body = _body(server, item["prompt"], spec.output_tokens, "completions")
        answer, error = await _post(server, session, path, body)
        if answer is None:
            entry["error"] = error
        else:
            choice = answer["choices"][0]
            entry["response"] = choice.get("text") or ""
            entry["output_tokens"] = (answer.get("usage") or {}).get("completion_tokens")
        path, body = _body(server, item["text"], 1, "completions")
        body.update(echo=True, logprobs=spec.top_logprobs)
        answer, error = await _post(server, session, path, body)
        logprobs = (answer["choices"][0].get("logprobs") if answer else None) or {}
        if logprobs.get("top_logprobs"):
            entry["scored"] = {k: logprobs.get(k) for k in ("tokens", "token_logprobs", "top_logprobs")}
        else:
            entry["scored_error"] = error or "the engine returned no log-probabilities"
        out.append(entry)
    return out


# -- the arithmetic, over buckets named by token text ---------------------------------------------------------------
def engine_buckets(top: dict[str, float], known=None) -> dict[str, float]:
    """The engine's top-k log-probabilities as probabilities by plain text (tokens of one text summed), and the rest
    of its mass as the TAIL bucket. ``known``: the texts that name one token alone; the others (the byte pieces of
    a character, all of which read as '', or a text the reference has no token for) go to the TAIL, since the engine
    names one of their tokens and the reference would sum them all."""
    out: dict[str, float] = {}
    for token, logprob in top.items():
        key = plain(token)
        if known is None or key in known:
            out[key] = out.get(key, 0.0) + math.exp(logprob)
    out[TAIL] = max(0.0, 1.0 - sum(out.values()))
    return out


def lumped_kl(reference: dict[str, float], engine: dict[str, float]) -> float:
    """KL(reference || engine) over the engine's buckets (engine_buckets): ``reference`` gives the reference's
    probability of each bucket but TAIL (the reference's mass on the tokens of that text), TAIL is the rest."""
    p = {k: reference.get(k, 0.0) for k in engine if k != TAIL}
    p[TAIL] = max(0.0, 1.0 - sum(p.values()))
    return sum(pk * math.log(pk / max(engine[k], FLOOR)) for k, pk in p.items() if pk > 0)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length when one is the other's prefix);
    None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def perplexity(logprobs: list[float]) -> float | None:
    return math.exp(-sum(logprobs) / len(logprobs)) if logprobs else None
