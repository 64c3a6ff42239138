"""`orchard router serve`: wiring of the router process.

`RouterBackend` (placement, relay, failover) is the `Backend` that the API layer serves:
`cluster.api` starts gRPC (`Generation` over it, `Router` for registration and operations,
gRPC health), the OpenAI-compatible HTTP API over the same backend, and Prometheus
/metrics on its own port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cluster.api.servicer import GenerationServicer
from cluster.api.serving import GENERATION_SERVICE, Endpoints, MetricsEndpoint
from cluster.fleet import FleetError
from cluster.fleet.nodes import AgentNodes, NodeRegistry, NodeSide
from cluster.fleet.service import FleetServicer
from cluster.net import check_addresses, parse_address
from cluster.platform import give_back_large_blocks_when_freed
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.config import RouterConfig
from cluster.router.control import RouterControl
from cluster.router.metrics import RouterMetrics
from cluster.router.policy import make_policy
from cluster.router.prompt_blocks import PromptBlocks
from cluster.router.proxy import ProxyConfig, RouterBackend
from cluster.router.registry import Registry, RegistryConfig

log = logging.getLogger(__name__)

ALL_INTERFACES = "0.0.0.0"  # an address with an empty host binds all interfaces


class RouterServer:
    def __init__(self, config: RouterConfig = RouterConfig(), node_side: NodeSide | None = None):
        """`node_side`: where the fleet's controller starts workers (default: the node
        agents that register here; `orchard ray up --catalog`: Ray's nodes)."""
        self.config = config
        self.registry = Registry(
            RegistryConfig(
                join_token=config.join_token,
                heartbeat_interval=config.heartbeat_interval,
                missed_heartbeats=config.missed_heartbeats,
                remove_after=config.remove_after,
                circuit_threshold=config.circuit_threshold,
                circuit_cooldown=config.circuit_cooldown,
                stream_idle_timeout=config.stream_idle_timeout,
            ),
            on_remove=lambda worker_id: self.policy.forget(worker_id),
            security=config.security.client(),
            bind_identities=config.security.mutual,
        )
        self.policy = make_policy(config.policy, kv_map=self.registry.kv_map,
                                  prefill_tps=config.kv.kv_prefill_tps, read_tps=config.kv.kv_read_tps)
        # the fleet's node agents (cluster/fleet): the controller places models through `agent_nodes`
        self.nodes = NodeRegistry(self.registry.config, bind_identities=config.security.mutual)
        self.agent_nodes = AgentNodes(self.nodes, config.security.client(), config.join_token)
        self.node_side = node_side or self.agent_nodes
        self.metrics = RouterMetrics(self.registry)
        self.prompt_blocks = PromptBlocks(config.kv, self.metrics)  # for kv_aware (lazy: no thread until used)
        self.controller = self._controller(config)
        self.fleet = FleetServicer(self.nodes, None if self.controller is None else self.controller.rpcs(),
                                   self.node_side)
        self.backend = RouterBackend(self.registry, self.policy, self.metrics, ProxyConfig(
            config.max_attempts, config.worker_wait, config.stream_idle_timeout, config.resume_wait,
            config.max_held, config.limits), fleet=self.controller, prompt_blocks=self.prompt_blocks)
        self.endpoints = Endpoints(default_host=ALL_INTERFACES, health_services=("", GENERATION_SERVICE),
                                   security=config.security)
        self._stop = asyncio.Event()
        self._health_task = None
        self._serving_task = None
        self._nodes_task = None
        self._fleet_task = None

    def _controller(self, config: RouterConfig):
        """The fleet's FleetController over the catalog file (--catalog), or None: no fleet."""
        if not config.fleet.enabled:
            return None
        from cluster.fleet.catalog import Catalog
        from cluster.fleet.controller import FleetController
        from cluster.fleet.metrics import FleetMetrics

        return FleetController(Catalog(config.fleet.catalog), self.node_side, self.registry,
                               FleetMetrics(self.metrics.prometheus), config.fleet,
                               router_id=f"{socket.gethostname()}-{os.getpid()}")

    async def start(self) -> None:
        """Bind and start everything; on any failure, stop what already started (gRPC
        server, health task, metrics and HTTP endpoints) before raising."""
        try:
            await self._start()
        except BaseException:
            await self.stop(grace=0)
            raise

    async def _start(self) -> None:
        control = RouterControl(self.registry, fleet=self.controller)

        def add_services(server) -> None:
            pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self.backend), server)
            pb_grpc.add_RouterServicer_to_server(control, server)
            pb_grpc.add_FleetServicer_to_server(self.fleet, server)

        registry = self.metrics.prometheus
        self.endpoints.bind_grpc(self.config.grpc_address)
        await self.endpoints.start(
            add_services, backend=self.backend, http_address=self.config.http_address,
            metrics=MetricsEndpoint(lambda: generate_latest(registry), CONTENT_TYPE_LATEST,
                                    healthy=lambda: self.registry.can_serve),
            metrics_address=self.config.metrics_address, request_timeout=self.config.request_timeout,
            serving=False,  # until a worker can take a request (_follow_serving)
            http_extras=None if self.config.console == "off" else lambda app, keys: self._console(app, keys, control),
        )
        for address in self.config.static_workers:
            self.registry.add_static(address)
        self._health_task = asyncio.create_task(self.registry.run(self._stop))
        self._nodes_task = asyncio.create_task(self.nodes.run(self._stop))
        if self.controller is not None:
            # one id per router of a fleet: its claims on loads are its own (the host and its bound port)
            self.controller.router_id = f"{socket.gethostname()}:{self.grpc_port}"
            self._fleet_task = asyncio.create_task(self.controller.run(self._stop))
        self._serving_task = asyncio.create_task(self._follow_serving())
        log.info(
            "router (%s) on gRPC %s, HTTP %s, metrics %s", self.policy.name, self.grpc_address,
            self.http_address or "off", self.metrics_address or "off",
        )

    def _console(self, app, keys, control: RouterControl) -> None:
        """The web console on the HTTP app (cluster/console): the state this router holds."""
        from cluster.console.actions import RouterActions
        from cluster.console.routes import add_routes
        from cluster.console.state import RouterState

        state = RouterState(self.registry, self.backend.recent, self._about, self.nodes, self.controller)
        add_routes(app, state, keys, RouterActions(control, self.controller))

    def _about(self) -> dict:
        return {"id": f"{socket.gethostname()}:{self.grpc_port}", "grpc": self.grpc_address or "",
                "http": self.http_address or "", "policy": self.policy.name, "fleet": self.controller is not None}

    async def _follow_serving(self) -> None:
        """gRPC health says SERVING while some worker can take a request, NOT_SERVING
        while none can (none registered, all unhealthy or draining). With kv_aware, a
        model's tokenizer starts loading as its first worker joins."""
        serving = None
        while not self._stop.is_set():
            if self.backend.prompt_blocks is not None:
                self.backend.prompt_blocks.prepare(self.registry.snapshot())
            now = self.registry.can_serve
            if now != serving:
                await self.endpoints.set_serving(now)
                serving = now
            await self.registry.wait_changed(0.25)

    @property
    def grpc_port(self) -> int | None:
        address = self.grpc_address
        return None if address is None else parse_address(address)[1]

    @property
    def grpc_address(self) -> str | None:
        return self.endpoints.addresses.get("grpc")

    @property
    def http_address(self) -> str | None:
        return self.endpoints.addresses.get("http")

    @property
    def metrics_address(self) -> str | None:
        return self.endpoints.addresses.get("metrics")

    async def stop(self, grace: float = 3.0) -> None:
        self._stop.set()
        if self._serving_task is not None:
            await self._serving_task
            self._serving_task = None
        await self.endpoints.stop(grace)
        if self._health_task is not None:
            await self._health_task
            self._health_task = None
        if self._nodes_task is not None:
            await self._nodes_task
            self._nodes_task = None
        if self._fleet_task is not None:
            await self._fleet_task
            self._fleet_task = None
        await self.agent_nodes.close()
        if self.controller is not None:
            self.controller.catalog.close()
        await self.registry.close()
        await self.prompt_blocks.close()

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
        config.security.check()
        config.fleet.check()
        config.kv.check()
    except ValueError as e:
        print(f"orchard router serve: {e}", file=sys.stderr)
        return 2
    give_back_large_blocks_when_freed()  # a router relays messages of up to 64 MiB: none may stay
    try:
        asyncio.run(serve(config))
    except (OSError, ValueError, FleetError) as e:
        print(f"orchard router serve: {e}", file=sys.stderr)
        return 1
    return 0
