"""The docs' examples work as written.

- Every ```toml block in README.md, docs/ and plugins/*/README.md is valid TOML, and every one that
  describes a workload (it sets `kind` or a `[model]` table) is a valid workload.
- Every block marked ``<!-- runnable ... -->`` on the line before it runs as written, with bash -e,
  in a temporary folder holding a copy of examples/ (so what it writes stays there), with the
  development environment's `llmadapt` first on PATH.
"""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from llmadapt import Workload
from llmadapt.testing import environments_unready

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("plugins/*/README.md"))]
BLOCK = re.compile(r"(?P<mark><!-- runnable[^>]*-->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.DOTALL)


def blocks(lang: str, runnable: bool = False):
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            if m["lang"] == lang and (not runnable or m["mark"]):
                line = text[: m.start()].count("\n") + 1
                yield pytest.param(m["body"], id=f"{doc.relative_to(REPO)}:{line}")


@pytest.mark.parametrize("body", list(blocks("toml")))
def test_toml_blocks_are_valid(body):
    data = tomllib.loads(body)
    if "kind" in data or "model" in data:
        Workload.from_dict(data)


RUNNABLE = list(blocks("sh", runnable=True))


def test_some_blocks_are_marked_runnable():
    assert RUNNABLE, "no block is marked <!-- runnable -->: the docs' commands would go untested"


@pytest.mark.skipif(bool(environments_unready("torch", "plain")), reason=environments_unready("torch", "plain") or "")
@pytest.mark.parametrize("body", RUNNABLE)
def test_runnable_blocks_run_as_written(body, tmp_path):
    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-e", "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_adapter_reference_is_rendered_from_the_code(tmp_path):
    """`make reference` renders the modules the Makefile names with pdoc: every name llmadapt.adapter gives an
    adapter author has its entry, with its docstring, and so does every hook, so the reference cannot drift from
    the code."""
    import html
    import inspect

    pdoc = pytest.importorskip("pdoc", reason="pdoc is in the dev extra (pip install -e '.[dev]')")
    import llmadapt.adapter as api
    from llmadapt.adapter import hookspecs

    listed = re.search(r"^REFERENCE_MODULES := (.*?[^\\])$", (REPO / "Makefile").read_text(), re.M | re.S)
    pdoc.pdoc(*listed.group(1).replace("\\\n", " ").split(), output_directory=tmp_path)

    def documented(page: Path, name: str, obj) -> None:
        text = page.read_text()
        assert f'id="{name}"' in text, (page.name, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = obj.__doc__
            assert doc and doc.strip(), f"{name} has no docstring of its own"
            first = " ".join(doc.split("\n\n")[0].split())[:40]
            assert html.escape(first, quote=False).split("`")[0][:20] in text, (name, first)

    for name in api.__all__:
        documented(tmp_path / "llmadapt" / "adapter.html", name, getattr(api, name))
    hooks = [name for name in vars(hookspecs) if name.startswith("llmadapt_")]
    assert sorted(hooks) == ["llmadapt_experiment_sink", "llmadapt_record_sink", "llmadapt_register_adapters"]
    for name in hooks:
        documented(tmp_path / "llmadapt" / "adapter" / "hookspecs.html", name, getattr(hookspecs, name))
    for module in ("weights", "sse", "moe"):  # the modules the package's docstring sends authors to
        assert (tmp_path / "llmadapt" / "adapter" / f"{module}.html").is_file(), module


def test_the_supports_table_is_the_class():
    """docs/writing-an-adapter.md's Supports table is docs/supports_table.py's rendering of the class: a field
    added, renamed or redocumented without rerunning it fails here."""
    import runpy

    script = runpy.run_path(str(REPO / "docs" / "supports_table.py"))
    text = (REPO / "docs" / "writing-an-adapter.md").read_text()
    assert script["updated"](text) == text, "the Supports table differs from the class: run python docs/supports_table.py"
    assert "| `engine_quantization` | `tuple[str, ...]` | `()` |" in text


# The losses the docs' transcripts print, rerun: (doc, the text the table follows, the workload, the row's label,
# its settings). The table prints four decimals: a documented loss reproduces when the rerun rounds to it.
DOCUMENTED_LOSSES = [
    ("README.md", "`make demo` creates", "examples/tiny-llama.toml", "torch dp1 mb4", ["train.steps=40"]),
    ("docs/breakdown.md", "llmadapt compare examples/breakdown.toml", "examples/breakdown.toml", "torch dp1 mb8", []),
    ("docs/comparisons.md", "llmadapt compare examples/tiny-llama.toml", "examples/tiny-llama.toml", "torch dp2",
     ["parallelism.dp=2"]),
    ("docs/comparisons.md", "llmadapt compare examples/tiny-mixtral.toml", "examples/tiny-mixtral.toml",
     "torch dp2 precision=fp32", ["parallelism.dp=2"]),
]


def documented_losses(doc: str, anchor: str, label: str) -> tuple[float, float]:
    """First and last loss of the row LABEL in the first table after ANCHOR in DOC."""
    text = (REPO / doc).read_text()
    start = text.index(anchor)
    row = re.search(rf"^P\d+\s+{re.escape(label)}\s+ok\s.*$", text[start:], re.MULTILINE)
    assert row, f"{doc}: no row {label!r} after {anchor!r}"
    losses = re.search(r"\s(\d+\.\d{4})\s+(\d+\.\d{4})\s+\d\.\d\de[+-]\d\d", row.group(0))  # before parity delta
    assert losses, row.group(0)
    return float(losses[1]), float(losses[2])


@pytest.mark.skipif(bool(environments_unready("torch")), reason=environments_unready("torch") or "")
@pytest.mark.parametrize("doc,anchor,workload,label,settings", DOCUMENTED_LOSSES,
                         ids=[f"{d}:{w}" for d, _, w, _, _ in DOCUMENTED_LOSSES])
def test_a_documented_loss_still_reproduces(doc, anchor, workload, label, settings, tmp_path):
    """The same problem hash must mean the same trajectory: when the canonical checkpoint, the data or the model
    code changes what a documented run computes, this fails until the transcript is regenerated and, for a preset's
    weights, spec.CHECKPOINT_RECIPE bumped (so that stored runs of the old weights are another problem)."""
    from llmadapt import run

    expected = documented_losses(doc, anchor, label)
    w = Workload.from_file(REPO / workload).with_overrides(settings)
    result = run(w, "torch", out=tmp_path)
    assert result.ok
    got = (round(result.summary.losses[0], 4), round(result.summary.losses[-1], 4))
    assert got == expected, f"{doc} prints {expected} for {label} on {workload}; it now computes {got}"
