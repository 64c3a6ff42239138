"""Penalties, logit bias and structured outputs on the wire: one way in from each front
end, one range check.

- `structured_proto`: the SDK's and `build_request`'s `structured=` value (a dict such as
  {"json_schema": {...}}, {"regex": "..."}, {"choice": [...]}, {"grammar": "..."},
  {"json_object": True}, or a `pb.StructuredOutput`) as the proto message.
- `openai_extras`: an OpenAI request body's presence_penalty, frequency_penalty,
  logit_bias, the extensions repetition_penalty, and `response_format` ("text",
  "json_object", "json_schema" with {name, schema, strict}), vLLM's `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar` and its newer `structured_outputs`
  object ({"json" | "regex" | "choice" | "grammar" | "json_object"}), as `build_request`
  keyword arguments. At most one constraint per request.
- `check_sampling`: OpenAI's ranges, run by `validate_request` on every backend.

A json_schema is always enforced in full, `strict` or not: a constrained decoder gives
strict mode's guarantee either way.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Mapping

from cluster.api.errors import BadField, InvalidRequest
from cluster.api.limits import MAX_INT32, check_json_depth, parse_json, shown
from cluster.proto.orchard.v1 import orchard_pb2 as pb

# OpenAI's ranges (the engine's SamplingParams keeps the same ones as its invariants).
MAX_TEMPERATURE = 2.0  # [0, 2]
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2]
# (0, 2]: vLLM takes any > 0, HF suggests about 1.2; past 2 every seen token is all but
# banned, which is a mistake rather than a setting.
MAX_REPETITION_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0  # values in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300


def structured_proto(value: Any) -> pb.StructuredOutput:
    if isinstance(value, pb.StructuredOutput):
        return value
    if not isinstance(value, Mapping) or len(value) != 1:
        raise InvalidRequest("structured must be one of {'json_schema': schema}, {'json_object': True}, "
                             "{'regex': str}, {'choice': [str, ...]}, {'grammar': lark_text}")
    (kind, spec), = value.items()
    out = pb.StructuredOutput()
    if kind == "json_schema":
        if not isinstance(spec, str):
            check_json_depth(spec, "json_schema")
        out.json_schema = spec if isinstance(spec, str) else json.dumps(spec)
    elif kind == "json_object":
        out.json_object = True
    elif kind in ("regex", "grammar") and isinstance(spec, str):
        setattr(out, kind, spec)
    elif kind == "choice" and isinstance(spec, (list, tuple)) and all(isinstance(c, str) for c in spec):
        out.choice.choices.extend(spec)
    else:
        raise InvalidRequest(f"structured={{{kind!r}: ...}}: unknown kind or a value of the wrong type")
    return out


def check_sampling(s: pb.SamplingParams, named: Callable[[str], str] = str) -> None:
    """OpenAI's ranges, and a structured output that is well-formed before compiling.
    `named(field)`: the name the client knows a wire field by (itself by default)."""
    if s.HasField("temperature") and not 0.0 <= s.temperature <= MAX_TEMPERATURE:
        raise BadField(named("temperature"), f"{named('temperature')} must be between 0 and 2, got {s.temperature:g}")
    if s.HasField("top_p") and not 0.0 < s.top_p <= 1.0:
        raise BadField(named("top_p"), f"{named('top_p')} must be in (0, 1], got {s.top_p:g}")
    if s.HasField("top_k") and s.top_k < 0:
        raise BadField(named("top_k"), f"{named('top_k')} must be >= 0 (0 disables it), got {s.top_k}")
    if s.HasField("min_p") and not 0.0 <= s.min_p <= 1.0:
        raise BadField(named("min_p"), f"{named('min_p')} must be in [0, 1], got {s.min_p:g}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise BadField(named(name), f"{named(name)} must be between -2 and 2, got {value:g}")
    if s.HasField("repetition_penalty") and not 0.0 < s.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise BadField(named("repetition_penalty"), f"{named('repetition_penalty')} must be in "
                                                    f"(0, {MAX_REPETITION_PENALTY:g}] (1 = off), got "
                                                    f"{s.repetition_penalty:g}")
    bias = named("logit_bias")
    if len(s.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise BadField(bias, f"{bias} has {len(s.logit_bias)} entries: at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    for token, value in s.logit_bias.items():
        if token < 0:
            raise BadField(bias, f"{bias} token id {token} must be >= 0")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # NaN too
            raise BadField(bias, f"{bias} values must be between -100 and 100, got {value:g} for token {token}")
    if s.HasField("structured"):
        field = named("response_format")
        kind = s.structured.WhichOneof("kind")
        if kind is None:
            raise BadField(field, "the structured output names no kind: set one of json_schema, json_object, regex, "
                                  "choice, grammar")
        if kind == "json_schema":
            schema = parse_json(s.structured.json_schema, "json_schema", field)
            if not isinstance(schema, (dict, bool)):
                raise BadField(field, "the JSON schema must be a JSON object")
        elif kind == "choice" and (not s.structured.choice.choices or not all(s.structured.choice.choices)):
            raise BadField(field, "a choice list needs at least one choice, none of them empty")
        elif kind in ("regex", "grammar") and not getattr(s.structured, kind).strip():
            raise BadField(field, f"the {kind} is empty")


# -- OpenAI HTTP --------------------------------------------------------------------------
def _number(body: Mapping, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadField(name, f"'{name}' must be a finite number, got {shown(value)}")
    return float(value)


def _logit_bias(body: Mapping) -> dict[int, float] | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise BadField("logit_bias", "'logit_bias' must be an object mapping token ids to numbers")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadField("logit_bias", f"logit_bias key {shown(key)} is not a token id") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadField("logit_bias", f"logit_bias[{shown(key)}] must be a number, got {shown(value)}")
        if not 0 <= token <= MAX_INT32:
            raise BadField("logit_bias", f"logit_bias token id {token} is out of range: token ids are 0 .. "
                                         f"{MAX_INT32}")
        out[token] = float(value)
    return out


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise BadField(param, f"'{param}' must be a JSON schema (an object)")


def _response_format(rf: Any) -> dict | None:
    if isinstance(rf, str):  # some clients send the bare type
        rf = {"type": rf}
    if not isinstance(rf, Mapping):
        raise BadField("response_format", "'response_format' must be an object with a 'type'")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping) or "schema" not in js:
            raise BadField("response_format", "response_format.json_schema must be an object with a 'schema' "
                                              "(and a 'name', and optionally 'strict')")
        return {"json_schema": _schema_text(js["schema"], "response_format")}
    raise BadField("response_format", f"response_format type {shown(kind)} is not supported: use 'text', "
                                      "'json_object' or 'json_schema'")


_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                       "json_object": "json_object"}


def _constraint(body: Mapping) -> tuple[str, dict] | None:
    """The one constraint of a request body, and the field it came from."""
    found: list[tuple[str, dict]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    for field, kind in _GUIDED.items():
        value = body.get(field)
        if value is None:
            continue
        if kind == "json_schema":
            value = _schema_text(value, field)
        elif kind == "choice" and not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
            raise BadField(field, f"'{field}' must be a list of strings")
        elif kind in ("regex", "grammar") and not isinstance(value, str):
            raise BadField(field, f"'{field}' must be a string")
        found.append((field, {kind: value}))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise BadField("structured_outputs", "'structured_outputs' must be an object")
        for key, value in so.items():
            if key not in _STRUCTURED_OUTPUTS:
                raise BadField("structured_outputs", f"structured_outputs.{shown(key)} is not supported: use one of "
                                                     f"{', '.join(_STRUCTURED_OUTPUTS)}")
            if value is None or value is False:
                continue
            kind = _STRUCTURED_OUTPUTS[key]
            if kind == "json_schema":
                value = _schema_text(value, "structured_outputs")
            found.append(("structured_outputs", {kind: value}))
    if len(found) > 1:
        names = ", ".join(sorted({f for f, _ in found}))
        raise BadField(found[1][0], f"more than one structured output was asked for ({names}): send one")
    return found[0] if found else None


def openai_extras(body: Mapping) -> dict[str, Any]:
    """`build_request` keyword arguments for an OpenAI body's penalties, bias and
    structured output (only those it sets)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _number(body, name)
        if value is not None:
            out[name] = value
    bias = _logit_bias(body)
    if bias:
        out["logit_bias"] = bias
    found = _constraint(body)
    if found is not None:
        field, spec = found
        try:
            out["structured"] = structured_proto(spec)
        except InvalidRequest as e:
            raise BadField(field, e.message) from None
    return out
