"""One start-up for a server's endpoints: gRPC (with health), OpenAI HTTP, /metrics.

The worker and the router each start an `Endpoints` with their servicers, their `Backend`
for the OpenAI API and their metrics; both get the same gRPC options (message limits, no
port sharing), the same binding rules and the same `/metrics` + `/health` endpoint.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.api.http import JsonErrorsServer, limits_of
from cluster.api.limits import GRPC_MAX_MESSAGE_BYTES, RequestLimits
from cluster.api.servicer import Backend
from cluster.platform import can_give_back_freed_memory, give_back_freed_memory, resident_bytes
from cluster.net import SERVER_KEEPALIVE_OPTIONS, parse_address
from cluster.security import AuthInterceptor, Keys, SecurityConfig, allowed_hosts, http_ssl_context, server_credentials

log = logging.getLogger(__name__)

GENERATION_SERVICE = "orchard.v1.Generation"
GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),  # the router's channels and the SDK's agree
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    *SERVER_KEEPALIVE_OPTIONS,
]
LINGER_SECONDS = 2.0  # after an answer that left a request's body unread (aiohttp's default: 10)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class MetricsEndpoint:
    """What `/metrics` renders and what `/health` on the same port answers."""

    render: Callable[[], bytes]
    content_type: str
    healthy: Callable[[], bool] = lambda: True


def bind(address: str, what: str, default_host: str = "127.0.0.1") -> socket.socket:
    """A listening, non-blocking TCP socket on HOST:PORT (port 0: any free one); an
    OSError that names the address and `what` it was for when it is taken."""
    host, port = parse_address(address, default_host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {address} for {what}: {e.strerror}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _host_port(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def metrics_app(metrics: MetricsEndpoint, security: SecurityConfig = SecurityConfig()) -> web.Application:
    """`/metrics` (with API keys configured, it takes one: Prometheus' `authorization`) and
    `/health` (always open: a load balancer's probe)."""
    keys = security.keys()

    async def handle_metrics(request: web.Request) -> web.Response:
        refused = keys.refusal(request.headers.get("Authorization"), "inference")
        if refused is not None:
            return web.json_response({"error": refused[1]}, status=401 if refused[0] == "unauthenticated" else 403,
                                     headers={"WWW-Authenticate": "Bearer"})
        return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})

    async def handle_health(request: web.Request) -> web.Response:
        ok = metrics.healthy()
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/health", handle_health)
    return app


async def _start_http(app: web.Application, address: str, what: str, default_host: str, ssl_context=None,
                      limits: RequestLimits = RequestLimits()) -> tuple[web.AppRunner, str]:
    """Serve `app` on `address`. A connection that has not sent a whole request's headers
    within `limits.http_header_timeout` of their first byte (of connecting, for its first
    request) is closed; an idle keep-alive connection stays open for
    `limits.http_keepalive_timeout` (see `JsonErrorsServer`). After an answer that left a
    body unread (413, 408), what else the client sends is read for LINGER_SECONDS at most.
    aiohttp's own refusals are JSON."""
    sock = bind(address, what, default_host)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=limits.http_keepalive_timeout, lingering_time=LINGER_SECONDS)
    await runner.setup()
    runner.server.__class__ = JsonErrorsServer  # the same server; its connections answer refusals in JSON
    runner.server.header_timeout = limits.http_header_timeout
    await web.SockSite(runner, sock, ssl_context=ssl_context).start()
    return runner, _host_port(sock)


TRIM_EVERY_SECONDS = 5.0
TRIM_GROWTH_BYTES = 2 << 20
TRIM_BUSY_CPU_SECONDS = 0.05  # CPU time in TRIM_EVERY_SECONDS that counts as busy (1% of a core)


def _cpu_seconds() -> float:
    return time.process_time()


async def _trim_freed_memory() -> None:
    """Give freed memory back to the system (`platform.give_back_freed_memory`: glibc keeps
    what a burst of large requests, a costly grammar or a hostile body freed in the middle
    of its heaps, and the process stays that large; on macOS the allocator returns it by
    itself): every TRIM_EVERY_SECONDS while the process is busy (it frees as it works) and
    once after, and whenever it has grown by TRIM_GROWTH_BYTES over its smallest size since
    it last did (a growth threshold alone kept what a burst freed as it ended, after the
    last trim). On a thread of its own."""
    floor, cpu, busy = resident_bytes(), _cpu_seconds(), False
    while True:
        await asyncio.sleep(TRIM_EVERY_SECONDS)
        rss, now = resident_bytes(), _cpu_seconds()
        was_busy, busy, cpu = busy, now - cpu >= TRIM_BUSY_CPU_SECONDS, now
        if busy or was_busy or rss >= floor + TRIM_GROWTH_BYTES:
            await asyncio.to_thread(give_back_freed_memory)
            floor = resident_bytes()
        else:
            floor = min(floor, rss)


def _drop_frame_locals(error: BaseException) -> None:
    """Clear the locals of the finished frames in `error`'s traceback and in those of the
    exceptions it chains. grpc.aio keeps an aborted call's AbortError in a reference cycle
    (the call's RPCState holds it; its traceback holds the frame of `context.abort`, whose
    context holds the RPCState), which only Python's next full collection frees, and that
    may be thousands of requests away: the frames would keep each refused request's bytes
    and message (up to GRPC_MAX_MESSAGE_BYTES) alive until then."""
    pending, seen = [error], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # skips the frames still running
        pending += [e.__context__, e.__cause__]


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    """A request whose bytes are not the protobuf message its method takes is refused
    INVALID_ARGUMENT, as the client's error (gRPC's own answer is UNKNOWN "Unexpected
    DecodeError"): each method with a single request parses it itself."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, details.method

        async def decoded(data: bytes, context):
            try:
                return parse(data)
            except Exception as e:  # protobuf's DecodeError, or whatever a deserializer raises
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request to {method} is not a valid protobuf message of its type ({e})")

        if handler.unary_stream:
            inner = handler.unary_stream

            async def stream(data, context):
                try:
                    result = inner(await decoded(data, context), context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    elif inspect.isawaitable(result):  # a method that writes with context.write
                        await result
                except BaseException as e:
                    del data  # this frame stays in the traceback
                    _drop_frame_locals(e)
                    raise

            return grpc.unary_stream_rpc_method_handler(stream, response_serializer=handler.response_serializer)
        inner = handler.unary_unary

        async def unary(data, context):
            try:
                result = inner(await decoded(data, context), context)
                return await result if inspect.isawaitable(result) else result
            except BaseException as e:
                del data  # this frame stays in the traceback
                _drop_frame_locals(e)
                raise

        return grpc.unary_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)


class _NamingServer:
    """The gRPC server as `add_services` sees it, noting the name of each service added
    (for server reflection)."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server
        self.names: list[str] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.names += [h.service_name() for h in handlers if callable(getattr(h, "service_name", None))]
        self._server.add_generic_rpc_handlers(handlers)

    def __getattr__(self, name):
        return getattr(self._server, name)


class Endpoints:
    """A server's endpoints. `bind_grpc` first (the caller may need the port, e.g. for a
    worker id), then `start`; `stop` stops whatever started, so a start that fails midway
    can be undone. `addresses` has what was bound ("grpc", "http", "metrics"), with the
    real port where 0 was asked for. An address with an empty host binds `default_host`."""

    def __init__(self, default_host: str = "127.0.0.1", health_services: tuple[str, ...] = ("", GENERATION_SERVICE),
                 security: SecurityConfig = SecurityConfig()):
        security.check()
        self.default_host = default_host
        self.security = security
        self.health_services = health_services
        self.health = health.aio.HealthServicer()
        self.addresses: dict[str, str] = {}
        self.grpc_server: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self._trimmer: asyncio.Task | None = None

    def bind_grpc(self, address: str) -> int:
        """Create the gRPC server and bind its port (not started yet); the bound port."""
        server = grpc.aio.server(options=GRPC_OPTIONS,
                                 interceptors=[AuthInterceptor(self.security.keys()), DecodeInterceptor()])
        host, _ = parse_address(address, self.default_host)
        creds = server_credentials(self.security)
        try:
            port = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if not port:
            raise OSError(f"cannot listen on {address} for gRPC (in use?)")
        self.grpc_server = server
        self.addresses["grpc"] = f"{host}:{port}"
        return port

    async def start(
        self,
        add_services: Callable[[grpc.aio.Server], None],
        *,
        backend: Backend | None = None,
        http_address: str | None = None,
        metrics: MetricsEndpoint | None = None,
        metrics_address: str | None = None,
        request_timeout: float | None = None,
        serving: bool = True,
        http_extras: Callable[[web.Application, Keys], None] | None = None,
    ) -> None:
        """Start gRPC with the services `add_services` adds plus gRPC health (SERVING, or
        NOT_SERVING with `serving=False` until the caller says otherwise) and reflection,
        then the OpenAI HTTP API over `backend` at `http_address` (requests limited to
        `request_timeout` seconds; `http_extras(app, keys)` adds more routes to it: the
        console) and `/metrics` + `/health` at `metrics_address` (None: not served)."""
        server = self.grpc_server
        assert server is not None, "bind_grpc first"
        naming = _NamingServer(server)
        add_services(naming)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, naming)
        # server reflection, so that grpcurl can list and describe every service here
        reflection.enable_server_reflection((*naming.names, reflection.SERVICE_NAME), server)
        await server.start()
        await self.set_serving(serving)
        if self._trimmer is None and can_give_back_freed_memory():
            self._trimmer = asyncio.get_running_loop().create_task(_trim_freed_memory())
        ssl_context = http_ssl_context(self.security)
        if metrics is not None and metrics_address:
            runner, self.addresses["metrics"] = await _start_http(
                metrics_app(metrics, self.security), metrics_address, "metrics", self.default_host, ssl_context)
            self._runners.append(runner)
        if backend is not None and http_address:
            from cluster.api.app import create_app

            host, _ = parse_address(http_address, self.default_host)
            app = create_app(backend, request_timeout, keys=self.security.keys(),
                             allowed_hosts=allowed_hosts(self.security, host),
                             cors_origins=tuple(o.strip() for o in (self.security.cors_origins or "").split(",")
                                                if o.strip()))
            if http_extras is not None:
                http_extras(app, self.security.keys())
            runner, self.addresses["http"] = await _start_http(app, http_address, "HTTP", self.default_host,
                                                               ssl_context, limits_of(backend))
            self._runners.append(runner)

    async def set_serving(self, serving: bool) -> None:
        for name in self.health_services:
            await self.health.set(name, SERVING if serving else NOT_SERVING)

    async def stop(self, grace: float | None) -> None:
        """Health says NOT_SERVING, HTTP stops, gRPC gives live RPCs `grace` seconds."""
        if self._trimmer is not None:
            self._trimmer.cancel()
            self._trimmer = None
        await self.health.enter_graceful_shutdown()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace)
            self.grpc_server = None
