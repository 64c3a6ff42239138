"""The console's HTTP routes, on a server's HTTP app (the router's, a worker's).

  GET  /                          the page (cluster/console/static/index.html)
  GET  /console/{file}            its scripts, style sheet and icon (shipped in the package)
  GET  /console/state             the state now, as JSON (`cluster.console.state`)
  GET  /console/events            the same, pushed as Server-Sent Events on change (`Hub`)
  POST /console/workers/{id}/drain            {"drain": true|false}: the admin key
  POST /console/models/{load|unload|pin|unpin}  {"model": NAME}: a catalog model (a fleet): the admin key

The page and its files are open (they hold no data); the state and its pushes take an API
key when the server has keys (as /metrics does); the actions take the admin key, which the
server must have (a keyless router would otherwise act for any page its browser opens), and
a JSON body (a type no cross-site form or no-cors fetch can send). Every
answer carries a strict Content-Security-Policy: scripts and styles from this origin only,
no inline script or style, no frames, nothing fetched from elsewhere.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

from aiohttp import web

from cluster.api.errors import OrchardError
from cluster.api.http import error_of, error_response, read_body, sse_comment
from cluster.api.limits import shown
from cluster.console.hub import Hub, encode
from cluster.security import ADMIN, INFERENCE, Keys

STATIC = Path(__file__).parent / "static"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
KEEPALIVE_SECONDS = 15.0  # a comment on a quiet push stream, so that proxies keep it open
MODEL_ACTIONS = ("load", "unload", "pin", "unpin")
MAX_OPEN_CONSOLES = 64  # push streams at once: each holds a connection for as long as its page is open


class ConsoleState(Protocol):
    def snapshot(self) -> dict: ...


class Actions(Protocol):
    """What an operator may do from the console; each raises OrchardError (its HTTP status
    and message go back to the page)."""

    async def drain(self, worker_id: str, drain: bool) -> dict: ...

    async def model(self, name: str, action: str) -> dict: ...


def add_routes(app: web.Application, state: ConsoleState, keys: Keys, actions: Actions | None = None) -> None:
    """The console on `app`: its page at /, its state, pushes and (with `actions`) the
    operator's actions."""
    console = _Console(state, keys, actions)
    app.on_shutdown.append(console.hub.close)
    app.on_response_prepare.append(_secure)
    app.router.add_get("/", console.page)
    app.router.add_get("/console/state", console.current)
    app.router.add_get("/console/events", console.events)
    app.router.add_get("/console/{name}", console.static)
    if actions is not None:
        app.router.add_post("/console/workers/{worker_id}/drain", console.drain)
        app.router.add_post("/console/models/{action}", console.model)


class _Console:
    def __init__(self, state: ConsoleState, keys: Keys, actions: Actions | None):
        self.state, self.keys, self.actions = state, keys, actions
        self.files = {p.name: (p.read_bytes(), CONTENT_TYPES[p.suffix]) for p in STATIC.iterdir()
                      if p.suffix in CONTENT_TYPES}
        self.hub = Hub(state.snapshot)

    def asset(self, name: str) -> web.Response:
        if name not in self.files:
            return error_response(404, f"no console file {name[:80]!r}")
        body, content_type = self.files[name]
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def page(self, request: web.Request) -> web.Response:
        return self.asset("index.html")

    async def static(self, request: web.Request) -> web.Response:
        return self.asset(request.match_info["name"])

    async def current(self, request: web.Request) -> web.StreamResponse:
        refused = _refused(request, self.keys, INFERENCE)
        if refused is not None:
            return refused
        return _json(self.state.snapshot())

    async def events(self, request: web.Request) -> web.StreamResponse:
        refused = _refused(request, self.keys, INFERENCE)
        if refused is not None:
            return refused
        if len(self.hub.listeners) >= MAX_OPEN_CONSOLES:
            return error_response(503, f"{MAX_OPEN_CONSOLES} consoles are open on this server, the most it serves: "
                                       "close one, or try again later", retry_after=5)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        queue = self.hub.subscribe()
        try:
            while True:
                try:
                    payload = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                except asyncio.TimeoutError:
                    await response.write(sse_comment("keepalive"))
                    continue
                if payload is None:  # the server stops
                    break
                await response.write(b"data: " + payload + b"\n\n")
        except ConnectionError:  # the page went away
            pass
        finally:
            self.hub.unsubscribe(queue)
        return response

    async def drain(self, request: web.Request) -> web.Response:
        refused = _action_refused(request, self.keys)
        if refused is not None:
            return refused
        try:
            value = (await read_body(request)).get("drain", True)
            if not isinstance(value, bool):
                return error_response(400, f"drain must be true or false, got {str(value)[:40]!r}", param="drain")
            return _json(await self.actions.drain(request.match_info["worker_id"], value))
        except OrchardError as e:
            return error_of(e)

    async def model(self, request: web.Request) -> web.Response:
        refused = _action_refused(request, self.keys)
        if refused is not None:
            return refused
        action = request.match_info["action"]
        if action not in MODEL_ACTIONS:
            return error_response(404, f"no model action {action[:40]!r}: one of {', '.join(MODEL_ACTIONS)}")
        try:
            name = (await read_body(request)).get("model")
            if not isinstance(name, str) or not name:
                return error_response(400, "model must be a catalog model's name", param="model")
            return _json(await self.actions.model(name, action))
        except OrchardError as e:
            return error_of(e)


def _refused(request: web.Request, keys: Keys, role: str) -> web.Response | None:
    refused = keys.refusal(request.headers.get("Authorization"), role)
    if refused is None:
        return None
    response = error_response(401 if refused[0] == "unauthenticated" else 403, refused[1],
                              code="invalid_api_key" if refused[0] == "unauthenticated" else "permission_denied")
    if refused[0] == "unauthenticated":
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _action_refused(request: web.Request, keys: Keys) -> web.Response | None:
    if not keys.admin:
        return error_response(403, "this server has no admin key, so it takes no action from the console: "
                                   "start it with --admin-key (or $ORCHARD_ADMIN_KEY)", code="permission_denied")
    refused = _refused(request, keys, ADMIN)
    if refused is None and request.content_type != "application/json":
        return error_response(415, "an action's body must be JSON, sent as Content-Type: application/json, "
                                   f"not {shown(request.content_type)}")
    return refused


def _json(body: dict) -> web.Response:
    return web.Response(body=encode(body), headers={"Content-Type": "application/json"})


async def _secure(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer of the console's, its errors too (the app's 404s and 405s among them),
    carries its Content-Security-Policy and the rest; the API's answers are left as they are."""
    if request.path == "/" or request.path.startswith("/console/"):
        response.headers.update(SECURITY_HEADERS)
