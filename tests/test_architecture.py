"""The architecture's rules (docs/architecture.md), checked on the code itself.

- Layers: every module of llmadapt is in a layer, and imports only from its own package or the layers below
  (import-linter's contracts in pyproject.toml; launch and analysis independent of each other), the core imports neither the reference adapter nor the old paths kept for adapters, and
  nothing inside llmadapt imports the package root.
- Names starting with an underscore do not cross modules.
- Sizes (a long function, a long module without its reason): tests/test_sizes.py.
- Adapters (plugins/, examples/' packages, llmadapt/reference) import llmadapt.adapter and nothing else of llmadapt.
- analysis only reads: no module of it imports the launcher's entry points or subprocess (llmadapt.experiments
  launches).
- A run folder's file names are written in contract/rundir.py (RunDir) only: a literal name joined onto a run folder
  elsewhere (the core or an adapter) fails; an adapter's own files are declared (AdapterInfo.run_files) and joined
  with RunDir.adapter_file.
"""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llmadapt"
LINT = Path(sys.executable).parent / "lint-imports"

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


def layered(config: str) -> set[str]:
    """The modules the layers contract of CONFIG (pyproject.toml's text) names."""
    import tomllib

    (contract,) = [c for c in tomllib.loads(config)["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


def top_level(package: Path) -> set[str]:
    """llmadapt's modules and packages, one level down."""
    return {f"llmadapt.{p.stem}" for p in package.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}


def test_every_module_has_a_layer():
    """A module outside the layers contract is outside every rule it states: each new one must be placed."""
    outside = top_level(PACKAGE) - layered((ROOT / "pyproject.toml").read_text())
    assert outside == set(), f"not in a layer of pyproject.toml's contract: {sorted(outside)}"


def test_a_module_left_out_of_the_layers_is_caught(tmp_path):
    config = (ROOT / "pyproject.toml").read_text().replace(' | llmadapt.streamfiles', '')
    assert "llmadapt.streamfiles" in top_level(PACKAGE) - layered(config)


@pytest.mark.parametrize("planted, broken", [
    ("from llmadapt.launch.runner import run", "layers"),  # the contract importing the orchestrator
    ("import llmadapt.reference.plugin", "reference adapter"),
    ("from llmadapt import Workload", "package root"),
    ("from llmadapt.analysis.report import show", "layers"),  # launch and analysis are independent
])
def test_a_planted_import_breaks_a_contract(tmp_path, planted, broken):
    shutil.copytree(PACKAGE, tmp_path / "llmadapt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    into = "launch/runner.py" if "analysis" in planted else "contract/stats.py"
    target = tmp_path / "llmadapt" / into
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


def test_the_old_module_paths_still_give_the_same_objects(monkeypatch):
    """Adapters written against 0.1 keep importing from the flat paths for one release, warned with the new path;
    the old modules live in llmadapt/compat/, not at the top level."""
    import importlib

    import llmadapt.adapter as adapter
    from llmadapt.compat import OLD_PATHS

    old = {"llmadapt.interfaces": ["Trainer", "FineTuner", "Server", "StepResult", "AdapterInfo", "Supports"],
           "llmadapt.serving": ["ServeContext", "PlannedRequest", "Chunk", "RequestFailed", "engine_popen_options"],
           "llmadapt.data": ["StepBatch", "MicroBatch"], "llmadapt.hookspecs": ["hookimpl"]}
    for module, names in old.items():
        monkeypatch.delitem(sys.modules, module, raising=False)  # imported afresh, so that it warns here
        with pytest.warns(DeprecationWarning, match=rf"{module} is deprecated.*: use llmadapt\.adapter"):
            loaded = importlib.import_module(module)
        for name in names:
            assert getattr(loaded, name) is getattr(adapter, name), f"{module}.{name}"
    assert importlib.import_module("llmadapt.runtime").WorkerContext is adapter.WorkerContext
    monkeypatch.delitem(sys.modules, "llmadapt.sse", raising=False)
    with pytest.warns(DeprecationWarning, match=r"llmadapt\.sse is deprecated.*: use llmadapt\.adapter\.sse$"):
        from llmadapt.sse import OpenAICompatibleServer as old_server
    from llmadapt.adapter.sse import OpenAICompatibleServer

    assert old_server is OpenAICompatibleServer
    assert not [name for name in OLD_PATHS if (PACKAGE / f"{name}.py").exists()]


@pytest.mark.parametrize("old, new", [("llmadapt.worker", "llmadapt.runtime"),
                                      ("llmadapt.microbench", "llmadapt.runtime")])
def test_an_old_worker_module_still_runs_and_says_its_new_name(old, new):
    """Batch scripts written before 0.2 run `python -m llmadapt.worker RUN_DIR`: the one worker entry point, and a
    warning the default filters show."""
    done = subprocess.run([sys.executable, "-m", old], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"python -m {old} is deprecated" in done.stderr and f"use python -m {new}" in done.stderr
    assert f"usage: python -m {new} RUN_DIR" in done.stderr


# Adapters and record sinks: the installable packages under plugins/ and examples/ (a folder with a pyproject.toml)
# and the reference adapter. examples/ also holds users' scripts, which use the user's API (`import llmadapt`).
def adapter_sources() -> list[Path]:
    roots = [PACKAGE / "reference", *(p.parent for p in sorted(ROOT.glob("plugins/*/pyproject.toml"))),
             *(p.parent for p in sorted(ROOT.glob("examples/*/pyproject.toml")))]
    return sorted(p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts)


# Imports outside llmadapt.adapter that an adapter package may make, each with its reason.
OUTSIDE_THE_SURFACE_ALLOWED = {
    # a record sink runs in the orchestrator; it stores the text `llmadapt show` prints for the run
    ("plugins/mlflow/llmadapt_mlflow/sink.py", "llmadapt.analysis.report"),
    # and a comparison's parent run keeps the comparison's HTML report
    ("plugins/mlflow/llmadapt_mlflow/sink.py", "llmadapt.analysis.htmlreport"),
    ("plugins/tensorboard/llmadapt_tensorboard/sink.py", "llmadapt.analysis.report"),
}


def outside_the_adapter_surface(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of llmadapt that is not llmadapt.adapter or one of its modules, function-level
    ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if (n == "llmadapt" or n.startswith("llmadapt."))
                  and not (n == "llmadapt.adapter" or n.startswith("llmadapt.adapter."))]
    return found


def test_adapters_import_only_the_adapter_surface():
    """Everything an adapter needs is exported by llmadapt.adapter, so the built-in adapters, the example and the
    reference adapter import nothing else of llmadapt (the core can change behind that surface)."""
    sources = adapter_sources()
    assert PACKAGE / "reference" / "plugin.py" in sources and any("adapter-plain" in p.parts for p in sources)
    found = []
    for path in sources:
        where = str(path.relative_to(ROOT))
        found += [f"{where}:{line} {module}" for line, module in outside_the_adapter_surface(path.read_text())
                  if (where, module) not in OUTSIDE_THE_SURFACE_ALLOWED]
    assert found == [], "import these from llmadapt.adapter: " + ", ".join(found)


@pytest.mark.parametrize("planted, caught", [
    ("from llmadapt.contract import Phase", True),
    ("from llmadapt import AdapterInfo", True),
    ("import llmadapt", True),
    ("def f():\n    from llmadapt.host import state_dir", True),
    ("import llmadapt.launch.environments as environments", True),
    ("from llmadapt.adapter import Phase, hookimpl", False),
    ("from llmadapt.adapter.sse import OpenAICompatibleServer", False),
    ("import llmadapt_megatron.trainer\nfrom .plugin import ENGINE_FLAGS", False),
])
def test_an_import_outside_the_adapter_surface_is_caught(planted, caught):
    assert bool(outside_the_adapter_surface(planted)) is caught


# The launcher's entry points, which start runs, engines or workers: llmadapt.experiments calls them, analysis not.
LAUNCHER_MODULES = {"llmadapt.launch.runner", "llmadapt.launch.serve", "llmadapt.launch.engine",
                    "llmadapt.launch.loadpoint", "llmadapt.launch.multinode", "llmadapt.launch.slurm"}
LAUNCHER_NAMES = {"llmadapt.launch": {"run"}, "llmadapt.launch.supervise": {"supervise", "worker_command"}}


def launches(source: str, subprocess_allowed: bool = False) -> list[str]:
    """'LINE: NAME' for each import in SOURCE of a launcher module, a launcher's entry point, or subprocess."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            found += [f"{node.lineno}: {module}.{a.name}" for a in node.names
                      if module in LAUNCHER_MODULES or f"{module}.{a.name}" in LAUNCHER_MODULES
                      or a.name in LAUNCHER_NAMES.get(module, ()) or (module == "subprocess" and not subprocess_allowed)]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names
                      if a.name in LAUNCHER_MODULES or (a.name == "subprocess" and not subprocess_allowed)]
    return found


def test_analysis_only_reads():
    """analysis reads run folders and the store; the commands that start runs live in llmadapt.experiments."""
    found = []
    for path in sorted((PACKAGE / "analysis").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        found += [f"{where}:{hit}" for hit in launches(path.read_text())]
    assert found == [], "analysis starts runs (move it to llmadapt.experiments): " + ", ".join(found)


@pytest.mark.parametrize("planted, caught", [
    ("from llmadapt.launch.runner import run", True),
    ("def f():\n    from llmadapt.launch import run", True),
    ("import llmadapt.launch.serve", True),
    ("from llmadapt.launch.serve import serve_points", True),
    ("from llmadapt.launch import slurm", True),
    ("from llmadapt.launch.supervise import supervise", True),
    ("import subprocess", True),
    ("from subprocess import run", True),
    ("from llmadapt.contract.readback import load_records, summarise", False),
    ("from llmadapt.launch.supervise import default_threads", False),
    ("from llmadapt.launch.runner import RunResult", True),  # the module itself is the launcher
])
def test_a_launch_from_analysis_is_caught(planted, caught):
    assert bool(launches(planted)) is caught


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


# What a path join names below a run folder: ranks' files, node folders, profiler traces.
_JOINED_RUN_NAME = re.compile(r"^/?(rank-|node-|profile\b|step-)")


def _literal(node: ast.AST) -> str | None:
    """A string literal's text; an f-string's with {} for each value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


# A run folder, as code names it: a variable or attribute called so (run_dir, ctx.run_dir, run_folder, out_run_dir),
# a settings key of that name (s["run_dir"]), a RunDir's path (RunDir(d).path, run.path).
_RUN_FOLDER = re.compile(r"(^|_)run_?(dir|folder)$")
_PATH_CALLS = {"Path", "PurePath", "join", "joinpath"}


def _names_run_folder(node: ast.AST) -> bool:
    """``node`` is an expression for a run folder (above), or Path(...) / .absolute() / .resolve() of one."""
    if isinstance(node, ast.Name):
        return bool(_RUN_FOLDER.search(node.id))
    if isinstance(node, ast.Attribute):
        if node.attr == "path":
            owner = node.value
            return ((isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "RunDir")
                    or (isinstance(owner, ast.Name) and owner.id in ("run", "rundir")) or _names_run_folder(owner))
        return bool(_RUN_FOLDER.search(node.attr))
    if isinstance(node, ast.Subscript):
        key = _literal(node.slice)
        return key is not None and bool(_RUN_FOLDER.search(key))
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("Path", "PurePath", "str") and node.args:
            return _names_run_folder(node.args[0])
        if isinstance(func, ast.Attribute) and func.attr in ("absolute", "resolve", "expanduser") and not node.args:
            return _names_run_folder(func.value)
    return False


def _joined_onto_run_folder(node: ast.AST, constants: dict[str, str]) -> list[str]:
    """The literal names ``node`` joins onto a run folder: ``run_dir / "x"``, ``Path(run_dir, "x")``,
    ``os.path.join(run_dir, "x")``, ``run_dir.joinpath("x")``, ``f"{run_dir}/x"``; a literal may stand in a module
    constant (``NAME = "x"``, ``run_dir / NAME``)."""
    def texts(*parts: ast.AST) -> list[str]:
        found = [_literal(p) if not isinstance(p, ast.Name) else constants.get(p.id) for p in parts]
        return [t for t in found if t is not None]

    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _names_run_folder(node.left):
        return texts(node.right)
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name == "joinpath" and isinstance(func, ast.Attribute) and _names_run_folder(func.value):
            return texts(*node.args)
        if name in _PATH_CALLS and len(node.args) > 1 and _names_run_folder(node.args[0]):
            return texts(*node.args[1:])
    if isinstance(node, ast.JoinedStr):
        for value, after in zip(node.values, node.values[1:]):
            if (isinstance(value, ast.FormattedValue) and _names_run_folder(value.value)
                    and isinstance(after, ast.Constant) and str(after.value).startswith("/")):
                return [str(after.value)]
    return []


def literal_run_folder_names(source: str) -> list[str]:
    """'LINE: TEXT' for each literal that names a file in a run folder: any string joined onto a run folder
    (``_joined_onto_run_folder``), a string that is one of RunDir's file names (or a path ending in one), or the
    right side of a ``/`` join that names a rank file, a node folder or the profile folder. A message that mentions
    a name ("no launch.json") is not a path and passes; an adapter's own names go through RunDir.adapter_file."""
    from llmadapt.contract.rundir import RunDir

    files = {v for k, v in vars(RunDir).items() if k.isupper() and isinstance(v, str) and "." in v}
    tree = ast.parse(source)
    constants = {a.targets[0].id: a.value.value for a in tree.body if isinstance(a, ast.Assign)
                 and len(a.targets) == 1 and isinstance(a.targets[0], ast.Name) and _literal(a.value) is not None
                 and isinstance(a.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        text = _literal(node)
        if text is not None and (text in files or ("/" in text and text.rsplit("/", 1)[1] in files)):
            found.append(f"{node.lineno}: {text}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right = _literal(node.right)
            if right is not None and _JOINED_RUN_NAME.match(right):
                found.append(f"{node.lineno}: {right}")
        found += [f"{node.lineno}: {name}" for name in _joined_onto_run_folder(node, constants)]
    return sorted(set(found), key=lambda hit: (int(hit.split(":")[0]), hit))


def test_run_folder_names_are_written_in_rundir_only():
    """Every path into a run folder goes through RunDir, so that its layout is changed in one place: the core's
    and the adapters' (which write the engine's files)."""
    rundir = PACKAGE / "contract" / "rundir.py"
    sources = sorted({*modules(), *adapter_sources()} - {rundir})
    assert any("llmadapt_vllm" in p.parts for p in sources)
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in sources
             for hit in literal_run_folder_names(path.read_text())]
    assert found == [], "name these through llmadapt.contract.rundir.RunDir: " + ", ".join(found)


def test_every_adapter_file_joined_is_declared():
    """Each name an adapter joins with RunDir.adapter_file is in an adapter's declaration (AdapterInfo.run_files),
    so that the declarations list every file adapters write in a run folder, before any run does."""
    import llmadapt

    declared = {name for a in llmadapt.adapters().values() for name in a.run_files}
    joined = {(str(path.relative_to(ROOT)), node.lineno, _literal(node.args[0])) for path in adapter_sources()
              for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and node.func.attr == "adapter_file" and node.args}
    assert {name for _, _, name in joined} >= {"vllm-cache", "gguf.json", "hostfile"}
    assert [j for j in joined if j[2] not in declared] == []


@pytest.mark.parametrize("planted, caught", [
    ('run_dir / "engine.json"', True),
    ('Path(d) / f"rank-{rank:05d}.jsonl"', True),
    ('folder / f"node-{k}"', True),
    ('Path(run_dir) / "profile" / f"step-{s}"', True),
    ('open(f"{run_dir}/worker.log")', True),
    ('settings = {"script": "job.sbatch"}', True),
    ('message = f"{d} is not a run directory (no launch.json)"', False),
    ('spec = {"profile": None}', False),
    # any name joined onto a run folder, not only RunDir's: an adapter's own file goes through RunDir.adapter_file
    ('cache = (ctx.run_dir / "engine-cache").absolute()', True),
    ('Path(s["run_dir"], "served.json").write_text(text)', True),
    ('settings = Path(settings["run_dir"]) / "engine-settings.json"', True),
    ('json.loads((Path(self.ctx.run_dir) / "served.json").read_text())', True),
    ('RunDir(d).path / "notes.txt"', True),
    ('run.path.joinpath("notes.txt")', True),
    ('os.path.join(run_dir, "hosts")', True),
    ('open(f"{out_run_dir}/hosts")', True),
    ('HOSTS = "hosts"\ndef f(run_dir):\n    return run_dir / HOSTS', True),
    ('RunDir(d).adapter_file("engine-cache", RUN_FILES)', False),
    ('checkpoint / "config.json"', False),
    ('message = f"{run_dir} has no summary"', False),
])
def test_a_planted_run_folder_name_is_caught(planted, caught):
    assert bool(literal_run_folder_names(planted)) is caught
