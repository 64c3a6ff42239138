"""A made-up model family, for tests/test_formats.py: all that adding a family's tool calls
takes, this one module (its calls' markers, parser and grammar, and how its models are
recognised) and its row in cluster/formats/registry.py's FAMILIES. Its models call a tool
as <<call>>{"name": ..., "arguments": {...}}<</call>>."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, named_call
from cluster.formats.family import Family
from cluster.formats.grammar import call_rule


def parse(text: str, tools: Any = None) -> dict:
    return named_call(json.loads(text))


def grammar(chosen: list[dict], atom: Callable[[str], str], start: str, end: str) -> str:
    return f"start: {atom(start)} call {atom(end)}\ncall: {call_rule(chosen)}\n"


CALLS = CallFormat("made_up", "<<call>>", "<</call>>", parse, ("<<call>>", "<</call>>"), grammar=grammar)


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    return CALLS if "<<call>>" in template else None


FAMILY = Family("made_up", calls=call_format)
