"""Tool calls in a model's output: a family's `CallFormat` (its markers, its parser, the
grammar that forces a call) and `ToolCallStream`, which cuts calls out of any family's
streamed output: text before a start marker streams as content, the call's text is held
until its end marker (or the end of the output when the family has none) and parsed then,
and markers never reach the content (the worker decodes the output with a family's
special marker tokens kept). The JSON call parsers several families share are here too.
Nothing here imports MLX.
"""

from __future__ import annotations

import json
import random
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from cluster.formats.base import ToolParser, partial_suffix
from cluster.proto.orchard.v1 import orchard_pb2 as pb

# a family's call grammar: (the chosen functions, how a marker is named, start, end) -> Lark text
CallGrammar = Callable[[list[dict], Callable[[str], str], str, str], str]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates refuse any other id: 9 letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class ToolCallStream:
    """Cuts tool calls out of a streamed output. `feed(text)` returns the content that may
    be shown now and the calls completed by it; `finish()` what is left at the end. Text
    that could be the start of a start marker is held back until it is known not to be.
    `bare_start`: a call may also open the output without a marker, with this text (Llama
    3's bare JSON call: "{"), and then runs to the end. `hidden`: the format's markers that
    are special tokens (a detokenizer drops them): a call that does not parse, or is cut
    short, comes back as text without them, as it would without tool parsing."""

    def __init__(self, start: str, end: str, parser: ToolParser, tools: list[dict], parallel: bool = True,
                 new_id: Callable[[str, int], str] | None = None, bare_start: str = "", hidden: tuple[str, ...] = ()):
        self.start, self.end, self.parser, self.tools = start, end, parser, tools
        self.hidden = hidden
        self.parallel = parallel
        self.new_id = new_id or (lambda name, index: new_call_id())
        self.bare_start = bare_start
        self.buffer = ""  # text not yet handed out (in a call: the call's text so far)
        self.in_call = False
        self.bare = False  # in a call opened by `bare_start` (no marker to put back if it fails)
        self.seen_text = False  # something other than whitespace was handed out
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[pb.ToolCall]]:
        return _joined(self.segments(text))

    def finish(self) -> tuple[str, list[pb.ToolCall]]:
        return _joined(self.rest())

    def segments(self, text: str) -> list[str | pb.ToolCall]:
        """What `text` completes, in the model's order: content (str) and calls."""
        # in a call, an end marker can only end in the new text: search from just before it
        # (so a long call costs O(its length), not O(length^2))
        scan_from = max(0, len(self.buffer) - len(self.end) + 1) if self.in_call else 0
        self.buffer += text
        out: list[str | pb.ToolCall] = []
        while True:
            if not self.in_call:
                if self.bare_start and not self.seen_text:
                    lead = self.buffer.lstrip()
                    if lead.startswith(self.bare_start):
                        self.in_call, self.bare, self.buffer = True, True, lead
                        break  # a bare call runs to the end of the output
                    if self.bare_start.startswith(lead):
                        break  # only whitespace yet, or what may still become the bare start
                    self.seen_text = True
                i = self.buffer.find(self.start)
                if i < 0:
                    keep = partial_suffix(self.buffer, self.start)
                    out.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                out.append(self.buffer[:i])
                self.buffer = self.buffer[i + len(self.start):]
                self.in_call = True
                scan_from = 0
            if not self.end:
                break  # the call runs to the end of the output
            j = self.buffer.find(self.end, scan_from)
            if j < 0:
                break
            body, self.buffer = self.buffer[:j], self.buffer[j + len(self.end):]
            self.in_call = False
            out += self._parse(body)
        if any(isinstance(x, str) and x.strip() for x in out):
            self.seen_text = True
        return [x for x in out if x != ""]

    def rest(self) -> list[str | pb.ToolCall]:
        """The rest at the end of the output: a call cut short is parsed if it can be (a
        family without an end marker ends here), else returned as text."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return [rest] if rest else []
        self.in_call = False
        return self._parse(rest, closed=False)

    def _parse(self, body: str, closed: bool = True) -> list[str | pb.ToolCall]:
        """The calls in one call's text (those kept), or the text with its markers when it
        does not parse."""
        try:
            result = self.parser(body, self.tools)
            items = result if isinstance(result, list) else [result]
            if not items:
                raise ValueError("no call")
            calls = [self._tool_call(item, self.num_calls + k) for k, item in enumerate(items)]
        except Exception:  # a parser of any family: a malformed call stays visible as text
            text = body if self.bare else self.start + body + (self.end if closed else "")
            for marker in self.hidden:
                text = text.replace(marker, "")
            return [text]
        if not self.parallel:
            calls = calls[:max(0, 1 - self.num_calls)]
        self.num_calls += len(calls)
        return calls

    def _tool_call(self, item: Any, index: int) -> pb.ToolCall:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise ValueError(f"not a tool call: {item!r}")
        args = item.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        return pb.ToolCall(id=self.new_id(item["name"], index), name=item["name"], arguments=args)


def _joined(segments: list[str | pb.ToolCall]) -> tuple[str, list[pb.ToolCall]]:
    return ("".join(x for x in segments if isinstance(x, str)), [x for x in segments if not isinstance(x, str)])


# -- the JSON calls several families write ---------------------------------------------------------
def json_object(text: str) -> dict:
    """A call's arguments: a JSON object (or one written as a JSON string); '' is {}."""
    value = json.loads(text) if text.strip() else {}
    if isinstance(value, str):  # arguments written as a JSON string
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("the arguments are not a JSON object")
    return value


def json_values(text: str) -> list[Any]:
    """The JSON values in `text`, one after another (separated by whitespace, ';' or ',')."""
    decoder, pos, out = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(text):
            return out
        value, pos = decoder.raw_decode(text, pos)
        out.append(value)


def named_call(obj: Any, args_key: str = "arguments") -> dict:
    """{"name", "arguments"} from a JSON call object, its arguments under `args_key`."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        raise ValueError(f"not a tool call: {obj!r}")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return {"name": obj["name"], "arguments": args if isinstance(args, dict) else json_object(args)}


def parse_json_calls(text: str, tools: Any = None) -> list[dict]:
    """A JSON call object or a list of them ({"name", "arguments"}): Granite, Nemotron,
    Mistral v3."""
    calls = []
    for value in json_values(text.strip()):
        calls += [named_call(v) for v in (value if isinstance(value, list) else [value])]
    return calls


def parse_json_object(text: str, tools: Any = None) -> dict:
    """mlx-lm's json_tools: {"name", "arguments"} (Hermes, Qwen)."""
    return json.loads(text.strip())


@dataclass(frozen=True)
class CallFormat:
    """How a family writes a tool call: the text between `start` and `end` ('' : to the
    end of the output), parsed by `parser(text, tools)` into a call dict or a list of them.
    `markers`: token texts the output must keep when decoded (special tokens the parser
    reads); `ids`: "openai" (call_...), "mistral" (9 letters and digits, which its templates
    require) or "kimi" (functions.NAME:INDEX, as its template renders them back); `grammar`:
    how constrained decoding forces a call, `grammar(chosen functions, atom, start, end)`
    -> Lark text (cluster/formats/grammar.py has the parts; cluster/worker/structured.py's
    `call_constraint` runs it), None where the format allows no grammar; `bare_start`: see
    ToolCallStream."""

    name: str
    start: str
    end: str
    parser: ToolParser = field(compare=False)
    markers: tuple[str, ...] = ()
    ids: str = "openai"
    grammar: CallGrammar | None = field(default=None, compare=False)
    bare_start: str = ""

    def new_id(self, name: str, index: int) -> str:
        if self.ids == "mistral":
            return mistral_call_id()
        if self.ids == "kimi":
            return f"functions.{name}:{index}"
        return new_call_id()

    def tool_call(self, name: str, arguments: str, index: int = 0) -> pb.ToolCall:
        return pb.ToolCall(id=self.new_id(name, index), name=name, arguments=arguments)

    def stream(self, tools: list[dict], parallel: bool = True, hidden: tuple[str, ...] = ()) -> ToolCallStream:
        """`hidden`: which of `markers` are special tokens in this model's vocabulary."""
        return ToolCallStream(self.start, self.end, self.parser, tools, parallel, self.new_id, self.bare_start, hidden)


