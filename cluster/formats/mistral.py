"""Mistral: calls after [TOOL_CALLS], v3's JSON list (Mistral Nemo) or v11's NAME[ARGS]{...}
(Mistral Small 3.2, Devstral, Magistral), ids of 9 letters and digits; Magistral's
[THINK]...[/THINK]."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, json_object, parse_json_calls
from cluster.formats.family import Family
from cluster.formats.grammar import arguments_schema, each_function, json_list, json_rule
from cluster.formats.thinking import ReasoningFormat

_MISTRAL_HEADER = re.compile(r"\s*([\w.-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\]\s*")


def parse_mistral(text: str, tools: Any = None) -> list[dict]:
    """Mistral after [TOOL_CALLS]: v3's JSON list [{"name", "arguments"}], or v11's
    NAME[ARGS]{...} (Magistral, Mistral Small 3.2; [CALL_ID]id between them in some),
    one call or several, each possibly after another [TOOL_CALLS]."""
    calls = []
    for part in text.split("[TOOL_CALLS]"):
        part = part.strip()
        if not part:
            continue
        if part[0] in "[{":
            calls += parse_json_calls(part)
            continue
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(part):
            m = _MISTRAL_HEADER.match(part, pos)
            if m is None:
                raise ValueError(f"not a Mistral call: {part[pos:pos + 40]!r}")
            args, pos = decoder.raw_decode(part, m.end())
            calls.append({"name": m.group(1), "arguments": args if isinstance(args, dict) else json_object(args)})
            while pos < len(part) and part[pos] in " \t\r\n":
                pos += 1
    if not calls:
        raise ValueError("no call")
    return calls


def v11_grammar(chosen: list[dict], atom: Callable[[str], str], start: str = "", end: str = "") -> str:
    """[TOOL_CALLS]NAME[ARGS]{...}"""
    return f'start: {atom("[TOOL_CALLS]")} fn\n' + each_function(
        chosen, lambda i, f: f'{json.dumps(f["name"])} {atom("[ARGS]")} {json_rule(arguments_schema(f))}')


MISTRAL_CALLS = CallFormat("mistral", "[TOOL_CALLS]", "", parse_mistral, ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
                           ids="mistral", grammar=v11_grammar)
MISTRAL_V3_CALLS = CallFormat("mistral_v3", "[TOOL_CALLS]", "", parse_mistral, ("[TOOL_CALLS]",), ids="mistral",
                              grammar=json_list)
MAGISTRAL = ReasoningFormat("magistral", "[THINK]", "[/THINK]")


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    if "[TOOL_CALLS]" in template:
        return MISTRAL_CALLS if "[ARGS]" in template else MISTRAL_V3_CALLS
    return None


def reasoning_format(template: str, vocab: Mapping[str, int]) -> ReasoningFormat | None:
    if "[THINK]" in vocab and "[/THINK]" in vocab and "[THINK]" in template:
        return MAGISTRAL
    return None


FAMILY = Family("mistral", calls=call_format, reasoning=reasoning_format)
