"""Kimi K2 (Instruct and Thinking): call sections of special tokens,
<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>, with
ids as its template renders them back. Thinking's <think> is think.py's."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, json_object
from cluster.formats.family import Family
from cluster.formats.grammar import arguments_schema, each_function, json_rule

_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*"
                        r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)


def parse_kimi(text: str, tools: Any = None) -> list[dict]:
    """Kimi K2's section: <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>..."""
    calls = [{"name": name, "arguments": json_object(args)} for name, args in _KIMI_CALL.findall(text)]
    if not calls:
        raise ValueError("no call")
    return calls


def grammar(chosen: list[dict], atom: Callable[[str], str], start: str = "", end: str = "") -> str:
    return f'start: {atom("<|tool_calls_section_begin|>")} fn {atom("<|tool_calls_section_end|>")}\n' + each_function(
        chosen, lambda i, f: f'{atom("<|tool_call_begin|>")} {json.dumps("functions." + f["name"] + ":0")} '
                             f'{atom("<|tool_call_argument_begin|>")} {json_rule(arguments_schema(f))} '
                             f'{atom("<|tool_call_end|>")}')


KIMI_CALLS = CallFormat("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", parse_kimi,
                        ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                         "<|tool_call_argument_begin|>", "<|tool_call_end|>"), ids="kimi", grammar=grammar)


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    return KIMI_CALLS if "<|tool_calls_section_begin|>" in template else None


FAMILY = Family("kimi", calls=call_format)
