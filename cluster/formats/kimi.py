"""Kimi K2 (Instruct and Thinking): call sections of special tokens,
<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>, with
ids as its template renders them back. Thinking's <think> is think.py's."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, json_object
from cluster.formats.chat import ChatFormat, template_text
from cluster.formats.family import Family
from cluster.formats.grammar import arguments_schema, each_function, json_rule
from cluster.formats.think import THINK_TOKENS

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


# -- its chat format (`orchard model create`) -------------------------------------------------
_KIMI = ("[BOS]", "[EOS]", "[PAD]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
         "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|media_start|>", "<|media_content|>", "<|media_pad|>",
         "<|media_end|>")

# `orchard model create --chat NAME`: the real chat templates (chat_templates/) and their tokens
REAL_FORMATS = {
    # Kimi K2 (Instruct and Thinking): call sections of special tokens; Thinking's <think> too
    "kimi-k2": ChatFormat(control=_KIMI, eos="<|im_end|>", stop=("[EOS]",), bos="[BOS]", pad="[PAD]", tools=True,
                          call_marker="<|tool_calls_section_begin|>", template=template_text("kimi-k2")),
    "kimi-k2-thinking": ChatFormat(control=_KIMI + THINK_TOKENS, eos="<|im_end|>", stop=("[EOS]",), bos="[BOS]",
                                   pad="[PAD]", tools=True, call_marker="<|tool_calls_section_begin|>",
                                   template=template_text("kimi-k2-thinking")),
}
