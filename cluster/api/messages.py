"""Anthropic's Messages API (`POST /v1/messages`) over the same `Backend` and chat path as
the OpenAI fronts, for the agent tools that speak it to local servers.

`system`, messages with text, `tool_use` and `tool_result` content blocks, `max_tokens`
(required, as Anthropic's API has it), `stop_sequences`, temperature / top_p / top_k,
tools (`input_schema`) and `tool_choice`; the model's calls come back as `tool_use`
blocks with `stop_reason: "tool_use"`. A thinking model's thinking comes first as a
`thinking` block (streamed as thinking_delta events; its signature is empty: nothing signs
it), and `thinking` blocks in an assistant message go back to its template;
`thinking: {"type": "enabled", "budget_tokens": N}` turns the template's thinking on and
ends the thinking after N tokens, `{"type": "disabled"}` turns it off (`enable_thinking` /
`thinking` for the template). Streaming sends Anthropic's events (message_start,
content_block_start / delta / stop, message_delta, message_stop). Errors are in
Anthropic's shape; `x-api-key` is accepted as the API key (the app's guard). Any other
field is a 400 that names it. `POST /v1/messages/count_tokens` counts the prompt a body
makes (`{"input_tokens": N}`) without running it.

Prompt caching is automatic: every full KV block of every prompt is cached (in memory, and
with `--kv-disk-dir` on disk), least recently used out first, and free. `cache_control`
breakpoints (`{"type": "ephemeral", "ttl"?: "5m" | "1h"}`, top level or on system blocks,
content blocks and tools) are checked and change nothing; usage reports the prompt tokens
served from cache as `cache_read_input_tokens`, the rest as `input_tokens`, and
`cache_creation_input_tokens` is 0 (writing the cache costs nothing extra).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any

from aiohttp import web

from cluster.api.errors import BadField, OrchardError
from cluster.api.http import (ANTHROPIC_ERROR_TYPES, BACKEND, LIMITS, anthropic_error, read_body,
                              renamed, request_timeout, served_model)
from cluster.api.limits import MAX_INT32, MAX_TOKENS_HIGH, MAX_TOKENS_LOW, RequestLimits, quoted, shown
from cluster.api.streams import generation
from cluster.api.wire import FINISH_REASON_NAMES, build_request, validate_request
from cluster.proto.orchard.v1 import orchard_pb2 as pb

PARAMS = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k",
                    "stream", "tools", "tool_choice", "metadata", "service_tier", "thinking", "cache_control"})
# What /v1/messages/count_tokens takes: the prompt's parts, no sampling.
COUNT_PARAMS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control"})
CACHE_TTLS = ("5m", "1h")
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", _create)
    app.router.add_post("/v1/messages/count_tokens", _count_tokens)


_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
               list: "an array"}


def _get(body: dict, name: str, kind: type | tuple, required: bool = False):
    value = body.get(name)
    if value is None:
        if required:
            raise BadField(name, f"{name}: Field required")
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not (
            isinstance(value, kinds) or (float in kinds and isinstance(value, int))):
        raise BadField(name, f"{name}: Input should be {' or '.join(_KIND_NAMES[k] for k in kinds)}, got "
                             f"{shown(value)}")
    return value


def check_cache_control(item: dict, where: str, field: str) -> None:
    """A `cache_control` breakpoint on `item` (the body, a block or a tool), if any: checked,
    then nothing to do (the module's docstring says why)."""
    mark = item.get("cache_control")
    if mark is None:
        return
    if (not isinstance(mark, dict) or mark.get("type") != "ephemeral" or set(mark) - {"type", "ttl"}
            or mark.get("ttl", CACHE_TTLS[0]) not in CACHE_TTLS):
        prefix = f"{where}." if where else ""
        raise BadField(field, f"{prefix}cache_control: Input should be {{\"type\": \"ephemeral\"}} with an optional "
                              f"ttl of '5m' or '1h', got {shown(mark)}")


def _blocks_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        if all(isinstance(b.get("text", ""), str) for b in content):
            for j, b in enumerate(content):
                check_cache_control(b, f"{where}.{j}", where.split(".")[0])
            return "".join(b.get("text", "") for b in content)
    raise BadField(where.split(".")[0], f"{where}: only text content is supported here")


def chat_messages(body: dict) -> list[dict]:
    """Anthropic's system and messages as chat messages (OpenAI's chat shape)."""
    messages = _get(body, "messages", list, required=True)
    if not messages:
        raise BadField("messages", "messages: at least one message is required")
    out: list[dict] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _blocks_text(system, "system")})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadField("messages", f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadField("messages", f"messages.{i}.content: Input should be a string or a list of content blocks")
        text, calls, thinking = [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind is not None:
                check_cache_control(b, where, "messages")
            if kind == "text":
                if not isinstance(b.get("text", ""), str):
                    raise BadField("messages", f"{where}.text: Input should be a string")
                text.append(b.get("text", ""))
            elif kind == "thinking" and m["role"] == "assistant":
                if not isinstance(b.get("thinking"), str):
                    raise BadField("messages", f"{where}.thinking: Field required (a string)")
                thinking.append(b["thinking"])
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                pass  # another server's encrypted thinking: nothing a template here can read
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str):
                    raise BadField("messages", f"{where}.name: Field required")
                if not isinstance(b.get("id", ""), (str, type(None))):
                    raise BadField("messages", f"{where}.id: Input should be a string")
                if not isinstance(b.get("input", {}), (dict, type(None))):
                    raise BadField("messages", f"{where}.input: Input should be an object")
                calls.append({"id": b.get("id") or "", "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(b.get("tool_use_id", ""), (str, type(None))):
                    raise BadField("messages", f"{where}.tool_use_id: Input should be a string")
                result = b.get("content", "")
                result = _blocks_text(result, where) if result is not None else ""
                if b.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "", "content": result})
            else:
                raise BadField("messages", f"{where}: content blocks of type {shown(kind)} are not supported in a "
                                           f"{m['role']} message")
        if text or calls or thinking:
            msg = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
    return out


def _tools(body: dict) -> tuple[list[dict] | None, Any, bool | None]:
    tools = _get(body, "tools", list)
    converted = None
    if tools:
        converted = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
                raise BadField("tools", f"tools.{i}: only custom tools ({{name, description, input_schema}}) are "
                                        f"supported, got type {shown(t.get('type') if isinstance(t, dict) else None)}")
            check_cache_control(t, f"tools.{i}", "tools")
            schema = t.get("input_schema") or {"type": "object", "properties": {}}
            if not isinstance(schema, dict):
                raise BadField("tools", f"tools.{i}.input_schema: Input should be a JSON Schema object, got "
                                        f"{shown(schema)}")
            if not isinstance(t.get("description", ""), (str, type(None))):
                raise BadField("tools", f"tools.{i}.description: Input should be a string")
            fn = {"name": t["name"], "parameters": schema}
            if t.get("description"):
                fn["description"] = t["description"]
            converted.append({"type": "function", "function": fn})
    choice = _get(body, "tool_choice", dict)
    if choice is None:
        return converted, None, None
    kind = choice.get("type")
    mapped = {"auto": "auto", "none": "none", "any": "required"}.get(kind) if isinstance(kind, str) else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise BadField("tool_choice", "tool_choice.name: Field required (a string) for type 'tool'")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    if mapped is None:
        raise BadField("tool_choice", f"tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none', got "
                                      f"{shown(kind)}")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    return converted, mapped, parallel


# The wire's fields by the names Anthropic's API gives them (in errors).
NAMES = {"stop": "stop_sequences", "prompt": "messages"}


def _request(body: dict, limits: RequestLimits, count: bool = False) -> pb.GenerateRequest:
    """The wire request of a Messages body; `count`: a count_tokens body (the prompt's
    parts only)."""
    unknown = sorted(k for k in body if k not in (COUNT_PARAMS if count else PARAMS))
    if unknown:
        raise BadField(unknown[0][:80], f"{quoted(unknown[0])}: Extra inputs are not permitted (not supported by this "
                                        "server)")
    check_cache_control(body, "", "cache_control")
    template, budget = _thinking(body.get("thinking"))
    max_tokens = 1 if count else _get(body, "max_tokens", int, required=True)
    if not MAX_TOKENS_LOW <= max_tokens <= MAX_TOKENS_HIGH:
        raise BadField("max_tokens", f"max_tokens: Input should be greater than or equal to 1, got {shown(max_tokens)}")
    stop = _get(body, "stop_sequences", list) or []
    if not all(isinstance(s, str) for s in stop):
        raise BadField("stop_sequences", "stop_sequences: Input should be a list of strings")
    top_k = _get(body, "top_k", int)
    if top_k is not None and not 0 <= top_k <= MAX_INT32:
        raise BadField("top_k", f"top_k: Input should be between 0 and {MAX_INT32}, got {top_k}")
    tools, choice, parallel = _tools(body)
    request = build_request(
        messages=chat_messages(body), model=_get(body, "model", str, required=True), max_tokens=max_tokens,
        temperature=_get(body, "temperature", float), top_p=_get(body, "top_p", float), top_k=top_k,
        stop=stop, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
        request_id=f"msg_{uuid.uuid4().hex}", chat_template_kwargs=template, thinking_token_budget=budget)
    validate_request(request, limits, NAMES)
    return request


def _thinking(value: Any) -> tuple[dict | None, int | None]:
    """The `thinking` field as template variables and a thinking budget."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return {"enable_thinking": False, "thinking": False}, None
    if kind == "adaptive":
        return {"enable_thinking": True, "thinking": True}, None
    if kind != "enabled":
        raise BadField("thinking", f"thinking.type: Input should be 'enabled', 'adaptive' or 'disabled', got "
                                   f"{shown(kind)}")
    budget = value.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget < 2**32:
        raise BadField("thinking", f"thinking.budget_tokens: Input should be an integer between 0 and {2**32 - 1}, got "
                                   f"{shown(budget)}")
    return {"enable_thinking": True, "thinking": True}, budget


def _stop_reason(r: pb.GenerateResponse, stop: list[str]) -> tuple[str, str | None]:
    finish = FINISH_REASON_NAMES.get(r.finish_reason) or "stop"
    if finish == "stop" and r.stop_reason in stop:
        return "stop_sequence", r.stop_reason
    return _STOP_REASONS.get(finish, "end_turn"), None


def _tool_use(c: pb.ToolCall) -> dict:
    try:
        args = json.loads(c.arguments) if c.arguments else {}
    except (ValueError, RecursionError):  # a model's output: any JSON it wrote deeper than Python parses
        args = {}
    return {"type": "tool_use", "id": f"toolu_{c.id.removeprefix('call_')}", "name": c.name, "input": args}


def _usage(u: pb.Usage) -> dict:
    """Anthropic's usage: `input_tokens` are those not read from the cache (a prompt's tokens
    are input + cache read + cache creation), as clients that price a request add them up."""
    return {"input_tokens": max(0, u.prompt_tokens - u.cached_tokens), "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


async def _create(request: web.Request) -> web.StreamResponse:
    try:
        body = await read_body(request)
        proto = _request(body, request.app[LIMITS])
        stream = bool(_get(body, "stream", bool))
        model = await served_model(request.app, proto.model)
        timeout = request_timeout(request)
        chunks = generation(request.app[BACKEND], proto, timeout)
    except OrchardError as e:
        return anthropic_error(e.http_status, renamed(e.message, NAMES))
    stop = list(proto.sampling.stop)
    message = {"id": proto.request_id, "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": _usage(pb.Usage())}
    async with contextlib.aclosing(chunks):
        try:
            first = await anext(chunks, None)
        except OrchardError as e:
            return anthropic_error(e.http_status, renamed(e.message, NAMES))
        if not stream:
            try:
                blocks, r = [], first  # in the model's order: thinking, text, tool_use, text...
                while r is not None:
                    if r.reasoning:
                        if blocks and blocks[-1]["type"] == "thinking":
                            blocks[-1]["thinking"] += r.reasoning
                        else:
                            blocks.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
                    if r.text:
                        if blocks and blocks[-1]["type"] == "text":
                            blocks[-1]["text"] += r.text
                        else:
                            blocks.append({"type": "text", "text": r.text})
                    blocks += [_tool_use(c) for c in r.tool_calls]
                    if r.finish_reason:
                        message["stop_reason"], message["stop_sequence"] = _stop_reason(r, stop)
                        message["usage"] = _usage(r.usage)
                    r = await anext(chunks, None)
            except OrchardError as e:
                return anthropic_error(e.http_status, renamed(e.message, NAMES))
            message["content"] = blocks or [{"type": "text", "text": ""}]
            return web.json_response(message)
        return await _stream(request, message, first, chunks, stop)


async def _count_tokens(request: web.Request) -> web.Response:
    """`POST /v1/messages/count_tokens`: the tokens of the prompt the same body makes on
    /v1/messages (its system, tools and thinking settings through the model's chat
    template), counted by a worker of the model without running it."""
    try:
        proto = _request(await read_body(request), request.app[LIMITS], count=True)
        counted = await request.app[BACKEND].tokenize(proto, timeout=request_timeout(request))
    except OrchardError as e:
        return anthropic_error(e.http_status, renamed(e.message, NAMES))
    return web.json_response({"input_tokens": len(counted.token_ids)})


async def _stream(request: web.Request, message: dict, first, chunks, stop: list[str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(event: str, **data):
        await response.write(sse(event, {"type": event, **data}))

    await send("message_start", message=message)
    index, open_block = 0, None  # the block being streamed: "thinking", "text" or None

    async def close():
        nonlocal open_block, index
        if open_block == "thinking":
            await send("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
        if open_block is not None:
            await send("content_block_stop", index=index)
            open_block, index = None, index + 1

    async def block(kind: str, text: str):
        nonlocal open_block
        if open_block != kind:
            await close()
            open_block = kind
            start = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                          "signature": ""}
            await send("content_block_start", index=index, content_block=start)
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta",
                                                                              "thinking": text}
        await send("content_block_delta", index=index, delta=delta)

    try:
        r = first
        while r is not None:
            if r.reasoning:
                await block("thinking", r.reasoning)
            if r.text:
                await block("text", r.text)
            for c in r.tool_calls:
                await close()
                use = _tool_use(c)
                await send("content_block_start", index=index, content_block={**use, "input": {}})
                await send("content_block_delta", index=index,
                           delta={"type": "input_json_delta", "partial_json": json.dumps(use["input"])})
                await send("content_block_stop", index=index)
                index += 1
            if r.finish_reason:
                message["stop_reason"], message["stop_sequence"] = _stop_reason(r, stop)
                message["usage"] = _usage(r.usage)
            r = await anext(chunks, None)
        await close()
        await send("message_delta", delta={"stop_reason": message["stop_reason"],
                                           "stop_sequence": message["stop_sequence"]}, usage=message["usage"])
        await send("message_stop")
    except OrchardError as e:
        await send("error", error={"type": ANTHROPIC_ERROR_TYPES.get(e.http_status, "api_error"),
                                   "message": renamed(e.message, NAMES)})
    await response.write_eof()
    return response
