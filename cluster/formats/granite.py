"""Granite 3.3: calls as a JSON list after <|tool_call|>; with `thinking`, the template asks
for <think>...</think><response>...</response> in plain text."""

from __future__ import annotations

from typing import Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, parse_json_calls
from cluster.formats.chat import TOOL_CALL_ARGS, TOOL_CALL_NAME, ChatFormat, join, template_text
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


# -- its chat format (`orchard model create`) -------------------------------------------------
# Granite: <|start_of_role|>role<|end_of_role|> ... <|end_of_text|>; calls after <|tool_call|>
GRANITE_CHAT = ChatFormat(
    control=("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"), markers=("<|tool_call|>",),
    eos="<|end_of_text|>", pad="<|end_of_text|>", tools=True, call_marker="<|tool_call|>",
    template=join(
        "{%- if tools %}{{ '<|start_of_role|>available_tools<|end_of_role|>' }}{%- for tool in tools %}",
        "{{ (tool | tojson) + '\\n' }}{%- endfor %}{{ '<|end_of_text|>\\n' }}{%- endif %}",
        "{%- for message in messages %}",
        "{{ '<|start_of_role|>' + ('tool_response' if message['role'] == 'tool' else message['role'])"
        " + '<|end_of_role|>' + (message['content'] or '') }}",
        "{%- if message.tool_calls %}{{ '<|tool_call|>[' }}{%- for tc in message.tool_calls %}", TOOL_CALL_NAME,
        "{{ '{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + ", TOOL_CALL_ARGS, " + '}' }}",
        "{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ ']' }}{%- endif %}",
        "{{ '<|end_of_text|>\\n' }}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}",
    ))

# `orchard model create --chat NAME`: the real chat templates (chat_templates/) and their tokens
REAL_FORMATS = {
    # Granite 3.3: `thinking` asks for <think>...</think><response>...</response> (plain text);
    # calls after <|tool_call|>
    "granite-3.3": ChatFormat(control=("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>",
                                       "<|start_of_cite|>", "<|end_of_cite|>"),
                              eos="<|end_of_text|>", pad="<|end_of_text|>", tools=True, call_marker="<|tool_call|>",
                              template=template_text("granite-3.3")),
}
