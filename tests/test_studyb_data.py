"""Study B's data formats read from the user's own files (data.format, eval.format; llmadapt.dataformats):
commonsense_15k / math_14k records (instruction, input, output, answer), HellaSwag multiple choice (ctx, endings,
label) and GSM8K (question, answer ending '#### n') scored by exact match on the final number. What trains and
what is scored is what the file says, token for token; a file missing a field its format needs is one line
before launch naming the file, the line and the field."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from llmadapt import Workload, run
from llmadapt.adapter.context import IGNORE
from llmadapt.dataformats import TEMPLATE, TEMPLATE_INPUT, final_number, gsm8k_number, number_match, parse
from llmadapt.errors import WorkloadError
from llmadapt.testing import environments_unready

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
SAMPLES = {"commonsense-tiny.jsonl": "instruction-input-output", "math-tiny.jsonl": "instruction-input-output",
           "hellaswag-tiny.jsonl": "hellaswag", "gsm8k-tiny.jsonl": "gsm8k"}


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def workload(train: Path, fmt: str, seq_len: int = 256, **eval_) -> Workload:
    spec = {"kind": "finetune", "data": {"source": "jsonl", "path": str(train), "format": fmt},
            "train": {"seq_len": seq_len}}
    if eval_:
        spec["eval"] = eval_
    return Workload.from_dict(spec)


@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast

    from llmadapt.models import canonical_checkpoint

    w = Workload()
    return PreTrainedTokenizerFast.from_pretrained(str(canonical_checkpoint(w.model, w.seed)))


def split(sample):
    """(prompt tokens, the tokens that carry loss) of a training sample."""
    loss = [t for t, label in enumerate(sample.labels) if label != IGNORE]
    assert loss == list(range(loss[0], loss[-1] + 1))  # one answer span
    return sample.input_ids[: loss[0] + 1], [sample.labels[t] for t in loss]


# -- the sample files -----------------------------------------------------------------------------------------------
def test_the_sample_files_are_what_the_script_writes_and_read_whole(tok):
    from llmadapt.runtime.data import TokenData

    files = runpy.run_path(str(DATA / "study_b_samples.py"))["FILES"]
    assert set(files) == set(SAMPLES)
    for name, rows in files.items():
        shipped = [json.loads(line) for line in (DATA / name).read_text().splitlines()]
        assert shipped == rows(), name
        w = workload(DATA / name, SAMPLES[name])  # checked before launch: every row has its fields
        data = TokenData(w, tok)
        texts = {parse(r, SAMPLES[name])[:2] for r in shipped}  # each row once per epoch, as its prompt and answer
        distinct = len(texts)
        assert len({tuple(data.sample(i).input_ids) for i in range(len(shipped))}) == distinct > 1


# -- what trains is what the file says ------------------------------------------------------------------------------
def test_instruction_records_prompt_with_the_template_and_train_on_the_output(tok, tmp_path):
    from llmadapt.runtime.data import TokenData

    rows = [{"instruction": "Which is colder, snow or fire?\n\nAnswer format: answer1/answer2", "input": "",
             "output": "the correct answer is answer1", "answer": "answer1"},
            {"instruction": "How many apples in all?", "input": "Tom has 3 apples and finds 4 more.",
             "output": "3 + 4 = 7. The answer is 7", "answer": "7"}]
    data = TokenData(workload(write(tmp_path / "d.jsonl", rows), "instruction-input-output"), tok)
    seen = {}
    for i in range(2):
        prompt, loss = split(data.sample(i))
        seen[tok.decode(loss)] = prompt
    expected = {
        "the correct answer is answer1</s>": TEMPLATE.format(instruction=rows[0]["instruction"]),
        "3 + 4 = 7. The answer is 7</s>": TEMPLATE_INPUT.format(instruction=rows[1]["instruction"],
                                                                  input=rows[1]["input"]),
    }
    assert set(seen) == set(expected)
    for answer, text in expected.items():
        assert seen[answer] == [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
    assert "### Input:\nTom has 3 apples" in tok.decode(seen["3 + 4 = 7. The answer is 7</s>"])
    assert "### Input" not in tok.decode(seen["the correct answer is answer1</s>"])  # empty input: no section


def test_an_instruction_that_names_its_answer_format_is_multiple_choice(tok, tmp_path):
    """commonsense_15k's layout for evaluation: the choices are the output with each option in the answer's
    place; the right one is the row's answer."""
    from llmadapt.runtime.data import TokenData

    rows = [{"instruction": "Which flies?\n\nAnswer1: a house Answer2: a bird\n\nAnswer format: answer1/answer2",
             "input": "", "output": "the correct answer is answer2", "answer": "answer2"}] * 2
    w = workload(write(tmp_path / "d.jsonl", rows), "instruction-input-output", examples=1)  # the last row held
    [held] = TokenData(w, tok).eval_examples()
    assert held.answer_index == 1 and held.choices[1] == held.sample
    assert [tok.decode(split(c)[1]) for c in held.choices] == ["the correct answer is answer1</s>",
                                                              "the correct answer is answer2</s>"]
    assert held.number is None


def test_hellaswag_rows_score_each_ending_after_the_context(tok, tmp_path):
    from llmadapt.runtime.data import TokenData

    rows = [{"ctx": "The bird sits on the branch.", "endings": ["It sings.", "It melts.", "It reads."], "label": 0},
            {"ctx_a": "A man picks up", "ctx_b": "an apple.", "endings": ["He eats it.", "He is a cloud."],
             "label": "1"}]  # the Hugging Face copy: label as text, the context in two parts
    train = write(tmp_path / "train.jsonl", [{"instruction": "q", "answer": "a"}])
    w = workload(train, "prompt-answer", examples=2, path=str(write(tmp_path / "hs.jsonl", rows)), format="hellaswag")
    held = TokenData(w, tok).eval_examples()
    assert [e.answer_index for e in held] == [0, 1]
    for e, row, context in zip(held, rows, ["The bird sits on the branch.", "A man picks up an apple."]):
        assert e.prompt == [tok.bos_token_id] + tok.encode(context, add_special_tokens=False)
        for choice, ending in zip(e.choices, row["endings"]):
            prompt, loss = split(choice)
            assert prompt == e.prompt
            assert loss == tok.encode(" " + ending, add_special_tokens=False) + [tok.eos_token_id]
        assert e.sample == e.choices[e.answer_index]


def test_gsm8k_trains_on_the_reasoning_and_scores_the_final_number(tok, tmp_path):
    from llmadapt.runtime.data import TokenData

    rows = [{"question": "Tom has 3 apples and finds 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"question": "Ana has 1,000 stones. How many?", "answer": "She has 1,000.\n#### 1,000"}]
    path = write(tmp_path / "g.jsonl", rows)
    data = TokenData(workload(path, "gsm8k"), tok)
    trained = {tuple(split(data.sample(i))[1]) for i in range(2)}
    assert trained == {tuple(tok.encode(r["answer"], add_special_tokens=False) + [tok.eos_token_id]) for r in rows}
    w = workload(write(tmp_path / "t.jsonl", [{"instruction": "q", "answer": "a"}]), "prompt-answer", examples=2,
                 path=str(path), format="gsm8k")
    held = TokenData(w, tok)
    assert held.match == "number" and [e.number for e in held.eval_examples()] == ["7", "1,000"]
    assert held.eval_examples()[0].prompt == [tok.bos_token_id] + tok.encode(rows[0]["question"] + "\n",
                                                                             add_special_tokens=False)
    assert TokenData(w.with_overrides(["eval.match=tokens"]), tok).match == "tokens"


# -- the metrics on hand-made cases ---------------------------------------------------------------------------------
@pytest.mark.parametrize("generated, expected, right", [
    ("3 + 4 = 7 apples. The answer is 7", "7", True),
    ("The answer is 7.", "7", True),  # a sentence's period is not a decimal point
    ("first 7, then she gives 2 away: 5", "7", False),  # the last number differs: 7 is not what it ends on
    ("so 41", "42", False),
    ("She has 1,250 stones", "1250", True),
    ("12.0", "12", True),
    ("-3 degrees", "-3", True),
    ("no number at all", "3", False),
    ("7", None, False),  # an answer without a number matches nothing
])
def test_exact_match_compares_the_last_number_generated(generated, expected, right):
    assert number_match(generated, expected) is right


def test_the_number_of_a_gsm8k_answer_is_after_its_hashes():
    assert gsm8k_number("2 + 3 = <<2+3=5>>5 then 5 * 2 = 10\n#### 10") == "10"
    assert gsm8k_number("she has 4 left") is None
    assert final_number("7 and then 12, done") == "12"
    assert parse({"question": "q", "answer": "1 + 1 = 2\n#### 2"}, "gsm8k").number == "2"
    assert parse({"instruction": "i", "input": "", "output": "o 9", "answer": "42"},
                 "instruction-input-output").number == "42"  # the bare answer, not the output's last number
    assert parse({"instruction": "i", "input": "", "output": "o 9", "answer": "answer2"},
                 "instruction-input-output").number is None  # commonsense's answers are not numbers


@pytest.fixture(scope="module")
def checkpoint():
    from llmadapt.models import canonical_checkpoint

    w = Workload()
    return canonical_checkpoint(w.model, w.seed)


def test_choice_accuracy_is_the_ending_with_the_highest_log_likelihood(tok, checkpoint, tmp_path):
    """Labels set to the canonical model's most likely ending (computed here, one unpadded forward pass per
    ending) on half the rows and to another ending on the rest: choice accuracy is exactly one half."""
    import torch

    from llmadapt.runtime.data import TokenData
    from llmadapt.runtime.evaluation import evaluate_folder, load_model

    model = load_model(checkpoint, "cpu")
    scenes = [("The bird sits on the branch.", ["It sings.", "It melts away.", "It reads a book.", "Stone."]),
              ("A woman turns on the lamp.", ["The room is light.", "The lamp runs.", "She eats it.", "Rain."]),
              ("The children throw stones.", ["They sink.", "They fly up.", "Trees grow.", "A cloud sings."]),
              ("A man picks up an apple.", ["He eats it.", "He flies.", "It is a house.", "The river."])]
    rows = []
    for i, (ctx, endings) in enumerate(scenes * 2):
        prompt = [tok.bos_token_id] + tok.encode(ctx, add_special_tokens=False)
        logliks = []
        for ending in endings:
            answer = tok.encode(" " + ending, add_special_tokens=False) + [tok.eos_token_id]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + answer])).logits[0].double(), -1)
            logliks.append(sum(float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(answer)))
        best = max(range(4), key=logliks.__getitem__)
        assert sorted(logliks)[-1] - sorted(logliks)[-2] > 1e-4  # no near-tie
        rows.append({"ctx": ctx, "endings": endings, "label": best if i < 4 else (best + 1) % 4})
    w = workload(write(tmp_path / "t.jsonl", [{"instruction": "q", "answer": "a"}]), "prompt-answer", examples=8,
                 path=str(write(tmp_path / "hs.jsonl", rows)), format="hellaswag", batch=3)
    figures = evaluate_folder(checkpoint, TokenData(w, tok), "cpu")
    assert figures["choice_accuracy"] == 0.5
    assert figures["exact_match"] is not None  # teacher-forced tokens for a set without numbers


def test_number_match_is_what_the_evaluation_reports(tok, checkpoint, tmp_path, monkeypatch):
    """The evaluation's exact match for gsm8k is the final number of the generated texts (here hand-made), not
    the teacher-forced tokens: one right, one whose last number differs, one right with a separator."""
    from llmadapt.runtime import evaluation
    from llmadapt.runtime.data import TokenData

    rows = [{"question": "q1", "answer": "x\n#### 7"}, {"question": "q2", "answer": "y\n#### 5"},
            {"question": "q3", "answer": "z\n#### 1250"}]
    texts = ["so 7", "5 apples and 2 more make 7", "she has 1,250"]
    asked = []

    def generate(model, prompts, budgets, device, batch, end, pad):
        asked.append((prompts, budgets))
        return [tok.encode(t, add_special_tokens=False) for t in texts]

    monkeypatch.setattr(evaluation, "generate", generate)
    w = workload(write(tmp_path / "t.jsonl", [{"instruction": "q", "answer": "a"}]), "prompt-answer", seq_len=32,
                 examples=3, path=str(write(tmp_path / "g.jsonl", rows)), format="gsm8k")
    data = TokenData(w, tok)
    figures = evaluation.evaluate_folder(checkpoint, data, "cpu")
    assert figures["exact_match"] == pytest.approx(2 / 3)
    [(prompts, budgets)] = asked
    assert prompts == [e.prompt for e in data.eval_examples()]
    assert budgets == [33 - len(p) for p in prompts]  # the tokens a training sample holds, prompt included


def test_generation_is_greedy_decoding_of_each_prompt_in_a_padded_batch(checkpoint):
    """Left-padded batches decode what each prompt alone decodes, cut at the end token or the budget."""
    import torch

    from llmadapt.runtime.evaluation import generate, load_model

    model = load_model(checkpoint, "cpu")
    prompts = [[1, 40, 41, 42, 43, 44, 45], [1, 50], [1, 60, 61, 62]]
    budgets = [5, 9, 3]
    batched = generate(model, prompts, budgets, "cpu", 3, 2, 0)
    for p, b, out in zip(prompts, budgets, batched):
        with torch.no_grad():
            alone = model.generate(torch.tensor([p]), max_new_tokens=b, do_sample=False, eos_token_id=2,
                                   pad_token_id=0)[0, len(p):].tolist()
        alone = alone[: alone.index(2)] if 2 in alone else alone
        assert out == alone and len(out) <= b


# -- bad input: one line before launch ------------------------------------------------------------------------------
GOOD = {"instruction-input-output": {"instruction": "i", "input": "", "output": "o", "answer": "a"},
        "hellaswag": {"ctx": "c", "endings": ["a", "b"], "label": 0},
        "gsm8k": {"question": "q", "answer": "r\n#### 3"},
        "prompt-answer": {"instruction": "q", "answer": "a"}}


@pytest.mark.parametrize("fmt, row, message", [
    ("instruction-input-output", {"instruction": "i", "input": "", "answer": "a"}, "needs a text field 'output'"),
    ("instruction-input-output", {"input": "", "output": "o", "answer": "a"}, "needs a text field 'instruction'"),
    ("instruction-input-output", {"instruction": "i", "output": "o"}, "needs a text field 'answer'"),
    ("hellaswag", {"endings": ["a", "b"], "label": 0}, "needs a text field 'ctx'"),
    ("hellaswag", {"ctx": "c", "label": 0}, "needs a field 'endings'"),
    ("hellaswag", {"ctx": "c", "endings": ["a", "b"]}, "needs a field 'label'"),
    ("hellaswag", {"ctx": "c", "endings": ["a", "b"], "label": 2}, "label 2 is not an index of its 2 endings"),
    ("gsm8k", {"answer": "#### 3"}, "needs a text field 'question'"),
    ("gsm8k", {"question": "q", "answer": "three"}, "needs an answer that ends with '#### <number>'"),
    ("prompt-answer", {"instruction": "q"}, "needs a text field 'answer'"),
])
@pytest.mark.parametrize("where", ["data.path", "eval.path"])
def test_a_row_missing_a_field_is_one_line_naming_file_line_and_field(fmt, row, message, where, tmp_path):
    path = write(tmp_path / "rows.jsonl", [GOOD[fmt], GOOD[fmt], row])
    if where == "data.path":
        build = lambda: workload(path, fmt)  # noqa: E731
    else:
        train = write(tmp_path / "train.jsonl", [GOOD["prompt-answer"]])
        build = lambda: workload(train, "prompt-answer", examples=2, path=str(path), format=fmt)  # noqa: E731
    with pytest.raises(WorkloadError, match=where.replace(".", r"\.")) as caught:
        build()
    text = str(caught.value)
    assert "\n" not in text and str(path) in text and f"line 3: {message}" in text


@pytest.mark.parametrize("overrides, field, message", [
    (["eval.examples=1", "eval.format=gsm8k"], "eval.format", "is the layout of eval.path"),
    (["eval.examples=1", "eval.match=number"], "data.path", "line 1: has no number in its answer"),
    (["data.format=csv"], "data.format", "allowed: prompt-answer, instruction-input-output"),
])
def test_bad_format_settings_are_one_line(overrides, field, message, tmp_path):
    path = write(tmp_path / "d.jsonl", [GOOD["prompt-answer"], GOOD["prompt-answer"]])
    with pytest.raises(WorkloadError, match=field.replace(".", r"\.")) as caught:
        workload(path, "prompt-answer").with_overrides(overrides)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_formats_left_at_their_defaults_keep_the_hashes(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"instruction": "q", "answer": "it is 3"}] * 2)
    plain = workload(path, "prompt-answer", examples=1)
    assert "format" not in plain.problem_dict()["data"] and "match" not in plain.problem_dict()["eval"]
    assert plain.problem_hash != plain.with_overrides(["eval.match=number"]).problem_hash
    other = write(tmp_path / "i.jsonl", [GOOD["instruction-input-output"]] * 2)
    assert workload(other, "instruction-input-output").problem_dict()["data"]["format"] == "instruction-input-output"


# -- for real: a fine-tune evaluated before and after ---------------------------------------------------------------
def test_a_fine_tune_evaluated_on_gsm8k_before_and_after_with_its_accuracy_curve(tmp_path):
    """The tiny Mixtral learns to end every answer on '#### 77'; evaluated by greedy generation on GSM8K rows whose
    answers are 77 and 78 in turn, exact match on the final number goes from none to exactly half. The report
    draws the accuracy curve beside the expert load before and after."""
    if environments_unready("torch"):
        pytest.skip(environments_unready("torch"))
    train = write(tmp_path / "train.jsonl", [{"question": f"{a} and {b}?", "answer": "#### 77"}
                                             for a in range(10) for b in range(10)])
    held = write(tmp_path / "gsm8k.jsonl", [{"question": f"{a} and {a + 1}?", "answer": f"#### {78 - a % 2}"}
                                            for a in range(8)])
    w = Workload.from_file(Path(__file__).resolve().parents[1] / "examples" / "tiny-mixtral.toml").with_overrides([
        "kind=finetune", "data.source=jsonl", f"data.path={train}", "data.format=gsm8k",
        "train.seq_len=24", "train.global_batch=4", "train.micro_batch=4", "train.steps=24",
        "train.warmup_steps=0", "train.lr=0.005", "telemetry.interval_s=0",
        "eval.examples=8", f"eval.path={held}", "eval.every=12", "eval.batch=8"])
    assert w.eval.resolved_match(w.data.format) == "number"
    result = run(w, "torch", out=tmp_path / "runs")
    assert result.ok, result.summary.failures
    points = result.summary.evaluations
    assert [p.step for p in points] == [0, 12, 24]
    assert points[0].exact_match == 0.0 and points[-1].exact_match == 0.5
    assert points[0].expert_load != points[-1].expert_load

    from llmadapt.analysis import figures as F
    from llmadapt.analysis.htmlreport import build

    _, figs, _ = build([result.run_dir], keep_figures=True)
    try:
        assert {"evaluation", "eval_expert_load"} <= set(figs)
        order = list(figs)
        assert order.index("eval_expert_load") == order.index("evaluation") + 1  # side by side in the page
        right = figs["evaluation"][1].axes[1]
        assert [list(line.get_ydata()) for line in right.get_lines()] == [[p.exact_match for p in points]]
    finally:
        for _, fig in figs.values():
            F.close(fig)


def test_the_accuracy_figure_draws_choice_accuracy_beside_exact_match():
    from llmadapt.analysis import figures as F

    points = [{"step": s, "loss": 2.0 - s / 10, "exact_match": e, "choice_accuracy": c, "token_accuracy": 0.1}
              for s, e, c in [(0, 0.0, 0.25), (5, 0.5, 0.75), (10, 1.0, 1.0)]]
    fig = F.evaluation_curves([F.ReportRun("torch", Path("."), Workload(), {"evaluations": points}, [])])
    try:
        lines = fig.axes[1].get_lines()
        assert [(line.get_linestyle(), list(line.get_ydata())) for line in lines] == [
            ("-", [0.0, 0.5, 1.0]), (":", [0.25, 0.75, 1.0])]
    finally:
        F.close(fig)
