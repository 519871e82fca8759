"""The core's size discipline, kept by the code itself (docs/architecture.md).

- No function in llmadapt/ over MAX_FUNCTION_LINES lines, but those in ALLOWANCES, each held at its size today: a
  ratchet. A function above its allowance fails; so does an allowance above its function's size (lower it: the
  number may only go down) or one whose function is gone or back under the limit (remove it).
- A module over MAX_MODULE_LINES lines says why in one docstring line that starts the reason with the marker
  ``Size: over 400 lines because`` (or ``It is over 400 lines because``); else it is split.

Sizes are lines from a function's ``def`` to its last line (nested functions count in their outer one and on their
own), and a module's lines. Every failure lists the largest offenders with their sizes (``pytest -rA`` shows them
on success too).
"""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llmadapt"
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 400
MARKER = re.compile(rf"^(Size: |It is )over {MAX_MODULE_LINES} lines because \S", re.MULTILINE)

ALLOWANCES: dict[str, int] = {}
"""Functions over the limit today, 'path:qualified name' -> lines. Numbers may only go down."""


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def function_sizes() -> dict[str, int]:
    """'path:Class.function' -> lines, for every function and method in llmadapt/ (nested ones too)."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    sizes[f"{where}:{name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.", where)
            else:
                visit(child, prefix, where)

    for path in modules():
        visit(ast.parse(path.read_text()), "", str(path.relative_to(ROOT)))
    return sizes


def module_sizes() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules()}


def top(sizes: dict[str, int], count: int = 10) -> str:
    return "\n".join(f"  {n:>5}  {name}" for name, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:count])


def test_no_function_grows_past_the_limit_or_its_allowance():
    sizes = function_sizes()
    print(f"largest functions (limit {MAX_FUNCTION_LINES}):\n{top(sizes)}")
    over = [f"{name}: {n} lines (allowed {ALLOWANCES.get(name, MAX_FUNCTION_LINES)})" for name, n in sizes.items()
            if n > ALLOWANCES.get(name, MAX_FUNCTION_LINES)]
    assert over == [], ("split these:\n  " + "\n  ".join(over) + f"\nlargest functions:\n{top(sizes)}")


def test_the_allowances_only_go_down():
    sizes = function_sizes()
    stale = []
    for name, allowed in ALLOWANCES.items():
        n = sizes.get(name)
        if n is None or n <= MAX_FUNCTION_LINES:
            stale.append(f"{name}: {'gone' if n is None else f'{n} lines'}, within the limit: remove its allowance")
        elif n < allowed:
            stale.append(f"{name}: {n} lines: lower its allowance from {allowed} to {n}")
    assert stale == [], "\n".join(stale)


def test_a_long_module_says_why_in_one_line():
    sizes = module_sizes()
    print(f"largest modules (limit {MAX_MODULE_LINES}):\n{top(sizes)}")
    unexplained = []
    for name, n in sizes.items():
        doc = ast.get_docstring(ast.parse((ROOT / name).read_text())) or ""
        if n > MAX_MODULE_LINES and not MARKER.search(doc):
            unexplained.append(f"{name} ({n} lines)")
    assert unexplained == [], ("say why in the docstring ('Size: over 400 lines because ...') or split: "
                               + ", ".join(unexplained) + f"\nlargest modules:\n{top(sizes)}")


def test_the_checks_catch_a_long_function_and_an_unexplained_module(tmp_path, monkeypatch):
    """Planted in a copy of the package: a function of 101 lines and a module of 401 lines without its reason."""
    package = tmp_path / "llmadapt"
    package.mkdir()
    (package / "long.py").write_text("def planted():\n" + "    x = 1\n" * 100)
    (package / "big.py").write_text('"""A module."""\n' + "x = 1\n" * 400)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert function_sizes() == {"llmadapt/long.py:planted": 101}
    for test in (test_no_function_grows_past_the_limit_or_its_allowance, test_a_long_module_says_why_in_one_line):
        try:
            test()
        except AssertionError as exc:
            assert "planted: 101 lines" in str(exc) or "big.py (401 lines)" in str(exc)
        else:
            raise AssertionError(f"{test.__name__} missed what was planted")
