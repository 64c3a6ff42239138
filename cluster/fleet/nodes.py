"""The router's view of its node agents, and the node side the fleet controller drives.

`NodeRegistry` keeps each agent's latest `NodeReport`: an agent registers (`RegisterNode`,
with the join token) and sends its report every heartbeat interval; one silent for
`missed_heartbeats` intervals is unhealthy (listed, never placed on) until it reports
again. A node silent for good stays listed as unhealthy: a Mac asleep comes back under
the same id. Under mutual TLS a node id belongs to the certificate that first registered
it, as a worker id does (`router/registry.py`).

`NodeSide` is what the controller calls to place models; `AgentNodes` implements it over
gRPC stubs to each agent's `Node` service, presenting the join token as
`authorization: Bearer TOKEN` and the router's TLS client credentials. Ray's nodes are the
other implementation (`fleet/ray_nodes.py`).

All of it runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from cluster.config import human_bytes
from cluster.fleet import FleetError
from cluster.net import CHANNEL_OPTIONS
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.registry import RegistryConfig
from cluster.security import NO_SECURITY, ClientSecurity, channel

log = logging.getLogger(__name__)

HEALTHY, UNHEALTHY = "healthy", "unhealthy"
RPC_TIMEOUT_S = 30.0  # an agent's answer to ReservePorts / StartWorker (it spawns, it does not wait for the load)
STOP_GRACE_S = 30.0  # StopWorker's answer, past its drain: the agent's SIGTERM, then SIGKILL after a grace


class NodeSide(Protocol):
    """Where the fleet controller starts and stops workers: node agents over gRPC
    (`AgentNodes`) or Ray nodes. Every failure is a `FleetError` whose code is the gRPC
    status a caller should see (NOT_FOUND: no such node or model on it; RESOURCE_EXHAUSTED:
    it does not fit, with the numbers; UNAVAILABLE: the node cannot be reached)."""

    def nodes(self) -> list[pb.NodeInfo]:
        """The latest report of every node, healthy or not."""

    async def reserve_ports(self, node_id: str, count: int) -> list[int]:
        """Free ports on the node, held for the caller (a group's ring and side channel)."""

    async def start(self, node_id: str, spec: pb.WorkerSpec) -> pb.ManagedWorker:
        """Start a worker or group member; returns once it is started, not loaded."""

    async def stop(self, node_id: str, worker_id: str, drain_timeout: float) -> pb.ManagedWorker:
        """Drain the worker (its requests in flight finish, up to `drain_timeout`), then stop it."""

    async def wait_changed(self, timeout: float) -> bool:
        """Wait until a node reports or changes state, at most `timeout` seconds."""

    async def fetch(self, node_id: str, request: pb.FetchModelRequest,
                    progress: Callable[[pb.FetchProgress], None]) -> pb.FetchProgress:
        """Bring the model's files onto the node: copied from `request.peers` in order, else
        pulled from the hub (hf: sources); `progress` is told as bytes arrive. Returns the
        last message (`done`, the path on the node, the fetched models deleted for room).
        NOT_FOUND: no peer and no hub has it; RESOURCE_EXHAUSTED: no room under the node's
        disk budget, with the numbers. No deadline of its own: the caller bounds it."""

    async def describe(self, node_id: str, source: str) -> pb.DiskModel:
        """The facts of `source` as the node would hold it, from its files there or (hf:)
        from the hub's metadata without fetching it."""


@dataclass(eq=False)
class NodeRecord:
    report: pb.NodeReport
    last_seen: float
    identity: str | None = None  # the certificate name it registered with (mutual TLS)
    healthy: bool = True

    @property
    def node_id(self) -> str:
        return self.report.node_id

    def info(self, now: float) -> pb.NodeInfo:
        return pb.NodeInfo(report=self.report, state=HEALTHY if self.healthy else UNHEALTHY,
                           age_seconds=max(0.0, now - self.last_seen))


class NodeRegistry:
    """The node agents that registered with this router, and their latest reports."""

    def __init__(self, config: RegistryConfig = RegistryConfig(), bind_identities: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config  # the router's join token, heartbeat interval and missed beats
        self.bind_identities = bind_identities
        self.clock = clock
        self.records: dict[str, NodeRecord] = {}
        self._changed = asyncio.Event()  # set, and replaced, at each change (`wait_changed`)

    # -- lookups ------------------------------------------------------------------------------
    def get(self, node_id: str) -> NodeRecord | None:
        return self.records.get(node_id)

    def nodes(self) -> list[pb.NodeInfo]:
        """Every node's latest report, healthy or not, by node id."""
        now = self.clock()
        return [self.records[k].info(now) for k in sorted(self.records)]

    async def wait_changed(self, timeout: float) -> bool:
        """Wait until a node reports, joins or changes state, at most `timeout` seconds."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- registration -------------------------------------------------------------------------
    def _check(self, token: str, node_id: str, identity: str | None) -> None:
        expected = self.config.join_token
        if expected and not hmac.compare_digest(token.encode(), expected.encode()):
            raise FleetError(grpc.StatusCode.PERMISSION_DENIED, "wrong join token")
        if not self.bind_identities:
            return
        if not identity:
            raise FleetError(grpc.StatusCode.UNAUTHENTICATED, "a node must register with a client certificate of "
                                                              "the fleet CA")
        known = self.records.get(node_id)
        if known is not None and known.identity is not None and known.identity != identity:
            log.warning("refused node id %s from certificate %r: it belongs to %r", node_id, identity,
                        known.identity)
            raise FleetError(grpc.StatusCode.PERMISSION_DENIED,
                             f"node id {node_id!r} belongs to another certificate than {identity!r}")

    def register(self, token: str, report: pb.NodeReport, identity: str | None = None) -> NodeRecord:
        """A node agent joins (or joins again: the router or the agent restarted)."""
        for name in ("node_id", "address"):
            if not getattr(report, name):
                raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"a node must register with its report's {name}")
        self._check(token, report.node_id, identity)
        record = self.records.get(report.node_id)
        if record is None:
            record = self.records[report.node_id] = NodeRecord(report, self.clock(), identity)
            log.info("node %s at %s joined (%s, budget %.1f GiB, %d models on disk)", report.node_id, report.address,
                     report.platform or "?", report.memory_budget_bytes / 2**30, len(report.models))
        elif record.report.instance_id != report.instance_id:
            self._check_not_held(record, report)
            log.info("node %s at %s registered again (its agent restarted)", report.node_id, report.address)
        record.identity = record.identity or identity
        self._record(record, report)
        return record

    def _check_not_held(self, record: NodeRecord, report: pb.NodeReport) -> None:
        """Another agent (another start, `instance_id`) under a node id whose agent still
        reports is a second Mac with the same id (by default the host name): taking the id
        over would flip it between the two at each heartbeat. An agent that restarted finds
        its earlier self silent within `unhealthy_after` (it retries until then)."""
        age = self.clock() - record.last_seen
        if (record.report.instance_id and report.instance_id and record.healthy
                and age <= self.config.unhealthy_after):
            log.warning("refused node id %s from %s: the agent at %s still reports under it", report.node_id,
                        report.address, record.report.address)
            raise FleetError(grpc.StatusCode.ALREADY_EXISTS,
                             f"node id {report.node_id!r} is held by another agent that still reports (at "
                             f"{record.report.address}, {age:.1f} s ago): give each Mac its own --node-id")

    def heartbeat(self, token: str, report: pb.NodeReport, identity: str | None = None) -> bool:
        """A node's periodic report; False: not known here (it should register again)."""
        self._check(token, report.node_id, identity)
        record = self.records.get(report.node_id)
        if record is None or (report.instance_id and record.report.instance_id != report.instance_id):
            return False
        self._record(record, report)
        return True

    def _record(self, record: NodeRecord, report: pb.NodeReport) -> None:
        record.report = report
        record.last_seen = self.clock()
        if not record.healthy:
            log.info("node %s reports again: healthy", record.node_id)
        record.healthy = True
        self._notify()

    # -- health -------------------------------------------------------------------------------
    def sweep(self, now: float | None = None, stalled: float = 0.0) -> None:
        """Mark nodes silent for `missed_heartbeats` intervals unhealthy. `stalled`: how late
        this process runs (its event loop's delay), not counted as the nodes' silence."""
        now = self.clock() if now is None else now
        for record in self.records.values():
            if record.healthy and now - record.last_seen - stalled > self.config.unhealthy_after:
                log.warning("node %s missed %d heartbeats: unhealthy", record.node_id, self.config.missed_heartbeats)
                record.healthy = False
                self._notify()

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every heartbeat interval until `stop` is set."""
        interval = self.config.heartbeat_interval
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not stop.is_set():
            self.sweep(stalled=max(0.0, loop.time() - due))
            due = loop.time() + interval
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass


@dataclass(eq=False)
class _Agent:
    address: str
    channel: object
    stub: pb_grpc.NodeStub


class AgentNodes:
    """`NodeSide` over the node agents in `registry`: gRPC calls to each agent's `Node`
    service with the join token and the router's TLS client credentials (`security`'s
    key is replaced by the join token)."""

    def __init__(self, registry: NodeRegistry, security: ClientSecurity = NO_SECURITY, join_token: str = "",
                 rpc_timeout: float = RPC_TIMEOUT_S):
        self.registry = registry
        self.security = dataclasses.replace(security, api_key=join_token)
        self.rpc_timeout = rpc_timeout
        self._agents: dict[str, _Agent] = {}
        self._closing: set[asyncio.Future] = set()

    def nodes(self) -> list[pb.NodeInfo]:
        return self.registry.nodes()

    async def wait_changed(self, timeout: float) -> bool:
        return await self.registry.wait_changed(timeout)

    def _stub(self, node_id: str, healthy: bool) -> pb_grpc.NodeStub:
        """The node's stub; with `healthy`, only while it reports (nothing new is placed on
        a node that missed its heartbeats; a stop is still tried)."""
        record = self.registry.get(node_id)
        if record is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"no node {node_id!r} registered")
        if healthy and not record.healthy:
            raise FleetError(grpc.StatusCode.UNAVAILABLE, f"node {node_id} is unhealthy (missed heartbeats)")
        agent = self._agents.get(node_id)
        if agent is None or agent.address != record.report.address:
            if agent is not None:  # the agent moved: a channel to its new address
                closing = asyncio.ensure_future(agent.channel.close(grace=None))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            ch = channel(record.report.address, self.security, options=CHANNEL_OPTIONS)
            agent = self._agents[node_id] = _Agent(record.report.address, ch, pb_grpc.NodeStub(ch))
        return agent.stub

    async def _call(self, node_id: str, method: str, request, timeout: float, healthy: bool = True):
        stub = self._stub(node_id, healthy)
        try:
            return await getattr(stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _fleet_error(node_id, e) from None

    async def reserve_ports(self, node_id: str, count: int) -> list[int]:
        reply = await self._call(node_id, "ReservePorts", pb.ReservePortsRequest(count=count), self.rpc_timeout)
        return list(reply.ports)

    async def start(self, node_id: str, spec: pb.WorkerSpec) -> pb.ManagedWorker:
        return await self._call(node_id, "StartWorker", pb.StartWorkerRequest(spec=spec), self.rpc_timeout)

    async def stop(self, node_id: str, worker_id: str, drain_timeout: float) -> pb.ManagedWorker:
        request = pb.StopWorkerRequest(worker_id=worker_id, drain_timeout_seconds=drain_timeout)
        return await self._call(node_id, "StopWorker", request, drain_timeout + STOP_GRACE_S, healthy=False)

    async def fetch(self, node_id: str, request: pb.FetchModelRequest,
                    progress: Callable[[pb.FetchProgress], None]) -> pb.FetchProgress:
        stub = self._stub(node_id, healthy=True)
        last = None
        try:
            async for message in stub.FetchModel(request):
                last = message
                if not message.done:
                    progress(message)
        except grpc.aio.AioRpcError as e:
            raise _fleet_error(node_id, e) from None
        if last is None or not last.done:
            raise FleetError(grpc.StatusCode.UNAVAILABLE, f"node {node_id}: the fetch of {request.source} ended "
                                                          "without its last message")
        return last

    async def describe(self, node_id: str, source: str) -> pb.DiskModel:
        return await self._call(node_id, "DescribeModel", pb.DescribeModelRequest(source=source), self.rpc_timeout)

    async def report(self, node_id: str) -> pb.NodeReport:
        """The node's report now (not its last heartbeat's)."""
        return await self._call(node_id, "GetNodeReport", pb.GetNodeReportRequest(), self.rpc_timeout,
                                healthy=False)

    async def close(self) -> None:
        agents, self._agents = list(self._agents.values()), {}
        for agent in agents:
            await agent.channel.close(grace=None)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _fleet_error(node_id: str, error: grpc.aio.AioRpcError) -> FleetError:
    code = error.code()
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        code = grpc.StatusCode.UNAVAILABLE
    return FleetError(code, f"node {node_id}: {error.details() or code.name}")


# -- `orchard nodes list` ----------------------------------------------------------------------
def format_nodes(nodes: list[pb.NodeInfo]) -> str:
    """One row per node: its state, platform, memory (budget, reserved for its workers,
    free of the budget), free disk and how many models it holds and runs; beneath it the
    models on its disk, what its fetched models take, the fetches under way and each worker
    it runs."""
    header = ("NODE", "STATE", "PLATFORM", "BUDGET", "RESERVED", "FREE", "DISK FREE", "MODELS", "WORKERS")
    rows = [header]
    for n in nodes:
        r = n.report
        state = n.state if n.state == HEALTHY else f"{n.state} ({n.age_seconds:.0f} s silent)"
        rows.append((r.node_id, state, r.platform or "-", human_bytes(r.memory_budget_bytes),
                     human_bytes(r.memory_reserved_bytes),
                     human_bytes(max(0, r.memory_budget_bytes - r.memory_reserved_bytes)),
                     human_bytes(r.disk_free_bytes), str(len(r.models)), str(len(r.workers))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {3, 4, 5, 6, 7, 8}
    lines = ["  ".join(c.rjust(wd) if i in right else c.ljust(wd) for i, (c, wd) in enumerate(zip(row, widths)))
             .rstrip() for row in rows]
    out = [lines[0]]
    for line, n in zip(lines[1:], nodes):
        out.append(line)
        r = n.report
        if r.models:
            out.append("  on disk: " + ", ".join(
                f"{m.name} ({human_bytes(m.weight_bytes)})" if not m.error else f"{m.name} (unreadable: {m.error})"
                for m in r.models))
        if r.disk_budget_bytes or r.disk_used_bytes:
            budget = f" of its --disk-budget {human_bytes(r.disk_budget_bytes)}" if r.disk_budget_bytes else ""
            out.append(f"  fetched models: {human_bytes(r.disk_used_bytes)}{budget}")
        for t in r.transfers:
            share = f" {100 * t.bytes_done // t.bytes_total}%" if t.bytes_total else ""
            origin = getattr(t, "from")
            out.append(f"  {'pulling' if origin == 'hub' else 'copying'} {t.source} from {origin}{share} "
                       f"({human_bytes(t.bytes_done)} in {t.seconds:.0f} s)")
        for w in r.workers:
            group = f", rank {w.group_rank} of {w.group_size}" if w.group_size > 1 else ""
            ended = f", exit {w.exit_code}: {w.reason}" if w.state == "exited" else ""
            out.append(f"  worker {w.worker_id}: {w.model} {w.state}{group}, reserved "
                       f"{human_bytes(w.reserved_bytes)}{' at ' + w.address if w.address else ''}{ended}")
    return "\n".join(out)


def list_nodes(router: str, security: ClientSecurity = NO_SECURITY, timeout: float = 10.0) -> list[pb.NodeInfo]:
    with channel(router, security, aio=False) as ch:
        return list(pb_grpc.FleetStub(ch).ListNodes(pb.ListNodesRequest(), timeout=timeout).nodes)


def run_list(args) -> int:
    """`orchard nodes list`."""
    import sys

    from cluster.security import client_from_args

    try:
        nodes = list_nodes(args.router, client_from_args(args, admin=True))
    except grpc.RpcError as e:
        print(f"orchard nodes list: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(format_nodes(nodes) if nodes else "no nodes")
    return 0
