"""Llama 3.x: a call is JSON {"name": ..., "parameters": {...}}, after <|python_tag|> or
opening the output bare; several are separated by ';'."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from cluster.formats.base import MlxLmCalls
from cluster.formats.calls import CallFormat, json_values, named_call
from cluster.formats.chat import TOOLS_JSON, TOOL_CALL_ARGS, TOOL_CALL_NAME, ChatFormat, join, template_text
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


# -- its chat format (`orchard model create`) -------------------------------------------------
# Llama 3.1: header tokens; a tool call is <|python_tag|>{json}<|eom_id|>, its result the ipython role
LLAMA3 = ChatFormat(
    control=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
             "<|eom_id|>", "<|finetune_right_pad_id|>"),
    markers=("<|python_tag|>",), eos="<|eot_id|>", stop=("<|eom_id|>", "<|end_of_text|>"),
    bos="<|begin_of_text|>", pad="<|finetune_right_pad_id|>", tools=True, call_marker="<|python_tag|>",
    template=join(
        "{{ bos_token }}",
        "{%- if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n' }}",
        "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{%- endif %}",
        "{{ '\\nYou have access to these functions. To call one, answer with <|python_tag|> and JSON of the "
        "form {\"name\": function name, \"parameters\": arguments}.' }}", TOOLS_JSON, "{{ '<|eot_id|>' }}",
        "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'system' and tools and loop.first %}",
        "{%- elif message['role'] == 'assistant' and message.tool_calls %}",
        "{%- for tc in message.tool_calls %}", TOOL_CALL_NAME,
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>{\"name\": \"' + tool_call.name"
        " + '\", \"parameters\": ' + ", TOOL_CALL_ARGS, " + '}<|eom_id|>' }}{%- endfor %}",
        "{%- else %}{{ '<|start_header_id|>' + ('ipython' if message['role'] == 'tool' else message['role'])"
        " + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}",
        "{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
    ))

# `orchard model create --chat NAME`: the real chat templates (chat_templates/) and their tokens
REAL_FORMATS = {
    # Llama 3.1: JSON calls {"name": ..., "parameters": ...}, or after <|python_tag|>
    "llama-3.1": ChatFormat(control=LLAMA3.control + ("<|python_tag|>",), eos="<|eot_id|>",
                            stop=("<|eom_id|>", "<|end_of_text|>"),
                            bos="<|begin_of_text|>", pad="<|finetune_right_pad_id|>", tools=True,
                            call_marker='{"name": "', template=template_text("llama-3.1")),
}
