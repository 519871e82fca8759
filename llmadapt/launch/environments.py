"""Isolated Python environments, one per adapter recipe, built as virtualenvs in the state folder.

An environment holds third-party packages only, and its folder is named by what is in them (the
recipe's hash: pins, install steps, Python version and the declared dependencies of the local
packages). llmadapt's own code and the adapter packages are not installed into it: every process
started in it gets them on ``PYTHONPATH`` from the source this orchestrator runs (`process_env`).
So clones of the repository share environments, a worker always runs the orchestrator's code
(never a copy left by another checkout), and deleting a clone breaks nothing.

State folder: ``$LLMADAPT_HOME``, else ``$XDG_CACHE_HOME/llmadapt``, else ``~/.cache/llmadapt``.
``LLMADAPT_PYTHON_<NAME>`` (name upper-cased, non-alphanumerics as ``_``) points an
environment at an interpreter you manage yourself (conda, a container, a cluster module).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from glob import escape as glob_escape
from pathlib import Path
from typing import Callable

from llmadapt.adapter.declaration import TOOLS_ENVIRONMENT, EnvironmentSpec
from llmadapt.errors import EnvironmentNotReadyError, LlmadaptError
from llmadapt.host import VERSION, state_dir

MARKER = "llmadapt-env.json"
BUILD_FILES = "build-files"
"""The folder of an environment holding its spec's ``build_files`` (kept: what its build read)."""

BYTECODE = "on first import"

HTA_ENVIRONMENT = EnvironmentSpec(
    name="hta",
    requirements=("pandas==3.1.1", "numpy==2.4.6", "plotly==7.1.0", "networkx==3.6.1", "pydot==4.0.1",
                  "psutil==7.2.2", "pyyaml==6.0.4"),
    # HTA 0.5.0 declares jupyterlab and pytest, which its analyses never import: its own dependencies above
    no_deps_requirements=("holistictraceanalysis==0.5.0",),
)
"""Holistic Trace Analysis, run on a profiled run's Kineto traces (llmadapt.experiments.hta); no adapter's."""

MLFLOW_ENVIRONMENT = EnvironmentSpec(name="mlflow", requirements=("mlflow==3.17.2",))
"""A full MLflow (tracking server and UI) for tests/test_mlflow.py and for trying the MLflow sink
(plugins/mlflow) on this machine: ``mlflow server`` from this environment's interpreter. The sink itself needs only
the light client, mlflow-skinny, where llmadapt runs."""

TOOL_ENVIRONMENTS = (TOOLS_ENVIRONMENT, HTA_ENVIRONMENT, MLFLOW_ENVIRONMENT)
"""Environments of tools the core runs, not of adapters: built, listed and pruned like theirs."""


def env_dir(spec: EnvironmentSpec, digest: str | None = None) -> Path:
    """The environment's folder, envs/NAME-HASH; or, while that holds no build, a finished build of the same recipe
    under another name. The packages are the same, so they are installed once: the core's ``tools`` environment and
    an adapter's that declares its requirements under a name of its own are one build, whichever name built it."""
    digest = digest or recipe_hash(spec)  # given by a caller that has it: a recipe reads every source's pyproject
    own = state_dir() / "envs" / f"{spec.name}-{digest[:12]}"
    if not (own / MARKER).is_file():
        for other in sorted(own.parent.glob(f"*-{digest[:12]}")):
            if _built_recipe(other) == digest:
                return other
    return own


def _built_recipe(folder: Path) -> str | None:
    """The recipe hash of the finished build in ``folder`` (its marker, written last), or None."""
    try:
        return json.loads((folder / MARKER).read_text()).get("recipe_hash")
    except (OSError, ValueError, AttributeError):
        return None


def override_var(spec: EnvironmentSpec) -> str:
    return "LLMADAPT_PYTHON_" + re.sub(r"[^A-Za-z0-9]", "_", spec.name).upper()


def core_source() -> Path | None:
    """The source checkout llmadapt runs from, if any (then workers import llmadapt from it)."""
    root = Path(__file__).resolve().parents[2]  # llmadapt/launch/environments.py -> the checkout
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "llmadapt"' in pyproject.read_text():
        return root
    return None


def local_sources(spec: EnvironmentSpec) -> list[Path]:
    """The source folders a process in this environment imports our code from: core, then the adapter's."""
    core = core_source()
    sources = [core] if core else []
    for path in spec.local_packages:
        source = Path(path)
        if not (source / "pyproject.toml").is_file():
            raise LlmadaptError(f"environment {spec.name!r}: local package {path!r} is not a source folder "
                                "(no pyproject.toml); name an installed package in requirements instead")
        sources.append(source)
    return sources


def _declared_dependencies(source: Path) -> list[str]:
    """[project].dependencies of a local package, without the local packages themselves (they come by path)."""
    return list(_dependencies_in((source / "pyproject.toml").read_text()))


@functools.lru_cache(maxsize=None)
def _dependencies_in(pyproject: str) -> tuple[str, ...]:
    # Parsed once per text: a recipe reads the same pyproject files for every environment (`llmadapt adapters`
    # would parse the core's 50 times).
    project = tomllib.loads(pyproject).get("project", {})
    return tuple(d for d in project.get("dependencies", [])
                 if re.split(r"[\s<>=!~\[;]", d, maxsplit=1)[0].lower() != "llmadapt"
                 and not d.lower().startswith("llmadapt-"))


def recipe(spec: EnvironmentSpec) -> dict:
    """What goes into the environment; no paths, so any clone of the same code computes the same recipe."""
    sources = local_sources(spec)
    dependencies = sorted({d for source in sources for d in _declared_dependencies(source)})
    if core_source() is None:
        dependencies.append(f"llmadapt=={VERSION}")  # an installed core: the same release in the environment
    out = {
        "requirements": list(spec.requirements),
        "dependencies": dependencies,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "bytecode": BYTECODE,  # see keep_bytecode
    }
    # Optional parts join the recipe only when used.
    if spec.install_env:
        out["install_env"] = [list(kv) for kv in spec.install_env]
    if spec.no_deps_requirements:
        out["no_deps_requirements"] = list(spec.no_deps_requirements)
    if spec.remove_after_install:
        out["remove_after_install"] = list(spec.remove_after_install)
    if spec.build_files:
        out["build_files"] = [list(kv) for kv in spec.build_files]
    return out


def recipe_hash(spec: EnvironmentSpec) -> str:
    return hashlib.sha256(json.dumps(recipe(spec), sort_keys=True).encode()).hexdigest()[:16]


def process_env(spec: EnvironmentSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with PYTHONPATH naming our sources first.

    Every process llmadapt starts with this environment's interpreter gets it: that is how a
    worker imports llmadapt and its adapter without either being installed there.
    """
    env = dict(os.environ if base is None else base)
    paths = [str(p) for p in local_sources(spec)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _site_packages(target: Path) -> Path:
    return target / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _distributions(target: Path) -> list[str]:
    try:
        return sorted(name for name in os.listdir(_site_packages(target)) if name.endswith(".dist-info"))
    except OSError:  # no site-packages (yet, or any more)
        return []


def older_builds(spec: EnvironmentSpec) -> list[Path]:
    """Folders of this environment built from another recipe (other pins, or before environments had hashes)."""
    envs = state_dir() / "envs"
    pattern = re.compile(re.escape(spec.name) + r"(-[0-9a-f]{12})?")
    current = env_dir(spec)
    return sorted(p for p in envs.glob(f"{glob_escape(spec.name)}*")
                  if p != current and pattern.fullmatch(p.name) and (p / MARKER).is_file())


def missing_distributions(spec: EnvironmentSpec, target: Path | None = None) -> list[str]:
    """Packages the build installed that are gone now (a pruned or half-deleted site-packages)."""
    target = target or env_dir(spec)
    try:
        built = json.loads((target / MARKER).read_text()).get("distributions", [])
    except (OSError, json.JSONDecodeError):
        return []
    present = set(_distributions(target))
    gone = [d for d in built if d not in present]
    if not (target / "bin" / "python").exists():
        gone.insert(0, "bin/python")
    return gone


def status(spec: EnvironmentSpec) -> str:
    """'override' (an interpreter named by environment variable), 'ready', 'broken' (packages the build
    installed are gone), 'building' (another process builds it now), 'stale' (built only from an older recipe)
    or 'missing'."""
    if os.environ.get(override_var(spec)):
        return "override"
    digest = recipe_hash(spec)
    target = env_dir(spec, digest)
    try:
        built = json.loads((target / MARKER).read_text()).get("recipe_hash") if (target / MARKER).is_file() else None
    except (OSError, json.JSONDecodeError):
        built = None
    if built == digest:
        return "broken" if missing_distributions(spec, target) else "ready"
    if building(spec):
        return "building"
    return "stale" if older_builds(spec) else "missing"


def building(spec: EnvironmentSpec) -> bool:
    """Whether a process holds the build lock (``create`` builds under it) of this environment now."""
    target = env_dir(spec)
    try:
        fd = os.open(target.parent / f".{target.name}.lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def python_for(spec: EnvironmentSpec) -> Path:
    """The interpreter that runs this environment's workers, or a clear error saying how to build it."""
    override = os.environ.get(override_var(spec))
    if override:
        return Path(override)
    state = status(spec)
    if state == "broken":
        gone = missing_distributions(spec)
        shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        raise EnvironmentNotReadyError(
            f"environment {spec.name!r} at {env_dir(spec)} is damaged ({shown} gone since it was built): "
            f"run `llmadapt env create {spec.name} --force`")
    if state != "ready":
        why = {"missing": "has not been built", "building": "is being built by another process"}.get(
            state, "was built from an older recipe")
        msg = f"environment {spec.name!r} {why}: run `llmadapt env create {spec.name}` (or set {override_var(spec)})"
        raise EnvironmentNotReadyError(msg)
    return env_dir(spec) / "bin" / "python"


def prune(spec: EnvironmentSpec) -> list[Path]:
    """Remove this environment's builds from other recipes (another clone at other pins builds its own again)."""
    import shutil

    removed = []
    for folder in older_builds(spec):
        with open(folder.parent / f".{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # never under a build in progress
            shutil.rmtree(folder)
        (folder.parent / f".{folder.name}.lock").unlink(missing_ok=True)
        removed.append(folder)
    return removed


def create(spec: EnvironmentSpec, *, log: Callable[[str], None] = print, force: bool = False) -> Path:
    """Build (or rebuild) the virtualenv with pip and return its interpreter.

    pip, not uv: pip finds the locally provided torch wheels that the pins name.
    """
    target = env_dir(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per environment (two `make` jobs, or two users of one state folder):
    # the second waits, then finds the environment ready.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"environment {spec.name!r} is being built by another process; waiting")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if status(spec) == "ready" and not force:
            log(f"environment {spec.name!r} is ready at {target}")
            return target / "bin" / "python"
        return _build(spec, target, log)


def _build(spec: EnvironmentSpec, target: Path, log: Callable[[str], None]) -> Path:
    started = time.monotonic()
    (target / MARKER).unlink(missing_ok=True)
    log(f"creating virtualenv {target}")
    checked_run([sys.executable, "-m", "venv", "--clear", str(target)], "venv creation")
    python = target / "bin" / "python"
    r = recipe(spec)
    # pip keys the wheels it builds from source by the source alone, not by install_env: a wheel built with other
    # flags (another environment's, an older recipe's) would be taken from its cache. Such builds skip the cache.
    no_cache = ["--no-cache-dir"] if spec.install_env else []
    args = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-compile", *no_cache,
            *r["requirements"], *r["dependencies"]]
    build_files = target / BUILD_FILES
    for name, text in spec.build_files:
        build_files.mkdir(exist_ok=True)
        (build_files / name).write_text(text)
    env = {**os.environ, **{k: v.replace("{build_files}", str(build_files)) for k, v in spec.install_env}}
    log(f"installing {len(r['requirements'])} pinned requirements and llmadapt's dependencies "
        "(this takes a few minutes)")
    checked_run(args, "pip install", stream=log, env=env, retries=2)
    if spec.no_deps_requirements:
        log(f"installing without dependencies: {' '.join(spec.no_deps_requirements)}")
        checked_run([*args[:6], *no_cache, "--no-deps", *spec.no_deps_requirements], "pip install --no-deps",
                    stream=log, env=env)
    if spec.remove_after_install:
        log(f"removing {' '.join(spec.remove_after_install)}")
        checked_run([str(python), "-m", "pip", "uninstall", "--disable-pip-version-check", "-y",
                *spec.remove_after_install], "pip uninstall", stream=log, env=env)
    keep_bytecode(target)
    (target / MARKER).write_text(
        json.dumps({"recipe_hash": recipe_hash(spec), "recipe": r, "created": time.time(),
                    "distributions": _distributions(target)}, indent=2)
    )
    log(f"environment {spec.name!r} ready in {time.monotonic() - started:.0f} s")
    return python


KEEP_BYTECODE = "llmadapt-keep-bytecode.pth"


def keep_bytecode(target: Path | str) -> None:
    """Installed with --no-compile, an environment's processes compile what they import and keep it (__pycache__).
    The Makefile does the same for the development venv.

    pip byte-compiles every module it installs: torch alone is 12,000, and three environments built side by side on
    2 cores spent most of their time there (a torch environment 180 s against 76 s without). A worker imports a
    fraction of them. But where PYTHONDONTWRITEBYTECODE (or -B) is set, as on some CI machines, nothing compiled at
    import is kept, and every process would compile torch from source again: this .pth line, run at each start of
    the environment's interpreter, keeps the bytecode of its own imports whatever the caller's setting. The first run
    in a new environment compiles what it imports (a few seconds, once).
    """
    (_site_packages(Path(target)) / KEEP_BYTECODE).write_text("import sys; sys.dont_write_bytecode = False\n")


# What pip prints when a download, not the recipe, failed: a truncated wheel fails its pinned hash, a
# connection drops. Seen in CI: a 286 MB triton wheel cut at 173 MB. Worth another try; nothing else is.
_TRANSIENT = ("DO NOT MATCH THE HASHES", "IncompleteRead", "ReadTimeoutError", "ConnectionError",
              "Connection reset", "ProtocolError", "Temporary failure in name resolution")


def checked_run(args: list[str], what: str, stream: Callable[[str], None] | None = None,
           env: dict[str, str] | None = None, retries: int = 0) -> None:
    for attempt in range(retries + 1):
        try:
            return _run_checked(args, what, stream, env)
        except LlmadaptError as exc:
            if attempt == retries or not any(marker in str(exc) for marker in _TRANSIENT):
                raise
            if stream:
                stream(f"  {what} failed on a download (attempt {attempt + 1} of {retries + 1}): trying again")


def _run_checked(args: list[str], what: str, stream: Callable[[str], None] | None,
                 env: dict[str, str] | None) -> None:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-30:]
        if stream and (line.startswith(("Successfully", "Collecting", "ERROR"))):
            stream("  " + line[:160])
    if proc.wait() != 0:  # one line (the last error pip printed), exit code 3: the environment is not built
        errors = [line for line in tail if line.startswith("ERROR")] or [line for line in tail if line.strip()]
        raise EnvironmentNotReadyError(f"{what} failed (exit {proc.returncode}): "
                                       f"{errors[-1].strip() if errors else 'no output'}")
