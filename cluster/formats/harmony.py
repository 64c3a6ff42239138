"""gpt-oss's harmony: messages [<|start|>ROLE] HEADER <|message|> BODY <|end|> on channels;
analysis is the thinking, final the answer, commentary to=functions.NAME a call (its body
the JSON arguments). `HarmonyStream` splits the thinking and the calls together."""

from __future__ import annotations

import json
import re
from typing import Callable, Mapping

from cluster.formats.base import MlxLmCalls, Thought, partial_suffix
from cluster.formats.calls import CallFormat, parse_json_object
from cluster.formats.chat import TOOL_CALL_ARGS, TOOL_CALL_NAME, ChatFormat, join, template_text
from cluster.formats.family import Family
from cluster.formats.grammar import arguments_schema, each_function, json_rule
from cluster.formats.thinking import ReasoningFormat

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


class HarmonyStream:
    """gpt-oss's harmony messages: [<|start|>ROLE] HEADER <|message|> BODY <|end|> (or
    <|call|>, <|return|>, the end of the output). The analysis channel is thinking, final
    the answer, commentary to=functions.NAME a call (its body the JSON arguments),
    commentary without a recipient a preamble (answer text). Segments as OutputSplitter's."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self, calls: CallFormat | None, tools: list[dict], parallel: bool = True, thinking: bool = False):
        self.calls, self.tools, self.parallel = calls, tools, parallel
        self.buffer = ""
        self.in_body = thinking
        self.route = "reasoning" if thinking else None  # "reasoning" | "content" | "call:NAME"
        self.body = ""  # a call's arguments so far
        self.header = ""
        self.started = False  # some message has been seen
        self.num_calls = 0
        self.trim = thinking

    def segments(self, text: str) -> list:
        self.buffer += text
        out: list = []
        while self.buffer:
            marks = self.ENDS if self.in_body else ("<|message|>",)
            found = min(((i, m) for m in marks if (i := self.buffer.find(m)) >= 0), default=None)
            if found is None:
                keep = max(partial_suffix(self.buffer, m) for m in HARMONY_TOKENS)
                self._take(out, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            i, mark = found
            self._take(out, self.buffer[:i])
            self.buffer = self.buffer[i + len(mark):]
            if self.in_body:
                self._close(out)
            else:
                self._open()
        return out

    def _take(self, out: list, text: str) -> None:
        if not text:
            return
        if not self.in_body:
            self.header += text
            return
        if self.route.startswith("call:"):
            self.body += text
            return
        if self.trim:
            text = text.lstrip()
            if not text:
                return
            self.trim = False
        out.append(Thought(text) if self.route == "reasoning" else text)

    def _open(self) -> None:
        """A header is complete: where its body goes."""
        header, self.header = self.header, ""
        self.started, self.in_body, self.trim, self.body = True, True, True, ""
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith("functions.") and self.calls is not None:
            self.route = "call:" + recipient.group(1)[len("functions."):]
        elif channel is not None and channel.group(1) == "analysis":
            self.route = "reasoning"
        else:
            self.route = "content"

    def _close(self, out: list, closed: bool = True) -> None:
        route, self.in_body = self.route, False
        if not route.startswith("call:"):
            return
        body, self.body = self.body, ""
        try:
            args = json.loads(body) if body.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("the arguments are not an object")
        except (ValueError, RecursionError):  # nested deeper than Python parses, too
            if body:
                out.append(body)  # a malformed call stays visible as text
            return
        if self.parallel or self.num_calls == 0:
            out.append(self.calls.tool_call(route[len("call:"):], json.dumps(args, ensure_ascii=False), self.num_calls))
            self.num_calls += 1

    def rest(self) -> list:
        out: list = []
        rest, self.buffer = self.buffer, ""
        self._take(out, rest)
        if self.in_body:
            self._close(out, closed=False)
        elif self.header and not self.started and "<|" not in self.header:
            out.append(self.header)  # no channel at all: the model answered plainly
        self.header = ""
        return out


def grammar(chosen: list[dict], atom: Callable[[str], str], start: str = "", end: str = "") -> str:
    """One call message's header and JSON body."""
    return "start: fn\n" + each_function(
        chosen, lambda i, f: f'{atom("<|channel|>")} {json.dumps("commentary to=functions." + f["name"] + " ")} '
                             f'{atom("<|constrain|>")} "json" {atom("<|message|>")} {json_rule(arguments_schema(f))}')


HARMONY = ReasoningFormat("harmony", "<|channel|>analysis<|message|>", "<|end|>", harmony=True, kept=HARMONY_TOKENS,
                          splitter=HarmonyStream, grammar_start=("<|channel|>", "analysis", "<|message|>"),
                          grammar_end=("<|end|>", "<|start|>", "assistant"),
                          answer_start=("<|channel|>", "final", "<|message|>"))
HARMONY_CALLS = CallFormat("harmony", "to=functions.", "", parse_json_object, grammar=grammar)


def call_format(template: str, vocab: Mapping[str, int], mlx_lm: MlxLmCalls | None) -> CallFormat | None:
    if "<|channel|>" in vocab and "functions." in template and "commentary" in template:
        return HARMONY_CALLS
    return None


def reasoning_format(template: str, vocab: Mapping[str, int]) -> ReasoningFormat | None:
    if "<|channel|>" in vocab and "<|message|>" in vocab and "analysis" in template:
        return HARMONY
    return None


FAMILY = Family("harmony", calls=call_format, reasoning=reasoning_format)


# -- its chat format (`orchard model create`) -------------------------------------------------
# gpt-oss harmony: <|start|>role<|channel|>...<|message|>...<|end|>; tools in the developer turn,
# calls on the commentary channel to=functions.NAME, ending <|call|>; a final answer ends <|return|>
HARMONY_CHAT = ChatFormat(
    control=("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
             "<|constrain|>", "<|return|>", "<|call|>"),
    eos="<|return|>", stop=("<|call|>", "<|endoftext|>"), pad="<|endoftext|>", tools=True,
    call_marker="<|channel|>commentary to=functions.",
    template=join(
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
        "{%- for tc in message.tool_calls %}", TOOL_CALL_NAME,
        "{{ '<|start|>assistant<|channel|>commentary to=functions.' + tool_call.name"
        " + ' <|constrain|>json<|message|>' + ", TOOL_CALL_ARGS, " + '<|call|>' }}{%- endfor %}",
        "{%- elif message['role'] == 'assistant' %}",
        "{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}",
        "{%- else %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}",
        "{%- endif %}{%- endfor %}",
        "{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{%- endif %}",
    ))

# `orchard model create --chat NAME`: the real chat templates (chat_templates/) and their tokens
REAL_FORMATS = {
    # gpt-oss: harmony channels (analysis = thinking, final = answer, commentary to=functions.NAME = a call)
    "gpt-oss": ChatFormat(
        control=("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                 "<|constrain|>", "<|return|>", "<|call|>"),
        eos="<|return|>", stop=("<|call|>", "<|endoftext|>"), pad="<|endoftext|>", tools=True,
        call_marker="to=functions.", template=template_text("gpt-oss")),
}
