"""The parts a family's call grammar is built of (pure Python: llguidance compiles the
result in cluster/worker/structured.py). A family's `CallFormat.grammar` is a function
`(chosen, atom, start, end) -> Lark text`: `chosen` the functions the call may name (in
OpenAI's `function` shape, {"name", "parameters"}), `atom(text)` how the grammar names a
marker (<[id]> for a special token, the quoted text for one that decodes as text),
`start` and `end` the format's markers. Arguments follow each function's `parameters`
schema, closed to undeclared keys."""

from __future__ import annotations

import json
from typing import Callable

# OpenAI's layout, {"a": 1, "b": [2, 3]}, and no other whitespace: a model (a random one
# above all) given free whitespace can spend its whole budget on it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed_objects(schema):
    """`schema` with `additionalProperties: false` wherever an object lists its properties
    and says nothing about others (xgrammar's strict mode, vLLM's default for tool calls):
    arguments hold the declared parameters only, instead of whatever keys a model invents."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k in _SUBSCHEMA_KEYS else v for k, v in schema.items()}
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in schema[key].items()}
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMA_KEYS = frozenset({"items", "prefixItems", "anyOf", "allOf", "oneOf", "not", "if", "then", "else",
                             "additionalProperties", "contains", "propertyNames", "unevaluatedItems",
                             "unevaluatedProperties"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def rebased(schema, root: str):
    """`schema` with each local `$ref` ("#", "#/$defs/Loc", ...) pointing at the same place
    once the schema itself sits at `root` ("#/$defs/args_0") inside a larger one; None when
    it has no local reference (it can be embedded as it is)."""
    found = False

    def walk(node):
        nonlocal found
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                found = True
                out[key] = root + value[1:]
            elif key in _SUBSCHEMA_KEYS:
                out[key] = walk(value)
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: walk(sub) for name, sub in value.items()}
            else:
                out[key] = value
        return out

    out = walk(schema)
    return out if found else None


def call_schema(chosen: list[dict], args_key: str = "arguments") -> dict:
    """{"name": ..., args_key: {...}} for any of the `chosen` functions, each one's arguments
    following its parameters schema (closed to undeclared keys; one with local references,
    such as pydantic's `$defs` and "#/$defs/Loc", moved under the wrapper's `$defs` with
    them rebased)."""
    variants, defs = [], {}
    for i, f in enumerate(chosen):
        arguments = arguments_schema(f)
        moved = rebased(arguments, f"#/$defs/arguments_{i}")
        if moved is not None:  # its references ("#/$defs/Loc", "#") are to its own root: keep it one
            defs[f"arguments_{i}"] = moved
            arguments = {"$ref": f"#/$defs/arguments_{i}"}
        variants.append({"type": "object", "properties": {"name": {"const": f["name"]}, args_key: arguments},
                         "required": ["name", args_key], "additionalProperties": False})
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if defs:
        schema["$defs"] = defs
    return schema


def json_rule(schema: dict) -> str:
    """A %json rule for `schema`, in OpenAI's layout (JSON_OPTIONS)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def arguments_schema(f: dict) -> dict:
    """A function's parameters schema, closed to undeclared keys (none: an empty object)."""
    return closed_objects(f.get("parameters") or {"type": "object", "properties": {}})


def call_rule(chosen: list[dict], args_key: str = "arguments") -> str:
    """A %json rule for one call object, {"name": ..., args_key: {...}}, to any of `chosen`."""
    return json_rule(call_schema(chosen, args_key))


def each_function(chosen: list[dict], rule: Callable[[int, dict], str]) -> str:
    """Rules `fn` (any of `chosen`) and f0, f1, ...: `rule(i, function)` is one function's
    call."""
    return "fn: " + " | ".join(f"f{i}" for i in range(len(chosen))) + "\n" + "".join(
        f"f{i}: {rule(i, f)}\n" for i, f in enumerate(chosen))


def json_list(chosen: list[dict], atom: Callable[[str], str], start: str, end: str = "") -> str:
    """START [{"name": ..., "arguments": {...}}] END (no END where the format has none):
    Granite, Nemotron, Mistral v3."""
    close = f" {atom(end)}" if end else ""
    return f'start: {atom(start)} "[" call "]"{close}\ncall: {call_rule(chosen)}\n'
