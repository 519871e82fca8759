"""The ``megatron`` adapter's worker classes: megatron-core's GPTModel, DDP, optimizer and schedules.

Imported only inside the adapter's environment, in the worker process.

One global step = ``get_forward_backward_func()`` over this data-parallel rank's micro-batches
(1F1B when pp > 1), megatron's ``finalize_model_grads`` (the data-parallel gradient reduction),
then the megatron optimizer's step. Loss convention (the contract's, as in the reference
adapter): sum of token cross-entropies over the global batch / ``batch.loss_tokens_global``.
Megatron's schedule divides each micro-batch's loss by the number of micro-batches and its DDP
averages gradients over the data-parallel ranks; the loss handed to the schedule is scaled by
``num_microbatches * dp / loss_tokens_global`` so that the gradients equal the reference's.
"""

from __future__ import annotations

from functools import partial

from llmadapt.adapter import FineTuner, Patch, Phase, StepResult, Trainer
from llmadapt.adapter.breakdown import DATA_PARALLEL_WRAPPERS

from .convert import CONVERT_VERSION, hf_to_megatron, load_into, megatron_to_hf
from .cpu_compat import Compat

SOURCE = "megatron"


class MegatronTrainer(Trainer):
    def framework_version(self) -> str:
        from importlib import metadata

        return metadata.version("megatron-core")

    def data_rank(self) -> tuple[int, int]:
        return self._dp_rank, self._dp_size

    def rank_role(self) -> str:
        p = self.ctx.workload.parallelism
        return f"pipeline stage {self._pp_rank}/{p.pp}, tensor rank {self._tp_rank}/{p.tp}, data rank {self._dp_rank}/{p.dp}"

    def module_class(self, name: str, type_name: str) -> str | None:
        cls = megatron_module_class(name, type_name)
        # linear_fc1 is the gate and up projections in one GEMM with a gated linear unit (SwiGLU), else up alone
        return "mlp.up" if cls == "mlp.gate_up" and not self.config.gated_linear_unit else cls

    def profiled_calls(self):
        # GPTModel computes the (vocab-parallel) loss in its own forward, outside output_layer; Megatron's optimizer
        # is no torch.optim.Optimizer (whose step the core knows), and its DDP keeps gradients in a buffer.
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.transformer import attention

        calls = [(self.model.module, "compute_language_model_loss", "loss"),
                 (self, "_optimizer_step", "optimizer"), (self.model, "zero_grad_buffer", "optimizer"),
                 (attention, "apply_rotary_pos_emb", "attention.rotary"),  # self_attention applies it
                 # the pipeline's sends and receives between stages, and the waits for them (the schedule makes a
                 # communicator per step: its class's method)
                 (P2PCommunicator, "_communicate", "communication")]
        if getattr(self.config, "finalize_model_grads_func", None) is not None:
            calls.append((self.config, "finalize_model_grads_func", "gradient"))
        return calls

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        import torch
        import torch.distributed as dist

        ctx, w = self.ctx, self.ctx.workload
        if w.lora.rank:  # refused before launch by the declaration; never silently ignored
            raise NotImplementedError("the megatron adapter does full fine-tuning only (lora.rank must be 0)")
        o = w.optimizations
        self._owns_group = False
        if not dist.is_initialized():  # one process: megatron still needs a default group
            dist.init_process_group("nccl" if ctx.is_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=ctx.device if ctx.is_cuda else None)
            self._owns_group = True

        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[w.precision]
        self.use_distributed_optimizer = o.zero_stage == 1
        self.compat = Compat(fake_type_strings=self.use_distributed_optimizer or w.precision == "bf16",
                             moe=w.model.is_moe)
        if not ctx.is_cuda:
            self.patches += self.compat.install()

        with self.compat.mode():
            self._build()

    def _build(self) -> None:
        import torch
        import torch.nn.functional as F
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.timers import Timers
        from megatron.core.transformer.transformer_config import TransformerConfig
        ctx, w = self.ctx, self.ctx.workload
        m, p, o, t = w.model, w.parallelism, w.optimizations, w.train
        ps.initialize_model_parallel(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                     expert_model_parallel_size=p.ep)
        model_parallel_cuda_manual_seed(w.seed)
        self._dp_rank, self._dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self._pp_rank, self._tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
        self.tp, self.pp = p.tp, p.pp
        self.timers = Timers(log_level=2, log_option="all")

        recompute = {}
        if o.recompute == "full":
            recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        elif o.recompute == "selective":
            recompute = dict(recompute_granularity="selective")  # megatron's default module: core_attn
        moe = {}
        if m.is_moe:
            moe = dict(num_moe_experts=m.num_experts, moe_router_topk=m.experts_per_token,
                       moe_token_dispatcher_type="allgather",  # alltoall creates a CUDA stream
                       moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,  # HF: router_aux_loss_coef 0
                       moe_router_score_function="softmax", moe_router_pre_softmax=False,  # = softmax, top-k, renorm
                       moe_grouped_gemm=False)
        self.config = TransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.intermediate_size,
            num_attention_heads=m.num_heads, num_query_groups=m.num_kv_heads, kv_channels=m.head_dim,
            normalization="RMSNorm", layernorm_epsilon=m.norm_eps, gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
            attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
            tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, expert_model_parallel_size=p.ep,
            sequence_parallel=False, use_cpu_initialization=True, perform_initialization=False,
            params_dtype=self.dtype, bf16=self.dtype == torch.bfloat16, pipeline_dtype=self.dtype,
            # Fusions that need apex/TE kernels or torch.jit on CUDA: off (their torch fallbacks compute the same).
            bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
            timers=self.timers, **recompute, **moe,
        )
        spec = get_gpt_layer_local_spec(num_experts=m.num_experts or None, moe_grouped_gemm=False,
                                        normalization="RMSNorm")
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        model = GPTModel(
            config=self.config, transformer_layer_spec=spec, vocab_size=m.vocab_size,
            max_sequence_length=m.max_position_embeddings, pre_process=self.first_stage,
            post_process=self.last_stage, parallel_output=True, share_embeddings_and_output_weights=m.tie_embeddings,
            position_embedding_type="rope", rotary_base=m.rope_theta,
        )
        _mark_tensor_parallel(model)
        if w.data.packing:
            model.rotary_pos_emb.register_forward_hook(self._packed_rope)
            # it changes what megatron computes (on every device), so every packed run's trace says so
            self.patches.append(Patch(
                framework="megatron-core", name="packed-rope-positions", kind="shim",
                description="a forward hook on GPTModel.rotary_pos_emb gives each token of a packed row the RoPE "
                            "angle of its own position (restarting at 0 with each sample): megatron-core's local "
                            "attention path takes the block-diagonal mask but reads no position ids"))
        self._load_rank_shard(model, ps)
        self.model_loaded()
        model.to(ctx.device)

        self.experts = _ExpertCounter(model, m) if m.is_moe else None
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=self.use_distributed_optimizer)
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=model)
        opt = t.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="sgd" if opt == "sgd" else "adam", lr=t.lr, min_lr=t.lr, weight_decay=t.weight_decay,
                decoupled_weight_decay=opt == "adamw",  # adamw -> torch AdamW; adam -> torch Adam (L2 in the grad)
                adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, sgd_momentum=0.0,  # torch's defaults, as the reference
                clip_grad=0.0,  # the reference does not clip
                bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                use_distributed_optimizer=self.use_distributed_optimizer, timers=self.timers,
            ),
            [self.model],
            config_overrides={},  # weight decay on every parameter, as the reference (megatron skips norms by default)
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = self.model.no_sync
        self.forward_backward = get_forward_backward_func()
        self._scale = 1.0
        # Train mode once: nothing in a run switches it off (evaluation loads the saved model apart),
        # and train() walks every module: a cost in every step, not in a bare loop.
        self.model.train()

    # -- one step ------------------------------------------------------------------------------
    def _load_rank_shard(self, model, ps) -> None:
        """This rank's converted weights into ``model``: read from the checkpoint tensor by tensor (only what this
        rank's tensor-, pipeline- and expert-parallel slice needs), converted, and cached in the state folder by
        the checkpoint's content hash and the slice, so the next run on this layout loads one file of the rank's
        share. The cache is written from the loaded model, once the converted copy is gone."""
        import os

        from safetensors.torch import save_file

        from llmadapt.adapter import recorded_weights_hash, state_dir
        from llmadapt.adapter.weights import CheckpointWeights

        ctx, m, p = self.ctx, self.ctx.workload.model, self.ctx.workload.parallelism
        where = dict(tp=p.tp, tp_rank=ps.get_tensor_model_parallel_rank(), pp=p.pp,
                     pp_rank=ps.get_pipeline_model_parallel_rank(), ep=p.ep, ep_rank=ps.get_expert_model_parallel_rank(),
                     etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank())
        self._where = where
        checksum = m.checksum or recorded_weights_hash(ctx.checkpoint)
        # Written from the model's parameters: in its dtype, which names the file with the slice.
        dtype = str(self.dtype).rpartition(".")[2]
        name = f"{checksum}-v{CONVERT_VERSION}-{dtype}-" + "-".join(f"{k}{v}" for k, v in where.items()) + ".safetensors"
        cached = state_dir() / "megatron-shards" / name
        if checksum and cached.is_file():
            load_into(model, CheckpointWeights(cached.parent, cached.name))  # a tensor at a time
            return
        weights = hf_to_megatron(CheckpointWeights(ctx.checkpoint), m, **where)
        load_into(model, weights)
        del weights
        if checksum:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            save_file({k: v.detach().contiguous() for k, v in model.named_parameters()}, str(tmp))
            os.replace(tmp, cached)

    def save_pretrained(self, folder, adapter_only: bool = False) -> None:  # no LoRA save here (refused)
        """Every rank's slice gathered on rank 0 and converted back to the Hugging Face layout (megatron_to_hf);
        config.json is the checkpoint's: the architecture did not change."""
        import shutil

        import torch.distributed as dist

        from llmadapt.adapter.weights import write_safetensors

        mine = (self._where, {k: v.detach().cpu() for k, v in self.model.module.named_parameters()})
        every = [None] * dist.get_world_size() if self.ctx.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        if self.ctx.rank == 0:
            write_safetensors(folder, megatron_to_hf(every, self.ctx.workload.model))
            shutil.copyfile(self.ctx.checkpoint / "config.json", folder / "config.json")

    def _forward_step(self, data_iterator, model):
        import torch

        input_ids, labels, positions, allowed = next(data_iterator)
        mask = labels != -100
        targets = torch.where(mask, labels, torch.zeros_like(labels))  # megatron's CE has no ignore_index
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        # Packed rows: megatron's local attention takes a [b, 1, s, s] mask, True where a score is masked out (it
        # then builds no causal mask of its own: ours is causal too); RoPE reads the positions (_packed_rope).
        attention_mask = None if allowed is None else ~allowed
        self._positions = positions
        if self.experts:
            self.experts.counting = True
        try:
            output = model(input_ids, positions, attention_mask, labels=targets)
        finally:
            if self.experts:
                self.experts.counting = False
        return output, partial(self._loss, mask)

    def _packed_rope(self, module, args, emb):
        """GPTModel's RoPE angles are those of positions 0..s-1 for every row ([s, 1, 1, d]); a packed row's
        positions restart at 0 with each sample: pick each token's own ([s, b, 1, d], which the rotation
        broadcasts over the heads)."""
        return emb[:, 0, 0, :][self._positions.t()].unsqueeze(2)

    def _loss(self, mask, token_losses):
        # token_losses: [b, s] per-token cross-entropy (fp32), on the last pipeline stage.
        token_sum = (token_losses.float() * mask.to(token_losses.device).float()).sum()
        return token_sum * self._scale, {"token_loss_sum": token_sum.detach().clone()}

    def step(self, batch) -> StepResult:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        ctx = self.ctx
        n = len(batch.micro_batches)
        # The schedule divides by n and DDP averages over dp: undo both, normalise by the global token count.
        self._scale = n * self._dp_size / batch.loss_tokens_global
        data = iter([(mb.input_ids.to(ctx.device), mb.labels.to(ctx.device),
                      None if mb.position_ids is None else mb.position_ids.to(ctx.device),
                      mb.attention_allowed(ctx.device)) for mb in batch.micro_batches])
        mb_size, seq = batch.micro_batches[0].input_ids.shape
        if self.experts:
            self.experts.start_step()
        with self.compat.mode():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            losses = self.forward_backward(
                forward_step_func=self._forward_step, data_iterator=data, model=[self.model], num_microbatches=n,
                seq_length=seq, micro_batch_size=mb_size, decoder_seq_length=seq, forward_only=False)
            self.timers("optimizer", log_level=0).start()
            grad_norm = self._optimizer_step()
            self.timers("optimizer", log_level=0).stop()

            local = sum(float(d["token_loss_sum"]) for d in losses) if self.last_stage else 0.0
            total = torch.tensor([local], dtype=torch.float64, device=ctx.device)
            if dist.get_world_size() > 1:
                # last stage: sum over data-parallel ranks; then hand it to every pipeline stage
                dist.all_reduce(total, group=ps.get_data_parallel_group())
                if self.pp > 1:
                    dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
            expert_load, ties = self.experts.global_counts_and_ties(self.tp) if self.experts else (None, None)
        return StepResult(loss=total.item() / batch.loss_tokens_global, phases=self._timer_phases(),
                          expert_load=expert_load, expert_near_ties=ties, grad_norm=float(grad_norm))

    def _optimizer_step(self) -> float:
        """optimizer.step() in its parts, to have the gradient norm without clipping (clip_grad=0 computes none):
        the norm over the model-parallel group (and the data-parallel one for the distributed optimizer)."""
        if self.optimizer.prepare_grads():
            raise RuntimeError("megatron's optimizer skipped the step (non-finite gradients)")
        grad_norm = self.optimizer.get_grad_norm()
        self.optimizer.step_with_ready_grads()
        return grad_norm

    def _timer_phases(self) -> list[Phase]:
        out = []
        # Every timer megatron started (schedules: forward-compute, backward-compute, and with pp the p2p
        # send/recv timers; finalize_model_grads: all-grads-sync; the optimizer's own), plus ours
        # around optimizer.step, in seconds for this step.
        for name, timer in self.timers._timers.items():
            out.append(Phase(name, timer.elapsed(reset=True), SOURCE))
        return out

    def teardown(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.compat.uninstall()


class MegatronFineTuner(MegatronTrainer, FineTuner):
    """Full fine-tuning (prompt tokens carry label -100, masked out of the loss). LoRA is refused."""

    role = "finetune"


class _ExpertCounter:
    """Per-layer, per-expert token counts from megatron's TopKRouter (forward hook on its routing_map).

    Counts only while ``counting`` is set (the forward pass proper), so full recomputation in the
    backward pass does not count twice. Layer index = the router's global layer number."""

    def __init__(self, model, spec) -> None:
        import torch

        self.num_layers, self.num_experts = spec.num_layers, spec.num_experts
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long)
        self.ties = torch.zeros(self.num_layers, dtype=torch.long)
        self.counting = False
        found = 0
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.register_forward_hook(self._hook(layer.layer_number - 1))
                router.routing = self._tie_counter(layer.layer_number - 1, router)
                found += 1
        if not found:
            raise RuntimeError("MoE model has no TopKRouter to count expert load from")

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.counting:
                _probs, routing_map = output
                self.counts[index] += routing_map.sum(dim=0).to("cpu", dtype=self.counts.dtype)

        return hook

    def _tie_counter(self, index: int, router):
        """The router's own routing, seeing its logits on the way: near-ties as llmadapt.adapter.moe counts them."""
        from llmadapt.adapter.moe import near_tie_count

        routing = router.routing

        def counted(logits, *args, **kwargs):
            if self.counting:
                self.ties[index] += near_tie_count(logits, router.topk)
            return routing(logits, *args, **kwargs)

        return counted

    def start_step(self) -> None:
        self.counts.zero_()
        self.ties.zero_()

    def global_counts_and_ties(self, tp: int) -> tuple[list[list[int]], list[int]]:
        """Every stage's layers and every data-parallel rank's tokens; tensor-parallel ranks route the same tokens."""
        from llmadapt.adapter.moe import all_reduce_counts

        return all_reduce_counts(self.counts, self.ties, divide=tp)


def megatron_module_class(name: str, type_name: str) -> str | None:
    """Megatron-core's GPT modules (local layer spec) in llmadapt's breakdown classes; None leaves a module's time
    to its parent."""
    last = name.rsplit(".", 1)[-1]
    if type_name in DATA_PARALLEL_WRAPPERS:
        return "communication"
    if type_name in ("GPTModel", "TransformerBlock", "TransformerLayer", "MoETransformerLayer"):
        return "model"  # their own code: the layout between blocks, residual adds (the loss has a range of its own)
    if last == "output_layer":
        return "lm_head"
    if last in ("embedding", "word_embeddings", "position_embeddings"):
        return "embedding"
    if last == "rotary_pos_emb" or "Rotary" in type_name:
        return "attention.rotary"
    if last == "linear_qkv":
        return "attention.qkv"
    if last == "linear_proj":
        return "attention.out"
    if last in ("self_attention", "core_attention"):
        return "attention.core"  # their own operators, split by study A (scores, softmax, weighted sum, the layout)
    if "norm" in last.lower() or "Norm" in type_name:
        return "norm"
    if last == "router":
        return "moe.router"
    if last in ("experts", "shared_experts") or ".experts." in name:
        return "moe.experts"  # and each local expert with its parts
    if type_name == "MoELayer":
        return "moe.dispatch"  # its own code: the token dispatcher is no module (split_module: dispatch, combine)
    if last == "linear_fc1":
        return "mlp.gate_up"
    if last == "linear_fc2":
        return "mlp.down"
    if last == "mlp":
        return "mlp"  # its own code: the activation and gating product (split_module)
    return None


def _mark_tensor_parallel(model) -> None:
    """Mark each tensor-parallel layer's weight as split over the tensor-parallel ranks, as megatron-core does only
    while it initialises the weight: with perform_initialization=False (the weights come from the checkpoint) the
    mark is never set, every rank but the first takes its slice for a copy of the first's, and the gradient norm
    (and clipping by it) sees half a tp=2 model. The partition stride (1) serves only to reassemble checkpoints,
    which this adapter does itself (megatron_to_hf)."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        dim = 0 if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) else \
            1 if isinstance(module, RowParallelLinear) else None
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
