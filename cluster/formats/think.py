"""<think>...</think>: the thinking markers Qwen3, QwQ, DeepSeek-R1 and V3.1, Kimi K2
Thinking, GLM-4.5 and Nemotron share (their calls are each family's own)."""

from __future__ import annotations

from typing import Mapping

from cluster.formats.family import Family
from cluster.formats.thinking import ReasoningFormat

THINK_TAGS = ReasoningFormat("think", "<think>", "</think>")
THINK_TOKENS = (THINK_TAGS.start, THINK_TAGS.end)  # the tokens a chat format adds for them


def reasoning_format(template: str, vocab: Mapping[str, int]) -> ReasoningFormat | None:
    if "<think>" in vocab and "</think>" in vocab and ("</think>" in template or "<think>" in template):
        return THINK_TAGS
    return None


FAMILY = Family("think", reasoning=reasoning_format)

