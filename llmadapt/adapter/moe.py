"""Per-layer, per-expert token counts from a Hugging Face MoE model's routers (worker side).

Works with transformers 5.x (``*TopKRouter`` modules return the chosen expert indices) and
4.x (the ``gate`` linear of a ``*SparseMoeBlock`` returns router logits: top-k is taken here
with the block's own k), and with Jamba's blocks, whose router is a linear called ``router`` in 5.x (top-k of
its logits, as the block takes it of their softmax). Counts only during the forward pass proper (``counting`` is set by
the caller), so recomputation in the backward pass is not counted twice.

Near-ties: a token whose k-th and (k+1)-th router logits are closer than floating-point noise is routed
by the reduction order, not by the model: two stacks that compute the same logits in a different order
may send it to different experts, and both are right. Each layer also counts such tokens, so that
comparisons (llmadapt.analysis.expert_load_parity) are exact where the router's choice is clear and
allow at most that many moved tokens where it is not.
"""

from __future__ import annotations

NEAR_TIE_RTOL = 1e-4
"""fp32: a gap below 1e-4 x max(1, |top logit|), ~1000 x float32's epsilon and over 10 x the logit differences
seen between stacks in fp32 after ten steps. Lower precisions: 4 x their epsilon (bf16: 3.1e-2)."""


def near_tie_count(logits, k: int) -> int:
    """Tokens whose k-th and (k+1)-th largest router logits are within noise (see the module's docstring)."""
    import torch

    logits = logits.detach().reshape(-1, logits.shape[-1])
    if k >= logits.shape[-1] or logits.numel() == 0:
        return 0  # every expert chosen: no boundary to be on
    top = torch.topk(logits.float(), k + 1, dim=-1).values
    rtol = max(NEAR_TIE_RTOL, 4 * torch.finfo(logits.dtype).eps)
    margin = rtol * top[:, 0].abs().clamp(min=1.0)
    return int((top[:, k - 1] - top[:, k] <= margin).sum())


class ExpertLoadCounter:
    """Counts, per MoE layer, the tokens each expert is routed while ``counting`` is set (hooks on the model's
    routers), and the near-ties among them."""

    def __init__(self, model, num_experts: int) -> None:
        import torch

        self.num_experts = num_experts
        self.counting = False
        self.token_mask = None
        """Count only these tokens (a bool tensor over the batch's positions, batch-major, as routers see them):
        evaluation leaves padding out; training counts every position it computes."""
        self._layers = []
        for module in model.modules():
            name = type(module).__name__
            if name.endswith("TopKRouter"):
                self._layers.append(module)
                module.register_forward_hook(self._hook(len(self._layers) - 1, None))
            elif name.endswith("SparseMoeBlock"):
                router = next((r for r in (getattr(module, "gate", None), getattr(module, "router", None))
                               if isinstance(r, torch.nn.Linear)), None)
                if router is not None:
                    self._layers.append(router)
                    router.register_forward_hook(self._hook(len(self._layers) - 1, module.top_k))
        if not self._layers:
            raise RuntimeError("MoE model has no recognisable router modules to count expert load from")
        self.counts = torch.zeros(len(self._layers), num_experts, dtype=torch.long)
        self.ties = torch.zeros(len(self._layers), dtype=torch.long)
        self.top_k = None

    def _hook(self, layer: int, top_k: int | None):
        import torch

        def hook(module, args, output):
            if not self.counting:
                return
            if top_k is None:  # 5.x router: (logits, scores, indices)
                logits, indices = output[0], output[2]
                k = indices.shape[-1]
            else:  # 4.x gate: logits
                logits, k = output, top_k
                indices = torch.topk(output, top_k, dim=-1).indices
            if self.token_mask is not None:
                keep = self.token_mask.reshape(-1).to(indices.device)
                indices, logits = indices.reshape(-1, k)[keep], logits.reshape(-1, logits.shape[-1])[keep]
            self.counts[layer] += torch.bincount(indices.reshape(-1).cpu(), minlength=self.num_experts)
            self.ties[layer] += near_tie_count(logits, k)

        return hook

    def start_step(self) -> None:
        self.counts.zero_()
        self.ties.zero_()

    def global_counts(self) -> list[list[int]]:
        """This step's counts summed over all ranks (all_reduce when distributed)."""
        return self.global_counts_and_ties()[0]

    def global_counts_and_ties(self) -> tuple[list[list[int]], list[int]]:
        """This step's counts and near-ties per layer, summed over all ranks."""
        return all_reduce_counts(self.counts, self.ties)


def all_reduce_counts(counts, ties, divide: int = 1) -> tuple[list[list[int]], list[int]]:
    """Sum [layer][expert] counts and [layer] near-ties over every rank, in one collective.

    ``divide``: ranks that route the same tokens (tensor-parallel ranks) are counted once."""
    import torch
    import torch.distributed as dist

    both = torch.cat([counts, ties.reshape(-1, 1)], dim=1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":  # NCCL reduces only device tensors
            both = both.cuda()
        dist.all_reduce(both)
        both = both.cpu() // divide
    return both[:, :-1].tolist(), both[:, -1].tolist()
