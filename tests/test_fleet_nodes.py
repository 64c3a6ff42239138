"""The router's view of node agents (cluster/fleet/nodes.py, fleet/service.py): an agent
registers with the join token and shows in ListNodes; a silent one turns unhealthy; the
admin key guards ListNodes; the catalog RPCs say how to get a catalog; `AgentNodes` calls
an agent's Node service with the join token as its bearer key and turns its errors into
FleetErrors."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.fleet import FleetError
from cluster.fleet.nodes import AgentNodes, NodeRegistry
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.config import RouterConfig
from cluster.router.registry import RegistryConfig
from cluster.router.server import RouterServer
from cluster.security import ClientSecurity, SecurityConfig, channel
from conftest import run

TOKEN = "join-s3cret"


def report(node_id: str = "mac-1", address: str = "127.0.0.1:1", instance: str = "a", **kw) -> pb.NodeReport:
    return pb.NodeReport(node_id=node_id, address=address, instance_id=instance, platform="cpu",
                         memory_budget_bytes=8 << 30, **kw)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_registry_joins_beats_and_turns_unhealthy_when_silent():
    async def go():
        clock = Clock()
        nodes = NodeRegistry(RegistryConfig(join_token=TOKEN, heartbeat_interval=1.0, missed_heartbeats=3),
                             clock=clock)
        with pytest.raises(FleetError) as e:
            nodes.register("wrong", report())
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and nodes.nodes() == []
        with pytest.raises(FleetError) as e:
            nodes.register(TOKEN, report(address=""))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "address" in e.value.message
        nodes.register(TOKEN, report(models=[pb.DiskModel(name="m", weight_bytes=5)]))
        [info] = nodes.nodes()
        assert info.state == "healthy" and info.report.models[0].name == "m"
        assert not nodes.heartbeat(TOKEN, report(node_id="mac-9"))  # unknown: register again
        assert not nodes.heartbeat(TOKEN, report(instance="b"))  # the agent restarted: register again
        clock.now += 2.5
        nodes.sweep()
        assert nodes.nodes()[0].state == "healthy"
        clock.now += 1.0  # 3.5 s silent > 3 beats of 1 s
        nodes.sweep()
        [info] = nodes.nodes()
        assert info.state == "unhealthy" and info.age_seconds == pytest.approx(3.5)
        assert nodes.heartbeat(TOKEN, report())
        assert nodes.nodes()[0].state == "healthy"

    run(go())


def test_a_second_agent_under_a_node_id_that_still_reports_is_refused():
    async def go():
        clock = Clock()
        nodes = NodeRegistry(RegistryConfig(join_token=TOKEN, heartbeat_interval=1.0, missed_heartbeats=3),
                             clock=clock)
        nodes.register(TOKEN, report(address="mac-a:50071", instance="a"))
        clock.now += 2.0
        assert nodes.heartbeat(TOKEN, report(address="mac-a:50071", instance="a"))
        with pytest.raises(FleetError) as e:  # two Macs both named mac-1
            nodes.register(TOKEN, report(address="mac-b:50071", instance="b"))
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert "'mac-1'" in e.value.message and "mac-a:50071" in e.value.message and "--node-id" in e.value.message
        [info] = nodes.nodes()
        assert info.report.address == "mac-a:50071"  # the first keeps it
        assert nodes.heartbeat(TOKEN, report(address="mac-a:50071", instance="a"))
        clock.now += 3.5  # the first went silent (it crashed, a restart follows): its id is free
        restarted = nodes.register(TOKEN, report(address="mac-a:50071", instance="c"))
        assert restarted.report.instance_id == "c"
        assert not nodes.heartbeat(TOKEN, report(address="mac-a:50071", instance="a"))

    run(go())


def test_node_ids_bind_to_their_certificate_under_mutual_tls():
    nodes = NodeRegistry(RegistryConfig(), bind_identities=True)
    with pytest.raises(FleetError) as e:
        nodes.register("", report())
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    nodes.register("", report(), identity="mac-1")
    with pytest.raises(FleetError) as e:
        nodes.register("", report(), identity="mac-2")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "another certificate" in e.value.message


async def _router(**kw) -> RouterServer:
    router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                       join_token=TOKEN, heartbeat_interval=0.2, **kw))
    await router.start()
    return router


def test_router_serves_the_fleet_service():
    async def go():
        router = await _router(security=SecurityConfig(admin_key="adm1n"))
        try:
            async with channel(router.grpc_address, ClientSecurity(api_key="adm1n")) as admin, \
                    channel(router.grpc_address) as anon:
                fleet, open_fleet = pb_grpc.FleetStub(admin), pb_grpc.FleetStub(anon)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await open_fleet.RegisterNode(pb.RegisterNodeRequest(join_token="nope", report=report()))
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                reply = await open_fleet.RegisterNode(pb.RegisterNodeRequest(join_token=TOKEN, report=report()))
                assert reply.node_id == "mac-1" and reply.heartbeat_interval_ms == 200
                beat = await open_fleet.NodeHeartbeat(pb.NodeHeartbeatRequest(join_token=TOKEN, report=report()))
                assert beat.known
                with pytest.raises(grpc.aio.AioRpcError) as e:  # an admin RPC
                    await open_fleet.ListNodes(pb.ListNodesRequest())
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                [node] = (await fleet.ListNodes(pb.ListNodesRequest())).nodes
                assert node.report.node_id == "mac-1" and node.state == "healthy"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await fleet.ListCatalog(pb.ListCatalogRequest())
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--catalog" in e.value.details()
                deadline = asyncio.get_running_loop().time() + 30
                while (await fleet.ListNodes(pb.ListNodesRequest())).nodes[0].state != "unhealthy":
                    assert asyncio.get_running_loop().time() < deadline, "a silent node stayed healthy"
                    await router.nodes.wait_changed(0.5)
        finally:
            await router.stop(grace=0)

    run(go())


class FakeAgent(pb_grpc.NodeServicer):
    """A Node service that records the authorization it was called with."""

    def __init__(self):
        self.seen: list[str] = []

    async def ReservePorts(self, request, context):
        self.seen.append(dict(context.invocation_metadata()).get("authorization", ""))
        return pb.ReservePortsResponse(ports=list(range(5000, 5000 + request.count)))

    async def StartWorker(self, request, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "needs 9.0 GiB, node has 1.0 of 8.0 GiB free")

    async def StopWorker(self, request, context):
        return pb.ManagedWorker(worker_id=request.worker_id, state="exited")


def test_agent_nodes_call_the_agent_with_the_join_token():
    async def go():
        server = grpc.aio.server()
        agent = FakeAgent()
        pb_grpc.add_NodeServicer_to_server(agent, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        nodes = NodeRegistry(RegistryConfig(join_token=TOKEN))
        side = AgentNodes(nodes, ClientSecurity(api_key="the-admin-key"), TOKEN)
        try:
            with pytest.raises(FleetError) as e:
                await side.reserve_ports("mac-1", 2)
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            nodes.register(TOKEN, report(address=f"127.0.0.1:{port}"))
            assert await side.reserve_ports("mac-1", 2) == [5000, 5001]
            assert agent.seen == [f"Bearer {TOKEN}"]
            with pytest.raises(FleetError) as e:
                await side.start("mac-1", pb.WorkerSpec(worker_id="w", model="m"))
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "mac-1" in e.value.message
            assert "needs 9.0 GiB" in e.value.message
            stopped = await side.stop("mac-1", "w", drain_timeout=1.0)
            assert stopped.state == "exited"
            nodes.sweep(now=nodes.clock() + 60)  # silent: nothing new goes there, a stop is still tried
            with pytest.raises(FleetError) as e:
                await side.reserve_ports("mac-1", 1)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "unhealthy" in e.value.message
            assert (await side.stop("mac-1", "w", drain_timeout=1.0)).state == "exited"
        finally:
            await side.close()
            await server.stop(0)

    run(go())


def test_list_nodes_answers_from_the_routers_node_side():
    """Under `orchard ray up --catalog` the node side is Ray's nodes, not the agents'
    registry: `orchard nodes list` shows those."""

    class RayLike:  # a node side other than the agents that register here
        def nodes(self) -> list[pb.NodeInfo]:
            return [pb.NodeInfo(report=report("ray-node-1"), state="healthy")]

    async def go():
        router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                           join_token=TOKEN), node_side=RayLike())
        await router.start()
        try:
            async with channel(router.grpc_address) as ch:
                reply = await pb_grpc.FleetStub(ch).ListNodes(pb.ListNodesRequest())
            assert [n.report.node_id for n in reply.nodes] == ["ray-node-1"]
        finally:
            await router.stop(grace=0)

    run(go())
