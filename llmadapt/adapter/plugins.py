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


def check_supported(info: AdapterInfo, workload) -> None:
    """Raise UnsupportedError (one line: adapter, field, value, what is allowed) before anything starts."""
    if workload.kind not in info.roles:
        raise UnsupportedError(
            f"adapter {info.name!r} does not support kind={workload.kind!r}; roles: {', '.join(info.roles)}"
        )
    if workload.kind == "serve" and workload.serve.mode == "offline" and "offline" not in info.roles:
        raise UnsupportedError(f"adapter {info.name!r} cannot run serve.mode='offline': it has no offline API "
                               f"(roles: {', '.join(info.roles)})")
    # Training declarations say nothing about serving engines: serve workloads meet only the adapter's own rules
    # (and the model family, which every role needs).
    family = workload.model.family
    problems = [] if family in info.supports.families else [("model.family", family, _family_refusal(workload))]
    problems += info.supports.engine_problems(workload) if workload.kind == "serve" else \
        [p for p in info.supports.problems(workload) if p[0] != "model.family"]
    problems += info.check(workload) if info.check else []
    if problems:
        field, value, allowed = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        use = _who_can(workload, field, info.name) if field in NAME_WHO_CAN else ""
        raise UnsupportedError(f"adapter {info.name!r} cannot run {field}={value!r}: {allowed}{use}{more}")


NAME_WHO_CAN = ("lora.rank", "data.packing", "optimizations.quantization")
"""Features a stack has or lacks outright: their refusal names the registered adapters that run them."""


def _who_can(workload, field: str, refused: str) -> str:
    others = [name for name, a in adapters().items() if name != refused and workload.kind in a.roles
              and not any(p[0] == field for p in a.supports.problems(workload))]
    return f"; {' or '.join(others)} can" if others else ""


def _family_refusal(workload) -> str:
    """What runs a model family this adapter does not: the registered adapters that declare it for this role."""
    family, role = workload.model.family, workload.kind
    others = [name for name, a in adapters().items() if family in a.supports.families and role in a.roles]
    use = f"use {' or '.join(others)}" if others else f"no registered adapter runs it for kind={role!r}"
    return f"this adapter does not run {family} models; {use}"


@lru_cache(maxsize=1)
def default_manager() -> pluggy.PluginManager:
    """The plugin manager of every allowed entry-point plugin, made once."""
    return plugin_manager()
