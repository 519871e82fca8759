"""Micro-benchmark worker: runs inside the core's tools environment (imports torch).

    python -m llmadapt.runtime RUN_DIR                    # a worker of kind 'micro'; ops or peak: one process
    python -m torch.distributed.run ... -m llmadapt.runtime RUN_DIR   # comm: one process per rank

Reads ``RUN_DIR/launch.json`` (written by llmadapt.micro), writes ``rank-NNNNN.jsonl``: a
header, then one record per measurement (``op_bench`` for operators and peaks, ``metric`` for
the peaks themselves, ``comm`` for collectives), flushed as it goes; any failure leaves a
failure record. The operators mirror what transformers' Llama/Mixtral modules run, so their
times can calibrate the analytical model of the reference adapter.

Size: over 400 lines because the three suites (operators, peaks, collectives) share one timer (the
worker's shell is llmadapt.runtime.lifecycle's); each suite is a function of its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from llmadapt.contract.jsonl import JsonlWriter
from llmadapt.contract.perf import OpBench
from llmadapt.contract.launch import LaunchRequest, OpCost, OpSpec, run_header
from llmadapt.contract.records import Comm, Metric, bandwidths
from llmadapt.contract.rundir import RunDir
from llmadapt.contract.stats import describe
from llmadapt.runtime import lifecycle


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}[name]


class Timer:
    """Times calls of a function: device-synchronised wall clock (CUDA events on GPU)."""

    def __init__(self, device, warmup: int, repeats: int, min_time_s: float, max_time_s: float) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.min_time_s, self.max_time_s = min_time_s, max_time_s

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def run(self, fn: Callable[[], Any]) -> list[float]:
        for _ in range(self.warmup):
            fn()
        self.sync()
        times: list[float] = []
        started = time.perf_counter()
        while True:
            if self.device.type == "cuda":
                import torch

                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            spent = time.perf_counter() - started
            if len(times) >= self.repeats and spent >= self.min_time_s or spent >= self.max_time_s and len(times) >= 3:
                break
        return times


# -- operators --------------------------------------------------------------------------------------
def _rmsnorm(x, weight, eps: float = 1e-5):
    import torch

    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _rotate_half(x):
    import torch

    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _eager_attention(q, k, v, mask):
    """transformers' eager_attention_forward: repeat_kv, scores, + mask, fp32 softmax, cast, @ v."""
    import torch

    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        b, kvh, s, d = k.shape
        k = k[:, :, None].expand(b, kvh, rep, s, d).reshape(b, kvh * rep, s, d)
        v = v[:, :, None].expand(b, kvh, rep, s, d).reshape(b, kvh * rep, s, d)
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
    scores = scores + mask
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


def _build(spec: OpSpec, device, dtype) -> tuple[Callable[[], Any], list, Any]:
    """(forward function, inputs that need gradients, a function making the output) for one op spec."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, grad=True, scale=1.0):
        t = (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    op, sh = spec.op, spec.shape
    if spec.kind == "gemm" and op != "moe_router":
        trainable = spec.trainable
        x, wt = rand(sh["m"], sh["k"]), rand(sh["n"], sh["k"], scale=sh["k"] ** -0.5, grad=trainable)
        return (lambda: F.linear(x, wt)), [x, wt] if trainable else [x], None
    if op == "moe_router":
        x, wt = rand(sh["m"], sh["k"]), rand(sh["n"], sh["k"], scale=sh["k"] ** -0.5)
        k = spec.extra["k"]

        def router():
            logits = F.linear(x, wt)
            probs = torch.softmax(logits.float(), dim=-1)
            top, idx = torch.topk(probs, k, dim=-1)
            return (top / top.sum(-1, keepdim=True)).to(x.dtype), idx

        return (lambda: router()[0]), [x, wt], None
    if op == "rmsnorm":
        x, wt = rand(sh["t"], sh["h"]), rand(sh["h"])
        return (lambda: _rmsnorm(x, wt)), [x, wt], None
    if op == "rotary":
        b, s, d = sh["b"], sh["s"], sh["d"]
        q, k = rand(b, sh["heads"], s, d), rand(b, sh["kv_heads"], s, d)
        cos, sin = rand(b, s, d, grad=False), rand(b, s, d, grad=False)
        return (lambda: _rotary(q, k, cos, sin)), [q, k], None
    if op == "swiglu":
        gate, up = rand(sh["t"], sh["i"]), rand(sh["t"], sh["i"])
        return (lambda: F.silu(gate) * up), [gate, up], None
    if op == "cross_entropy":
        logits = rand(sh["t"], sh["v"])
        labels = torch.randint(0, sh["v"], (sh["t"],), generator=g).to(device)
        return (lambda: F.cross_entropy(logits.float(), labels, reduction="sum")), [logits], None
    if op == "moe_dispatch":
        t, h, ne, k = sh["t"], sh["h"], sh["experts"], sh["k"]
        x = rand(t, h)
        idx = torch.stack([torch.randperm(ne, generator=g)[:k] for _ in range(t)]).to(device)
        weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(device=device, dtype=dtype)

        def dispatch():
            # transformers' MixtralExperts routing, with the expert MLP left out (benchmarked as fc1/swiglu/fc2)
            out = torch.zeros_like(x)
            with torch.no_grad():
                mask = F.one_hot(idx, num_classes=ne + 1).permute(2, 1, 0)
                hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for e in hit:
                e = e[0]
                if e == ne:
                    continue
                pos, tok = torch.where(mask[e])
                out.index_add_(0, tok, (x[tok] * weights[tok, pos, None]).to(out.dtype))
            return out

        return dispatch, [x], None
    if op == "attention":
        b, heads, kvh, s, d = sh["b"], sh["heads"], sh["kv_heads"], sh["s"], sh["d"]
        q, k, v = rand(b, heads, s, d), rand(b, kvh, s, d), rand(b, kvh, s, d)
        backend = spec.backend
        if backend == "eager":
            mask = torch.full((s, s), float("-inf"), device=device, dtype=dtype).triu(1)[None, None]
            return (lambda: _eager_attention(q, k, v, mask)), [q, k, v], None
        from torch.nn.attention import SDPBackend, sdpa_kernel

        member = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                  "cudnn": "CUDNN_ATTENTION"}[backend]
        if not hasattr(SDPBackend, member):
            raise NotImplementedError(f"this torch has no SDPA backend {member}")
        kernel = getattr(SDPBackend, member)

        def sdpa():
            with sdpa_kernel([kernel]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kvh != heads)

        return sdpa, [q, k, v], None
    raise ValueError(f"unknown micro-benchmark op {op!r}")


def run_ops(launch: LaunchRequest, device, writer: JsonlWriter, timer: Timer) -> None:
    import torch

    for spec in launch.spec.ops:
        dtype = _torch_dtype(spec.dtype)
        directions = spec.directions
        try:
            fwd, inputs, _ = _build(spec, device, dtype)
            fwd()  # raises here when a backend cannot run these inputs
        except Exception as exc:  # an SDPA backend the device does not offer, a dtype without kernels
            for direction in directions:
                writer.write(_op_record(spec, direction, [], status="unsupported", note=_one_line(exc)))
            continue
        for direction in directions:
            d = spec.cost[direction]
            try:
                if direction == "forward":
                    with torch.no_grad() if "backward" not in directions else _null():
                        times = timer.run(fwd)
                else:
                    out = fwd()
                    outs = out if isinstance(out, tuple) else (out,)
                    grads = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs]
                    times = timer.run(lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True,
                                                                  allow_unused=True))
                writer.write(_op_record(spec, direction, times, flops=d.flops, bytes_=d.bytes))
            except Exception as exc:
                writer.write(_op_record(spec, direction, [], status="error", note=_one_line(exc)))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _op_record(spec: OpSpec, direction, times, *, status="ok", note=None, flops=None, bytes_=None) -> OpBench:
    d = spec.cost.get(direction, OpCost())
    flops = d.flops if flops is None else flops
    bytes_ = d.bytes if bytes_ is None else bytes_
    stats = describe(times)
    p50 = stats.p50 if stats else None
    return OpBench(rank=0, op=spec.op, direction=direction, dtype=spec.dtype, shape=spec.shape,
                   flops=float(flops), bytes=float(bytes_), seconds=stats, times_s=times,
                   flops_per_s=flops / p50 if p50 and flops else None,
                   bytes_per_s=bytes_ / p50 if p50 and bytes_ else None, backend=spec.backend,
                   launches=d.launches, status=status, note=note)


def run_peak(launch: LaunchRequest, device, writer: JsonlWriter, timer: Timer) -> None:
    """Best GEMM FLOP/s per dtype over a few square sizes, and copy bandwidth of a large buffer."""
    import torch

    spec = launch.spec.peak
    gpu = device.type == "cuda"
    dtypes = spec.dtypes or (["fp32", "tf32", "bf16", "fp16"] if gpu else ["fp32", "bf16"])
    sizes = spec.gemm_sizes_gpu if gpu else spec.gemm_sizes_cpu
    for dtype_name in dtypes:
        dtype = _torch_dtype(dtype_name)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
        best = 0.0
        for n in sizes:
            try:
                a = torch.randn(n, n, device=device).to(dtype)
                b = torch.randn(n, n, device=device).to(dtype)
                times = timer.run(lambda: torch.mm(a, b))
            except Exception as exc:
                writer.write(OpBench(rank=0, op="gemm", direction="forward", dtype=dtype_name,
                                     shape={"m": n, "k": n, "n": n}, flops=2.0 * n ** 3, bytes=0.0, seconds=None,
                                     times_s=[], status="unsupported", note=_one_line(exc), source="llmadapt.micro peak"))
                break
            flops, size = 2.0 * n ** 3, a.element_size()
            stats = describe(times)
            writer.write(OpBench(rank=0, op="gemm", direction="forward", dtype=dtype_name,
                                 shape={"m": n, "k": n, "n": n}, flops=flops, bytes=3.0 * n * n * size, seconds=stats,
                                 times_s=times, flops_per_s=flops / stats.p50, bytes_per_s=3.0 * n * n * size / stats.p50,
                                 source="llmadapt.micro peak"))
            best = max(best, flops / stats.min)
        if best:
            writer.write(Metric(rank=0, name=f"peak.flops_per_s.{dtype_name}", value=best, unit="FLOP/s",
                                source="llmadapt.micro peak: best GEMM over sizes and repeats"))
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
    n = (spec.copy_bytes_gpu if gpu else spec.copy_bytes_cpu) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = timer.run(lambda: dst.copy_(src))
    stats = describe(times)
    moved = 2.0 * n * 4
    writer.write(OpBench(rank=0, op="copy", direction="forward", dtype="fp32", shape={"elements": n}, flops=0.0,
                         bytes=moved, seconds=stats, times_s=times, bytes_per_s=moved / stats.p50,
                         source="llmadapt.micro peak"))
    writer.write(Metric(rank=0, name="peak.memory_bytes_per_s", value=moved / stats.min, unit="bytes/s",
                        source="llmadapt.micro peak: best copy (read + write) of a buffer larger than caches"))


def run_comm(launch: LaunchRequest, device, writer: JsonlWriter, rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    spec = launch.spec.comm
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    backend = dist.get_backend()
    for op in spec.ops:
        for size in spec.sizes:
            elems = max(world, size // 4 // world * world)
            nbytes = elems * 4
            try:
                fn = _collective(op, elems, world, rank, device)
                for _ in range(spec.warmup):
                    fn()
                sync()
            except Exception as exc:
                if rank == 0:
                    writer.write(OpBench(rank=0, op=op, direction="forward", dtype="fp32",
                                         shape={"bytes": nbytes, "ranks": world}, flops=0.0, bytes=float(nbytes),
                                         seconds=None, times_s=[], status="unsupported",
                                         note=f"{backend}: {_one_line(exc)}", source="llmadapt.micro comm"))
                dist.barrier()
                break
            times = []
            for _ in range(spec.iters):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - t0)
            slowest = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rank == 0:
                per_iter = slowest.cpu().tolist()
                algbw, busbw = bandwidths(op, nbytes, len(per_iter), sum(per_iter), world)
                writer.write(Comm(rank=0, op=op, message_bytes=nbytes, count=len(per_iter), total_seconds=sum(per_iter),
                                  source=f"llmadapt.micro comm ({backend}, {world} ranks; slowest rank per iteration)",
                                  algbw_gbytes_per_s=algbw, busbw_gbytes_per_s=busbw))


def _collective(op: str, elems: int, world: int, rank: int, device) -> Callable[[], Any]:
    """One call of a collective moving S = elems * 4 bytes in the nccl-tests sense."""
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        t = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        t = torch.ones(elems, device=device)
        return lambda: dist.broadcast(t, src=0)
    if op == "all_gather":  # S = the gathered size
        out, inp = torch.empty(elems, device=device), torch.ones(elems // world, device=device)
        try:
            dist.all_gather_into_tensor(out, inp)
            return lambda: dist.all_gather_into_tensor(out, inp)
        except (RuntimeError, NotImplementedError, ValueError):
            parts = list(out.chunk(world))
            return lambda: dist.all_gather(parts, inp)
    if op == "reduce_scatter":  # S = the total (input) size
        inp, out = torch.ones(elems, device=device), torch.empty(elems // world, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    if op == "all_to_all":  # S = each rank's send buffer
        inp, out = torch.ones(elems, device=device), torch.empty(elems, device=device)
        return lambda: dist.all_to_all_single(out, inp)
    raise ValueError(f"unknown collective {op!r}")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def run_micro(run_dir: Path) -> int:
    """The micro-benchmark suite the launch record in RUN_DIR asks for; returns the process exit code."""
    launch = lifecycle.launch_record(run_dir)
    from llmadapt.runtime.device import Place, apply_thread_policy, describe_device, pick_device, software_versions

    place = Place.from_env()
    writer = JsonlWriter(RunDir(run_dir).rank_file(place.rank))
    with lifecycle.WorkerProcess(writer, place, "micro-benchmark", describe=_one_line) as worker:
        import torch

        apply_thread_policy()
        device = pick_device(place)
        worker.join_group(device)
        suite = launch.suite
        writer.write(run_header(
            launch, rank=place.rank, local_rank=place.local_rank, world_size=place.world_size,
            framework_version=torch.__version__, device=describe_device(device), software=software_versions(),
            patches=[],
        ))
        t = launch.spec.timing
        timer = Timer(device, t.warmup, t.repeats, t.min_time_s, t.max_time_s)
        if suite in ("ops", "peak") and launch.spec.peak:
            run_peak(launch, device, writer, timer)
        if suite == "ops":
            run_ops(launch, device, writer, timer)
        elif suite == "comm":
            run_comm(launch, device, writer, place.rank, place.world_size)
    return worker.code


def main(argv: list[str] | None = None) -> None:
    """``python -m llmadapt.runtime.microbench RUN_DIR``, its name before the one entry point
    (``python -m llmadapt.runtime``), still run by the compat path llmadapt.microbench."""
    from llmadapt.runtime.kinds import main as run_kind

    run_kind(argv)


if __name__ == "__main__":
    main()
