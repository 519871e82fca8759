"""Peak memory of writing a checkpoint and of loading it on each rank, whole against bounded, on one model.

Two measurements, each side by side on the same model (about one billion parameters by default: Llama-shaped,
hidden 2048, 16 layers, vocabulary 32000, fp32, 3.8 GB of weights):

1. Writing the canonical checkpoint, each way in its own process, peak resident memory from getrusage:
   - **whole**: what llmadapt did before: the model built whole by transformers (``from_config``) and saved
     with ``save_pretrained``;
   - **streaming**: ``llmadapt.models`` now: tensor by tensor into shards of at most ``--shard-mb``.
2. Loading it on each training stack at two ranks: ``llmadapt run`` with ``model.path`` set to the streamed
   folder, one SGD step (no optimizer state: the step is only there so the run is a real one), and each rank's
   ``setup_peak_rss_bytes`` (the process's high-water mark when the model is built and loaded, imports
   included) and ``setup_seconds``; the first step's time beside them. The stacks and layouts:
   torch dp=2 (DDP: every rank holds the whole model, loaded by transformers onto the meta device first),
   deepspeed dp=2 ZeRO-3 (deepspeed.zero.Init through transformers' HfDeepSpeedConfig: each rank materialises
   its partition), megatron tp=2 (each rank reads the tensors of its slice and converts them; the converted
   slice cached, so a second run is also measured), colossalai tp=2 (HybridParallelPlugin: built inside
   LazyInitContext, materialised sliced, each rank loading its slices with booster.load_model).

    python benchmarks/model_loading.py                    # about 15 minutes on 2 cores, 20 GB of memory
    python benchmarks/model_loading.py --layers 2 --hidden 512 --json   # a quick look
    python benchmarks/model_loading.py --smoke            # hidden 64, one layer, 1 MiB shards, torch only (CI)

Not a test: it prints figures and asserts nothing about time or memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STACKS = {
    "torch": ["parallelism.dp=2"],
    "deepspeed": ["parallelism.dp=2", "optimizations.zero_stage=3"],
    "megatron": ["parallelism.tp=2"],
    "colossalai": ["parallelism.tp=2"],
}

WRITE = """
import json, resource, sys, time
from pathlib import Path
from llmadapt.spec import ModelSpec
model, out, how, shard = ModelSpec(**json.loads(sys.argv[1])), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
start = time.perf_counter()
if how == "streaming":
    from llmadapt.models import _build
    _build(model, 0, out, shard_bytes=shard)
else:
    import torch
    from transformers import AutoModelForCausalLM
    from llmadapt.models import build_tokenizer, hf_config
    config = hf_config(model, build_tokenizer(model.vocab_size, out))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out), max_shard_size=shard)
print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "seconds": time.perf_counter() - start}))
"""


def model_spec(args) -> dict:
    return dict(name="bench-1b", family="llama", vocab_size=32000, hidden_size=args.hidden,
                intermediate_size=args.hidden * 11 // 4, num_layers=args.layers, num_heads=16, num_kv_heads=16,
                max_position_embeddings=256)


def params(m: dict) -> int:
    h, i, v = m["hidden_size"], m["intermediate_size"], m["vocab_size"]
    return 2 * v * h + m["num_layers"] * (4 * h * h + 3 * h * i + 2 * h) + h


def write(model: dict, out: Path, how: str, shard_bytes: int) -> dict:
    out.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-c", WRITE, json.dumps(model), str(out), how, str(shard_bytes)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load(adapter: str, folder: Path, out: Path, layout: list[str]) -> dict:
    from llmadapt import Workload, run
    from llmadapt.contract.jsonl import read_jsonl

    w = Workload().with_overrides([
        f"model.path={folder}", "train.seq_len=16", "train.global_batch=2", "train.micro_batch=1", "train.steps=1",
        "train.warmup_steps=0", "train.optimizer=sgd", "telemetry.interval_s=0", *layout])
    result = run(w, adapter, out=out, timeout=1800)
    # Loading is measured even when the step then runs out of memory (the figures come before the first step).
    ranks = {"estimate": estimated_weights(w.for_adapter(adapter)),
             "step": "ok" if result.ok else str(result.summary.failures[0].message)[:160]}
    for path in sorted(result.run_dir.glob("rank-*.jsonl")):
        records = read_jsonl(path)
        metric = {r["name"]: r["value"] for r in records if r["type"] == "metric"}
        step = next((r for r in records if r["type"] == "step"), None)
        ranks[path.stem] = {name: metric.get(name) for name in
                            ("load_peak_rss_bytes", "load_seconds", "setup_peak_rss_bytes", "setup_seconds")}
        ranks[path.stem]["first_step_seconds"] = step["seconds"] if step else None
    return ranks


def estimated_weights(w) -> float:
    """The weights one rank holds by `llmadapt estimate`'s memory model (the device does not enter this part)."""
    from llmadapt.analysis.perf.estimate import memory
    from llmadapt.contract.catalog import find_device

    return memory(w, find_device("A100-80GB"), 1).weights_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--shard-mb", type=int, default=1024, help="shard size of both writers (MiB)")
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated adapters to load with")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size: hidden 64, one layer, 1 MiB shards, loaded by torch alone (flags "
                             "given explicitly still count: --stacks torch,megatron adds megatron's cached-slice "
                             "run); shows that the script works, in seconds; its figures mean little")
    args = parser.parse_args()
    if args.smoke:  # its sizes become the defaults: flags given explicitly still count
        parser.set_defaults(hidden=64, layers=1, shard_mb=1, stacks="torch")
        args = parser.parse_args()
    model = model_spec(args)
    n = params(model)
    results: dict = {"model": model, "parameters": n, "weights_bytes": 4 * n, "shard_bytes": args.shard_mb << 20}
    with tempfile.TemporaryDirectory(prefix="llmadapt-loading-") as tmp:
        tmp = Path(tmp)
        results["write"] = {how: write(model, tmp / how, how, args.shard_mb << 20) for how in ("whole", "streaming")}
        from llmadapt.host import state_dir
        from llmadapt.modelfolder import content_hash

        for cached in (state_dir() / "megatron-shards").glob(f"{content_hash(tmp / 'streaming')}-*"):
            cached.unlink()  # the first megatron run converts: its slice cache starts empty
        results["load"] = {}
        for adapter in args.stacks.split(","):
            results["load"][adapter] = load(adapter, tmp / "streaming", tmp / "runs", STACKS[adapter])
            if adapter == "megatron":  # again: the converted slices come from the cache now
                results["load"]["megatron (cached slices)"] = load(adapter, tmp / "streaming", tmp / "runs",
                                                                   STACKS[adapter])
    if args.json:
        print(json.dumps(results, indent=2))
        return
    gb = 1e9
    print(f"model: {n / 1e9:.2f} B parameters, {4 * n / gb:.2f} GB in fp32; shards of {args.shard_mb} MiB")
    for how, r in results["write"].items():
        print(f"write {how:<10} peak RSS {r['peak_rss_bytes'] / gb:6.2f} GB   {r['seconds']:6.1f} s")
    def figure(value, unit="GB"):
        return "-" if value is None else f"{value / gb:6.2f} GB" if unit == "GB" else f"{value:6.1f} s"

    for adapter, ranks in results["load"].items():
        ranks = dict(ranks)
        print(f"load  {adapter:<26} the estimate's weights per rank {ranks.pop('estimate') / gb:.2f} GB; "
              f"step: {ranks.pop('step')}")
        for rank, r in ranks.items():
            print(f"      {rank}  loaded: peak RSS {figure(r['load_peak_rss_bytes'])} at {figure(r['load_seconds'], 's')}"
                  f"   setup: peak RSS {figure(r['setup_peak_rss_bytes'])} in {figure(r['setup_seconds'], 's')}"
                  f"   first step {figure(r['first_step_seconds'], 's')}")


if __name__ == "__main__":
    main()
