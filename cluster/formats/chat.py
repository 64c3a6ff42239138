"""Chat formats, for the models `orchard model create` makes: the special tokens a family's
chat template uses, its end-of-turn token and the Jinja template itself, in the family's
own style (ChatML for Qwen, header tokens for Llama 3, turns for Gemma, [INST] for Mistral,
harmony for gpt-oss, ...), with the family's tool-call markers where it has them. Each
family's module holds its formats (hermes.py's CHATML, mistral.py's MISTRAL, plain.py for
the families with nothing else here); this module the type and the template parts they
share; registry.py the tables `orchard model create` reads.

`control` tokens structure the conversation and are special (a detokenizer skips them);
`markers` delimit tool calls and results and are added as ordinary tokens, so that they
survive decoding and a tool-call parser sees them, as in the real tokenizers. Every one of
them is a single token of the trained tokenizer. `eos` ends an assistant turn; `stop` are
the family's other end tokens (generation_config.json lists all of them).

The formats are written for random-weight test models: they render what a real model of
the family would be prompted with, not necessarily byte for byte. A family's
`REAL_FORMATS` are the real ones of the reasoning and tool-calling families (`orchard model
create --chat NAME`): their chat templates as their tokenizer_config.json carries them, in
chat_templates/ (`template_text`), and the tokens they name, special where the family's
tokenizer has them special (Mistral's [TOOL_CALLS], harmony's channels, Llama 3's
<|python_tag|>, Kimi's and DeepSeek's call sections), ordinary added tokens where it has
them so (Qwen's <think> and <tool_call>).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChatFormat:
    control: tuple[str, ...]  # special tokens, ids 0.. in this order
    eos: str
    template: str
    markers: tuple[str, ...] = ()  # tool-call markers: single, non-special tokens
    stop: tuple[str, ...] = ()  # more end tokens than eos
    bos: str | None = None
    pad: str | None = None
    tools: bool = False  # the template renders `tools=` and tool calls
    call_marker: str | None = None  # what opens a tool call in the assistant's text
    # the tokenizer's ids: control tokens first (0..), the BPE, markers last; or, as Qwen's
    # real tokenizers have them, the BPE first, then the control tokens, then the markers
    bpe_first: bool = False

    @property
    def eos_tokens(self) -> tuple[str, ...]:
        return (self.eos, *self.stop)


def join(*parts: str) -> str:
    """A template from its parts."""
    return "".join(parts)


# a tool call's name and its arguments as JSON (arguments may come as a dict or a string)
TOOL_CALL_NAME = "{%- set tool_call = tc.function if tc.function is defined else tc %}"
TOOL_CALL_ARGS = "(tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson)"
TOOLS_JSON = "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"


def chatml(call_open: str = "<tool_call>", call_close: str = "</tool_call>", bos: str = "",
           pythonic: bool = False, list_open: str = "<tools>", list_close: str = "</tools>") -> str:
    """ChatML (<|im_start|>role ... <|im_end|>) with Hermes-style tools in the system turn."""
    if pythonic:  # LFM2: [name(arg=value, ...)]
        call = join("{{ '[' + tool_call.name + '(' }}{%- for k, v in tool_call.arguments.items() %}",
                    "{{ k + '=' + (v | tojson) }}{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ ')]' }}")
    else:  # {"name": ..., "arguments": ...}
        call = "{{ '\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + " + TOOL_CALL_ARGS + " + '}\\n' }}"
    return join(
        bos and "{{ bos_token }}",
        "{%- if tools %}{{ '<|im_start|>system\\n' }}",
        "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}",
        "{{ '# Tools\\n\\nYou may call one or more functions. Their signatures are within " + list_open
        + list_close + ":\\n" + list_open + "' }}",
        TOOLS_JSON,
        "{{ '\\n" + list_close + "\\n\\nReturn each function call within " + call_open + call_close
        + ".<|im_end|>\\n' }}",
        "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'system' and tools and loop.first %}",
        "{%- elif message['role'] == 'assistant' and message.tool_calls %}",
        "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}",
        "{%- for tc in message.tool_calls %}", TOOL_CALL_NAME, "{{ '" + call_open + "' }}", call,
        "{{ '" + call_close + "' }}{%- endfor %}{{ '<|im_end|>\\n' }}",
        "{%- elif message['role'] == 'tool' %}",
        "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}",
        "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}",
        "{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}",
    )


CHATML_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def template_text(name: str) -> str:
    """A family's chat template, as its tokenizer_config.json carries it."""
    return (Path(__file__).parent / "chat_templates" / f"{name}.jinja").read_text()
