"""OpenAI-compatible HTTP API (aiohttp) in front of any `Generation` backend.

The backend is a `cluster.api.servicer.Backend`: the worker's `WorkerService` or the
router's `RouterBackend` in process (or the SDK's `GrpcBackend` over a channel), so the
worker and the router serve the same API.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming or not),
GET /v1/models, GET /v1/models/{id}, GET /health, and on the same app /v1/responses
(responses.py) and /v1/messages (messages.py); /v1/completions' evaluation features
(echo, prompt lists, n, prompt_logprobs) are in completions.py; `cluster.api.app` puts them
all on one app over the shared base (`cluster.api.http`). Sampling fields:
max_tokens (max_completion_tokens; a chat without it runs to the end of the context),
temperature, top_p, n, seed, stop, stream_options.include_usage, logprobs (top_logprobs
for chat), presence_penalty, frequency_penalty, logit_bias, response_format, tools,
tool_choice, parallel_tool_calls (chat), reasoning_effort (chat), and the extensions
ignore_eos, top_k, min_p, speculative, stop_token_ids, repetition_penalty, vLLM's guided_*
and structured_outputs (`cluster.api.constraints`), and for chat vLLM's
chat_template_kwargs, thinking_token_budget and include_reasoning. A thinking model's
thinking comes back apart from its answer, as vLLM returns it: `message.reasoning_content`
(and `reasoning`, which newer clients read), streamed as deltas of the same names, counted
in usage.completion_tokens_details.reasoning_tokens. Any other parameter is a 400 that names it, except
ACCEPTED_NO_EFFECT (user, metadata, store, ...), which real clients send and which change
no output. Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`
with 400 (bad input), 404 (unknown model or route), 405, 429 (queue full), 503 (draining
or unavailable).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from cluster.api.constraints import openai_extras
from cluster.api.errors import OrchardError
from cluster.api.http import (ACCEPTED_NO_EFFECT, BACKEND, ERROR_TYPES, LIMITS, BadField, body_field, check_params,
                              error_of, error_response, int_field, keepalive, read_body, request_timeout, served_model,
                              sse, sse_comment, within)
from cluster.api.limits import (COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_INT32, MAX_LOGPROBS, MAX_TOKENS_HIGH,
                                MAX_TOKENS_LOW, RequestLimits, quoted, shown)
from cluster.api.servicer import finished
from cluster.api.wire import FINISH_REASON_NAMES, build_request, num_choices, validate_request
from cluster.proto.orchard.v1 import orchard_pb2 as pb

log = logging.getLogger(__name__)



def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id:.+}", _model)
    app.router.add_get("/health", _health)


# -- request parsing ----------------------------------------------------------------------
def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise BadField("stop", f"'stop' must be a string or an array of strings, got {shown(stop)}")


def n_field(body: dict, limits: RequestLimits) -> int:
    """`n`, checked against the server's max_n before anything is built for its samples."""
    n = body_field(body, "n", int, 1)
    if n < 1:
        raise BadField("n", f"n must be >= 1, got {n}")
    if n > limits.max_n:
        raise BadField("n", f"n={shown(n)}: at most {limits.max_n} samples per request are allowed (max_n)")
    return n


def sampling_kwargs(body: dict, chat: bool, limits: RequestLimits = RequestLimits()) -> dict[str, Any]:
    """`build_request` keyword arguments for the sampling fields, each checked by the name
    the client sent."""
    n = n_field(body, limits)
    if n != 1 and not chat:  # completions.py takes n off the body and sets it per prompt
        raise BadField("n", "n is set per prompt by the completions endpoint")
    if body_field(body, "best_of", int, 1) != 1:
        raise BadField("best_of", "best_of is not supported")
    if body.get("echo"):
        raise BadField("echo", "echo is not supported")
    max_tokens = int_field(body, "max_completion_tokens", low=MAX_TOKENS_LOW, high=MAX_TOKENS_HIGH) if chat else None
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", low=MAX_TOKENS_LOW, high=MAX_TOKENS_HIGH)
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    seed = int_field(body, "seed", low=-2**63, high=2**64 - 1)
    if seed is not None and seed < 0:
        seed &= 0xFFFF_FFFF_FFFF_FFFF  # OpenAI accepts negative seeds: keep them distinct
    if chat:
        want = body_field(body, "logprobs", bool, False)
        top = int_field(body, "top_logprobs", 0, low=0, high=MAX_LOGPROBS)
        logprobs = top if want else None
    else:
        logprobs = int_field(body, "logprobs", low=0, high=MAX_LOGPROBS)
    stop_token_ids = body_field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
        raise BadField("stop_token_ids", "'stop_token_ids' must be an array of integers")
    extra = {"n": n} if n != 1 else {}
    return dict(
        max_tokens=max_tokens,
        temperature=body_field(body, "temperature", float),
        top_p=body_field(body, "top_p", float),
        top_k=int_field(body, "top_k", low=0, high=MAX_INT32),
        min_p=body_field(body, "min_p", float),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=stop_token_ids,
        ignore_eos=body_field(body, "ignore_eos", bool, False),
        logprobs=logprobs,
        speculative=body_field(body, "speculative", bool),
        **extra,
    )


def _completion_prompt(body: dict) -> str | list[int]:
    if "prompt" not in body:
        raise BadField("prompt", "'prompt' is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise BadField("prompt", "'prompt' must be a string or a list of token ids (one prompt per request)")


_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal",  # refusal: null only
                           "reasoning_content", "reasoning"})  # an assistant's thinking, for templates that keep it


def _chat_messages(body: dict) -> list[dict]:
    """OpenAI's messages as the wire takes them: text content (parts joined), an
    assistant's `tool_calls`, a tool result's `tool_call_id` and `name`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadField("messages", f"messages[{i}] must be an object with a string 'role'")
        if m["role"] not in _ROLES:
            raise BadField("messages", f"messages[{i}].role {shown(m['role'])} is not one of {', '.join(_ROLES)}")
        extra = sorted(k for k in m if k not in _MESSAGE_KEYS or (k == "refusal" and m[k] is not None))
        if extra:
            raise BadField("messages", f"messages[{i}]: {', '.join(map(quoted, extra[:5]))} not supported by this "
                                        "server")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadField("messages", f"messages[{i}]: only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise BadField("messages", f"messages[{i}].content must be a string or a list of text parts")
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) and isinstance(c.get("id", ""), (str, type(None)))
                    and isinstance(c["function"].get("arguments", ""), (str, dict, type(None))) for c in calls):
                raise BadField("messages", f"messages[{i}].tool_calls must be a list of "
                                            "{id, type: function, function: {name, arguments}}")
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name", "reasoning_content", "reasoning"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise BadField("messages", f"messages[{i}].{key} must be a string")
                msg[key] = m[key]
        out.append(msg)
    return out


def _reasoning_kwargs(body: dict) -> dict[str, Any]:
    """chat_template_kwargs (vLLM's), reasoning_effort and thinking_token_budget."""
    return dict(chat_template_kwargs=body_field(body, "chat_template_kwargs", dict),
                reasoning_effort=body_field(body, "reasoning_effort", str),
                thinking_token_budget=body_field(body, "thinking_token_budget", int))  # its range: build_request's


def _tool_kwargs(body: dict) -> dict[str, Any]:
    tools = body_field(body, "tools", list)
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise BadField("tool_choice", "'tool_choice' must be a string or an object")
    return dict(tools=tools or None, tool_choice=choice,
                parallel_tool_calls=body_field(body, "parallel_tool_calls", bool))


# What the chat and completions endpoints read (everything else is refused by name).
_COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "seed", "stop",
                     "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                     "top_k", "min_p", "stop_token_ids", "ignore_eos", "repetition_penalty", "response_format",
                     "speculative",
                     "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}
                    ) | ACCEPTED_NO_EFFECT
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort", "thinking_token_budget",
                         "include_reasoning"}
# best_of and suffix are read to be refused by name (completions.py)
COMPLETION_PARAMS = _COMMON | {"prompt", "echo", "best_of", "suffix", "prompt_logprobs"}


def make_request(body: dict, chat: bool, request_id: str, limits: RequestLimits = RequestLimits()
                 ) -> pb.GenerateRequest:
    """The request of a chat or completions body, checked as every backend will check it,
    with the errors naming the body's fields."""
    check_params(body, CHAT_PARAMS if chat else COMPLETION_PARAMS)
    model = body_field(body, "model", str, "")
    kwargs = sampling_kwargs(body, chat, limits) | openai_extras(body)  # penalties, logit_bias, structured outputs
    if chat:
        request = build_request(messages=_chat_messages(body), model=model, request_id=request_id, **kwargs,
                                **_tool_kwargs(body), **_reasoning_kwargs(body))
        names = {"logprobs": "top_logprobs", "prompt": "messages",
                 "max_tokens": "max_completion_tokens" if body.get("max_completion_tokens") is not None else
                 "max_tokens"}
    else:
        request = build_request(_completion_prompt(body), model=model, request_id=request_id, **kwargs)
        names = {"messages": "prompt"}
    validate_request(request, limits, names)
    return request


# -- response building --------------------------------------------------------------------
def _usage(u: pb.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


PARTIAL_TOKEN_PREFIX = "bytes:"  # a token that is not whole UTF-8 on its own, as OpenAI shows it: bytes:\xe2\x80


def token_bytes(token: str) -> list[int]:
    """A token's own bytes: its text's, or those a "bytes:\\xNN..." token spells out."""
    if token.startswith(PARTIAL_TOKEN_PREFIX):
        try:
            return list(token[len(PARTIAL_TOKEN_PREFIX):].encode("latin-1").decode("unicode_escape").encode("latin-1"))
        except (UnicodeError, ValueError):
            pass
    return list(token.encode("utf-8"))


def _chat_logprobs(lps) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": token_bytes(token)}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t.token, t.logprob) for t in lp.top]}
                        for lp in lps]}


class Exchange:
    """One HTTP request: its ids, and how its chunks become OpenAI JSON."""

    def __init__(self, chat: bool, model: str, want_logprobs: bool, include_reasoning: bool = True):
        self.chat = chat
        self.include_reasoning = include_reasoning  # vLLM's include_reasoning: false drops the thinking
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.want_logprobs = want_logprobs
        self.num_tool_calls: dict[int, int] = {}
        self.started: set[int] = set()  # choices whose first delta (with the role) is sent

    def _envelope(self, choices: list, usage: dict | None, stream: bool) -> dict:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or not stream:
            body["usage"] = usage
        return body

    # The chat endpoint's choices (completions.py builds its own, on `_envelope`).
    def stream_chunk(self, r: pb.GenerateResponse) -> dict | None:
        """The chunk's SSE object; None when it has nothing to say (its text held back, as
        a tool call's is until the call is whole)."""
        i = r.index
        logprobs = _chat_logprobs(r.logprobs) if self.want_logprobs else None
        first = i not in self.started
        self.started.add(i)
        delta = {"role": "assistant", "content": r.text} if first else ({"content": r.text} if r.text else {})
        if r.reasoning and self.include_reasoning:  # vLLM's name, and the newer one
            delta["reasoning_content"] = delta["reasoning"] = r.reasoning
        if r.tool_calls:  # a call is sent whole, when its end marker has arrived
            done = self.num_tool_calls.get(i, 0)
            delta["tool_calls"] = [{"index": done + k, **tool_call_json(c)} for k, c in enumerate(r.tool_calls)]
            self.num_tool_calls[i] = done + len(r.tool_calls)
        finish = FINISH_REASON_NAMES.get(r.finish_reason)
        if not (first or delta or finish or logprobs and logprobs.get("content")):
            return None
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope([choice], None, stream=True)

    def usage_chunk(self, usage: pb.Usage) -> dict:
        return self._envelope([], _usage(usage), stream=True)

    def full(self, chunks: list[pb.GenerateResponse]) -> dict:
        """The whole answer: one choice per sample index, in index order; the usage (of
        all samples) rides on the last chunk."""
        by_index: dict[int, list[pb.GenerateResponse]] = {}
        for c in chunks:
            by_index.setdefault(c.index, []).append(c)
        choices = [self._choice(i, by_index[i]) for i in sorted(by_index)] or [self._choice(0, [])]
        last = chunks[-1] if chunks else pb.GenerateResponse()
        return self._envelope(choices, _usage(last.usage), stream=False)

    def _choice(self, index: int, chunks: list[pb.GenerateResponse]) -> dict:
        text = "".join(c.text for c in chunks)
        finish = next((FINISH_REASON_NAMES.get(c.finish_reason) for c in reversed(chunks) if c.finish_reason), None)
        logprobs = _chat_logprobs([lp for c in chunks for lp in c.logprobs]) if self.want_logprobs else None
        calls = [tool_call_json(c) for ch in chunks for c in ch.tool_calls]
        message = {"role": "assistant", "content": text if text or not calls else None}
        reasoning = "".join(c.reasoning for c in chunks)
        if reasoning and self.include_reasoning:  # vLLM's name, and the newer one
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def tool_call_json(c: pb.ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


async def _models(request: web.Request) -> web.Response:
    try:
        models = await request.app[BACKEND].list_models()
    except OrchardError as e:
        return error_response(e.http_status, e.message)
    return web.json_response({"object": "list", "data": [_model_json(m) for m in models.models]})


def _model_json(m: pb.ModelInfo) -> dict:
    """A model as /v1/models lists it; `tasks` says what it serves (generate, embed, score)."""
    return {"id": m.id, "object": "model", "created": 0, "owned_by": m.owned_by or "orchard",
            "max_model_len": m.max_model_len, "tasks": list(m.tasks) or ["generate"]}


async def _model(request: web.Request) -> web.Response:
    model_id = request.match_info["model_id"]
    try:
        models = await request.app[BACKEND].list_models()
    except OrchardError as e:
        return error_response(e.http_status, e.message)
    for m in models.models:
        if m.id == model_id:
            return web.json_response(_model_json(m))
    return error_response(404, f"The model {shown(model_id)} does not exist", param="model", code="model_not_found")


async def _health(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    if getattr(backend, "draining", False):
        return web.json_response({"status": "draining"}, status=503)
    if getattr(backend, "stalled", False):
        return web.json_response({"status": "stalled", "message": getattr(backend, "stall_reason", "")}, status=503)
    if getattr(backend, "serving", True) is False:  # a router with no worker that can take a request
        return web.json_response({"status": "unavailable", "message": "no worker can take a request"}, status=503)
    try:
        await backend.list_models()
    except OrchardError as e:
        return web.json_response({"status": "unavailable", "message": e.message}, status=503)
    return web.json_response({"status": "ok"})


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request)


async def _generate(request: web.Request) -> web.StreamResponse:
    """A chat completion, whole or streamed."""
    backend = request.app[BACKEND]
    try:
        body = await read_body(request)
        stream = body_field(body, "stream", bool, False)
        stream_options = body_field(body, "stream_options", dict, {})
        include_usage = bool(stream_options.get("include_usage")) and stream
        ex = Exchange(True, "", bool(body.get("logprobs")), body_field(body, "include_reasoning", bool, True))
        proto = make_request(body, True, ex.id, request.app[LIMITS])
        ex.model = await served_model(request.app, proto.model)
        timeout = request_timeout(request)
        chunks = finished(within(backend.generate(proto, timeout=timeout), timeout), num_choices(proto))
    except OrchardError as e:
        return error_of(e)
    async with contextlib.aclosing(chunks):
        try:
            if not stream:
                return web.json_response(ex.full([c async for c in chunks]))
            # Wait for the first chunk before sending headers, so that refusals (queue
            # full, bad input found by the engine) still get their HTTP status.
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        except OrchardError as e:  # a request held past the router's --resume-wait too: 503, Retry-After
            return error_of(e)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        usage = None
        async with contextlib.aclosing(keepalive(chunks, backend, proto.request_id)) as rest:
            try:
                r = first
                while r is not None:
                    if isinstance(r, str):  # held mid-stream: no worker of model `r` can take it yet
                        await response.write(sse_comment(f"waiting for a worker of {r or 'any model'}"))
                    else:
                        if (body := ex.stream_chunk(r)) is not None:
                            await response.write(sse(body))
                        if r.HasField("usage"):
                            usage = r.usage
                    r = await anext(rest, None)
            except OrchardError as e:
                kind = ERROR_TYPES.get(e.http_status, "server_error")
                await response.write(sse({"error": {"message": e.message, "type": kind, "param": None,
                                                     "code": e.http_status}}))
        if include_usage and usage is not None:
            await response.write(sse(ex.usage_chunk(usage)))
        await response.write(sse("[DONE]"))
        await response.write_eof()
        return response
