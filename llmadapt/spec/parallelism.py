"""How a workload is laid out and which memory and speed techniques it uses: the parallelism and optimizations
sections. All but base-weight quantization change how a workload runs, not the numbers it computes (in exact
arithmetic)."""

from __future__ import annotations

import attrs

from llmadapt.spec.fields import at_least, choice

OFFLOADS = ("none", "optimizer", "optimizer+params")
RECOMPUTES = ("none", "selective", "full")
QUANTIZATIONS = ("none", "int8", "nf4", "fp4")


@attrs.frozen
class Parallelism:
    """Degrees of parallelism; world size = dp * tp * pp (expert parallelism is carved out of dp * tp)."""

    dp: int = attrs.field(default=1, validator=at_least(1))
    tp: int = attrs.field(default=1, validator=at_least(1))
    pp: int = attrs.field(default=1, validator=at_least(1))
    ep: int = attrs.field(default=1, validator=at_least(1))
    p2p: bool = True
    """Peer-to-peer between GPUs (NVLink, or PCIe P2P); false sets NCCL_P2P_DISABLE=1 for the ranks, so collectives
    go through host memory (study A's NVLink against PCIe). Needs NCCL: refused where no GPU is visible."""
    threads_per_rank: int = attrs.field(default=0, validator=at_least(0))
    """CPU threads of each rank (torch's intra-op pool, OpenMP, MKL). 0: the launcher's choice, OMP_NUM_THREADS
    where exported, else the node's cores shared among its ranks. A comparison whose cells would get different
    counts gives them all the fewest (llmadapt.experiments.compare): on a CPU, threads per rank decide the step time
    as much as the layout does."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@attrs.frozen
class Optimizations:
    """Memory and speed techniques (study A's R, F, Z2, Z3, Z2O, Z3O, Q)."""

    zero_stage: int = attrs.field(default=0, validator=choice((0, 1, 2, 3)))
    offload: str = attrs.field(default="none", validator=choice(OFFLOADS))
    recompute: str = attrs.field(default="none", validator=choice(RECOMPUTES))
    flash_attention: bool = False
    quantization: str = attrs.field(default="none", validator=choice(QUANTIZATIONS))
    """Base-weight quantization (bitsandbytes); needs LoRA (QLoRA) since quantized weights do not train."""
