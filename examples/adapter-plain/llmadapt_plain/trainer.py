"""The ``plain`` adapter's worker classes: a hand-written fp32 training loop on one rank.

Imported only inside the adapter's environment, in the worker process, so torch is fine here.
"""

from __future__ import annotations

from llmadapt.adapter import FineTuner, Phase, StepResult, Trainer

PHASES = ("forward", "backward", "optimizer")


class PlainTrainer(Trainer):
    def framework_version(self) -> str:
        import torch

        return torch.__version__

    def setup(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        ctx, train = self.ctx, self.ctx.workload.train
        model = AutoModelForCausalLM.from_pretrained(str(ctx.checkpoint), dtype=torch.float32,
                                                     attn_implementation="eager")
        model.config.use_cache = False
        self.model = model.to(ctx.device)
        optimizer = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[train.optimizer]
        self.optimizer = optimizer(self.model.parameters(), lr=train.lr, weight_decay=train.weight_decay)

    def step(self, batch) -> StepResult:
        import torch.nn.functional as F

        ctx = self.ctx
        timings: list[Phase] = []  # ctx.phase adds each micro-batch's time to its phase; relabelled below
        loss_sum = 0.0
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for mb in batch.micro_batches:
            input_ids, labels = mb.input_ids.to(ctx.device), mb.labels.to(ctx.device)
            with ctx.phase("forward", timings):
                logits = self.model(input_ids=input_ids).logits
                # The contract's loss: sum of token cross-entropies / loss-bearing tokens of the global batch.
                token_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
            with ctx.phase("backward", timings):
                (token_loss / batch.loss_tokens_global).backward()
            loss_sum += token_loss.item()
        with ctx.phase("optimizer", timings):
            self.optimizer.step()
        phases = [Phase(name, sum(t.seconds for t in timings if t.name == name), "plain") for name in PHASES]
        return StepResult(loss=loss_sum / batch.loss_tokens_global, phases=phases)


class PlainFineTuner(PlainTrainer, FineTuner):
    role = "finetune"
