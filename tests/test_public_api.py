"""The stable Python API (CHANGELOG.md's version policy): every name that docs/public-api.txt records is still
there with a compatible signature, or was deprecated first; a new public name is recorded before it ships."""

from __future__ import annotations

import importlib
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

API = runpy.run_path(str(Path(__file__).resolve().parents[1] / "docs" / "public_api.py"))


def test_no_recorded_name_disappears_or_breaks_its_signature():
    recorded = API["read"]()
    broken = API["breaks"](recorded, API["surface"]())
    assert not broken, ("the stable API changed (CHANGELOG.md: deprecate first, or record a compatible change "
                        "with `make api`):\n" + "\n".join(broken))
    for name, rest in recorded.items():  # a deprecated name still works, and says so
        if rest.endswith("# deprecated"):
            module, _, attr = name.rpartition(".")
            with pytest.warns(DeprecationWarning):
                getattr(importlib.import_module(module), attr)


def test_every_public_name_is_recorded():
    recorded = API["read"]()
    new = [line for line in API["surface"]() if line.partition(" ")[0] not in recorded]
    assert not new, "public names not in docs/public-api.txt (run `make api`, say so in CHANGELOG.md):\n" + \
        "\n".join(new)


@pytest.mark.parametrize(("old", "new", "ok"), [
    ("(a, b=1) -> 'str'", "(a, b=1, c=2) -> 'str'", True),  # a new parameter with a default, at the end
    ("(a, *, k=1)", "(a, *, j=2, k=1)", True),  # a new keyword-only parameter with a default
    ("class(x: 'int') -> None", "class(x: 'int', y: 'int' = 0) -> None", True),  # an attrs field added
    ("(a, b=1)", "(a, c=0, b=1)", False),  # inserted before b: f(1, 2) now sets c
    ("(a, b=1)", "(a, b=1, c)", False),  # a new required parameter
    ("(a, b=1)", "(a, b=2)", False),  # a default changed
    ("(a, b=1)", "(a)", False),  # a parameter removed
    ("(a, *, k=1)", "(a)", False),  # a keyword-only parameter removed
    ("(a) -> 'int'", "(a) -> 'str'", False),  # the return changed
    ("class(a) -> None", "(a)", False),  # a class became a function
])
def test_compatible_tells_a_compatible_change_from_a_break(old, new, ok):
    assert API["compatible"](old, new) is ok


def test_breaks_finds_a_removed_name_and_a_changed_signature_and_lets_a_deprecated_one_go():
    recorded = {"m.f": "(a, b=1)", "m.g": "(a)", "m.old": "(a)  # deprecated", "m.C": "class(x) -> None"}
    current = ["m.f (a)", "m.C class(x, y=0) -> None"]  # f lost b, g is gone, old's deprecation is over
    assert API["breaks"](recorded, current) == ["m.f changed: (a, b=1) -> (a)",
                                                 "m.g disappeared without a deprecation"]


def test_launch_run_stays_the_function_whatever_was_imported_before():
    # Importing a submodule binds it on its package: a module named launch/run.py would replace the function
    # llmadapt.launch.run once imported. Every submodule of launch is imported first, then the name is read.
    code = ("import importlib, pkgutil, llmadapt.launch as l\n"
            "for m in pkgutil.iter_modules(l.__path__): importlib.import_module(f'llmadapt.launch.{m.name}')\n"
            "from llmadapt.launch import run\n"
            "print(type(run).__name__, type(l.run).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["function", "function"]
