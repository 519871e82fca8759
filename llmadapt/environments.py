"""Isolated Python environments, one per adapter recipe, built as virtualenvs in the state folder.

State folder: ``$LLMADAPT_HOME``, else ``$XDG_CACHE_HOME/llmadapt``, else ``~/.cache/llmadapt``.
``LLMADAPT_PYTHON_<NAME>`` (name upper-cased, non-alphanumerics as ``_``) points an
environment at an interpreter you manage yourself (conda, a container, a cluster module).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .errors import EnvironmentNotReadyError, LlmadaptError
from .interfaces import EnvironmentSpec

MARKER = "llmadapt-env.json"


def state_dir() -> Path:
    if os.environ.get("LLMADAPT_HOME"):
        return Path(os.environ["LLMADAPT_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmadapt"


def env_dir(spec: EnvironmentSpec) -> Path:
    return state_dir() / "envs" / spec.name


def override_var(spec: EnvironmentSpec) -> str:
    return "LLMADAPT_PYTHON_" + re.sub(r"[^A-Za-z0-9]", "_", spec.name).upper()


def core_source() -> Path | None:
    """The source checkout llmadapt runs from, if any (then environments install it editable)."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "llmadapt"' in pyproject.read_text():
        return root
    return None


def recipe(spec: EnvironmentSpec) -> dict:
    from . import __version__

    core = core_source()
    out = {
        "requirements": list(spec.requirements),
        "local_packages": [str(core)] if core else [],
        "core": f"llmadapt=={__version__}" if core is None else "editable",
        "plugin_packages": list(spec.local_packages),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    # Optional parts join the recipe only when used, so existing environments keep their hash.
    if spec.install_env:
        out["install_env"] = [list(kv) for kv in spec.install_env]
    if spec.no_deps_requirements:
        out["no_deps_requirements"] = list(spec.no_deps_requirements)
    if spec.remove_after_install:
        out["remove_after_install"] = list(spec.remove_after_install)
    return out


def recipe_hash(spec: EnvironmentSpec) -> str:
    return hashlib.sha256(json.dumps(recipe(spec), sort_keys=True).encode()).hexdigest()[:16]


def status(spec: EnvironmentSpec) -> str:
    """'override' (an interpreter named by environment variable), 'ready', 'stale' (recipe changed) or 'missing'."""
    if os.environ.get(override_var(spec)):
        return "override"
    marker = env_dir(spec) / MARKER
    if not marker.is_file():
        return "missing"
    try:
        built = json.loads(marker.read_text()).get("recipe_hash")
    except (OSError, json.JSONDecodeError):
        return "missing"
    return "ready" if built == recipe_hash(spec) else "stale"


def python_for(spec: EnvironmentSpec) -> Path:
    """The interpreter that runs this environment's workers, or a clear error saying how to build it."""
    override = os.environ.get(override_var(spec))
    if override:
        return Path(override)
    state = status(spec)
    if state != "ready":
        why = "has not been built" if state == "missing" else "was built from an older recipe"
        msg = f"environment {spec.name!r} {why}: run `llmadapt env create {spec.name}` (or set {override_var(spec)})"
        raise EnvironmentNotReadyError(msg)
    return env_dir(spec) / "bin" / "python"


def create(spec: EnvironmentSpec, *, log: Callable[[str], None] = print, force: bool = False) -> Path:
    """Build (or rebuild) the virtualenv with pip and return its interpreter.

    pip, not uv: pip finds the locally provided torch wheels that the pins name.
    """
    target = env_dir(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per environment (two `make` jobs, or two users of one state folder):
    # the second waits, then finds the environment ready.
    with open(target.parent / f".{spec.name}.lock", "w") as lock:
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
    _check([sys.executable, "-m", "venv", "--clear", str(target)], "venv creation")
    python = target / "bin" / "python"
    r = recipe(spec)
    args = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *r["requirements"]]
    args += [arg for path in r["local_packages"] + r["plugin_packages"] for arg in ("-e", path)]
    if r["core"] != "editable":
        args.append(r["core"])
    env = {**os.environ, **dict(spec.install_env)}
    log(f"installing {len(r['requirements'])} pinned requirements + llmadapt (this takes a few minutes)")
    _check(args, "pip install", stream=log, env=env, retries=2)
    if spec.no_deps_requirements:
        log(f"installing without dependencies: {' '.join(spec.no_deps_requirements)}")
        _check([*args[:5], "--no-deps", *spec.no_deps_requirements], "pip install --no-deps", stream=log, env=env)
    if spec.remove_after_install:
        log(f"removing {' '.join(spec.remove_after_install)}")
        _check([str(python), "-m", "pip", "uninstall", "--disable-pip-version-check", "-y",
                *spec.remove_after_install], "pip uninstall", stream=log, env=env)
    (target / MARKER).write_text(
        json.dumps({"recipe_hash": recipe_hash(spec), "recipe": r, "created": time.time()}, indent=2)
    )
    log(f"environment {spec.name!r} ready in {time.monotonic() - started:.0f} s")
    return python


# What pip prints when a download, not the recipe, failed: a truncated wheel fails its pinned hash, a
# connection drops. Seen in CI: a 286 MB triton wheel cut at 173 MB. Worth another try; nothing else is.
_TRANSIENT = ("DO NOT MATCH THE HASHES", "IncompleteRead", "ReadTimeoutError", "ConnectionError",
              "Connection reset", "ProtocolError", "Temporary failure in name resolution")


def _check(args: list[str], what: str, stream: Callable[[str], None] | None = None,
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
    if proc.wait() != 0:
        joined = "\n".join(tail)
        raise LlmadaptError(f"{what} failed (exit {proc.returncode}):\n{joined}")
