"""NVIDIA Nemotron (Nemotron-H, Nemotron Nano 2): calls as a JSON list in
<TOOLCALL>[...]</TOOLCALL>. Nano 2's thinking is think.py's <think>, opened in the prompt."""

from __future__ import annotations

from typing import Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, parse_json_calls
from cluster.formats.chat import CHATML_CONTROL, ChatFormat, chatml, template_text
from cluster.formats.family import Family
from cluster.formats.grammar import json_list
from cluster.formats.think import THINK_TOKENS

NEMOTRON_CALLS = CallFormat("nemotron", "<TOOLCALL>", "</TOOLCALL>", parse_json_calls, ("<TOOLCALL>", "</TOOLCALL>"),
                            grammar=json_list)


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    return NEMOTRON_CALLS if "<TOOLCALL>" in template else None


FAMILY = Family("nemotron", calls=call_format)


# -- its chat format (`orchard model create`) -------------------------------------------------
# Nemotron-H: ChatML, tool calls as <TOOLCALL>[...]</TOOLCALL>
NEMOTRON = ChatFormat(control=CHATML_CONTROL, markers=("<TOOLCALL>", "</TOOLCALL>", "<tool_response>",
                                                        "</tool_response>"),
                      eos="<|im_end|>", pad="<|endoftext|>", template=chatml("<TOOLCALL>", "</TOOLCALL>"), tools=True,
                      call_marker="<TOOLCALL>")

# `orchard model create --chat NAME`: the real chat templates (chat_templates/) and their tokens
REAL_FORMATS = {
    # NVIDIA Nemotron Nano 2: /think and /no_think; <think> opened in the prompt; <TOOLCALL>[...]</TOOLCALL>
    "nemotron-nano-2": ChatFormat(control=("<unk>", "<s>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>")
                                  + THINK_TOKENS + ("<TOOLCALL>", "</TOOLCALL>"),
                                  markers=("<AVAILABLE_TOOLS>", "</AVAILABLE_TOOLS>", "<TOOL_RESPONSE>",
                                           "</TOOL_RESPONSE>"),
                                  eos="<SPECIAL_12>", stop=("</s>",), bos="<s>", pad="<unk>", tools=True,
                                  call_marker="<TOOLCALL>", template=template_text("nemotron-nano-2")),
}
