"""Tool calling on the wire: tool definitions and choices checked once, chat history
turned into what a chat template reads, and a response chunk split into thinking, text and
tool calls by a model's splitter. How each family writes its calls and thinking is
cluster/formats/'s. Nothing here imports MLX.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from cluster.api.errors import BadField
from cluster.api.limits import MAX_ID_CHARS, MAX_NAME_CHARS, parse_json, quoted, shown
from cluster.formats.base import Thought
from cluster.proto.orchard.v1 import orchard_pb2 as pb


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


# -- a response chunk, split ---------------------------------------------------------------
def split_chunk(stream, chunk: pb.GenerateResponse) -> list[pb.GenerateResponse]:
    """One response chunk with its output split by `stream` (cluster/formats/: a
    ToolCallStream or an OutputSplitter): thinking into `reasoning`, calls into `tool_calls`, the rest
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
    usage = chunk.usage if chunk.HasField("usage") else None
    finish, stop_reason = chunk.finish_reason, chunk.stop_reason
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
