"""Quality beside speed (serve.quality): after a serving run's measured requests, the same fixed held-out texts
sent to every engine, greedily, and scored against transformers' fp32 decoding of the same checkpoint.

Two requests per text, over the engine's completions API, built by the adapter's own ``payload`` (so that an
engine's settings, such as llama.cpp's repeat penalty, hold here too):

- greedy: the text's first sentence as the prompt, ``output_tokens`` asked, the engine free to stop at its
  end-of-sequence token, streamed and parsed by the adapter as the measured requests are; its text and token count;
- scored: the whole text, echoed, not streamed, with ``top_logprobs`` log-probabilities per position and one token
  asked: the log-probability the engine gives each true next token, and its top-k next tokens there. An engine
  that returns none (transformers serve) has its greedy figures alone, and the record says why.

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


def _request(prompt: str, max_tokens: int):
    from llmadapt.adapter.context import PlannedRequest

    return PlannedRequest(index=0, warmup=False, offset_s=None, prompt=prompt, prompt_token_ids=[], input_tokens=0,
                          output_tokens=max_tokens, ignore_eos=False, api="completions")


async def greedy(server, session, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The engine's greedy response, streamed as the measured requests are (the adapter's own parser): its text and
    its token count (usage where the engine gives it, else the chunks' counts)."""
    text, counted, usage = [], 0, None
    try:
        async for chunk in server.stream(session, _request(prompt, max_tokens)):
            text.append(chunk.text)
            counted += chunk.tokens or 0
            usage = chunk.usage_output_tokens if chunk.usage_output_tokens is not None else usage
    except Exception as exc:  # a failed request is a figure left out, with why, never the run's end
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"response": "".join(text), "output_tokens": usage if usage is not None else counted or None}


async def scored(server, session, text: str, k: int) -> dict[str, Any]:
    """The engine's log-probabilities of ``text``, echoed (OpenAI completions' echo and logprobs), not streamed."""
    path, body = server.payload(_request(text, 1))
    body.update(stream=False, echo=True, logprobs=k)
    body.pop("stream_options", None)
    try:
        async with session.post(server.ctx.base_url + path, json=body, headers=server.headers()) as r:
            answer = await r.text()
            if r.status != 200:
                return {"scored_error": f"HTTP {r.status}: {answer[:200]}"}
        logprobs = json.loads(answer)["choices"][0].get("logprobs") or {}
    except Exception as exc:  # not OpenAI's answer, or no answer: the figures are left out, saying why
        return {"scored_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    if not logprobs.get("top_logprobs"):
        return {"scored_error": "the engine returned no log-probabilities"}
    return {"scored": {key: logprobs.get(key) for key in ("tokens", "token_logprobs", "top_logprobs")}}


async def _twice(ask) -> dict[str, Any]:
    """One retry where the server closed a kept-alive connection as the request went out (seen on vLLM after the
    load point's last request): that is the connection's fault, not an answer."""
    first = await ask()
    return await ask() if "Disconnected" in (first.get("error") or first.get("scored_error") or "") else first


async def probe(server, session, spec) -> list[dict[str, Any]]:
    """Each held-out text's greedy response and scored echo, as the engine answered (or why it did not)."""
    out = []
    for item in held_out_texts(spec.texts):
        out.append({**item, **await _twice(lambda: greedy(server, session, item["prompt"], spec.output_tokens)),
                    **await _twice(lambda: scored(server, session, item["text"], spec.top_logprobs))})
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
