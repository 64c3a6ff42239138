"""Chat formats of the model families `orchard model create` makes: the special tokens a
family's chat template uses, its end-of-turn token and the Jinja template itself, in the
family's own style (ChatML for Qwen, header tokens for Llama 3, turns for Gemma, [INST]
for Mistral, harmony for gpt-oss, ...), with the family's tool-call markers where it has
them.

`control` tokens structure the conversation and are special (a detokenizer skips them);
`markers` delimit tool calls and results and are added as ordinary tokens, so that they
survive decoding and a tool-call parser sees them, as in the real tokenizers. Every one of
them is a single token of the trained tokenizer. `eos` ends an assistant turn; `stop` are
the family's other end tokens (generation_config.json lists all of them).

The formats above are written here for random-weight test models: they render what a real
model of the family would be prompted with, not necessarily byte for byte. `REAL_FORMATS`
are the real ones of the reasoning and tool-calling families (their chat templates as
their tokenizer_config.json carries them, in cluster/chat_templates/, and their tokens
special where the family has them special): `orchard model create --chat NAME`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.formats.deepseek import MARKERS as _DS


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


def _j(*parts: str) -> str:
    return "".join(parts)


# a tool call's name and its arguments as JSON (arguments may come as a dict or a string)
_NAME = "{%- set tool_call = tc.function if tc.function is defined else tc %}"
_ARGS = "(tool_call.arguments if tool_call.arguments is string else tool_call.arguments | tojson)"
_TOOLS_JSON = "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"


def _chatml(call_open: str = "<tool_call>", call_close: str = "</tool_call>", bos: str = "",
            pythonic: bool = False, list_open: str = "<tools>", list_close: str = "</tools>") -> str:
    """ChatML (<|im_start|>role ... <|im_end|>) with Hermes-style tools in the system turn."""
    if pythonic:  # LFM2: [name(arg=value, ...)]
        call = _j("{{ '[' + tool_call.name + '(' }}{%- for k, v in tool_call.arguments.items() %}",
                  "{{ k + '=' + (v | tojson) }}{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ ')]' }}")
    else:  # {"name": ..., "arguments": ...}
        call = "{{ '\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + " + _ARGS + " + '}\\n' }}"
    return _j(
        bos and "{{ bos_token }}",
        "{%- if tools %}{{ '<|im_start|>system\\n' }}",
        "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}",
        "{{ '# Tools\\n\\nYou may call one or more functions. Their signatures are within " + list_open
        + list_close + ":\\n" + list_open + "' }}",
        _TOOLS_JSON,
        "{{ '\\n" + list_close + "\\n\\nReturn each function call within " + call_open + call_close
        + ".<|im_end|>\\n' }}",
        "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'system' and tools and loop.first %}",
        "{%- elif message['role'] == 'assistant' and message.tool_calls %}",
        "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}",
        "{%- for tc in message.tool_calls %}", _NAME, "{{ '" + call_open + "' }}", call,
        "{{ '" + call_close + "' }}{%- endfor %}{{ '<|im_end|>\\n' }}",
        "{%- elif message['role'] == 'tool' %}",
        "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}",
        "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}",
        "{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}",
    )


_CHATML_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_HERMES_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHATML = ChatFormat(control=_CHATML_CONTROL, markers=_HERMES_MARKERS, eos="<|im_end|>", pad="<|endoftext|>",
                    template=_chatml(), tools=True, call_marker="<tool_call>")

# Nemotron-H: ChatML, tool calls as <TOOLCALL>[...]</TOOLCALL>
NEMOTRON = ChatFormat(control=_CHATML_CONTROL, markers=("<TOOLCALL>", "</TOOLCALL>", "<tool_response>",
                                                        "</tool_response>"),
                      eos="<|im_end|>", pad="<|endoftext|>", template=_chatml("<TOOLCALL>", "</TOOLCALL>"), tools=True, call_marker="<TOOLCALL>")

# LFM2: ChatML after <|startoftext|>, tools as a list and pythonic calls between markers
LFM2 = ChatFormat(control=("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                  markers=("<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
                           "<tool_response>", "</tool_response>"),
                  eos="<|im_end|>", bos="<|startoftext|>", pad="<|pad|>", tools=True, call_marker="<|tool_call_start|>",
                  template=_chatml("<|tool_call_start|>", "<|tool_call_end|>", bos="yes", pythonic=True,
                                   list_open="<|tool_list_start|>", list_close="<|tool_list_end|>"))

# Llama 3.1: header tokens; a tool call is <|python_tag|>{json}<|eom_id|>, its result the ipython role
LLAMA3 = ChatFormat(
    control=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
             "<|eom_id|>", "<|finetune_right_pad_id|>"),
    markers=("<|python_tag|>",), eos="<|eot_id|>", stop=("<|eom_id|>", "<|end_of_text|>"),
    bos="<|begin_of_text|>", pad="<|finetune_right_pad_id|>", tools=True, call_marker="<|python_tag|>",
    template=_j(
        "{{ bos_token }}",
        "{%- if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n' }}",
        "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{%- endif %}",
        "{{ '\\nYou have access to these functions. To call one, answer with <|python_tag|> and JSON of the "
        "form {\"name\": function name, \"parameters\": arguments}.' }}", _TOOLS_JSON, "{{ '<|eot_id|>' }}",
        "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'system' and tools and loop.first %}",
        "{%- elif message['role'] == 'assistant' and message.tool_calls %}",
        "{%- for tc in message.tool_calls %}", _NAME,
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>{\"name\": \"' + tool_call.name"
        " + '\", \"parameters\": ' + ", _ARGS, " + '}<|eom_id|>' }}{%- endfor %}",
        "{%- else %}{{ '<|start_header_id|>' + ('ipython' if message['role'] == 'tool' else message['role'])"
        " + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}",
        "{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
    ))

# Gemma 2 / 3: user and model turns; a system message opens the first user turn
_GEMMA_SYSTEM = _j(
    "{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set first = '' %}{%- endif %}",
)
GEMMA = ChatFormat(
    control=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), eos="<end_of_turn>", stop=("<eos>",),
    bos="<bos>", pad="<pad>",
    template=_j(
        "{{ bos_token }}", _GEMMA_SYSTEM,
        "{%- for message in messages %}",
        "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'"
        " + (first if loop.first else '') + message['content'] + '<end_of_turn>\\n' }}",
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}",
    ))

# Gemma 4: <|turn>role ... <turn|>; tools declared in the system turn, calls <|tool_call>call:name{...}<tool_call|>
GEMMA4 = ChatFormat(
    control=("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"),
    markers=("<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>"),
    eos="<turn|>", stop=("<eos>",), bos="<bos>", pad="<pad>", tools=True, call_marker="<|tool_call>",
    template=_j(
        "{{ bos_token }}",
        "{%- if tools or messages[0]['role'] == 'system' %}{{ '<|turn>system\\n' }}",
        "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{%- endif %}",
        "{%- for tool in tools or [] %}{{ '<|tool>declaration:' + (tool | tojson) + '<tool|>' }}{%- endfor %}",
        "{{ '<turn|>\\n' }}{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'system' and loop.first %}",
        "{%- elif message['role'] == 'tool' %}",
        "{{ '<|tool_response>response:' + (message.name or 'tool') + '{value:' + (message['content'] | tojson)"
        " + '}<tool_response|>' }}",
        "{%- else %}{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'"
        " + (message['content'] or '') }}",
        "{%- for tc in message.tool_calls or [] %}", _NAME,
        "{{ '<|tool_call>call:' + tool_call.name + ", _ARGS, " + '<tool_call|>' }}{%- endfor %}",
        "{{ '<turn|>\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|turn>model\\n' }}{%- endif %}",
    ))

# Mistral: [INST] ... [/INST]; tools in [AVAILABLE_TOOLS] before the last user turn, calls after [TOOL_CALLS]
MISTRAL = ChatFormat(
    control=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
             "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
    markers=("[TOOL_CALLS]",), eos="</s>", bos="<s>", pad="<unk>", tools=True, call_marker="[TOOL_CALLS]",
    template=_j(
        "{{ bos_token }}",
        "{%- if messages[0]['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + messages[0]['content'] + '[/SYSTEM_PROMPT]' }}"
        "{%- set messages = messages[1:] %}{%- endif %}",
        "{%- set ns = namespace(last_user=-1) %}{%- for message in messages %}{%- if message['role'] == 'user' %}"
        "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'user' %}",
        "{%- if tools and loop.index0 == ns.last_user %}{{ '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}",
        "{{ '[INST]' + message['content'] + '[/INST]' }}",
        "{%- elif message['role'] == 'tool' %}{{ '[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]' }}",
        "{%- elif message.tool_calls %}{{ '[TOOL_CALLS][' }}",
        "{%- for tc in message.tool_calls %}", _NAME,
        "{{ '{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + ", _ARGS, " + '}' }}",
        "{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ ']</s>' }}",
        "{%- else %}{{ message['content'] + '</s>' }}{%- endif %}{%- endfor %}",
    ))

# Phi-3 / Phi-4-mini: <|role|>\n ... <|end|>; tools between <|tool|> <|/tool|> in the system turn
PHI3 = ChatFormat(
    control=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    markers=("<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>"),
    eos="<|end|>", stop=("<|endoftext|>",), pad="<|endoftext|>", tools=True, call_marker="<|tool_call|>",
    template=_j(
        "{%- if tools and messages[0]['role'] != 'system' %}{{ '<|system|>\\n<|tool|>' + (tools | tojson)"
        " + '<|/tool|><|end|>\\n' }}{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] }}",
        "{%- if tools %}{{ '<|tool|>' + (tools | tojson) + '<|/tool|>' }}{%- endif %}{{ '<|end|>\\n' }}",
        "{%- elif message['role'] == 'tool' %}{{ '<|tool_response|>\\n' + message['content'] + '<|end|>\\n' }}",
        "{%- else %}{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}",
        "{%- for tc in message.tool_calls or [] %}", _NAME,
        "{{ '<|tool_call|>{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + ", _ARGS,
        " + '}<|/tool_call|>' }}{%- endfor %}",
        "{{ '<|end|>\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}",
    ))

# DeepSeek-V3: <｜User｜> / <｜Assistant｜>; tool calls and outputs between their own markers
DEEPSEEK = ChatFormat(
    control=(_DS["bos"], _DS["eos"], _DS["user"], _DS["assistant"]),
    markers=tuple(_DS[k] for k in ("calls", "calls_end", "call", "call_end", "sep", "outputs", "outputs_end",
                                   "output", "output_end")),
    eos=_DS["eos"], bos=_DS["bos"], pad=_DS["eos"], tools=True, call_marker=_DS["calls"],
    template=_j(
        "{{ bos_token }}",
        "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{%- endif %}",
        "{%- if tools %}{{ '\\n\\n## Tools\\nYou have access to these tools:' }}", _TOOLS_JSON, "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'user' %}{{ '" + _DS["user"] + "' + message['content'] }}",
        "{%- elif message['role'] == 'tool' %}",
        "{{ '" + _DS["outputs"] + _DS["output"] + "' + message['content'] + '" + _DS["output_end"]
        + _DS["outputs_end"] + "' }}",
        "{%- elif message['role'] == 'assistant' %}{{ '" + _DS["assistant"] + "' + (message['content'] or '') }}",
        "{%- if message.tool_calls %}{{ '" + _DS["calls"] + "' }}{%- for tc in message.tool_calls %}", _NAME,
        "{{ '" + _DS["call"] + "function" + _DS["sep"] + "' + tool_call.name + '\\n```json\\n' + ", _ARGS,
        " + '\\n```" + _DS["call_end"] + "' }}{%- endfor %}{{ '" + _DS["calls_end"] + "' }}{%- endif %}",
        "{{ '" + _DS["eos"] + "' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '" + _DS["assistant"] + "' }}{%- endif %}",
    ))

# Command R / A (Cohere): role tokens inside START/END_OF_TURN; tool calls as a JSON list in an action
COHERE = ChatFormat(
    control=("<PAD>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
             "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"),
    markers=("<|START_ACTION|>", "<|END_ACTION|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>",
             "<|START_RESPONSE|>", "<|END_RESPONSE|>"),
    eos="<|END_OF_TURN_TOKEN|>", stop=("<EOS_TOKEN>",), bos="<BOS_TOKEN>", pad="<PAD>", tools=True, call_marker="<|START_ACTION|>",
    template=_j(
        "{{ bos_token }}",
        "{%- if tools or messages[0]['role'] == 'system' %}{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' }}",
        "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{%- endif %}",
        "{%- if tools %}{{ '\\n\\n## Available Tools\\n```json\\n[' }}{%- for tool in tools %}{{ tool | tojson }}",
        "{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ ']\\n```' }}{%- endif %}",
        "{{ '<|END_OF_TURN_TOKEN|>' }}{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'system' and loop.first %}",
        "{%- elif message['role'] == 'user' %}",
        "{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + message['content'] + '<|END_OF_TURN_TOKEN|>' }}",
        "{%- elif message['role'] == 'tool' %}{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>'"
        " + message['content'] + '<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>' }}",
        "{%- elif message.tool_calls %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_ACTION|>[' }}",
        "{%- for tc in message.tool_calls %}", _NAME,
        "{{ '{\"tool_call_id\": \"' + (loop.index0 | string) + '\", \"tool_name\": \"' + tool_call.name"
        " + '\", \"parameters\": ' + ", _ARGS, " + '}' }}{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}",
        "{{ ']<|END_ACTION|><|END_OF_TURN_TOKEN|>' }}",
        "{%- else %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>' + message['content']"
        " + '<|END_RESPONSE|><|END_OF_TURN_TOKEN|>' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}",
    ))

# gpt-oss harmony: <|start|>role<|channel|>...<|message|>...<|end|>; tools in the developer turn,
# calls on the commentary channel to=functions.NAME, ending <|call|>; a final answer ends <|return|>
HARMONY = ChatFormat(
    control=("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
             "<|constrain|>", "<|return|>", "<|call|>"),
    eos="<|return|>", stop=("<|call|>", "<|endoftext|>"), pad="<|endoftext|>", tools=True, call_marker="<|channel|>commentary to=functions.",
    template=_j(
        "{{ '<|start|>system<|message|>You are a helpful assistant.\\n\\nReasoning: medium\\n\\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}",
        "{%- if tools %}{{ '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}"
        "{%- endif %}{{ '<|end|>' }}",
        "{%- if tools or messages[0]['role'] == 'system' %}{{ '<|start|>developer<|message|>' }}",
        "{%- if messages[0]['role'] == 'system' %}{{ '# Instructions\\n\\n' + messages[0]['content'] + '\\n\\n' }}",
        "{%- endif %}{%- if tools %}{{ '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}",
        "{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}",
        "{{ '\\n// ' + (f.description or '') + '\\ntype ' + f.name + ' = (_: ' + (f.parameters | tojson)"
        " + ') => any;\\n' }}{%- endfor %}{{ '\\n} // namespace functions' }}{%- endif %}{{ '<|end|>' }}",
        "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'system' and loop.first %}",
        "{%- elif message['role'] == 'tool' %}{{ '<|start|>functions.' + (message.name or 'tool')"
        " + ' to=assistant<|channel|>commentary<|message|>' + message['content'] + '<|end|>' }}",
        "{%- elif message['role'] == 'assistant' and message.tool_calls %}",
        "{%- for tc in message.tool_calls %}", _NAME,
        "{{ '<|start|>assistant<|channel|>commentary to=functions.' + tool_call.name"
        " + ' <|constrain|>json<|message|>' + ", _ARGS, " + '<|call|>' }}{%- endfor %}",
        "{%- elif message['role'] == 'assistant' %}",
        "{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}",
        "{%- else %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}",
        "{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{%- endif %}",
    ))

# Granite: <|start_of_role|>role<|end_of_role|> ... <|end_of_text|>; calls after <|tool_call|>
GRANITE = ChatFormat(
    control=("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"), markers=("<|tool_call|>",),
    eos="<|end_of_text|>", pad="<|end_of_text|>", tools=True, call_marker="<|tool_call|>",
    template=_j(
        "{%- if tools %}{{ '<|start_of_role|>available_tools<|end_of_role|>' }}{%- for tool in tools %}",
        "{{ (tool | tojson) + '\\n' }}{%- endfor %}{{ '<|end_of_text|>\\n' }}{%- endif %}",
        "{%- for message in messages %}",
        "{{ '<|start_of_role|>' + ('tool_response' if message['role'] == 'tool' else message['role'])"
        " + '<|end_of_role|>' + (message['content'] or '') }}",
        "{%- if message.tool_calls %}{{ '<|tool_call|>[' }}{%- for tc in message.tool_calls %}", _NAME,
        "{{ '{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + ", _ARGS, " + '}' }}",
        "{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ ']' }}{%- endif %}",
        "{{ '<|end_of_text|>\\n' }}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}",
    ))

# EXAONE 4: [|role|] ... [|endofturn|]; Hermes-style <tool_call> in the assistant turn
EXAONE = ChatFormat(
    control=("[PAD]", "[BOS]", "[|endofturn|]", "[|system|]", "[|user|]", "[|assistant|]", "[|tool|]"),
    markers=_HERMES_MARKERS[:2] + ("<tool_result>", "</tool_result>"), eos="[|endofturn|]", pad="[PAD]",
    tools=True, call_marker="<tool_call>",
    template=_j(
        "{%- if tools %}{{ '[|system|]# Available Tools\\n<tools>' }}", _TOOLS_JSON,
        "{{ '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.[|endofturn|]\\n' }}",
        "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'tool' %}{{ '[|tool|]<tool_result>' + message['content']"
        " + '</tool_result>[|endofturn|]\\n' }}",
        "{%- else %}{{ '[|' + message['role'] + '|]' + (message['content'] or '') }}",
        "{%- for tc in message.tool_calls or [] %}", _NAME,
        "{{ '<tool_call>{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + ", _ARGS,
        " + '}</tool_call>' }}{%- endfor %}",
        "{%- if message['role'] != 'user' %}{{ '[|endofturn|]' }}{%- endif %}{{ '\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '[|assistant|]' }}{%- endif %}",
    ))

# GLM-4: [gMASK]<sop> then <|role|>\n...; a turn ends where the next role token begins, a tool
# call is "name\n{arguments}" and its result an <|observation|> turn
GLM4 = ChatFormat(
    control=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
    eos="<|user|>", stop=("<|observation|>", "<|endoftext|>"), pad="<|endoftext|>", tools=True, call_marker="<|assistant|>",
    template=_j(
        "{{ '[gMASK]<sop>' }}",
        "{%- if tools %}{{ '<|system|>\\n# Available tools' }}", _TOOLS_JSON, "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'tool' %}{{ '<|observation|>\\n' + message['content'] }}",
        "{%- elif message.tool_calls %}{%- for tc in message.tool_calls %}", _NAME,
        "{{ '<|assistant|>' + tool_call.name + '\\n' + ", _ARGS, " }}{%- endfor %}",
        "{%- else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}",
    ))

# OLMo 2 / OLMoE instruct (Tulu): <|endoftext|><|user|>\n...\n<|assistant|>\n...<|endoftext|>
TULU = ChatFormat(
    control=("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"), eos="<|endoftext|>",
    bos="<|endoftext|>", pad="<|pad|>",
    template=_j(
        "{{ bos_token }}{%- for message in messages %}",
        "{%- if message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}",
        "{%- else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}",
    ))

# ERNIE 4.5: plain "User: / Assistant:" lines after <|begin_of_sentence|>
ERNIE = ChatFormat(
    control=("<unk>", "<|begin_of_sentence|>", "<|end_of_sentence|>"), eos="<|end_of_sentence|>",
    bos="<|begin_of_sentence|>", pad="<unk>",
    template=_j(
        "{{ bos_token }}{%- for message in messages %}",
        "{%- if message['role'] == 'system' %}{{ message['content'] + '\\n' }}",
        "{%- elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n' }}",
        "{%- else %}{{ 'Assistant: ' + message['content'] + '<|end_of_sentence|>' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ 'Assistant: ' }}{%- endif %}",
    ))

# StarCoder2-Instruct: ### Instruction / ### Response; fill-in-the-middle tokens in the vocabulary
STARCODER2 = ChatFormat(
    control=("<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"), eos="<|endoftext|>",
    bos="<|endoftext|>", pad="<fim_pad>",
    template=_j(
        "{{ bos_token }}{%- for message in messages %}",
        "{%- if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}",
        "{%- elif message['role'] == 'user' %}{{ '### Instruction\\n' + message['content'] + '\\n\\n' }}",
        "{%- else %}{{ '### Response\\n' + message['content'] + eos_token + '\\n\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '### Response\\n' }}{%- endif %}",
    ))

# what a test checks in a rendered prompt of each format: the generation prompt's end
GENERATION_PROMPT = {
    "CHATML": "<|im_start|>assistant\n", "NEMOTRON": "<|im_start|>assistant\n", "LFM2": "<|im_start|>assistant\n",
    "LLAMA3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "GEMMA": "<start_of_turn>model\n",
    "GEMMA4": "<|turn>model\n", "MISTRAL": "[/INST]", "PHI3": "<|assistant|>\n", "DEEPSEEK": _DS["assistant"],
    "COHERE": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "HARMONY": "<|start|>assistant",
    "GRANITE": "<|start_of_role|>assistant<|end_of_role|>", "EXAONE": "[|assistant|]", "GLM4": "<|assistant|>\n",
    "TULU": "<|assistant|>\n", "ERNIE": "Assistant: ", "STARCODER2": "### Response\n",
}
FORMATS = {name: globals()[name] for name in GENERATION_PROMPT}


# -- the real formats of the reasoning and tool-calling families ------------------------------
# `orchard model create --chat NAME`: each family's own chat template (cluster/chat_templates/,
# as the model's tokenizer_config.json carries it) and the tokens it names, special where the
# family's tokenizer has them special (Mistral's [TOOL_CALLS], harmony's channels, Llama 3's
# <|python_tag|>, Kimi's and DeepSeek's call sections), ordinary added tokens where it has
# them so (Qwen's <think> and <tool_call>).


def template_text(name: str) -> str:
    """A family's chat template, as its tokenizer_config.json carries it."""
    return (Path(__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


_QWEN = dict(control=_CHATML_CONTROL, eos="<|im_end|>", stop=("<|endoftext|>",), pad="<|endoftext|>", tools=True,
             call_marker="<tool_call>", bpe_first=True)
_THINK = ("<think>", "</think>")
_DS_CALLS = tuple(_DS[k] for k in ("calls", "calls_end", "call", "call_end", "sep", "outputs", "outputs_end",
                                   "output", "output_end"))
_DEEPSEEK = dict(control=(_DS["bos"], _DS["eos"], _DS["user"], _DS["assistant"]) + _DS_CALLS, markers=_THINK,
                 eos=_DS["eos"], bos=_DS["bos"], pad=_DS["eos"], tools=True, call_marker=_DS["calls"])
_KIMI = ("[BOS]", "[EOS]", "[PAD]", "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
         "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|media_start|>", "<|media_content|>", "<|media_pad|>",
         "<|media_end|>")
_TEKKEN = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]", "[TOOL_CALLS]")
_TEKKEN_V11 = _TEKKEN + ("[IMG]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]", "[TOOL_CONTENT]")
_MISTRAL = dict(eos="</s>", bos="<s>", pad="<unk>", tools=True, call_marker="[TOOL_CALLS]")

REAL_FORMATS = {
    # Qwen3: the model opens <think> itself (enable_thinking=False closes an empty one in the prompt)
    "qwen3": ChatFormat(markers=_HERMES_MARKERS + _THINK, template=template_text("qwen3"), **_QWEN),
    # QwQ: the template opens <think> in the prompt
    "qwq": ChatFormat(markers=_HERMES_MARKERS + _THINK, template=template_text("qwq"), **_QWEN),
    # Qwen3-Coder: XML calls, <tool_call><function=NAME><parameter=KEY>value</parameter>...
    "qwen3-coder": ChatFormat(markers=_HERMES_MARKERS, template=template_text("qwen3-coder"), **_QWEN),
    # DeepSeek-R1 (the distills' template): <think> opened in the prompt
    "deepseek-r1": ChatFormat(template=template_text("deepseek-r1"), **_DEEPSEEK),
    # DeepSeek-V3.1: `thinking` opens <think> in the prompt (else </think> closes it); calls
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>...
    "deepseek-v3.1": ChatFormat(template=template_text("deepseek-v3.1"), **_DEEPSEEK),
    # gpt-oss: harmony channels (analysis = thinking, final = answer, commentary to=functions.NAME = a call)
    "gpt-oss": ChatFormat(
        control=("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                 "<|constrain|>", "<|return|>", "<|call|>"),
        eos="<|return|>", stop=("<|call|>", "<|endoftext|>"), pad="<|endoftext|>", tools=True,
        call_marker="to=functions.", template=template_text("gpt-oss")),
    # Kimi K2 (Instruct and Thinking): call sections of special tokens; Thinking's <think> too
    "kimi-k2": ChatFormat(control=_KIMI, eos="<|im_end|>", stop=("[EOS]",), bos="[BOS]", pad="[PAD]", tools=True,
                          call_marker="<|tool_calls_section_begin|>", template=template_text("kimi-k2")),
    "kimi-k2-thinking": ChatFormat(control=_KIMI + _THINK, eos="<|im_end|>", stop=("[EOS]",), bos="[BOS]",
                                   pad="[PAD]", tools=True, call_marker="<|tool_calls_section_begin|>",
                                   template=template_text("kimi-k2-thinking")),
    # GLM-4.5 / 4.6: <think> the model opens, XML key/value calls
    "glm-4.5": ChatFormat(
        control=("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                 "<|assistant|>", "<|observation|>"),
        markers=_THINK + ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
                          "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"),
        eos="<|endoftext|>", stop=("<|user|>", "<|observation|>"), pad="<|endoftext|>", tools=True,
        call_marker="<tool_call>", template=template_text("glm-4.5")),
    # Magistral (2509) / Ministral 3 Reasoning: [THINK]...[/THINK], calls NAME[ARGS]{...}
    "magistral": ChatFormat(control=_TEKKEN_V11 + ("[THINK]", "[/THINK]"), template=template_text("magistral"),
                            **_MISTRAL),
    # Mistral v3 tool calls (Mistral Nemo): [TOOL_CALLS][{"name": ..., "arguments": ...}]
    "mistral-nemo": ChatFormat(control=_TEKKEN, template=template_text("mistral-nemo"), **_MISTRAL),
    # Mistral v11 (Mistral Small 3.2, Devstral): [TOOL_CALLS]NAME[ARGS]{...}
    "mistral-small-3.2": ChatFormat(control=_TEKKEN_V11, template=template_text("mistral-small-3.2"), **_MISTRAL),
    # Llama 3.1: JSON calls {"name": ..., "parameters": ...}, or after <|python_tag|>
    "llama-3.1": ChatFormat(control=LLAMA3.control + ("<|python_tag|>",), eos="<|eot_id|>", stop=("<|eom_id|>", "<|end_of_text|>"),
                            bos="<|begin_of_text|>", pad="<|finetune_right_pad_id|>", tools=True,
                            call_marker='{"name": "', template=template_text("llama-3.1")),
    # Granite 3.3: `thinking` asks for <think>...</think><response>...</response> (plain text);
    # calls after <|tool_call|>
    "granite-3.3": ChatFormat(control=("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>",
                                       "<|start_of_cite|>", "<|end_of_cite|>"),
                              eos="<|end_of_text|>", pad="<|end_of_text|>", tools=True, call_marker="<|tool_call|>",
                              template=template_text("granite-3.3")),
    # NVIDIA Nemotron Nano 2: /think and /no_think; <think> opened in the prompt; <TOOLCALL>[...]</TOOLCALL>
    "nemotron-nano-2": ChatFormat(control=("<unk>", "<s>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>")
                                  + _THINK + ("<TOOLCALL>", "</TOOLCALL>"),
                                  markers=("<AVAILABLE_TOOLS>", "</AVAILABLE_TOOLS>", "<TOOL_RESPONSE>",
                                           "</TOOL_RESPONSE>"),
                                  eos="<SPECIAL_12>", stop=("</s>",), bos="<s>", pad="<unk>", tools=True,
                                  call_marker="<TOOLCALL>", template=template_text("nemotron-nano-2")),
}
# the mlx-lm architecture each family's models have (what `orchard model create --chat` pairs it with)
REAL_FORMAT_ARCH = {
    "qwen3": "qwen3", "qwq": "qwen2", "qwen3-coder": "qwen3_moe", "deepseek-r1": "qwen2", "deepseek-v3.1": "deepseek_v3",
    "gpt-oss": "gpt_oss", "kimi-k2": "deepseek_v3", "kimi-k2-thinking": "deepseek_v3", "glm-4.5": "glm4",
    "magistral": "mistral", "mistral-nemo": "mistral", "mistral-small-3.2": "mistral", "llama-3.1": "llama",
    "granite-3.3": "granite", "nemotron-nano-2": "nemotron_h",
}
