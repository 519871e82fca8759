"""The device catalog: what the analytical model knows about a device, each figure with its source and date.

The package ships ``resources/devices.toml`` (datasheet GPUs). Users extend or override it
with their own TOML files, read in this order, later ones winning field by field:

1. the shipped catalog;
2. ``$LLMADAPT_HOME/devices.toml`` (default ``~/.cache/llmadapt/devices.toml``), where
   ``llmadapt micro peak --save NAME`` writes measured devices (CPUs are described by
   measurement, not by datasheet);
3. files named by ``LLMADAPT_DEVICES`` (colon-separated);
4. files passed explicitly (``--catalog FILE``).

An entry with an existing name updates only the fields it gives (``peak_flops`` and
``sources`` merge key by key). Nothing here imports torch.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from llmadapt.errors import LlmadaptError, not_a_file
from llmadapt.host import state_dir

FIELDS = ("kind", "description", "aliases", "match", "memory_bytes", "memory_bandwidth", "peak_flops",
          "interconnect", "interconnect_bandwidth", "host_bandwidth", "price_per_hour", "shared_by_ranks",
          "runtime_overhead_bytes", "measured", "sources")


KINDS = ("gpu", "cpu")


@attrs.frozen
class Source:
    """Where a figure comes from, and when."""

    ref: str
    date: str


@attrs.frozen
class DeviceSpec:
    """One device as the analytical model sees it. Units: bytes, bytes/s, FLOP/s, US$ per device-hour."""

    name: str
    kind: str
    description: str = ""
    aliases: tuple[str, ...] = ()
    match: tuple[str, ...] = ()
    """Substrings of a run's reported device name that map it to this entry (e.g. 'AMD EPYC')."""
    memory_bytes: float | None = None
    memory_bandwidth: float | None = None
    peak_flops: dict[str, float] = attrs.Factory(dict)
    """Dense peak FLOP/s per dtype (fp32, tf32, bf16, fp16, fp8, int8)."""
    interconnect: str | None = None
    interconnect_bandwidth: float | None = None
    """Per direction: the most a collective's busbw can reach."""
    host_bandwidth: float | None = None
    price_per_hour: float | None = None
    shared_by_ranks: bool = False
    """True for CPUs: ranks on one machine share its cores and memory bandwidth."""
    runtime_overhead_bytes: float | None = None
    """Memory the runtime takes before any model (CUDA context, or a CPU worker's baseline)."""
    measured: bool = False
    sources: dict[str, Source] = attrs.Factory(dict)
    origin: str = ""
    """Which catalog file(s) the entry came from."""

    def peak(self, dtype: str) -> float | None:
        return self.peak_flops.get(dtype)

    def source_of(self, field: str) -> str:
        s = self.sources.get(field)
        return f"{s.ref} ({s.date})" if s else "no source"

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def shipped_catalog_text() -> str:
    return resources.files("llmadapt.resources").joinpath("devices.toml").read_text()


def user_catalog_path() -> Path:
    return state_dir() / "devices.toml"


def _catalog_paths(extra: list[str | Path] | tuple = ()) -> list[Path]:
    paths = [user_catalog_path()]
    env = os.environ.get("LLMADAPT_DEVICES")
    if env:
        paths += [Path(p) for p in env.split(os.pathsep) if p]
    paths += [Path(p) for p in extra]
    return paths


def _parse(text: str, origin: str) -> dict[str, dict[str, Any]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LlmadaptError(f"device catalog {origin} could not be parsed: {exc}") from None
    devices = data.get("devices", {})
    if not isinstance(devices, dict):
        raise LlmadaptError(f"device catalog {origin}: [devices] must be a table of devices")
    for name, entry in devices.items():
        if not isinstance(entry, dict):
            raise LlmadaptError(f"device catalog {origin}: devices.{name} must be a table")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise LlmadaptError(f"device catalog {origin}: devices.{name}.{unknown[0]} is not a known field; "
                                f"known: {', '.join(FIELDS)}")
    return devices


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if key in ("peak_flops", "sources") and isinstance(value, dict):
            out[key] = {**out.get(key, {}), **value}
        else:
            out[key] = value
    return out


def _build(name: str, raw: dict[str, Any], origin: str) -> DeviceSpec:
    kind = raw.get("kind")
    if kind not in KINDS:
        raise LlmadaptError(f"device catalog: devices.{name}.kind is {kind!r}; allowed: {', '.join(KINDS)}")
    sources = {}
    for field, src in (raw.get("sources") or {}).items():
        if isinstance(src, dict) and "ref" in src:
            sources[field] = Source(ref=str(src["ref"]), date=str(src.get("date", "undated")))
        else:
            sources[field] = Source(ref=str(src), date="undated")

    def num(key: str) -> float | None:
        value = raw.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise LlmadaptError(f"device catalog: devices.{name}.{key} must be a non-negative number, got {value!r}")
        return float(value)

    peaks = {}
    for dtype, value in (raw.get("peak_flops") or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LlmadaptError(f"device catalog: devices.{name}.peak_flops.{dtype} must be a positive number")
        peaks[dtype] = float(value)
    return DeviceSpec(
        name=name, kind=kind, description=str(raw.get("description", "")),
        aliases=tuple(raw.get("aliases", ())), match=tuple(raw.get("match", ())),
        memory_bytes=num("memory_bytes"), memory_bandwidth=num("memory_bandwidth"), peak_flops=peaks,
        interconnect=raw.get("interconnect"), interconnect_bandwidth=num("interconnect_bandwidth"),
        host_bandwidth=num("host_bandwidth"), price_per_hour=num("price_per_hour"),
        shared_by_ranks=bool(raw.get("shared_by_ranks", kind == "cpu")),
        runtime_overhead_bytes=num("runtime_overhead_bytes"), measured=bool(raw.get("measured", False)),
        sources=sources, origin=origin,
    )


def load_catalog(extra: list[str | Path] | tuple = ()) -> dict[str, DeviceSpec]:
    """Every known device by name: the shipped catalog, updated by the user's files."""
    raw: dict[str, dict[str, Any]] = {}
    origins: dict[str, list[str]] = {}
    for name, entry in _parse(shipped_catalog_text(), "llmadapt/resources/devices.toml").items():
        raw[name] = dict(entry)
        origins[name] = ["package"]
    for path in _catalog_paths(extra):
        if not path.is_file():
            if path in [Path(p) for p in extra]:
                raise LlmadaptError(f"device catalog {path}: {not_a_file(path)}")
            continue
        for name, entry in _parse(path.read_text(), str(path)).items():
            raw[name] = _merge(raw.get(name, {}), entry)
            origins.setdefault(name, []).append(str(path))
    return {name: _build(name, entry, " + ".join(origins[name])) for name, entry in raw.items()}


def normalised(name: str) -> str:
    """A device name as compared: lower case, the vendor's words dropped, '-', '_' and runs of spaces as one space
    ('NVIDIA A100-SXM4-80GB' -> 'a100 sxm4 80gb', 'Tesla V100-SXM2-32GB' -> 'v100 sxm2 32gb')."""
    words = re.sub(r"[-_\s]+", " ", name.strip().lower()).split()
    return " ".join(w for w in words if w not in ("nvidia", "tesla", "geforce", "amd", "instinct"))


def _by_name(name: str, catalog: dict[str, DeviceSpec]) -> DeviceSpec | None:
    """The entry whose name or an alias is NAME, compared normalised."""
    key = normalised(name)
    for spec in catalog.values():
        if key == normalised(spec.name) or key in (normalised(a) for a in spec.aliases):
            return spec
    return None


def find_device(name: str, catalog: dict[str, DeviceSpec] | None = None, *,
                extra: list[str | Path] | tuple = ()) -> DeviceSpec:
    """A device by name or alias (normalised: case, the vendor's name, '-' or ' '), or one clear error listing
    what is known."""
    catalog = load_catalog(extra) if catalog is None else catalog
    key = name.strip().lower()
    found = _by_name(name, catalog)
    if found is not None:
        return found
    known = ", ".join(sorted(catalog))
    hint = "; CPUs are described by measurement: `llmadapt micro peak --save NAME`" if "cpu" in key else ""
    raise LlmadaptError(f"unknown device {name!r}; known: {known}{hint}")


def device_for_reported(reported_name: str, catalog: dict[str, DeviceSpec] | None = None) -> DeviceSpec | None:
    """The catalog entry for a name a run reported (e.g. 'NVIDIA H100 80GB HBM3', 'AMD EPYC'), if any."""
    catalog = load_catalog() if catalog is None else catalog
    text = reported_name.lower()
    found = _by_name(reported_name, catalog)
    if found is not None:
        return found
    for spec in catalog.values():
        if any(m.lower() in text for m in spec.match if m):
            return spec
    return None


# -- writing the user's catalog -------------------------------------------------------------------
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(float(value)) if isinstance(value, float) else str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def _key(k: str) -> str:
    return k if all(c.isalnum() or c in "-_" for c in k) else _toml_value(k)


def dumps(devices: dict[str, dict[str, Any]]) -> str:
    """TOML text for a {name: fields} mapping, in the catalog's layout."""
    lines = ["# llmadapt device catalog (user entries); see llmadapt/resources/devices.toml for the format.", ""]
    for name, entry in devices.items():
        lines.append(f"[devices.{_key(name)}]")
        for k, v in entry.items():
            if k != "sources" and v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
        if entry.get("sources"):
            lines += ["", f"[devices.{_key(name)}.sources]"]
            for k, v in entry["sources"].items():
                lines.append(f"{_key(k)} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def save_device(name: str, fields: dict[str, Any], path: str | Path | None = None) -> Path:
    """Add or update one entry in a user catalog file (default: $LLMADAPT_HOME/devices.toml)."""
    path = Path(path) if path else user_catalog_path()
    existing: dict[str, dict[str, Any]] = {}
    if path.is_file():
        existing = {k: dict(v) for k, v in _parse(path.read_text(), str(path)).items()}
    existing[name] = _merge(existing.get(name, {}), fields)
    _build(name, existing[name], str(path))  # validate before writing
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(dumps(existing))
    os.replace(tmp, path)
    return path


def today() -> str:
    return _dt.date.today().isoformat()
