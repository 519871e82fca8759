"""The configuration space ``tune`` searches: every configuration each adapter declares it can run (its
``Supports``), over the ranks available, at the workload's global batch; then what is pruned before any probe and
why (the workload's own rules, the adapter's capability check, a redundant setting, the memory model), and the
order the rest is probed in (the estimate's step time where the device is known).

A new adapter's options enter the space through its declaration alone: nothing here names an adapter.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs

from llmadapt.adapter.plugins import check_supported, get_adapter
from llmadapt.analysis.labels import layout_label
from llmadapt.errors import LlmadaptError, UnsupportedError, WorkloadError
from llmadapt.spec import Workload


@attrs.frozen
class Candidate:
    """One configuration of one adapter: the settings it adds to the workload, and the workload it runs."""

    adapter: str
    settings: tuple[str, ...]
    workload: Workload = attrs.field(eq=False, repr=False)
    label: str
    estimate_step_s: float | None = None
    """The estimate's step time (None without a device whose peaks are known)."""
    estimate_bytes: float | None = None
    """The estimate's peak memory per rank (None for a family the memory model does not cover)."""

    @property
    def key(self) -> str:
        """Stable across runs of tune (the state file names probes by it)."""
        return f"{self.adapter}:{','.join(self.settings)}"

    @property
    def cell(self) -> str:
        """As ``compare --cell`` takes it."""
        return self.key if self.settings else self.adapter


@attrs.frozen
class Pruned:
    adapter: str
    settings: tuple[str, ...]
    reason: str


@attrs.frozen
class Space:
    candidates: list[Candidate]
    """What may be probed, in the order to probe it."""
    pruned: list[Pruned]
    enumerated: int
    order: str
    """How ``candidates`` is ordered, in words."""

    def reasons(self) -> dict[str, int]:
        """How many configurations each kind of reason pruned (the reason's text before its first ':')."""
        out: dict[str, int] = {}
        for p in self.pruned:
            kind = p.reason.split(":")[0]
            out[kind] = out.get(kind, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


SEARCHED = ("parallelism.tp", "parallelism.pp", "parallelism.dp", "parallelism.ep", "optimizations.zero_stage",
            "optimizations.offload", "optimizations.recompute", "optimizations.flash_attention", "train.micro_batch")
"""The fields a configuration sets (``configurations``): what ``fixed`` may name."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(w: Workload, supports: Any, ranks: int) -> list[dict[str, int]]:
    """Every (tp, pp, dp, ep) over 1..``ranks`` ranks that the adapter declares, largest ranks last."""
    out = []
    for world in range(1, ranks + 1):
        for tp, pp in itertools.product(_divisors(world), repeat=2):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            if (tp > 1 and not supports.tp) or (pp > 1 and not supports.pp) or (dp > 1 and not supports.dp):
                continue
            eps = [1] + ([e for e in _divisors(dp) if e > 1] if supports.ep and w.model.is_moe else [])
            out += [{"tp": tp, "pp": pp, "dp": dp, "ep": ep} for ep in eps]
    return out


def configurations(w: Workload, adapter: str, ranks: int) -> list[tuple[str, ...]]:
    """The settings of every configuration the adapter's declaration allows (before any rule across fields)."""
    s = get_adapter(adapter).supports
    axes: list[list[list[str]]] = [
        [[f"parallelism.{k}={v}" for k, v in layout.items()] for layout in layouts(w, s, ranks)],
        [[f"optimizations.zero_stage={z}"] for z in s.zero_stages],
        [[f"optimizations.offload={o}"] for o in s.offload],
        [[f"optimizations.recompute={r}"] for r in s.recompute],
        [[f"optimizations.flash_attention={'true' if f else 'false'}"] for f in ([False, True] if s.flash_attention
                                                                                 else [False])],
    ]
    out = []
    for combination in itertools.product(*axes):
        settings = [x for part in combination for x in part]
        dp = int(settings[2].split("=")[1])
        if w.train.global_batch % dp:
            continue  # the rules below name it; every dp that splits the batch is still tried
        for mb in _divisors(w.train.global_batch // dp):
            out.append(tuple(settings + [f"train.micro_batch={mb}"]))
    return out


def _redundant(w: Workload) -> str | None:
    """Settings that equal a simpler configuration's run (probed once, under the simpler one)."""
    o, p = w.optimizations, w.parallelism
    if o.zero_stage and p.dp == 1:
        return "redundant: ZeRO shards over data-parallel ranks; with dp=1 it is stage 0's run"
    return None


def space(workload: Workload, adapters: list[str], *, ranks: int, max_memory_bytes: float | None = None,
          device: Any = None, fixed: tuple[str, ...] | list[str] = ()) -> Space:
    """Enumerate, prune and order. ``device``: a catalog DeviceSpec for the estimate (memory and step time);
    None: memory from the model alone (no runtime overhead), no step-time order. ``fixed``: field paths that keep
    the workload's value (not searched)."""
    from llmadapt.analysis.perf import estimate as model
    from llmadapt.spec.loading import flatten

    unknown = [f for f in fixed if f not in SEARCHED]
    if unknown:
        raise LlmadaptError(f"fixed {', '.join(unknown)}: not a searched field; searched: {', '.join(SEARCHED)}")

    if workload.kind == "serve":
        raise LlmadaptError("tune searches training and fine-tuning configurations; a serve workload's engine "
                            "parameters are searched by `llmadapt sla` per engine")
    factors = model.load_factors(device) if device is not None and device.peak(workload.precision) else None
    candidates: list[Candidate] = []
    pruned: list[Pruned] = []
    seen: set[tuple[str, str]] = set()
    enumerated = 0
    for adapter in adapters:
        base = workload.for_adapter(adapter)
        flat = flatten(base.to_dict())
        own = [s for s in configurations(base, adapter, ranks)
               if all(str(flat[p]).lower() == v.lower() for p, _, v in (x.partition("=") for x in s) if p in fixed)]
        if not own:
            raise LlmadaptError(f"adapter {adapter!r} has no configuration at global batch {workload.train.global_batch} "
                                f"on {ranks} rank(s)")
        for settings in own:
            enumerated += 1
            try:
                w = base.with_overrides(list(settings), source="tune")
            except WorkloadError as exc:
                pruned.append(Pruned(adapter, settings, f"workload rule: {exc}"))
                continue
            reason = _redundant(w)
            if reason is None:
                try:
                    check_supported(get_adapter(adapter), w)
                except UnsupportedError as exc:
                    reason = f"capability: {exc}"
            if reason is None and (adapter, w.content_hash) in seen:
                reason = "redundant: the same workload as another configuration"
            est_bytes = est_s = None
            if reason is None and w.model.family in ("llama", "mixtral"):
                spec = device if device is not None else _unbounded()
                est_bytes = model.memory(w, spec, w.micro_batch).total_bytes
                if max_memory_bytes is not None and est_bytes > max_memory_bytes:
                    reason = (f"memory: the estimate needs {est_bytes / 2**30:.2f} GiB per rank, over the limit of "
                              f"{max_memory_bytes / 2**30:.2f} GiB")
                elif factors is not None:
                    est_s = model.step_time(w, device, factors, w.micro_batch)[0]
            if reason:
                pruned.append(Pruned(adapter, settings, reason))
                continue
            seen.add((adapter, w.content_hash))
            candidates.append(Candidate(adapter, _given(settings, base), w, layout_label(adapter, w), est_s,
                                        est_bytes))
    if factors is not None:
        candidates.sort(key=lambda c: (c.estimate_step_s is None, c.estimate_step_s or 0.0))
        order = f"by the estimate's step time on {device.name}"
    else:
        candidates = _interleaved(sorted(candidates, key=_cost_guess))
        order = ("by a rule of thumb (defaults first, then extra work: recomputation, offload, ZeRO-3, smaller "
                 "micro-batches), stacks interleaved; give --device with measured peaks to order by the estimate")
    return Space(candidates, pruned, enumerated, order)


def _given(settings: tuple[str, ...], base: Workload) -> tuple[str, ...]:
    """The settings that differ from the workload's own values: a candidate is named by what it changes."""
    from llmadapt.spec.loading import flatten

    flat = flatten(base.to_dict())
    out = []
    for s in settings:
        path, _, value = s.partition("=")
        if str(flat.get(path)).lower() != value.lower():
            out.append(s)
    return tuple(out)


def _unbounded():
    from llmadapt.contract.catalog import DeviceSpec

    return DeviceSpec(name="this machine", kind="cpu", runtime_overhead_bytes=0.0)


def _cost_guess(c: Candidate) -> tuple:
    """A rule of thumb where no step-time model is at hand: what adds work comes later."""
    w = c.workload
    o = w.optimizations
    extra = (o.recompute != "none") + (o.offload != "none") + (o.zero_stage == 3)
    return (extra, w.world_size, -w.micro_batch, o.zero_stage)


def _interleaved(candidates: list[Candidate]) -> list[Candidate]:
    """One stack's next candidate after another's: a budget that ends early has probed every stack."""
    by: dict[str, list[Candidate]] = {}
    for c in candidates:
        by.setdefault(c.adapter, []).append(c)
    return [c for group in itertools.zip_longest(*by.values()) for c in group if c is not None]
