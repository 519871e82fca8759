"""Evaluation of the model being trained (workload.eval), identical on every stack.

Each stack writes its trained weights the way ``save.path`` does (``Trainer.save_pretrained``: ZeRO-3 partitions
and tensor-parallel slices gathered, LoRA merged) into a scratch folder of the run; rank 0 loads that folder with
transformers, in fp32, and scores the held-out examples here. So the figures come from the same tokens, order and
arithmetic whatever stack trained the weights: only the weights differ. A stack's own forward pass (a Megatron
pipeline, a ZeRO-3 engine) is not used, which also keeps the training model's state untouched.

Figures (llmadapt.contract.records.Evaluation): loss and perplexity over the scored tokens; token accuracy; exact
match, teacher-forced: every answer token, end token included, is the most likely one given the true tokens before
it, which is exactly when greedy decoding generates the answer and stops (one forward pass per example instead of
one per token); or, with eval.match = 'number' (GSM8K's rule, the default for the gsm8k format), whether the last
number of the text greedy decoding writes after the prompt (up to its end token, at most seq_len + 1 - prompt
tokens) equals the answer's number; for multiple choice (a ``choices`` list, a HellaSwag row, an instruction that
ends 'Answer format: a/b/c'), the choice with the highest summed log-likelihood (its end token included).

Runs inside workers (imports torch and transformers). The model on rank 0 is a whole copy next to the training
state: for a model that does not fit one device twice, evaluate the saved model (save.path) with a serving engine.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

from llmadapt.adapter.context import IGNORE, Sample
from llmadapt.contract.records import Evaluation
from llmadapt.contract.rundir import RunDir
from llmadapt.dataformats import number_match
from llmadapt.runtime.data import TokenData



def evaluate_trained(trainer, data: TokenData, step: int, run_dir: Path, barrier) -> Evaluation | None:
    """The model as trained so far, evaluated on rank 0 (None on the others). Every rank takes part in writing the
    weights; every rank waits until rank 0 is done, so that no rank's next step clock holds rank 0's evaluation."""
    ctx = trainer.ctx
    start = time.perf_counter()
    folder = RunDir(run_dir).eval_scratch  # removed after each evaluation
    if ctx.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    if barrier:
        barrier()  # the folder exists before any rank writes into it
    trainer.save_pretrained(folder)
    if barrier:
        barrier()  # every rank's part of the weights is written
    record = None
    try:
        if ctx.rank == 0:
            with trainer.plain_transformers():
                figures = evaluate_folder(folder, data, ctx.device)
            record = Evaluation(rank=0, step=step, seconds=time.perf_counter() - start, **figures)
    finally:
        if ctx.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if barrier:
        barrier()
    return record


def evaluate_folder(folder: Path, data: TokenData, device) -> dict:
    """Score the workload's held-out examples with the model in FOLDER: Evaluation's figures, as a dict."""
    import torch

    w = data.w
    examples = data.eval_examples()
    # Loading must not move the training's random streams (dropout, LoRA init of later runs): they stay as if no
    # evaluation had run.
    devices = [device] if getattr(device, "type", "cpu") == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model = load_model(folder, device)
        counter = None
        if w.model.is_moe:
            from llmadapt.adapter.moe import ExpertLoadCounter

            counter = ExpertLoadCounter(model, w.model.num_experts)
        nll, tokens, hits, exact = 0.0, 0, 0, 0
        for chunk in _batches([e.sample for e in examples], w.eval.batch):
            scores = score(model, chunk, device, counter)
            for s in scores:
                nll += s["nll"]
                tokens += s["tokens"]
                hits += s["hits"]
                exact += s["exact"]
        choice_right = choice_total = 0
        with_choices = [e for e in examples if e.choices]
        if with_choices:
            flat = [(i, c) for i, e in enumerate(with_choices) for c in e.choices]
            totals: dict[int, list[float]] = {}
            for chunk in _batches(flat, w.eval.batch):
                for (i, _), s in zip(chunk, score(model, [c for _, c in chunk], device, None)):
                    totals.setdefault(i, []).append(-s["nll"])
            for i, e in enumerate(with_choices):
                logliks = totals[i]
                choice_right += int(max(range(len(logliks)), key=logliks.__getitem__) == e.answer_index)
            choice_total = len(with_choices)
        if data.has_answers and data.match == "number":
            budgets = [max(1, data.max_new_tokens - len(e.prompt)) for e in examples]
            texts = [data.decode(t) for t in generate(model, [e.prompt for e in examples], budgets, device,
                                                      w.eval.batch, data.end_token, data.pad_token)]
            exact = sum(number_match(text, e.number) for text, e in zip(texts, examples))
    loss = nll / tokens if tokens else float("nan")
    answers = data.has_answers
    out = {
        "examples": len(examples), "tokens": tokens, "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else float("inf"),
        "token_accuracy": hits / tokens if tokens else float("nan"),
        "exact_match": exact / len(examples) if answers else None,
        "choice_accuracy": choice_right / choice_total if choice_total else None,
        "split": data.split_rule, "split_counts": data.split_counts,
    }
    if counter is not None:
        out["expert_load"] = counter.counts.tolist()
        out["expert_near_ties"] = counter.ties.tolist()
    return out


def load_model(folder: Path, device):
    """The saved model in fp32, whatever the training precision (so stacks are scored alike)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    dtype = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    return AutoModelForCausalLM.from_pretrained(str(folder), **dtype).to(device).eval()


def score(model, samples: list[Sample], device, counter) -> list[dict]:
    """Per sample: summed negative log-likelihood of its labelled tokens, their number, how many are the most
    likely token, and whether all are (1 or 0). ``counter``: an ExpertLoadCounter fed the samples' real tokens."""
    import torch

    ids = torch.tensor([s.input_ids for s in samples], dtype=torch.long, device=device)
    labels = torch.tensor([s.labels for s in samples], dtype=torch.long, device=device)
    mask = labels != IGNORE
    if counter is not None:
        lengths = torch.tensor([s.length for s in samples])
        counter.token_mask = torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        counter.counting = True
    try:
        logits = model(input_ids=ids).logits.float()
    finally:
        if counter is not None:
            counter.counting = False
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.where(mask, labels, torch.zeros_like(labels))
    picked = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1).double()
    right = (logits.argmax(-1) == labels) & mask
    nll = -(picked * mask).sum(1)
    out = []
    for i in range(len(samples)):
        n = int(mask[i].sum())
        out.append({"nll": float(nll[i]), "tokens": n, "hits": int(right[i].sum()),
                    "exact": int(n > 0 and int(right[i].sum()) == n)})
    return out


def generate(model, prompts: list[list[int]], budgets: list[int], device, batch: int, end: int | None,
             pad: int) -> list[list[int]]:
    """Greedy decoding of each prompt, BATCH at a time (left-padded, masked): the new tokens up to the end token
    (left out) or the prompt's budget of new tokens."""
    import torch

    out = []
    for start in range(0, len(prompts), batch):
        chunk, budget = prompts[start : start + batch], budgets[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], dtype=torch.long, device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], dtype=torch.long, device=device)
        new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(budget), do_sample=False,
                             eos_token_id=end, pad_token_id=pad)[:, width:]
        for tokens, most in zip(new.tolist(), budget):
            tokens = tokens[:most]
            out.append(tokens[: tokens.index(end)] if end is not None and end in tokens else tokens)
    return out


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]
