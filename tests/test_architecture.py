"""The architecture's rules (docs/architecture.md), checked on the code itself.

- Layers: a module imports only from its own package or the layers below (import-linter's contracts in
  pyproject.toml), the core imports neither the reference adapter nor the old paths kept for adapters, and
  nothing inside llmadapt imports the package root.
- Names starting with an underscore do not cross modules.
- A module over 400 lines says why in its docstring.
"""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llmadapt"
LINT = Path(sys.executable).parent / "lint-imports"
MAX_LINES = 400

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(root), "PATH": ""})


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_layers_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("planted, broken", [
    ("from llmadapt.launch.run import run", "layers"),  # the contract importing the orchestrator
    ("import llmadapt.reference.plugin", "reference adapter"),
    ("from llmadapt import Workload", "package root"),
])
def test_a_planted_import_breaks_a_contract(tmp_path, planted, broken):
    shutil.copytree(PACKAGE, tmp_path / "llmadapt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "llmadapt" / "contract" / "stats.py"
    target.write_text(target.read_text() + f"\n{planted}  # planted by the test\n")
    result = lint(tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "0 broken" not in result.stdout and broken in result.stdout.split("Broken contracts")[1]


def test_private_names_stay_in_their_module():
    crossing = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmadapt"):
                crossing += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                             for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossing == []


def test_a_long_module_says_why():
    unexplained = []
    for path in modules():
        lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and f"over {MAX_LINES} lines" not in doc:
            unexplained.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert unexplained == []


def test_the_old_module_paths_still_give_the_same_objects():
    """Adapters written against 0.1 keep importing from the flat paths for one release."""
    import importlib

    import llmadapt.adapter as adapter

    old = {"llmadapt.interfaces": ["Trainer", "FineTuner", "Server", "StepResult", "AdapterInfo", "Supports"],
           "llmadapt.serving": ["ServeContext", "PlannedRequest", "Chunk", "RequestFailed", "engine_popen_options"],
           "llmadapt.data": ["StepBatch", "MicroBatch"], "llmadapt.runtime": ["WorkerContext"],
           "llmadapt.hookspecs": ["hookimpl"]}
    for module, names in old.items():
        for name in names:
            assert getattr(importlib.import_module(module), name) is getattr(adapter, name), f"{module}.{name}"
    from llmadapt.adapter.sse import OpenAICompatibleServer
    from llmadapt.sse import OpenAICompatibleServer as old_server

    assert old_server is OpenAICompatibleServer


def test_no_import_cycles():
    """Counting every import, function-level and TYPE_CHECKING ones too; `from package import name` counts as
    importing the package's __init__ (which may still be half-run). The layers contract alone does not see
    cycles inside a package."""
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in modules()}
    edges: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmadapt"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("llmadapt")]
            edges[name] |= {t for t in targets if t in names and t != name}

    cycles, stack, state = [], [], {}

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert cycles == []
