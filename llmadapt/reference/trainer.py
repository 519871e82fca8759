"""The reference Trainer/FineTuner: transformers' model, a hand-written step, DDP for data parallel.

Deliberately plain: the loss every other stack must match is computed here in the most
obvious way (sum of token cross-entropies / loss-bearing tokens of the global batch).
"""

from __future__ import annotations

from contextlib import nullcontext

from llmadapt.adapter import FineTuner, Phase, Span, StepResult, Trainer, quantization
from llmadapt.adapter.kernels import slow_paths
from llmadapt.adapter.moe import ExpertLoadCounter


class TorchTrainer(Trainer):
    """Pre-training; the fine-tuner below differs only by what the workload asks (LoRA/QLoRA, data)."""

    def framework_version(self) -> str:
        import torch

        return torch.__version__

    def setup(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        w, ctx = self.ctx.workload, self.ctx
        self.dtype = dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[w.precision]
        kwargs = {"dtype": dtype, "attn_implementation": "sdpa" if w.optimizations.flash_attention else "eager"}
        quant = w.optimizations.quantization
        if quant != "none":
            kwargs["quantization_config"] = quantization.bnb_config(quant, dtype)
            kwargs["device_map"] = {"": ctx.device}
        model = AutoModelForCausalLM.from_pretrained(str(ctx.checkpoint), **kwargs)
        self.model_loaded()
        self.notes += slow_paths(model)
        if quant == "none":
            model.to(ctx.device)
        model.config.use_cache = False
        if w.optimizations.recompute == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if w.lora.rank:
            from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

            if quant != "none":
                model = prepare_model_for_kbit_training(
                    model, use_gradient_checkpointing=w.optimizations.recompute == "full"
                )
            torch.manual_seed(w.seed)  # LoRA's A matrices start random: the same start on every stack
            model = get_peft_model(model, LoraConfig(
                r=w.lora.rank, lora_alpha=w.lora.alpha, lora_dropout=w.lora.dropout,
                target_modules=list(w.lora.target_modules), task_type="CAUSAL_LM",
            ))
            if quant != "none":  # the experts bitsandbytes left, quantized and checked before step 0
                self.weights = quantization.quantize_and_check(model, quant, dtype)
        self.experts = ExpertLoadCounter(model, w.model.num_experts) if w.model.is_moe else None
        self.ddp = ctx.world_size > 1
        if self.ddp:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)
        # Train mode once: nothing in a run switches it off (evaluation loads the saved model apart),
        # and train() walks every module: a cost in every step, not in a bare loop.
        model.train()
        self.model = model
        self.params = params = [p for p in model.parameters() if p.requires_grad]
        opt = w.train.optimizer
        if opt == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=w.train.lr, weight_decay=w.train.weight_decay)
        else:
            cls = torch.optim.AdamW if opt == "adamw" else torch.optim.Adam
            self.optimizer = cls(params, lr=w.train.lr, weight_decay=w.train.weight_decay)
        self._flash = w.optimizations.flash_attention

    def save_pretrained(self, folder, adapter_only: bool = False) -> None:
        from llmadapt.adapter.weights import save_hf_model

        save_hf_model(self.model.module if self.ddp else self.model, folder, write=self.ctx.rank == 0,
                      adapter_only=adapter_only)

    def _attention_backend(self):
        if not self._flash:
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # FlashAttention kernel (CUDA) or its CPU counterpart

    def step(self, batch) -> StepResult:
        import torch
        import torch.nn.functional as F

        ctx, model = self.ctx, self.model
        self.optimizer.zero_grad(set_to_none=True)
        scale = ctx.world_size / batch.loss_tokens_global  # DDP averages over ranks: undo that
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        phases: list[Phase] = []
        spans: list[Span] = []
        last = len(batch.micro_batches) - 1
        if self.experts:
            self.experts.start_step()
        for i, mb in enumerate(batch.micro_batches):
            sync = model.no_sync() if self.ddp and i < last else nullcontext()
            labels = mb.labels.to(ctx.device)
            with sync, self._attention_backend():
                with ctx.phase("forward", phases, spans=spans, span=f"forward {i}"):
                    if self.experts:
                        self.experts.counting = True
                    logits = model(**mb.model_inputs(ctx.device, self.dtype)).logits
                    if self.experts:
                        self.experts.counting = False
                    token_loss = F.cross_entropy(
                        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                        reduction="sum",
                    )
                with ctx.phase("backward", phases, spans=spans, span=f"backward {i}"):
                    (token_loss * scale).backward()
            loss_sum += token_loss.detach().double()
        with ctx.phase("optimizer", phases, spans=spans):
            # DDP averaged the gradients over the ranks already: every rank's norm is the global one
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
            self.optimizer.step()
        if self.ddp:
            import torch.distributed as dist

            dist.all_reduce(loss_sum)
        expert_load, ties = self.experts.global_counts_and_ties() if self.experts else (None, None)
        return StepResult(loss=loss_sum.item() / batch.loss_tokens_global, phases=phases, expert_load=expert_load,
                          expert_near_ties=ties, spans=spans, grad_norm=grad_norm.item())


class TorchFineTuner(TorchTrainer, FineTuner):
    role = "finetune"
