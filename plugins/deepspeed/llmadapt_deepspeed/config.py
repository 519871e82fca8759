"""The DeepSpeed config a workload maps to. Pure Python (no torch, no deepspeed): testable anywhere.

Every choice that is not DeepSpeed's default is named here with its reason; the README lists
them for users.
"""

from __future__ import annotations

from typing import Any

# No periodic "step=N, lr=..." progress lines: the core does the reporting.
STEPS_PER_PRINT = 2**31 - 1

# torch.optim defaults, written out so DeepSpeed builds exactly the reference's optimizer.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def gradient_accumulation_steps(workload) -> int:
    return workload.per_rank_batch // workload.micro_batch


def client_cpu_adam(workload) -> bool:
    """Whether the adapter builds DeepSpeedCPUAdam itself and hands it to ``deepspeed.initialize``.

    DeepSpeed's config builds DeepSpeedCPUAdam only for an offloaded optimizer; without offload it
    would build FusedAdam. With ``optimizer_impl = "cpu_adam"`` and no offload (parameters in host
    memory: the CPU device) the adapter passes DeepSpeedCPUAdam as the client optimizer instead.
    """
    return workload.train.optimizer_impl == "cpu_adam" and workload.optimizations.offload == "none"


def optimizer_config(workload) -> dict[str, Any] | None:
    """The workload's optimizer, as DeepSpeed's config names it; None when the adapter builds it (client).

    ``optimizer_impl = "torch"`` (the default): ``torch_adam`` makes DeepSpeed use
    torch.optim.Adam/AdamW instead of FusedAdam (a CUDA/C++ op) or DeepSpeedCPUAdam (a C++ op
    compiled at first use, minutes on a small machine): nothing JIT-compiles.
    ``optimizer_impl = "cpu_adam"`` with offload: no ``torch_adam``, so DeepSpeed builds
    DeepSpeedCPUAdam for the offloaded states, its own ZeRO-Offload path.
    DeepSpeed's "Adam" means AdamW unless ``adam_w_mode`` is false: say so explicitly.
    """
    t = workload.train
    if client_cpu_adam(workload):
        return None
    if t.optimizer in ("adam", "adamw"):
        params = {"lr": t.lr, "betas": list(ADAM_BETAS), "eps": ADAM_EPS, "weight_decay": t.weight_decay,
                  "adam_w_mode": t.optimizer == "adamw"}
        if t.optimizer_impl == "torch":
            params["torch_adam"] = True
        return {"type": "AdamW" if t.optimizer == "adamw" else "Adam", "params": params}
    # Not a DeepSpeed optimizer name: DeepSpeed takes it from torch.optim by that name.
    return {"type": "SGD", "params": {"lr": t.lr, "weight_decay": t.weight_decay}}


def expected_optimizer(workload) -> str:
    """The class name of the optimizer DeepSpeed must end up with (checked after initialisation)."""
    t = workload.train
    if t.optimizer_impl == "cpu_adam":
        return "DeepSpeedCPUAdam"
    return {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}[t.optimizer]


def zero_config(workload) -> dict[str, Any]:
    o = workload.optimizations
    zero: dict[str, Any] = {"stage": o.zero_stage}
    if o.zero_stage == 3:
        # Partition every parameter, as the workload's ZeRO-3 asks. DeepSpeed's default keeps
        # parameters under 1e5 elements replicated: on the tiny presets that is all of them,
        # and ZeRO-3 would silently be ZeRO-2.
        zero["stage3_param_persistence_threshold"] = 0
    if o.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if o.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return zero


def build_config(workload) -> dict[str, Any]:
    """The DeepSpeed config dict for ``workload`` (data parallel over every rank)."""
    w, o = workload, workload.optimizations
    config: dict[str, Any] = {
        "train_batch_size": w.train.global_batch,
        "train_micro_batch_size_per_gpu": w.micro_batch,
        "gradient_accumulation_steps": gradient_accumulation_steps(w),
        "steps_per_print": STEPS_PER_PRINT,
        "gradient_clipping": 0.0,
        "zero_optimization": zero_config(w),
        "bf16": {"enabled": w.precision == "bf16"},
        "fp16": {"enabled": w.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # What DeepSpeed measures, read back as records: engine timers and every collective.
        "wall_clock_breakdown": True,
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
    }
    optimizer = optimizer_config(w)
    if optimizer is not None:
        config["optimizer"] = optimizer
    if w.train.optimizer == "sgd" and o.zero_stage > 0:
        config["zero_allow_untested_optimizer"] = True  # torch.optim.SGD under ZeRO
    if o.offload != "none" and w.train.optimizer_impl == "torch":
        # Keep the torch optimizer with offload too (DeepSpeed would force DeepSpeedCPUAdam).
        config["zero_force_ds_cpu_optimizer"] = False
    if o.recompute != "none":
        # DeepSpeed's activation checkpointing, plainly: no activation partitioning (that needs
        # tensor parallelism), no CPU checkpointing.
        config["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    return config
