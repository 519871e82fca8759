"""The stable Python API: every name in the ``__all__`` of the modules below, one line each with its signature
(a class's public methods on lines of their own), as docs/public-api.txt holds it. The version policy in
CHANGELOG.md says what may change; tests/test_public_api.py fails when a name listed there disappears or its
signature changes. After a deliberate change, run this script (``make api``) and say so in CHANGELOG.md.

A name that is deprecated keeps its line with ``# deprecated`` after it (added by hand), and the test then asks
that using it warns; taken out of its module's ``__all__``, it keeps the line while the name still works (a module
``__getattr__`` that warns)."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

MODULES = ("llmadapt", "llmadapt.adapter", "llmadapt.spec", "llmadapt.contract", "llmadapt.experiments",
           "llmadapt.analysis", "llmadapt.analysis.frames", "llmadapt.analysis.store", "llmadapt.launch")
SNAPSHOT = Path(__file__).with_name("public-api.txt")


def _signature(obj: object) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):  # a builtin without one
        return "(...)"
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # a default's repr with an address differs each run


def _methods(cls: type) -> list[tuple[str, str]]:
    out = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            out.append((name, "property"))
        elif isinstance(member, (classmethod, staticmethod)):
            out.append((name, type(member).__name__ + _signature(member.__func__)))
        elif inspect.isfunction(member):
            out.append((name, _signature(member)))
    return sorted(out)


def describe(qualified: str, obj: object) -> list[str]:
    """The lines of one public name."""
    if inspect.isclass(obj):
        lines = [f"{qualified} class{_signature(obj)}"]
        lines += [f"{qualified}.{name} {kind}" for name, kind in _methods(obj)]
        return lines
    if callable(obj):
        return [f"{qualified} {_signature(obj)}"]
    return [f"{qualified} = {type(obj).__name__}"]  # a constant: its type is the API, not its value


def surface() -> list[str]:
    """Every line of the API as the installed code has it."""
    lines = []
    for name in MODULES:
        module = importlib.import_module(name)
        for each in sorted(module.__all__):
            lines += describe(f"{name}.{each}", getattr(module, each))
    return lines


def read(path: Path = SNAPSHOT) -> dict[str, str]:
    """The recorded API: each line's name to the rest of the line (``# deprecated`` kept)."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition(" ")
            out[name] = rest
    return out


def _parameters(signature: str) -> tuple[list[str], str]:
    """A recorded signature's parameters (split at the commas outside brackets and quotes) and what follows them."""
    if not signature.startswith(("(", "class(")):
        return [signature], ""
    body = signature[signature.index("(") + 1:]
    depth, quote, part, params = 0, "", "", []
    for i, ch in enumerate(body):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                params.append(part.strip())
                return [p for p in params if p], body[i + 1:]
            depth -= 1
        elif ch == "," and depth == 0:
            params.append(part.strip())
            part = ""
            continue
        part += ch
    return [signature], ""


def compatible(old: str, new: str) -> bool:
    """Whether code written against ``old`` still works against ``new``: the positional parameters as they were,
    new ones only after them; every keyword-only parameter still there; every added parameter with a default;
    the same return."""
    if old == new:
        return True
    (before, old_return), (after, new_return) = _parameters(old), _parameters(new)
    if old_return != new_return or old.startswith("class(") != new.startswith("class("):
        return False

    def sections(params: list[str]) -> tuple[list[str], set[str]]:
        star = next((i for i, p in enumerate(params) if p.startswith("*")), len(params))
        return params[:star], set(params[star:])

    (old_pos, old_kw), (new_pos, new_kw) = sections(before), sections(after)
    added = new_pos[len(old_pos):] + sorted(new_kw - old_kw)
    return (new_pos[:len(old_pos)] == old_pos and old_kw <= new_kw
            and all("=" in p or p.startswith("*") for p in added))


def breaks(recorded: dict[str, str], current: list[str]) -> list[str]:
    """What the current API breaks of the recorded one: a name gone that was not deprecated, a signature changed
    in a way that breaks a caller (see ``compatible``). New names and a deprecated name's removal are not
    breaks."""
    now = dict(line.partition(" ")[::2] for line in current)
    out = []
    for name, rest in recorded.items():
        deprecated = rest.endswith("# deprecated")
        old = rest.removesuffix("# deprecated").rstrip()
        if name not in now:
            if not deprecated:
                out.append(f"{name} disappeared without a deprecation")
        elif not compatible(old, now[name].removesuffix("# deprecated").rstrip()):
            out.append(f"{name} changed: {old} -> {now[name]}")
    return out


def _resolves(qualified: str) -> bool:
    """Whether a recorded name still gives an object (a deprecated one through its module's ``__getattr__``)."""
    import warnings

    module, _, attr = qualified.rpartition(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            return False
    return True


def _module_of(line: str) -> str:
    """The module of MODULES a line of the API comes from (the longest that prefixes its name)."""
    name = line.partition(" ")[0]
    return max((m for m in MODULES if name.startswith(m + ".")), key=len, default="")


def main() -> None:
    kept = {name: rest for name, rest in read().items() if rest.endswith("# deprecated")} if SNAPSHOT.exists() else {}
    lines = [line if line.partition(" ")[0] not in kept else f"{line}  # deprecated" for line in surface()]
    listed = {line.partition(" ")[0] for line in lines}
    for name, rest in kept.items():  # deprecated and out of __all__: its line stays while the name still works
        if name not in listed and _resolves(name):
            module = name.rpartition(".")[0]
            after = [i for i, line in enumerate(lines) if _module_of(line) == module and line.partition(" ")[0] < name]
            lines.insert(after[-1] + 1 if after else len(lines), f"{name} {rest}")
    SNAPSHOT.write_text("# The stable Python API (docs/public_api.py writes it; CHANGELOG.md has the policy).\n"
                        + "\n".join(lines) + "\n")
    print(f"{SNAPSHOT}: {len(lines)} lines", file=sys.stderr)


if __name__ == "__main__":
    main()
