"""Commands about what is installed: adapters, schema, env create/list/prune. Each command's options are registered
beside its handler (``register_<command>``, found by cli/main.py's table of commands), as in every group of cli/."""

from __future__ import annotations

import json
import sys

from llmadapt.cli.common import add_command, emit
from llmadapt.errors import LlmadaptError
from llmadapt.texttable import text_table


def cmd_adapters(args) -> int:
    from llmadapt.adapter.plugins import adapters
    from llmadapt.launch import environments

    rows = []
    for info in adapters().values():
        env = info.environment
        rows.append({
            "name": info.name, "version": info.version, "framework": info.framework, "roles": list(info.roles),
            "supports": info.supports.summary() if set(info.roles) - {"serve"} else "-",
            "environment": env.name if env else "-",
            "environment_status": environments.status(env) if env else "attach only",
            "description": info.description, "run_files": dict(info.run_files),
        })
    lines = text_table(["name", "version", "roles", "environment", "supports"],
                       [[r["name"], r["version"], ",".join(r["roles"]), f"{r['environment']} ({r['environment_status']})",
                         r["supports"]] for r in rows])
    emit(args, rows, "\n".join(lines))
    return 0


def cmd_schema(args) -> int:
    from llmadapt.contract.schema import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def _environments() -> dict:
    """Every environment by name: the adapters' and the core's tools' (llmadapt.launch.environments)."""
    from llmadapt.adapter.plugins import adapters
    from llmadapt.launch.environments import TOOL_ENVIRONMENTS

    specs = {info.environment.name: info.environment for info in adapters().values() if info.environment}
    return {**specs, **{spec.name: spec for spec in TOOL_ENVIRONMENTS}}


def _environment(name: str):
    from llmadapt.adapter.plugins import adapters

    for info in adapters().values():
        if info.environment and name == info.name:
            return info.environment
    specs = _environments()
    if name in specs:
        return specs[name]
    raise LlmadaptError(f"unknown environment {name!r}; known: {', '.join(sorted(specs))}")


def cmd_env_create(args) -> int:
    from llmadapt.launch.environments import create

    python = create(_environment(args.name), force=args.force, log=lambda m: print(m, file=sys.stderr, flush=True))
    emit(args, {"environment": args.name, "python": str(python)}, f"{args.name}: {python}")
    return 0


def cmd_env_list(args) -> int:
    from llmadapt.launch import environments

    envs = _environments()
    rows = [{"environment": name, "status": environments.status(spec), "path": str(environments.env_dir(spec)),
             "requirements": list(spec.requirements),
             "older_builds": [str(p) for p in environments.older_builds(spec)]} for name, spec in sorted(envs.items())]
    lines = [f"{r['environment']:<16} {r['status']:<9} {r['path']}" for r in rows]
    older = sum(len(r["older_builds"]) for r in rows)
    if older and not args.json:
        lines.append(f"({older} builds from other recipes: `llmadapt env prune` removes them)")
    emit(args, rows, "\n".join(lines))
    return 0


def cmd_env_prune(args) -> int:
    from llmadapt.launch import environments

    specs = _environments()
    if args.name:
        specs = {args.name: _environment(args.name)}
    removed = [str(p) for spec in specs.values() for p in environments.prune(spec)]
    emit(args, removed, "\n".join(f"removed {p}" for p in removed) or "nothing to remove")
    return 0


# -- registration: each command's options, in the order its --help lists them ----------------------------------
def register_adapters(sub) -> None:
    add_command(sub, "adapters", cmd_adapters, "list registered adapters, what they support and their environments")


def register_schema(sub) -> None:
    add_command(sub, "schema", cmd_schema, "print the JSON Schema of trace records")


def register_env(sub) -> None:
    env = sub.add_parser("env", help="build and list adapter environments")
    env_sub = env.add_subparsers(dest="env_command", required=True, metavar="ACTION")
    p = env_sub.add_parser("create", help="build an adapter's environment (virtualenv with pinned requirements)")
    p.add_argument("name", help="environment (or adapter) name")
    p.add_argument("--force", action="store_true", help="rebuild even if ready")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env_create)
    p = env_sub.add_parser("list", help="list environments and whether they are built")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env_list)
    p = env_sub.add_parser("prune", help="remove builds from other recipes (older pins, other checkouts' code)")
    p.add_argument("name", nargs="?", help="one environment (default: all)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env_prune)
