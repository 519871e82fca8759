"""The ``deepspeed`` adapter's worker classes: transformers' model driven by a DeepSpeed engine.

Imported only inside the adapter's environment, in the worker process.

The loss is the contract's (sum of token cross-entropies over the global batch / its
loss-bearing tokens). DeepSpeed divides the loss handed to ``engine.backward`` by the
gradient-accumulation steps and averages gradients over the data-parallel ranks, so each
micro-batch's token-loss sum is handed over multiplied by ``gas * dp / loss_tokens_global``:
the gradient then equals the reference's exactly (up to float rounding).
"""

from __future__ import annotations

import contextlib

import functools
import os
import sys
import time
from contextlib import nullcontext
from typing import Any

from llmadapt.adapter import Comm, FineTuner, Metric, Patch, Phase, Span, StepResult, Trainer, bandwidths, quantization
from llmadapt.adapter.kernels import slow_paths

from .config import ADAM_BETAS, ADAM_EPS, build_config, client_cpu_adam, expected_optimizer, gradient_accumulation_steps
from .plugin import CPU_ADAM_ON_CUDA, FP16_ON_CPU

SOURCE = "deepspeed"
# DeepSpeed's global engine timers (summed over a step's micro-batches), in its own names.
ENGINE_TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
# nccl-tests size convention: for these ops the bytes moved are the gathered/scattered whole,
# n times the per-rank tensor DeepSpeed's comms logger records for all-gather.
_GATHER_OPS = ("all_gather", "all_gather_into_tensor", "allgather_fn", "all_gather_base")

PATCH_SHM = Patch(
    framework="deepspeed",
    name="skip-shm-comm-op",
    description="deepspeed.comm.torch.build_shm_op returns None, so DeepSpeed's shared-memory collective op "
                "(C++, JIT-compiled with gcc at every init_distributed, ~80 s on 2 cores) is not built; "
                "DeepSpeed's collectives then run through torch.distributed over gloo, its own fallback.",
    kind="cpu-equivalent",
)
PATCH_COMMS_TIMER = Patch(
    framework="deepspeed",
    name="comms-logger-per-op-latency",
    description="deepspeed.comm's comms logger reads each op's timer with elapsed(reset=False), so the latency it "
                "logs for the k-th call of an op is the sum of the first k calls; the timer is reset after each "
                "logged op so every entry is that one op's latency (a bug fix, any device).",
    kind="fix",
)


class DeepSpeedTrainer(Trainer):
    """Pre-training; the fine-tuner differs only by what the workload asks (LoRA, instruction data)."""

    def framework_version(self) -> str:
        import deepspeed

        return deepspeed.__version__

    # -- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        import torch

        ctx, w = self.ctx, self.ctx.workload
        if w.precision == "fp16" and not ctx.is_cuda:
            raise RuntimeError(f"{FP16_ON_CPU}: use fp32 or bf16")
        if client_cpu_adam(w) and ctx.is_cuda:
            raise RuntimeError(CPU_ADAM_ON_CUDA)
        self.config = build_config(w)
        self.gas = gradient_accumulation_steps(w)
        self._own_process_group = False
        _set_extensions_dir()
        self._init_distributed()

        import deepspeed
        from transformers import AutoModelForCausalLM

        self._metrics: list[Metric] = []
        if w.train.optimizer_impl == "cpu_adam":
            self._load_cpu_adam()
        quant = w.optimizations.quantization
        self._compute_dtype = torch.bfloat16 if w.precision == "bf16" and quant == "none" else (
            torch.float16 if w.precision == "fp16" else torch.float32)
        kwargs: dict[str, Any] = {}
        if quant != "none":
            # QLoRA as the reference adapter does it: bitsandbytes base weights (nf4 4-bit or LLM.int8),
            # loaded on this rank's device; compute in fp32 (DeepSpeed's bf16 mode casts the rest).
            kwargs["quantization_config"] = quantization.bnb_config(quant, torch.float32)
            kwargs["device_map"] = {"": ctx.device}
        self._zero_init = None
        if w.optimizations.zero_stage == 3 and quant == "none":
            # ZeRO-3 from the start: while this object lives, transformers builds the model inside deepspeed.zero.Init
            # (each rank materialises only its partition) and loads the checkpoint shard by shard into the
            # partitions, so no rank ever holds the whole model.
            from transformers.integrations import HfDeepSpeedConfig

            self._zero_init = HfDeepSpeedConfig(self.config)
        model = AutoModelForCausalLM.from_pretrained(
            str(ctx.checkpoint), dtype=torch.float32,  # DeepSpeed casts to bf16/fp16 and keeps fp32 master weights
            attn_implementation="sdpa" if w.optimizations.flash_attention else "eager", **kwargs,
        )
        self.model_loaded()
        model.config.use_cache = False
        self.notes += slow_paths(model)
        if quant != "none":
            from peft import prepare_model_for_kbit_training

            # Freezes the base and casts its non-quantized weights (norms, embeddings) to fp32; recomputation
            # is set up below with DeepSpeed's checkpoint function, not peft's.
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        recompute = w.optimizations.recompute
        if recompute != "none":
            deepspeed.checkpointing.configure(None, deepspeed_config=self.config)
            if recompute == "full":
                # transformers' per-layer hook, with DeepSpeed's checkpoint function instead of torch's.
                model.gradient_checkpointing_enable()
                model._set_gradient_checkpointing(enable=True,
                                                  gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
            else:
                _checkpoint_attention(model, deepspeed.checkpointing.checkpoint)
                model.enable_input_require_grads()  # reentrant recompute needs an input that requires grad
        if w.lora.rank:
            from peft import LoraConfig, get_peft_model

            # LoRA's A matrices are random: draw them from the workload's seed, so every layout
            # (ZeRO stage, dp, recompute) starts from the same adapter weights (as the reference does).
            torch.manual_seed(w.seed)
            model = get_peft_model(model, LoraConfig(
                r=w.lora.rank, lora_alpha=w.lora.alpha, lora_dropout=w.lora.dropout,
                target_modules=list(w.lora.target_modules), task_type="CAUSAL_LM",
            ))
        if quant != "none":  # the experts bitsandbytes left, quantized and checked before step 0
            self.weights = quantization.quantize_and_check(model, quant, torch.float32)
        self.experts = None
        if w.model.is_moe:
            from llmadapt.adapter.moe import ExpertLoadCounter

            self.experts = ExpertLoadCounter(model, w.model.num_experts)
        params = [p for p in model.parameters() if p.requires_grad]
        client = None
        if client_cpu_adam(w):
            # DeepSpeed's config would build FusedAdam without offload: hand it DeepSpeedCPUAdam (parameters
            # are in host memory on the CPU device, which is what DeepSpeedCPUAdam updates).
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            client = DeepSpeedCPUAdam(params, lr=w.train.lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                      weight_decay=w.train.weight_decay, adamw_mode=w.train.optimizer == "adamw")
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params,
                                                                 optimizer=client, config=self.config)
        self._record_optimizer(expected_optimizer(w))
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

        # ZeRO's and the bf16/fp16 optimizers reduce the gradient norm over every shard themselves; a plain torch
        # optimizer under the engine (no ZeRO, fp32) has none: it is taken where the engine reduced the gradients.
        self._norm_here = not isinstance(self.engine.optimizer, DeepSpeedOptimizer)
        # Train mode once: nothing in a run switches it off (evaluation loads the saved model apart),
        # and train() walks every module: a cost in every step, not in a bare loop.
        self.engine.train()
        self._flash = w.optimizations.flash_attention
        # Collectives of initialisation (parameter broadcasts) belong to no step: start counting after them.
        self._comms_seen: dict[tuple[str, int], int] = {}
        self._step_comms()
        self._flops: list[Metric] = []
        # One profiled forward: the last warm-up step (excluded from statistics), else the first step.
        # Not under ZeRO-3: there DeepSpeed swaps torch's F.linear for its memory-efficient linear,
        # whose inner matmul the profiler counts on top of the F.linear it patches (linear FLOPs
        # come out doubled), and partitioned parameters count as 0.
        self._profile_step = max(w.train.warmup_steps - 1, 0) if w.optimizations.zero_stage < 3 else None

    def save_pretrained(self, folder, adapter_only: bool = False) -> None:
        """Under ZeRO-3 the partitions are gathered first (every rank takes part; each holds the whole model
        for the moment it takes rank 0 to write it)."""
        import deepspeed

        from llmadapt.adapter.weights import save_hf_model

        module = self.engine.module
        gather = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
                  if self.ctx.workload.optimizations.zero_stage == 3 else contextlib.nullcontext())
        with gather:
            save_hf_model(module, folder, write=self.ctx.rank == 0, adapter_only=adapter_only)

    @contextlib.contextmanager
    def plain_transformers(self):
        """While our HfDeepSpeedConfig is registered, from_pretrained partitions what it loads with collectives on
        every rank: unregistered while rank 0 alone loads the evaluation model."""
        if self._zero_init is None:
            yield
            return
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            set_hf_deepspeed_config(self._zero_init)

    def _load_cpu_adam(self) -> None:
        """Build (first use: gcc, minutes) or load DeepSpeed's C++ CPU Adam op, timed: the trace says what it cost."""
        from deepspeed.ops.op_builder import CPUAdamBuilder

        start = time.perf_counter()
        CPUAdamBuilder().load()
        self._metrics.append(Metric(self.ctx.rank, "cpu_adam_op_load_seconds", time.perf_counter() - start, "s",
                                    SOURCE))

    def _record_optimizer(self, expected: str) -> None:
        """Check DeepSpeed built the optimizer the workload asked for, and say which one in the trace.

        The metric's name carries the optimizer's class (``optimizer:deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam``),
        its value the parameter elements that optimizer updates on this rank (its ZeRO partition).
        """
        basic = self.engine.basic_optimizer
        cls = type(basic)
        if cls.__name__ != expected:
            raise RuntimeError(f"DeepSpeed built the optimizer {cls.__module__}.{cls.__name__}, but the workload asks "
                               f"for {expected} (train.optimizer_impl={self.ctx.workload.train.optimizer_impl!r})")
        elements = sum(p.numel() for group in basic.param_groups for p in group["params"])
        self._metrics.append(Metric(self.ctx.rank, f"optimizer:{cls.__module__}.{cls.__name__}", float(elements),
                                    "param", SOURCE))

    def _init_distributed(self) -> None:
        import torch.distributed as dist

        ctx = self.ctx
        if not ctx.is_cuda:
            module = sys.modules.get("deepspeed.comm.torch")
            if module is None:
                import deepspeed.comm  # noqa: F401  (loads deepspeed.comm.torch)

                module = sys.modules["deepspeed.comm.torch"]
            # `import deepspeed.comm.torch as m` would bind torch itself (deepspeed.comm re-exports
            # a name `torch`): patch the module object DeepSpeed's TorchBackend reads its global from.
            if not hasattr(module, "build_shm_op"):
                raise RuntimeError("deepspeed.comm.torch has no build_shm_op: this DeepSpeed is not the one "
                                   "the adapter was written for")
            module.build_shm_op = lambda: None
            self.patches.append(PATCH_SHM)
        _fix_comms_logger_latency()
        self.patches.append(PATCH_COMMS_TIMER)
        if not dist.is_initialized():
            # One rank: the core starts no process group, DeepSpeed needs one. A private in-memory
            # store avoids a TCP rendezvous (no port to pick, nothing to collide with).
            dist.init_process_group("nccl" if ctx.is_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._own_process_group = True
        # The engine reads its device index from LOCAL_RANK, which only launchers set.
        os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)

    # -- one step ---------------------------------------------------------------------------
    def _attention_backend(self):
        if not self._flash:
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)

    def step(self, batch) -> StepResult:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        ctx, engine = self.ctx, self.engine
        if len(batch.micro_batches) != self.gas:
            raise RuntimeError(f"got {len(batch.micro_batches)} micro-batches, DeepSpeed was configured for {self.gas}")
        # DeepSpeed divides by gas and averages over the dp ranks: hand it the token-loss sum times both.
        scale = self.gas * ctx.world_size / batch.loss_tokens_global
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        phases: list[Phase] = []
        spans: list[Span] = []
        if self.experts:
            self.experts.start_step()
        for i, mb in enumerate(batch.micro_batches):
            labels = mb.labels.to(ctx.device)
            profiler = self._start_flops_profile(batch.step, i)
            with self._attention_backend():
                with ctx.phase("forward", phases, spans=spans, span=f"forward {i}"):
                    if self.experts:
                        self.experts.counting = True
                    # the engine's compute dtype (it casts the module to bf16): a packed row's mask must match it
                    logits = engine(**mb.model_inputs(ctx.device, self._compute_dtype)).logits
                    if self.experts:
                        self.experts.counting = False
                    if profiler is not None:
                        self._end_flops_profile(profiler, batch.step, mb.input_ids.numel())
                    token_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
                with ctx.phase("backward", phases, spans=spans, span=f"backward {i}"):
                    engine.backward(token_loss * scale)
            # DeepSpeed's optimizer step runs at the accumulation boundary (the last micro-batch)
            with ctx.phase("optimizer", phases, spans=spans, span=f"engine.step {i}", span_source=SOURCE):
                if i == self.gas - 1 and self._norm_here:  # the engine reduced the gradients at this boundary
                    grad_norm = torch.nn.utils.get_total_norm(
                        [p.grad for p in engine.module.parameters() if p.grad is not None]).item()
                engine.step()
            loss_sum += token_loss.detach().double()
        if not self._norm_here:
            grad_norm = float(engine.get_global_grad_norm())  # ZeRO's and the bf16 optimizer's own, every shard
        timers = engine.get_wall_clock_timers()
        phases += [Phase(name, timers[name] / 1000.0, SOURCE) for name in ENGINE_TIMERS if name in timers]
        if ctx.world_size > 1:
            dist.all_reduce(loss_sum)  # torch.distributed, not deepspeed.comm: not in DeepSpeed's comms log
        expert_load, ties = self.experts.global_counts_and_ties() if self.experts else (None, None)
        # What setup found (the optimizer built, the op load time) goes out with the first step, not at the end:
        # a run that fails later keeps it.
        metrics, self._metrics = self._metrics, []
        return StepResult(loss=loss_sum.item() / batch.loss_tokens_global, phases=phases, expert_load=expert_load,
                          expert_near_ties=ties,
                          spans=spans, comms=self._step_comms(), metrics=metrics, grad_norm=grad_norm)

    def profiled_calls(self):
        # The engine's step is ZeRO's optimizer step; its backward adds ZeRO's gradient reduction to autograd's.
        calls = [*super().profiled_calls(), (self.engine, "step", "optimizer"), (self.engine, "backward", "gradient")]
        # ZeRO-3 gathers a module's parameters before it runs and releases them after, in hooks of its own
        offload = getattr(self.engine.optimizer, "parameter_offload", None)
        if offload is not None:
            calls += [(offload, name, "communication") for name in (
                "pre_sub_module_forward_function", "post_sub_module_forward_function",
                "pre_sub_module_backward_function", "post_sub_module_backward_function")]
        return calls

    # -- what DeepSpeed reports -------------------------------------------------------------
    def _start_flops_profile(self, step: int, micro: int):
        if step != self._profile_step or micro != 0:
            return None
        from deepspeed.profiling.flops_profiler import FlopsProfiler

        profiler = FlopsProfiler(self.engine.module)
        profiler.start_profile()
        return profiler

    def _end_flops_profile(self, profiler, step: int, tokens: int) -> None:
        profiler.stop_profile()
        flops, macs = float(profiler.get_total_flops()), float(profiler.get_total_macs())
        rank = self.ctx.rank
        self._flops = [
            Metric(rank, "forward_flops", flops, "flop", SOURCE, step),
            Metric(rank, "forward_macs", macs, "mac", SOURCE, step),
            Metric(rank, "forward_flops_per_token", flops / tokens, "flop/token", SOURCE, step),
            # DeepSpeed's own training estimate (its autotuner): backward = 2x forward.
            Metric(rank, "train_flops_per_token", 3 * flops / tokens, "flop/token", SOURCE, step),
            Metric(rank, "profiled_forward_seconds", float(profiler.get_total_duration()), "s", SOURCE, step),
            Metric(rank, "params", float(profiler.get_total_params()), "param", SOURCE, step),
        ]
        profiler.end_profile()

    def _step_comms(self) -> list[Comm]:
        """This step's new entries in DeepSpeed's comms logger, one record per (op, message size)."""
        from deepspeed.comm import comm as ds_comm

        out = []
        world = self.ctx.world_size
        for op, sizes in ds_comm.comms_logger.get_raw_data().items():
            for size, (count, latencies_ms, _, _) in sorted(sizes.items()):
                seen = self._comms_seen.get((op, size), 0)
                if count > seen:
                    out.append(_comm(self.ctx.rank, op, size, count - seen, sum(latencies_ms[seen:count]) / 1000.0,
                                     world, step=None))
                    self._comms_seen[(op, size)] = count
        return out

    def final_records(self) -> list[Comm | Metric]:
        import deepspeed.comm as ds_dist

        records: list[Comm | Metric] = list(self._flops)
        # Whole-run aggregate (initialisation included), as DeepSpeed summarises it; collective on all ranks.
        summary = ds_dist.log_summary(return_dict=True) or {}
        world = self.ctx.world_size
        for op, sizes in (summary.get("summary") or {}).items():
            if op == "log_summary_barrier":
                continue  # the summary's own barrier, not training traffic
            for size, entry in sorted(sizes.items()):
                records.append(_comm(self.ctx.rank, op, int(size), int(entry["count"]),
                                     entry["total_latency_ms"] / 1000.0, world, step=None))
        # DeepSpeed's throughput timer: global-batch samples/s over the steps after its first two.
        tput = self.engine.tput_timer
        if tput.global_step_count > tput.start_step and tput.total_elapsed_time > 0:
            records.append(Metric(self.ctx.rank, "throughput_samples_per_s", float(tput.avg_samples_per_sec()),
                                  "sample/s", SOURCE))
        return records

    def teardown(self) -> None:
        import torch.distributed as dist

        self.engine.destroy()
        if self._own_process_group and dist.is_initialized():
            dist.destroy_process_group()


class DeepSpeedFineTuner(DeepSpeedTrainer, FineTuner):
    role = "finetune"


# -- helpers --------------------------------------------------------------------------------
def _comm(rank: int, op: str, size: int, count: int, seconds: float, world: int, step: int | None) -> Comm:
    """One Comm record; sizes and bandwidths follow nccl-tests (algbw = bytes / time, busbw = algbw x factor)."""
    message = size * world if op in _GATHER_OPS else size
    algbw, busbw = bandwidths(op, message, count, seconds, world)  # GB/s, as nccl-tests (DeepSpeed logs Gbit/s)
    return Comm(rank=rank, op=op, message_bytes=int(message), count=int(count), total_seconds=float(seconds),
                source=SOURCE, step=step, algbw_gbytes_per_s=algbw, busbw_gbytes_per_s=busbw)


def _checkpoint_attention(model, checkpoint) -> int:
    """Selective recomputation: each decoder layer's self-attention block runs under DeepSpeed's
    activation checkpointing (the MLP keeps its activations).

    The module's class is swapped for a subclass whose ``__call__`` goes through ``checkpoint``,
    so the recompute in backward re-enters ``__call__`` with every module hook (ZeRO-3's
    parameter gathering included). Tensor keyword arguments (transformers passes
    ``hidden_states=``) take part in autograd: DeepSpeed's checkpoint passes them as inputs.
    """
    import torch

    count = 0
    for layer in model.modules():
        attn = getattr(layer, "self_attn", None)
        if not isinstance(attn, torch.nn.Module) or type(attn).__name__.startswith("DeepSpeedCheckpointed"):
            continue
        base = type(attn)

        def __call__(self, *args, _base=base, **kwargs):
            if self.training and torch.is_grad_enabled():
                return checkpoint(functools.partial(_base.__call__, self), *args, **kwargs)
            return _base.__call__(self, *args, **kwargs)

        attn.__class__ = type(f"DeepSpeedCheckpointed{base.__name__}", (base,), {"__call__": __call__})
        count += 1
    if not count:
        raise RuntimeError("recompute=selective: the model has no self_attn modules to checkpoint")
    return count


def _set_extensions_dir() -> None:
    """JIT-compiled DeepSpeed ops (DeepSpeedCPUAdam) go to llmadapt's state folder, one folder per DeepSpeed,
    torch and Python version: compiled once per machine (or CI cache), never mixed across ABIs. A
    ``TORCH_EXTENSIONS_DIR`` set by the user wins."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    from importlib import metadata

    from llmadapt.adapter import state_dir

    tag = (f"deepspeed-{metadata.version('deepspeed')}-torch-{metadata.version('torch')}-"
           f"py{sys.version_info.major}.{sys.version_info.minor}")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(state_dir() / "torch-extensions" / tag)


_COMMS_FIXED = False


def _fix_comms_logger_latency() -> None:
    """Make each comms-logger entry that op's own latency (see PATCH_COMMS_TIMER)."""
    global _COMMS_FIXED
    if _COMMS_FIXED:
        return
    from deepspeed.comm import comm as ds_comm

    logger = ds_comm.comms_logger
    original = logger.append

    def append(raw_name: str, record_name: str, latency: float, msg_size: int, *args: Any, **kwargs: Any):
        timer = ds_comm.timers(record_name)
        records = getattr(timer, "elapsed_records", None) or []
        if records:
            latency = records[-1]  # this op alone, in ms (elapsed() just filled the list)
        timer.reset()
        return original(raw_name, record_name, latency, msg_size, *args, **kwargs)

    logger.append = append
    _COMMS_FIXED = True
