"""OpenAI's Responses API (`POST /v1/responses`, the Agents SDK's default) over the same
`Backend` and chat path as /v1/chat/completions.

`input` is a string or a list of items (messages with text content, `function_call` and
`function_call_output` items); `instructions` is a system message for this turn only;
function tools become the request's tools and the model's calls `function_call` output
items. A thinking model's thinking comes first as a `reasoning` output item (its text in
`content`, as reasoning_text; streamed as response.reasoning_text.delta events), and a
reasoning item in `input` goes back to the model with the assistant turn that follows it
(templates that keep the thinking read it); `reasoning.effort` reaches the chat template
(gpt-oss's system message). `previous_response_id` continues a conversation this process
stored (an in-memory store bounded in count and in text, `ResponseStore`: the oldest are
forgotten first; `store: false` keeps a response out of it). Streaming sends the typed
events the `openai` package reads (response.created, output_item / content_part /
output_text / reasoning_text / function_call_arguments events, response.completed). Any
other field is a 400 that names it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
import uuid
from typing import Any

from aiohttp import web

from cluster.api.errors import NotFound, OrchardError
from cluster.api.bodies import ACCEPTED_NO_EFFECT, body_field, check_metadata, int_field
from cluster.api.http import (BACKEND, ERROR_TYPES, LIMITS, BadField, error_response, read_body, renamed,
                              request_timeout, served_model)
from cluster.api.limits import MAX_TOKENS_HIGH, MAX_TOKENS_LOW, parse_json, quoted, shown
from cluster.api.streams import generation
from cluster.api.wire import FINISH_REASON_NAMES, build_request, validate_request
from cluster.proto.orchard.v1 import orchard_pb2 as pb

STORE_SIZE = 1024  # responses kept for previous_response_id, the oldest forgotten first
STORE_CHARS = 64 << 20  # ... and at most this much JSON text in all (a response holds its whole conversation)


class ResponseStore:
    """The responses kept for previous_response_id: the last STORE_SIZE, within STORE_CHARS
    (each holds its conversation, up to a whole context of text: by count alone, 1,024 of a
    32k-token model's could hold a gigabyte)."""

    def __init__(self, max_entries: int = STORE_SIZE, max_chars: int = STORE_CHARS):
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: collections.OrderedDict[str, tuple[list, dict, int]] = collections.OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, conversation: list, obj: dict) -> None:
        size = len(json.dumps(conversation, ensure_ascii=False)) + len(json.dumps(obj, ensure_ascii=False))
        self._entries[key] = (conversation, obj, size)
        self.chars += size
        while len(self._entries) > self.max_entries or (self.chars > self.max_chars and len(self._entries) > 1):
            self.chars -= self._entries.popitem(last=False)[1][2]

    def get(self, key: str) -> tuple[list, dict] | None:
        """(the conversation, the response object), or None when it is not kept."""
        entry = self._entries.get(key)
        return None if entry is None else entry[:2]


_STORE = web.AppKey("responses_store", ResponseStore)

# The wire's fields by the names this API gives them (in errors).
NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input",
         "reasoning_effort": "reasoning.effort"}
PARAMS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                    "tools", "tool_choice", "parallel_tool_calls", "previous_response_id", "store", "text",
                    "truncation", "reasoning", "include", "stream_options", "seed"}) | ACCEPTED_NO_EFFECT


def add_routes(app: web.Application) -> None:
    app[_STORE] = ResponseStore()
    app.router.add_post("/v1/responses", _create)
    app.router.add_get("/v1/responses/{response_id}", _get)


# -- request ----------------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadField("input", f"{where}: only text content (input_text / output_text parts) is supported")


_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status"},
              "function_call": {"type", "id", "call_id", "name", "arguments", "status"},
              "function_call_output": {"type", "id", "call_id", "output", "status"},
              "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"}}


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's thinking: its reasoning_text content, else its summary's text."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text", ""), str)
                                                  for p in parts):
            raise BadField("input", f"{where}.{key} must be a list of {{type: {kind}, text}} parts")
        text = "".join(p.get("text", "") for p in parts)
        if text:
            return text
    return ""


def input_messages(items: Any) -> list[dict]:
    """Responses `input` as chat messages (OpenAI's chat shape)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise BadField("input", "'input' must be a string or a list of items")
    out: list[dict] = []
    thinking = ""  # a reasoning item's, for the assistant turn that follows it
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadField("input", f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise BadField("input", f"input[{i}].type must be a string, got {shown(kind)}")
        extra = set(item) - _ITEM_KEYS.get(kind, set(item))
        if extra:
            raise BadField("input", f"input[{i}]: unknown field{'s' if len(extra) > 1 else ''} "
                                     f"{', '.join(map(quoted, sorted(extra)[:5]))} in a {shown(kind)} item")
        if not isinstance(item.get("call_id", ""), (str, type(None))):
            raise BadField("input", f"input[{i}].call_id must be a string, got {shown(item['call_id'])}")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadField("input", f"input[{i}].role must be user, system, developer or assistant")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content", ""), f"input[{i}]")})
            if role == "assistant" and thinking:
                out[-1]["reasoning_content"], thinking = thinking, ""
        elif kind == "reasoning":
            thinking += _reasoning_text(item, f"input[{i}]")
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                raise BadField("input", f"input[{i}]: a function_call needs a name and arguments (a JSON string)")
            if item.get("arguments"):
                parse_json(item["arguments"], f"input[{i}].arguments", "input")
            call = {"id": item.get("call_id") or "", "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1] and not thinking:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            elif out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1] and not thinking:
                out[-1]["tool_calls"] = [call]  # a message, then its calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thinking:
                    out[-1]["reasoning_content"], thinking = thinking, ""
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text(output, f"input[{i}].output") if isinstance(output, list) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id") or "", "content": output})
        else:
            raise BadField("input", f"input[{i}]: items of type {shown(kind)} are not supported")
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body_field(body, "tools", list)
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise BadField("tools", f"tools[{i}]: tools of type {shown(kind)} are not supported; only function tools "
                                     "({type: function, name, parameters})")
        fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict):
    choice = body.get("tool_choice")
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return choice["name"]
    raise BadField("tool_choice", "'tool_choice' must be none, auto, required or {type: function, name}")


def _check(body: dict) -> None:
    unknown = sorted(k for k in body if k not in PARAMS)
    if unknown:
        raise BadField(unknown[0], f"unknown parameter{'s' if len(unknown) > 1 else ''} "
                                    f"{', '.join(map(repr, unknown))}: not supported by this server")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise BadField("text", "'text' must be an object with 'format'")
        if text.get("format") not in (None, {"type": "text"}):
            raise BadField("text", "'text.format' other than text (structured output) is not supported by this "
                                    "server yet")
        if text.get("verbosity") is not None:
            raise BadField("text", "'text.verbosity' is not supported by this server")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise BadField("reasoning", "'reasoning' must be an object with 'effort' (and 'summary')")
        if reasoning.get("effort") is not None and not isinstance(reasoning["effort"], str):
            raise BadField("reasoning", "'reasoning.effort' must be a string")
        if reasoning.get("summary") not in (None, "auto") or reasoning.get("generate_summary") not in (None, "auto"):
            raise BadField("reasoning", "reasoning summaries are not made by this server: the reasoning items carry "
                                        "the whole thinking as reasoning_text; send 'summary' null or 'auto'")
    if body.get("truncation") not in (None, "disabled"):
        raise BadField("truncation", "only truncation 'disabled' is supported")
    if body.get("include"):
        raise BadField("include", "'include' is not supported by this server")
    check_metadata(body)  # echoed back and stored


# -- response -----------------------------------------------------------------------------------
def _usage(u: pb.Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class _Turn:
    """One response: its ids, its settings as echoed back, its output items in order
    (reasoning, messages and function calls, as the model produced them)."""

    def __init__(self, body: dict, model: str, history: list[dict]):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body = body
        self.model = model
        self.history = history  # the conversation before this turn's output (without instructions)
        # {"type": "message" | "reasoning", "id", "text"}, or a call
        self.items: list[dict | pb.ToolCall] = []
        self.usage: pb.Usage | None = None
        self.finish: str | None = None

    def _joined(self, kind: str) -> str:
        return "".join(i["text"] for i in self.items if isinstance(i, dict) and i["type"] == kind)

    @property
    def text(self) -> str:
        return self._joined("message")

    @property
    def calls(self) -> list[pb.ToolCall]:
        return [i for i in self.items if isinstance(i, pb.ToolCall)]

    def add_text(self, text: str, kind: str = "message") -> tuple[int, bool]:
        """Append text to the last item of its kind ("message" or "reasoning"), or open a
        new one after anything else: (its index, opened)."""
        opened = not self.items or not isinstance(self.items[-1], dict) or self.items[-1]["type"] != kind
        if opened:
            prefix = "msg" if kind == "message" else "rs"
            self.items.append({"type": kind, "id": f"{prefix}_{uuid.uuid4().hex}", "text": ""})
        self.items[-1]["text"] += text
        return len(self.items) - 1, opened

    def add_call(self, c: pb.ToolCall) -> int:
        self.items.append(c)
        return len(self.items) - 1

    @staticmethod
    def message_item(m: dict, status: str) -> dict:
        return {"type": "message", "id": m["id"], "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": m["text"], "annotations": [], "logprobs": []}]}

    @staticmethod
    def reasoning_item(m: dict, status: str) -> dict:
        return {"type": "reasoning", "id": m["id"], "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": m["text"]}]}

    @staticmethod
    def call_item(c: pb.ToolCall, status: str = "completed") -> dict:
        return {"type": "function_call", "id": f"fc_{c.id.removeprefix('call_')}", "call_id": c.id, "name": c.name,
                "arguments": c.arguments, "status": status}

    def item(self, i: dict | pb.ToolCall, status: str) -> dict:
        if not isinstance(i, dict):
            return self.call_item(i)
        return (self.message_item if i["type"] == "message" else self.reasoning_item)(i, status)

    def output(self) -> list[dict]:
        if not any(isinstance(i, pb.ToolCall) or i["type"] == "message" for i in self.items):
            self.add_text("")  # an answer with no message and no call still has one (empty) message
        done = "incomplete" if self.finish == "length" else "completed"
        return [self.item(i, done) for i in self.items]

    def obj(self, status: str) -> dict:
        b = self.body
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": self.output() if done else [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
            "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice") or "auto",
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"), "store": b.get("store", True),
            "metadata": b.get("metadata") or {}, "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "reasoning": b.get("reasoning"),
            "usage": _usage(self.usage) if done and self.usage is not None else None,
        }

    @property
    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def conversation(self) -> list[dict]:
        """The history plus this turn's output, as the next turn continues it."""
        turn = {"role": "assistant", "content": self.text}
        if self._joined("reasoning"):
            turn["reasoning_content"] = self._joined("reasoning")
        if self.calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        return self.history + [turn]


def _remember(app: web.Application, turn: _Turn) -> None:
    if turn.body.get("store", True) is False:
        return
    app[_STORE].put(turn.id, turn.conversation(), turn.obj(turn.status))


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def _error(e: OrchardError) -> web.Response:
    """An error in this API's words (the backend's field names as this API's)."""
    param = getattr(e, "param", None)
    return error_response(e.http_status, renamed(e.message, NAMES), NAMES.get(param, param))


async def _get(request: web.Request) -> web.Response:
    entry = request.app[_STORE].get(request.match_info["response_id"])
    if entry is None:
        return error_response(404, f"Response with id {shown(request.match_info['response_id'])} not found.",
                              param="response_id")
    return web.json_response(entry[1])


async def _create(request: web.Request) -> web.StreamResponse:
    try:
        body = await read_body(request)
        _check(body)
        if "input" not in body:
            raise BadField("input", "'input' is required")
        history: list[dict] = []
        prev = body_field(body, "previous_response_id", str)
        if prev:
            entry = request.app[_STORE].get(prev)
            if entry is None:
                raise NotFound(f"Previous response with id {shown(prev)} not found (responses are kept in this "
                               f"server's memory, the last {STORE_SIZE}, and only with store: true)")
            history = list(entry[0])
        history += input_messages(body["input"])
        instructions = body_field(body, "instructions", str)
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
        stream = body_field(body, "stream", bool, False)
        body_field(body, "store", bool)
        proto = build_request(
            messages=messages, model=body_field(body, "model", str, ""),
            max_tokens=int_field(body, "max_output_tokens", low=MAX_TOKENS_LOW, high=MAX_TOKENS_HIGH),
            temperature=body_field(body, "temperature", float), top_p=body_field(body, "top_p", float),
            seed=int_field(body, "seed", low=0, high=2**64 - 1), tools=_tools(body), tool_choice=_tool_choice(body),
            parallel_tool_calls=body_field(body, "parallel_tool_calls", bool),
            reasoning_effort=(body.get("reasoning") or {}).get("effort"))
        validate_request(proto, request.app[LIMITS], NAMES)
        turn = _Turn(body, await served_model(request.app, proto.model), history)
        proto.request_id = turn.id
        timeout = request_timeout(request)
        chunks = generation(request.app[BACKEND], proto, timeout)
    except OrchardError as e:
        return _error(e)
    async with contextlib.aclosing(chunks):
        try:
            first = await anext(chunks, None)
        except OrchardError as e:
            return _error(e)
        if not stream:
            try:
                r = first
                while r is not None:
                    _take(turn, r)
                    r = await anext(chunks, None)
            except OrchardError as e:
                return _error(e)
            _remember(request.app, turn)
            return web.json_response(turn.obj(turn.status))
        return await _stream(request, turn, first, chunks)


def _take(turn: _Turn, r: pb.GenerateResponse) -> None:
    if r.reasoning:
        turn.add_text(r.reasoning, "reasoning")
    if r.text:
        turn.add_text(r.text)
    for c in r.tool_calls:
        turn.add_call(c)
    if r.finish_reason:
        turn.finish = FINISH_REASON_NAMES.get(r.finish_reason)
        turn.usage = r.usage


# Each streamed item kind's empty content part, and the name its text events go by.
_PARTS = {"message": ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}, "output_text"),
          "reasoning": ({"type": "reasoning_text", "text": ""}, "reasoning_text")}


class _Events:
    """A turn's server-sent events as its chunks come: each numbered in order, at most one
    message or reasoning item open at a time, a function call sent whole."""

    def __init__(self, response: web.StreamResponse, turn: _Turn):
        self.response = response
        self.turn = turn
        self.seq = 0
        self.open_index: int | None = None  # the message or reasoning item being streamed

    async def send(self, event: str, **data) -> None:
        await self.response.write(_sse(event, {"type": event, "sequence_number": self.seq, **data}))
        self.seq += 1

    async def open_item(self, index: int) -> None:
        self.open_index = index
        m = self.turn.items[index]
        await self.send("response.output_item.added", output_index=index,
                        item={**self.turn.item(m, "in_progress"), "content": []})
        await self.send("response.content_part.added", item_id=m["id"], output_index=index, content_index=0,
                        part=_PARTS[m["type"]][0])

    async def close_item(self) -> None:
        if self.open_index is None:
            return
        index, self.open_index = self.open_index, None
        m = self.turn.items[index]
        part, name = _PARTS[m["type"]]
        extra = {"logprobs": []} if m["type"] == "message" else {}
        await self.send(f"response.{name}.done", item_id=m["id"], output_index=index, content_index=0,
                        text=m["text"], **extra)
        await self.send("response.content_part.done", item_id=m["id"], output_index=index, content_index=0,
                        part=dict(part, text=m["text"]))
        await self.send("response.output_item.done", output_index=index, item=self.turn.item(m, "completed"))

    async def add_text(self, text: str, kind: str) -> None:
        index, opened = self.turn.add_text(text, kind)
        if opened:
            await self.close_item()
            await self.open_item(index)
        extra = {"logprobs": []} if kind == "message" else {}
        await self.send(f"response.{_PARTS[kind][1]}.delta", item_id=self.turn.items[index]["id"],
                        output_index=index, content_index=0, delta=text, **extra)

    async def add_call(self, c: pb.ToolCall) -> None:
        await self.close_item()
        index, item = self.turn.add_call(c), self.turn.call_item(c)
        await self.send("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"})
        await self.send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=c.arguments)
        await self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=c.arguments, name=c.name)
        await self.send("response.output_item.done", output_index=index, item=item)

    async def add_chunk(self, r: pb.GenerateResponse) -> None:
        """As `_take`, sending each step's events."""
        if r.reasoning:
            await self.add_text(r.reasoning, "reasoning")
        if r.text:
            await self.add_text(r.text, "message")
        for c in r.tool_calls:
            await self.add_call(c)
        if r.finish_reason:
            self.turn.finish = FINISH_REASON_NAMES.get(r.finish_reason)
            self.turn.usage = r.usage

    async def close_output(self) -> None:
        """Close the open item; an answer with no message and no call still has one (empty) message."""
        if not any(isinstance(i, pb.ToolCall) or i["type"] == "message" for i in self.turn.items):
            await self.close_item()
            await self.open_item(self.turn.add_text("")[0])
        await self.close_item()


async def _stream(request: web.Request, turn: _Turn, first, chunks) -> web.StreamResponse:
    """The turn as server-sent events: created, in progress, its items as the chunks from
    `first` on come, then completed or incomplete; an error event if the backend fails."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    events = _Events(response, turn)
    await events.send("response.created", response=turn.obj("in_progress"))
    await events.send("response.in_progress", response=turn.obj("in_progress"))
    try:
        r = first
        while r is not None:
            await events.add_chunk(r)
            r = await anext(chunks, None)
        await events.close_output()
        _remember(request.app, turn)
        status = turn.status
        await events.send("response.completed" if status == "completed" else "response.incomplete",
                          response=turn.obj(status))
    except OrchardError as e:
        await events.send("error", code=ERROR_TYPES.get(e.http_status, "server_error"),
                          message=renamed(e.message, NAMES), param=None)
    await response.write_eof()
    return response

