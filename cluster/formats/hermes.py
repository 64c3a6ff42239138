"""The call formats mlx-lm's tokenizer finds from a chat template (Hermes'
<tool_call>{json}</tool_call> of Qwen and many others, LFM2's pythonic [f(a=1)], Gemma 4's
call:f{...}, GLM-4.5's and Qwen3-Coder's XML): its markers and parser, which the worker
passes in. Only Hermes' JSON calls have a grammar."""

from __future__ import annotations

from typing import Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat
from cluster.formats.chat import CHATML_CONTROL, ChatFormat, chatml, template_text
from cluster.formats.family import Family
from cluster.formats.grammar import call_rule
from cluster.formats.think import THINK_TOKENS


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


# -- its chat format (`orchard model create`) -------------------------------------------------
HERMES_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHATML = ChatFormat(control=CHATML_CONTROL, markers=HERMES_MARKERS, eos="<|im_end|>", pad="<|endoftext|>",
                    template=chatml(), tools=True, call_marker="<tool_call>")

_QWEN = dict(control=CHATML_CONTROL, eos="<|im_end|>", stop=("<|endoftext|>",), pad="<|endoftext|>", tools=True,
             call_marker="<tool_call>", bpe_first=True)

# `orchard model create --chat NAME`: the real chat templates (chat_templates/) and their tokens
REAL_FORMATS = {
    # Qwen3: the model opens <think> itself (enable_thinking=False closes an empty one in the prompt)
    "qwen3": ChatFormat(markers=HERMES_MARKERS + THINK_TOKENS, template=template_text("qwen3"), **_QWEN),
    # QwQ: the template opens <think> in the prompt
    "qwq": ChatFormat(markers=HERMES_MARKERS + THINK_TOKENS, template=template_text("qwq"), **_QWEN),
    # Qwen3-Coder: XML calls, <tool_call><function=NAME><parameter=KEY>value</parameter>...
    "qwen3-coder": ChatFormat(markers=HERMES_MARKERS, template=template_text("qwen3-coder"), **_QWEN),
}
