"""The model section: its shape (``ModelSpec``), the presets, and the recipe and folder key of the canonical
checkpoint."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import attrs

from llmadapt.errors import WorkloadError
from llmadapt.modelfolder import MAMBA_D_CONV, MAMBA_D_STATE, MAMBA_EXPAND  # noqa: F401 (the spec's names)
from llmadapt.spec.fields import at_least, choice

FAMILIES = ("llama", "mixtral", "jamba")
JAMBA_LAYOUT = ("attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset")
"""Jamba's layer pattern (transformers' JambaConfig names): None for the other families, and then left out of every
hash, so the llama and mixtral workloads and checkpoints keep the hashes they had."""


@attrs.frozen
class ModelSpec:
    """Model shape. Decoder-only Llama-style (RMSNorm, rotary, SwiGLU, GQA); MoE when num_experts > 0.

    Family 'jamba' (AI21's Jamba, transformers' JambaForCausalLM): a hybrid whose layers are attention (no rotary)
    once every ``attn_layer_period`` layers from ``attn_layer_offset`` and Mamba mixers otherwise, each followed by
    an MoE block once every ``expert_layer_period`` layers from ``expert_layer_offset`` and by a dense SwiGLU MLP
    otherwise."""

    name: str = "custom"
    """Preset name or 'custom'; a label only (not part of the workload hash)."""
    family: str = attrs.field(default="llama", validator=choice(FAMILIES))
    vocab_size: int = attrs.field(default=512, validator=at_least(2))
    hidden_size: int = attrs.field(default=64, validator=at_least(1))
    intermediate_size: int = attrs.field(default=176, validator=at_least(1))
    num_layers: int = attrs.field(default=2, validator=at_least(1))
    num_heads: int = attrs.field(default=4, validator=at_least(1))
    num_kv_heads: int = attrs.field(default=2, validator=at_least(1))
    max_position_embeddings: int = attrs.field(default=256, validator=at_least(1))
    rope_theta: float = attrs.field(default=10000.0, validator=at_least(1.0))
    norm_eps: float = 1e-5
    num_experts: int = attrs.field(default=0, validator=at_least(0))
    """0 for a dense model; otherwise experts per MoE layer (every layer is MoE)."""
    experts_per_token: int = attrs.field(default=2, validator=at_least(1))
    """Top-k routing: experts each token is sent to (MoE only)."""
    attn_layer_period: int | None = attrs.field(default=None, validator=at_least(1))
    """jamba only: an attention layer once in this many (Jamba-v0.1: 8); the others are Mamba layers."""
    attn_layer_offset: int | None = attrs.field(default=None, validator=at_least(0))
    """jamba only: the first attention layer's index (Jamba-v0.1: 4)."""
    expert_layer_period: int | None = attrs.field(default=None, validator=at_least(1))
    """jamba only: an MoE block once in this many layers (Jamba-v0.1: 2); the others have a dense MLP."""
    expert_layer_offset: int | None = attrs.field(default=None, validator=at_least(0))
    """jamba only: the first MoE layer's index (Jamba-v0.1: 1)."""
    tie_embeddings: bool = False
    path: str | None = None
    """A local Hugging Face model folder (config.json, safetensors, tokenizer.json): its weights and tokenizer
    instead of a preset's random ones; the shape fields then come from its config.json. Not part of either hash
    (the same folder elsewhere is the same model): its content is, as ``checksum``."""
    checksum: str | None = None
    """Content hash of the folder at ``path`` (config, weights index, shard hashes, tokenizer), recorded by
    llmadapt when the workload is built and checked again before launch; not set by hand."""

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise WorkloadError("hidden_size", self.hidden_size, f"must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise WorkloadError("num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        layout = {name: getattr(self, name) for name in JAMBA_LAYOUT}
        if self.family == "jamba":
            missing = next((name for name, value in layout.items() if value is None), None)
            if missing:
                raise WorkloadError(missing, None, "family 'jamba' needs its layer layout (preset 'jamba-v0.1' has "
                                                   "the released one)")
            for kind in ("attn", "expert"):
                period, offset = layout[f"{kind}_layer_period"], layout[f"{kind}_layer_offset"]
                if offset >= period:
                    raise WorkloadError(f"{kind}_layer_offset", offset, f"must be < {kind}_layer_period={period}")
            if self.num_experts < 2:
                raise WorkloadError("num_experts", self.num_experts, "family 'jamba' needs num_experts >= 2 (its "
                                                                     "MoE layers)")
        elif any(value is not None for value in layout.values()):
            name = next(name for name, value in layout.items() if value is not None)
            raise WorkloadError(name, layout[name], f"only for family 'jamba' (this model is {self.family!r})")
        if self.family == "mixtral" and self.num_experts < 1:
            raise WorkloadError("num_experts", self.num_experts, "family 'mixtral' needs num_experts >= 1")
        if self.family == "llama" and self.num_experts:
            raise WorkloadError("num_experts", self.num_experts, "family 'llama' is dense: use 0 or family 'mixtral'")
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise WorkloadError(
                "experts_per_token", self.experts_per_token, f"must be <= num_experts={self.num_experts}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def layer_kinds(self) -> list[tuple[str, bool]]:
        """(mixer, MoE?) of every layer: mixer 'attention' or 'mamba' (jamba), MoE true where the layer's MLP is
        an MoE block (every layer of a mixtral, the pattern's layers of a jamba)."""
        if self.family != "jamba":
            return [("attention", self.is_moe)] * self.num_layers
        return [("attention" if n % self.attn_layer_period == self.attn_layer_offset else "mamba",
                 n % self.expert_layer_period == self.expert_layer_offset) for n in range(self.num_layers)]

    @property
    def mamba_inner(self) -> int:
        """jamba: the Mamba mixer's inner width (expand x hidden_size)."""
        return MAMBA_EXPAND * self.hidden_size

    @property
    def mamba_dt_rank(self) -> int:
        """jamba: the rank of the time-step projection (JambaConfig's 'auto': ceil(hidden_size / 16))."""
        return math.ceil(self.hidden_size / 16)


def drop_unset_layout(model: dict[str, Any]) -> dict[str, Any]:
    """A model's dict less the jamba layout fields a family without them leaves unset: hashes stay what they were
    before jamba came (JAMBA_LAYOUT)."""
    for name in JAMBA_LAYOUT:
        if model.get(name, 0) is None:
            model.pop(name)
    return model


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Real shapes, from the published configs.
    "llama2-7b": dict(family="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=32, num_heads=32, num_kv_heads=32, max_position_embeddings=4096),
    "llama2-13b": dict(family="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                       num_layers=40, num_heads=40, num_kv_heads=40, max_position_embeddings=4096),
    "llama2-70b": dict(family="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                       num_layers=80, num_heads=64, num_kv_heads=8, max_position_embeddings=4096),
    "mixtral-8x7b": dict(family="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, max_position_embeddings=32768,
                         rope_theta=1e6, num_experts=8, experts_per_token=2),
    # ai21labs/Jamba-v0.1's config (transformers' JambaConfig defaults): 52B parameters, 12B active.
    "jamba-v0.1": dict(family="jamba", vocab_size=65536, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, max_position_embeddings=262144, norm_eps=1e-6,
                       num_experts=16, experts_per_token=2, attn_layer_period=8, attn_layer_offset=4,
                       expert_layer_period=2, expert_layer_offset=1),
    # Tiny shapes for CPU: same architecture, GQA included, seconds per run.
    "tiny-llama": dict(family="llama", vocab_size=512, hidden_size=64, intermediate_size=176,
                       num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256),
    "tiny-mixtral": dict(family="mixtral", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                         rope_theta=1e6, num_experts=4, experts_per_token=2),
    # Jamba's pattern in four layers: mamba+MLP, mamba+MoE, attention+MLP, mamba+MoE.
    "tiny-jamba": dict(family="jamba", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_layers=4, num_heads=4, num_kv_heads=2, max_position_embeddings=256, norm_eps=1e-6,
                       num_experts=4, experts_per_token=2, attn_layer_period=4, attn_layer_offset=2,
                       expert_layer_period=2, expert_layer_offset=1),
}


CHECKPOINT_RECIPE = 2
"""How llmadapt builds a preset's canonical checkpoint (llmadapt.models); bump whenever the weights it writes for a
preset and seed change (2: written streaming, in shards). A preset problem's identity includes it: the same preset
and seed with other weights is another problem (tests/test_docs.py fails when a documented loss stops reproducing)."""


def checkpoint_key(model: ModelSpec, seed: int) -> str:
    """The canonical checkpoint's folder name under the state folder's ``checkpoints``: a hash of what builds it (the
    model's shapes, the seed, the recipe), so equal models share one checkpoint."""
    data = attrs.asdict(model)
    for key in ("name", "path", "checksum"):
        data.pop(key)
    drop_unset_layout(data)
    text = json.dumps({"model": data, "seed": seed, "recipe": CHECKPOINT_RECIPE}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]
