"""The HTTP base every API module builds on: the app and its guard (keys, allowed hosts,
CORS), the backend handle, error shapes (OpenAI's and Anthropic's), JSON bodies and typed
fields, per-request timeouts, SSE framing.

`new_app` makes an app with no routes; `cluster.api.app.create_app` puts each API's routes
on it (openai.py: chat, models, health; completions.py; responses.py; messages.py). Those
modules import this one and never each other's private names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from aiohttp import web

from cluster.api.errors import DeadlineExceeded, InvalidRequest
from cluster.api.servicer import Backend
from cluster.security import Keys, host_allowed

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error", 503: "service_unavailable",
               504: "timeout_error"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 504: "timeout_error"}
BACKEND = web.AppKey("backend", object)  # the app's `Backend`
TIMEOUT = web.AppKey("request_timeout", object)
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds, per request (at most the server's --request-timeout)
MODEL_CACHE = web.AppKey("model_cache", list)

# Sent by real clients and changing no output: every API accepts them. Any other
# parameter an endpoint does not read is refused by name (400), never silently ignored.
ACCEPTED_NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                                "safety_identifier"})


def new_app(backend: Backend, request_timeout: float | None = None, *, keys: Keys | None = None,
            allowed_hosts: tuple[str, ...] | None = None, cors_origins: tuple[str, ...] = ()) -> web.Application:
    """An app over `backend` with no routes yet, guarded: with `keys`, `/v1/*` takes
    `Authorization: Bearer KEY` (401 otherwise); with `allowed_hosts`, a request whose Host
    is not one of them is 403 (DNS rebinding); with `cors_origins` ("*" for any), browser
    pages of those origins may call it (CORS)."""
    app = web.Application(client_max_size=32 << 20, middlewares=[_guard(keys or Keys(), allowed_hosts)])
    if cors_origins:
        _cors(app, cors_origins)
    app[BACKEND] = backend
    app[TIMEOUT] = request_timeout
    app[MODEL_CACHE] = [float("-inf"), ""]
    return app


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status if code is None else code}}
    return web.json_response(body, status=status)


def anthropic_error(status: int, message: str) -> web.Response:
    """Anthropic's error shape (on /v1/messages)."""
    return web.json_response({"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                                         "message": message}}, status=status)


class BadField(InvalidRequest):
    """A 400 about one request field, which the error's `param` names."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def body_field(body: dict, name: str, kind: type | tuple, default=None):
    """`body[name]` if it is of `kind` (None: `default`), else BadField."""
    value = body.get(name, default)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds) or (float in kinds and isinstance(value, int))
    if not ok:
        names = " or ".join("number" if k is float else k.__name__ for k in kinds)
        raise BadField(name, f"'{name}' must be a {names}, got {json.dumps(value)}")
    return value


def check_params(body: dict, known: frozenset[str]) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise BadField(unknown[0], f"unknown parameter{'s' if len(unknown) > 1 else ''} "
                                    f"{', '.join(map(repr, unknown))}: not supported by this server")


async def read_body(request: web.Request) -> dict:
    """The request's JSON object, or InvalidRequest (400) saying what is wrong with it."""
    try:
        body = await request.json(loads=json.loads)
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


async def served_model(app: web.Application, asked: str) -> str:
    """The model to name in responses: the one asked for, else the backend's first
    (looked up at most every 10 s, not once per request)."""
    if asked:
        return asked
    cache = app[MODEL_CACHE]
    if time.monotonic() - cache[0] > 10.0:
        models = (await app[BACKEND].list_models()).models
        cache[:] = [time.monotonic(), models[0].id if models else ""]
    return cache[1]


def request_timeout(request: web.Request) -> float | None:
    """The request's time limit: the server's, or the client's header if shorter."""
    limit = request.app[TIMEOUT]
    header = request.headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            asked = float(header)
        except ValueError:
            asked = -1.0
        if not asked > 0:
            raise InvalidRequest(f"{TIMEOUT_HEADER} must be a number of seconds > 0, got {header!r}")
        limit = asked if limit is None else min(limit, asked)
    return limit


async def within(chunks, timeout: float | None):
    """`chunks`, or DeadlineExceeded once `timeout` seconds have passed (closing `chunks`:
    the request is cancelled wherever it runs)."""
    async with contextlib.aclosing(chunks):
        if timeout is None:
            async for chunk in chunks:
                yield chunk
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"the request took longer than its {timeout:g} s timeout") from None
            yield chunk


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def _guard(keys: Keys, allowed: tuple[str, ...] | None):
    @web.middleware
    async def guard(request: web.Request, handler):
        if not host_allowed(request.headers.get("Host"), allowed):
            return error_response(403, f"Host {request.headers.get('Host')!r} is not served here: add it to the "
                                       "server's --allowed-hosts", code="host_not_allowed")
        anthropic = request.path.startswith("/v1/messages")
        if request.path.startswith("/v1/"):
            authorization = request.headers.get("Authorization")
            if authorization is None and request.headers.get("x-api-key"):  # Anthropic's clients send this
                authorization = f"Bearer {request.headers['x-api-key']}"
            refused = keys.refusal(authorization, "inference")
            if refused is not None:
                if anthropic:
                    return anthropic_error(401, refused[1])
                response = error_response(401, refused[1], code="invalid_api_key")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        try:
            return await handler(request)
        except web.HTTPException as e:  # no such route or method: in the API's error shape, not plain text
            if e.status < 400:
                raise
            message = (f"no route {request.method} {request.path}" if e.status == 404 else
                       f"{request.method} is not allowed on {request.path}" if e.status == 405 else e.reason)
            return anthropic_error(e.status, message) if anthropic else error_response(e.status, message)

    return guard


def _cors(app: web.Application, origins: tuple[str, ...]) -> None:
    """CORS for browser clients of the listed origins: preflights answered, responses
    (streams too, as their headers go out) marked. A request from another origin gets no
    CORS headers: its browser blocks it."""
    any_origin = "*" in origins

    def allowed(request: web.Request) -> bool:
        origin = request.headers.get("Origin")
        return origin is not None and (any_origin or origin in origins)

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers and allowed(request):
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS", "Access-Control-Max-Age": "600",
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                    "authorization, content-type")})
        return await handler(request)

    async def mark(request: web.Request, response: web.StreamResponse) -> None:
        if allowed(request):
            response.headers["Access-Control-Allow-Origin"] = request.headers["Origin"]
            response.headers["Vary"] = "Origin"

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(mark)
