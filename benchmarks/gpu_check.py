"""Every GPU path of llmadapt on one device, in one script, in a few minutes: the check to run when a GPU is at hand.

Runs from a source checkout, not installed, with the interpreter that runs it (it must have torch and
transformers: a GPU machine's own Python) and no network. What a bare GPU machine with PyTorch lacks is a few
pure-Python wheels of the orchestrator: jsonschema, referencing, jsonschema-specifications and rpds-py (under
1 MB together; rpds-py is compiled: bring the wheel for the machine's Python and platform). DeepSpeed's and
Megatron-core's steps run where those import (their wheels are small enough to bring: deepspeed is an sdist that
builds its ops when first used, megatron-core a few MB); elsewhere they are skipped, saying why.

    PYTHONPATH=. python3 benchmarks/gpu_check.py               # on the GPU: 6 minutes at most (--budget)
    PYTHONPATH=. python3 benchmarks/gpu_check.py --rehearse    # the same steps on a CPU with tiny shapes (CI)

Steps, each a real llmadapt command under its own timeout: the reference adapter on tiny-llama (one step
profiled at operator level, telemetry); a ~1B Llama in bf16 at seq 2048 with SDPA (flash) attention, one step
profiled at level full (kernel basis, NVML energy per token, CUDA peak memory, MFU); `llmadapt trace` on that
step's own Kineto trace; `micro peak` (bf16 GEMM) beside a bare torch.matmul loop in the same process; `estimate
--validate` against the measured 1B step; a LoRA fine-tune evaluated before and after; DeepSpeed ZeRO-2 and
ZeRO-3 and Megatron-core on one device; `maxbatch` last, with what the budget has left. The whole check keeps to
its budget (6 minutes on a GPU: a lent machine's minutes are few). Results go into one file
(OUT/gpu-check.json) as each step ends. Exit status 0 when no step failed (skipped steps say why).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent

# The ~1B Llama (Llama-2's shape at hidden 2048, 16 layers: 1.1B parameters with its 32k vocabulary).
ONE_B = ["model.hidden_size=2048", "model.intermediate_size=5632", "model.num_layers=16", "model.num_heads=16",
         "model.num_kv_heads=16", "model.vocab_size=32000", "model.max_position_embeddings=2048"]


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


class Check:
    """The steps, their results in one file, each under its own timeout."""

    def __init__(self, out: Path, rehearse: bool) -> None:
        self.out, self.rehearse = out, rehearse
        self.out.mkdir(parents=True, exist_ok=True)
        self.file = out / "gpu-check.json"
        self.results: dict[str, Any] = {"rehearsal": rehearse, "machine": {}, "steps": []}
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        # The reference adapter and the core's tools (micro-benchmarks) run on this interpreter (it has torch): no
        # environment to build, no network.
        self.env.setdefault("LLMADAPT_PYTHON_TORCH", sys.executable)
        self.env.setdefault("LLMADAPT_PYTHON_TOOLS", sys.executable)
        self.runs = out / "runs"
        self.catalog = out / "devices.toml"
        self.found: dict[str, Any] = {}

    def save(self) -> None:
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        tmp.replace(self.file)

    def llmadapt(self, *args: str, timeout: float) -> tuple[int, dict[str, Any] | None, str]:
        """One llmadapt command with --json; (exit status, its JSON or None, the end of its stderr)."""
        done = subprocess.run([sys.executable, "-m", "llmadapt.cli", *args, "--json"], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        try:
            data = json.loads(done.stdout)
        except ValueError:
            data = None
        return done.returncode, data, done.stderr.strip()[-600:]

    def step(self, name: str, timeout: float, body: Callable[[float], dict[str, Any]]) -> None:
        """Run one step: its figures, or why it failed, was skipped or ran out of time; saved at once."""
        t0 = time.monotonic()
        entry: dict[str, Any] = {"step": name, "timeout_s": timeout}
        try:
            entry.update(status="ok", figures=body(timeout))
        except Skip as exc:
            entry.update(status="skipped", message=str(exc))
        except subprocess.TimeoutExpired:
            entry.update(status="timeout", message=f"no result within {timeout:.0f} s")
        except Exception as exc:  # noqa: BLE001 - a failed step is a result; the next one runs
            entry.update(status="failed", message=f"{type(exc).__name__}: {exc}"[:1200])
        entry["seconds"] = round(time.monotonic() - t0, 1)
        self.results["steps"].append(entry)
        self.save()
        print(f"{name:<18} {entry['status']:<8} {entry['seconds']:>6.1f} s  "
              f"{entry.get('message') or _short(entry.get('figures'))}", flush=True)

    def run(self, workload: str, adapter: str, overrides: list[str], timeout: float) -> dict[str, Any]:
        rc, data, err = self.llmadapt("run", workload, "--adapter", adapter, "--out", str(self.runs),
                                      *sets(*overrides), timeout=timeout)
        if data is None:
            raise RuntimeError(f"exit {rc}: {err}")
        summary = data["summary"]
        if summary["status"] != "ok":
            failure = (summary.get("failures") or [{}])[0]
            raise RuntimeError(f"run failed ({failure.get('cause')}): {str(failure.get('message'))[:500]}")
        return data


class Skip(Exception):
    """A step that cannot run here, and why."""


def _short(figures: dict[str, Any] | None) -> str:
    if not figures:
        return ""
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in list(figures.items())[:6])


def run_figures(data: dict[str, Any]) -> dict[str, Any]:
    """What a run's summary says of the GPU paths."""
    s = data["summary"]
    out: dict[str, Any] = {"run_dir": data["run_dir"], "device": (s.get("device") or {}).get("name"),
                           "step_p50_s": (s.get("step_time_s") or {}).get("p50"),
                           "tokens_per_s": (s.get("tokens_per_s") or {}).get("mean"),
                           "mfu": s.get("mfu"), "peak_memory_bytes": s.get("peak_memory_bytes"),
                           "memory_kind": s.get("memory_kind")}
    t = s.get("telemetry") or {}
    out.update(telemetry_source=t.get("source"), energy_j=t.get("energy_j"), joules_per_token=t.get("joules_per_token"),
               telemetry_unavailable=t.get("unavailable"))
    b = s.get("breakdown")
    if b and b.get("profiled_steps"):
        ops = b.get("operators") or []
        total = sum(o["seconds"] for o in ops) or None
        modules = b.get("modules") or []
        mod_total = sum(m["seconds"] for m in modules) or None
        out.update(basis=b["basis"], operator_classes={o["name"]: round(o["seconds"] * 1e3, 3) for o in ops},
                   named_operator_share=1 - sum(o["seconds"] for o in ops if o["name"] == "other") / total
                   if total else None,
                   named_module_share=1 - sum(m["seconds"] for m in modules if m["name"] == "other") / mod_total
                   if mod_total else None,
                   idle_s=b.get("idle_seconds"), compute_s=b.get("compute_seconds"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes, on whatever device (CI runs this)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="results folder")
    parser.add_argument("--only", help="comma-separated step names to run (default: all)")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (default: 360 on a GPU, 1500 "
                        "rehearsing): a step gets at most what is left; steps past it are skipped, saying so")
    args = parser.parse_args()
    check = Check(args.out.resolve(), args.rehearse)
    only = set(args.only.split(",")) if args.only else None
    r = args.rehearse

    import torch  # this interpreter runs the reference adapter: it must have torch

    cuda = torch.cuda.is_available()
    if not cuda and not r:
        print("no CUDA device visible: run with --rehearse on a CPU", file=sys.stderr)
        return 2
    machine = check.results["machine"]
    machine.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                   device=torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
                   hostname=platform.node(), started=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    if cuda:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True)
        machine["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()[:200]
    for package in ("transformers", "deepspeed", "megatron.core", "pynvml", "jsonschema"):
        machine[package] = "present" if _importable(package) else "missing"
    check.save()

    tiny = "examples/tiny-llama.toml"
    big = ONE_B + ["train.seq_len=2048", "train.global_batch=4", "train.micro_batch=4"] if not r else \
        ["train.seq_len=64", "train.global_batch=4", "train.micro_batch=4"]
    big += ["precision=bf16", "optimizations.flash_attention=true", "train.steps=4", "train.warmup_steps=2",
            "profile.steps=[4]", "profile.level=full", "telemetry.interval_s=0.2"]

    def wanted(name: str) -> bool:
        return only is None or name in only

    def tiny_run(timeout: float) -> dict[str, Any]:
        data = check.run(tiny, "torch", ["profile.steps=[3]", "profile.level=operator", "telemetry.interval_s=0.1"],
                         timeout)
        return run_figures(data)

    def one_b(timeout: float) -> dict[str, Any]:
        data = check.run(tiny, "torch", big, timeout)
        check.found["big"] = data
        figures = run_figures(data)
        if cuda and "attention" not in (figures.get("operator_classes") or {}):
            figures["warning"] = "no attention kernel in the profiled step: SDPA did not run a fused kernel"
        return figures

    def trace(timeout: float) -> dict[str, Any]:
        data = check.found.get("big") or _missing("llama-1b")
        folder = Path(data["run_dir"]) / "profile"
        steps = sorted(folder.glob("step-*"))
        if not steps:
            raise RuntimeError(f"no Kineto trace kept in {folder}")
        source = steps[0]
        if not cuda:  # a CPU step has no kernels: rehearse the command on a real GPU trace where one is at hand
            shared = REPO.parent / "shared" / "data" / "kineto-gpu" / "a100-2rank-nccl.json.gz"
            if not shared.is_file():
                raise Skip("a CPU trace has no kernels, and no real GPU trace is at hand to rehearse with")
            source = shared
        rc, out, err = check.llmadapt("trace", str(source), timeout=timeout)
        if rc != 0 or out is None:
            raise RuntimeError(f"exit {rc}: {err}")
        ranks = out["ranks"]
        b = ranks[0]["breakdown"]
        if b.get("error"):
            raise RuntimeError(b["error"])
        total = sum(o["seconds"] for o in b["operators"]) or 1.0
        return {"files": len(ranks), "span_s": b["step_seconds"], "compute_s": b["compute_seconds"],
                "idle_s": b["idle_seconds"],
                "named_kernel_share": 1 - sum(o["seconds"] for o in b["operators"] if o["name"] == "other") / total,
                "classes": {o["name"]: round(o["seconds"] * 1e3, 3) for o in b["operators"][:8]}}

    def micro_peak(timeout: float) -> dict[str, Any]:
        sizes = "256,512" if r else "4096,8192"
        # a CPU is described by measurement: saved in this check's own catalog, never the user's
        extra = ["--save", "gpu-check-cpu", "--catalog-file", str(check.catalog)] if not cuda else []
        rc, out, err = check.llmadapt("micro", "peak", "--dtypes", "bf16", "--gemm-sizes", sizes, "--out",
                                      str(check.runs), *extra, timeout=timeout)
        if out is None:
            raise RuntimeError(f"exit {rc}: {err}")
        from llmadapt.contract.catalog import device_for_reported

        measured = out["peaks"].get("flops_per_s.bf16")
        spec = device_for_reported(out["device_name"])
        figures = {"device": out["device_name"], "micro_peak_bf16_flops_per_s": measured,
                   "bare_matmul_bf16_flops_per_s": _bare_matmul(torch, 512 if r else 8192, cuda),
                   "catalog_bf16_flops_per_s": spec.peak("bf16") if spec else None,
                   "memory_bytes_per_s": out["peaks"].get("memory_bytes_per_s")}
        if measured:
            figures["micro_over_bare"] = measured / figures["bare_matmul_bf16_flops_per_s"]
            if figures["catalog_bf16_flops_per_s"]:
                figures["micro_over_catalog"] = measured / figures["catalog_bf16_flops_per_s"]
        return figures

    def estimate(timeout: float) -> dict[str, Any]:
        data = check.found.get("big") or _missing("llama-1b")
        device = [] if cuda else ["--device", "gpu-check-cpu", "--catalog", str(check.catalog)]
        rc, out, err = check.llmadapt("estimate", "--validate", data["run_dir"], *device, timeout=timeout)
        if out is None:
            raise RuntimeError(f"exit {rc}: {err}")
        row = out["rows"][0]
        return {"device": out["device"], "measured_step_s": row["measured_step_s"],
                "predicted_step_s": row["predicted_step_s"], "error": row["error"]}

    def maxbatch(timeout: float) -> dict[str, Any]:
        limit = ["--memory-limit", "3G", "--max-batch", "8"] if not cuda else ["--start", "8", "--max-batch", "64"]
        workload = [tiny] if r else [tiny, *sets(*ONE_B, "train.seq_len=2048", "precision=bf16",
                                                 "optimizations.flash_attention=true")]
        rc, out, err = check.llmadapt("maxbatch", *workload, "--adapter", "torch", "--out", str(check.runs), *limit,
                                      timeout=timeout)
        if out is None:
            raise RuntimeError(f"exit {rc}: {err}")
        result = out.get("result", out)
        return {"max_batch": result.get("max_batch"), "first_failing": result.get("first_failing"),
                "probes": len(out.get("probes", [])), "message": str(result.get("message"))[:200]}

    def lora(timeout: float) -> dict[str, Any]:
        data = check.run("examples/finetune-eval.toml", "torch",
                         ["lora.rank=8", "lora.alpha=16", "train.steps=38", "eval.every=20", "eval.examples=32"],
                         timeout)
        evals = data["summary"].get("evaluations") or []
        if len(evals) < 2:
            raise RuntimeError(f"{len(evals)} evaluation(s): expected before and after")
        return {"eval_loss_before": evals[0]["loss"], "eval_loss_after": evals[-1]["loss"],
                "exact_match_before": evals[0].get("exact_match"), "exact_match_after": evals[-1].get("exact_match"),
                **{k: v for k, v in run_figures(data).items() if k in ("device", "step_p50_s", "mfu")}}

    def stack(adapter: str, module: str, overrides: list[str]) -> Callable[[float], dict[str, Any]]:
        def body(timeout: float) -> dict[str, Any]:
            variable = f"LLMADAPT_PYTHON_{adapter.upper()}"
            if _importable(module):
                check.env.setdefault(variable, sys.executable)
            elif variable not in check.env and not _environment_ready(adapter, check.env):
                raise Skip(f"{module} does not import here and no {adapter} environment is built "
                           f"(bring its wheel, or set {variable})")
            data = check.run(tiny, adapter, overrides + ["profile.steps=[3]", "profile.level=operator"], timeout)
            return run_figures(data)
        return body

    steps: list[tuple[str, float, Callable[[float], dict[str, Any]]]] = [
        ("tiny-llama", 120, tiny_run),
        ("llama-1b", 150 if not r else 120, one_b),
        ("trace", 60, trace),
        ("micro-peak", 60, micro_peak),
        ("estimate", 30, estimate),
        ("lora-eval", 120, lora),
        ("deepspeed-zero2", 120, stack("deepspeed", "deepspeed", ["optimizations.zero_stage=2"])),
        ("deepspeed-zero3", 120, stack("deepspeed", "deepspeed", ["optimizations.zero_stage=3"])),
        ("megatron", 120, stack("megatron", "megatron.core", [])),
        ("maxbatch", 90 if cuda else 150, maxbatch),  # last: its probes take what the budget has left
    ]
    print(f"gpu check on {machine['device']} (torch {machine['torch']}, CUDA {machine['cuda']}): "
          f"results in {check.file}", flush=True)
    budget = args.budget or (1500.0 if r else 360.0)
    deadline = time.monotonic() + budget
    for name, timeout, body in steps:
        if not wanted(name):
            continue
        left = deadline - time.monotonic()
        if left < 10:
            check.step(name, 0, _out_of_budget(budget))
            continue
        check.step(name, min(timeout, left), body)
    check.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    check.save()
    failed = [s["step"] for s in check.results["steps"] if s["status"] in ("failed", "timeout")]
    print(f"{len(check.results['steps'])} steps: " + ", ".join(
        f"{sum(s['status'] == k for s in check.results['steps'])} {k}" for k in ("ok", "skipped", "failed", "timeout")))
    return 1 if failed else 0


def _out_of_budget(budget: float) -> Callable[[float], dict[str, Any]]:
    def body(_timeout: float) -> dict[str, Any]:
        raise Skip(f"the check's budget of {budget:.0f} s was spent before this step")
    return body


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _missing(step: str):
    raise Skip(f"needs the {step} step's run, which did not complete")


def _environment_ready(adapter: str, env: dict[str, str]) -> bool:
    """Whether llmadapt's own environment for ADAPTER is built (a CI rehearsal has them)."""
    done = subprocess.run([sys.executable, "-m", "llmadapt.cli", "env", "list", "--json"], env=env, cwd=REPO,
                          capture_output=True, text=True)
    try:
        return any(e.get("environment") == adapter and e.get("status") == "ready" for e in json.loads(done.stdout))
    except (ValueError, AttributeError):
        return False


def _bare_matmul(torch, n: int, cuda: bool) -> float:
    """torch.matmul's best of several timed calls at n x n x n in bf16: the number `micro peak` should reach."""
    device = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(3):
        torch.matmul(a, b)
    for _ in range(10):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            torch.matmul(a, b)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / 5)
    return 2 * n**3 / best


if __name__ == "__main__":
    sys.exit(main())
