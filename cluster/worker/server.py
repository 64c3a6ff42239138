"""`orchard worker serve`: the engine behind gRPC, Prometheus and (optionally) OpenAI HTTP.

One asyncio event loop runs the grpc.aio server (Generation, WorkerAdmin, grpc.health.v1),
the metrics endpoint and the OpenAI-compatible API; one engine thread (`EngineLoop`)
owns the engine. `WorkerService` sits between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from dataclasses import replace
from typing import AsyncIterator

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.net import check_addresses, parse_address
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.sdk.errors import OrchardError
from cluster.worker.config import WorkerOptions

log = logging.getLogger(__name__)

GENERATION_SERVICE = "orchard.v1.Generation"
READY_PREFIX = "ORCHARD_WORKER_READY "  # + JSON of the bound addresses, printed on stdout
GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second worker on the same port must fail, not share it
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


class GenerationServicer(pb_grpc.GenerationServicer):
    """`Generation` over any backend with `generate(request)` and `list_models()` (the
    worker's service here; the router can put its own behind the same servicer)."""

    def __init__(self, backend):
        self.backend = backend

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        try:
            # closed here when the RPC ends or is cancelled: the engine abort is immediate
            async with contextlib.aclosing(self.backend.generate(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except OrchardError as e:
            await context.abort(e.code, e.message)

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        try:
            return await self.backend.list_models()
        except OrchardError as e:
            await context.abort(e.code, e.message)


class WorkerAdminServicer(pb_grpc.WorkerAdminServicer):
    def __init__(self, service, health_servicer):
        self.service = service
        self.health = health_servicer

    async def GetLoad(self, request, context) -> pb.LoadReport:
        return self.service.load_report()

    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        response = self.service.set_draining(request.drain)
        status = health_pb2.HealthCheckResponse.NOT_SERVING if request.drain else health_pb2.HealthCheckResponse.SERVING
        await self.health.set(GENERATION_SERVICE, status)
        return response


def _bind(address: str) -> socket.socket:
    host, port = parse_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {address}: {e.strerror}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def _start_http(app: web.Application, address: str) -> tuple[web.AppRunner, str]:
    sock = _bind(address)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    return runner, f"{host}:{port}"


class WorkerServer:
    """Start with `await start()`, stop with `await stop()`; `addresses` has what was bound."""

    def __init__(self, options: WorkerOptions):
        self.options = options
        self.service = None
        self.engine_loop = None
        self.addresses: dict[str, str] = {}
        self._grpc: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self._registration = None
        self.health = health.aio.HealthServicer()

    async def start(self) -> "WorkerServer":
        """Load the engine and bind everything; on any failure, stop what already started
        (engine thread, gRPC server, HTTP sites) before raising."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        from cluster.worker.engine import Engine
        from cluster.worker.metrics import WorkerMetrics
        from cluster.worker.service import WorkerService
        from cluster.worker.service_loop import EngineLoop

        opts = self.options
        loop = asyncio.get_running_loop()

        def load_engine() -> Engine:
            engine = Engine.from_pretrained(opts.model_path, opts.engine_config)
            log.info("engine warmed up in %.2f s", engine.warm_up())
            return engine

        self.engine_loop = EngineLoop(
            load_engine,
            lambda now, events: self.service.on_engine_events(now, events),
        )
        await loop.run_in_executor(None, self.engine_loop.start)

        server = grpc.aio.server(options=GRPC_OPTIONS)
        host, _ = parse_address(opts.grpc_address)
        port = server.add_insecure_port(opts.grpc_address)
        if port == 0:
            raise OSError(f"cannot listen on {opts.grpc_address} for gRPC (in use?)")
        self.addresses["grpc"] = f"{host}:{port}"
        worker_id = opts.worker_id or f"{socket.gethostname()}-{port}"
        engine = self.engine_loop.engine
        metrics = WorkerMetrics(engine.model_name, worker_id, lambda: engine.stats)
        self.service = WorkerService(self.engine_loop, worker_id, metrics)
        self.service.attach(loop)

        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self.service), server)
        pb_grpc.add_WorkerAdminServicer_to_server(WorkerAdminServicer(self.service, self.health), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await server.start()
        self._grpc = server
        for name in ("", GENERATION_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

        if opts.metrics_address:
            runner, addr = await _start_http(self._metrics_app(), opts.metrics_address)
            self._runners.append(runner)
            self.addresses["metrics"] = addr
        if opts.http_address:
            from cluster.openai_api import create_app

            runner, addr = await _start_http(create_app(self.service), opts.http_address)
            self._runners.append(runner)
            self.addresses["http"] = addr
        if opts.router:
            from cluster.worker.registration import Registration

            advertise = opts.advertise_address or self.addresses["grpc"]
            if advertise.rpartition(":")[0] in ("0.0.0.0", "::", ""):  # bound to all: name this machine
                advertise = f"{socket.getfqdn()}:{parse_address(advertise)[1]}"
            self._registration = Registration(opts.router, advertise, self.service.load_report,
                                              join_token=opts.join_token, worker_id=worker_id,
                                              interval=opts.heartbeat_interval)
            self._registration.start()
        log.info("worker %s serving %s (%s): %s", worker_id, engine.model_name, opts.model_path,
                 ", ".join(f"{k} {v}" for k, v in self.addresses.items()))

    def ready_info(self) -> dict:
        """The bound addresses and what was loaded (for scripts that start workers)."""
        from cluster import platform

        engine = self.engine_loop.engine
        return {**self.addresses, "worker_id": self.service.worker_id, "model": engine.model_name,
                "dtypes": [str(engine.runner.dtype).removeprefix("mlx.core.")], "blas": platform.blas_path()}

    def _metrics_app(self) -> web.Application:
        metrics = self.service.metrics

        async def handle_metrics(request: web.Request) -> web.Response:
            body = metrics.render()
            return web.Response(body=body, headers={"Content-Type": metrics.content_type})

        async def handle_health(request: web.Request) -> web.Response:
            ok = self.engine_loop is not None and self.engine_loop.alive
            return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

        app = web.Application()
        app.router.add_get("/metrics", handle_metrics)
        app.router.add_get("/health", handle_health)
        return app

    async def stop(self) -> None:
        """Stop taking requests, give running streams `grace_seconds`, stop the engine."""
        if self.service is not None:
            self.service.draining = True
        if self._registration is not None:
            await self._registration.stop()
            self._registration = None
        await self.health.enter_graceful_shutdown()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self._grpc is not None:
            await self._grpc.stop(self.options.grace_seconds)
            self._grpc = None
        if self.engine_loop is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop)
        if self.service is not None:
            self.service.close()


async def run_until_signalled(options: WorkerOptions, ready_line: bool = True) -> None:
    server = WorkerServer(options)
    await server.start()
    if ready_line:
        print(READY_PREFIX + json.dumps(server.ready_info()), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    try:
        await stop.wait()
    finally:
        log.info("worker stopping")
        await server.stop()


def serve(options: WorkerOptions) -> int:
    """Entry point of `orchard worker serve` (no model path: the built-in small model)."""
    from cluster.models_cache import resolve_model

    try:
        check_addresses(options.grpc_address, options.metrics_address, options.http_address, options.router,
                        options.advertise_address)
    except ValueError as e:
        print(f"orchard worker serve: {e}", file=sys.stderr)
        return 2
    options = replace(options, model_path=str(resolve_model(options.model_path)))
    code = 0
    try:
        asyncio.run(run_until_signalled(options))
    except OSError as e:
        print(f"orchard worker serve: {e}", file=sys.stderr)
        code = 1
    # Everything the worker started is stopped and joined. Skip interpreter teardown: MLX
    # keeps per-thread C++ state (compile caches) whose destructors take the GIL, and where
    # we cannot wait for the engine's OS thread to be gone (no /proc) they can race
    # Py_Finalize and abort an orderly shutdown.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
