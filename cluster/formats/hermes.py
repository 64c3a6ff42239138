"""The call formats mlx-lm's tokenizer finds from a chat template (Hermes'
<tool_call>{json}</tool_call> of Qwen and many others, LFM2's pythonic [f(a=1)], Gemma 4's
call:f{...}, GLM-4.5's and Qwen3-Coder's XML): its markers and parser, which the worker
passes in. Only Hermes' JSON calls have a grammar."""

from __future__ import annotations

from typing import Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat
from cluster.formats.family import Family
from cluster.formats.grammar import call_rule


def grammar(chosen: list[dict], atom: Callable[[str], str], start: str, end: str) -> str:
    """START\\n{"name": ..., "arguments": {...}}\\nEND"""
    return f'start: {atom(start)} "\\n" call "\\n" {atom(end)}\ncall: {call_rule(chosen)}\n'


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    """The markers its template names (Hermes' <tool_call> on a Llama 3 vocabulary too)."""
    if mlx_lm is None:
        return None
    start, end, parser, module = mlx_lm
    kind = module.rsplit(".", 1)[-1]
    return CallFormat(kind, start, end or "", parser, (start, end or ""),
                      grammar=grammar if kind == "json_tools" else None)


FAMILY = Family("hermes", calls=call_format)
