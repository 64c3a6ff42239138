"""DeepSeek V3 / R1 / V3.1: its markers (full-width bars, U+2581 for spaces) in one table;
calls in a section, V3.1's NAME<｜tool▁sep｜>{...} or V3 / R1's
function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```. Its thinking is <think> (think.py)."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, json_object
from cluster.formats.chat import TOOLS_JSON, TOOL_CALL_ARGS, TOOL_CALL_NAME, ChatFormat, join, template_text
from cluster.formats.family import Family
from cluster.formats.grammar import arguments_schema, each_function, json_rule
from cluster.formats.think import THINK_TOKENS

MARKERS = {k: "<\uff5c" + v.replace(" ", "\u2581") + "\uff5c>" for k, v in dict(
    bos="begin of sentence", eos="end of sentence", user="User", assistant="Assistant",
    calls="tool calls begin", calls_end="tool calls end", call="tool call begin", call_end="tool call end",
    sep="tool sep", outputs="tool outputs begin", outputs_end="tool outputs end", output="tool output begin",
    output_end="tool output end").items()}
_DS_CALL = re.compile(re.escape(MARKERS["call"]) + "(.*?)" + re.escape(MARKERS["call_end"]), re.DOTALL)
_FENCED = re.compile(r"^\s*([\w.-]+)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def parse_deepseek(text: str, tools: Any = None) -> list[dict]:
    """DeepSeek's call section: V3.1's <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>,
    or V3 / R1's ...begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>."""
    calls = []
    for body in _DS_CALL.findall(text):
        head, _, rest = body.partition(MARKERS["sep"])
        fenced = _FENCED.match(rest)
        if fenced is not None:
            calls.append({"name": fenced.group(1), "arguments": json_object(fenced.group(2))})
        else:
            calls.append({"name": head.strip(), "arguments": json_object(rest)})
    if not calls:
        raise ValueError("no call")
    return calls


def grammar(chosen: list[dict], atom: Callable[[str], str], start: str = "", end: str = "") -> str:
    """V3.1's section: one call NAME<｜tool▁sep｜>{...}."""
    calls, calls_end, call, sep, call_end = (MARKERS[k] for k in ("calls", "calls_end", "call", "sep", "call_end"))
    return f"start: {atom(calls)} fn {atom(calls_end)}\n" + each_function(
        chosen, lambda i, f: f"{atom(call)} {json.dumps(f['name'])} {atom(sep)} {json_rule(arguments_schema(f))} "
                             f"{atom(call_end)}")


DEEPSEEK_CALLS = CallFormat("deepseek", MARKERS["calls"], MARKERS["calls_end"], parse_deepseek,
                            tuple(MARKERS[k] for k in ("calls", "calls_end", "call", "call_end", "sep")),
                            grammar=grammar)


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    return DEEPSEEK_CALLS if MARKERS["calls"] in template else None


FAMILY = Family("deepseek", calls=call_format)


# -- its chat format (`orchard model create`) -------------------------------------------------
# the markers of tool calls and tool outputs
_SECTIONS = tuple(MARKERS[k] for k in ("calls", "calls_end", "call", "call_end", "sep", "outputs", "outputs_end",
                                       "output", "output_end"))

# DeepSeek-V3: <｜User｜> / <｜Assistant｜>; tool calls and outputs between their own markers
DEEPSEEK = ChatFormat(
    control=(MARKERS["bos"], MARKERS["eos"], MARKERS["user"], MARKERS["assistant"]), markers=_SECTIONS,
    eos=MARKERS["eos"], bos=MARKERS["bos"], pad=MARKERS["eos"], tools=True, call_marker=MARKERS["calls"],
    template=join(
        "{{ bos_token }}",
        "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{%- endif %}",
        "{%- if tools %}{{ '\\n\\n## Tools\\nYou have access to these tools:' }}", TOOLS_JSON, "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'user' %}{{ '" + MARKERS["user"] + "' + message['content'] }}",
        "{%- elif message['role'] == 'tool' %}",
        "{{ '" + MARKERS["outputs"] + MARKERS["output"] + "' + message['content'] + '" + MARKERS["output_end"]
        + MARKERS["outputs_end"] + "' }}",
        "{%- elif message['role'] == 'assistant' %}{{ '" + MARKERS["assistant"] + "' + (message['content'] or '') }}",
        "{%- if message.tool_calls %}{{ '" + MARKERS["calls"] + "' }}{%- for tc in message.tool_calls %}",
        TOOL_CALL_NAME,
        "{{ '" + MARKERS["call"] + "function" + MARKERS["sep"] + "' + tool_call.name + '\\n```json\\n' + ",
        TOOL_CALL_ARGS,
        " + '\\n```" + MARKERS["call_end"] + "' }}{%- endfor %}{{ '" + MARKERS["calls_end"] + "' }}{%- endif %}",
        "{{ '" + MARKERS["eos"] + "' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '" + MARKERS["assistant"] + "' }}{%- endif %}",
    ))

# the real tokenizers have the section markers special, and <think> tags
_REAL = dict(control=DEEPSEEK.control + _SECTIONS, markers=THINK_TOKENS, eos=MARKERS["eos"], bos=MARKERS["bos"],
             pad=MARKERS["eos"], tools=True, call_marker=MARKERS["calls"])

# `orchard model create --chat NAME`: the real chat templates (chat_templates/) and their tokens
REAL_FORMATS = {
    # DeepSeek-R1 (the distills' template): <think> opened in the prompt
    "deepseek-r1": ChatFormat(template=template_text("deepseek-r1"), **_REAL),
    # DeepSeek-V3.1: `thinking` opens <think> in the prompt (else </think> closes it); calls
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>...
    "deepseek-v3.1": ChatFormat(template=template_text("deepseek-v3.1"), **_REAL),
}
