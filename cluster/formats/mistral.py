"""Mistral: calls after [TOOL_CALLS], v3's JSON list (Mistral Nemo) or v11's NAME[ARGS]{...}
(Mistral Small 3.2, Devstral, Magistral), ids of 9 letters and digits; Magistral's
[THINK]...[/THINK]."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, json_object, parse_json_calls
from cluster.formats.chat import TOOL_CALL_ARGS, TOOL_CALL_NAME, ChatFormat, join, template_text
from cluster.formats.family import Family
from cluster.formats.grammar import arguments_schema, each_function, json_list, json_rule
from cluster.formats.thinking import ReasoningFormat

_MISTRAL_HEADER = re.compile(r"\s*([\w.-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\]\s*")


def parse_mistral(text: str, tools: Any = None) -> list[dict]:
    """Mistral after [TOOL_CALLS]: v3's JSON list [{"name", "arguments"}], or v11's
    NAME[ARGS]{...} (Magistral, Mistral Small 3.2; [CALL_ID]id between them in some),
    one call or several, each possibly after another [TOOL_CALLS]."""
    calls = []
    for part in text.split("[TOOL_CALLS]"):
        part = part.strip()
        if not part:
            continue
        if part[0] in "[{":
            calls += parse_json_calls(part)
            continue
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(part):
            m = _MISTRAL_HEADER.match(part, pos)
            if m is None:
                raise ValueError(f"not a Mistral call: {part[pos:pos + 40]!r}")
            args, pos = decoder.raw_decode(part, m.end())
            calls.append({"name": m.group(1), "arguments": args if isinstance(args, dict) else json_object(args)})
            while pos < len(part) and part[pos] in " \t\r\n":
                pos += 1
    if not calls:
        raise ValueError("no call")
    return calls


def v11_grammar(chosen: list[dict], atom: Callable[[str], str], start: str = "", end: str = "") -> str:
    """[TOOL_CALLS]NAME[ARGS]{...}"""
    return f'start: {atom("[TOOL_CALLS]")} fn\n' + each_function(
        chosen, lambda i, f: f'{json.dumps(f["name"])} {atom("[ARGS]")} {json_rule(arguments_schema(f))}')


MISTRAL_CALLS = CallFormat("mistral", "[TOOL_CALLS]", "", parse_mistral, ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
                           ids="mistral", grammar=v11_grammar)
MISTRAL_V3_CALLS = CallFormat("mistral_v3", "[TOOL_CALLS]", "", parse_mistral, ("[TOOL_CALLS]",), ids="mistral",
                              grammar=json_list)
MAGISTRAL = ReasoningFormat("magistral", "[THINK]", "[/THINK]")


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    if "[TOOL_CALLS]" in template:
        return MISTRAL_CALLS if "[ARGS]" in template else MISTRAL_V3_CALLS
    return None


def reasoning_format(template: str, vocab: Mapping[str, int]) -> ReasoningFormat | None:
    if "[THINK]" in vocab and "[/THINK]" in vocab and "[THINK]" in template:
        return MAGISTRAL
    return None


FAMILY = Family("mistral", calls=call_format, reasoning=reasoning_format)


# -- its chat format (`orchard model create`) -------------------------------------------------
# Mistral: [INST] ... [/INST]; tools in [AVAILABLE_TOOLS] before the last user turn, calls after [TOOL_CALLS]
MISTRAL = ChatFormat(
    control=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
             "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
    markers=("[TOOL_CALLS]",), eos="</s>", bos="<s>", pad="<unk>", tools=True, call_marker="[TOOL_CALLS]",
    template=join(
        "{{ bos_token }}",
        "{%- if messages[0]['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + messages[0]['content'] + '[/SYSTEM_PROMPT]' }}"
        "{%- set messages = messages[1:] %}{%- endif %}",
        "{%- set ns = namespace(last_user=-1) %}{%- for message in messages %}{%- if message['role'] == 'user' %}"
        "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'user' %}",
        "{%- if tools and loop.index0 == ns.last_user %}"
        "{{ '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}",
        "{{ '[INST]' + message['content'] + '[/INST]' }}",
        "{%- elif message['role'] == 'tool' %}{{ '[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]' }}",
        "{%- elif message.tool_calls %}{{ '[TOOL_CALLS][' }}",
        "{%- for tc in message.tool_calls %}", TOOL_CALL_NAME,
        "{{ '{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + ", TOOL_CALL_ARGS, " + '}' }}",
        "{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ ']</s>' }}",
        "{%- else %}{{ message['content'] + '</s>' }}{%- endif %}{%- endfor %}",
    ))

_TEKKEN = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]", "[TOOL_CALLS]")

_TEKKEN_V11 = _TEKKEN + ("[IMG]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]", "[TOOL_CONTENT]")

_MISTRAL = dict(eos="</s>", bos="<s>", pad="<unk>", tools=True, call_marker="[TOOL_CALLS]")

# `orchard model create --chat NAME`: the real chat templates (chat_templates/) and their tokens
REAL_FORMATS = {
    # Magistral (2509) / Ministral 3 Reasoning: [THINK]...[/THINK], calls NAME[ARGS]{...}
    "magistral": ChatFormat(control=_TEKKEN_V11 + ("[THINK]", "[/THINK]"), template=template_text("magistral"),
                            **_MISTRAL),
    # Mistral v3 tool calls (Mistral Nemo): [TOOL_CALLS][{"name": ..., "arguments": ...}]
    "mistral-nemo": ChatFormat(control=_TEKKEN, template=template_text("mistral-nemo"), **_MISTRAL),
    # Mistral v11 (Mistral Small 3.2, Devstral): [TOOL_CALLS]NAME[ARGS]{...}
    "mistral-small-3.2": ChatFormat(control=_TEKKEN_V11, template=template_text("mistral-small-3.2"), **_MISTRAL),
}
