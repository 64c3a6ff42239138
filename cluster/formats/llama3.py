"""Llama 3.x: a call is JSON {"name": ..., "parameters": {...}}, after <|python_tag|> or
opening the output bare; several are separated by ';'."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, json_values, named_call
from cluster.formats.family import Family
from cluster.formats.grammar import call_rule


def parse_llama3(text: str, tools: Any = None) -> list[dict]:
    """Llama 3.x: {"name": ..., "parameters": {...}}, several separated by ';'. A call
    names its arguments ("parameters", or "arguments"): a call may open the output with no
    marker at all, so an answer that is a JSON object with a "name" is not one."""
    values = json_values(text.strip())
    if not all(isinstance(v, Mapping) and ("parameters" in v or "arguments" in v) for v in values):
        raise ValueError("not a Llama 3 call: no parameters")
    return [named_call(v, "parameters") for v in values]


def grammar(chosen: list[dict], atom: Callable[[str], str], start: str = "", end: str = "") -> str:
    """The bare JSON call, its arguments under "parameters"."""
    return f'start: call\ncall: {call_rule(chosen, "parameters")}\n'


LLAMA3_CALLS = CallFormat("llama3", "<|python_tag|>", "", parse_llama3, ("<|python_tag|>",), grammar=grammar,
                          bare_start="{")


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    """Only a guess from its vocabulary: the registry asks it after every format a template names."""
    if "<|python_tag|>" in vocab and '"parameters"' in template:
        return LLAMA3_CALLS
    return None


FAMILY = Family("llama3", calls=call_format)
