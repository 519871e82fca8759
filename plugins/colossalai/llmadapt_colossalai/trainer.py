"""The ``colossalai`` adapter's worker classes: transformers' model driven by a ColossalAI Booster.

Imported only inside the adapter's environment (ColossalAI 0.5.0, transformers 4.51.3), in the
worker process.

The loss is the contract's: the sum of token cross-entropies over the global batch divided by
``batch.loss_tokens_global``. Every ColossalAI plugin averages gradients over its data-parallel
group (DDP, LowLevelZero's ``flat_grads /= world_size``, FSDP, the hybrid plugins'
``sync_dp_grads``), and the 1F1B schedule divides each micro-batch's criterion by the number of
micro-batches; the loss handed to ColossalAI is scaled by ``dp`` (and the micro-batch count
under pp) over ``loss_tokens_global`` so that the gradients equal the reference's.
"""

from __future__ import annotations

from contextlib import nullcontext

from llmadapt.adapter import FineTuner, Phase, Span, StepResult, Trainer

from . import cpu_patches
from .plugin import booster_plugin

LABELS = "llmadapt_labels"  # labels ride in the pipeline's batch dict under a key the model ignores


class ColossalAITrainer(Trainer):
    """Pre-training; the fine-tuner differs only by what the workload asks (LoRA, instruction data)."""

    def framework_version(self) -> str:
        import colossalai

        return colossalai.__version__

    def data_rank(self) -> tuple[int, int]:
        return self._dp_rank, self._dp_size

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        import torch
        import torch.distributed as dist

        ctx, w = self.ctx, self.ctx.workload
        try:
            import colossalai  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                "colossalai is not installed in this environment: build it with `llmadapt env create colossalai` "
                "(its recipe adds `pip install --no-deps colossalai==0.5.0 galore_torch==1.0`)") from exc
        self.plugin_name = booster_plugin(w)
        # what the model computes in: every plugin casts to bf16 for precision=bf16 (TorchDDP loads bf16 weights)
        self._compute_dtype = torch.bfloat16 if w.precision == "bf16" else torch.float32
        p = w.parallelism
        self.pipeline = self.plugin_name in ("HybridParallelPlugin", "MoeHybridParallelPlugin") and p.pp > 1
        self._own_group = False
        if not dist.is_initialized():  # one process: ColossalAI's plugins still need a default group
            dist.init_process_group("nccl" if ctx.is_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        if not ctx.is_cuda:
            self._patch_for_cpu()

        from colossalai.booster import Booster

        # Tensor or pipeline parallelism: the model is built lazily (ColossalAI's LazyInitContext records the
        # construction, no weights) and materialised already sliced by boost; then each rank loads its slices
        # from the checkpoint's shards (booster.load_model), never the whole model.
        lazy = self.plugin_name in ("HybridParallelPlugin", "MoeHybridParallelPlugin") and not w.lora.rank
        model = self._lazy_model() if lazy else self._load_model()
        if w.lora.rank:
            from peft import LoraConfig

            # LoRA's A matrices are random: draw them from the workload's seed, so every layout starts alike.
            torch.manual_seed(w.seed)
            self.booster = Booster(plugin=self._make_plugin(model))
            model = self.booster.enable_lora(model, lora_config=LoraConfig(
                r=w.lora.rank, lora_alpha=w.lora.alpha, lora_dropout=w.lora.dropout,
                target_modules=list(w.lora.target_modules), task_type="CAUSAL_LM"))
        else:
            self.booster = Booster(plugin=self._make_plugin(model))
        optimizer = self._make_optimizer([q for q in model.parameters() if q.requires_grad])
        self.model, self.optimizer, *_ = self.booster.boost(model, optimizer)
        if lazy:
            self._load_slices()
            self.model_loaded()  # lazily built: boost (the slicing and the optimizer's wrapping) came first
        plugin = self.booster.plugin

        if self.plugin_name in ("HybridParallelPlugin", "MoeHybridParallelPlugin"):
            self.dp_group = plugin.dp_group
            self._dp_size = dist.get_world_size(plugin.dp_group)
            self._dp_rank = dist.get_rank(plugin.dp_group)
            self.tp_rank = dist.get_rank(plugin.tp_group)
            self.last_stage = plugin.stage_manager is None or plugin.stage_manager.is_last_stage()
        else:
            self.dp_group = None  # the whole world
            self._dp_size, self._dp_rank = dist.get_world_size(), dist.get_rank()
            self.tp_rank, self.last_stage = 0, True
        if self._dp_size != p.dp:
            raise RuntimeError(f"{self.plugin_name} made {self._dp_size} data-parallel ranks; the workload asks {p.dp}")
        # Skip the gradient reduction on all but the last micro-batch where the plugin can (ZeRO-2 cannot:
        # ColossalAI asserts "ZeRO2(partition_grads) and no_sync are not compatible").
        self.skip_sync = plugin.support_no_sync() and w.optimizations.zero_stage != 2
        self.experts = None
        if w.model.is_moe:
            from llmadapt.adapter.moe import ExpertLoadCounter

            # After boosting: shardformer swaps the MoE blocks (EPMixtralSparseMoeBlock keeps the HF gate).
            self.experts = ExpertLoadCounter(self.model, w.model.num_experts)
        self.vocab = w.model.vocab_size
        # Train mode once: nothing in a run switches it off (evaluation loads the saved model apart),
        # and train() walks every module: a cost in every step, not in a bare loop.
        self.model.train()

    def _load_slices(self) -> None:
        """Each rank's slices from the checkpoint's shards (ColossalAI's checkpoint IO cuts whole tensors for the
        tensor-parallel layers). A checkpoint with tied embeddings holds the matrix once, as
        model.embed_tokens.weight (transformers writes no lm_head.weight): with pp > 1 the last stage holds lm_head
        without the embedding, so load_model leaves it as built (random, a loss of ln(vocab)). That stage's lm_head
        is given the embedding through the same loader; ColossalAI keeps the two copies equal from there by
        all-reducing their gradients between the stages (HybridParallelModule.sync_shared_params)."""
        from colossalai.checkpoint_io.utils import load_state_dict_into_model

        from llmadapt.adapter.weights import INDEX, WEIGHTS, CheckpointWeights

        ctx, w = self.ctx, self.ctx.workload
        index = ctx.checkpoint / INDEX
        self.booster.load_model(self.model, str(index if index.is_file() else ctx.checkpoint / WEIGHTS))
        stages = self.booster.plugin.stage_manager
        weights = CheckpointWeights(ctx.checkpoint)
        if w.model.tie_embeddings and stages is not None and stages.is_last_stage() and "lm_head.weight" not in weights:
            load_state_dict_into_model(self.model.unwrap(), {"lm_head.weight": weights["model.embed_tokens.weight"]},
                                       missing_keys=[])
            self.model.update_master_params()  # a ZeRO optimizer's master copy follows the weights it was given

    def _patch_for_cpu(self) -> None:
        w = self.ctx.workload
        p, zero = w.parallelism, w.optimizations.zero_stage
        if self.plugin_name != "TorchFSDPPlugin" and zero > 0:  # LowLevelZeroOptimizer or its hybrid subclasses
            self.patches.append(cpu_patches.zero_sanity_check())
            self.patches.append(cpu_patches.accelerator_streams())
        if p.tp > 1:  # shardformer's tensor-parallel layers save and restore the RNG state while built
            self.patches.append(cpu_patches.accelerator_rng())
        if p.pp > 1:
            self.patches.append(cpu_patches.hccl_stub())
        if self.plugin_name == "TorchFSDPPlugin":
            self.patches.append(cpu_patches.fsdp_device())

    def _load_model(self):
        import torch
        from transformers import AutoModelForCausalLM

        ctx, w = self.ctx, self.ctx.workload
        # TorchDDPPlugin does not handle precision: bf16 there means bf16 weights, as in the reference.
        # The other plugins cast to bf16 themselves and keep fp32 master weights (or FSDP's mixed precision).
        bf16_weights = w.precision == "bf16" and self.plugin_name == "TorchDDPPlugin"
        # transformers 4.51 reads rope_theta at the top level only; a folder transformers 5 wrote has it under
        # rope_parameters alone: give it the value the workload read from the folder.
        model = AutoModelForCausalLM.from_pretrained(
            str(ctx.checkpoint), torch_dtype=torch.bfloat16 if bf16_weights else torch.float32,
            attn_implementation="eager", rope_theta=w.model.rope_theta)
        self.model_loaded()
        model.config.use_cache = False
        # transformers 4.x ignores 5.x's rope_parameters: make sure it read the canonical rope_theta.
        theta = getattr(model.config, "rope_theta", None)
        if theta is not None and abs(float(theta) - float(w.model.rope_theta)) > 1e-6 * float(w.model.rope_theta):
            raise RuntimeError(f"transformers {__import__('transformers').__version__} read rope_theta={theta} from the "
                               f"canonical checkpoint, the workload says {w.model.rope_theta}")
        if w.optimizations.recompute == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def _lazy_model(self):
        import torch
        from colossalai.lazy import LazyInitContext
        from transformers import AutoConfig, AutoModelForCausalLM

        w = self.ctx.workload
        config = AutoConfig.from_pretrained(str(self.ctx.checkpoint), rope_theta=w.model.rope_theta)
        with LazyInitContext():
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, attn_implementation="eager")
        model.config.use_cache = False
        return model

    def _make_plugin(self, model):
        import torch

        w = self.ctx.workload
        p, o = w.parallelism, w.optimizations
        name = self.plugin_name
        if name == "TorchDDPPlugin":
            from colossalai.booster.plugin import TorchDDPPlugin

            return TorchDDPPlugin()
        if name == "LowLevelZeroPlugin":
            from colossalai.booster.plugin import LowLevelZeroPlugin

            return LowLevelZeroPlugin(stage=o.zero_stage, precision=w.precision, max_norm=0.0,
                                      overlap_communication=False, cpu_offload=o.offload == "optimizer")
        if name == "TorchFSDPPlugin":
            from colossalai.booster.plugin import TorchFSDPPlugin
            from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            mixed = None
            if w.precision == "bf16":
                mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16)
            layer = type(model.model.layers[0])  # one FSDP unit per decoder layer, plus the root
            return TorchFSDPPlugin(sharding_strategy=ShardingStrategy.FULL_SHARD,
                                   auto_wrap_policy=ModuleWrapPolicy({layer}), mixed_precision=mixed)
        # max_norm inf: the optimizer reduces the gradient norm over its tp/pp/dp groups (what it would clip by)
        # and clips nothing. (LowLevelZero computes it whatever max_norm is.)
        common = dict(tp_size=p.tp, pp_size=p.pp, precision=w.precision, zero_stage=o.zero_stage, max_norm=float("inf"),
                      parallel_output=False,  # full logits: the adapter computes the contract's loss itself
                      make_vocab_size_divisible_by=1,  # no vocabulary padding (it would change the softmax)
                      overlap_communication=False)
        if p.pp > 1:
            common["num_microbatches"] = w.per_rank_batch // w.micro_batch
        if name == "HybridParallelPlugin":
            from colossalai.booster.plugin import HybridParallelPlugin

            return HybridParallelPlugin(**common)
        from colossalai.booster.plugin import MoeHybridParallelPlugin

        return MoeHybridParallelPlugin(ep_size=p.ep, **common)

    def _make_optimizer(self, params):
        import torch

        t = self.ctx.workload.train
        if t.optimizer == "sgd":
            return torch.optim.SGD(params, lr=t.lr, weight_decay=t.weight_decay)
        if t.optimizer == "adamw" and self.plugin_name == "TorchFSDPPlugin":
            # TorchFSDPPlugin re-creates the optimizer as cls(fsdp_params, **optimizer.defaults), and torch
            # 2.13's AdamW.__init__ refuses its own 'decoupled_weight_decay' default. Adam with
            # decoupled_weight_decay=True is what AdamW is in torch 2.13 (AdamW subclasses it so).
            return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay, decoupled_weight_decay=True)
        cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=t.lr, weight_decay=t.weight_decay)

    # -- one step -------------------------------------------------------------------------------
    def _token_loss(self, logits, labels):
        import torch.nn.functional as F

        logits = logits[..., : self.vocab].float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                               reduction="sum")

    def profiled_calls(self):
        # The plugin's optimizer wrapper (ZeRO's, HybridParallel's) is no torch.optim.Optimizer the core knows;
        # the booster's backward adds the plugin's gradient reduction to autograd's.
        return [*super().profiled_calls(), (self.optimizer, "step", "optimizer"), (self.optimizer, "zero_grad", "optimizer"),
                (self.booster, "backward", "gradient")]

    def step(self, batch) -> StepResult:
        import torch
        import torch.distributed as dist

        ctx = self.ctx
        self.optimizer.zero_grad()
        if self.experts:
            self.experts.start_step()
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        spans: list[Span] = []
        if self.pipeline:
            phases = self._pipeline_step(batch, loss_sum, spans)
        else:
            phases = self._plain_step(batch, loss_sum, spans)
        with ctx.phase("optimizer", phases, spans=spans):
            grad_norm = self._torch_grad_norm()
            self.optimizer.step()
        if grad_norm is None:
            grad_norm = self.optimizer.get_grad_norm()  # the ZeRO and hybrid optimizers' own, over their groups
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self.pipeline:  # only the last stage has the loss; count each data-parallel rank once
                if not (self.last_stage and self.tp_rank == 0):
                    loss_sum.zero_()
                dist.all_reduce(loss_sum)
            elif self._dp_size > 1:  # tensor-parallel ranks hold the same loss: sum over data parallel only
                dist.all_reduce(loss_sum, group=self.dp_group)
        expert_load, ties = self.experts.global_counts_and_ties() if self.experts else (None, None)
        return StepResult(loss=loss_sum.item() / batch.loss_tokens_global, phases=phases, expert_load=expert_load,
                          expert_near_ties=ties, spans=spans,
                          grad_norm=None if grad_norm is None else float(grad_norm))

    def _torch_grad_norm(self):
        """The gradient norm where the plugin leaves the optimizer to torch: DDP's gradients are averaged over the
        ranks already; FSDP's root reduces its shards' norms (a max_norm of inf clips nothing)."""
        import torch

        if self.plugin_name == "TorchDDPPlugin":
            return torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        if self.plugin_name == "TorchFSDPPlugin":
            from torch.distributed.fsdp import FullyShardedDataParallel

            root = next(m for m in self.model.modules() if isinstance(m, FullyShardedDataParallel))
            return root.clip_grad_norm_(float("inf"))
        return None

    def _plain_step(self, batch, loss_sum, spans) -> list[Phase]:
        ctx = self.ctx
        scale = self._dp_size / batch.loss_tokens_global
        phases: list[Phase] = []
        last = len(batch.micro_batches) - 1
        for i, mb in enumerate(batch.micro_batches):
            sync = self.booster.no_sync(self.model, self.optimizer) if self.skip_sync and i < last else nullcontext()
            labels = mb.labels.to(ctx.device)
            with sync:
                with ctx.phase("forward", phases, spans=spans, span=f"forward {i}"):
                    if self.experts:
                        self.experts.counting = True
                    logits = self.model(**mb.model_inputs(ctx.device, self._compute_dtype)).logits
                    if self.experts:
                        self.experts.counting = False
                    token_loss = self._token_loss(logits, labels)
                with ctx.phase("backward", phases, spans=spans, span=f"backward {i}"):
                    self.booster.backward(token_loss * scale, self.optimizer)
            loss_sum += token_loss.detach().double()
        return phases

    def _pipeline_step(self, batch, loss_sum, spans) -> list[Phase]:
        import torch

        ctx = self.ctx
        micro = len(batch.micro_batches)
        scale = micro * self._dp_size / batch.loss_tokens_global  # the schedule divides by the micro-batch count
        # The schedule cuts every tensor of the dict into micro-batches along dim 0 and hands each stage its piece:
        # packed rows' 4D mask and position ids reach every stage's decoder layers.
        inputs = [mb.model_inputs(ctx.device, self._compute_dtype) for mb in batch.micro_batches]
        data = {key: torch.cat([x[key] for x in inputs]) for key in inputs[0]}
        data[LABELS] = torch.cat([mb.labels for mb in batch.micro_batches]).to(ctx.device)
        sums = []

        def criterion(outputs, micro_batch):
            token_loss = self._token_loss(outputs.logits, micro_batch[LABELS])
            sums.append(token_loss.detach().double())
            return token_loss * scale

        phases: list[Phase] = []
        with ctx.phase("forward_backward", phases, spans=spans, span="pipeline forward+backward (1F1B)"):
            self.booster.execute_pipeline(iter([data]), self.model, criterion, self.optimizer, return_loss=False)
        for s in sums:
            loss_sum += s
        return phases

    def save_pretrained(self, folder, adapter_only: bool = False) -> None:  # no LoRA save here (refused)
        """ColossalAI's own checkpoint IO for the plugin in use (it gathers tensor-parallel slices and FSDP shards),
        sharded safetensors with Hugging Face's names; config.json is the checkpoint's."""
        import shutil

        self.booster.save_model(self.model, str(folder), shard=True, use_safetensors=True, size_per_shard=1024)
        if self.ctx.rank == 0:
            shutil.copyfile(self.ctx.checkpoint / "config.json", folder / "config.json")

    def teardown(self) -> None:
        import torch.distributed as dist

        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()


class ColossalAIFineTuner(ColossalAITrainer, FineTuner):
    role = "finetune"
