"""The JSON Schema of every record, generated from the record classes (their field types and docstrings),
and the checks and upgrades applied when a record is read.
"""

from __future__ import annotations

import functools
import json
import operator
import types
import typing
from typing import Any, Literal

import attrs

from llmadapt.contract.launch import LaunchRequest
from llmadapt.spec import Workload
from llmadapt.contract.perf import Estimate, Fit, MaxBatch, OpBench, Probe, Validation
from llmadapt.contract.records import (
    SCHEMA_VERSION,
    Breakdown,
    ClientLoad,
    Comm,
    End,
    Evaluation,
    Quality,
    Failure,
    Header,
    Interference,
    Metric,
    Request,
    ServerSample,
    Step,
    Summary,
    Telemetry,
)
from llmadapt.errors import ContractError

RECORD_TYPES: dict[str, type] = {
    "header": Header, "step": Step, "request": Request, "server_sample": ServerSample, "client_load": ClientLoad,
    "comm": Comm, "breakdown": Breakdown, "telemetry": Telemetry, "evaluation": Evaluation,
    "interference": Interference, "quality": Quality,
    "metric": Metric, "failure": Failure, "end": End, "summary": Summary,
    "op_bench": OpBench, "estimate": Estimate, "fit": Fit, "validation": Validation, "probe": Probe,
    "maxbatch": MaxBatch, "launch": LaunchRequest,
}


def to_json(record: Any) -> dict[str, Any]:
    """``attrs.asdict(record)``, a few times faster: a step record is written every step, between steps."""
    return {name: _plain(getattr(record, name)) for name in _field_names(type(record))}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if attrs.has(type(value)):
        return to_json(value)
    return value


def to_json_line(record: Any) -> str:
    """The record as compact JSON text: the same text as ``json.dumps(to_json(record))`` without building the
    nested dicts first (json's encoder, in C, walks the lists and numbers and asks for one record's fields at a
    time). The worker writes one between every two steps, where it is the loop's largest cost."""
    return _LINE.encode(record)


def _fields_of(record: Any) -> dict[str, Any]:
    cls = type(record)
    getter = _GETTERS.get(cls)
    if getter is None:
        if not attrs.has(cls):
            raise TypeError(f"Object of type {cls.__name__} is not JSON serializable")
        names = _field_names(cls)
        getter = _GETTERS[cls] = (names, operator.attrgetter(*names) if len(names) > 1 else
                                  (lambda r, name=names[0]: (getattr(r, name),)))
    names, get = getter
    return dict(zip(names, get(record)))


_LINE = json.JSONEncoder(separators=(",", ":"), default=_fields_of)
_GETTERS: dict[type, tuple[tuple[str, ...], Any]] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in attrs.fields(cls))
    return names


# -- JSON Schema, generated from the record types ---------------------------------------------
def _schema_for(hint: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if hint is Workload:  # the workload's own form, checked by its builder (docs/workloads.md), as the header has it
        return {"type": "object", "description": "the workload (Workload.to_dict; docs/workloads.md)"}
    if attrs.has(hint):
        name = hint.__name__
        if name not in defs:
            defs[name] = {}  # placeholder against recursion
            hints = typing.get_type_hints(hint)
            props, required = {}, []
            docs = _field_docs(hint)  # once per class: it parses the class's source
            for field in attrs.fields(hint):
                props[field.name] = _schema_for(hints[field.name], defs)
                doc = docs.get(field.name)
                if doc:
                    props[field.name]["description"] = doc
                if field.default is attrs.NOTHING:
                    required.append(field.name)
            defs[name] = {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            }
            if hint.__doc__:
                defs[name]["description"] = " ".join(hint.__doc__.split())
        return {"$ref": f"#/$defs/{name}"}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_for(a, defs) for a in typing.get_args(hint)]}
    if origin is Literal:
        values = list(typing.get_args(hint))
        return {"const": values[0]} if len(values) == 1 else {"enum": values}
    if origin is list:
        return {"type": "array", "items": _schema_for(typing.get_args(hint)[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema_for(typing.get_args(hint)[1], defs)}
    simple = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
    if hint in simple:
        return {"type": simple[hint]}
    if hint is Any:
        return {}
    raise TypeError(f"no JSON Schema mapping for {hint!r}")


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after a field), read from the source."""
    return _module_field_docs(cls.__module__).get(cls.__qualname__, {})


@functools.cache
def _module_field_docs(module: str) -> dict[str, dict[str, str]]:
    """Every top-level class's attribute docstrings in one module, its source parsed once (inspect.getsource parses
    the whole module again for each class: a second of every process that validated a record)."""
    import ast
    import inspect
    import sys

    try:
        tree = ast.parse(inspect.getsource(sys.modules[module]))
    except (OSError, TypeError, KeyError):
        return {}
    found: dict[str, dict[str, str]] = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        docs = found[cls.name] = {}
        for node, nxt in zip(cls.body, cls.body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return found


def json_schema() -> dict[str, Any]:
    """The JSON Schema of one trace record (any type), from the record classes above."""
    defs: dict[str, Any] = {}
    refs = [_schema_for(cls, defs) for cls in RECORD_TYPES.values()]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://llmadapt.dev/schema/record-{SCHEMA_VERSION}.json",
        "title": f"llmadapt trace record, schema {SCHEMA_VERSION}",
        "oneOf": refs,
        "$defs": defs,
    }


_validator = None


def validate(record: dict[str, Any]) -> dict[str, Any]:
    """Check one record against the schema; raise ContractError naming the first problem."""
    global _validator
    if _validator is None:
        import jsonschema

        _validator = jsonschema.Draft202012Validator(json_schema())
    kind = record.get("type") if isinstance(record, dict) else None
    if not isinstance(kind, str) or kind not in RECORD_TYPES:  # a list or an object is no type's name
        raise ContractError(f"record has unknown type {kind!r}; known: {', '.join(RECORD_TYPES)}")
    sub = {"$ref": f"#/$defs/{RECORD_TYPES[kind].__name__}", "$defs": _validator.schema["$defs"]}
    error = next(iter(_validator.evolve(schema=sub).iter_errors(record)), None)
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(record)"
        raise ContractError(f"{kind} record, field {where}: {error.message}")
    if record.get("schema_version", SCHEMA_VERSION).split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise ContractError(f"schema version {record['schema_version']} is not readable by {SCHEMA_VERSION}")
    return record


# Fields renamed since schema 1.0, as (record type, old name, new name); older traces read as if new.
_RENAMED = (("comm", "algbw_gbps", "algbw_gbytes_per_s"), ("comm", "busbw_gbps", "busbw_gbytes_per_s"))


def upgrade(record: Any) -> Any:
    """A record of an older 1.x schema in today's field names (same values: those fields were GB/s already)."""
    if isinstance(record, dict):
        for kind, old, new in _RENAMED:
            if record.get("type") == kind and old in record:
                record[new] = record.pop(old)
    return record
