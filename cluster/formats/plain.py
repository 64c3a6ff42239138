"""The chat formats of the families with no tool-call or thinking format of Orchard's own
(their calls, where they make any, are mlx-lm's: hermes.py; GLM-4.5 thinks in think.py's
tags): LFM2, Gemma 2 / 3 and 4, Phi-3, Command R, EXAONE, GLM-4, OLMo's Tulu, ERNIE,
StarCoder2."""

from __future__ import annotations

from cluster.formats.chat import TOOLS_JSON, TOOL_CALL_ARGS, TOOL_CALL_NAME, ChatFormat, chatml, join, template_text
from cluster.formats.hermes import HERMES_MARKERS
from cluster.formats.think import THINK_TOKENS

# LFM2: ChatML after <|startoftext|>, tools as a list and pythonic calls between markers
LFM2 = ChatFormat(control=("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                  markers=("<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
                           "<tool_response>", "</tool_response>"),
                  eos="<|im_end|>", bos="<|startoftext|>", pad="<|pad|>", tools=True, call_marker="<|tool_call_start|>",
                  template=chatml("<|tool_call_start|>", "<|tool_call_end|>", bos="yes", pythonic=True,
                                  list_open="<|tool_list_start|>", list_close="<|tool_list_end|>"))

# Gemma 2 / 3: user and model turns; a system message opens the first user turn
_GEMMA_SYSTEM = join(
    "{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n\\n' %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set first = '' %}{%- endif %}",
)

GEMMA = ChatFormat(
    control=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), eos="<end_of_turn>", stop=("<eos>",),
    bos="<bos>", pad="<pad>",
    template=join(
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
    template=join(
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
        "{%- for tc in message.tool_calls or [] %}", TOOL_CALL_NAME,
        "{{ '<|tool_call>call:' + tool_call.name + ", TOOL_CALL_ARGS, " + '<tool_call|>' }}{%- endfor %}",
        "{{ '<turn|>\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|turn>model\\n' }}{%- endif %}",
    ))

# Phi-3 / Phi-4-mini: <|role|>\n ... <|end|>; tools between <|tool|> <|/tool|> in the system turn
PHI3 = ChatFormat(
    control=("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    markers=("<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>"),
    eos="<|end|>", stop=("<|endoftext|>",), pad="<|endoftext|>", tools=True, call_marker="<|tool_call|>",
    template=join(
        "{%- if tools and messages[0]['role'] != 'system' %}{{ '<|system|>\\n<|tool|>' + (tools | tojson)"
        " + '<|/tool|><|end|>\\n' }}{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] }}",
        "{%- if tools %}{{ '<|tool|>' + (tools | tojson) + '<|/tool|>' }}{%- endif %}{{ '<|end|>\\n' }}",
        "{%- elif message['role'] == 'tool' %}{{ '<|tool_response|>\\n' + message['content'] + '<|end|>\\n' }}",
        "{%- else %}{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}",
        "{%- for tc in message.tool_calls or [] %}", TOOL_CALL_NAME,
        "{{ '<|tool_call|>{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + ", TOOL_CALL_ARGS,
        " + '}<|/tool_call|>' }}{%- endfor %}",
        "{{ '<|end|>\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}",
    ))

# Command R / A (Cohere): role tokens inside START/END_OF_TURN; tool calls as a JSON list in an action
COHERE = ChatFormat(
    control=("<PAD>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
             "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>"),
    markers=("<|START_ACTION|>", "<|END_ACTION|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>",
             "<|START_RESPONSE|>", "<|END_RESPONSE|>"),
    eos="<|END_OF_TURN_TOKEN|>", stop=("<EOS_TOKEN>",), bos="<BOS_TOKEN>", pad="<PAD>", tools=True,
    call_marker="<|START_ACTION|>",
    template=join(
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
        "{%- for tc in message.tool_calls %}", TOOL_CALL_NAME,
        "{{ '{\"tool_call_id\": \"' + (loop.index0 | string) + '\", \"tool_name\": \"' + tool_call.name"
        " + '\", \"parameters\": ' + ", TOOL_CALL_ARGS,
        " + '}' }}{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}",
        "{{ ']<|END_ACTION|><|END_OF_TURN_TOKEN|>' }}",
        "{%- else %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>' + message['content']"
        " + '<|END_RESPONSE|><|END_OF_TURN_TOKEN|>' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}",
    ))

# EXAONE 4: [|role|] ... [|endofturn|]; Hermes-style <tool_call> in the assistant turn
EXAONE = ChatFormat(
    control=("[PAD]", "[BOS]", "[|endofturn|]", "[|system|]", "[|user|]", "[|assistant|]", "[|tool|]"),
    markers=HERMES_MARKERS[:2] + ("<tool_result>", "</tool_result>"), eos="[|endofturn|]", pad="[PAD]",
    tools=True, call_marker="<tool_call>",
    template=join(
        "{%- if tools %}{{ '[|system|]# Available Tools\\n<tools>' }}", TOOLS_JSON,
        "{{ '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
        ".[|endofturn|]\\n' }}",
        "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'tool' %}{{ '[|tool|]<tool_result>' + message['content']"
        " + '</tool_result>[|endofturn|]\\n' }}",
        "{%- else %}{{ '[|' + message['role'] + '|]' + (message['content'] or '') }}",
        "{%- for tc in message.tool_calls or [] %}", TOOL_CALL_NAME,
        "{{ '<tool_call>{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + ", TOOL_CALL_ARGS,
        " + '}</tool_call>' }}{%- endfor %}",
        "{%- if message['role'] != 'user' %}{{ '[|endofturn|]' }}{%- endif %}{{ '\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '[|assistant|]' }}{%- endif %}",
    ))

# GLM-4: [gMASK]<sop> then <|role|>\n...; a turn ends where the next role token begins, a tool
# call is "name\n{arguments}" and its result an <|observation|> turn
GLM4 = ChatFormat(
    control=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
    eos="<|user|>", stop=("<|observation|>", "<|endoftext|>"), pad="<|endoftext|>", tools=True,
    call_marker="<|assistant|>",
    template=join(
        "{{ '[gMASK]<sop>' }}",
        "{%- if tools %}{{ '<|system|>\\n# Available tools' }}", TOOLS_JSON, "{%- endif %}",
        "{%- for message in messages %}",
        "{%- if message['role'] == 'tool' %}{{ '<|observation|>\\n' + message['content'] }}",
        "{%- elif message.tool_calls %}{%- for tc in message.tool_calls %}", TOOL_CALL_NAME,
        "{{ '<|assistant|>' + tool_call.name + '\\n' + ", TOOL_CALL_ARGS, " }}{%- endfor %}",
        "{%- else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}",
    ))

# OLMo 2 / OLMoE instruct (Tulu): <|endoftext|><|user|>\n...\n<|assistant|>\n...<|endoftext|>
TULU = ChatFormat(
    control=("<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"), eos="<|endoftext|>",
    bos="<|endoftext|>", pad="<|pad|>",
    template=join(
        "{{ bos_token }}{%- for message in messages %}",
        "{%- if message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}",
        "{%- else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}",
    ))

# ERNIE 4.5: plain "User: / Assistant:" lines after <|begin_of_sentence|>
ERNIE = ChatFormat(
    control=("<unk>", "<|begin_of_sentence|>", "<|end_of_sentence|>"), eos="<|end_of_sentence|>",
    bos="<|begin_of_sentence|>", pad="<unk>",
    template=join(
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
    template=join(
        "{{ bos_token }}{%- for message in messages %}",
        "{%- if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}",
        "{%- elif message['role'] == 'user' %}{{ '### Instruction\\n' + message['content'] + '\\n\\n' }}",
        "{%- else %}{{ '### Response\\n' + message['content'] + eos_token + '\\n\\n' }}{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '### Response\\n' }}{%- endif %}",
    ))

# `orchard model create --chat NAME`: the real chat templates (chat_templates/) and their tokens
REAL_FORMATS = {
    # GLM-4.5 / 4.6: <think> the model opens, XML key/value calls
    "glm-4.5": ChatFormat(
        control=("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                 "<|assistant|>", "<|observation|>"),
        markers=THINK_TOKENS + ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
                          "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"),
        eos="<|endoftext|>", stop=("<|user|>", "<|observation|>"), pad="<|endoftext|>", tools=True,
        call_marker="<tool_call>", template=template_text("glm-4.5")),
}
