"""How fast does the command line start, and does it stay clear of torch?

llmadapt promises a light core: ``import llmadapt`` and the commands that only look things up
must not load torch (frameworks load only inside workers). This script times, as
subprocesses, the same interpreter doing nothing (``python -c pass``: the floor), then
``llmadapt --help`` and ``llmadapt adapters`` (median of --repeat runs each), and checks for
every command which heavy modules (torch, transformers, numpy, ...) ended up in sys.modules.
With --importtime it also lists the slowest imports (``python -X importtime``) of each command.

    python benchmarks/cli_startup.py                  # 10 runs of each
    python benchmarks/cli_startup.py --repeat 20 --importtime --json
    python benchmarks/cli_startup.py --smoke          # one timed run of each (CI's smoke pass, seconds)

Not a test: it prints figures; it exits 1 only when a command failed or loaded torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("torch", "transformers", "numpy", "safetensors", "tokenizers", "peft", "accelerate", "bitsandbytes")
COMMANDS = {"--help": ["--help"], "adapters": ["adapters"]}

# Runs llmadapt's CLI the way the console script does, then reports which heavy modules were
# imported, on stderr as one tagged JSON line (the command's own output is untouched).
PROBE = r"""
import sys, json
sys.argv = ["llmadapt", *sys.argv[1:]]
code = 0
try:
    from llmadapt.cli import main
    main()
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
heavy = %r
print("@@probe " + json.dumps({"code": code, "loaded": [m for m in heavy if m in sys.modules],
                               "modules": len(sys.modules)}), file=sys.stderr)
""" % (HEAVY,)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=10, help="timed runs per command (default 10)")
    p.add_argument("--python", default=sys.executable, help="interpreter with llmadapt installed (default: this one)")
    p.add_argument("--importtime", action="store_true", help="also list the slowest imports of each command")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest size (one timed run of each; flags given explicitly still count): a pass that "
                        "shows the script works, in seconds; its figures mean little")
    args = p.parse_args(argv)
    if args.smoke:  # its sizes become the defaults: flags given explicitly still count
        p.set_defaults(repeat=1)
        args = p.parse_args(argv)
    return args


def console_script(python: str) -> list[str]:
    """The installed `llmadapt` entry point next to the interpreter, else `python -c` the same call."""
    script = Path(python).parent / "llmadapt"
    if script.is_file():
        return [str(script)]
    return [python, "-c", "import sys; from llmadapt.cli import main; sys.argv[0] = 'llmadapt'; main()"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("PYTHONPROFILEIMPORTTIME", None)
    # Cached bytecode, as an installed package has it: with PYTHONDONTWRITEBYTECODE set (as on the machines
    # this project is built on) every run compiled llmadapt's modules again, about 25 ms of `adapters`.
    e.pop("PYTHONDONTWRITEBYTECODE", None)
    return e


def time_command(cmd: list[str], repeat: int) -> dict:
    subprocess.run(cmd, capture_output=True, env=env())  # untimed: warms the page cache and .pyc files
    times, codes = [], set()
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, env=env())
        times.append(time.perf_counter() - start)
        codes.add(proc.returncode)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "runs": repeat, "exit_codes": sorted(codes)}


def probe(python: str, args: list[str]) -> dict:
    proc = subprocess.run([python, "-c", PROBE, *args], capture_output=True, text=True, env=env())
    for line in proc.stderr.splitlines():
        if line.startswith("@@probe "):
            return json.loads(line[len("@@probe "):])
    raise RuntimeError(f"probe of {args} gave no report (exit {proc.returncode}): {proc.stderr[-500:]}")


def importtime(python: str, args: list[str], top: int = 8) -> dict:
    """Parse `python -X importtime`: self and cumulative microseconds per module, the slowest first."""
    proc = subprocess.run([python, "-X", "importtime", "-c", PROBE, *args], capture_output=True, text=True, env=env())
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative_us, name = line[len("import time:"):].split("|", 2)
        name = name[1:]  # "| " then two spaces per level of nesting
        rows.append({"module": name.strip(), "top_level": not name.startswith(" "),
                     "self_us": int(self_us), "cumulative_us": int(cumulative_us)})
    llmadapt_us = sum(r["cumulative_us"] for r in rows if r["top_level"] and r["module"].startswith("llmadapt"))
    slowest = sorted((r for r in rows if r["top_level"]), key=lambda r: -r["cumulative_us"])[:top]
    torch_seen = any(r["module"] == "torch" for r in rows)
    return {"total_import_us": sum(r["self_us"] for r in rows), "llmadapt_import_us": llmadapt_us,
            "slowest_top_level": slowest, "torch_in_importtime": torch_seen}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = console_script(args.python)
    report: dict = {"python": args.python, "entry": base[0], "repeat": args.repeat,
                    "floor": time_command([args.python, "-c", "pass"], args.repeat),
                    "import_llmadapt": time_command([args.python, "-c", "import llmadapt"], args.repeat),
                    "commands": {}}
    report["import_llmadapt"]["torch_loaded"] = "torch" in probe_import(args.python)
    for name, cli_args in COMMANDS.items():
        row = time_command(base + cli_args, args.repeat)
        p = probe(args.python, cli_args)
        row.update(loaded_heavy=p["loaded"], torch_loaded="torch" in p["loaded"], modules=p["modules"],
                   probe_exit_code=p["code"], over_floor_s=row["median_s"] - report["floor"]["median_s"])
        if args.importtime:
            row["importtime"] = importtime(args.python, cli_args)
        report["commands"][name] = row

    bad = [n for n, r in report["commands"].items() if r["torch_loaded"] or r["exit_codes"] != [0]]
    bad += ["import llmadapt"] if report["import_llmadapt"]["torch_loaded"] else []
    report["ok"] = not bad
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if not bad else 1


def probe_import(python: str) -> list[str]:
    code = f"import sys, json, llmadapt; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env(), check=True).stdout
    return json.loads(out)


def render(r: dict) -> str:
    ms = lambda s: f"{s * 1e3:8.1f}"  # noqa: E731
    floor = r["floor"]["median_s"]
    lines = [
        f"interpreter  {r['python']} ({r['repeat']} timed runs each, median; min..max in brackets)",
        "",
        f"{'command':<26} {'median ms':>9} {'over floor':>10} {'x floor':>7}   {'min..max ms':<15} "
        "torch  heavy modules loaded",
    ]

    def row(label: str, t: dict, torch_loaded, heavy) -> str:
        span = f"{t['min_s'] * 1e3:.0f}..{t['max_s'] * 1e3:.0f}"
        torch_txt = "-" if torch_loaded is None else ("YES" if torch_loaded else "no")
        return (f"{label:<26} {ms(t['median_s'])} {ms(t['median_s'] - floor):>10} {t['median_s'] / floor:>7.2f}   "
                f"{span:<15} {torch_txt:<6} {heavy}")

    lines.append(row("python -c pass (floor)", r["floor"], None, ""))
    imp = r["import_llmadapt"]
    lines.append(row("python -c 'import llmadapt'", imp, imp["torch_loaded"], ""))
    for name, c in r["commands"].items():
        heavy = ", ".join(c["loaded_heavy"]) or "none"
        lines.append(row(f"llmadapt {name}", c, c["torch_loaded"], f"{heavy} ({c['modules']} modules)"))
    for name, c in r["commands"].items():
        it = c.get("importtime")
        if not it:
            continue
        lines += ["", f"llmadapt {name}: -X importtime, llmadapt's own imports {it['llmadapt_import_us'] / 1e3:.1f} ms "
                      f"cumulative, all imports {it['total_import_us'] / 1e3:.1f} ms; slowest top-level imports:"]
        for m in it["slowest_top_level"]:
            lines.append(f"    {m['cumulative_us'] / 1e3:7.1f} ms  {m['module']}")
    torch_any = r["import_llmadapt"]["torch_loaded"] or any(c["torch_loaded"] for c in r["commands"].values())
    failed = [f"llmadapt {n}" for n, c in r["commands"].items() if c["exit_codes"] != [0]]
    lines += ["", "torch imported on these paths: " + ("YES (the light-core promise is broken)" if torch_any else "no")]
    if failed:
        lines.append("commands that failed: " + ", ".join(failed))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
