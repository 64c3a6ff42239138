"""The one table of model families: `FAMILIES`, asked in order, finds a model's tool-call
format and thinking markers from its chat template and vocabulary. A family (or a format
several share) is one module of this package exporting a `FAMILY` (cluster/formats/family.py)
and one row here."""

from __future__ import annotations

from typing import Mapping

from cluster.formats import deepseek, granite, harmony, hermes, kimi, llama3, mistral, nemotron, think
from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat
from cluster.formats.family import Family
from cluster.formats.thinking import ReasoningFormat

# first answer wins: formats a template names before mlx-lm's (hermes), Llama 3's guess from
# its vocabulary after it; Granite's plain-text thinking before the <think> tags
FAMILIES: tuple[Family, ...] = (harmony.FAMILY, mistral.FAMILY, deepseek.FAMILY, kimi.FAMILY, nemotron.FAMILY,
                                granite.FAMILY, hermes.FAMILY, llama3.FAMILY, think.FAMILY)


def call_format(chat_template: str | None, vocab: Mapping[str, int],
                mlx_lm: MlxLmCalls | None = None) -> CallFormat | None:
    """The model's call format from its chat template and vocabulary, else the one mlx-lm
    found (`mlx_lm`: its tool_call_start, tool_call_end, parse_tool_call and the parser's
    module name); None: the model has no tool calling."""
    template = chat_template if isinstance(chat_template, str) else ""
    for family in FAMILIES:
        found = family.calls(template, vocab, mlx_lm) if family.calls is not None else None
        if found is not None:
            return found
    return None


def reasoning_format(chat_template: str | None, vocab: Mapping[str, int]) -> ReasoningFormat | None:
    """The model's thinking markers, from its chat template and vocabulary."""
    template = chat_template if isinstance(chat_template, str) else ""
    for family in FAMILIES:
        found = family.reasoning(template, vocab) if family.reasoning is not None else None
        if found is not None:
            return found
    return None
