"""Tool calling on the wire: tool definitions and choices checked once, chat history
turned into what a chat template reads, and tool calls cut out of a model's output.

The model's family decides how a call looks: a `CallFormat` (`call_format` finds it from
the chat template and vocabulary) has its markers, its parser and how a grammar can force
a call. Orchard's own formats cover the families whose markers are special tokens or that
mlx-lm has no parser for (Mistral v3 and v11, Llama 3.x JSON and <|python_tag|>, DeepSeek
V3 / V3.1, Kimi K2, Granite, Nemotron, gpt-oss harmony); the others take the markers and
the parser from mlx-lm's tokenizer (Hermes' `<tool_call>{json}</tool_call>`, LFM2's
pythonic `[f(a=1)]`, Gemma 4's `call:f{...}`, GLM-4.5's and Qwen3-Coder's XML), which the
worker passes in. `ToolCallStream` does the rest for any of them: text before a start
marker streams as content, the call's text is held until its end marker (or the end of the
output when the family has none) and parsed then, and markers never reach the content (the
worker decodes the output with a family's special marker tokens kept). Nothing here
imports MLX.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from cluster.api.errors import BadField
from cluster.api.limits import MAX_ID_CHARS, MAX_NAME_CHARS, parse_json, quoted, shown
from cluster.proto.orchard.v1 import orchard_pb2 as pb

ToolParser = Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools): a call dict or a list of them


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates refuse any other id: 9 letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class Thought(str):
    """Thinking text among an output's segments (cluster/api/reasoning.py cuts it out);
    `split_chunk` puts it in a chunk's `reasoning`."""


# -- what a request may say ----------------------------------------------------------------
def parse_tools(tools_json: str) -> list[dict]:
    """The request's tool definitions (OpenAI's shape), or BadField saying what is wrong."""
    if not tools_json:
        return []
    tools = parse_json(tools_json, "tools")
    if not isinstance(tools, list):
        raise BadField("tools", "tools must be a list of tool definitions")
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise BadField("tools", f"tools[{i}]: only tools of type 'function' are supported")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadField("tools", f"tools[{i}].function.name is required")
        if len(fn["name"]) > MAX_NAME_CHARS:
            raise BadField("tools", f"tools[{i}].function.name has {len(fn['name'])} characters: at most "
                                    f"{MAX_NAME_CHARS} are allowed")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise BadField("tools", f"tools[{i}].function.parameters must be a JSON Schema object")
        if fn["name"] in names:
            raise BadField("tools", f"tools[{i}]: a second function named {quoted(fn['name'])}")
        names.add(fn["name"])
    return tools


def tool_choice_mode(request: pb.GenerateRequest) -> str:
    """"none", "auto", "required" or "function" (unset: "auto" with tools, "none" without)."""
    if not request.HasField("tool_choice"):
        return "auto" if request.tools else "none"
    which = request.tool_choice.WhichOneof("choice")
    if which == "function":
        return "function"
    mode = request.tool_choice.mode
    if mode not in ("none", "auto", "required"):
        raise BadField("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a function, got "
                                      f"{shown(mode)}")
    return mode


def validate_tools(request: pb.GenerateRequest, named: Callable[[str], str] = str) -> None:
    """The tool fields of a request, checked the same way by every backend (`named`: the
    name the client knows a wire field by)."""
    try:
        tools = parse_tools(request.tools)
    except BadField as e:
        raise BadField(named(e.param), e.message) from None
    if (request.tools or request.HasField("tool_choice") or request.HasField("parallel_tool_calls")) \
            and request.WhichOneof("prompt") != "chat":
        raise BadField(named("tools"), "tools, tool_choice and parallel_tool_calls need a chat prompt (messages)")
    choice = named("tool_choice")
    try:
        mode = tool_choice_mode(request)
    except BadField as e:
        raise BadField(choice, e.message) from None
    if mode in ("required", "function"):
        if not tools:
            raise BadField(choice, f"{choice} {mode!r} needs tools")
        names = {t["function"]["name"] for t in tools}
        if mode == "function" and request.tool_choice.function not in names:
            raise BadField(choice, f"{choice} names function {shown(request.tool_choice.function)}, which is not in "
                                   "tools")
    for i, m in enumerate(request.chat.messages):
        if len(m.role) > MAX_NAME_CHARS or len(m.name) > MAX_NAME_CHARS or len(m.tool_call_id) > MAX_ID_CHARS:
            what = ("role", m.role, MAX_NAME_CHARS) if len(m.role) > MAX_NAME_CHARS else \
                ("name", m.name, MAX_NAME_CHARS) if len(m.name) > MAX_NAME_CHARS else \
                ("tool_call_id", m.tool_call_id, MAX_ID_CHARS)
            raise BadField(named("messages"), f"{named('messages')}[{i}].{what[0]} has {len(what[1])} characters: at "
                                              f"most {what[2]} are allowed")
        for j, call in enumerate(m.tool_calls):
            if not call.name:
                raise BadField(named("messages"), "a tool call in the chat history has no function name")
            if len(call.name) > MAX_NAME_CHARS or len(call.id) > MAX_ID_CHARS:
                raise BadField(named("messages"), f"{named('messages')}[{i}]: a tool call's name is at most "
                                                  f"{MAX_NAME_CHARS} characters and its id at most {MAX_ID_CHARS}")
            _arguments(call.arguments, f"{named('messages')}[{i}].tool_calls[{j}].function.arguments",
                       named("messages"))


def _arguments(text: str, field: str = "arguments", param: str | None = None) -> Any:
    """A call's arguments for a chat template: the JSON object (templates render it).
    BadField naming `field` when they are not JSON, or nested past MAX_JSON_DEPTH."""
    return parse_json(text, field, param) if text else {}


def template_messages(messages: Iterable[pb.ChatMessage], arguments_as_text: bool = False) -> list[dict]:
    """Chat messages as a chat template reads them (mlx-lm's and transformers' shape):
    assistant tool calls with their arguments as objects (as JSON text with
    `arguments_as_text`: DeepSeek's templates concatenate them), tool results with their
    ids, an assistant's thinking as `reasoning_content`."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning:
            d["reasoning_content"] = m.reasoning  # Qwen3, GLM, Kimi K2 Thinking read it
            if not m.content:
                d["thinking"] = m.reasoning  # gpt-oss reads this one, and refuses it beside content
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": (c.arguments or "{}") if arguments_as_text
                                             else _arguments(c.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


# -- tool calls in the output --------------------------------------------------------------
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


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# -- the families' call formats ----------------------------------------------------------------
def _json_object(text: str) -> dict:
    value = json.loads(text) if text.strip() else {}
    if isinstance(value, str):  # arguments written as a JSON string
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("the arguments are not a JSON object")
    return value


def _json_values(text: str) -> list[Any]:
    """The JSON values in `text`, one after another (separated by whitespace, ';' or ',')."""
    decoder, pos, out = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(text):
            return out
        value, pos = decoder.raw_decode(text, pos)
        out.append(value)


def _named(obj: Any, args_key: str = "arguments") -> dict:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        raise ValueError(f"not a tool call: {obj!r}")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return {"name": obj["name"], "arguments": args if isinstance(args, dict) else _json_object(args)}


def parse_json_calls(text: str, tools: Any = None) -> list[dict]:
    """A JSON call object or a list of them ({"name", "arguments"}): Granite, Nemotron,
    Mistral v3."""
    calls = []
    for value in _json_values(text.strip()):
        calls += [_named(v) for v in (value if isinstance(value, list) else [value])]
    return calls


def parse_llama3(text: str, tools: Any = None) -> list[dict]:
    """Llama 3.x: {"name": ..., "parameters": {...}}, several separated by ';'. A call
    names its arguments ("parameters", or "arguments"): a call may open the output with no
    marker at all, so an answer that is a JSON object with a "name" is not one."""
    values = _json_values(text.strip())
    if not all(isinstance(v, Mapping) and ("parameters" in v or "arguments" in v) for v in values):
        raise ValueError("not a Llama 3 call: no parameters")
    return [_named(v, "parameters") for v in values]


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
            calls.append({"name": m.group(1), "arguments": args if isinstance(args, dict) else _json_object(args)})
            while pos < len(part) and part[pos] in " \t\r\n":
                pos += 1
    if not calls:
        raise ValueError("no call")
    return calls


# DeepSeek's call markers (full-width bars, U+2581 for spaces)
DEEPSEEK_MARKERS = {k: "<\uff5c" + v.replace(" ", "\u2581") + "\uff5c>" for k, v in dict(
    calls="tool calls begin", calls_end="tool calls end", call="tool call begin", call_end="tool call end",
    sep="tool sep").items()}
_DS_CALL = re.compile(re.escape(DEEPSEEK_MARKERS["call"]) + "(.*?)" + re.escape(DEEPSEEK_MARKERS["call_end"]),
                      re.DOTALL)
_FENCED = re.compile(r"^\s*([\w.-]+)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def parse_deepseek(text: str, tools: Any = None) -> list[dict]:
    """DeepSeek's call section: V3.1's <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>,
    or V3 / R1's ...begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>."""
    calls = []
    for body in _DS_CALL.findall(text):
        head, _, rest = body.partition(DEEPSEEK_MARKERS["sep"])
        fenced = _FENCED.match(rest)
        if fenced is not None:
            calls.append({"name": fenced.group(1), "arguments": _json_object(fenced.group(2))})
        else:
            calls.append({"name": head.strip(), "arguments": _json_object(rest)})
    if not calls:
        raise ValueError("no call")
    return calls


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*"
                        r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)


def parse_kimi(text: str, tools: Any = None) -> list[dict]:
    """Kimi K2's section: <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>..."""
    calls = [{"name": name, "arguments": _json_object(args)} for name, args in _KIMI_CALL.findall(text)]
    if not calls:
        raise ValueError("no call")
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
    how constrained decoding forces a call (cluster/worker/structured.py), None where the
    format allows no grammar; `bare_start`: see ToolCallStream."""

    name: str
    start: str
    end: str
    parser: ToolParser = field(compare=False)
    markers: tuple[str, ...] = ()
    ids: str = "openai"
    grammar: str | None = None
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


MISTRAL_CALLS = CallFormat("mistral", "[TOOL_CALLS]", "", parse_mistral, ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
                           ids="mistral", grammar="mistral_v11")
MISTRAL_V3_CALLS = CallFormat("mistral_v3", "[TOOL_CALLS]", "", parse_mistral, ("[TOOL_CALLS]",), ids="mistral",
                              grammar="mistral_v3")
LLAMA3_CALLS = CallFormat("llama3", "<|python_tag|>", "", parse_llama3, ("<|python_tag|>",), grammar="llama3",
                          bare_start="{")
DEEPSEEK_CALLS = CallFormat("deepseek", DEEPSEEK_MARKERS["calls"], DEEPSEEK_MARKERS["calls_end"], parse_deepseek,
                            tuple(DEEPSEEK_MARKERS.values()), grammar="deepseek")
KIMI_CALLS = CallFormat("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", parse_kimi,
                        ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                         "<|tool_call_argument_begin|>", "<|tool_call_end|>"), ids="kimi", grammar="kimi")
GRANITE_CALLS = CallFormat("granite", "<|tool_call|>", "", parse_json_calls, ("<|tool_call|>",), grammar="granite")
NEMOTRON_CALLS = CallFormat("nemotron", "<TOOLCALL>", "</TOOLCALL>", parse_json_calls, ("<TOOLCALL>", "</TOOLCALL>"),
                            grammar="nemotron")
# gpt-oss: calls are harmony messages (cluster/api/reasoning.py's HarmonyStream reads them)
HARMONY_CALLS = CallFormat("harmony", "to=functions.", "", parse_json_object, grammar="harmony")


def call_format(chat_template: str | None, vocab: Mapping[str, int],
                mlx_lm: tuple[str, str, ToolParser, str] | None = None) -> CallFormat | None:
    """The model's call format from its chat template and vocabulary; else the one mlx-lm
    found (`mlx_lm`: its tool_call_start, tool_call_end, parse_tool_call and the parser's
    module name); None: the model has no tool calling."""
    t = chat_template if isinstance(chat_template, str) else ""
    if "<|channel|>" in vocab and "functions." in t and "commentary" in t:
        return HARMONY_CALLS
    if "[TOOL_CALLS]" in t:
        return MISTRAL_CALLS if "[ARGS]" in t else MISTRAL_V3_CALLS
    if DEEPSEEK_MARKERS["calls"] in t:
        return DEEPSEEK_CALLS
    if "<|tool_calls_section_begin|>" in t:
        return KIMI_CALLS
    if "<TOOLCALL>" in t:
        return NEMOTRON_CALLS
    if "<|tool_call|>" in t and "<|start_of_role|>" in t:
        return GRANITE_CALLS
    if mlx_lm is not None:  # the markers its template names (Hermes' <tool_call> on a Llama 3 vocabulary too)
        start, end, parser, module = mlx_lm
        kind = module.rsplit(".", 1)[-1]
        return CallFormat(kind, start, end or "", parser, (start, end or ""),
                          grammar="json_markers" if kind == "json_tools" else None)
    if "<|python_tag|>" in vocab and '"parameters"' in t:  # Llama 3's: only a guess from its vocabulary
        return LLAMA3_CALLS
    return None


def split_chunk(stream, chunk: pb.GenerateResponse) -> list[pb.GenerateResponse]:
    """One response chunk with its output split by `stream` (a ToolCallStream or
    reasoning.OutputSplitter): thinking into `reasoning`, calls into `tool_calls`, the rest
    in `text`. A chunk is its reasoning, then its text, then its calls: a segment that
    would break that order goes in a chunk of its own after it, so the chunks keep the
    model's order. The token ids and logprobs stay on the first; the last one finishes,
    with "tool_calls" when calls were made and the model stopped. An aborted chunk (the
    worker stopping: the router resumes the request elsewhere from the tokens sent) sends
    nothing `stream` holds back: the resumed worker's splitter reads those tokens again and
    sends it then (flushed here, a marker's first characters or a call cut short would
    reach the client as text, and the call again whole)."""
    segments = stream.segments(chunk.text)
    if chunk.finish_reason and chunk.finish_reason != pb.FINISH_REASON_ABORT:
        segments += stream.rest()
        if stream.num_calls and chunk.finish_reason == pb.FINISH_REASON_STOP:
            chunk.finish_reason = pb.FINISH_REASON_TOOL_CALLS
    out = [chunk]
    finish, usage, stop_reason = chunk.finish_reason, chunk.usage if chunk.HasField("usage") else None, chunk.stop_reason
    chunk.text = ""
    for seg in segments:
        last = out[-1]
        if isinstance(seg, Thought):
            if last.text or last.tool_calls:
                last = _next_chunk(out, chunk)
            last.reasoning += seg
        elif isinstance(seg, str):
            if last.tool_calls:  # text after a call: a new chunk
                last = _next_chunk(out, chunk)
            last.text += seg
        else:
            last.tool_calls.append(seg)
    if len(out) > 1:  # the finish moves to the last chunk
        chunk.finish_reason, chunk.stop_reason = pb.FINISH_REASON_UNSPECIFIED, ""
        chunk.ClearField("usage")
        out[-1].finish_reason, out[-1].stop_reason = finish, stop_reason
        if usage is not None:
            out[-1].usage.CopyFrom(usage)
    return out


def _next_chunk(out: list[pb.GenerateResponse], chunk: pb.GenerateResponse) -> pb.GenerateResponse:
    out.append(pb.GenerateResponse(request_id=chunk.request_id, worker_id=chunk.worker_id, index=chunk.index))
    return out[-1]
