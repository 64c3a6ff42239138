"""The fleet controller (cluster/fleet/controller.py) against an in-process node side
(tests/fake_nodes.py) and the router's real Registry and proxy: single-flight loads (one
router, two routers on one catalog file), keep-alive, eviction (never a model in flight,
never a pinned one), load failures reaching held requests at once, an unknown model's
404, a router restart, and a request for a cold model served through the proxy."""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc
import pytest

from cluster.api import errors
from cluster.fleet import FleetError
from cluster.fleet.catalog import Catalog
from cluster.fleet.config import FleetConfig
from cluster.fleet.controller import CatalogRPCs, FleetController
from cluster.fleet.metrics import FleetMetrics
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.metrics import RouterMetrics
from cluster.router.policy import make_policy
from cluster.router.proxy import ProxyConfig, RouterBackend
from cluster.router.registry import DRAINING, Registry
from tests.conftest import run
from tests.fake_nodes import FakeNodes, ServingNodes, disk_model


class Clock:
    """A hand-moved clock (the controller's monotonic one and the catalog's wall clock)."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Router:
    """One router's fleet parts: a registry, a controller on the catalog file, a backend."""

    def __init__(self, tmp_path, nodes_cls=FakeNodes, router_id: str = "r1", nodes: FakeNodes | None = None,
                 clock: Clock | None = None, connect: bool = False, **config):
        self.registry = Registry(connect=connect)
        self.clock = clock or Clock()
        self.catalog = Catalog(tmp_path / "catalog.db", clock=self.clock)
        self.nodes = nodes if nodes is not None else nodes_cls([self.registry])
        if nodes is not None:
            nodes.registries.append(self.registry)
        self.metrics = RouterMetrics(self.registry)
        self.fleet_metrics = FleetMetrics(self.metrics.prometheus)
        self.controller = FleetController(self.catalog, self.nodes, self.registry, self.fleet_metrics,
                                          FleetConfig(catalog=str(tmp_path / "catalog.db"), **config), router_id,
                                          clock=self.clock)
        self.backend = RouterBackend(self.registry, make_policy("least_loaded"), self.metrics, ProxyConfig(),
                                     fleet=self.controller)

    def add(self, name: str, source: str | None = None, **fields) -> None:
        self.catalog.add(pb.CatalogModel(name=name, source=source or name, **fields))

    def sample(self, name: str, **labels) -> float:
        return self.metrics.prometheus.get_sample_value(name, labels) or 0.0

    async def pool(self, model: str, rid: str = "r", timeout: float | None = None):
        """The workers a request for `model` may go to (after its hold, if it is held)."""
        from cluster.router.proxy import _Tries

        tries = _Tries(rid, timeout, 5.0)
        return await self.backend._next_pool(tries, model, 0)


async def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while not predicate():
        if loop.time() > until:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def fleet(tmp_path, budgets=(5.0,), models=(("small", 3.0), ("other", 3.0)), **kw) -> Router:
    r = Router(tmp_path, **kw)
    for i, budget in enumerate(budgets):
        r.nodes.add_node(f"mac-{i + 1}", budget, [disk_model(name, gib) for name, gib in models])
    for name, _ in models:
        r.add(name, keep_alive_seconds=300)
    return r


def test_fifty_concurrent_requests_for_a_cold_model_start_one_load(tmp_path):
    async def main():
        r = fleet(tmp_path)
        pools = await asyncio.wait_for(asyncio.gather(*(r.pool("small", f"req-{i}") for i in range(50))), 60)
        assert all(len(p) == 1 and p[0].model == "small" for p in pools)
        assert [spec.model for _, spec in r.nodes.started] == ["small"]
        await wait_for(lambda: not r.controller.loading("small"), "the load's end")
        assert r.sample("orchard_fleet_loads_total", model="small", outcome="loaded") == 1
        assert r.sample("orchard_fleet_load_wait_seconds_count") == 50
        placed = r.catalog.placements("small")
        assert [(p.node_id, p.worker_id) for p in placed] == [("mac-1", r.nodes.started[0][1].worker_id)]
        assert r.controller.describe("small").state == "serving"
        await r.nodes.close()

    run(main())


def test_two_routers_on_one_catalog_file_start_one_load(tmp_path):
    """Each router's requests trigger its own controller; the catalog's claim lets one
    start the model, the other waits for the worker to register with it too."""

    async def main():
        a = fleet(tmp_path, router_id="router-a")
        b = Router(tmp_path, router_id="router-b", nodes=a.nodes, clock=a.clock)
        requests = [a.pool("small", f"a-{i}") for i in range(10)] + [b.pool("small", f"b-{i}") for i in range(10)]
        pools = await asyncio.wait_for(asyncio.gather(*requests), 60)
        assert all(len(p) == 1 for p in pools)
        assert len(a.nodes.started) == 1
        await wait_for(lambda: not (a.controller.loading("small") or b.controller.loading("small")), "the loads' end")
        outcomes = {o: a.sample("orchard_fleet_loads_total", model="small", outcome=o)
                    + b.sample("orchard_fleet_loads_total", model="small", outcome=o) for o in ("loaded", "found")}
        assert outcomes == {"loaded": 1, "found": 1}
        assert a.catalog.claim_of("small") is None  # released once loaded
        await a.nodes.close()

    run(main())


def test_keep_alive_zero_unloads_after_the_request(tmp_path):
    async def main():
        r = fleet(tmp_path)
        await r.controller.load("small")
        worker_id = r.nodes.started[0][1].worker_id
        r.controller.request_started("small", keep_alive=0)
        await asyncio.sleep(0.05)
        assert r.nodes.stopped == []  # not while its request runs
        r.controller.request_finished("small")
        r.controller.request_started("small", keep_alive=0)  # the next request comes while it unloads
        await wait_for(lambda: r.nodes.stopped == [worker_id], "the unload")
        await wait_for(lambda: not r.controller._busy("small"), "the unload's end")
        assert r.sample("orchard_fleet_unloads_total", model="small", reason="keep_alive") == 1
        assert r.catalog.placements("small") == []
        # its keep_alive 0 holds for the next load
        await r.controller.load("small")
        r.controller.request_finished("small")
        await wait_for(lambda: len(r.nodes.stopped) == 2, "the unload after the next request")
        await r.nodes.close()

    run(main())


def test_an_idle_model_is_unloaded_when_its_keep_alive_runs_out(tmp_path):
    async def main():
        r = fleet(tmp_path)
        await r.controller.load("small")
        r.controller.request_started("small")
        r.controller.request_finished("small")
        r.clock.now += 299
        assert r.controller.expire() == []
        r.clock.now += 2
        assert r.controller.expire() == ["small"]
        await wait_for(lambda: len(r.nodes.stopped) == 1, "the unload")
        await r.nodes.close()

    run(main())


def test_a_pinned_or_busy_model_outlives_its_keep_alive(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(8.0,))
        r.add("small", keep_alive_seconds=10, pin=True, replace=True)
        r.add("other", keep_alive_seconds=10, replace=True)
        await r.controller.load("small")
        await r.controller.load("other")
        r.controller.request_started("other")
        r.clock.now += 3600
        assert r.controller.expire() == []
        r.controller.request_finished("other")
        r.clock.now += 11
        assert r.controller.expire() == ["other"]
        await r.nodes.close()

    run(main())


def test_an_idle_model_is_evicted_for_another_never_one_in_flight_nor_pinned(tmp_path):
    async def main():
        r = fleet(tmp_path)  # one node: room for one of the two models
        await r.controller.load("small")
        small = r.nodes.started[0][1].worker_id
        # in flight: "other" cannot have its room, and waits for it
        r.controller.request_started("small")
        other = asyncio.ensure_future(r.controller.load("other"))
        await wait_for(lambda: "waiting for room" in r.controller.describe("other").status, "other to wait")
        assert r.nodes.stopped == [] and not other.done()
        # pinned meanwhile: never its room, so the waiting load is refused once small is idle
        r.add("small", keep_alive_seconds=300, pin=True, replace=True)
        r.controller.request_finished("small")
        with pytest.raises(FleetError) as e:
            await asyncio.wait_for(other, 30)
        assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and r.nodes.stopped == []
        r.controller._errors.clear()
        # idle and not pinned: evicted for "other"
        r.add("small", keep_alive_seconds=300, replace=True)
        await r.controller.load("other")
        assert r.nodes.stopped == [small]
        assert [spec.model for _, spec in r.nodes.started] == ["small", "other"]
        assert r.sample("orchard_fleet_unloads_total", model="small", reason="evicted") == 1
        assert r.controller.describe("small").state == "on disk"
        await r.nodes.close()

    run(main())


def test_a_model_serving_before_its_node_reports_it_running_may_be_evicted(tmp_path):
    """A node's report lags its worker: the worker registered and served while its agent
    still says loading (the agent polls it). Its room may be taken once it is idle: the
    router's registry is the truth that it loaded, not a report a heartbeat old."""
    async def main():
        r = fleet(tmp_path)  # one node: room for one of the two models
        await r.controller.load("small")
        node, spec = r.nodes.started[0]
        r.nodes._worker(node, spec.worker_id).state = "loading"  # the agent has not seen it answer yet
        await r.controller.load("other")
        assert r.nodes.stopped == [spec.worker_id]
        await r.nodes.close()

    run(main())


class LaggingNodes(FakeNodes):
    """A node side whose StartWorker answers, and shows in the node's report, a while after
    it is called (a real agent is a network call away and reports on its heartbeat)."""

    async def start(self, node_id: str, spec: pb.WorkerSpec) -> pb.ManagedWorker:
        await asyncio.sleep(0.2)
        return await super().start(node_id, spec)


def test_two_loads_planned_at_once_do_not_count_on_the_same_room(tmp_path):
    """Two nodes with room for one model each and two cold models asked for at once: one
    on each node (the second plan counts the room the first set aside before any report
    shows it), both served."""
    async def main():
        r = fleet(tmp_path, budgets=(5.0, 5.0), nodes_cls=LaggingNodes)
        await asyncio.gather(r.controller.load("small"), r.controller.load("other"))
        assert sorted(node for node, _ in r.nodes.started) == ["mac-1", "mac-2"]
        assert r.controller.describe("small").state == r.controller.describe("other").state == "serving"
        await r.nodes.close()

    run(main())


def test_no_room_reaches_held_requests_at_once(tmp_path):
    """A model bigger than every node: the held requests fail at once (not after
    --load-timeout) with what it needs and what each node has; so do new ones."""

    async def main():
        r = fleet(tmp_path, budgets=(5.0, 4.0), models=(("huge", 30.0),))
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*(r.pool("huge", f"q{i}") for i in range(5)),
                                                        return_exceptions=True), 30)
        assert time.monotonic() - t0 < 20  # the load timeout is 600 s
        for e in results:
            assert isinstance(e, errors.Unavailable), e
            assert e.retry_after and "could not be loaded" in e.message and "mac-1" in e.message
            assert "mac-2" in e.message
        assert r.nodes.started == []
        with pytest.raises(errors.Unavailable):
            await asyncio.wait_for(r.pool("huge", "later"), 5)
        assert "last load failed" in r.controller.describe("huge").status
        assert r.sample("orchard_fleet_loads_total", model="huge", outcome="no_room") == 1

    run(main())


def test_a_worker_that_exits_while_loading_fails_the_load(tmp_path):
    async def main():
        r = fleet(tmp_path)
        r.nodes.exit_on_start = "unsupported model family"
        with pytest.raises(errors.Unavailable) as e:
            await asyncio.wait_for(r.pool("small"), 30)
        assert "unsupported model family" in e.value.message
        assert r.catalog.placements("small") == []
        await r.nodes.close()

    run(main())


def test_a_model_neither_served_nor_in_the_catalog_is_not_found_listing_the_catalog(tmp_path):
    async def main():
        r = fleet(tmp_path)
        with pytest.raises(errors.NotFound) as e:
            await asyncio.wait_for(r.pool("nope"), 5)
        assert "other" in e.value.message and "small" in e.value.message
        request = pb.GenerateRequest(model="nope", text="hi")
        with pytest.raises(errors.NotFound):
            await anext(r.backend.generate(request))

    run(main())


def test_a_restarted_router_finds_what_is_loaded_and_loads_nothing_twice(tmp_path):
    async def main():
        before = fleet(tmp_path, budgets=(8.0,), models=(("small", 3.0), ("other", 3.0), ("gone", 1.0)))
        await before.controller.load("small")
        await before.controller.load("gone")
        small = before.nodes.started[0][1].worker_id
        nodes = before.nodes
        nodes.registries.clear()
        # the router restarts: a new registry and controller on the same catalog file and nodes;
        # meanwhile "gone" left the catalog, and the catalog records a worker no node runs
        after = Router(tmp_path, router_id="r1", nodes=nodes)
        after.catalog.remove("gone")
        from cluster.fleet.catalog import Placement
        after.catalog.record_placement(Placement("other", "mac-1", "other@lost", router_id="r1"))
        nodes.register(small, "small")  # the worker registers again
        after.controller.reconcile()
        await wait_for(lambda: len(nodes.stopped) == 1, "the stop of the model no longer in the catalog")
        assert after.catalog.placements("other") == []
        pool = await asyncio.wait_for(after.pool("small"), 10)
        assert [w.worker_id for w in pool] == [small]
        assert [spec.model for _, spec in nodes.started] == ["small", "gone"]
        await nodes.close()

    run(main())


def test_a_restarted_router_waits_for_a_worker_placed_before(tmp_path):
    """A request right after the restart, before the worker registered again: held for
    it, not loaded a second time."""

    async def main():
        before = fleet(tmp_path)
        await before.controller.load("small")
        small = before.nodes.started[0][1].worker_id
        nodes = before.nodes
        nodes.registries.clear()
        after = Router(tmp_path, nodes=nodes)
        asyncio.get_running_loop().call_later(0.3, nodes.register, small, "small")
        pool = await asyncio.wait_for(after.pool("small"), 10)
        assert [w.worker_id for w in pool] == [small] and len(nodes.started) == 1
        await nodes.close()

    run(main())


def test_catalog_rpcs(tmp_path):
    class Context:
        async def abort(self, code, message):
            raise FleetError(code, message)

    async def main():
        r = fleet(tmp_path, models=(("small", 3.0),))
        rpcs, ctx = CatalogRPCs(r.controller), Context()
        added = await rpcs.AddModel(pb.CatalogModel(name="chat", source="small"), ctx)
        assert not added.HasField("keep_alive_seconds") and added.state == "on disk"
        assert 3 * 2**30 < added.footprint_bytes < 4 * 2**30  # the estimate, before it is loaded
        assert r.controller._keep_alive("chat") == 300  # --default-keep-alive 5m
        zero = await rpcs.AddModel(pb.CatalogModel(name="once", source="small", keep_alive_seconds=0), ctx)
        assert zero.keep_alive_seconds == 0
        with pytest.raises(FleetError) as e:
            await rpcs.AddModel(pb.CatalogModel(name="chat", source="small"), ctx)
        assert e.value.code is grpc.StatusCode.ALREADY_EXISTS
        loaded = await rpcs.LoadModel(pb.LoadModelRequest(name="chat"), ctx)
        assert loaded.state == "serving" and loaded.placements[0].node_id == "mac-1"
        listed = await rpcs.ListCatalog(pb.ListCatalogRequest(), ctx)
        assert [(m.name, m.state) for m in listed.models] == [("chat", "serving"), ("once", "on disk"),
                                                              ("small", "on disk")]
        models = (await r.backend.list_models()).models
        assert [(m.id, m.state) for m in models] == [("chat", "serving"), ("once", "on disk"), ("small", "on disk")]
        workers = [w.info() for w in r.registry.snapshot()]
        r.controller.annotate(workers)
        assert [(w.node_id, w.catalog_model) for w in workers] == [("mac-1", "chat")]
        unloaded = await rpcs.UnloadModel(pb.UnloadModelRequest(name="chat"), ctx)
        assert unloaded.state == "on disk" and r.sample("orchard_fleet_unloads_total", model="chat",
                                                        reason="operator") == 1
        await rpcs.RemoveModel(pb.RemoveModelRequest(name="chat"), ctx)
        with pytest.raises(FleetError) as e:
            await rpcs.LoadModel(pb.LoadModelRequest(name="chat"), ctx)
        assert e.value.code is grpc.StatusCode.NOT_FOUND and "once" in e.value.message
        await r.nodes.close()

    run(main())


def test_a_request_for_a_cold_catalog_model_is_held_and_served_through_the_proxy(tmp_path):
    """The real proxy path: the request is held while the node "starts" a worker (a fake
    worker answering gRPC), then relayed from it."""

    async def main():
        r = fleet(tmp_path, nodes_cls=ServingNodes, connect=True)
        from cluster.api.wire import build_request

        request = build_request("hello", model="small", max_tokens=5, keep_alive=0)  # the SDK's keep_alive=0
        chunks = [c async for c in r.backend.generate(request, timeout=60)]
        assert chunks[-1].finish_reason and sum(len(c.token_ids) for c in chunks) == 5
        assert len(r.nodes.started) == 1
        await wait_for(lambda: len(r.nodes.stopped) == 1, "keep_alive 0: the unload after the request")
        await r.nodes.close()
        await r.registry.close()

    run(main())


def test_keep_alive_in_openai_bodies():
    from cluster.api.bodies import ChatBody, CompletionBody
    from cluster.api.limits import RequestLimits

    def chat(body):
        return ChatBody.parse(body, RequestLimits()).request("r", RequestLimits())

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert not chat(body).HasField("keep_alive_seconds")
    for given, seconds in (("5m", 300), ("1h30m", 5400), (0, 0), ("-1", -1), (90, 90), ("30s", 30)):
        assert chat(body | {"keep_alive": given}).keep_alive_seconds == seconds
    completion = CompletionBody.parse({"model": "m", "prompt": "hi", "keep_alive": "2m"}, RequestLimits())
    assert completion.request("r", RequestLimits()).keep_alive_seconds == 120
    for bad in ("soon", True, [], {"m": 5}, "9999999h"):
        with pytest.raises(errors.InvalidRequest) as e:
            chat(body | {"keep_alive": bad})
        assert e.value.param == "keep_alive"


def test_a_router_with_a_catalog_serves_the_fleet_over_grpc_and_http(tmp_path, capsys, monkeypatch):
    """`orchard router serve --catalog`: the catalog commands (with the admin key),
    /v1/models with each entry's state, a chat for a cold catalog model held, loaded and
    served (a stream told of the load in SSE comments meanwhile; keep_alive 0 unloads it
    after), an unknown model's 404 listing the catalog, and `orchard router workers`
    naming the node and catalog entry of a placed worker."""
    import aiohttp

    from cluster.api import streams

    monkeypatch.setattr(streams, "KEEPALIVE_SECONDS", 0.1)

    from cluster.fleet import models_cli
    from cluster.router import admin
    from cluster.router.config import RouterConfig
    from cluster.router.server import RouterServer
    from cluster.security import SecurityConfig

    def cli(*argv) -> int:
        from cluster.cli import build_parser

        args = build_parser(["models", *argv]).parse_args(["models", *argv])
        return models_cli.run(args)

    async def main():
        config = RouterConfig(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", metrics_address=None,
                              security=SecurityConfig(admin_key="sekret"),
                              fleet=FleetConfig(catalog=str(tmp_path / "catalog.db")))
        router = RouterServer(config)
        nodes = router.controller.nodes = ServingNodes([router.registry])
        nodes.add_node("mac-1", 5.0, [disk_model("small", 3.0)])
        await router.start()
        try:
            grpc_address, http = router.grpc_address, f"http://{router.http_address}"
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, cli, "add", "chat", "--source", "small", "--router",
                                              grpc_address, "--admin-key", "sekret", "--keep-alive", "10m") == 0
            assert "chat" in capsys.readouterr().out
            assert await loop.run_in_executor(None, cli, "list", "--router", grpc_address) == 1  # no admin key
            assert "UNAUTHENTICATED" in capsys.readouterr().err
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{http}/v1/models") as r:
                    listed = (await r.json())["data"]
                assert [(m["id"], m["state"]) for m in listed] == [("chat", "on disk")]
                body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                        "keep_alive": 0}
                nodes.load_delay = 1.0
                comments, events = [], []
                async with session.post(f"{http}/v1/chat/completions", json=body | {"stream": True}) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        (comments if line.startswith(b":") else events).append(line.decode().strip())
                # the status after the prefix moves on ("loading on mac-1", then "serving on mac-1" in the
                # moment between the worker's registration and the held request waking)
                assert comments and all(c.startswith(": loading model 'chat': ") for c in comments), comments
                assert any(c.startswith(": loading model 'chat': loading") for c in comments), comments
                assert "data: [DONE]" in events
                await wait_for(lambda: len(nodes.stopped) == 1, "keep_alive 0: the unload")
                nodes.load_delay = 0.05
                async with session.post(f"{http}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["choices"][0]["finish_reason"]
                await wait_for(lambda: len(nodes.stopped) == 2, "keep_alive 0: the unload")
                async with session.post(f"{http}/v1/chat/completions", json=body | {"model": "nope"}) as r:
                    assert r.status == 404
                    assert "catalog: chat" in (await r.json())["error"]["message"]
            assert await loop.run_in_executor(None, cli, "load", "chat", "--router", grpc_address,
                                              "--admin-key", "sekret") == 0
            assert "serving on mac-1" in capsys.readouterr().out
            workers = await loop.run_in_executor(None, lambda: admin.list_workers(
                grpc_address, config.security.client()))
            assert "fleet: catalog model chat on node mac-1" in admin.format_workers(workers)
            assert await loop.run_in_executor(None, cli, "remove", "chat", "--router", grpc_address,
                                              "--admin-key", "sekret") == 0
            assert len(nodes.stopped) == 3 and router.controller.catalog.entries() == []
        finally:
            await router.stop(grace=0)
            await nodes.close()

    run(main())


def test_orchard_models_list_shows_replicas_and_their_bounds():
    from cluster.fleet.models_cli import format_catalog

    table = format_catalog([pb.CatalogModel(name="hot", source="s", state="serving", replicas=2, min_replicas=1,
                                            max_replicas=3),
                            pb.CatalogModel(name="warm", source="s", state="serving", replicas=1, max_replicas=2),
                            pb.CatalogModel(name="cold", source="s", state="on disk")])
    header, hot, warm, cold = table.splitlines()
    column = header.index("REPLICAS")
    assert hot[column:].startswith("2 (1-3)") and warm[column:].startswith("1 (1-2)")
    assert cold[column:].startswith("-")


def test_orchard_models_refuses_bad_flags_in_one_line(capsys):
    from cluster.cli import main

    for argv, words in ((["models", "add", "m", "--keep-alive", "soon"], "--keep-alive"),
                        (["models", "add", "m", "--context", "-5"], "--context must be >= 0"),
                        (["models", "add", "m", "--engine-arg", "'unclosed"], "--engine-arg"),
                        (["models", "add", "m", "--min-replicas", "-1"], "--min-replicas: -1, not in 0..64"),
                        (["models", "add", "m", "--max-replicas", "65"], "--max-replicas: 65, not in 0..64"),
                        (["models", "add", "m", "--min-replicas", "3", "--max-replicas", "2"],
                         "--max-replicas: 2, less than --min-replicas 3")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_model_bigger_than_any_node_is_served_by_a_group_the_controller_forms(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(5.0, 5.0), models=(("big", 7.0),))
        pool = await asyncio.wait_for(r.pool("big"), 30)
        specs = [spec for _, spec in r.nodes.started]
        assert [(node, spec.group_rank, spec.group_size) for node, spec in r.nodes.started] == [
            (r.nodes.started[0][0], 0, 2), (r.nodes.started[1][0], 1, 2)]
        assert {node for node, _ in r.nodes.started} == {"mac-1", "mac-2"}
        hosts = list(specs[0].group_hosts)
        assert len(hosts) == 2 and all(list(s.group_hosts) == hosts for s in specs)
        assert all(s.group_port == specs[0].group_port > 0 for s in specs)
        runs = [[int(x) for x in run.split("-")] for run in specs[0].group_shares.split(",")]
        assert sum(last - first + 1 for first, last in runs) == 8 and all(
            s.group_shares == specs[0].group_shares for s in specs)
        assert all(s.reserved_bytes <= 5 * 2**30 for s in specs)
        assert [w.worker_id for w in pool] == [specs[0].worker_id]  # rank 0 is the worker the router sees
        described = r.controller.describe("big")
        assert described.state == "serving" and {p.node_id for p in described.placements} == {"mac-1", "mac-2"}
        # a node's report a heartbeat behind: its rank still "loading" while the group serves
        rank_1_node, rank_1 = r.nodes.started[1][0], specs[1].worker_id
        r.nodes._worker(rank_1_node, rank_1).state = "loading"
        described = r.controller.describe("big")
        assert (described.state, described.status) == ("serving", "serving on mac-1 and mac-2"), described.status
        r.nodes._worker(rank_1_node, rank_1).state = "running"
        await r.controller.unload("big")
        assert sorted(r.nodes.stopped) == sorted(s.worker_id for s in specs)
        await r.nodes.close()

    run(main())


def test_fleet_metrics(tmp_path):
    async def main():
        r = fleet(tmp_path)
        await r.controller.load("small")
        worker_id = r.nodes.started[0][1].worker_id
        estimate = r.nodes.started[0][1].reserved_bytes
        r.registry.workers[worker_id].report.resident_bytes = int(estimate * 1.05)
        assert r.sample("orchard_fleet_models_loaded", node="mac-1") == 1
        assert r.sample("orchard_fleet_node_memory_bytes", node="mac-1", kind="budget") == 5 * 2**30
        assert r.sample("orchard_fleet_node_memory_bytes", node="mac-1", kind="reserved") == estimate
        assert abs(r.sample("orchard_fleet_footprint_error_ratio", model="small") - 0.05) < 1e-6
        assert r.sample("orchard_fleet_load_seconds_count") == 1
        await r.nodes.close()

    run(main())


def test_a_worker_that_ended_elsewhere_leaves_no_footprint_estimate_behind(tmp_path):
    """A worker this router started that ended without it (another router unloaded the
    model, the worker exited) is forgotten with its node's report: the estimates kept per
    worker do not grow with every load over the router's life."""
    async def main():
        a = fleet(tmp_path, router_id="router-a")
        b = Router(tmp_path, router_id="router-b", nodes=a.nodes, clock=a.clock)
        for _ in range(3):
            await a.controller.load("small")
            a.controller.reconcile()
            b.controller.reconcile()
            await b.controller.unload("small")
            a.controller.reconcile()
        assert len(a.nodes.started) == 3 and a.controller._estimates == {}
        await a.nodes.close()

    run(main())


def test_router_serve_refuses_bad_fleet_flags_in_one_line(tmp_path, capsys):
    from cluster.router.config import RouterConfig
    from cluster.router.server import run as serve

    catalog = str(tmp_path / "c.db")
    for fleet_config, words in ((FleetConfig(catalog=catalog, default_keep_alive="soon"), "--default-keep-alive"),
                                (FleetConfig(catalog=catalog, load_timeout=0), "--load-timeout must be > 0"),
                                (FleetConfig(catalog=catalog, fleet_context=0), "--fleet-context must be >= 1"),
                                (FleetConfig(catalog=catalog, scale_up_wait=0), "--scale-up-wait must be > 0 seconds"),
                                (FleetConfig(catalog=catalog, scale_window=float("nan")), "--scale-window must be > 0"),
                                (FleetConfig(catalog=catalog, scale_window=60, scale_down_idle=30),
                                 "--scale-down-idle must be at least --scale-window (60 s), got 30")):
        assert serve(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                  fleet=fleet_config)) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1


def test_two_routers_whose_keep_alives_run_out_together_unload_once(tmp_path):
    async def main():
        a = fleet(tmp_path, router_id="router-a")
        b = Router(tmp_path, router_id="router-b", nodes=a.nodes, clock=a.clock)
        await a.controller.load("small")
        b.controller.reconcile()  # b finds it loaded
        a.clock.now += 301
        assert a.controller.expire() == ["small"] and b.controller.expire() == ["small"]
        await wait_for(lambda: not (a.controller._busy("small") or b.controller._busy("small")), "the unloads")
        assert len(a.nodes.stopped) == 1
        unloads = sum(r.sample("orchard_fleet_unloads_total", model="small", reason="keep_alive") for r in (a, b))
        assert unloads == 1
        # an operator's unload while the other router holds the model's claim is refused, not ignored
        await a.controller.load("small")
        assert a.catalog.claim("small", "router-a", 60)
        with pytest.raises(FleetError) as e:
            await b.controller.unload("small")
        assert e.value.code is grpc.StatusCode.UNAVAILABLE and len(a.nodes.stopped) == 1
        await a.nodes.close()

    run(main())


def test_the_router_side_of_the_fleet_imports_no_mlx():
    import subprocess
    import sys

    code = ("import sys; sys.modules['mlx'] = None; import cluster.fleet.controller, cluster.fleet.models_cli, "
            "cluster.router.server; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_kv_pool_holds_fleet_concurrency_full_contexts(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(8.0,), fleet_concurrency=8, fleet_context=1024)
        await r.controller.load("small")
        spec = r.nodes.started[0][1]
        assert spec.context == 1024 and spec.kv_cache_bytes == 8 * 1024 * 1024  # 1 KiB a token
        await r.nodes.close()

    run(main())


def test_a_model_on_a_node_gone_is_loaded_on_another_not_on_one_silent_a_moment(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(5.0, 5.0))
        await r.controller.load("small")
        first_node, first = r.nodes.started[0][0], r.nodes.started[0][1].worker_id
        r.nodes.healthy[first_node] = False  # missed a few heartbeats (a busy Mac): its worker is still there
        r.nodes.silent[first_node] = 5.0
        r.registry.mark_failed(first, "silent")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(r.pool("small"), 1.5)
        assert len(r.nodes.started) == 1
        r.nodes.silent[first_node] = 60.0  # past the router's --remove-after: the Mac is gone
        pool = await asyncio.wait_for(r.pool("small"), 30)
        assert len(r.nodes.started) == 2 and r.nodes.started[1][0] != first_node
        assert [w.worker_id for w in pool] == [r.nodes.started[1][1].worker_id]
        await r.nodes.close()

    run(main())


def test_a_load_whose_worker_served_and_unloaded_before_the_load_woke_ends(tmp_path):
    """On a busy router the load's task may wake after its worker served a keep_alive 0
    request and was unloaded: the load ends (it loaded), rather than waiting for a worker
    that is gone until --load-timeout while the model's next requests wait on it."""

    async def main():
        r = fleet(tmp_path)
        ticks = r.controller._tick

        async def slow_tick():  # the router's loop busy: the load's task wakes late
            await asyncio.sleep(1.0)
            await ticks()

        r.controller._tick = slow_tick
        r.controller.ensure_loaded("small")
        await wait_for(lambda: r.controller.serving("small"), "the worker")
        r.controller.request_started("small", keep_alive=0)
        r.controller.request_finished("small")
        await wait_for(lambda: len(r.nodes.stopped) == 1, "the unload")
        await wait_for(lambda: not r.controller.loading("small"), "the load's end", timeout=10)
        assert r.sample("orchard_fleet_loads_total", model="small", outcome="loaded") == 1
        await r.nodes.close()

    run(main())


def test_a_model_unloaded_is_loaded_again_at_once_not_found_on_its_stopped_worker(tmp_path):
    """A stopped worker stays in the registry until it misses heartbeats, and in its node's
    report until the node's next one: the controller that stopped it believes neither."""

    async def main():
        r = fleet(tmp_path, nodes_cls=lambda registries: FakeNodes(registries, stale=True))
        for reason in ("operator", "keep_alive"):
            await r.controller.load("small")
            stopped = r.nodes.started[-1][1].worker_id
            if reason == "operator":
                await r.controller.unload("small")
            else:
                r.controller.request_started("small", keep_alive=0)
                r.controller.request_finished("small")
                await wait_for(lambda: stopped in r.nodes.stopped, "the unload")
                await wait_for(lambda: not r.controller._busy("small"), "the unload's end")
            assert r.registry.serving("small") == [] and r.controller.describe("small").state != "serving"
            pool = await asyncio.wait_for(r.pool("small", timeout=30), 30)
            started = r.nodes.started[-1][1].worker_id
            assert started != stopped and [w.worker_id for w in pool] == [started]
            r.nodes.heartbeat()
        assert len(r.nodes.started) == 3
        await r.nodes.close()

    run(main())


def test_a_catalog_name_with_a_slash_or_long_loads_under_a_file_safe_worker_id(tmp_path):
    async def main():
        long_name = "org/" + "x" * 120
        r = fleet(tmp_path, budgets=(8.0,))
        r.add("qwen/qwen3-8b", source="small", keep_alive_seconds=300)
        r.add(long_name, source="other", keep_alive_seconds=300)
        await r.controller.load("qwen/qwen3-8b")
        await r.controller.load(long_name)
        ids = [spec.worker_id for _, spec in r.nodes.started]
        assert [spec.model for _, spec in r.nodes.started] == ["qwen/qwen3-8b", long_name]
        assert all("/" not in i and len(i) < 80 for i in ids) and ids[0].startswith("qwen-qwen3-8b-")
        assert r.controller.describe("qwen/qwen3-8b").state == "serving"
        await r.nodes.close()

    run(main())


def test_keep_alive_zero_never_unloads_a_pinned_model_nor_one_another_router_runs_requests_on(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(8.0,))
        r.add("small", keep_alive_seconds=300, pin=True, replace=True)
        await r.controller.load("small")
        await r.controller.load("other")
        for model in ("small", "other"):
            r.controller.request_started(model, keep_alive=0)
        other = r.nodes.started[1][1].worker_id
        r.registry.workers[other].report.num_running = 1  # another router's request, as its worker reports it
        for model in ("small", "other"):
            r.controller.request_finished(model)
        await asyncio.sleep(0.1)
        assert r.nodes.stopped == [] and not r.controller._busy("other")
        r.registry.workers[other].report.num_running = 0
        assert r.controller.expire() == ["other"]  # once it reports none, its keep_alive 0 applies
        await wait_for(lambda: r.nodes.stopped == [other], "the unload")
        await r.nodes.close()

    run(main())


@pytest.mark.parametrize("arch", ["gemma4_text", "qwen3_next"])
def test_a_group_of_a_model_whose_layers_own_kv_unevenly_gets_the_pool_the_footprint_counted(tmp_path, arch):
    """Gemma 4's last layers reuse earlier layers' K/V, qwen3_next's linear-attention layers
    own none: split by layers, one rank holds more of the K/V than its share of layers. The ranks' flags, as the agent
    gives them, pass the group's own fit check (group/memory.py) with the pool of blocks
    the footprint counted."""
    from mlx_lm.utils import load_model

    from cluster.cli import build_parser
    from cluster.config import from_args
    from cluster.fleet import facts, footprint
    from cluster.fleet.agent import worker_argv
    from cluster.modelgen import create_model
    from cluster.worker.config import WorkerOptions
    from cluster.worker.group.leader import _pool_blocks, split
    from cluster.worker.group.memory import LeastKV, check_fit, join_info, rank_parts
    from cluster.worker.group.stage import Assignment

    path = create_model(tmp_path / arch, arch, "tiny", seed=0)
    disk = facts.disk_model(path, "cpu")
    disk.name = "uneven"
    context, contexts = 256, 2
    whole = footprint.estimate(disk, context, 64, "cpu")
    rest = whole.weights + footprint.kv_pool_bytes(disk, context, contexts) + whole.state
    budget_gib = (whole.overhead + 0.75 * rest) / 2**30  # one node cannot hold it, two can

    async def main():
        r = Router(tmp_path, fleet_concurrency=contexts, fleet_context=context)
        for node in ("mac-1", "mac-2"):
            r.nodes.add_node(node, budget_gib, [disk])
        r.add("uneven")
        await asyncio.wait_for(r.pool("uneven"), 30)
        await r.nodes.close()
        return [spec for _, spec in r.nodes.started]

    specs = run(main())
    assert [s.group_rank for s in specs] == [0, 1]
    options = []
    for spec in specs:
        argv = worker_argv(spec, str(path), "127.0.0.1:1", "127.0.0.1", "127.0.0.1", 1)[3:]
        options.append(from_args(WorkerOptions, build_parser(argv).parse_args(argv)))
    lazy, _ = load_model(path, lazy=True, strict=False)
    num_layers = len(lazy.layers)
    infos = {r: {"host": f"mac-{r + 1}", **join_info(o.group.memory_budget, o.engine_config.kv_cache_memory_bytes)}
             for r, o in enumerate(options)}
    config, group = options[0].engine_config, options[0].group
    assignment = Assignment("pipeline", 2, split(lazy, group, {r: infos[r]["memory"] for r in infos}), num_layers)
    virtual = group.inflight or 2
    parts = rank_parts(lazy, assignment, config, infos)
    assert len({p.kv_per_block * num_layers // len(p.layers) for p in parts}) > 1  # K/V owned unevenly
    check_fit(parts, LeastKV.of(lazy, config, virtual), config.num_kv_blocks, num_layers)
    capacities = [p.kv_budget // p.kv_per_block if p.kv_budget and p.kv_per_block else 1 << 30 for p in parts]
    assert _pool_blocks(config, capacities, virtual) == footprint.kv_pool_blocks(context, contexts)
    assert all(o.engine_config.max_num_seqs == 64 for o in options)


def test_a_hybrids_worker_runs_the_requests_at_once_its_footprint_counted_state_slots_for(tmp_path):
    async def main():
        r = Router(tmp_path)
        hybrid = disk_model("hybrid", 1.0)
        hybrid.state_bytes_per_seq = 4 << 20
        r.nodes.add_node("mac-1", 8.0, [hybrid])
        r.add("hybrid")
        r.add("narrow", source="hybrid", engine_args=["--max-num-seqs", "8"])
        for model, seqs in (("hybrid", 64), ("narrow", 8)):  # the worker's default, or the entry's own
            await r.controller.load(model)
            spec = r.nodes.started[-1][1]
            fp = r.controller._footprints(r.catalog.get(model), r.nodes.nodes())["mac-1"]
            assert spec.max_num_seqs == seqs and fp.state == seqs * (4 << 20) and spec.reserved_bytes == fp.total
        await r.nodes.close()

    run(main())


def test_a_held_streams_status_for_a_model_removed_while_it_waits_is_the_apis_error(tmp_path):
    """The SSE stream's hold comment asks the controller; a model removed meanwhile is an
    OrchardError (the stream's error event naming it), not a FleetError that cuts it."""
    r = fleet(tmp_path)
    r.backend.held["req-1"] = "small"
    r.backend.loading.add("req-1")
    assert r.backend.hold_status("req-1").startswith("loading model 'small'")
    r.catalog.remove("small")
    with pytest.raises(errors.NotFound, match="'small'"):
        r.backend.hold_status("req-1")


def test_a_model_removed_that_another_router_unloads_is_left_to_it_and_an_unload_failure_is_logged(tmp_path, caplog):
    async def main():
        a = fleet(tmp_path, router_id="router-a")
        b = Router(tmp_path, router_id="router-b", nodes=a.nodes, clock=a.clock)
        await a.controller.load("small")
        a.catalog.remove("small")
        assert a.catalog.claim("small", "router-a", 600)  # router-a unloads it (its removal)
        for _ in range(3):  # router-b's ticks
            b.controller.reconcile()
            await wait_for(lambda: not b.controller._busy("small"), "router-b's try")
            assert b.controller._unloads["small"].exception() is None and a.nodes.stopped == []
        a.catalog.release("small", "router-a")

        def broken(*_):
            raise RuntimeError("catalog file unreadable")

        b.catalog.claim = broken
        b.controller.reconcile()
        await wait_for(lambda: not b.controller._busy("small"), "router-b's unload")
        await asyncio.sleep(0)  # its done-callbacks
        assert any("fleet unload small failed: catalog file unreadable" in r.getMessage() for r in caplog.records)
        await a.nodes.close()

    run(main())


def test_a_failed_loads_worker_whose_stop_fails_is_not_forgotten_while_its_node_runs_it(tmp_path):
    async def main():
        r = fleet(tmp_path, load_timeout=0.5)
        r.nodes.load_delay = 3600  # it never registers: the load times out
        drains = []

        async def stop_times_out(node_id, worker_id, drain_timeout):
            drains.append(drain_timeout)
            raise FleetError(grpc.StatusCode.DEADLINE_EXCEEDED, "StopWorker: deadline exceeded")

        r.nodes.stop = stop_times_out
        with pytest.raises(FleetError) as e:
            await r.controller.load("small")
        assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        worker_id = r.nodes.started[0][1].worker_id
        assert drains and all(d > 0 for d in drains)  # never 0: the agent's default, past the call's deadline
        assert worker_id not in r.controller._stopped  # its node reports it running still: believed
        assert [p.worker_id for p in r.catalog.placements("small")] == [worker_id]
        assert [m.worker.worker_id for m in r.controller._live_members("small")] == [worker_id]


def test_a_cold_model_waits_for_room_that_busy_models_hold(tmp_path):
    """One node with room for one model, which is busy: a request for another model is not
    refused; it waits, and once the busy model's requests end, the idle model is unloaded
    and the other loaded (a request for a model that could never fit is refused at once:
    test_no_room_reaches_held_requests_at_once)."""

    async def main():
        r = fleet(tmp_path)
        assert len(await asyncio.wait_for(r.pool("small", "first"), 30)) == 1
        await wait_for(lambda: not r.controller.loading("small"), "small's load to end")
        r.controller.request_started("small")  # a stream in flight on it
        other = asyncio.ensure_future(r.pool("other", "cold"))
        await wait_for(lambda: "waiting for room" in r.controller.describe("other").status, "other to wait")
        assert not other.done() and r.controller.load_error("other") is None
        assert [spec.model for _, spec in r.nodes.started] == ["small"]  # small was not stopped under its stream
        r.controller.request_finished("small")
        pool = await asyncio.wait_for(other, 60)
        assert [w.model for w in pool] == ["other"]
        assert [spec.model for _, spec in r.nodes.started] == ["small", "other"]
        assert r.sample("orchard_fleet_unloads_total", model="small", reason="evicted") == 1
        await r.nodes.close()

    run(main())


def test_a_requests_keep_alive_is_its_own_and_a_later_request_without_one_gets_the_models(tmp_path):
    async def main():
        r = fleet(tmp_path)
        await r.controller.load("small")
        r.controller.request_started("small", keep_alive=10)
        r.controller.request_finished("small")
        r.controller.request_started("small")  # none: the entry's 300 s again
        r.controller.request_finished("small")
        r.clock.now += 11
        assert r.controller.expire() == []
        r.clock.now += 290
        assert r.controller.expire() == ["small"]
        await r.nodes.close()

    run(main())


@pytest.mark.parametrize("seconds, says", [(float("nan"), "nan is not a number of seconds"),
                                           (float("inf"), "inf is not a number of seconds"),
                                           (1e12, "1e+12 is more than 3.1536e+07 seconds")])
def test_a_grpc_requests_keep_alive_seconds_is_checked_as_the_http_bodys(tmp_path, seconds, says):
    async def main():
        r = fleet(tmp_path)
        request = pb.GenerateRequest(model="small", text="hi", keep_alive_seconds=seconds)
        with pytest.raises(errors.BadField) as e:
            async for _ in r.backend.generate(request, 5.0):
                pass
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and e.value.param == "keep_alive_seconds"
        assert says in e.value.message and r.nodes.started == [] and r.controller._use == {}

    run(main())


def test_a_catalog_write_waiting_for_another_routers_lock_does_not_stall_the_loop(tmp_path):
    """Another router holds the catalog's write lock for a while: meanwhile a request of one
    model ends here (a write: the model's last use, done once the lock is free) and a
    request of another model is served."""
    import sqlite3
    import threading

    locked, release, gave_up = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:  # the other router's transaction
        db = sqlite3.connect(tmp_path / "catalog.db", isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        locked.set()
        release.wait(15)
        gave_up.set()
        db.execute("ROLLBACK")
        db.close()

    async def main():
        r = fleet(tmp_path, budgets=(8.0,))
        await r.controller.load("small")
        await r.controller.load("other")
        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        try:
            assert locked.wait(30)
            r.controller.request_started("small")
            r.controller.request_finished("small")
            pool = await asyncio.wait_for(r.pool("other"), 30)
            served_while_locked = not gave_up.is_set()
        finally:
            release.set()
            holder.join(30)
        assert [w.model for w in pool] == ["other"] and served_while_locked
        await wait_for(lambda: r.catalog.last_used("small") is not None, "the write once the lock is free")

    run(main())


def test_two_loads_planned_at_once_count_each_others_slot_under_max_loaded(tmp_path):
    """A load whose StartWorker is on its way holds a slot of the node's --max-loaded
    before the node's report lists its worker: a second cold model planned meanwhile
    evicts an idle one for its slot instead of being refused by the node."""

    async def main():
        r = fleet(tmp_path, budgets=(10.0,), models=(("small", 2.0), ("other", 2.0), ("third", 2.0)))
        r.nodes.reports["mac-1"].max_loaded = 2
        await r.controller.load("small")
        start = r.nodes.start

        async def slow_start(node_id, spec):  # the RPC's time: the node's report lags
            await asyncio.sleep(0.2)
            return await start(node_id, spec)

        r.nodes.start = slow_start
        r.controller.ensure_loaded("other")
        r.controller.ensure_loaded("third")
        await wait_for(lambda: not (r.controller.loading("other") or r.controller.loading("third")), "the loads")
        assert r.controller.load_error("other") is None and r.controller.load_error("third") is None
        assert r.controller.serving("other") and r.controller.serving("third")
        assert len(r.nodes.stopped) == 1  # small, evicted for the second's slot
        await r.nodes.close()

    run(main())


def test_a_worker_another_router_stopped_leaves_this_routers_registry_once_its_node_reports_it_gone(tmp_path):
    async def main():
        a = fleet(tmp_path, router_id="router-a", nodes_cls=lambda registries: FakeNodes(registries, stale=True))
        b = Router(tmp_path, router_id="router-b", nodes=a.nodes, clock=a.clock)
        await a.controller.load("small")
        worker_id = a.nodes.started[0][1].worker_id
        b.controller.reconcile()
        b.registry.workers[worker_id].inflight = 1  # b's request: the worker drains
        unloading = asyncio.ensure_future(a.controller.unload("small"))
        await wait_for(lambda: a.nodes.reports["mac-1"].workers[0].state == "stopping", "the drain")
        b.controller.reconcile()
        assert worker_id in b.registry.workers  # stopping: b's request finishes there
        b.registry.workers[worker_id].inflight = 0
        await asyncio.wait_for(unloading, 30)
        assert worker_id in b.registry.workers  # its heartbeats stopped: b hears nothing yet
        b.controller.reconcile()
        assert worker_id in b.registry.workers  # its node has not reported since
        a.nodes.heartbeat()
        b.controller.reconcile()
        assert worker_id not in b.registry.workers and not b.controller.serving("small")
        await a.nodes.close()

    run(main())


def test_a_router_that_dies_mid_load_leaves_a_claim_the_other_takes_over_within_a_few_ticks(tmp_path):
    """The claim's holder renews it every tick while its load runs (a load longer than the
    claim's life keeps it); one that dies (no release) holds the model only until its claim
    runs out, well before --load-timeout."""
    from cluster.fleet.controller import CLAIM_TTL, TICK

    async def main():
        a = fleet(tmp_path, router_id="router-a", load_timeout=600)
        b = Router(tmp_path, router_id="router-b", nodes=a.nodes, clock=a.clock, load_timeout=600)
        start, hang = a.nodes.start, asyncio.Event()

        async def first_start_hangs(node_id, spec):
            if not hang.is_set():
                hang.set()
                await asyncio.Event().wait()  # router-a's StartWorker never answers
            return await start(node_id, spec)

        a.nodes.start = first_start_hangs
        a.controller.ensure_loaded("small")
        await wait_for(hang.is_set, "router-a's load")
        a.clock.now += CLAIM_TTL + 1  # longer than the claim's life: router-a's renewals keep it
        await asyncio.sleep(2.5 * TICK)
        assert b.catalog.claim_of("small").router_id == "router-a"
        a.catalog.release = lambda *_: True  # router-a dies: its claim is never released
        a.controller._loads["small"].cancel()
        await asyncio.sleep(1.5 * TICK)
        b.controller.ensure_loaded("small")
        await asyncio.sleep(0.5)
        assert b.controller.loading("small") and len(a.nodes.started) == 0
        a.clock.now += CLAIM_TTL + 1  # a few ticks later on the catalog's clock
        await wait_for(lambda: b.controller.serving("small"), "router-b's load", timeout=60)
        assert len(a.nodes.started) == 1
        await a.nodes.close()

    run(main())


def test_a_group_unloads_rank_0_first_its_members_once_it_has_drained(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(5.0, 5.0), models=(("big", 7.0),))
        await r.controller.load("big")
        rank0, member = (spec.worker_id for _, spec in r.nodes.started)
        r.registry.workers[rank0].inflight += 1  # a stream in flight on the group
        unload = asyncio.ensure_future(r.controller.unload("big"))
        await asyncio.sleep(0.3)
        assert r.nodes.stopped == [] and not unload.done()  # rank 0 drains; its member still runs
        assert r.nodes._worker(r.nodes.started[1][0], member).state == "running"
        r.registry.workers[rank0].inflight -= 1
        await asyncio.wait_for(unload, 30)
        assert r.nodes.stopped == [rank0, member]
        await r.nodes.close()

    run(main())


def test_a_crash_looping_worker_placed_already_fails_its_load_with_its_reason_and_is_stopped(tmp_path):
    async def main():
        r = fleet(tmp_path, load_timeout=10)
        r.nodes.reports["mac-1"].workers.add(  # found after a restart: it exits and its node starts it again
            worker_id="small-1@mac-1-abc", model="small", state="starting", restarts=3, exit_code=1,
            reason="RuntimeError: the weights are truncated", reserved_bytes=0)
        with pytest.raises(FleetError) as e:
            await r.controller.load("small")
        assert e.value.code is grpc.StatusCode.UNAVAILABLE and "the weights are truncated" in e.value.message
        assert "started again 3 times" in e.value.message and r.nodes.stopped == ["small-1@mac-1-abc"]
        assert r.sample("orchard_fleet_replacements_total", reason="crash") == 1
        r.controller._errors.clear()
        await r.controller.load("small")  # placed again: a new worker
        assert len(r.nodes.started) == 1 and r.controller.serving("small")
        await r.nodes.close()

    run(main())


# -- placing where the files are not: pulled from the hub, copied from a peer ----------------------------

def hub_fleet(tmp_path, budgets=(5.0, 5.0), **kw) -> Router:
    """Nodes holding nothing, and "org/chat" (3 GiB) on the fake hub."""
    r = Router(tmp_path, **kw)
    for i, budget in enumerate(budgets):
        r.nodes.add_node(f"mac-{i + 1}", budget, [])
    r.nodes.hub["hf:org/chat@main"] = disk_model("hf:org/chat@main", 3.0)
    r.add("chat", source="hf:org/chat", keep_alive_seconds=300)
    return r


def test_a_model_on_no_node_is_pulled_from_the_hub_with_its_progress_shown_then_started(tmp_path):
    async def main():
        r = hub_fleet(tmp_path)
        assert r.controller.describe("chat").state == "not on disk"
        assert "pulled from the hub when it loads" in r.controller.describe("chat").status
        r.nodes.fetch_gate = asyncio.Event()
        loading = asyncio.ensure_future(r.controller.load("chat"))
        await wait_for(lambda: r.nodes.fetches, "the fetch")
        node, request, origin = r.nodes.fetches[0]
        assert origin == "hub" and list(request.peers) == [] and request.source == "hf:org/chat@main"
        assert "hf:org/chat@main" in request.protect
        assert r.nodes.described and r.nodes.started == []  # described (footprint) before, started after
        described = r.controller.describe("chat")
        assert described.state == "pulling" and described.status == f"pulling to {node} from the hub 0%"
        [info] = r.controller.model_infos()
        assert (info.state, info.status) == ("pulling", described.status)
        assert info.max_model_len == 4096 and list(info.tasks) == ["generate"]  # from the hub's description
        r.nodes.fetch_gate.set()
        await wait_for(lambda: r.controller.describe("chat").fetch_progress >= 0.5, "the fetch's progress")
        await asyncio.wait_for(loading, 30)
        assert [(n, spec.source) for n, spec in r.nodes.started] == [(node, "hf:org/chat@main")]
        assert r.controller.describe("chat").state == "serving" and len(r.nodes.fetches) == 1
        await r.nodes.close()

    run(main())


def test_a_second_placement_copies_from_the_node_that_holds_it_and_holders_with_room_come_first(tmp_path):
    async def main():
        r = hub_fleet(tmp_path, budgets=(5.0, 5.0))
        r.add("pinned", source="pinned", pin=True)
        r.nodes.reports["mac-1"].models.append(disk_model("pinned", 1.0))
        await r.controller.load("chat")
        first = r.nodes.started[0][0]
        other = "mac-2" if first == "mac-1" else "mac-1"
        await r.controller.unload("chat")
        await r.controller.load("chat")  # the holder has room: no fetch
        assert r.nodes.started[1][0] == first and len(r.nodes.fetches) == 1
        await r.controller.unload("chat")
        r.nodes.reports[first].memory_reserved_bytes += int(4 * 2**30)  # the holder has no room now
        r.nodes.fetch_gate = asyncio.Event()
        loading = asyncio.ensure_future(r.controller.load("chat"))
        await wait_for(lambda: len(r.nodes.fetches) == 2, "the copy")
        node, request, origin = r.nodes.fetches[1]
        assert (node, origin) == (other, first) and [p.node_id for p in request.peers] == [first]
        assert set(request.protect) == {"hf:org/chat@main", "pinned"}
        described = r.controller.describe("chat")
        assert described.state == "copying" and described.status == f"copying to {other} from {first} 0%"
        r.nodes.fetch_gate.set()
        await asyncio.wait_for(loading, 30)
        assert r.nodes.started[2][0] == other and [o for *_, o in r.nodes.fetches] == ["hub", first]
        await r.nodes.close()

    run(main())


def test_a_plain_models_dir_model_is_copied_to_a_node_with_room_and_never_pulled(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(5.0,), models=(("small", 3.0),))
        r.nodes.reports["mac-1"].memory_reserved_bytes = int(4 * 2**30)  # its holder has no room
        r.nodes.add_node("mac-2", 5.0, [])
        await r.controller.load("small")
        assert [(n, o) for n, _, o in r.nodes.fetches] == [("mac-2", "mac-1")]
        assert r.nodes.started[0][0] == "mac-2"
        await r.controller.unload("small")
        # no healthy node holds it (mac-2's copy gone, mac-1 lost): it cannot be fetched
        r.nodes.reports["mac-2"].models.pop()
        r.nodes.healthy["mac-1"] = False
        with pytest.raises(FleetError) as e:
            await r.controller.load("small")
        assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "no healthy node holds" in e.value.message
        await r.nodes.close()

    run(main())


def test_a_hub_model_the_hub_does_not_know_fails_its_load_with_the_hubs_error(tmp_path):
    async def main():
        r = hub_fleet(tmp_path)
        r.nodes.hub.clear()
        with pytest.raises(FleetError) as e:
            await r.controller.load("chat")
        assert e.value.code is grpc.StatusCode.NOT_FOUND
        assert "no node holds hf:org/chat" in e.value.message and "nor on the hub" in e.value.message
        await r.nodes.close()

    run(main())


def test_a_group_of_a_model_on_no_node_fetches_onto_each_rank_only_its_layers(tmp_path):
    async def main():
        r = hub_fleet(tmp_path, budgets=(5.0, 5.0))
        r.nodes.hub["hf:org/chat@main"] = disk_model("hf:org/chat@main", 7.0, layers=32)
        await r.controller.load("chat")
        specs = {spec.group_rank: (node, spec) for node, spec in r.nodes.started}
        assert sorted(specs) == [0, 1]
        layers = {node: (req.first_layer, req.last_layer) for node, req, _ in r.nodes.fetches}
        assert set(layers) == {"mac-1", "mac-2"}
        # each rank fetches the layers the group is told to give it (--group-shares as layers): no more, no fewer
        runs = [tuple(int(x) for x in run.split("-")) for run in specs[0][1].group_shares.split(",")]
        assert all(spec.group_shares == specs[0][1].group_shares for _, spec in specs.values())
        assert [layers[specs[r][0]] for r in (0, 1)] == runs
        assert runs[0][1] == 31 and runs[1] == (0, runs[0][0] - 1)
        await r.nodes.close()

    run(main())


# -- a lost Mac: its models placed again on the nodes that remain ------------------------------------------

def lose(r: Router, node_id: str) -> None:
    """The node and its workers stop reporting, past the router's --remove-after."""
    r.nodes.healthy[node_id] = False
    r.nodes.silent[node_id] = r.registry.config.remove_after + 1
    for w in r.nodes.reports[node_id].workers:
        r.registry.remove(w.worker_id)
    r.nodes._notify()


def come_back(r: Router, node_id: str) -> None:
    r.nodes.healthy[node_id] = True
    r.nodes.silent[node_id] = 0.0
    r.nodes._notify()


async def replaced(r: Router, model: str, started: int) -> None:
    """Until the controller's tick placed `model` again (`started` workers started by then)."""
    async def placed_again() -> bool:
        r.controller.replace_lost()
        return len(r.nodes.started) >= started and r.controller.serving(model)

    loop = asyncio.get_running_loop()
    until = loop.time() + 30
    while not await placed_again():
        assert loop.time() < until, f"{model} was not placed again"
        await asyncio.sleep(0.02)


def test_a_model_on_a_node_lost_serves_again_on_another_and_the_node_back_is_reused(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(5.0, 5.0))
        await r.controller.load("small")
        first_node, first = r.nodes.started[0][0], r.nodes.started[0][1].worker_id
        r.nodes.healthy[first_node] = False  # a few missed heartbeats: nothing placed again
        r.nodes.silent[first_node] = 5.0
        assert r.controller.replace_lost() == []
        lose(r, first_node)
        assert r.controller.replace_lost() == ["small"]
        await replaced(r, "small", 2)
        other = r.nodes.started[1][0]
        assert other != first_node
        assert [p.node_id for p in r.controller.describe("small").placements] == [other]
        assert [p.node_id for p in r.catalog.placements("small")] == [other]
        assert r.sample("orchard_fleet_replacements_total", reason="node_lost") == 1
        # the node comes back still running its worker: stopped (placed elsewhere since)
        come_back(r, first_node)
        r.controller.replace_lost()
        await wait_for(lambda: first in r.nodes.stopped, "the abandoned worker's stop")
        assert r.controller.replace_lost() == [] and len(r.nodes.started) == 2
        await r.nodes.close()

    run(main())


def test_a_node_back_is_a_candidate_with_the_files_it_fetched(tmp_path):
    async def main():
        r = hub_fleet(tmp_path, budgets=(5.0, 5.0))
        await r.controller.load("chat")
        first_node, first = r.nodes.started[0][0], r.nodes.started[0][1].worker_id
        lose(r, first_node)
        await replaced(r, "chat", 2)
        second = r.nodes.started[1][0]
        assert [o for *_, o in r.nodes.fetches] == ["hub", "hub"]  # its only holder was gone
        come_back(r, first_node)
        r.controller.replace_lost()
        await wait_for(lambda: first in r.nodes.stopped, "the abandoned worker's stop")
        await r.controller.unload("chat")
        r.nodes.reports[second].memory_reserved_bytes += 4 * 2**30  # room only on the node back
        await r.controller.load("chat")
        assert r.nodes.started[2][0] == first_node and len(r.nodes.fetches) == 2  # its own files
        await r.nodes.close()

    run(main())


def test_a_group_whose_node_is_lost_is_formed_again_over_the_nodes_left(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(5.0, 5.0, 5.0), models=(("big", 7.0),))
        r.nodes.reports["mac-3"].memory_reserved_bytes = 5 * 2**30  # full, for now
        await r.controller.load("big")
        ranks = [(node, spec.worker_id) for node, spec in r.nodes.started]
        assert {node for node, _ in ranks} == {"mac-1", "mac-2"}
        r.nodes.reports["mac-3"].memory_reserved_bytes = 0
        lost, kept_worker = ranks[1][0], ranks[0][1]
        lose(r, lost)
        await replaced(r, "big", 4)
        assert kept_worker in r.nodes.stopped  # the rank left of the broken group
        again = {node for node, _ in r.nodes.started[2:]}
        assert again == {"mac-1", "mac-2", "mac-3"} - {lost}
        assert {p.node_id for p in r.controller.describe("big").placements} == again
        await r.nodes.close()

    run(main())


def test_a_group_whose_node_is_lost_shrinks_to_one_node_that_now_has_room(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(10.0, 5.0), models=(("big", 7.0), ("other", 3.0)))
        r.add("other", pin=True, replace=True)
        await r.controller.load("other")  # on mac-1: the big one no longer fits there alone
        await r.controller.load("big")
        assert sorted(node for node, spec in r.nodes.started if spec.model == "big") == ["mac-1", "mac-2"]
        await r.controller.unload("other")
        lose(r, "mac-2")
        await replaced(r, "big", 4)
        node, spec = r.nodes.started[-1]
        assert (node, spec.model, spec.group_size) == ("mac-1", "big", 0)
        await r.nodes.close()

    run(main())


def test_a_request_held_for_a_group_whose_node_is_lost_waits_for_it_formed_again(tmp_path):
    """Its rank left exits and is started again by its node while its member is gone (as a
    group does): that is no crash loop failing the request, which waits for the group
    formed again over the nodes that remain."""

    async def main():
        r = fleet(tmp_path, budgets=(5.0, 5.0, 5.0), models=(("big", 7.0),), load_timeout=60)
        r.nodes.reports["mac-3"].memory_reserved_bytes = 5 * 2**30
        await r.controller.load("big")
        (rank0_node, rank0), (lost, _) = [(n, s.worker_id) for n, s in r.nodes.started]
        r.nodes.reports["mac-3"].memory_reserved_bytes = 0
        r.nodes.healthy[lost] = False  # silent: the group is broken, its rank 0 starting again
        r.registry.remove(rank0)
        worker = r.nodes._worker(rank0_node, rank0)
        worker.state, worker.restarts = "starting", 5
        stop = asyncio.Event()
        running = asyncio.ensure_future(r.controller.run(stop))
        held = asyncio.ensure_future(r.pool("big"))
        await asyncio.sleep(0.5)
        assert not held.done() and len(r.nodes.started) == 2  # a busy Mac, maybe: nothing moves yet
        r.nodes.silent[lost] = r.registry.config.remove_after + 1  # now it is lost
        r.nodes._notify()
        pool = await asyncio.wait_for(held, 30)
        new_rank0 = next(s.worker_id for _, s in r.nodes.started[2:] if s.group_rank == 0)
        assert [w.worker_id for w in pool] == [new_rank0]
        assert r.controller.load_error("big") is None
        stop.set()
        await running
        await r.nodes.close()

    run(main())


def test_fetch_and_replacement_metrics(tmp_path):
    async def main():
        r = fleet(tmp_path)
        report = r.nodes.reports["mac-1"]
        report.instance_id = "start-1"
        report.transfer_totals.add(kind="hub", bytes=100, seconds=2.0, fetches=1)
        report.transfer_totals.add(kind="peer", bytes=50, seconds=0.5, fetches=2, failures=1)
        assert r.sample("orchard_fleet_fetch_bytes_total", kind="hub") == 100
        assert r.sample("orchard_fleet_fetches_total", kind="peer", outcome="failed") == 1
        report.instance_id = "start-2"  # the agent restarted: its totals begin again, the fleet's count on
        del report.transfer_totals[:]
        report.transfer_totals.add(kind="hub", bytes=10, seconds=1.0, fetches=1)
        assert r.sample("orchard_fleet_fetch_bytes_total", kind="hub") == 110
        assert r.sample("orchard_fleet_fetch_seconds_total", kind="hub") == 3.0
        assert r.sample("orchard_fleet_fetches_total", kind="hub", outcome="ok") == 2
        assert r.sample("orchard_fleet_fetch_bytes_total", kind="peer") == 50
        await r.nodes.close()

    run(main())


def test_a_second_router_leaves_the_group_the_first_formed_again_alone(tmp_path):
    async def main():
        a = fleet(tmp_path, budgets=(5.0, 5.0, 5.0), models=(("big", 7.0),), router_id="router-a")
        b = Router(tmp_path, router_id="router-b", nodes=a.nodes, clock=a.clock)
        a.nodes.reports["mac-3"].memory_reserved_bytes = 5 * 2**30
        await a.controller.load("big")
        a.nodes.reports["mac-3"].memory_reserved_bytes = 0
        lose(a, a.nodes.started[1][0])
        await replaced(a, "big", 4)
        formed = {spec.worker_id for _, spec in a.nodes.started[2:]}
        stopped = list(a.nodes.stopped)
        assert b.controller.replace_lost() == ["big"]  # b abandons the worker on the node lost ...
        await wait_for(lambda: b.controller.serving("big") and not b.controller._replacing, "b finding a's group")
        assert a.nodes.stopped == stopped and len(a.nodes.started) == 4  # ... and stops nothing of a's
        assert formed == {p.worker_id for p in b.controller.describe("big").placements}
        await a.nodes.close()

    run(main())


# -- replicas that follow traffic -------------------------------------------------------------------

def hot_fleet(tmp_path, budgets=(5.0, 5.0, 5.0), models=(("hot", 3.0),), min_replicas=1, max_replicas=3,
              **kw) -> Router:
    """Nodes with room for one model each; "hot" never unloaded for idleness, 4 slots a replica."""
    r = fleet(tmp_path, budgets=budgets, models=models, scale_up_wait=2.0, scale_window=30.0,
              scale_down_idle=120.0, **kw)
    r.add("hot", keep_alive_seconds=-1, min_replicas=min_replicas, max_replicas=max_replicas,
          engine_args=["--max-num-seqs", "4"], replace=True)
    return r


async def step(r: Router, seconds: float = 1.0, waits: list[float] = ()) -> list[tuple[str, int]]:
    """`waits` told, the clock moved on `seconds`, and the controller's replica step taken, to
    the end of the changes it began."""
    for wait in waits:
        r.controller.request_waited("hot", wait)
    r.clock.now += seconds
    begun = r.controller.scale()
    await wait_for(lambda: not any(r.controller.scaling(m) for m, _ in begun), "the replica change")
    return begun


def replica_nodes(r: Router, model: str = "hot") -> list[str]:
    """The node of each live replica (rank 0) of `model`."""
    return sorted(members[0].node_id for members in r.controller.placed().get(model).replicas().values())


def test_a_hot_models_replicas_grow_to_max_one_per_window_and_shrink_back_when_the_load_ends(tmp_path):
    async def main():
        r = hot_fleet(tmp_path)
        await r.controller.load("hot")
        for _ in range(8):  # twice what a replica's slots hold, all the time
            r.controller.request_started("hot")
        r.nodes.load_delay = 2.0  # long enough to look at it while it loads
        for _ in range(31):  # the first window, and a replica added at its end
            r.clock.now += 1
            r.controller.request_waited("hot", 5.0)
            r.controller.scale()
        await wait_for(lambda: len(r.nodes.started) == 2, "the second replica's start")
        described = r.controller.describe("hot")  # the model serves while its replica loads
        assert described.state == "serving" and "a replica loading on" in described.status, described.status
        await wait_for(lambda: not r.controller.scaling("hot"), "the second replica")
        r.nodes.load_delay = 0.05
        changes = [(r.clock.now, +1)]
        for _ in range(200):
            changes += [(r.clock.now, delta) for _, delta in await step(r, waits=[5.0] * 3)]
            nodes = replica_nodes(r)
            assert len(nodes) == len(set(nodes)) <= 3  # never two on a node, never past max_replicas
        assert [delta for _, delta in changes] == [+1, +1]
        assert replica_nodes(r) == ["mac-1", "mac-2", "mac-3"]
        assert r.controller.describe("hot").replicas == 3 and r.sample("orchard_fleet_replicas", model="hot") == 3
        for _ in range(8):  # the load ends
            r.controller.request_finished("hot")
        for _ in range(400):
            changes += [(r.clock.now, delta) for _, delta in await step(r)]
        assert [delta for _, delta in changes] == [+1, +1, -1, -1]
        times = [t for t, _ in changes]
        assert all(later - earlier >= 30.0 for earlier, later in zip(times, times[1:]))  # one change a window
        assert times[2] - times[1] >= 120.0  # down after --scale-down-idle
        assert len(replica_nodes(r)) == 1 and len(r.nodes.stopped) == 2
        started = [spec.worker_id for _, spec in r.nodes.started]
        assert len(started) == len(set(started)) == 3
        assert r.catalog.placements("hot")[0].worker_id not in r.nodes.stopped and len(r.catalog.placements("hot")) == 1
        assert r.sample("orchard_fleet_scale_events_total", model="hot", direction="up") == 2
        assert r.sample("orchard_fleet_scale_events_total", model="hot", direction="down") == 2
        assert r.sample("orchard_fleet_replicas", model="hot") == 1
        await r.nodes.close()

    run(main())


def test_waits_between_the_thresholds_neither_add_nor_remove_replicas(tmp_path):
    """Two replicas, then waits hovering under --scale-up-wait but over half of it, with one
    request in flight (one replica would carry it at a quarter of its slots): no change, as
    without hysteresis it would come down; waits around the threshold only ever add."""
    async def main():
        r = hot_fleet(tmp_path)
        await r.controller.load("hot")
        r.controller.request_started("hot")
        for _ in range(31):
            await step(r, waits=[5.0] * 3)
        assert len(replica_nodes(r)) == 2
        for _ in range(600):
            assert await step(r, waits=[1.5] * 3) == []
        hovering = itertools.cycle([1.1, 2.9, 1.9, 2.1, 2.5, 1.4])
        changes = []
        for _ in range(600):
            changes += [delta for _, delta in await step(r, waits=[next(hovering) for _ in range(3)])]
        assert -1 not in changes
        await r.nodes.close()

    run(main())


def test_a_replica_goes_only_to_a_node_without_one_evicting_an_idle_model_there(tmp_path):
    async def main():
        r = hot_fleet(tmp_path, models=(("hot", 3.0), ("other", 3.0)))
        await r.controller.load("other")
        await r.controller.load("hot")
        other_node = r.controller.placed()["other"].node_ids
        for _ in range(8):
            r.controller.request_started("hot")
        for _ in range(70):
            await step(r, waits=[5.0] * 3)
        assert replica_nodes(r) == ["mac-1", "mac-2", "mac-3"]  # the third where "other" was, evicted
        assert "other" not in r.controller.replica_counts() and other_node[0] in replica_nodes(r)
        assert r.sample("orchard_fleet_unloads_total", model="other", reason="evicted") == 1
        await r.nodes.close()

    run(main())


def test_no_node_without_a_replica_no_more_replicas(tmp_path):
    async def main():
        r = hot_fleet(tmp_path, budgets=(8.0, 8.0))  # room for two replicas on each node
        await r.controller.load("hot")
        for _ in range(8):
            r.controller.request_started("hot")
        for _ in range(200):
            await step(r, waits=[5.0] * 3)
        assert replica_nodes(r) == ["mac-1", "mac-2"] and len(r.nodes.started) == 2
        assert "no node without a replica of it has room" in r.controller._scale_failed["hot"]
        assert r.controller.describe("hot").state == "serving"
        await r.nodes.close()

    run(main())


async def two_replicas(r: Router, in_flight: int) -> list[str]:
    """"hot" grown to two replicas under a sustained wait, then `in_flight` requests left
    in flight: the replicas' worker ids."""
    await r.controller.load("hot")
    for _ in range(8):
        r.controller.request_started("hot")
    for _ in range(31):
        await step(r, waits=[5.0] * 3)
    for _ in range(8 - in_flight):
        r.controller.request_finished("hot")
    return sorted(r.controller.placed()["hot"].replicas())


def test_a_replica_removed_is_drained_its_requests_in_flight_finish(tmp_path):
    async def main():
        r = hot_fleet(tmp_path)
        ids = await two_replicas(r, in_flight=2)
        for worker_id in ids:  # one request on each (as the proxy counts them)
            r.registry.find(worker_id).inflight = 1
        begun = []
        for _ in range(130):
            r.clock.now += 1
            begun = r.controller.scale()
            if begun:
                break
        assert begun == [("hot", -1)]
        await wait_for(lambda: any(r.registry.find(w).state == DRAINING for w in ids), "the drain")
        victim = next(w for w in ids if r.registry.find(w).state == DRAINING)
        assert [w.worker_id for w in r.registry.candidates("hot")] == [w for w in ids if w != victim]
        await asyncio.sleep(0.5)
        assert r.controller.scaling("hot") and r.nodes.stopped == []  # its request runs on
        r.registry.find(victim).inflight = 0  # it finished
        await wait_for(lambda: not r.controller.scaling("hot"), "the removal's end")
        assert r.nodes.stopped == [victim] and len(replica_nodes(r)) == 1
        await r.nodes.close()

    run(main())


def test_the_replica_removed_is_the_one_with_the_fewest_requests_in_flight(tmp_path):
    async def main():
        r = hot_fleet(tmp_path)
        busy, quiet = await two_replicas(r, in_flight=2)
        r.registry.find(busy).inflight = 2
        for _ in range(130):
            await step(r)
        assert r.nodes.stopped == [quiet]
        await r.nodes.close()

    run(main())


def test_min_replicas_are_placed_at_load_each_on_its_own_node(tmp_path):
    async def main():
        r = hot_fleet(tmp_path, min_replicas=3, max_replicas=0)
        await r.controller.load("hot")
        assert await step(r, 0.0) == [("hot", +1)]
        assert await step(r, 0.0) == [("hot", +1)]
        assert await step(r, 0.0) == []
        assert replica_nodes(r) == ["mac-1", "mac-2", "mac-3"]
        for _ in range(400):  # idle: never below min_replicas
            assert await step(r) == []
        described = r.controller.describe("hot")
        assert (described.replicas, described.min_replicas, described.max_replicas) == (3, 3, 0)
        assert described.status.startswith("serving on ")
        await r.nodes.close()

    run(main())


def test_the_proxy_tells_the_controller_each_requests_wait_for_its_first_token(tmp_path):
    async def main():
        r = fleet(tmp_path, nodes_cls=ServingNodes, connect=True)
        from cluster.api.wire import build_request

        told = []
        r.controller.request_waited = lambda model, seconds: told.append((model, seconds))
        request = build_request("hello", model="small", max_tokens=5)
        chunks = [c async for c in r.backend.generate(request, timeout=60)]
        assert chunks[-1].finish_reason
        assert len(told) == 1 and told[0][0] == "small" and 0 < told[0][1] < 60  # once, held for its load too
        chunks = [c async for c in r.backend.generate(request, timeout=60)]
        assert len(told) == 2
        await r.nodes.close()

    run(main())


def test_a_node_side_that_fetches_nothing_is_placed_again_on_the_nodes_that_hold_the_files(tmp_path):
    """Ray's nodes copy and pull nothing (UNIMPLEMENTED): the load is planned again without
    the nodes that lack the files, here unloading an idle model on the one that holds them."""

    async def main():
        r = fleet(tmp_path, budgets=(5.0,), models=(("small", 0.25), ("other", 4.6)))
        r.nodes.add_node("mac-2", 5.0, [])
        await r.controller.load("other")  # mac-1: the small one fits there only if it goes

        async def unimplemented(node_id, request, progress):
            raise FleetError(grpc.StatusCode.UNIMPLEMENTED, f"model {request.source!r} is not on Ray node {node_id}")

        r.nodes.fetch = unimplemented
        await r.controller.load("small")  # a copy to mac-2 is sooner than unloading: tried first
        assert [(n, s.model) for n, s in r.nodes.started] == [("mac-1", "other"), ("mac-1", "small")]
        assert r.sample("orchard_fleet_unloads_total", model="other", reason="evicted") == 1
        await r.nodes.close()

    run(main())


def test_a_replica_that_fails_to_start_is_tried_again_a_window_later_not_every_tick(tmp_path):
    async def main():
        r = hot_fleet(tmp_path)
        await r.controller.load("hot")
        for _ in range(8):
            r.controller.request_started("hot")
        r.nodes.exit_on_start = "out of memory"
        for _ in range(95):
            await step(r, waits=[5.0] * 3)
        assert len(r.nodes.started) == 1 + 3  # at 30, 60 and 90 s: one try a window
        assert "out of memory" in r.controller._scale_failed["hot"]
        assert len(replica_nodes(r)) == 1
        r.nodes.exit_on_start = None
        for _ in range(30):
            await step(r, waits=[5.0] * 3)
        assert len(replica_nodes(r)) == 2 and "hot" not in r.controller._scale_failed
        await r.nodes.close()

    run(main())


def test_a_load_timed_out_while_fetching_says_how_far_the_fetch_got(tmp_path):
    async def main():
        r = hub_fleet(tmp_path, budgets=(5.0,), load_timeout=1)
        r.nodes.fetch_gate = asyncio.Event()  # a slow hub
        with pytest.raises(FleetError) as e:
            await r.controller.load("chat")
        assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "while pulling to mac-1 from the hub 0%: a big model's files need a longer --load-timeout" \
            in e.value.message
        await r.nodes.close()

    run(main())


def test_a_node_lost_while_its_worker_loads_is_placed_around(tmp_path):
    async def main():
        r = fleet(tmp_path, budgets=(5.0, 5.0))
        r.nodes.load_delay = 3600  # the first worker never comes up
        loading = asyncio.ensure_future(r.controller.load("small"))
        await wait_for(lambda: r.nodes.started, "the first start")
        first_node = r.nodes.started[0][0]
        r.nodes.load_delay = 0.05
        lose(r, first_node)
        r.controller.replace_lost()
        await asyncio.wait_for(loading, 30)
        assert len(r.nodes.started) == 2 and r.nodes.started[1][0] != first_node and r.controller.serving("small")
        await r.nodes.close()

    run(main())


def test_a_stream_on_a_node_lost_waits_for_its_model_placed_again_and_resumes_token_exact(tmp_path):
    from cluster.api.wire import build_request
    from tests.fake_worker import fake_token

    async def main():
        r = fleet(tmp_path, budgets=(5.0, 5.0), nodes_cls=ServingNodes, connect=True)
        await r.controller.load("small")
        first_node, first = r.nodes.started[0][0], r.nodes.started[0][1].worker_id
        r.nodes.served[first].die_after_tokens = 10  # the Mac goes, mid-stream
        stop = asyncio.Event()
        running = asyncio.ensure_future(r.controller.run(stop))
        request = build_request("hello", model="small", max_tokens=40)
        streaming = asyncio.ensure_future(_collect(r.backend.generate(request, timeout=60)))
        await wait_for(lambda: r.nodes.served.get(first) is None or r.nodes.served[first].dead, "the worker's death")
        lose(r, first_node)
        chunks = await asyncio.wait_for(streaming, 60)
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == [fake_token(request, i) for i in range(40)] and chunks[-1].finish_reason
        assert [n for n, _ in r.nodes.started][1:] == ["mac-2" if first_node == "mac-1" else "mac-1"]
        stop.set()
        await running
        await r.nodes.close()
        await r.registry.close()

    run(main())


async def _collect(stream) -> list:
    return [c async for c in stream]


def test_a_node_whose_disk_budget_has_no_room_for_the_files_is_passed_over(tmp_path):
    async def main():
        r = hub_fleet(tmp_path, budgets=(5.0, 6.0))  # mac-2 has the most room: tried first
        fetch = r.nodes.fetch
        full = {"mac-2"}

        async def disk_budget(node_id, request, progress):
            if node_id in full:
                raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"node {node_id}: 3.0 GiB needed, 1.0 GiB "
                                                                     "free of its --disk-budget 10 GiB")
            return await fetch(node_id, request, progress)

        r.nodes.fetch = disk_budget
        await r.controller.load("chat")
        assert [n for n, _ in r.nodes.started] == ["mac-1"]
        await r.controller.unload("chat")
        r.nodes.reports["mac-1"].models.pop()
        full.add("mac-1")
        r.controller._errors.clear()
        with pytest.raises(FleetError) as e:
            await r.controller.load("chat")
        assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "onto mac-1: node mac-1: 3.0 GiB needed" in e.value.message and "onto mac-2" in e.value.message
        await r.nodes.close()

    run(main())


def test_a_replica_whose_files_are_copied_shows_the_copy_beside_the_serving_one(tmp_path):
    async def main():
        r = hot_fleet(tmp_path, budgets=(5.0,), max_replicas=2)
        r.nodes.add_node("mac-2", 5.0, [])
        await r.controller.load("hot")
        for _ in range(8):
            r.controller.request_started("hot")
        r.nodes.fetch_gate = asyncio.Event()
        for _ in range(40):
            if r.nodes.fetches:
                break
            for _ in range(3):
                r.controller.request_waited("hot", 5.0)
            r.clock.now += 1
            r.controller.scale()
            await asyncio.sleep(0.01)
        await wait_for(lambda: r.nodes.fetches, "the replica's copy")
        described = r.controller.describe("hot")
        assert described.state == "serving"
        assert described.status == "serving on mac-1; a replica copying to mac-2 from mac-1 0%"
        r.nodes.fetch_gate.set()
        await wait_for(lambda: replica_nodes(r) == ["mac-1", "mac-2"], "the replica")
        await r.nodes.close()

    run(main())


def test_a_model_lost_while_its_replica_is_being_added_waits_for_that_replica_not_a_second_one(tmp_path):
    """Its only serving replica's node lost while another replica's files are copied: the
    load that places it again waits for the replica being added (one placement of a model
    at a time in this router: they shared its bookkeeping), and nothing is started twice."""
    async def main():
        r = hub_fleet(tmp_path, budgets=(5.0, 5.0, 5.0), scale_up_wait=2.0, scale_window=30.0, scale_down_idle=120.0)
        r.add("chat", source="hf:org/chat", keep_alive_seconds=-1, max_replicas=2,
              engine_args=["--max-num-seqs", "4"], replace=True)
        await r.controller.load("chat")
        first = r.nodes.started[0][0]
        r.nodes.fetch_gate = asyncio.Event()
        for _ in range(40):
            if len(r.nodes.fetches) > 1:
                break
            for _ in range(3):
                r.controller.request_waited("chat", 5.0)
            r.clock.now += 1
            r.controller.scale()
            await asyncio.sleep(0.01)
        await wait_for(lambda: len(r.nodes.fetches) > 1, "the replica's copy")
        lose(r, first)
        assert r.controller.replace_lost() == ["chat"]
        await wait_for(lambda: r.controller.loading("chat"), "the load placing it again")
        await asyncio.sleep(0.2)  # a second placement would be fetching by now
        assert len(r.nodes.fetches) == 2
        r.nodes.fetch_gate.set()
        await wait_for(lambda: r.controller.serving("chat") and not r.controller.loading("chat"), "it served again")
        assert r.controller.load_error("chat") is None
        assert len(r.nodes.started) == 2 and r.nodes.started[1][0] == r.nodes.fetches[1][0]
        await r.nodes.close()

    run(main())


def test_an_operators_unload_during_a_replicas_fetch_leaves_no_replica_behind(tmp_path):
    """`orchard models unload` while another replica's files are on their way: the replica
    being added is given up with the rest (it started after the unload, and ran on)."""
    async def main():
        r = hub_fleet(tmp_path, scale_up_wait=2.0, scale_window=30.0, scale_down_idle=120.0)
        r.add("chat", source="hf:org/chat", keep_alive_seconds=-1, max_replicas=2,
              engine_args=["--max-num-seqs", "4"], replace=True)
        await r.controller.load("chat")
        r.nodes.fetch_gate = asyncio.Event()
        for _ in range(40):
            if len(r.nodes.fetches) > 1:
                break
            for _ in range(3):
                r.controller.request_waited("chat", 5.0)
            r.clock.now += 1
            r.controller.scale()
            await asyncio.sleep(0.01)
        await wait_for(lambda: len(r.nodes.fetches) > 1, "the replica's copy")
        await asyncio.wait_for(r.controller.unload("chat"), 30)
        r.nodes.fetch_gate.set()
        await wait_for(lambda: not r.controller.scaling("chat"), "the replica's end")
        assert not [m for p in r.controller.placed().values() for m in p.members if m.live]
        assert r.controller.describe("chat").state == "on disk"
        await r.nodes.close()

    run(main())


def test_the_run_loop_stopped_ends_its_loads_before_it_returns(tmp_path):
    """A load under way when the router stops is cancelled and has ended (its workers
    stopped, its claim released) when `run` returns: nothing of it runs on after the router
    closes its nodes and its loop."""
    async def main():
        r = hub_fleet(tmp_path)
        r.nodes.fetch_gate = asyncio.Event()
        stop = asyncio.Event()
        running = asyncio.ensure_future(r.controller.run(stop))
        r.controller.ensure_loaded("chat")
        await wait_for(lambda: r.nodes.fetches, "the fetch")
        loading = r.controller._loads["chat"]
        stop.set()
        await asyncio.wait_for(running, 30)
        assert loading.done()
        assert r.catalog.claim_of("chat") is None
        await r.nodes.close()

    run(main())


def test_a_group_formed_again_waits_for_its_rank_left_to_stop_and_evicts_nothing(tmp_path):
    """A group whose node is lost is formed again once its rank left has stopped: that rank's
    room is the group's to take, so no idle model elsewhere is unloaded for it, and no other
    node is drawn in. Found end to end (test_fleet_e2e's node lost mid-trace): a request
    held for the group started the load while the rank left was still draining."""
    from cluster.fleet.controller import TICK

    async def main():
        r = fleet(tmp_path, budgets=(5.0,) * 4, models=(("big", 7.0), ("other", 3.0)), load_timeout=60)
        for node in ("mac-3", "mac-4"):
            r.nodes.reports[node].memory_reserved_bytes = 5 * 2**30  # full, for now
        await r.controller.load("big")
        r.nodes.reports["mac-3"].memory_reserved_bytes = 0
        await r.controller.load("other")  # idle on mac-3 from now on
        r.nodes.reports["mac-4"].memory_reserved_bytes = 0
        ranks = {spec.group_rank: (node, spec.worker_id) for node, spec in r.nodes.started if spec.model == "big"}
        (kept_node, kept), (lost, _) = ranks[0], ranks[1]
        assert {kept_node, lost} == {"mac-1", "mac-2"}
        started = len(r.nodes.started)

        # the rank left drains for a while, as a real one does, its node saying "stopping"
        draining, drained = asyncio.Event(), asyncio.Event()
        stop = r.nodes.stop

        async def slow_stop(node_id: str, worker_id: str, drain_timeout: float) -> pb.ManagedWorker:
            if worker_id == kept:
                r.nodes._worker(node_id, worker_id).state = "stopping"
                draining.set()
                await drained.wait()
            return await stop(node_id, worker_id, drain_timeout)

        r.nodes.stop = slow_stop
        r.registry.remove(kept)  # its streams broke with the group
        lose(r, lost)
        stopping = asyncio.Event()
        running = asyncio.ensure_future(r.controller.run(stopping))
        held = asyncio.ensure_future(r.pool("big"))
        await asyncio.wait_for(draining.wait(), 30)
        await asyncio.sleep(3 * TICK)  # a window for a wrong plan: nothing may start or stop meanwhile
        assert len(r.nodes.started) == started and r.nodes.stopped == [], r.nodes.started[started:]
        drained.set()
        await asyncio.wait_for(held, 30)
        assert {node for node, spec in r.nodes.started[started:]} == {kept_node, "mac-4"}
        assert r.nodes.stopped == [kept]  # "other" still loaded
        stopping.set()
        await running
        await r.nodes.close()

    run(main())


def test_the_room_of_a_worker_stopped_counts_as_free_while_its_nodes_report_still_says_stopping(tmp_path):
    async def main():
        r = fleet(tmp_path, nodes_cls=lambda registries: FakeNodes(registries, stale=True))
        await r.controller.load("small")
        await r.controller.unload("small")
        [(node, worker)] = r.nodes.unreported
        worker.state = "stopping"  # the node's last report, from before the worker's exit
        assert r.controller._pending_bytes() == {node: -worker.reserved_bytes}
        await r.controller.load("other")  # room for one model only: "small"'s is free
        assert r.nodes.stopped == [r.nodes.started[0][1].worker_id] and r.nodes.started[1][0] == node
        await r.nodes.close()

    run(main())
