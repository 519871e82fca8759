"""Per-layer, per-expert token counts from a Hugging Face MoE model's routers (worker side).

Works with transformers 5.x (``*TopKRouter`` modules return the chosen expert indices) and
4.x (the ``gate`` linear of a ``*SparseMoeBlock`` returns router logits: top-k is taken here
with the block's own k). Counts only during the forward pass proper (``counting`` is set by
the caller), so recomputation in the backward pass is not counted twice.
"""

from __future__ import annotations


class ExpertLoadCounter:
    def __init__(self, model, num_experts: int) -> None:
        import torch

        self.num_experts = num_experts
        self.counting = False
        self._layers = []
        for module in model.modules():
            name = type(module).__name__
            if name.endswith("TopKRouter"):
                self._layers.append(module)
                module.register_forward_hook(self._hook(len(self._layers) - 1, None))
            elif name.endswith("SparseMoeBlock") and isinstance(getattr(module, "gate", None), torch.nn.Linear):
                self._layers.append(module.gate)
                module.gate.register_forward_hook(self._hook(len(self._layers) - 1, module.top_k))
        if not self._layers:
            raise RuntimeError("MoE model has no recognisable router modules to count expert load from")
        self.counts = torch.zeros(len(self._layers), num_experts, dtype=torch.long)

    def _hook(self, layer: int, top_k: int | None):
        import torch

        def hook(module, args, output):
            if not self.counting:
                return
            if top_k is None:  # 5.x router: (logits, scores, indices)
                indices = output[2]
            else:  # 4.x gate: logits
                indices = torch.topk(output, top_k, dim=-1).indices
            self.counts[layer] += torch.bincount(indices.reshape(-1).cpu(), minlength=self.num_experts)

        return hook

    def start_step(self) -> None:
        self.counts.zero_()

    def global_counts(self) -> list[list[int]]:
        """This step's counts summed over all ranks (all_reduce when distributed)."""
        import torch.distributed as dist

        counts = self.counts.clone()
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":  # NCCL reduces only device tensors
                counts = counts.cuda()
            dist.all_reduce(counts)
        return counts.cpu().tolist()
