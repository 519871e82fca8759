"""The plugin manager: adapters come from entry points in the ``llmadapt`` group, built-in or not.

``LLMADAPT_LOAD_PLUGINS`` limits which entry points load: a comma-separated list of names,
or empty for none (so a broken adapter package cannot lock anyone out of the CLI).

A source checkout used without installing it (on PYTHONPATH, as on a machine with no network) has no package
metadata: its own adapters are then read from the entry points its pyproject files declare.
"""

from __future__ import annotations

import os
import sys
import tomllib
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy

import llmadapt.adapter.hookspecs as hookspecs
from llmadapt.adapter.declaration import AdapterInfo
from llmadapt.errors import LlmadaptError, UnknownAdapterError, UnsupportedError, did_you_mean

GROUP = "llmadapt"


def plugin_manager(load_entrypoints: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the hookspecs and (by default) every allowed entry-point plugin."""
    pm = pluggy.PluginManager(GROUP)
    pm.add_hookspecs(hookspecs)
    if load_entrypoints:
        allowed = os.environ.get("LLMADAPT_LOAD_PLUGINS")
        names = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
        loaded: dict[str, str] = {}
        for ep in [*metadata.entry_points(group=GROUP), *checkout_entry_points()]:
            if names is not None and ep.name not in names:
                continue
            if ep.name in loaded:
                if loaded[ep.name] == ep.value:
                    continue  # the same package's metadata seen twice (e.g. an old and an editable install)
                msg = f"two packages define the llmadapt plugin {ep.name!r}: {loaded[ep.name]} and {ep.value}"
                raise LlmadaptError(msg)
            loaded[ep.name] = ep.value
            try:
                plugin = ep.load()
            except Exception as exc:
                msg = f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}; set LLMADAPT_LOAD_PLUGINS to skip it"
                raise LlmadaptError(msg) from exc
            pm.register(plugin, name=ep.name)
    pm.check_pending()
    return pm


def checkout_entry_points() -> list[metadata.EntryPoint]:
    """Where llmadapt is imported from a source checkout that is not installed: the ``llmadapt`` entry points of
    the checkout's pyproject files (the core's, plugins/*, examples/*), each package's folder put on sys.path so
    that its entry point imports. Nothing where llmadapt is installed: its metadata says it all. (An entry point
    found both ways is loaded once: the same name and value.)"""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        return []
    try:  # installed, unless the metadata found is a build's leftover inside the checkout (llmadapt.egg-info)
        if Path(str(metadata.distribution("llmadapt").locate_file(""))).resolve() != root:
            return []
    except metadata.PackageNotFoundError:
        pass
    found = []
    for pyproject in [root / "pyproject.toml", *sorted(root.glob("plugins/*/pyproject.toml")),
                      *sorted(root.glob("examples/*/pyproject.toml"))]:
        try:
            project = tomllib.loads(pyproject.read_text()).get("project", {})
        except (OSError, tomllib.TOMLDecodeError):
            continue
        group = project.get("entry-points", {}).get(GROUP, {})
        if group and pyproject.parent != root and str(pyproject.parent) not in sys.path:
            sys.path.append(str(pyproject.parent))
        found += [metadata.EntryPoint(name=name, value=value, group=GROUP) for name, value in group.items()]
    return found


def collect_adapters(pm: pluggy.PluginManager) -> dict[str, AdapterInfo]:
    found: dict[str, AdapterInfo] = {}
    owners: dict[str, str] = {}

    for impl in pm.hook.llmadapt_register_adapters.get_hookimpls():
        def register(info: AdapterInfo, _plugin: str = impl.plugin_name) -> None:
            if not isinstance(info, AdapterInfo):
                raise LlmadaptError(f"plugin {_plugin!r} registered {info!r}, not an llmadapt.AdapterInfo")
            if info.name in found:
                msg = f"adapter {info.name!r} is registered twice: by plugin {owners[info.name]!r} and by {_plugin!r}"
                raise LlmadaptError(msg)
            found[info.name] = info
            owners[info.name] = _plugin

        try:
            impl.function(register=register)
        except LlmadaptError:
            raise
        except Exception as exc:  # a broken third-party plugin: named in one line, never a traceback
            raise LlmadaptError(f"plugin {impl.plugin_name!r} failed to register its adapters: "
                                f"{type(exc).__name__}: {exc}; set LLMADAPT_LOAD_PLUGINS to skip it") from None
    return dict(sorted(found.items()))


@lru_cache(maxsize=1)
def _default_adapters() -> dict[str, AdapterInfo]:
    return collect_adapters(default_manager())


def adapters(pm: pluggy.PluginManager | None = None) -> dict[str, AdapterInfo]:
    """Every registered adapter by name (from a given manager, or the default one)."""
    return collect_adapters(pm) if pm is not None else _default_adapters()


def get_adapter(name: str, pm: pluggy.PluginManager | None = None) -> AdapterInfo:
    """The registered adapter called NAME; an unknown name is an error listing the registered ones."""
    found = adapters(pm)
    if name not in found:
        known = ", ".join(found) or "none (is llmadapt installed with pip?)"
        raise UnknownAdapterError(f"unknown adapter {name!r}{did_you_mean(name, found)}; registered adapters: {known}")
    return found[name]


def problems(info: AdapterInfo, workload) -> list[tuple[str, Any, str]]:
    """Every reason INFO cannot run WORKLOAD, as (field, value, what is allowed); empty: it runs it. The one
    capability check: `check_supported` refuses on it, and a refusal names another adapter only when this
    accepts the workload for that adapter."""
    if workload.kind not in info.roles:
        return [("kind", workload.kind, f"roles: {', '.join(info.roles)}")]
    if workload.kind == "serve" and workload.serve.mode == "offline" and "offline" not in info.roles:
        return [("serve.mode", "offline", f"it has no offline API (roles: {', '.join(info.roles)})")]
    # Training declarations say nothing about serving engines: serve workloads meet only the adapter's own rules
    # (and the model family, which every role needs).
    family = workload.model.family
    found = [] if family in info.supports.families else [
        ("model.family", family, f"this adapter does not run {family} models")]
    found += info.supports.engine_problems(workload) if workload.kind == "serve" else \
        [p for p in info.supports.problems(workload) if p[0] != "model.family"]
    return found + (info.check(workload) if info.check else [])


def check_supported(info: AdapterInfo, workload) -> None:
    """Raise UnsupportedError (one line: adapter, field, value, what is allowed) before anything starts."""
    found = problems(info, workload)
    if not found:
        return
    field, value, allowed = found[0]
    if field == "kind":
        raise UnsupportedError(f"adapter {info.name!r} does not support kind={value!r}; {allowed}")
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    if field == "model.family":
        use = alternatives(workload, info.name, "use {}")
    elif field in NAME_WHO_CAN:
        use = alternatives(workload, info.name, "{} can")
    else:
        use = ""
    raise UnsupportedError(f"adapter {info.name!r} cannot run {field}={value!r}: {allowed}{use}{more}")


NAME_WHO_CAN = ("lora.rank", "data.packing", "optimizations.quantization", "save.path", "serve.api")
"""Features a stack has or lacks outright: their refusal names the registered adapters that run the workload."""


def runners(workload, pm: pluggy.PluginManager | None = None) -> list[str]:
    """The registered adapters that run WORKLOAD as it is: those whose `problems` is empty."""
    return [name for name, a in adapters(pm).items() if not problems(a, workload)]


def alternatives(workload, refused: str, form: str) -> str:
    """What a refusal by adapter REFUSED adds: '; ' + FORM naming the other adapters that run the whole workload
    (by `problems`, the check that would accept it: never one that would refuse it in turn), or, where none
    does, each other adapter of this kind with the first thing it refuses."""
    others = [name for name in runners(workload) if name != refused]
    if others:
        return "; " + form.format(" or ".join(others))
    why: dict[str, list[str]] = {}
    for name, a in adapters().items():
        if name != refused and workload.kind in a.roles:
            field, value, _ = problems(a, workload)[0]
            why.setdefault(f"{field}={value!r}", []).append(name)
    if not why:
        return f"; no other installed adapter runs kind={workload.kind!r}"
    return "; no installed adapter runs this: " + "; ".join(
        f"{_names(names)} {'refuses' if len(names) == 1 else 'refuse'} {what}" for what, names in why.items())


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


@lru_cache(maxsize=1)
def default_manager() -> pluggy.PluginManager:
    """The plugin manager of every allowed entry-point plugin, made once."""
    return plugin_manager()
