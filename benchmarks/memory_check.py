"""Peak memory of Study B's Mixtral-8x7B QLoRA training step, measured with fake tensors, beside llmadapt's estimate.

Study B (arXiv 2408.04693) ran LLaMA-Factory (llmtuner ~0.5, transformers 4.36.2) with LoRA rank 16 on the experts'
w1/w2/w3 and the router, 4-bit NF4 with double quantisation, bf16, FlashAttention-2 and gradient checkpointing
(use_reentrant=True). This script runs that training step (forward, 4.36's loss, backward, AdamW) at Mixtral-8x7B's
real shapes under PyTorch's FakeTensorMode: no storage is allocated, but every operator's output has its real size,
and a dispatch mode counts the bytes of every storage an operator creates until its last reference dies. The peak of
that count, above the parameters, is the step's dynamic peak (activations, gradients, optimizer states, transients).

What is measured and what is modelled:
- measured (by running the code): the decoder layers' activations and their lifetime under reentrant checkpointing,
  the logits (bf16, LLaMA-Factory's fp32 upcast hook, 4.36's shifted contiguous copy, cross entropy), every gradient,
  LoRA's fp32 weights (through peft), their gradients and AdamW's states (foreach, as on CUDA);
- reproduced, not run: 4.36.2's Mixtral MoE block (a per-expert loop over nn.Linear w1/w2/w3 and a Linear router;
  transformers 5's Mixtral fuses the experts into 3-D parameters, which peft cannot wrap as Linear, so the 4.36 block
  is rebuilt here), its routing balanced over the experts (real routing is data-dependent and cannot run on fake
  tensors), and FlashAttention-2 stood in for by torch's CPU flash kernel (it saves q, k, v, the output and the
  log-sum-exp, as flash-attn does; 4.36 repeats k and v to all heads before calling it);
- modelled: the 4-bit weights (0.5 byte per parameter + double-quantised absmax: 1 byte per 64 + 4 bytes per 64 x 256),
  stood in for by frozen bf16 weights that are not counted; bitsandbytes' dequantised bf16 copy of one weight, made in
  forward and again in backward (a clone of the stand-in); bitsandbytes' MatMul4Bit keeping its input for backward
  (releases of early 2024 did, 0.50 does not: ``--no-keep-input``).
Not in any figure: the CUDA context, the caching allocator's rounding and fragmentation, cuBLAS/flash workspaces.

Layers: the step is run at 1, 2 and 4 layers and extrapolated linearly to 32 (the checks print how linear it is).

Size: over 400 lines because the rebuilt 4.36 model, the counting mode, the step and the two reports (peaks, max
batches) belong to one measurement and read best together.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30
MIXTRAL = dict(vocab=32000, hidden=4096, intermediate=14336, heads=32, kv_heads=8, experts=8, top_k=2, layers=32)
TINY = dict(vocab=512, hidden=64, intermediate=128, heads=4, kv_heads=2, experts=4, top_k=2, layers=2)
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes, 8-bit absmax per 64, fp32 absmax of absmax per 256 blocks


def build(shape: dict, layers: int, keep_input: bool, rank: int = 16):
    """The 4.36 Mixtral as LLaMA-Factory trains it, on fake tensors: the peft model, its lm_head, the stand-in parts."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn
    from transformers import AttentionInterface, MixtralConfig, MixtralForCausalLM

    class Dequant4bit(torch.autograd.Function):
        """bitsandbytes' MatMul4Bit: dequantise the whole weight to bf16 for the matmul, again in backward."""

        @staticmethod
        def forward(ctx, x, weight):
            out = nn.functional.linear(x, weight.clone())  # the clone is the dequantised copy
            ctx.save_for_backward(x if keep_input else None, weight)
            return out

        @staticmethod
        def backward(ctx, grad):
            _, weight = ctx.saved_tensors
            return grad @ weight.clone(), None

    class Linear4bit(nn.Linear):
        def forward(self, x):
            return Dequant4bit.apply(x, self.weight)

    class Expert(nn.Module):  # transformers 4.36.2's MixtralBLockSparseTop2MLP
        def __init__(self):
            super().__init__()
            h, i = shape["hidden"], shape["intermediate"]
            self.w1, self.w2, self.w3 = Linear4bit(h, i, bias=False), Linear4bit(i, h, bias=False), Linear4bit(
                h, i, bias=False)

        def forward(self, x, routing_weights):
            return routing_weights * self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))

    class SparseMoeBlock(nn.Module):  # transformers 4.36.2's MixtralSparseMoeBlock, routing balanced (see above)
        def __init__(self):
            super().__init__()
            self.gate = Linear4bit(shape["hidden"], shape["experts"], bias=False)
            self.experts = nn.ModuleList(Expert() for _ in range(shape["experts"]))

        def forward(self, hidden_states):
            b, s, h = hidden_states.shape
            x = hidden_states.view(-1, h)
            router_logits = self.gate(x)
            weights = nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
            weights, selected = torch.topk(weights, shape["top_k"], dim=-1)
            weights /= weights.sum(dim=-1, keepdim=True)
            weights = weights.to(x.dtype)
            final = torch.zeros((b * s, h), dtype=x.dtype, device=x.device)
            torch.nn.functional.one_hot(selected, num_classes=shape["experts"]).permute(2, 1, 0)  # 4.36's mask
            t, n = b * s, len(self.experts)
            for e, expert in enumerate(self.experts):
                # 4.36: idx, top_x = torch.where(expert_mask[e]); here each expert gets t * top_k / experts slots
                lo, hi = t * shape["top_k"] * e // n, t * shape["top_k"] * (e + 1) // n
                slots = torch.arange(lo, hi, device=x.device)
                idx, top_x = slots // t, slots % t
                current = x[None, top_x].reshape(-1, h)
                out = expert(current, weights[top_x, idx, None])
                final.index_add_(0, top_x, out.to(x.dtype))
            return final.reshape(b, s, h)

    def flash_standin(module, query, key, value, attention_mask, scaling=None, **_):
        """4.36's MixtralFlashAttention2: repeat k/v to all heads, then flash-attn (which saves q, k, v, out, lse)."""
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True,
                                                                            scale=scaling)
        return out.transpose(1, 2), None

    AttentionInterface.register("flash_standin", flash_standin)
    config = MixtralConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                           intermediate_size=shape["intermediate"], num_hidden_layers=layers,
                           num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                           num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                           max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False)
    torch.set_default_dtype(torch.bfloat16)  # from_pretrained(torch_dtype=bf16): every weight in bf16
    try:
        with torch.device("meta"):  # no storage: fake storage comes in to_fake (peft's .to() cannot swap fakes)
            model = MixtralForCausalLM(config)
            for layer in model.model.layers:
                attn = layer.self_attn
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    old = getattr(attn, name)
                    setattr(attn, name, Linear4bit(old.in_features, old.out_features, bias=False))
                layer.mlp = SparseMoeBlock()
    finally:
        torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "flash_standin"
    model.requires_grad_(False)
    # LLaMA-Factory 0.5's prepare_model_for_training: input grads for reentrant checkpointing, fp32 logits
    model.enable_input_require_grads()
    model.lm_head.register_forward_hook(lambda _m, _a, out: out.to(torch.float32))
    # peft on transformers 5 maps Mixtral's v4 names (w1/w2/w3) onto v5's fused expert tensors; these are v4 modules
    model.config.model_type = "mixtral-v4"
    with torch.device("meta"):
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules=["w1", "w2", "w3", "gate"]))
    for p in model.parameters():  # LLaMA-Factory upcasts the trainable (LoRA) weights to fp32
        if p.requires_grad:
            p.data = p.data.to(torch.float32)
    for module in model.modules():
        # peft 0.8's 4-bit LoRA left the input in bf16 under autocast; peft 0.21's lora.Linear would cast it to fp32
        # (and autocast back to bf16: one more copy of every LoRA input, ~96 KB per token and layer here)
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False
    return model


def to_fake(model) -> None:
    """Give every parameter and buffer a fake CPU storage of its shape and dtype (call inside FakeTensorMode)."""
    import torch

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"),
                                                               requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device="cpu")


class LiveBytes:
    """A dispatch mode counting the bytes of every storage an operator creates, from creation to release."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        from torch.utils.weak import WeakIdKeyDictionary, weakref

        class Mode(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.live = self.peak = 0
                self.phase = self.peak_phase = ""
                self.seen = WeakIdKeyDictionary()
                self.phase_peaks = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if hasattr(t, "untyped_storage"):
                        st = t.untyped_storage()
                        if st not in self.seen:
                            n = st.nbytes()
                            self.seen[st] = weakref.ref(st, partial(self._free, n))
                            self.live += n
                            if self.live > self.peak:
                                self.peak, self.peak_phase = self.live, self.phase
                            self.phase_peaks[self.phase] = max(self.live, self.phase_peaks.get(self.phase, 0))
                return out

            def _free(self, n, _ref):
                self.live -= n

            def existing(self, tensors):
                """Storages made before counting (parameters): their views are not new memory."""
                for t in tensors:
                    self.seen[t.untyped_storage()] = None

        return Mode()


def measure(shape: dict, layers: int, batch: int, seq: int, recompute: bool, keep_input: bool = True) -> dict:
    """One training step (the second, so AdamW's states exist) of ``layers`` layers: its dynamic peak and the phase."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build(shape, layers, keep_input)
    with FakeTensorMode(allow_non_fake_inputs=True):
        to_fake(model)
        if recompute:  # LLaMA-Factory 0.5: gradient_checkpointing_enable(), reentrant in transformers 4.36
            model.get_base_model().gradient_checkpointing_enable({"use_reentrant": True})
        model.train()
        base = model.get_base_model()
        lora = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(lora, lr=5e-5, foreach=True)  # foreach: the CUDA default
        ids = torch.zeros((batch, seq), dtype=torch.long)
        mode = LiveBytes()
        mode.existing([*model.parameters(), *model.buffers()])
        with mode:
            for step in range(2):
                if step:  # the second step, with AdamW's states, is the one reported
                    mode.peak, mode.phase_peaks = mode.live, {}
                mode.phase = "forward"
                with torch.autocast("cpu", dtype=torch.bfloat16):  # the Trainer's bf16 autocast (CUDA there)
                    hidden = base.model(input_ids=ids).last_hidden_state
                    mode.phase = "loss"
                    hidden.register_hook(lambda _g: setattr(mode, "phase", "backward-layers"))
                    logits = base.lm_head(hidden).float()
                    # transformers 4.36's MixtralForCausalLM loss: shifted contiguous copies, mean cross entropy
                    shift_logits = logits[..., :-1, :].contiguous().view(-1, shape["vocab"])
                    shift_labels = ids[..., 1:].contiguous().view(-1)
                    loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels)
                del hidden, logits, shift_logits
                mode.phase = "backward-loss"
                loss.backward()
                del loss
                mode.phase = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
        named = dict(model.named_parameters())
        frozen = {n: p.numel() for n, p in named.items() if not p.requires_grad}
    quantized = sum(v for n, v in frozen.items() if n.endswith(".weight") and ("_proj" in n or ".w" in n or "gate" in n)
                    and "lm_head" not in n and "embed" not in n)
    return {"layers": layers, "batch": batch, "seq": seq, "recompute": recompute, "keep_input": keep_input,
            "peak_bytes": mode.peak, "peak_phase": mode.peak_phase, "phase_peaks": dict(mode.phase_peaks),
            "lora_params": sum(p.numel() for p in lora), "quantized_params": quantized,
            "bf16_params": sum(frozen.values()) - quantized}


def extrapolate(rows: dict[int, dict], to: int) -> dict:
    """Each phase's peak is linear in the layers: its line through the two largest layer counts, taken to ``to``
    layers; the step's peak is the highest phase there. The smallest count checks the line."""
    ordered = sorted(rows.items())
    (l1, a), (l2, b), (l3, c) = ordered[0], ordered[-2], ordered[-1]
    phases = {}
    for phase, top in c["phase_peaks"].items():
        slope = (top - b["phase_peaks"][phase]) / (l3 - l2)
        off = a["phase_peaks"][phase] / (top + (l1 - l3) * slope) - 1
        phases[phase] = {"peak_bytes": top + (to - l3) * slope, "per_layer_bytes": slope, "line_error": off}
    phase = max(phases, key=lambda k: phases[k]["peak_bytes"])
    per_layer = lambda key: c[key] + (to - l3) * (c[key] - b[key]) / (l3 - l2)  # noqa: E731
    return {"peak_bytes": phases[phase]["peak_bytes"], "peak_phase": phase, "phases": phases,
            "per_layer_bytes": phases[phase]["per_layer_bytes"],
            "line_error": max(abs(x["line_error"]) for x in phases.values()),
            "lora_params": per_layer("lora_params"), "quantized_params": per_layer("quantized_params"),
            "bf16_params": per_layer("bf16_params")}


def workload(shape: dict, batch: int, seq: int, recompute: bool):
    """The same step as an llmadapt workload (Study B's recipe)."""
    from llmadapt import Workload

    return Workload.from_dict({
        "kind": "finetune", "precision": "bf16",
        "model": {"preset": "mixtral-8x7b", "vocab_size": shape["vocab"], "hidden_size": shape["hidden"],
                  "intermediate_size": shape["intermediate"], "num_layers": shape["layers"],
                  "num_heads": shape["heads"], "num_kv_heads": shape["kv_heads"], "num_experts": shape["experts"],
                  "experts_per_token": shape["top_k"]},
        "train": {"seq_len": seq, "global_batch": batch, "micro_batch": batch},
        "lora": {"rank": 16, "target_modules": ["w1", "w2", "w3", "gate"]},
        "optimizations": {"quantization": "nf4", "flash_attention": True,
                          "recompute": "full" if recompute else "none"}})


def estimate_dynamic(shape: dict, batch: int, seq: int, recompute: bool) -> float:
    """llmadapt's estimate of the same step, less the weights and the runtime: gradients + optimizer + activations."""
    from llmadapt.analysis.perf import estimate as est
    from llmadapt.contract.catalog import find_device

    m = est.memory(workload(shape, batch, seq, recompute), find_device("A40"), batch, est.Options(check_fit=False))
    return m.gradients_bytes + m.optimizer_bytes + m.activations_bytes


def study_bounds(small: float, big: float) -> dict:
    """Study B's max batches (4 fit on the small device and 5 did not, 17 on the big one and 18 did not) as bounds on
    a fixed cost F and a cost per sample m: 4m + F <= small < 5m + F and 17m + F <= big < 18m + F."""
    feasible = []
    for k in range(1, 100000):
        m = (big - small) / 14 + k * ((big - small) / 12 - (big - small) / 14) / 100000
        lo, hi = max(small - 5 * m, big - 18 * m), min(small - 4 * m, big - 17 * m)
        if lo < hi:
            feasible.append((m, lo, hi))
    return {"per_sample": (feasible[0][0], feasible[-1][0]),
            "fixed": (min(f[1] for f in feasible), max(f[2] for f in feasible))}


def max_batches(shape: dict, devices: list[str], seqs: list[int], layer_counts: list[int], keep: bool) -> list[dict]:
    """The largest batch that fits each device: the modelled weights + the measured dynamic peak + 1 GiB of runtime
    (the estimate's default for a GPU) against the catalog's capacity; beside it, the estimate's own max batch."""
    from llmadapt.analysis.perf import estimate as est
    from llmadapt.contract.catalog import find_device

    peaks: dict[tuple, float] = {}

    def peak(b, seq, recompute):
        if (b, seq, recompute) not in peaks:
            rows = {n: measure(shape, n, b, seq, recompute, keep) for n in layer_counts}
            peaks[b, seq, recompute] = extrapolate(rows, shape["layers"])["peak_bytes"]
        return peaks[b, seq, recompute]

    first = measure(shape, layer_counts[0], 1, seqs[0], True, keep)
    scale = shape["layers"] / layer_counts[0]
    weights = (first["quantized_params"] * scale * NF4_BYTES + first["bf16_params"] * 2
               + first["lora_params"] * scale * 4)
    out = []
    for name in devices:
        dev = find_device(name)
        for recompute in (True, False):
            for seq in seqs:
                def fits(b, seq=seq, recompute=recompute, cap=dev.memory_bytes):
                    return weights + peak(b, seq, recompute) + est.GPU_RUNTIME_OVERHEAD <= cap

                w = workload(shape, 1, seq, recompute)
                guess = est.max_micro_batch(w, dev, est.Options(check_fit=False))
                b = max(1, guess)  # start at the estimate's answer and step to the boundary: few fake steps
                if fits(b):
                    while fits(b + 1):
                        b += 1
                else:
                    while b > 0 and not fits(b):
                        b -= 1
                out.append({"device": dev.name, "recompute": recompute, "seq": seq, "measured": b, "estimate": guess,
                            "weights_bytes": weights, "estimate_weights_bytes": est.memory(w, dev, 1).weights_bytes})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one batch and length (seconds)")
    ap.add_argument("--batches", default="1,4,8,17")
    ap.add_argument("--seqs", default="128,256,512,1024")
    ap.add_argument("--layers", default="1,2,4")
    ap.add_argument("--no-keep-input", action="store_true", help="bitsandbytes 0.50's MatMul4Bit (keeps no input)")
    ap.add_argument("--maxbatch", metavar="DEVICES",
                    help="catalog devices (A40,A100-80GB): the largest batch that fits each")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    shape = TINY if args.smoke else MIXTRAL
    batches = [2] if args.smoke else [int(x) for x in args.batches.split(",")]
    seqs = [32] if args.smoke else [int(x) for x in args.seqs.split(",")]
    layer_counts = [int(x) for x in args.layers.split(",")]
    keep = not args.no_keep_input
    results = []
    t0 = time.perf_counter()
    if args.maxbatch:
        rows = max_batches(shape, args.maxbatch.split(","), seqs, layer_counts, keep)
        print(f"shape {shape}; bitsandbytes keeps the 4-bit linears' input: {keep}")
        print(f"weights: modelled {rows[0]['weights_bytes'] / GIB:.3f} GiB, the estimate's "
              f"{rows[0]['estimate_weights_bytes'] / GIB:.3f} GiB; runtime 1 GiB")
        print("device     recompute  seq    max batch: fake-measured  estimate")
        for r in rows:
            print(f"{r['device']:10} {'full' if r['recompute'] else 'none':9}  {r['seq']:5}  {r['measured']:24}  "
                  f"{r['estimate']:8}")
        from llmadapt.contract.catalog import find_device

        bounds = study_bounds(find_device("A40").memory_bytes / GIB, find_device("A100-80GB").memory_bytes / GIB)
        print("Study B's 4 (A40) and 17 (80 GB) at catalog capacities: per sample {:.2f}-{:.2f} GiB, fixed "
              "{:.1f}-{:.1f} GiB".format(*bounds["per_sample"], *bounds["fixed"]))
        print(f"({time.perf_counter() - t0:.0f} s)")
        if args.json:
            Path(args.json).write_text(json.dumps({"shape": shape, "keep_input": keep, "maxbatch": rows,
                                                   "study_bounds": bounds}, indent=1))
        return 0
    print(f"shape {shape}; bitsandbytes keeps the 4-bit linears' input: {keep}")
    print("recompute  batch  seq    peak GiB @%d layers  per layer MiB  line error  peak in          "
          "estimate GiB  error" % shape["layers"])
    for recompute in (True, False):
        for seq in seqs:
            for batch in batches:
                rows = {n: measure(shape, n, batch, seq, recompute, keep) for n in layer_counts}
                x = extrapolate(rows, shape["layers"])
                x["estimate_bytes"] = estimate_dynamic(shape, batch, seq, recompute)
                results.append({"recompute": recompute, "batch": batch, "seq": seq, **x,
                                "rows": list(rows.values())})
                print(f"{'full' if recompute else 'none':9}  {batch:5}  {seq:5}  {x['peak_bytes'] / GIB:19.3f}  "
                      f"{x['per_layer_bytes'] / 2**20:13.1f}  {x['line_error']:10.2%}  {x['peak_phase']:15}  "
                      f"{x['estimate_bytes'] / GIB:12.3f}  {x['estimate_bytes'] / x['peak_bytes'] - 1:+6.1%}")
    static = results[0]
    weights = static["quantized_params"] * NF4_BYTES + static["bf16_params"] * 2 + static["lora_params"] * 4
    print(f"weights (modelled): {static['quantized_params'] / 1e9:.3f} B 4-bit parameters x {NF4_BYTES:.4f} B "
          f"+ {static['bf16_params'] / 1e9:.3f} B bf16 + {static['lora_params'] / 1e6:.1f} M LoRA fp32 = "
          f"{weights / GIB:.3f} GiB")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "keep_input": keep, "weights_bytes": weights,
                                               "nf4_bytes_per_param": NF4_BYTES, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
