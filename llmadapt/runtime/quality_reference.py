"""The fp32 reference of a quality probe (llmadapt.runtime.quality), run in the tools environment (torch,
transformers): the checkpoint loaded in fp32, each held-out prompt decoded greedily, each held-out text scored, and
the engine's answers compared with them.

``python -m llmadapt.runtime.quality_reference IN_JSON OUT_JSON``: IN holds the checkpoint, the greedy length and
the probe's entries; OUT gets the Quality record's fields.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from llmadapt.runtime.quality import TAIL, engine_buckets, first_divergence, lumped_kl, perplexity, plain


def bucket_index(tokenizer, vocab_size: int) -> dict[str, int]:
    """Each plain token text that one token alone reads as -> that token's id (the byte pieces of a character all
    read as '', and some texts several tokens read as: those are left out, lumped into the rest)."""
    index: dict[str, list[int]] = {}
    for i in range(vocab_size):
        index.setdefault(plain(tokenizer.decode([i])), []).append(i)
    return {text: ids[0] for text, ids in index.items() if len(ids) == 1}


def greedy(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return [t for t in new[:next((i for i, t in enumerate(new) if t in eos), len(new))]]


def score_text(model, tokenizer, index, text: str, scored: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Per position with the engine's figures: the reference's and the engine's log-probability of the true token,
    whether their top tokens agree, and the lumped KL. Empty, with why, where the engine's tokens are not the
    reference tokenizer's."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    n = ids.shape[1]
    tokens, token_logprobs, tops = scored["tokens"], scored["token_logprobs"], scored["top_logprobs"]
    if len(tokens) < n or any(plain(tokens[j]) != plain(tokenizer.decode(ids[0, j : j + 1])) for j in range(n)
                              if plain(tokens[j]) and plain(tokenizer.decode(ids[0, j : j + 1]))):
        return [], "the engine tokenized a held-out text unlike the reference's tokenizer: its log-probabilities left out"
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    out = []
    for j in range(1, n):  # position j: the distribution of token j given the tokens before it
        top = tops[j]
        if not top or token_logprobs[j] is None:
            continue
        row = logp[j - 1].exp()
        buckets = engine_buckets(top, index)
        reference = {k: float(row[index[k]]) for k in buckets if k != TAIL}
        engine_top = plain(max(top.items(), key=lambda kv: kv[1])[0])
        reference_top = plain(tokenizer.decode([int(row.argmax())]))
        out.append({"kl": lumped_kl(reference, buckets),
                    # judged where the reference's top token has a text of its own (not a byte piece, which the
                    # engine's top-k, keyed by text, may have kept another piece of)
                    "same_top": engine_top == reference_top if reference_top in index else None,
                    "engine_logprob": float(token_logprobs[j]), "reference_logprob": float(logp[j - 1, ids[0, j]])})
    return out, None


def compare(checkpoint: Path, output_tokens: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    index = bucket_index(tokenizer, model.config.vocab_size)
    identical, divergences, engine_out, reference_out, positions, notes = 0, [], [], [], [], []
    for e in entries:
        ref_ids = greedy(model, tokenizer, e["prompt"], output_tokens)
        reference_out.append(len(ref_ids))
        if "response" not in e:
            notes.append(f"greedy request failed: {e.get('error')}")
            continue
        ref_text = tokenizer.decode(ref_ids)
        if plain(e["response"]) == plain(ref_text):
            identical += 1
        else:
            enc = tokenizer(plain(e["response"]), add_special_tokens=False).input_ids
            divergences.append(first_divergence(tokenizer(plain(ref_text), add_special_tokens=False).input_ids, enc))
        if e.get("output_tokens") is not None:
            engine_out.append(e["output_tokens"])
        if "scored" in e:
            found, why = score_text(model, tokenizer, index, e["text"], e["scored"])
            positions += found
            if why:
                notes.append(why)
        else:
            notes.append(e.get("scored_error") or "no log-probabilities")
    out: dict[str, Any] = {
        "texts": len(entries), "reference": f"transformers {transformers.__version__} fp32",
        "identical": identical, "identical_share": identical / len(entries) if entries else 0.0,
        "first_divergence_median": statistics.median(d for d in divergences if d is not None)
        if any(d is not None for d in divergences) else None,
        "output_tokens_mean": statistics.fmean(engine_out) if engine_out else None,
        "reference_output_tokens_mean": statistics.fmean(reference_out) if reference_out else 0.0,
        "positions": len(positions),
        "note": "; ".join(dict.fromkeys(notes))[:300] or None,
    }
    if positions:
        judged = [p["same_top"] for p in positions if p["same_top"] is not None]
        out.update(same_top_share=sum(judged) / len(judged) if judged else None,
                   kl_mean=statistics.fmean(p["kl"] for p in positions),
                   perplexity=perplexity([p["engine_logprob"] for p in positions]),
                   reference_perplexity=perplexity([p["reference_logprob"] for p in positions]))
    out["seconds"] = round(time.monotonic() - started, 3)
    return out


def main() -> None:
    given = json.loads(Path(sys.argv[1]).read_text())
    result = compare(Path(given["checkpoint"]), given["output_tokens"], given["entries"])
    result["top_logprobs"] = given["top_logprobs"] if result["positions"] else 0
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
