"""The workload: the sections together (``Workload``), its construction from files, dicts and ``--set`` settings,
its settings for one adapter, and its identity (the content and problem hashes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs

from llmadapt.errors import WorkloadError
from llmadapt.spec.data import DataSpec
from llmadapt.spec.fields import choice
from llmadapt.spec.loading import build, field_at, file_data, flatten, load_yaml
from llmadapt.spec.model import CHECKPOINT_RECIPE, MODEL_PRESETS, ModelSpec, drop_unset_layout
from llmadapt.spec.parallelism import Optimizations, Parallelism
from llmadapt.spec.serving import EngineSpec, ServeSpec, SourceSpec
from llmadapt.spec.training import EvalSpec, LoraSpec, ProfileSpec, SaveSpec, TelemetrySpec, TrainSpec
from llmadapt.spec.validation import check_workload

KINDS = ("train", "finetune", "serve")
PRECISIONS = ("fp32", "bf16", "fp16")

# Fields that change how a workload runs but not the numbers it computes (in exact arithmetic).
# Runs whose workloads differ only here share a problem hash, so their losses can be compared.
_LAYOUT_FIELDS = {
    "parallelism": None,
    "train": ("micro_batch", "optimizer_impl", "on_nonfinite"),
    "optimizations": ("zero_stage", "offload", "recompute", "flash_attention"),
    "profile": None,  # looking does not change the numbers
    "save": None,  # nor does keeping the result
    "eval": ("batch",),  # how many examples share a forward pass
    "telemetry": None,
}


@attrs.frozen
class Workload:
    """One workload: the unit that runs identically on every stack."""

    kind: str = attrs.field(default="train", validator=choice(KINDS))
    name: str = ""
    """A label only (not part of the hash)."""
    seed: int = 0
    model: ModelSpec = attrs.field(factory=lambda: ModelSpec(name="tiny-llama", **MODEL_PRESETS["tiny-llama"]))
    data: DataSpec = attrs.field(factory=DataSpec)
    train: TrainSpec = attrs.field(factory=TrainSpec)
    precision: str = attrs.field(default="fp32", validator=choice(PRECISIONS))
    parallelism: Parallelism = attrs.field(factory=Parallelism)
    optimizations: Optimizations = attrs.field(factory=Optimizations)
    lora: LoraSpec = attrs.field(factory=LoraSpec)
    serve: ServeSpec = attrs.field(factory=ServeSpec)
    profile: ProfileSpec = attrs.field(factory=ProfileSpec)
    save: SaveSpec = attrs.field(factory=SaveSpec)
    eval: EvalSpec = attrs.field(factory=EvalSpec)
    telemetry: TelemetrySpec = attrs.field(factory=TelemetrySpec)
    adapters: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    """Settings for one adapter only: adapter name -> {dotted path: value} (``[adapters.megatron]`` in a file,
    ``--set megatron:parallelism.tp=2``). They wait here until `for_adapter` applies one adapter's; not part of
    either hash."""
    sources: dict[str, str] = attrs.field(factory=dict, eq=False)
    """Where each field that was set explicitly came from: dotted path -> 'file', 'file [adapters.NAME]',
    '--set', '--set NAME:', 'cell', 'matrix'. Settings still waiting for their adapter are under 'NAME:path'.
    Recorded in every trace header with the final workload; not part of either hash."""

    def __attrs_post_init__(self) -> None:
        check_workload(self)
        known = self.to_dict() if self.adapters else {}
        for name, settings in self.adapters.items():
            if not isinstance(settings, dict):
                raise WorkloadError(f"adapters.{name}", settings, "must be a table of settings for that adapter")
            for path, value in settings.items():
                field_at(known, path, value, name)  # an unknown field is refused now, not at for_adapter

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        """Build from plain data (parsed TOML/YAML/JSON); model.preset expands to its fields."""
        return build(cls, data, "")

    @classmethod
    def from_file(cls, path: str | Path) -> Workload:
        """Load a TOML, YAML or JSON workload file; paths in it are relative to the file."""
        return cls.from_dict(file_data(path))

    def with_overrides(self, assignments: list[str] | tuple[str, ...], *, source: str = "override") -> Workload:
        """Apply ``path=value`` assignments (values parsed as YAML scalars/lists), in order.

        ``NAME:path=value`` is a setting for adapter NAME only: it waits in ``adapters`` until `for_adapter`.
        A setting for all adapters replaces any earlier one-adapter setting of the same field: the last
        setting of a field wins. ``source`` is recorded in ``sources`` ('--set', 'cell', 'matrix', ...).
        """
        if not assignments:
            return self
        import yaml

        items = []
        for assignment in assignments:
            key, sep, raw = assignment.partition("=")
            adapter, colon, path = key.strip().rpartition(":")
            if not sep or not path or (colon and not adapter):
                raise WorkloadError(source, assignment, "use path=value, e.g. train.steps=5, or adapter:path=value "
                                    "for one adapter, e.g. megatron:parallelism.tp=2")
            try:
                value = load_yaml(raw) if raw else ""
            except yaml.YAMLError:
                value = raw
            items.append((adapter.strip() or None, path.strip(), value))
        return self._with_values(items, source)

    def for_adapter(self, name: str) -> Workload:
        """This workload as adapter ``name`` runs it: its own settings applied, in order, after the settings
        for all; no adapter's settings left waiting. Errors name the adapter ('megatron:parallelism.tp')."""
        own = self.adapters.get(name, {})
        base = attrs.evolve(self, adapters={}, sources={k: v for k, v in self.sources.items() if ":" not in k})
        origins = {path: self.sources.get(f"{name}:{path}", f"{name}:") for path in own}
        return base._with_values([(None, path, value) for path, value in own.items()], origins, scope=name)

    def _with_values(self, items: list[tuple[str | None, str, Any]], source: str | dict[str, str], *,
                     scope: str | None = None) -> Workload:
        """Apply (adapter or None, dotted path, value) settings in order. ``source``: what to record for each
        (one label, or one per path); ``scope``: the adapter every error names."""
        if not items:
            return self
        data = self.to_dict()
        waiting, sources = data["adapters"], data["sources"]
        for adapter, path, value in items:
            origin = source.get(path, "") if isinstance(source, dict) else f"{source} {adapter}:" if adapter else source
            target = field_at(data, path, value, adapter or scope)
            if adapter:  # waits for its adapter; a field set again moves to the end (applied in the order given)
                waiting.setdefault(adapter, {}).pop(path, None)
                waiting[adapter][path] = value
                sources[f"{adapter}:{path}"] = origin
                continue
            if path in ("model.preset", "model.path"):  # a preset or a folder replaces the whole model section
                data["model"] = {path.split(".")[1]: value}
                for key in [k for k in sources if k.startswith("model.")]:
                    del sources[key]
            else:
                target[path.split(".")[-1]] = value
            sources[path] = origin
            for name in list(waiting):  # a later setting for all wins over an earlier one for one adapter
                if path in waiting[name]:
                    del waiting[name][path]
                    sources.pop(f"{name}:{path}", None)
                if not waiting[name]:
                    del waiting[name]
        try:
            return Workload.from_dict(data)
        except WorkloadError as exc:
            if scope and not exc.field.startswith(f"{scope}:"):
                raise WorkloadError(f"{scope}:{exc.field}", exc.value, exc.allowed) from None
            raise

    # -- identity -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @property
    def content_hash(self) -> str:
        """Stable hash of everything that defines the workload (labels, per-adapter settings and sources
        excluded: apply `for_adapter` first)."""
        return _hash(_without_labels(self.to_dict()))

    def problem_dict(self) -> dict[str, Any]:
        """What determines the loss trajectory, the problem hash's input: layout and memory techniques (the
        parallelism section, micro-batch, optimizer implementation, ZeRO, offload, recompute, flash attention),
        labels and per-adapter settings left out; the weights' identity in (a model folder's content checksum, or
        for a preset the recipe that builds its canonical checkpoint)."""
        data = _without_labels(self.to_dict())
        if "checksum" not in data["model"]:  # a preset: its weights are the recipe's (a model folder's, its content)
            data["model"]["checkpoint_recipe"] = CHECKPOINT_RECIPE
        for section, fields in _LAYOUT_FIELDS.items():
            if section not in data:  # left out of the hash altogether (an eval section that evaluates nothing)
                continue
            if fields is None:
                data.pop(section)
            else:
                for field in fields:
                    data[section].pop(field, None)  # some are left out at their defaults already
        return data

    @property
    def problem_hash(self) -> str:
        """Hash of what determines the loss trajectory: layout and memory techniques excluded."""
        return _hash(self.problem_dict())

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def per_rank_batch(self) -> int:
        return self.train.global_batch // self.parallelism.dp

    @property
    def micro_batch(self) -> int:
        return self.train.micro_batch or self.per_rank_batch

    @property
    def label(self) -> str:
        return self.name or f"{self.kind}-{self.model.name}"


def _without_labels(data: dict[str, Any]) -> dict[str, Any]:
    """A workload's dict less what does not define it: labels, per-adapter settings, sources, the model
    folder's location (its content is the checksum; absent for a preset, so older hashes stay as they were), and
    the eval section when nothing is evaluated, data.packing off, save.lora, serve.stream, serve.mode, serve.engine, serve.source,
    parallelism.p2p, parallelism.threads_per_rank and train.on_nonfinite at their defaults (so are older hashes), and
    serve.max_failed_share and the quality gate (judgements of the result); serve.quality when off."""
    for key in ("name", "adapters", "sources"):
        data.pop(key)
    if not data["eval"]["examples"]:
        data.pop("eval")
    else:  # eval.format, eval.match and eval.share unset, data.format at its default: left out, so older hashes stay
        for key in ("format", "match"):
            if data["eval"][key] is None:
                data["eval"].pop(key)
        if not data["eval"]["share"]:
            data["eval"].pop("share")
    if data["data"]["format"] == "prompt-answer":
        data["data"].pop("format")
    if not data["data"]["packing"]:
        data["data"].pop("packing")
    if data["save"]["lora"] == "merged":
        data["save"].pop("lora")
    if not data["serve"]["stream"]:
        data["serve"].pop("stream")
    data["serve"].pop("max_failed_share")  # judges the result, changes nothing measured
    if data["serve"]["mode"] == "online":
        data["serve"].pop("mode")
    if not data["serve"]["profile"]:
        data["serve"].pop("profile")
    for key in ("min_share", "output_tolerance"):  # the quality gate judges the result, changes nothing measured
        data["serve"]["quality"].pop(key)
    if not data["serve"]["quality"]["texts"]:  # off: left out, so older hashes stay
        data["serve"].pop("quality")
    if data["serve"]["source"] == attrs.asdict(SourceSpec()):
        data["serve"].pop("source")
    if data["serve"]["engine"] == attrs.asdict(EngineSpec()):
        data["serve"].pop("engine")
    elif data["serve"]["engine"]["prefix_caching"] is None:  # unset: left out, so older hashes stay
        data["serve"]["engine"].pop("prefix_caching")
    if data["parallelism"]["p2p"]:
        data["parallelism"].pop("p2p")
    if not data["parallelism"]["threads_per_rank"]:
        data["parallelism"].pop("threads_per_rank")
    if data["train"]["on_nonfinite"] == "stop":
        data["train"].pop("on_nonfinite")
    for key in ("name", "path"):
        data["model"].pop(key)
    if data["model"]["checksum"] is None:
        data["model"].pop("checksum")
    drop_unset_layout(data["model"])
    return data


def problem_difference(a: Workload, b: Workload) -> list[str]:
    """The fields (dotted paths, with both values) where two workloads pose different problems."""
    keys = set(flatten(a.problem_dict())) | set(flatten(b.problem_dict()))
    # Values from the whole workload: a problem leaves settings at their defaults out (older hashes stay), and a
    # setting one side left out is its default there, not None.
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    return [f"{k} ({fa.get(k)!r} vs {fb.get(k)!r})" for k in sorted(keys) if fa.get(k) != fb.get(k)]


def varied_fields(workloads: list[Workload]) -> list[str]:
    """The dotted paths whose values differ among WORKLOADS, in the workload's field order; labels (the workload's
    name), per-adapter settings and sources left out, as the content hash leaves them."""
    flat = [flatten(w.to_dict()) for w in workloads]
    paths = dict.fromkeys(k for f in flat for k in f if k.split(".")[0] not in ("name", "adapters", "sources"))
    return [k for k in paths if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1]


def _hash(data: dict[str, Any]) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
