"""Granite 3.3: calls as a JSON list after <|tool_call|>; with `thinking`, the template asks
for <think>...</think><response>...</response> in plain text."""

from __future__ import annotations

from typing import Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, parse_json_calls
from cluster.formats.family import Family
from cluster.formats.grammar import json_list
from cluster.formats.thinking import ReasoningFormat

GRANITE_CALLS = CallFormat("granite", "<|tool_call|>", "", parse_json_calls, ("<|tool_call|>",), grammar=json_list)
GRANITE = ReasoningFormat("granite", "<think>", "</think>", strip=("<response>", "</response>"))


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    return GRANITE_CALLS if "<|tool_call|>" in template and "<|start_of_role|>" in template else None


def reasoning_format(template: str, vocab: Mapping[str, int]) -> ReasoningFormat | None:
    if "<think></think>" in template and "<response></response>" in template:  # asked for in plain text
        return GRANITE
    return None


FAMILY = Family("granite", calls=call_format, reasoning=reasoning_format)
