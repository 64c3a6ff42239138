"""`orchard router serve`: the router process.

gRPC (grpc.aio): `Generation` (proxied to workers, with failover), `Router` (registration
and operations) and gRPC health. HTTP: the OpenAI-compatible API in front of the same
`Generation` service. Metrics: Prometheus on its own port.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.net import check_addresses, parse_address
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.config import RouterConfig
from cluster.router.control import RouterControl
from cluster.router.metrics import RouterMetrics
from cluster.router.policy import make_policy
from cluster.router.proxy import GenerationProxy, ProxyConfig, RouterBackend
from cluster.router.registry import Registry, RegistryConfig

log = logging.getLogger(__name__)

ALL_INTERFACES = "0.0.0.0"  # an address with an empty host binds all interfaces


class RouterServer:
    def __init__(self, config: RouterConfig = RouterConfig()):
        self.config = config
        self.policy = make_policy(config.policy)
        self.registry = Registry(
            RegistryConfig(
                join_token=config.join_token,
                heartbeat_interval=config.heartbeat_interval,
                missed_heartbeats=config.missed_heartbeats,
                remove_after=config.remove_after,
            ),
            on_remove=self.policy.forget,
        )
        self.metrics = RouterMetrics(self.registry)
        self.backend = RouterBackend(self.registry, self.policy, self.metrics, ProxyConfig(config.max_attempts, config.worker_wait))
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._server = None
        self._http = None
        self._metrics_http = None
        self._stop = asyncio.Event()
        self._health_task = None

    async def start(self) -> None:
        """Bind and start everything; on any failure, stop what already started (gRPC
        server, health task, metrics and HTTP endpoints) before raising."""
        try:
            await self._start()
        except BaseException:
            await self.stop(grace=0)
            raise

    async def _start(self) -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_GenerationServicer_to_server(GenerationProxy(self.backend), server)
        pb_grpc.add_RouterServicer_to_server(RouterControl(self.registry), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            self.grpc_port = server.add_insecure_port(self.config.grpc_address)
        except RuntimeError:
            self.grpc_port = 0
        if not self.grpc_port:
            raise OSError(f"cannot listen on {self.config.grpc_address} for gRPC (in use?)")
        await server.start()
        self._server = server
        for address in self.config.static_workers:
            self.registry.add_static(address)
        self._health_task = asyncio.create_task(self.registry.run(self._stop))
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_address:
            self._start_metrics()
        if self.config.http_address:
            await self._start_http()
        log.info(
            "router (%s) on gRPC %s, HTTP %s, metrics %s", self.policy.name, self.grpc_address,
            self.http_address or "off", self.metrics_address or "off",
        )

    def _start_metrics(self) -> None:
        from prometheus_client import start_http_server

        host, port = parse_address(self.config.metrics_address, default_host=ALL_INTERFACES)
        try:
            self._metrics_http, _ = start_http_server(port, addr=host, registry=self.metrics.prometheus)
        except OSError as e:
            raise OSError(f"cannot listen on {self.config.metrics_address} for metrics: {e.strerror}") from None
        self.metrics_port = self._metrics_http.server_port

    async def _start_http(self) -> None:
        from aiohttp import web

        from cluster.openai_api import create_app

        host, port = parse_address(self.config.http_address, default_host=ALL_INTERFACES)
        runner = web.AppRunner(create_app(self.backend), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise OSError(f"cannot listen on {self.config.http_address} for HTTP: {e.strerror}") from None
        self._http = runner
        self.http_port = runner.addresses[0][1]

    def _local(self, port: int | None, configured: str | None) -> str | None:
        if port is None or configured is None:
            return None
        host, _ = parse_address(configured, default_host=ALL_INTERFACES)
        return f"{host}:{port}"

    @property
    def grpc_address(self) -> str:
        return self._local(self.grpc_port, self.config.grpc_address)

    @property
    def http_address(self) -> str | None:
        return self._local(self.http_port, self.config.http_address)

    @property
    def metrics_address(self) -> str | None:
        return self._local(self.metrics_port, self.config.metrics_address)

    async def stop(self, grace: float = 3.0) -> None:
        self._stop.set()
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace)
            self._server = None
        if self._health_task is not None:
            await self._health_task
            self._health_task = None
        await self.registry.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None

    async def wait(self) -> None:
        await self._stop.wait()


async def serve(config: RouterConfig) -> None:
    """Run until SIGINT/SIGTERM."""
    router = RouterServer(config)
    await router.start()  # stops what it started if it fails
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, router._stop.set)
    print(
        f"orchard router: grpc={router.grpc_address} http={router.http_address or 'off'} "
        f"metrics={router.metrics_address or 'off'} policy={router.policy.name}",
        flush=True,
    )
    await router.wait()
    log.info("router stopping")
    await router.stop()


def run(config: RouterConfig) -> int:
    """Entry point of `orchard router serve`: check the addresses, serve until signalled."""
    try:
        check_addresses(config.grpc_address, config.http_address, config.metrics_address, *config.static_workers)
    except ValueError as e:
        print(f"orchard router serve: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except (OSError, ValueError) as e:
        print(f"orchard router serve: {e}", file=sys.stderr)
        return 1
    return 0
