"""The module paths of before 0.2 (``llmadapt.sse``, ``llmadapt.interfaces``, ... and ``python -m
llmadapt.worker``), kept for one release for adapters and scripts written against them.

Each old module is a file here, loaded under its old name by the finder below (the package root installs it), so
the package's top level shows only its layers. Loading one warns (DeprecationWarning) with the new path.
Nothing inside llmadapt imports them; docs/writing-an-adapter.md lists each old path's new one."""

import sys
import warnings
from pathlib import Path

OLD_PATHS = ("data", "environments", "hookspecs", "interfaces", "microbench", "moe", "plugins", "prepare", "serving",
             "sse", "worker")


class OldPaths:
    """A finder (sys.meta_path) for ``llmadapt.NAME``, NAME an old path: this package's NAME.py, under the old
    name (one module per name, so ``python -m`` runs it too)."""

    def find_spec(self, fullname: str, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != "llmadapt" or name not in OLD_PATHS:
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(fullname, Path(__file__).with_name(f"{name}.py"))


def install() -> None:
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())


def moved(old: str, new: str, module_name: str) -> None:
    """Warn that ``old`` is deprecated, naming ``new``; called by each old module with its ``__name__``."""
    # Attributed to whoever imported the old path; run as `python -m`, to the module itself (__main__), since the
    # default filters show a DeprecationWarning only there.
    warnings.warn(f"{old} is deprecated and will be removed in the next release: use {new}", DeprecationWarning,
                  stacklevel=2 if module_name == "__main__" else 3)
