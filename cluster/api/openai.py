"""OpenAI-compatible HTTP API (aiohttp) in front of any `Generation` backend.

The backend is a `cluster.api.servicer.Backend`: the worker's `WorkerService` or the
router's `RouterBackend` in process (or the SDK's `GrpcBackend` over a channel), so the
worker and the router serve the same API.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming or not),
GET /v1/models, GET /v1/models/{id}, GET /health, and on the same app /v1/responses
(responses.py) and /v1/messages (messages.py); /v1/completions' evaluation features
(echo, prompt lists, n, prompt_logprobs) are in completions.py; `cluster.api.app` puts them
all on one app over the shared base (`cluster.api.http`). Sampling fields (read and
checked in one pass by `cluster.api.bodies`):
max_tokens (max_completion_tokens; a chat without it runs to the end of the context),
temperature, top_p, n, seed, stop, stream_options.include_usage, logprobs (top_logprobs
for chat), presence_penalty, frequency_penalty, logit_bias, response_format, tools,
tool_choice, parallel_tool_calls (chat), reasoning_effort (chat), and the extensions
keep_alive (Ollama's: a router's fleet model stays loaded that long after it), ignore_eos,
top_k, min_p, speculative, stop_token_ids, repetition_penalty, vLLM's guided_* and
structured_outputs (`cluster.api.constraints`), and for chat vLLM's
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

from aiohttp import web

from cluster.api.bodies import ChatBody
from cluster.api.errors import OrchardError
from cluster.api.http import (BACKEND, ERROR_TYPES, LIMITS, error_of, error_response, read_body,
                              request_timeout, served_model, sse, sse_comment)
from cluster.api.limits import shown
from cluster.api.streams import generation
from cluster.api.wire import FINISH_REASON_NAMES
from cluster.proto.orchard.v1 import orchard_pb2 as pb

log = logging.getLogger(__name__)



def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id:.+}", _model)
    app.router.add_get("/health", _health)


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


def new_id(chat: bool) -> str:
    """A new request's id, in OpenAI's shape."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


class Exchange:
    """One HTTP request: its ids, and how its chunks become OpenAI JSON."""

    def __init__(self, chat: bool, model: str, want_logprobs: bool, include_reasoning: bool = True,
                 request_id: str = ""):
        self.chat = chat
        self.include_reasoning = include_reasoning  # vLLM's include_reasoning: false drops the thinking
        self.id = request_id or new_id(chat)
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
    """A model as /v1/models lists it; `tasks` says what it serves (generate, embed, score);
    a fleet's catalog model also its `state` and `status` ("serving on mac-1 and mac-3")."""
    out = {"id": m.id, "object": "model", "created": 0, "owned_by": m.owned_by or "orchard",
           "max_model_len": m.max_model_len, "tasks": list(m.tasks) or ["generate"]}
    if m.state:
        out |= {"state": m.state, "status": m.status}
    return out


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
    """A chat completion, whole or streamed: the body read (http) and checked in one pass
    (`ChatBody`), its wire request built, the model and timeout picked, the backend's
    chunks (`generation`) answered in OpenAI's shape."""
    backend = request.app[BACKEND]
    try:
        raw = await read_body(request)
        body = ChatBody.parse(raw, request.app[LIMITS])
        proto = body.request(new_id(chat=True), request.app[LIMITS])
        model = await served_model(request.app, proto.model)
        timeout = request_timeout(request)
        chunks = generation(backend, proto, timeout, held=body.stream)
    except OrchardError as e:
        return error_of(e)
    ex = Exchange(True, model, body.want_logprobs, body.include_reasoning, proto.request_id)
    async with contextlib.aclosing(chunks):
        try:
            if not body.stream:
                return web.json_response(ex.full([c async for c in chunks]))
            # Wait for the first chunk before sending headers, so that refusals (queue
            # full, bad input found by the engine) still get their HTTP status (a request
            # held while a fleet loads its model starts its stream, `keepalive`: a failed
            # load is then an error event, as a failure mid-stream is).
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = None
        except OrchardError as e:  # a request held past the router's --resume-wait too: 503, Retry-After
            return error_of(e)
        return await _stream(request, ex, first, chunks, body.include_usage)


async def _stream(request: web.Request, ex: Exchange, first: pb.GenerateResponse | None, rest,
                  include_usage: bool) -> web.StreamResponse:
    """The answer as SSE: `first` and then `rest`'s chunks, a held stream's waits as
    comments, an error mid-stream as an error event, then the usage if asked and [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    usage = None
    try:
        r = first
        while r is not None:
            if isinstance(r, str):  # held: no worker of model `r` can take it yet (or it is being loaded)
                status = getattr(request.app[BACKEND], "hold_status", lambda _: None)(ex.id)
                await response.write(sse_comment(status or f"waiting for a worker of {r or 'any model'}"))
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
