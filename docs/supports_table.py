"""The `Supports` table of docs/writing-an-adapter.md, rendered from the class: each field's name, type, default
and docstring (what a workload may then set).

`python docs/supports_table.py` rewrites the table (`make reference` runs it); tests/test_docs.py fails when the
doc and the class differ.
"""

import ast
import inspect
from pathlib import Path

import attrs

DOC = Path(__file__).with_name("writing-an-adapter.md")
MARK = "<!-- generated from llmadapt.adapter.Supports by docs/supports_table.py (make reference) -->\n"


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring, the string on the lines after it (attrs keeps none at run time), in one line."""
    tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    return {node.target.id: " ".join(after.value.value.split()) for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


def render() -> str:
    from llmadapt.adapter.declaration import Supports

    docs = field_docs(Supports)
    rows = ["| field | type | default | allows |", "| --- | --- | --- | --- |"]
    for field in attrs.fields(Supports):
        if field.name not in docs:
            raise SystemExit(f"Supports.{field.name} has no docstring: say what it allows "
                             "(llmadapt/adapter/declaration.py)")
        default = repr(field.default).replace("'", '"')
        rows.append(f"| `{field.name}` | `{field.type}` | `{default}` | {docs[field.name]} |")
    return "\n".join(rows) + "\n"


def updated(text: str) -> str:
    """``text`` (the guide) with the table after MARK, up to the next blank line, rendered anew."""
    start = text.index(MARK) + len(MARK)
    end = text.index("\n\n", start) + 1
    return text[:start] + render() + text[end:]


if __name__ == "__main__":
    DOC.write_text(updated(DOC.read_text()))
