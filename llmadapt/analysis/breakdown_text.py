"""A run's breakdown as text: the timeline, module and operator classes, module x operator, layers and
collectives, as `show` and `llmadapt trace` print them (docs/breakdown.md); and the weights each module class held,
quantized or not, as `show` prints them."""

from __future__ import annotations

from typing import Any


def render_breakdown(b: dict[str, Any], engine: bool = False) -> list[str]:
    """The profiled steps: timeline, module classes, operator classes, layers, collectives. ``engine``: a serving
    engine's own steps (serve.profile), whose time outside operators is the engine's Python."""
    from llmadapt.texttable import text_table

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    if engine:
        lines = [f"engine     its own profile, {b['basis']} basis, mean per engine step over {b['profiled_steps']} "
                 f"step(s): step {ms(b['step_seconds'])} ms = operators {ms(b['compute_seconds'])} + the engine's "
                 f"Python {ms(b['idle_seconds'])}"]
        total = sum(c["seconds"] for c in b["operators"]) or 1.0
        return lines + text_table(["class", "ms", "share", "count"],
                                  [[c["name"], ms(c["seconds"]), f"{c['seconds'] / total:.1%}", str(c["count"])]
                                   for c in sorted(b["operators"], key=lambda c: -c["seconds"])])
    lines = [f"breakdown  level {b['level']}, {b['basis']} basis, mean per profiled step and rank over "
             f"{b['profiled_steps']} profiled step(s)"]
    lines += [f"profiling failed {e}" for e in b.get("errors", [])]
    if not b["profiled_steps"]:
        return lines
    exposed = b["comm_seconds"] - b["overlapped_comm_seconds"]
    copies = next((c["seconds"] for c in b.get("kernel_types") or [] if c["name"] == "memory"), 0.0)
    lines.append(f"timeline   step {ms(b['step_seconds'])} ms = compute {ms(b['compute_seconds'])} + exposed "
                 f"communication {ms(exposed)} + " + (f"copies alone {ms(copies)} + " if copies else "")
                 + f"idle {ms(b['idle_seconds'])}; communication {ms(b['comm_seconds'])} "
                 f"ms, " + (f"{b['overlapped_comm_seconds'] / b['comm_seconds']:.0%} of it overlapped with compute"
                            if b["comm_seconds"] else "none"))
    lines += module_lines(b)
    if b["operators"]:
        total = sum(c["seconds"] for c in b["operators"]) or 1.0
        lines += [""] + text_table(["operator class", "ms", "share", "count", "GFLOP"],
                                   [[c["name"], ms(c["seconds"]), f"{c['seconds'] / total:.1%}", str(c["count"]),
                                     f"{c['flops'] / 1e9:.3f}" if c.get("flops") else "-"] for c in b["operators"]])
        if b.get("gemm_flops_per_s"):
            lines.append(f"GEMM achieved {b['gemm_flops_per_s'] / 1e9:,.2f} GFLOP/s per rank (set it against "
                         "`llmadapt micro peak`)")
    lines += module_operator_lines(b)
    if b["layers"]:
        lines += [""] + text_table(["layer", "forward ms", "backward ms"],
                                   [[str(x["layer"]), ms(x["forward_seconds"]), ms(x["backward_seconds"])]
                                    for x in b["layers"]])
    if b["collectives"]:
        lines += [""] + text_table(
            ["collective", "count", "ms", "MB", "busbw GB/s", "backend", "algorithm"],
            [[c["kind"], str(c["count"]), ms(c["seconds"]), "-" if c["bytes"] is None else f"{c['bytes'] / 1e6:.3f}",
              "-" if c["busbw_gbytes_per_s"] is None else f"{c['busbw_gbytes_per_s']:.3f}", c["backend"],
              c["algorithm"] or "-"] for c in b["collectives"]])
    return lines


def module_lines(b: dict[str, Any]) -> list[str]:
    """The module classes: each one's time, its share of all classes' time, and where it ran: the model's forward,
    its backward, or outside both (the optimizer, waits for collectives, the adapter's own code), so the three
    add up to the class's time. A breakdown whose classes carry no phase (read from a foreign trace's
    annotations) shows '-' there."""
    from llmadapt.texttable import text_table

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    modules = b["modules"]
    total = sum(c["seconds"] for c in modules) or 1.0
    phased = any(c["forward_seconds"] or c["backward_seconds"] for c in modules)

    def phases(c: dict[str, Any]) -> list[str]:
        if not phased:
            return ["-"] * 3
        return [ms(c["forward_seconds"]), ms(c["backward_seconds"]),
                ms(c["seconds"] - c["forward_seconds"] - c["backward_seconds"])]

    basis = "the step" if b.get("basis") == "cpu" else "all classes"
    return text_table(["module class", "ms", f"share of {basis}", "forward ms", "backward ms", "outside ms"],
                      [[c["name"], ms(c["seconds"]), f"{c['seconds'] / total:.1%}", *phases(c)] for c in modules]) + (
        ["outside: neither the model's forward nor its backward (the optimizer, waits for collectives, the "
         "adapter's own code)"] if phased else [])


def module_operator_lines(b: dict[str, Any], width: int = 6) -> list[str]:
    """Module class x operator class, ms per profiled step: which operators each module spends its time on (the
    operator classes with most time as columns, the rest summed as 'rest')."""
    from llmadapt.texttable import text_table

    cells = b.get("module_operators") or []
    if not cells:
        return []
    split = [(c["name"].rsplit("/", 1), c["seconds"]) for c in cells]
    totals: dict[str, float] = {}
    for (_, op), seconds in split:
        totals[op] = totals.get(op, 0.0) + seconds
    columns = sorted(totals, key=lambda op: -totals[op])[:width]
    modules = [m["name"] for m in b["modules"] if any(mod == m["name"] for (mod, _), _ in split)]
    body = []
    for module in modules:
        mine = {op: seconds for (mod, op), seconds in split if mod == module}
        rest = sum(v for op, v in mine.items() if op not in columns)
        body.append([module, *[f"{mine[op] * 1e3:.2f}" if op in mine else "-" for op in columns],
                     f"{rest * 1e3:.2f}" if rest else "-"])
    return [""] + text_table(["module x operator, ms", *columns, "rest"], body)


def weights_lines(weights: list[dict[str, Any]]) -> list[str]:
    """What the model held, quantized or not: per storage format, its module classes with their tensors and bytes
    (stored, and unquantized where quantized)."""
    def size(n: float) -> str:
        return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"

    by_format: dict[str, list[dict[str, Any]]] = {}
    for w in weights:
        by_format.setdefault(w["format"], []).append(w)
    lines = []
    for fmt, rows in sorted(by_format.items(), key=lambda kv: kv[0].startswith(("fp", "bf"))):
        parts = [f"{w['module_class']} {w['tensors']} ({size(w['stored_bytes'])}"
                 + (f" of {size(w['unquantized_bytes'])})" if w["stored_bytes"] != w["unquantized_bytes"] else ")")
                 for w in rows]
        lines.append(f"weights    {fmt}: " + ", ".join(parts))
    return lines
