"""Tool calling on the wire: tool definitions and choices checked once, chat history
turned into what a chat template reads, and tool calls cut out of a model's output.

The model's family decides how a call looks (Hermes' `<tool_call>{json}</tool_call>`,
LFM2's pythonic `[f(a=1)]`, Gemma 4's `call:f{...}`, Mistral's `[TOOL_CALLS]`): the worker
takes the markers and the parser from mlx-lm's tokenizer (`tool_call_start`,
`tool_call_end`, `tool_parser`) and `ToolCallStream` does the rest for any of them: text
before a start marker streams as content, the call's text is held until its end marker
(or the end of the output when the family has none) and parsed then, and markers never
reach the content. Nothing here imports MLX.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Iterable, Mapping

from cluster.api.errors import BadField, InvalidRequest
from cluster.api.limits import MAX_ID_CHARS, MAX_NAME_CHARS, quoted, shown
from cluster.proto.orchard.v1 import orchard_pb2 as pb

ToolParser = Callable[[str, Any], Any]  # mlx-lm's parse_tool_call(text, tools): a call dict or a list of them


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- what a request may say ----------------------------------------------------------------
def parse_tools(tools_json: str) -> list[dict]:
    """The request's tool definitions (OpenAI's shape), or InvalidRequest saying what is wrong."""
    if not tools_json:
        return []
    try:
        tools = json.loads(tools_json)
    except ValueError as e:
        raise BadField("tools", f"tools is not valid JSON: {e}") from None
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
        for call in m.tool_calls:
            if not call.name:
                raise BadField(named("messages"), "a tool call in the chat history has no function name")
            if len(call.name) > MAX_NAME_CHARS or len(call.id) > MAX_ID_CHARS:
                raise BadField(named("messages"), f"{named('messages')}[{i}]: a tool call's name is at most "
                                                  f"{MAX_NAME_CHARS} characters and its id at most {MAX_ID_CHARS}")
            _arguments(call.arguments)


def _arguments(text: str) -> Any:
    """A call's arguments for a chat template: the JSON object (templates render it), or
    the text as it is when it is not JSON."""
    if not text:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequest(f"the arguments of a tool call in the chat history are not JSON: {text[:80]!r}") from None


def template_messages(messages: Iterable[pb.ChatMessage]) -> list[dict]:
    """Chat messages as a chat template reads them (mlx-lm's and transformers' shape):
    assistant tool calls with their arguments as objects, tool results with their ids."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
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
    that could be the start of a start marker is held back until it is known not to be."""

    def __init__(self, start: str, end: str, parser: ToolParser, tools: list[dict], parallel: bool = True):
        self.start, self.end, self.parser, self.tools = start, end, parser, tools
        self.parallel = parallel
        self.buffer = ""  # text not yet handed out (in a call: the call's text so far)
        self.in_call = False
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
                i = self.buffer.find(self.start)
                if i < 0:
                    keep = _partial_suffix(self.buffer, self.start)
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
            calls = [_tool_call(item) for item in items]
        except Exception:  # a parser of any family: a malformed call stays visible as text
            return [self.start + body + (self.end if closed else "")]
        if not self.parallel:
            calls = calls[:max(0, 1 - self.num_calls)]
        self.num_calls += len(calls)
        return calls


def _joined(segments: list[str | pb.ToolCall]) -> tuple[str, list[pb.ToolCall]]:
    return ("".join(x for x in segments if isinstance(x, str)), [x for x in segments if not isinstance(x, str)])


def _tool_call(item: Any) -> pb.ToolCall:
    if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
        raise ValueError(f"not a tool call: {item!r}")
    args = item.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return pb.ToolCall(id=new_call_id(), name=item["name"], arguments=args)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split_chunk(stream: ToolCallStream, chunk: pb.GenerateResponse) -> list[pb.GenerateResponse]:
    """One response chunk with its tool calls cut out of its text into `tool_calls`. Text
    that follows a call goes in a chunk of its own after it, so the chunks keep the
    model's order (a chunk is its text, then its calls). The token ids and logprobs stay on
    the first; the last one finishes, with "tool_calls" when calls were made and the
    model stopped."""
    segments = stream.segments(chunk.text)
    if chunk.finish_reason:
        segments += stream.rest()
        if stream.num_calls and chunk.finish_reason == pb.FINISH_REASON_STOP:
            chunk.finish_reason = pb.FINISH_REASON_TOOL_CALLS
    out = [chunk]
    finish, usage, stop_reason = chunk.finish_reason, chunk.usage if chunk.HasField("usage") else None, chunk.stop_reason
    chunk.text = ""
    for seg in segments:
        last = out[-1]
        if isinstance(seg, str):
            if last.tool_calls:  # text after a call: a new chunk
                last = pb.GenerateResponse(request_id=chunk.request_id, worker_id=chunk.worker_id, index=chunk.index)
                out.append(last)
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
