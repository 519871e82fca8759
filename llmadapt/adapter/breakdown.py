"""One taxonomy for where a step's time goes, the same names on every stack (docs/breakdown.md).

An adapter's ``Trainer.module_class`` maps each module of its framework to a module class (or None: its structure
decides, llmadapt.adapter.structure, else its time goes to the enclosing module's class); the default here knows transformers' Llama and Mixtral modules, which the
torch, DeepSpeed and ColossalAI adapters all run. ``operator_class`` maps a profiled operator to its class.
Nothing here imports torch.
"""

from __future__ import annotations

import re

MODULE_CLASSES = (
    "embedding", "norm", "attention.qkv", "attention.rotary", "attention.qk", "attention.softmax", "attention.av",
    "attention.fused", "attention.core", "attention.out", "mixer", "mlp.gate", "mlp.up", "mlp.gate_up", "mlp.activation",
    "mlp.down", "mlp", "moe.router", "moe.dispatch", "moe.experts", "moe.combine", "model", "lm_head", "loss",
    "gradient", "optimizer", "communication", "unclassified", "other",
)
"""Module classes: study A's list of a step's parts (docs/breakdown.md says what each holds on each stack).
Attention splits into its scores (``attention.qk``: Q times K transposed), ``attention.softmax`` and its weighted
sum (``attention.av``: the weights times V) where the attention is eager; a fused kernel (SDPA, FlashAttention)
is one class that says so, ``attention.fused``; ``attention.core`` keeps the rest of attention's own code (the
mask, the layout of q, k and v). The MLP splits into its projections and its activation (with the gating
product); ``mlp.gate_up`` is one fused projection of both, ``mlp`` what no part claims. A MoE layer splits into
its router, the dispatch of tokens to experts, the experts' own work and the combine (weighting and summing the
experts' outputs). 'mixer' is a token mixer that is not attention: a state-space block (Mamba's selective scan with
its projections and causal convolution) or an RWKV-style time mix. 'model' is the model's own code outside its named parts: residual adds, masks and position
ids, the layout between blocks. 'gradient' is the accumulation of each parameter's gradient and what a stack
hooks there (DDP's bucketing, ZeRO's partitioning, Megatron-core's main_grad). 'optimizer' and 'communication'
are also found by the core (the optimizer's step and zero_grad, collectives, waiting for a collective);
'communication' holds a data-parallel wrapper's own code too (gradient-reduction bookkeeping). 'unclassified' is a
module with weights that neither the stack's classifier nor the structure (``module_classes``) names, sitting in
the model's own code: a part of a new model family, shown with its share instead of hidden in 'model'. 'other' is
whatever no class claims: the adapter's own code between operators (reported, never hidden)."""

DATA_PARALLEL_WRAPPERS = ("DistributedDataParallel", "DeepSpeedEngine", "FullyShardedDataParallel", "FSDPModule",
                          "TorchDDPModel", "LowLevelZeroModel", "HybridParallelModule", "ModelWrapper",
                          "Float16Module")
"""Module types that wrap a model for data parallelism (or precision) on the stacks llmadapt runs."""

OPERATOR_CLASSES = (
    "gemm", "attention", "softmax", "convolution", "elementwise", "reduction", "normalization", "memory",
    "dequantization", "optimizer", "gradient_accumulation", "parameter_hooks", "autograd", "framework_function",
    "memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "memcpy_other", "memset",
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv", "other_collective",
    "other",
)
"""Operator classes. On the CPU basis from the operator's name (``operator_class``); on the GPU's kernel basis
from the kernel's name (``kernel_class``): then the memcpy classes (by direction) and memset are the device's
copy and set activities, and 'memory' is copy and layout kernels. The frameworks' own machinery has classes
named for what it does: 'gradient_accumulation' (AccumulateGrad and what a stack hooks there: DDP's bucketing,
ZeRO's partitioning), 'parameter_hooks' (ZeRO-3's gather and release around each module), 'autograd' (a
backward node's own time), 'framework_function' (the Python of a framework's autograd Function: Megatron-core's
tensor-parallel layers, ZeRO-3's linear)."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


def layer_index(name: str) -> int | None:
    """The transformer block a module name is ('model.layers.3', 'module.decoder.layers.0'); None otherwise."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def hf_module_class(name: str, type_name: str) -> str | None:
    """The class of a transformers Llama/Mixtral module by its qualified name and type name (any wrapper prefix,
    e.g. DeepSpeed's 'module.'); None for a module whose time belongs to its parent (a ModuleList, the parts
    of a class already named)."""
    last = name.rsplit(".", 1)[-1]
    if type_name in DATA_PARALLEL_WRAPPERS:
        return "communication"
    if type_name.endswith(("ForCausalLM", "Model", "DecoderLayer")) or layer_index(name) is not None:
        return "model"  # the model's and each block's own code: masks, position ids, residual adds
    if last == "lm_head":
        return "lm_head"
    if last == "embed_tokens" or type_name.endswith("Embedding") and "Rotary" not in type_name:
        return "embedding"
    if "Rotary" in type_name:
        return "attention.rotary"
    if last in ("q_proj", "k_proj", "v_proj", "qkv_proj"):
        return "attention.qkv"
    if last == "o_proj":
        return "attention.out"
    if type_name.endswith("Attention"):
        return "attention.core"  # its own operators: rotary applied, scores, softmax, weighted sum (SDPA)
    if "Norm" in type_name:
        return "norm"
    if "Router" in type_name or last == "gate":  # Llama's dense MLP names its projection gate_proj
        return "moe.router"
    if type_name.endswith("Experts") or last == "experts" or ".experts." in name:
        # one expert and its parts too: a ModuleList of experts is indexed, its own forward never runs, and
        # ColossalAI's expert-parallel block calls an expert's w1, w2, w3 directly
        return "moe.experts"
    if "SparseMoe" in type_name or "MoeBlock" in type_name or last == "block_sparse_moe":
        return "moe.dispatch"  # transformers routes and combines in one loop: combine is inside dispatch here
    if last in _MLP_PARTS:
        return _MLP_PARTS[last]
    if type_name.endswith("MLP") or last == "mlp":
        return "mlp"  # its own code: the activation and gating product (split_module)
    return None


_MLP_PARTS = {"gate_proj": "mlp.gate", "up_proj": "mlp.up", "down_proj": "mlp.down", "gate_up_proj": "mlp.gate_up"}


def rotary_calls(modules) -> list[tuple[object, str, str]]:
    """transformers applies the rotary embedding in a function of the model's own Python module
    (``apply_rotary_pos_emb``) that attention's forward looks up there: that function, as a call the core times as
    'attention.rotary' (``Trainer.profiled_calls``), for each attention module type among ``modules``."""
    import sys

    found = {}
    for root in modules:
        for _, module in root.named_modules():
            home = sys.modules.get(type(module).__module__)
            if type(module).__name__.endswith("Attention") and callable(getattr(home, "apply_rotary_pos_emb", None)):
                found[id(home)] = home
    return [(home, "apply_rotary_pos_emb", "attention.rotary") for home in found.values()]


LOSS_OPS = ("cross_entropy", "nll_loss")  # a loss, inside the model or computed by the adapter
_COMBINE_OPS = ("index_add", "scatter_add", "scatter_reduce")  # summing the experts' outputs back per token
_MACHINERY = {"parameter_hooks", "framework_function", "autograd", "gradient_accumulation", "other"}


def split_module(cls: str, parts: list[tuple[str, str | None]]) -> list[str | None]:
    """Study A's finer classes inside one call of a module of class ``cls``: ``parts`` are what the call ran itself,
    in time order, each (operator name, None) or (range name, its class) for a classified module or call inside
    it; the result is each operator's class (None for a nested range: it keeps its own).

    - attention's own code ('attention.core'): a fused attention operator is 'attention.fused'; GEMMs in turn
      the scores ('attention.qk') and the weighted sum ('attention.av'), and what runs between the two (scale,
      mask, softmax, dropout: Megatron-core's fused scale-mask-softmax) 'attention.softmax';
    - an MLP's own elementwise operators are its activation and gating product ('mlp.activation');
    - a MoE layer's own code (and experts that gather and scatter tokens themselves): before an expert's work
      (a GEMM or an expert module) dispatch, after it combine, up to and with the sum of the outputs
      (index_add_, scatter_add); softmax and top-k before the first expert are the router's;
    - a loss operator is 'loss' wherever it runs.
    The frameworks' machinery (ZeRO's hooks, autograd Functions) keeps the module's class."""
    kinds = [None if nested else operator_class(name) for name, nested in parts]
    out: list[str | None] = [None if nested else cls for _, nested in parts]
    if cls == "attention.core":
        gemms = 0
        for i, kind in enumerate(kinds):
            if kind == "attention":
                out[i] = "attention.fused"
            elif kind == "gemm":
                out[i] = "attention.av" if gemms % 2 else "attention.qk"
                gemms += 1
            elif kind == "softmax" or gemms % 2 and kind not in _MACHINERY and out[i] is not None:
                out[i] = "attention.softmax"  # with the scale, mask and dropout between the two GEMMs
    elif cls == "mlp":
        out = ["mlp.activation" if kind == "elementwise" else o for kind, o in zip(kinds, out)]
    elif cls in ("moe.dispatch", "moe.experts"):
        out = _split_moe(cls, parts, kinds, out)
    return ["loss" if nested is None and any(k in name for k in LOSS_OPS) else o
            for (name, nested), o in zip(parts, out)]


def _split_moe(cls: str, parts, kinds, out):
    work = [kind == "gemm" or nested == "moe.experts" for (_, nested), kind in zip(parts, kinds)]
    combines = [nested is None and any(k in name for k in _COMBINE_OPS) for name, nested in parts]
    if cls == "moe.experts" and not any(combines):
        return out  # one expert, or experts that leave dispatch and combine to their layer
    segments, start, busy = [], 0, False  # a segment: one expert's dispatch, work and combine
    for i in range(len(parts)):
        busy = busy or work[i]
        if combines[i] and busy:
            segments.append(range(start, i + 1))
            start, busy = i + 1, False
    segments.append(range(start, len(parts)))
    first_work = next((i for i, w in enumerate(work) if w), len(parts))
    for segment in segments:
        done = [i for i in segment if work[i]]
        first, last = (done[0], done[-1]) if done else ((-1, -1) if segment.start > first_work else (len(parts),) * 2)
        for i in segment:
            if out[i] is None or kinds[i] in _MACHINERY or collective_kind(parts[i][0]):
                continue
            if work[i]:
                out[i] = "moe.experts"
            elif i < first:
                routing = i < first_work and (kinds[i] == "softmax" or "topk" in parts[i][0])
                out[i] = "moe.router" if routing and cls == "moe.dispatch" else "moe.dispatch"
            elif i > last:
                out[i] = "moe.combine"
            else:
                out[i] = cls if cls == "moe.experts" else "moe.dispatch"
    return out


_COLLECTIVES = (
    ("all_reduce", ("allreduce", "all_reduce")),
    ("all_gather", ("allgather", "all_gather")),
    ("reduce_scatter", ("reduce_scatter", "reducescatter")),
    ("all_to_all", ("alltoall", "all_to_all")),
    ("broadcast", ("broadcast",)),
    ("send_recv", ("send", "recv")),
)
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "_scaled_mm",
         "_int_mm", "einsum"}
_MEMORY = {"copy_", "to", "_to_copy", "contiguous", "clone", "cat", "stack", "view", "reshape", "transpose", "t",
           "permute", "expand", "unsqueeze", "squeeze", "flatten", "unflatten", "split", "chunk", "narrow", "slice",
           "select", "index_select", "gather", "scatter", "scatter_add", "scatter_add_", "index_add_", "index",
           "index_put_", "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
           "fill_", "zero_", "new_zeros", "new_empty", "new_empty_strided", "as_strided", "_unsafe_view",
           "detach", "alias", "split_with_sizes", "unbind", "resize_", "set_", "_reshape_alias", "repeat",
           "repeat_interleave", "pad", "constant_pad_nd", "embedding", "embedding_dense_backward",
           "embedding_backward", "masked_fill", "masked_fill_", "where", "tril", "triu", "arange", "full"}


def collective_kind(op_name: str) -> str | None:
    """'all_reduce', 'all_gather', ... for a collective's profiler name (c10d::allreduce_, gloo:all_reduce,
    nccl:all_reduce, record_param_comms aside); None for anything else."""
    low = op_name.lower()
    if not any(k in low for k in ("c10d", "gloo", "nccl", "dist", "comm")):
        return None
    for kind, keys in _COLLECTIVES:
        if any(k in low for k in keys):
            return kind
    return "other_collective" if "c10d::" in low else None


_PARAMETER_HOOKS = ("PreBackwardFunction", "PostBackwardFunction", "PreForwardFunction", "PostForwardFunction")


def operator_class(op_name: str) -> str:
    """The operator class of one profiled operator by its name ('aten::mm' -> 'gemm'). Not ATen: the autograd
    engine's gradient accumulation (where DDP buckets and ZeRO partitions), ZeRO-3's parameter hooks (gather
    before a module, release after), a backward node's own time, a framework's autograd Function's own code."""
    coll = collective_kind(op_name)
    if coll:
        return coll
    if op_name in ("detach", "detach_"):  # autograd's view op, recorded without its aten:: prefix
        return "memory"
    if op_name.startswith("bitsandbytes::"):  # a quantized base: its weights (de)quantized, its own matmuls
        if "quant" in op_name:
            return "dequantization"
        return "gemm" if re.search(r"gemm|gemv|matmul|_mm\b", op_name) else "other"
    if not op_name.startswith("aten::"):
        if "AccumulateGrad" in op_name:
            return "gradient_accumulation"
        if op_name.startswith(_PARAMETER_HOOKS):
            return "parameter_hooks"
        if re.search(r"Backward\d*$", op_name) or op_name.startswith("torch::autograd::"):
            return "autograd"  # a backward node's own time (CopySlices, AsStrided: view bookkeeping)
        if op_name.startswith(("llmadapt::", "ProfilerStep", "autograd::engine")) or "::" in op_name:
            return "other"
        return "framework_function"
    base = op_name[6:]
    if base.endswith("_backward"):
        base = base[:-9]
    if base in _GEMM:
        return "gemm"
    if "attention" in base or "flash" in base:
        return "attention"
    if "softmax" in base:
        return "softmax"
    if "norm" in base:
        return "normalization"
    if base.startswith("_foreach") or base in ("addcdiv_", "addcmul_", "lerp_", "_fused_adam_", "_fused_adamw_"):
        return "optimizer"
    if base in _MEMORY or base.rstrip("_") in _MEMORY:
        return "memory"
    return "elementwise"


# Kernel names, in order: the first pattern that matches gives the class. Libraries name their kernels in their
# own ways: cuBLAS (ampere_/sm90_xmma_gemm, nvjet), CUTLASS, rocBLAS/Tensile (Cijk_), cuDNN, MIOpen, ATen
# (at::native::*), cub, Triton from TorchInductor (triton_poi/red/per/tem), FlashAttention, bitsandbytes.
_KERNEL_CLASSES = tuple((cls, re.compile(pattern, re.IGNORECASE)) for cls, pattern in (
    ("dequantization", r"dequant|kQuantize|gemv_4bit|unpack_?int|int4_to|int8_to"),
    ("attention", r"flash|fmha|attention|attn|sdpa|mha_(fwd|bwd)"),
    ("softmax", r"softmax"),
    ("optimizer", r"multi_tensor_apply|fused_?adam|\badam|\blamb\b|lamb_|fused_sgd|sgd_kernel|_foreach_"),
    ("normalization", r"(layer|rms|batch|group|instance)_?norm|bn_(fw|bw)|welford|RowwiseMoments|GammaBeta|"
                      r"cuComputeGradInput|cuApplyLayerNorm|cuApplyRMSNorm"),
    ("memory", r"nchwToNhwc|nhwcToNchw|CatArray|direct_copy|copy_kernel|transpose|FillFunctor|fill_kernel"),
    ("convolution", r"conv|winograd|implicit_?gemm|fprop|dgrad|wgrad|scudnn|cudnn|cask_|computeOffsets|"
                    r"computeBOffsets|miopen|im2col|col2im"),
    ("gemm", r"gemm|gemv|cutlass|xmma|cublas|nvjet|sm\d\d_|ampere_|volta_|turing_|hopper_|maxwell_|Cijk_|"
             r"splitKreduce|matmul|triton_tem|dot_kernel|wmma"),
    ("reduction", r"reduce|cub::|DeviceScan|DeviceRadix|DeviceSelect|DeviceSegmented|triton_red|triton_per|"
                  r"argmax|argmin|topk|sort|cumsum|histogram|max_pool|avg_pool|adaptive_\w*pool"),
    ("memory", r"index|gather|scatter|embedding|permute|fbgemm_gpu::|bounds_check|indices|masked_|roll|flip|"
               r"repeat|to_dense|copy"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_poi|Functor|_kernel_cuda|dropout|"
                    r"activation|gelu|silu|relu|sigmoid|tanh|distribution|philox|curand|clamp"),
))
_MEMCPY = re.compile(r"^Memcpy\s+(HtoD|DtoH|DtoD)", re.IGNORECASE)
_MEMORY_FUNCTOR = re.compile(r"direct_copy|FillFunctor|copy_kernel", re.IGNORECASE)


def _match_kernel(text: str) -> str | None:
    return next((cls for cls, pattern in _KERNEL_CLASSES if pattern.search(text)), None)


def kernel_class(name: str, category: str = "kernel") -> str:
    """The operator class of one GPU activity by its name and its Kineto category ('kernel', 'gpu_memcpy',
    'gpu_memset'): NCCL's kernels by collective kind, copies by direction, other kernels by their library's
    name. A kernel's own name (before its template and call arguments) decides first; the arguments only where
    it says nothing, or to find the copy or fill inside an ATen elementwise kernel."""
    if category == "gpu_memset" or name.startswith("Memset"):
        return "memset"
    if category == "gpu_memcpy" or name.startswith("Memcpy"):
        m = _MEMCPY.match(name)
        return f"memcpy_{m.group(1).lower()}" if m else "memcpy_other"
    if "nccl" in name.lower() or "rccl" in name.lower():
        return nccl_kernel_kind(name)
    head = re.split(r"[<(]", name.replace("(anonymous namespace)", ""), maxsplit=1)[0]
    cls = _match_kernel(head)
    if cls == "elementwise" and _MEMORY_FUNCTOR.search(name):
        return "memory"
    return cls or _match_kernel(name) or "other"


_NCCL_KINDS = (("allreduce", "all_reduce"), ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
               ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("sendrecv", "send_recv"),
               ("send", "send_recv"), ("recv", "send_recv"), ("reduce", "all_reduce"))


def nccl_kernel_kind(name: str, collective_name: str = "") -> str:
    """A collective kind from an NCCL kernel's name (ncclDevKernel_AllReduce_Sum_f32_RING_LL) or, for the generic
    kernel (ncclDevKernel_Generic), the 'Collective name' argument that PyTorch copies onto it."""
    for text in (collective_name, name):
        low = text.lower().replace("_", "")
        for key, kind in _NCCL_KINDS:
            if key in low:
                return kind
    return "other_collective"
