"""The HTTP base every API module builds on: the app and its guard (keys, allowed hosts,
CORS), the backend handle, error shapes (OpenAI's and Anthropic's), JSON bodies (their
fields: `cluster.api.bodies`), per-request timeouts, SSE framing.

`new_app` makes an app with no routes; `cluster.api.app.create_app` puts each API's routes
on it (openai.py: chat, models, health; completions.py; responses.py; messages.py). Those
modules import this one and never each other's private names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from cluster.api.errors import BadField, InvalidRequest, OrchardError
from cluster.api.limits import (HTTP_MAX_BODY_BYTES, MAX_JSON_DEPTH, MAX_SHOWN_CHARS, MAX_TIMEOUT_SECONDS,
                                RequestLimits, check_json_depth, loads_strict, quoted, shown)
from cluster.api.servicer import Backend
from cluster.security import Keys, host_allowed

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 409: "conflict_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error",
               503: "service_unavailable", 504: "timeout_error"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 504: "timeout_error"}
BACKEND = web.AppKey("backend", object)  # the app's `Backend`
TIMEOUT = web.AppKey("request_timeout", object)
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds, per request (at most the server's --request-timeout)
MODEL_CACHE = web.AppKey("model_cache", list)
# set on a request whose body could not be read: its answer closes the connection
CLOSE = web.RequestKey("close_connection", bool) if hasattr(web, "RequestKey") else "orchard.close_connection"
LIMITS = web.AppKey("limits", RequestLimits)  # the backend's (`limits_of`): the same on HTTP and gRPC


def new_app(backend: Backend, request_timeout: float | None = None, *, keys: Keys | None = None,
            allowed_hosts: tuple[str, ...] | None = None, cors_origins: tuple[str, ...] = ()) -> web.Application:
    """An app over `backend` with no routes yet, guarded: with `keys`, every path but
    `OPEN_PATHS` (and the console's, which checks keys itself) takes `Authorization: Bearer
    KEY` (401 otherwise); with `allowed_hosts`, a request whose Host
    is not one of them is 403 (DNS rebinding); with `cors_origins` ("*" for any), browser
    pages of those origins may call it (CORS)."""
    app = web.Application(client_max_size=HTTP_MAX_BODY_BYTES, middlewares=[_guard(keys or Keys(), allowed_hosts)])
    if cors_origins:
        _cors(app, cors_origins)
    app[BACKEND] = backend
    app[LIMITS] = limits_of(backend)
    app[TIMEOUT] = request_timeout
    app[MODEL_CACHE] = [float("-inf"), ""]
    return app


def limits_of(backend) -> RequestLimits:
    """What `backend` lets one request ask for (the worker's and the router's limits;
    the defaults for a backend that has none of its own)."""
    limits = getattr(backend, "limits", None)
    return limits if isinstance(limits, RequestLimits) else RequestLimits()


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   retry_after: int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status if code is None else code}}
    headers = None if retry_after is None else {"Retry-After": str(retry_after)}
    return web.json_response(body, status=status, headers=headers)


def error_of(e: OrchardError) -> web.Response:
    """An OrchardError's response: its status, message, field, and when to retry if it says."""
    return error_response(e.http_status, e.message, getattr(e, "param", None),
                          retry_after=getattr(e, "retry_after", None))


def anthropic_error(status: int, message: str) -> web.Response:
    """Anthropic's error shape (on /v1/messages)."""
    return web.json_response({"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                                         "message": message}}, status=status)


def renamed(message: str, names: dict[str, str]) -> str:
    """A backend's message with the wire's field names written as this API's client knows
    them (`names`: wire -> client). Only names with an underscore are rewritten: they
    cannot be mistaken for a word of the message's prose."""
    for wire, client in names.items():
        if "_" in wire:
            message = re.sub(rf"\b{re.escape(wire)}\b", client, message)
    return message


# A JSON escape of half a surrogate pair: not Unicode text; a string holding one cannot be
# encoded again (into a proto, a response), so the body is refused where it is read.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


async def read_body(request: web.Request) -> dict:
    """The request's JSON object (strict JSON: no NaN or Infinity, no lone surrogates, each
    field nested at most MAX_JSON_DEPTH deep), or InvalidRequest (400) saying what is wrong
    with it. A body that does not arrive within
    the server's `http_body_timeout` is a 408."""
    limit = request.app[LIMITS].http_body_timeout
    try:
        raw = await asyncio.wait_for(request.read(), limit)
    except asyncio.TimeoutError:
        request[CLOSE] = True
        raise RequestTimeout(f"the request body did not arrive within {limit:g} s (http_body_timeout)") from None
    except web.HTTPRequestEntityTooLarge:
        request[CLOSE] = True
        raise TooLarge(f"the request body is larger than {HTTP_MAX_BODY_BYTES} bytes, the most this server "
                       "reads") from None
    except (RequestPayloadError, HttpProcessingError) as e:  # a body its Content-Encoding does not decode, ...
        request[CLOSE] = True
        encoding = request.headers.get("Content-Encoding")
        what = f" as its Content-Encoding ({quoted(encoding)}) says" if encoding else ""
        reason = " ".join(str(e).split()).removeprefix("400, message: ")
        raise InvalidRequest(f"the request body could not be read{what}: {reason}") from None
    try:
        body = loads_strict(raw)
    except RecursionError:
        raise InvalidRequest(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects "
                             f"within each other): at most {MAX_JSON_DEPTH} are allowed") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name, value in body.items():
        check_json_depth(value, name[:MAX_SHOWN_CHARS])
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise InvalidRequest("the request body holds a lone UTF-16 surrogate escape (such as \\udc80), which "
                                 "is not Unicode text") from None
    return body


class RequestTimeout(InvalidRequest):
    """The client took too long to send its request (HTTP 408)."""

    http_status = 408


class TooLarge(InvalidRequest):
    """HTTP 413."""

    http_status = 413


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
    """The request's time limit: the server's, or the client's header if shorter (a
    finite number of seconds > 0; beyond MAX_TIMEOUT_SECONDS it sets no limit)."""
    limit = request.app[TIMEOUT]
    header = request.headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            asked = float(header)
        except ValueError:
            asked = math.nan
        if not (asked > 0 and math.isfinite(asked)):
            raise BadField(TIMEOUT_HEADER, f"{TIMEOUT_HEADER} must be a finite number of seconds > 0, "
                                           f"got {shown(header)}")
        if asked < MAX_TIMEOUT_SECONDS:
            limit = asked if limit is None else min(limit, asked)
    return limit


def sse_comment(text: str) -> bytes:
    """An SSE comment line: clients skip it; it keeps the connection in use."""
    return f": {text}\n\n".encode()


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


# On a server with API keys every path takes one but these: health, and the console's page
# and files, which check keys themselves (the page loads, then asks for one). A route added
# later is closed until it is listed here.
OPEN_PATHS = frozenset({"/health", "/"})
OWN_KEYS_PREFIXES = ("/console/",)


def needs_key(path: str) -> bool:
    return path not in OPEN_PATHS and not path.startswith(OWN_KEYS_PREFIXES)


def _guard(keys: Keys, allowed: tuple[str, ...] | None):
    @web.middleware
    async def guard(request: web.Request, handler):
        if not host_allowed(request.headers.get("Host"), allowed):
            return error_response(403, f"Host {request.headers.get('Host')!r} is not served here: add it to the "
                                       "server's --allowed-hosts", code="host_not_allowed")
        anthropic = request.path.startswith("/v1/messages")
        if needs_key(request.path):
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
            response = await handler(request)
            if request.get(CLOSE):  # its body was not read whole: the connection cannot carry another request
                response.force_close()
            return response
        except web.HTTPException as e:  # no such route or method: in the API's error shape, not plain text
            if e.status < 400:
                raise
            message = (f"no route {request.method} {shown(request.path)}" if e.status == 404 else
                       f"{request.method} is not allowed on {shown(request.path)}" if e.status == 405 else e.reason)
            return anthropic_error(e.status, message) if anthropic else error_response(e.status, message)
        except (ConnectionError, asyncio.CancelledError):  # the client went away
            raise
        except Exception as e:  # a bug: still an answer in the API's shape, and the server goes on
            log.exception("%s %s failed", request.method, shown(request.path))
            message = f"internal error ({type(e).__name__}): the server could not handle this request"
            return anthropic_error(500, message) if anthropic else error_response(500, message)

    return guard


class JsonErrorsServer(web.Server):
    """aiohttp's low-level server whose connections answer aiohttp's own refusals (a
    malformed request line or header, headers past their size limits) in the OpenAI error
    shape, as JSON, instead of plain text, and drop a client whose headers take longer than
    `header_timeout` seconds from their first byte (from connecting, for a connection's first
    request). aiohttp has no header timeout of its own: its keep-alive timer also runs while
    headers are read, so as a header timeout it closed idle keep-alive connections as soon
    (30 s), before the proxies and client pools that keep them longer (nginx 60 s, Go 90 s):
    a request written on one as it closed failed. Here the keep-alive is aiohttp's own, apart.
    `serving` makes an app's server one of these."""

    header_timeout: float | None = None

    def __call__(self) -> RequestHandler:
        return _JsonErrorsProtocol(self, loop=self._loop, **self._kwargs)


class _JsonErrorsProtocol(RequestHandler):
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch_headers()  # the first request's headers: within the header timeout of connecting

    def data_received(self, data: bytes) -> None:
        idle = self._waiter is not None and not self._waiter.done()  # between requests (keep-alive)
        super().data_received(data)
        if self._messages:  # a whole request's headers (or a malformed request) arrived
            self._unwatch_headers()
        elif idle and self._header_deadline is None:  # a request begins on an idle connection
            self._watch_headers()

    def connection_lost(self, exc) -> None:
        self._unwatch_headers()
        super().connection_lost(exc)

    def _watch_headers(self) -> None:
        timeout = getattr(self._manager, "header_timeout", None)
        if timeout and self._header_deadline is None:
            self._header_deadline = self._loop.call_later(timeout, self._headers_late)
            # aiohttp's keep-alive timer closes a connection whose next request is not whole
            # when it fires: not while the header timeout still runs
            self._next_keepalive_close_time = max(self._next_keepalive_close_time, self._loop.time() + timeout + 1)

    def _unwatch_headers(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if not self._messages and not self._request_in_progress:
            log.debug("closed a connection whose request headers took longer than %g s", self._manager.header_timeout)
            self.force_close()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            super().handle_error(request, status, exc, message)  # logs the bug; raises once a response is under way
            text = "internal error: the server could not handle this request"
        else:  # a client's malformed request: one short line in the log, not a traceback
            if request.writer.output_size > 0:
                raise ConnectionError("a response is under way: no error response can follow it")
            text = " ".join((message or "").split())[:200] or HTTPStatus(status).phrase
            log.debug("refused a malformed HTTP request (%d): %s", status, text)
            text = f"the HTTP request could not be read: {text}"
        response = error_response(status, text)
        response.force_close()
        return response


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
