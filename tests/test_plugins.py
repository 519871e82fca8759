"""Plugins: registration through pluggy, support checks before launch, the adapters listing."""

import itertools
import json
import re
import subprocess
import sys

import pytest

import llmadapt
from llmadapt import AdapterInfo, EnvironmentSpec, LlmadaptError, Supports, UnsupportedError, Workload, hookimpl
from llmadapt.adapter.plugins import check_supported, collect_adapters, get_adapter, plugin_manager

ENV = EnvironmentSpec(name="x", requirements=("torch==2.13.0",))


def info(name, **supports):
    return AdapterInfo(name=name, version="1", framework="f", roles={"train": "m:C"}, environment=ENV,
                       supports=Supports(**supports))


@pytest.fixture
def pm():
    return plugin_manager(load_entrypoints=False)


def test_local_plugin_registers_like_an_entry_point(pm):
    """A plugin object with the hook registers adapters on a fresh manager."""
    class Plugin:
        @hookimpl
        def llmadapt_register_adapters(self, register):
            register(info("mine"))

    pm.register(Plugin())
    assert list(collect_adapters(pm)) == ["mine"]
    assert get_adapter("mine", pm).framework == "f"


def test_duplicate_names_are_an_error_naming_both_plugins(pm):
    """Two plugins registering one name is refused, naming both."""
    class A:
        @hookimpl
        def llmadapt_register_adapters(self, register):
            register(info("same"))

    pm.register(A(), name="first")
    pm.register(A(), name="second")
    with pytest.raises(LlmadaptError, match="adapter 'same' is registered twice: by plugin '.*' and by '.*'"):
        collect_adapters(pm)


def test_misspelt_hook_is_caught(pm):
    """A hook implementation with an unknown name fails validation instead of doing nothing."""
    class Typo:
        @hookimpl
        def llmadapt_register_adapter(self, register):
            pass

    pm.register(Typo())
    with pytest.raises(Exception, match="unknown hook"):
        pm.check_pending()


def test_reference_adapter_comes_from_the_entry_point():
    """The built-in torch adapter registers through the `llmadapt` entry-point group."""
    from importlib import metadata

    names = {ep.name: ep.value for ep in metadata.entry_points(group="llmadapt")}
    assert names["torch"] == "llmadapt.reference.plugin"
    assert "torch" in llmadapt.adapters()


def test_unknown_adapter_lists_the_known_ones():
    """Asking for an unregistered adapter names it and lists what exists."""
    with pytest.raises(llmadapt.UnknownAdapterError, match="unknown adapter 'nope'; registered adapters: .*torch"):
        get_adapter("nope")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["parallelism.tp=2"], "adapter 'a' cannot run parallelism.tp=2: supported: 1"),
        (["optimizations.zero_stage=2"], "adapter 'a' cannot run optimizations.zero_stage=2: supported: 0"),
        (["precision=bf16"], "adapter 'a' cannot run precision='bf16': supported: fp32"),
        (["kind=finetune"], "adapter 'a' does not support kind='finetune'; roles: train"),
    ],
)
def test_unsupported_requests_fail_with_one_line(sets, message):
    """The declaration is checked before anything starts."""
    with pytest.raises(UnsupportedError) as err:
        check_supported(info("a"), Workload().with_overrides(sets))
    assert str(err.value) == message


def test_adapter_check_hook_adds_rules():
    """An adapter's own check() problems are reported the same way."""
    custom = AdapterInfo(name="c", version="1", framework="f", roles={"train": "m:C"}, environment=ENV,
                         check=lambda w: [("precision", w.precision, "fp16 needs a GPU")])
    with pytest.raises(UnsupportedError, match=r"adapter 'c' cannot run precision='fp32': fp16 needs a GPU"):
        check_supported(custom, Workload())


SUGGESTED = re.compile(r"; (?:use )?([\w-]+(?: or [\w-]+)*)(?: can)?(?: \(and \d+ more\))?$")
AXES = {  # every combination is a workload (where the spec accepts it) put to every registered adapter
    "model.preset": ["tiny-llama", "tiny-mixtral", "tiny-jamba"],
    "lora.rank": [0, 8],
    "optimizations.quantization": ["none", "nf4", "int8"],
    "data.packing": ["false", "true"],
    "parallelism.tp": [1, 2],
}


def suggestion_workloads():
    for values in itertools.product(*AXES.values()):
        sets = [f"{k}={v}" for k, v in zip(AXES, values)]
        sets += ["kind=finetune", "train.seq_len=32", "train.global_batch=4"] if "lora.rank=8" in sets else []
        try:
            yield sets, Workload().with_overrides(sets)
        except llmadapt.WorkloadError:
            continue  # a combination the spec refuses itself: no adapter is asked


def test_a_refusal_names_only_adapters_that_run_the_workload():
    """Property: whatever a refusal suggests ('X can', 'use X') is an adapter whose own check accepts the whole
    workload; where none does, the refusal says so instead of naming one."""
    from llmadapt.adapter.plugins import adapters

    seen = 0
    for sets, workload in suggestion_workloads():
        for name, adapter in adapters().items():
            try:
                check_supported(adapter, workload)
                continue
            except UnsupportedError as err:
                message = str(err)
            found = SUGGESTED.search(message)
            if found and "no installed adapter runs this" not in message and "no other installed" not in message:
                seen += 1
                for other in found.group(1).split(" or "):
                    check_supported(get_adapter(other), workload)  # raises, naming the workload, if it cannot
            elif "no installed adapter runs this" in message:
                for other, adapter_other in adapters().items():
                    with pytest.raises(UnsupportedError):
                        check_supported(adapter_other, workload)
    assert seen  # the property was put to suggestions, not only to refusals without one


def test_load_plugins_variable_limits_entry_points(monkeypatch):
    """LLMADAPT_LOAD_PLUGINS='' loads no entry-point plugin at all."""
    monkeypatch.setenv("LLMADAPT_LOAD_PLUGINS", "")
    assert collect_adapters(plugin_manager()) == {}


def test_adapters_command_lists_roles_supports_and_environment():
    """`llmadapt adapters --json` shows name, version, roles, supports and environment readiness."""
    out = subprocess.run([sys.executable, "-m", "llmadapt.cli", "adapters", "--json"], capture_output=True, text=True,
                         check=True)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    torch = rows["torch"]
    assert torch["roles"] == ["train", "finetune"]
    assert torch["environment"] == "torch"
    from llmadapt.launch.environments import status

    assert torch["environment_status"] == status(get_adapter("torch").environment)
    assert "dp" in torch["supports"] and "lora" in torch["supports"]
    assert rows["vllm"]["run_files"] == dict(get_adapter("vllm").run_files) and "vllm-cache" in rows["vllm"]["run_files"]


def test_every_adapter_declares_run_folder_files_the_core_leaves_alone():
    """Each adapter's own run-folder files (AdapterInfo.run_files) are plain names, said what they hold, and none is
    a file the core writes or reads: the layout of a run folder is RunDir's names and these."""
    from llmadapt.contract.rundir import RunDir

    declared = {(a.name, name): what for a in llmadapt.adapters().values() for name, what in a.run_files.items()}
    assert {("vllm", "vllm-cache"), ("llamacpp", "gguf.json"), ("deepspeed", "hostfile")} <= set(declared)
    assert [k for k, what in declared.items() if RunDir.adapter_name_problem(k[1]) or not what.strip()] == []


@pytest.mark.parametrize("name, declared, refused", [
    ("engine-cache", {"engine-cache": "a cache"}, None),
    ("engine-cache", ("engine-cache",), None),
    ("other.json", {"engine-cache": "a cache"}, "not among the adapter's declared run-folder files (engine-cache)"),
    ("summary.json", {"summary.json": ""}, "one of the core's run-folder files"),
    ("engine-profile", {"engine-profile": ""}, "one of the core's run-folder files"),
    ("engine.jsonl", {"engine.jsonl": ""}, "read by the core as records"),
    ("node-2", {"node-2": ""}, "a node folder"),
    ("cache/x", {"cache/x": ""}, "not a plain file or folder name"),
    ("..", {"..": ""}, "not a plain file or folder name"),
])
def test_an_adapter_file_is_one_it_declared_and_not_the_cores(tmp_path, name, declared, refused):
    from llmadapt.contract.rundir import RunDir

    if refused is None:
        assert RunDir(tmp_path).adapter_file(name, declared) == tmp_path / name
    else:
        with pytest.raises(ValueError, match=re.escape(refused)):
            RunDir(tmp_path).adapter_file(name, declared)


def test_listing_adapters_does_not_import_torch():
    """The orchestrator path stays light: no torch import to list adapters or show help."""
    code = ("import sys; from llmadapt.cli import main\n"
            "for argv in (['adapters'], ['--help']):\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'LIGHT')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("LIGHT")


def test_a_plugin_whose_registration_raises_is_one_line_naming_it(pm):
    class Broken:
        @hookimpl
        def llmadapt_register_adapters(self, register):
            register(AdapterInfo(name="broken", roles={"nope": "x:Y"}, framework="f", version="0"))

    pm.register(Broken(), name="broken-plugin")
    with pytest.raises(LlmadaptError) as exc:
        collect_adapters(pm)
    message = str(exc.value)
    assert message.startswith("plugin 'broken-plugin' failed to register its adapters: ") and "\n" not in message


def test_a_source_checkout_that_is_not_installed_finds_its_own_adapters(tmp_path):
    """A copy of the checkout on PYTHONPATH, run by an interpreter where llmadapt is not installed (the reference
    adapter's environment, as on a machine with no network): its adapters come from its pyproject files."""
    import shutil

    from llmadapt.launch.environments import TOOLS_ENVIRONMENT, EnvironmentNotReadyError, python_for

    try:
        python = python_for(TOOLS_ENVIRONMENT)
    except EnvironmentNotReadyError as exc:
        pytest.skip(str(exc))
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    checkout = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("*.egg-info", "__pycache__")
    for part in ("llmadapt", "plugins", "examples"):
        shutil.copytree(root / part, checkout / part, ignore=ignore)
    shutil.copy(root / "pyproject.toml", checkout)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(checkout), "LLMADAPT_HOME": str(tmp_path / "home")}
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; m.distribution('llmadapt')"],
                           env=env, cwd=tmp_path, capture_output=True, text=True)
    assert "PackageNotFoundError" in probe.stderr  # not installed there: the case under test
    done = subprocess.run([str(python), "-m", "llmadapt.cli", "adapters", "--json"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    names = {a["name"] for a in json.loads(done.stdout)}
    assert {"torch", "hf", "deepspeed", "megatron", "colossalai", "vllm", "llamacpp", "plain"} <= names
