"""Adapter environments: recipes, their states, the build steps and one builder at a time.

The real builds (every adapter's environment, the --no-deps and uninstall steps of colossalai and
vllm among them) run in `make test` before this suite; here the steps are checked without pip.
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llmadapt.adapter.declaration import EnvironmentSpec
from llmadapt.errors import EnvironmentNotReadyError, LlmadaptError
from llmadapt.launch import environments


REAL_STATE = os.environ.get("LLMADAPT_HOME")
"""The state folder the built environments are in (the fixture below points every test elsewhere)."""


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMADAPT_HOME", str(tmp_path))
    monkeypatch.delenv("LLMADAPT_PYTHON_DEMO", raising=False)
    return tmp_path


def spec(**kw) -> EnvironmentSpec:
    return EnvironmentSpec(**{"name": "demo", "requirements": ("torch==2.13.0",), **kw})


def test_optional_steps_join_the_recipe_only_when_used():
    plain = environments.recipe(spec())
    assert "no_deps_requirements" not in plain and "remove_after_install" not in plain
    full = environments.recipe(spec(no_deps_requirements=("colossalai==0.5.0",), remove_after_install=("triton",)))
    assert full["no_deps_requirements"] == ["colossalai==0.5.0"] and full["remove_after_install"] == ["triton"]
    assert environments.recipe_hash(spec()) != environments.recipe_hash(spec(remove_after_install=("triton",)))
    # Who builds the checkpoint is not an install step: it does not make a built environment stale.
    assert environments.recipe_hash(spec()) == environments.recipe_hash(spec(builds_checkpoint=False))


def built(s: EnvironmentSpec, recipe_hash: str | None = None, distributions=()) -> Path:
    """An environment folder as a build leaves it (marker, interpreter, site-packages), without pip."""
    target = environments.env_dir(s)
    site = environments._site_packages(target)
    site.mkdir(parents=True, exist_ok=True)
    for name in distributions:
        (site / name).mkdir(exist_ok=True)
    (target / "bin").mkdir(exist_ok=True)
    (target / "bin" / "python").touch()
    (target / environments.MARKER).write_text(json.dumps({
        "recipe_hash": recipe_hash or environments.recipe_hash(s), "distributions": list(distributions)}))
    return target


def test_states_and_the_error_that_says_what_to_run(monkeypatch, state):
    s = spec()
    assert environments.status(s) == "missing"
    with pytest.raises(EnvironmentNotReadyError, match=r"'demo' has not been built: run `llmadapt env create demo`"):
        environments.python_for(s)
    # A build of other pins lives in its own folder: this recipe's is still to build, and says so.
    other = spec(requirements=("torch==2.12.0",))
    built(other)
    assert environments.env_dir(other) != environments.env_dir(s)
    assert environments.status(s) == "stale" and environments.status(other) == "ready"
    with pytest.raises(EnvironmentNotReadyError, match="built from an older recipe"):
        environments.python_for(s)
    target = built(s)
    assert environments.status(s) == "ready"
    assert environments.python_for(s) == target / "bin" / "python"
    assert target.parent == state / "envs" and target.name == f"demo-{environments.recipe_hash(s)[:12]}"
    monkeypatch.setenv("LLMADAPT_PYTHON_DEMO", "/opt/conda/bin/python")
    assert environments.status(s) == "override" and str(environments.python_for(s)) == "/opt/conda/bin/python"


def test_a_ready_environment_whose_packages_are_gone_is_refused_with_the_repair(state):
    s = spec()
    target = built(s, distributions=("torch-2.13.0.dist-info", "numpy-2.3.0.dist-info", "peft-0.21.2.dist-info"))
    assert environments.status(s) == "ready"
    import shutil

    shutil.rmtree(environments._site_packages(target) / "torch-2.13.0.dist-info")
    assert environments.status(s) == "broken"
    with pytest.raises(EnvironmentNotReadyError) as err:
        environments.python_for(s)
    assert "\n" not in str(err.value)
    assert "is damaged (torch-2.13.0.dist-info gone since it was built)" in str(err.value)
    assert str(err.value).endswith("run `llmadapt env create demo --force`")
    (target / "bin" / "python").unlink()
    assert environments.missing_distributions(s)[0] == "bin/python"


def test_the_recipe_names_no_path_so_clones_share_environments(tmp_path):
    """Two copies of one adapter package in different folders (two clones) make one recipe; workers get
    the copy the orchestrator runs, first on PYTHONPATH, before what the caller had there."""
    copies = []
    for clone in ("a", "b"):
        package = tmp_path / clone / "plugins" / "demo"
        package.mkdir(parents=True)
        (package / "pyproject.toml").write_text(
            '[project]\nname = "llmadapt-demo"\ndependencies = ["llmadapt", "numpy>=2"]\n')
        copies.append(spec(local_packages=(str(package),)))
    first, second = copies
    assert environments.recipe_hash(first) == environments.recipe_hash(second)
    assert "numpy>=2" in environments.recipe(first)["dependencies"]
    assert not any("llmadapt" == d for d in environments.recipe(first)["dependencies"])
    assert str(tmp_path) not in json.dumps(environments.recipe(first))
    env = environments.process_env(second, {"PYTHONPATH": "/mine"})
    paths = env["PYTHONPATH"].split(":")
    assert paths[0] == str(environments.core_source()) and paths[1:] == [first.local_packages[0].replace("/a/", "/b/"), "/mine"]
    # A new dependency is another recipe: its own folder, never a rebuild of the shared one.
    (tmp_path / "b" / "plugins" / "demo" / "pyproject.toml").write_text(
        '[project]\nname = "llmadapt-demo"\ndependencies = ["numpy>=2", "scipy"]\n')
    assert environments.env_dir(first) != environments.env_dir(second)


def test_a_local_package_that_is_not_a_source_folder_is_refused(tmp_path):
    with pytest.raises(LlmadaptError, match="is not a source folder"):
        environments.recipe(spec(local_packages=(str(tmp_path),)))


def fake_build(monkeypatch, s: EnvironmentSpec, during=lambda what, args, env: None):
    """``create(s)`` with the build's commands replaced: the interpreter and each step's (what, args, env); the
    venv step lays out what venv would, ``during`` sees each step as it runs."""
    calls = []

    def check(args, what, stream=None, env=None, retries=0):
        calls.append((what, args, env))
        if what == "venv creation":
            environments._site_packages(environments.env_dir(s)).mkdir(parents=True)
            (environments.env_dir(s) / "bin").mkdir()
            (environments.env_dir(s) / "bin" / "python").touch()
        during(what, args, env)

    monkeypatch.setattr(environments, "checked_run", check)
    return environments.create(s, log=lambda line: None), calls


def test_build_steps_in_order(monkeypatch, state):
    s = spec(no_deps_requirements=("colossalai==0.5.0",), remove_after_install=("torchvision", "triton"),
             install_env=(("DS_BUILD_OPS", "0"),))
    python, calls = fake_build(monkeypatch, s)
    assert [what for what, _, _ in calls] == ["venv creation", "pip install", "pip install --no-deps", "pip uninstall"]
    install, no_deps, uninstall = (args for _, args, _ in calls[1:])
    assert install[:6] == [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-compile"]
    assert "torch==2.13.0" in install and "colossalai==0.5.0" not in install
    # install_env changes what a source build makes, which pip's wheel cache does not know: no cache then
    _, plain_calls = fake_build(monkeypatch, spec(name="plain-demo", requirements=("numpy==2.4.6",)))
    assert install[6] == "--no-cache-dir" and "--no-cache-dir" not in plain_calls[1][1]
    assert no_deps[4:] == ["--disable-pip-version-check", "--no-compile", "--no-cache-dir", "--no-deps",
                           "colossalai==0.5.0"]
    # installed without bytecode, its processes keep what they compile even where PYTHONDONTWRITEBYTECODE is set
    assert (environments._site_packages(environments.env_dir(s)) / environments.KEEP_BYTECODE).read_text() == \
        "import sys; sys.dont_write_bytecode = False\n"
    assert uninstall[-3:] == ["-y", "torchvision", "triton"]
    assert environments.status(s) == "ready"


def test_build_files_are_written_before_pip_and_named_in_the_install_env(monkeypatch, state):
    """A file the build reads (llamacpp's CMake script) is in the environment's build-files folder when pip runs,
    its path in the variable that names it; the recipe holds its text and no path, so clones share the build."""
    seen = {}

    def at_pip(what, args, env):
        if what == "pip install":
            path = Path(env["CMAKE_ARGS"].split("=", 1)[1])
            seen.update(path=path, text=path.read_text())

    s = spec(install_env=(("CMAKE_ARGS", "-DCMAKE_PROJECT_INCLUDE={build_files}/opts.cmake"),),
             build_files=(("opts.cmake", "set(X OFF)\n"),))
    fake_build(monkeypatch, s, during=at_pip)
    assert seen == {"path": environments.env_dir(s) / environments.BUILD_FILES / "opts.cmake", "text": "set(X OFF)\n"}
    r = environments.recipe(s)
    assert r["build_files"] == [["opts.cmake", "set(X OFF)\n"]] and str(state) not in json.dumps(r)
    assert environments.recipe_hash(s) != environments.recipe_hash(spec(install_env=s.install_env,
                                                                        build_files=(("opts.cmake", "set(X ON)\n"),)))
    assert "build_files" not in environments.recipe(spec())
    with pytest.raises(ValueError, match="'../x' is not a plain file name"):
        spec(build_files=(("../x", ""),))


def test_a_second_builder_waits_for_the_first_and_builds_nothing(monkeypatch):
    started, release = threading.Event(), threading.Event()
    builds, logs = [], []

    def slow_build(spec, target, log):
        builds.append(spec.name)
        started.set()
        release.wait(10)
        built(spec)
        return target / "bin" / "python"

    monkeypatch.setattr(environments, "_build", slow_build)
    first = threading.Thread(target=environments.create, args=(spec(),), kwargs={"log": logs.append})
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=environments.create, args=(spec(),), kwargs={"log": logs.append})
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second builder must wait for the first"
    release.set()
    first.join(10)
    second.join(10)
    assert builds == ["demo"]
    assert any("being built by another process" in line for line in logs)
    assert any("is ready at" in line for line in logs)


def test_a_download_that_fails_is_tried_again_and_a_recipe_error_is_not(tmp_path):
    """pip failing on a truncated download (its hash check) is transient; any other failure is final."""
    from llmadapt.launch.environments import checked_run

    count = tmp_path / "count"
    script = (f'n=$(cat {count} 2>/dev/null || echo 0); echo $((n+1)) > {count}; '
              'if [ "$n" -lt 1 ]; then echo "ERROR: THESE PACKAGES DO NOT MATCH THE HASHES"; exit 1; fi')
    seen = []
    checked_run(["sh", "-c", script], "pip install", stream=seen.append, retries=2)
    assert count.read_text().strip() == "2" and any("trying again" in line for line in seen)

    count.unlink()
    with pytest.raises(LlmadaptError, match="ResolutionImpossible"):
        checked_run(["sh", "-c", f"echo x >> {count}; echo 'ERROR: ResolutionImpossible'; exit 1"], "pip install",
               retries=2)
    assert count.read_text().count("x") == 1


def test_a_failed_build_step_is_one_line_with_pips_last_error_and_exit_code_3():
    """A step that fails (here a real subprocess printing as pip does) ends with EnvironmentNotReadyError: the
    table's exit code 3 (environment), one line naming the step and pip's last error, not its whole output."""
    import sys

    from llmadapt.errors import ExitCode, exit_code_of

    script = "print('Collecting x'); print('ERROR: No matching distribution found for x==9'); print(''); exit(1)"
    with pytest.raises(EnvironmentNotReadyError) as caught:
        environments._run_checked([sys.executable, "-c", script], "installing x", None, None)
    assert str(caught.value) == "installing x failed (exit 1): ERROR: No matching distribution found for x==9"
    assert exit_code_of(caught.value) == ExitCode.ENVIRONMENT == 3


def test_an_environment_of_the_same_recipe_under_another_name_is_the_same_build(monkeypatch, state):
    """The core's tools environment and an adapter's of the same requirements (the reference's `torch`): whichever
    is built serves both, nothing is installed twice; each keeps its own name and override variable."""
    monkeypatch.setattr(environments, "checked_run", lambda *a, **k: pytest.fail("nothing should be installed"))
    monkeypatch.delenv("LLMADAPT_PYTHON_TOOLS", raising=False)
    tools, adapter = spec(name="tools"), spec(name="adapter")
    target = built(adapter)
    assert environments.env_dir(tools) == target and environments.status(tools) == "ready"
    assert environments.python_for(tools) == target / "bin" / "python"
    assert environments.create(tools, log=lambda line: None) == target / "bin" / "python"
    assert environments.older_builds(tools) == [] and environments.prune(tools) == []
    assert target.is_dir()
    # Another recipe, or a build not finished (no marker yet), is not the same build.
    assert environments.status(spec(name="tools", requirements=("torch==2.12.0",))) == "missing"
    (target / environments.MARKER).unlink()
    assert environments.status(tools) == "missing" and environments.env_dir(tools).name.startswith("tools-")
    built(adapter)
    monkeypatch.setenv("LLMADAPT_PYTHON_TOOLS", "/opt/tools/bin/python")  # each name keeps its own override
    assert str(environments.python_for(tools)) == "/opt/tools/bin/python"
    assert environments.python_for(adapter) == target / "bin" / "python"


def test_the_core_builds_checkpoints_in_its_tools_environment(monkeypatch):
    """An adapter whose environment cannot write the canonical checkpoint gets it from the core's tools environment,
    which no adapter's name stands for."""
    from llmadapt.adapter.declaration import TOOLS_ENVIRONMENT
    from llmadapt.launch import prepare
    from llmadapt.spec import Workload

    asked = []

    def python_for(spec):
        asked.append(spec.name)
        raise EnvironmentNotReadyError(f"environment {spec.name!r} has not been built")

    monkeypatch.setattr(prepare, "python_for", python_for)
    w = Workload.from_dict({"kind": "train", "name": "t", "model": {"preset": "tiny-llama"}})
    with pytest.raises(EnvironmentNotReadyError, match="'tools'"):
        prepare.ensure_checkpoint(w, spec(name="colossalai", builds_checkpoint=False))
    assert asked == ["tools"] and TOOLS_ENVIRONMENT.name == "tools"
    assert "torch" not in {s.name for s in environments.TOOL_ENVIRONMENTS}


def test_a_built_environment_keeps_the_bytecode_it_compiles_whatever_the_callers_setting(monkeypatch):
    """Installed without bytecode, the reference adapter's real environment compiles what its processes import and
    keeps it, under PYTHONDONTWRITEBYTECODE=1 and -B too: else every worker would compile torch from source."""
    from llmadapt.reference.plugin import ENVIRONMENT

    if REAL_STATE:
        monkeypatch.setenv("LLMADAPT_HOME", REAL_STATE)
    else:
        monkeypatch.delenv("LLMADAPT_HOME")
    try:
        python = environments.python_for(ENVIRONMENT)
    except EnvironmentNotReadyError as exc:
        pytest.skip(str(exc))
    done = subprocess.run([str(python), "-B", "-c", "import sys; print(sys.dont_write_bytecode)"], text=True,
                          capture_output=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.skipif(Path(sys.prefix).resolve() != (Path(__file__).resolve().parents[1] / ".venv").resolve(),
                    reason="runs in the Makefile's development venv (.venv beside tests/) only")
def test_the_development_venv_keeps_the_bytecode_it_compiles():
    """`make setup` installs without byte-compiling and keeps what the venv's processes compile (the tests' own
    interpreter: pytest workers and the commands they start import torch and transformers)."""
    done = subprocess.run([sys.executable, "-B", "-c", "import sys; print(sys.dont_write_bytecode)"], text=True,
                          capture_output=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
