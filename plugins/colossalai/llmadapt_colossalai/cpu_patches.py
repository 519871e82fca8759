"""CPU equivalents for the few places where ColossalAI 0.5.0 assumes CUDA (or an NPU).

Applied by the trainer only when the worker runs on CPU, and only those the chosen Booster
plugin reaches; each returns the ``Patch`` that goes into every trace header of the run.
All are real CPU equivalents (no faked type or device string), hence kind ``cpu-equivalent``.
"""

from __future__ import annotations

from llmadapt.adapter import Patch

FRAMEWORK = "colossalai"


def zero_sanity_check() -> Patch:
    """LowLevelZeroOptimizer._sanity_checks asserts the accelerator is cuda or npu; keep its dtype check only."""
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    def _sanity_checks(self):
        for group in self.optim.param_groups:
            for param in group["params"]:
                if not getattr(param, "skip_zero_check", False):
                    assert param.dtype == self._dtype, (
                        f"Parameters are expected to have the same dtype `{self._dtype}`, but got `{param.dtype}`")

    LowLevelZeroOptimizer._sanity_checks = _sanity_checks
    return Patch(FRAMEWORK, "zero-sanity-check-cpu",
                 "LowLevelZeroOptimizer._sanity_checks asserts a cuda/npu accelerator before checking parameter "
                 "dtypes; the device assertion is dropped (the optimizer's reductions are plain torch.distributed "
                 "calls that gloo runs on CPU), the dtype check is kept.")


class CpuStream:
    """The one stream a CPU has: work runs synchronously, so waiting and recording are no-ops."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event

    def query(self) -> bool:
        return True


def accelerator_streams() -> Patch:
    """CpuAccelerator's stream methods and synchronize raise; on CPU there is one synchronous stream."""
    from contextlib import nullcontext

    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    stream = CpuStream()
    CpuAccelerator.synchronize = lambda self, device=None: None
    CpuAccelerator.Stream = lambda self, device=None, priority=0, **kwargs: stream
    CpuAccelerator.current_stream = lambda self, device=None: stream
    CpuAccelerator.default_stream = lambda self, device=None: stream
    CpuAccelerator.set_stream = lambda self, stream_: None
    CpuAccelerator.stream = lambda self, stream_: nullcontext()
    return Patch(FRAMEWORK, "cpu-accelerator-streams",
                 "CpuAccelerator.Stream/current_stream/default_stream/stream/set_stream and synchronize raise 'not "
                 "supported'; a CPU runs its kernels synchronously on one stream, so these return that one stream "
                 "(whose waits are no-ops), a null context, or do nothing. LowLevelZero's bucket store creates a "
                 "communication stream even with overlap_communication=False (the adapter's setting), never using it.")


def accelerator_rng() -> Patch:
    """CpuAccelerator.get_rng_state(device) calls torch.get_rng_state(device), which takes no argument."""
    import torch
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    CpuAccelerator.get_rng_state = lambda self, device=None: torch.get_rng_state()
    CpuAccelerator.set_rng_state = lambda self, new_state, device=None: torch.set_rng_state(new_state)
    CpuAccelerator.manual_seed = lambda self, seed: torch.manual_seed(seed)
    return Patch(FRAMEWORK, "cpu-accelerator-rng",
                 "CpuAccelerator.get_rng_state passes a device to torch.get_rng_state (a TypeError) and manual_seed "
                 "raises; both use the CPU generator (torch.get_rng_state/set_rng_state/manual_seed). Shardformer's "
                 "tensor-parallel layers read and set the RNG state while they are built.")


def hccl_stub() -> Patch:
    """The pipeline p2p code calls torch.distributed.is_hccl_available, which only exists with torch_npu."""
    import torch.distributed as dist

    if not hasattr(dist, "is_hccl_available"):
        dist.is_hccl_available = lambda: False
    return Patch(FRAMEWORK, "is-hccl-available-stub",
                 "colossalai.pipeline.p2p calls torch.distributed.is_hccl_available(), defined only when Huawei's "
                 "torch_npu is installed; a stub returns False (there is no HCCL here), so p2p uses gloo.")


def fsdp_device() -> Patch:
    """TorchFSDPPlugin.configure passes device_id=torch.cuda.current_device(); on CPU FSDP takes no device id."""
    import torch
    from colossalai.booster.plugin.torch_fsdp_plugin import TorchFSDPPlugin

    original = TorchFSDPPlugin.configure

    def configure(self, *args, **kwargs):
        # torch.cuda.current_device() raises without CUDA; during configure it answers the CPU device,
        # which torch FSDP accepts as its compute device (with no device id it refuses to run on CPU).
        saved = torch.cuda.current_device
        torch.cuda.current_device = lambda: torch.device("cpu")
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = saved

    TorchFSDPPlugin.configure = configure
    return Patch(FRAMEWORK, "fsdp-device-id-cpu",
                 "TorchFSDPPlugin.configure hard-codes device_id=torch.cuda.current_device(); on CPU the FSDP wrapper "
                 "gets device_id=torch.device('cpu'), which torch FSDP accepts as its compute device.")
