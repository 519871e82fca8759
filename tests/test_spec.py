"""Workload specification: presets, files, overrides, hashes and the errors users see."""

import json
import os
from pathlib import Path

import pytest

from llmadapt import MODEL_PRESETS, Workload, WorkloadError


def test_presets_expand_to_real_shapes():
    """llama2-70b has GQA with 8 KV heads; mixtral-8x7b routes top-2 of 8 experts."""
    w = Workload.from_dict({"model": {"preset": "llama2-70b"}})
    assert (w.model.hidden_size, w.model.num_layers, w.model.num_heads, w.model.num_kv_heads) == (8192, 80, 64, 8)
    m = Workload.from_dict({"model": {"preset": "mixtral-8x7b"}}).model
    assert (m.num_experts, m.experts_per_token, m.is_moe) == (8, 2, True)
    assert set(MODEL_PRESETS) >= {"llama2-7b", "llama2-13b", "llama2-70b", "mixtral-8x7b", "tiny-llama", "tiny-mixtral"}


def test_explicit_fields_override_a_preset():
    """Fields next to a preset replace the preset's values."""
    w = Workload.from_dict({"model": {"preset": "tiny-llama", "num_layers": 3}})
    assert w.model.num_layers == 3 and w.model.hidden_size == 64


def test_hash_is_stable_and_ignores_labels():
    """A preset and its explicit fields hash the same; names are labels, not content."""
    a = Workload.from_dict({"model": {"preset": "tiny-llama"}, "name": "a"})
    explicit = dict(MODEL_PRESETS["tiny-llama"])
    b = Workload.from_dict({"model": explicit, "name": "b"})
    assert a.content_hash == b.content_hash
    assert len(a.content_hash) == 64
    assert a.with_overrides(["train.steps=11"]).content_hash != a.content_hash


def test_problem_hash_ignores_layout_but_not_math():
    """Parallel layout and memory techniques keep the problem hash; precision or LoRA change it."""
    w = Workload()
    same = w.with_overrides(["parallelism.dp=2", "train.micro_batch=2", "optimizations.recompute=full",
                              "train.optimizer_impl=cpu_adam"])
    assert same.problem_hash == w.problem_hash and same.content_hash != w.content_hash
    assert w.with_overrides(["precision=bf16"]).problem_hash != w.problem_hash


@pytest.mark.parametrize("suffix", ["toml", "yaml", "json"])
def test_loads_every_file_format(tmp_path, suffix):
    """TOML, YAML and JSON files give the same workload."""
    texts = {
        "toml": 'kind = "train"\n[model]\npreset = "tiny-llama"\n[train]\nsteps = 3\n',
        "yaml": "kind: train\nmodel: {preset: tiny-llama}\ntrain: {steps: 3}\n",
        "json": json.dumps({"kind": "train", "model": {"preset": "tiny-llama"}, "train": {"steps": 3}}),
    }
    path = tmp_path / f"w.{suffix}"
    path.write_text(texts[suffix])
    w = Workload.from_file(path)
    assert w.train.steps == 3 and w.model.name == "tiny-llama"


def test_data_path_is_relative_to_the_workload_file(tmp_path):
    """A relative data.path resolves against the file's folder, so examples run from anywhere."""
    (tmp_path / "d.jsonl").write_text('{"instruction": "a", "answer": "b"}\n')
    (tmp_path / "w.toml").write_text('kind = "finetune"\n[data]\nsource = "jsonl"\npath = "d.jsonl"\n')
    assert Workload.from_file(tmp_path / "w.toml").data.path == str(tmp_path / "d.jsonl")


def test_overrides_parse_values():
    """--set values are parsed: numbers, booleans, lists."""
    w = Workload(kind="finetune").with_overrides(
        ["train.lr=0.01", "optimizations.flash_attention=true", "lora.rank=4", "lora.target_modules=[q_proj,k_proj]"]
    )
    assert w.train.lr == 0.01 and w.optimizations.flash_attention is True
    assert w.lora.target_modules == ("q_proj", "k_proj")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["optimizations.zero_stage=5"], "workload field 'optimizations.zero_stage': got 5; allowed: 0, 1, 2, 3"),
        (["parallelism.dp=3"], "workload field 'train.global_batch': got 8; must be divisible by parallelism.dp=3"),
        (["train.micro_batch=3"], "workload field 'train.micro_batch': got 3; must divide the per-rank batch "
                                  "global_batch/dp = 8"),
        (["model.preset=llama3"], "workload field 'model.preset': got 'llama3'; known presets: llama2-7b, "
                                  "llama2-13b, llama2-70b, mixtral-8x7b, jamba-v0.1, tiny-llama, tiny-mixtral, tiny-jamba"),
        (["train.stepz=3"], "workload field 'train.stepz': got 3; unknown field (did you mean 'steps'?); known here: global_batch, lr, "
                            "micro_batch, on_nonfinite, optimizer, optimizer_impl, seq_len, steps, warmup_steps, weight_decay"),
        (["precision=fp8"], "workload field 'precision': got 'fp8'; allowed: fp32, bf16, fp16"),
        (["train.steps=many"], "workload field 'train.steps': got 'many'; must be an integer"),
        (["parallelism.tp=4"], "workload field 'parallelism.tp': got 4; must divide model.num_heads=4 and "
                               "model.num_kv_heads=2"),
        (["optimizations.offload=optimizer+params", "optimizations.zero_stage=2"],
         "workload field 'optimizations.offload': got 'optimizer+params'; parameter offload needs "
         "optimizations.zero_stage = 3"),
        (["train.optimizer_impl=cpu_adam", "train.optimizer=sgd"],
         "workload field 'train.optimizer_impl': got 'cpu_adam'; cpu_adam needs train.optimizer adam or adamw"),
        (["optimizations.quantization=nf4"], "workload field 'optimizations.quantization': got 'nf4'; quantized "
                                             "base weights do not train: set lora.rank > 0 (QLoRA)"),
        (["data.source=jsonl", "data.path=/nonexistent.jsonl"],
         "workload field 'data.path': got '/nonexistent.jsonl'; no such file"),
        (["serve.send_spin_ms=-1"], "workload field 'serve.send_spin_ms': got -1.0; must be >= 0"),
    ],
)
def test_bad_input_names_field_value_and_allowed(sets, message):
    """Every rule violation is one line naming the field, the value and what is allowed."""
    with pytest.raises(WorkloadError) as info:
        Workload().with_overrides(sets)
    assert str(info.value) == message


def test_unparseable_file_is_one_clear_line(tmp_path):
    """A syntax error in a workload file names the file."""
    path = tmp_path / "bad.toml"
    path.write_text("kind = \n")
    with pytest.raises(WorkloadError, match=r"workload field 'file': got '.*bad.toml'; could not be parsed"):
        Workload.from_file(path)


@pytest.mark.parametrize("raw, expected", [("3e-3", 3e-3), ("1e-4", 1e-4), ("1E5", 1e5), ("0.5", 0.5)])
def test_numbers_are_numbers_as_people_write_them(tmp_path, raw, expected):
    """YAML 1.1 reads 3e-3 as a string; in --set and in YAML files it is the number the docs mean."""
    assert Workload.from_dict({}).with_overrides([f"train.lr={raw}"]).train.lr == expected
    path = tmp_path / "w.yaml"
    path.write_text(f"train:\n  lr: {raw}\n")
    assert Workload.from_file(path).train.lr == expected


def test_a_workload_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "w.toml"
    path.write_bytes(b'name = "\xff\xfe"\n')
    with pytest.raises(WorkloadError, match="is not UTF-8 text") as info:
        Workload.from_file(path)
    assert "\n" not in str(info.value)


def test_matrix_axes_are_given_once_and_parse_cleanly():
    from llmadapt.analysis.comparison import parse_matrix
    from llmadapt.errors import LlmadaptError

    assert parse_matrix(["train.lr=1e-3,3e-3"]) == {"train.lr": [1e-3, 3e-3]}
    with pytest.raises(LlmadaptError, match="given twice"):
        parse_matrix(["parallelism.dp=1,2", "parallelism.dp=2,4"])
    with pytest.raises(LlmadaptError, match="is not a YAML scalar"):
        parse_matrix(["train.lr=[1"])


def _jsonl(tmp_path, text):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    return ["kind=finetune", "data.source=jsonl", f"data.path={path}"]


@pytest.mark.parametrize("sets, field, allowed", [
    (["train.lr=.nan"], "train.lr", "must be a finite number >= 0.0"),
    (["train.lr=.inf"], "train.lr", "must be a finite number >= 0.0"),
    (["kind=finetune", "lora.rank=4", "lora.target_modules=[qkv]"], "lora.target_modules",
     "not a linear layer of a llama model"),
    (["kind=finetune", "lora.rank=4", "lora.target_modules=[]"], "lora.target_modules", "name at least one of"),
    (["lora.dropout=1.5"], "lora.dropout", "must be in [0, 1)"),
    (["lora.dropout=-0.1"], "lora.dropout", "must be >= 0.0"),
    (["kind=serve", "serve.max_concurrency=0"], "serve.max_concurrency", "must be >= 1"),
    (["kind=serve", "serve.arrival.concurrency=-2"], "serve.arrival.concurrency", "must be >= 1"),
    (["kind=serve", "serve.duration_s=-1"], "serve.duration_s", "must be a finite number > 0"),
    (["kind=serve", "serve.slo.ttft_ms=-5"], "serve.slo.ttft_ms", "must be a finite number > 0"),
    (["kind=serve", "serve.url=ftp://host/x"], "serve.url", "must be an http:// or https:// URL"),
    (["kind=serve", "serve.url=localhost:8000"], "serve.url", "must be an http:// or https:// URL"),
    (["model.preset=[tiny-llama]"], "model.preset", "known presets"),
])
def test_wrong_values_are_refused_before_anything_runs(sets, field, allowed):
    with pytest.raises(WorkloadError) as info:
        Workload.from_dict({}).with_overrides(sets)
    assert info.value.field == field and allowed in info.value.allowed, str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, allowed", [
    ("", "has no examples"),
    ('{"instruction": "a", "answer": "b"}\n{not json\n', "line 2 is not JSON"),
    ('{"instruction": "a", "reply": "b"}\n', "line 1: needs a text field 'answer' (set data.prompt_field"),
    ('["instruction", "answer"]\n', "line 1: is not a JSON object with the prompt-answer fields"),
    ('{"instruction": 3, "answer": "b"}\n', "line 1: needs a text field 'instruction'"),
])
def test_a_broken_instruction_file_is_refused_at_the_edge(tmp_path, text, allowed):
    with pytest.raises(WorkloadError, match="data.path") as info:
        Workload.from_dict({}).with_overrides(_jsonl(tmp_path, text))
    assert allowed in info.value.allowed


def test_an_empty_workload_file_is_refused(tmp_path):
    for name, text in (("w.toml", ""), ("w.yaml", "# nothing\n"), ("w.json", "{}")):
        (tmp_path / name).write_text(text)
        with pytest.raises(WorkloadError, match="is empty"):
            Workload.from_file(tmp_path / name)


def test_errors_echo_only_an_excerpt_of_the_value():
    with pytest.raises(WorkloadError) as info:
        Workload.from_dict({"name": "x" * 10, "train": {"optimizer": "y" * 1_000_000}})
    assert len(str(info.value)) < 300 and "1000002 characters" in str(info.value)


# The content and problem hashes of the examples, as the single-module spec computed them: stored runs and the run
# store find their workload by these, so code that moves or refactors the spec must leave them as they are. A
# deliberate change (an example edited, CHECKPOINT_RECIPE bumped for the problem hash) updates its pin.
EXAMPLE_HASHES = {
    "breakdown.toml": ("93a624dcb9c6fc5d", "9168ee879df0951a"),
    "deepspeed-techniques.toml": ("68f1d8505da329d1", "c5c7a0b2489b08f6"),
    "finetune-eval.toml": ("4046e72fa8a1ad7a", "d9fc145aaddfbb28"),
    "finetune-lora.yaml": ("4e5812c26c6a252d", "0813c97285e7658c"),
    "serve-compare.toml": ("0c13e2f9fd2a3590", "e64dbd69e75df67e"),
    "serve-mooncake.toml": ("d369839b33589b2c", "04c4ba608ffe0ebc"),
    "serve-sharegpt.toml": ("194be0711fe019d1", "73175b1a32c19f89"),
    "serve-tiny.toml": ("fc9cba7cb97b2889", "8a1a9de1481d75b6"),
    "tiny-llama.toml": ("98a04020997b9638", "49a683fe3d58b7eb"),
    "tiny-mixtral.toml": ("66e3e94194b006b3", "928301e3a24bcdb8"),
}


@pytest.mark.parametrize("name", sorted(EXAMPLE_HASHES))
def test_the_examples_hash_as_they_did(name, monkeypatch):
    root = Path(__file__).resolve().parent.parent

    def relative(value):  # the paths of files in the checkout as written relative to it: the same pins anywhere
        if isinstance(value, dict):
            return {k: relative(v) for k, v in value.items()}
        if isinstance(value, str) and value.startswith(f"{root}{os.sep}"):
            return os.path.relpath(value, root)
        return value

    monkeypatch.chdir(root)
    w = Workload.from_dict(relative(Workload.from_file(root / "examples" / name).to_dict()))
    assert (w.content_hash[:16], w.problem_hash[:16]) == EXAMPLE_HASHES[name]
