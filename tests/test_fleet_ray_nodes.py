"""`RayNodes` (cluster/fleet/ray_nodes.py), the fleet's node side over Ray, on one local
Ray instance shared by the module: it lists the node with its memory and the models on
its disk; `start` makes a worker actor that registers with a router and serves, is
restarted by Ray when it dies, and `stop` drains it and kills it for good.

Skipped when Ray is not installed (`.venv/bin/pip install -e '.[ray]'`)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time

import grpc
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (.venv/bin/pip install -e '.[ray]')")

from cluster.fleet import FleetError  # noqa: E402
from cluster.fleet.ray_nodes import FLEET_PREFIX, RayNodes  # noqa: E402
from cluster.proto.orchard.v1 import orchard_pb2 as pb  # noqa: E402
from cluster.ray_launcher import NAMESPACE, RaySpec, _LoopThread  # noqa: E402
from cluster.router.registry import HEALTHY  # noqa: E402
from cluster.up import free_port  # noqa: E402
from conftest import wait_for  # noqa: E402

GiB = 1 << 30
RAY_MEMORY = 6 * GiB  # the node's Ray `memory` resource here
TOKEN = "ray-nodes-token"


@pytest.fixture(scope="module")
def ray_node():
    temp_dir = tempfile.mkdtemp(prefix="orayn", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray.init(num_cpus=2, resources={"orchard_worker": 1}, include_dashboard=False, _node_ip_address="127.0.0.1",
             namespace=f"orchard-test-{free_port()}", logging_level="WARNING", _temp_dir=temp_dir,
             _memory=RAY_MEMORY)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def loop():
    """The asyncio loop the router (and so RayNodes) runs on."""
    thread = _LoopThread("test-ray-nodes")
    yield thread
    thread.loop.call_soon_threadsafe(thread.loop.stop)


def test_ray_nodes_import_no_mlx():
    """RayNodes runs in the router's actor, which never imports MLX."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['mlx'] = None; import cluster.fleet.ray_nodes, cluster.ray_launcher; "
            "print('mlx' in sys.modules and sys.modules['mlx'] is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr


def _nodes(models_dir, router="127.0.0.1:1", **kw) -> RayNodes:
    spec = RaySpec(model="unused", host="127.0.0.1", join_token=TOKEN, max_restarts=3, detached=False)
    return RayNodes(spec, router, str(models_dir), **kw)


def test_a_ray_worker_gets_the_specs_pool_and_requests_at_once(tmp_path):
    """As the agent's workers: the blocks and --max-num-seqs the controller's footprint counted."""
    from cluster.fleet.ray_nodes import worker_options

    spec = pb.WorkerSpec(worker_id="w-1", model="m", source="m", context=512, num_kv_blocks=64, max_num_seqs=6,
                         group_size=2, group_rank=0, group_hosts=["127.0.0.1:7000", "127.0.0.1:7001"])
    options = worker_options(_nodes(tmp_path).worker_flags(spec, str(tmp_path), "127.0.0.1", 7100))
    assert (options.engine_config.num_kv_blocks, options.engine_config.max_num_seqs) == (64, 6)


def test_ray_nodes_fetch_only_what_a_node_holds_and_say_so_for_the_rest(tmp_path):
    """The fleet over Ray copies and pulls nothing: a model on the node is there; any other
    is UNIMPLEMENTED, saying what to do."""
    from cluster.fleet.ray_nodes import _Node

    nodes = _nodes(tmp_path)
    nodes._nodes["n1"] = _Node("ray-1", "127.0.0.1", 1 << 30, pb.NodeReport(
        node_id="n1", models=[pb.DiskModel(name="dense", weight_bytes=5), pb.DiskModel(name="small.gguf")]))

    async def go():
        here = await nodes.fetch("n1", pb.FetchModelRequest(source="small"), lambda p: None)
        assert here.done and getattr(here, "from") == "disk" and here.path == str(tmp_path / "small.gguf")
        assert (await nodes.describe("n1", "dense")).weight_bytes == 5
        for call in (nodes.fetch("n1", pb.FetchModelRequest(source="hf:acme/x"), lambda p: None),
                     nodes.describe("n1", "hf:acme/x")):
            with pytest.raises(FleetError) as e:
                await call
            assert e.value.code == grpc.StatusCode.UNIMPLEMENTED and "hf:acme/x" in e.value.message

    asyncio.run(go())


def test_nodes_lists_the_ray_node_with_its_memory_and_the_models_on_its_disk(ray_node, loop, tiny_model_dir):
    nodes = _nodes(tiny_model_dir.parent)
    assert nodes.nodes() == []  # nothing probed yet (and no loop here to probe on)
    loop.run(nodes.refresh(), timeout=120)
    (info,) = nodes.nodes()
    report = info.report
    assert info.state == "healthy"
    assert report.node_id == RayNodes.node_id(ray.get_runtime_context().get_node_id())
    assert report.memory_budget_bytes == RAY_MEMORY and report.memory_reserved_bytes == 0
    assert report.memory_available_bytes > 0 and report.disk_free_bytes > 0
    assert report.platform in ("cpu", "metal") and report.advertise_host == "127.0.0.1"
    (model,) = report.models  # facts.scan's, run on the node
    assert model.name == tiny_model_dir.name and model.weight_bytes > 0 and model.num_layers > 0
    assert list(report.workers) == []

    capped = _nodes(tiny_model_dir.parent, memory_budget=GiB)  # --memory-budget caps Ray's memory resource
    loop.run(capped.refresh(), timeout=120)
    assert capped.nodes()[0].report.memory_budget_bytes == GiB


def test_wait_changed_says_when_a_refresh_came(ray_node, loop, tiny_model_dir):
    nodes = _nodes(tiny_model_dir.parent, refresh_interval=0.5)
    assert loop.run(nodes.wait_changed(60), timeout=90)  # the first refresh
    assert nodes.nodes()
    assert loop.run(nodes.wait_changed(60), timeout=90)  # the next, an interval later


def test_start_refuses_with_the_reason_before_starting_anything(ray_node, loop, tiny_model_dir):
    nodes = _nodes(tiny_model_dir.parent)
    loop.run(nodes.refresh(), timeout=120)
    node_id = nodes.nodes()[0].report.node_id

    def refused(node, **spec) -> FleetError:
        with pytest.raises(FleetError) as e:
            loop.run(nodes.start(node, pb.WorkerSpec(worker_id="w1", model="tiny", **spec)), timeout=60)
        return e.value

    e = refused("ray-nowhere", source=tiny_model_dir.name)
    assert e.code == grpc.StatusCode.NOT_FOUND and "ray-nowhere" in e.message and node_id in e.message
    e = refused(node_id, source="not-here")
    assert e.code == grpc.StatusCode.NOT_FOUND and "'not-here'" in e.message
    assert str(tiny_model_dir.parent) in e.message
    e = refused(node_id, source=tiny_model_dir.name, reserved_bytes=7 * GiB)
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs 7.0 GiB" in e.message and "has 6.0 GiB of 6.0 GiB free" in e.message
    e = refused(node_id, source=tiny_model_dir.name, reserved_bytes=GiB, engine_args=["--no-such-flag"])
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "--no-such-flag" in e.message
    e = refused(node_id, source="")
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "spec.source" in e.message
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(FLEET_PREFIX)]

    # an actor of that name runs (not one of the fleet's here): refused, and never taken for one
    from collections import Counter

    squatter = ray.remote(num_cpus=0)(Counter).options(name=f"{FLEET_PREFIX}w1", namespace=NAMESPACE).remote()
    try:
        loop.run(nodes.refresh(), timeout=120)
        assert list(nodes.nodes()[0].report.workers) == []
        e = refused(node_id, source=tiny_model_dir.name, reserved_bytes=GiB)
        assert e.code == grpc.StatusCode.ALREADY_EXISTS and "w1" in e.message
    finally:
        ray.kill(squatter, no_restart=True)
    with pytest.raises(FleetError) as stopped:
        loop.run(nodes.stop(node_id, "w1", 1.0), timeout=60)
    assert stopped.value.code == grpc.StatusCode.NOT_FOUND


async def _start_router():
    """A router on a free port that the tests' Ray workers register with."""
    from cluster.router.config import RouterConfig
    from cluster.router.server import RouterServer

    server = RouterServer(RouterConfig(grpc_address=f"127.0.0.1:{free_port()}", http_address=None,
                                       metrics_address=None, join_token=TOKEN, heartbeat_interval=0.5))
    await server.start()
    return server


def _until(what: str, check, timeout: float = 240.0, every: float = 0.5):
    """conftest's wait_for, with this file's generous default for Ray's starts."""
    return wait_for(check, timeout, what, every)


def _pid(handle):
    try:
        return ray.get(handle.pid.remote(), timeout=10)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


@pytest.mark.slow
def test_a_started_worker_serves_is_restarted_by_ray_and_stops_drained(ray_node, loop, tiny_model_dir):
    """start -> the actor registers with the router and serves; a new RayNodes (a restarted
    router's) finds it; killed, Ray restarts it and
    it registers again (same id, same port); stop with a stream in flight -> the stream finishes, then the actor
    is gone for good and its memory is free again."""
    from cluster.sdk import Client

    router = loop.run(_start_router(), timeout=60)
    nodes = _nodes(tiny_model_dir.parent, router=router.grpc_address)
    try:
        loop.run(nodes.refresh(), timeout=120)
        node_id = nodes.nodes()[0].report.node_id
        spec = pb.WorkerSpec(worker_id="tiny-1", model="chat", source=tiny_model_dir.name,
                             context=512, kv_cache_bytes=8 << 20, reserved_bytes=GiB)
        started = loop.run(nodes.start(node_id, spec), timeout=60)
        assert started.worker_id == "tiny-1" and started.state == "starting" and started.reserved_bytes == GiB
        report = nodes.nodes()[0].report
        assert report.memory_reserved_bytes == GiB and [w.worker_id for w in report.workers] == ["tiny-1"]
        nodes.max_loaded = 1  # --max-loaded 1: a second model does not start here
        assert nodes.nodes()[0].report.max_loaded == 1
        with pytest.raises(FleetError) as e:
            loop.run(nodes.start(node_id, pb.WorkerSpec(worker_id="other-1", model="other", source=spec.source)),
                     timeout=60)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loaded 1" in e.value.message
        nodes.max_loaded = 0

        def healthy():
            return [w for w in router.registry.serving("chat")
                    if w.worker_id == "tiny-1" and w.state == HEALTHY]

        first = _until("the worker registers with the router", healthy)[0]
        address, instance = first.address, first.instance  # (the registry updates its record in place)
        with Client(router.grpc_address, timeout=60) as c:
            r = c.generate("The orchard", model="chat", max_tokens=8, temperature=0, ignore_eos=True)
        assert r.worker_id == "tiny-1" and len(r.token_ids) == 8
        loop.run(nodes.refresh(), timeout=120)
        (w,) = nodes.nodes()[0].report.workers
        assert w.state == "running" and w.address == address

        # a restarted router's RayNodes finds the fleet's actors again, with their specs
        again = _nodes(tiny_model_dir.parent, router=router.grpc_address)
        loop.run(again.refresh(), timeout=120)
        _until("the new RayNodes finds the worker", lambda: loop.run(again.refresh(), timeout=120)
               or again.nodes()[0].report.workers)
        (found,) = again.nodes()[0].report.workers
        assert (found.worker_id, found.model, found.reserved_bytes, found.state) == ("tiny-1", "chat", GiB, "running")
        assert again.nodes()[0].report.memory_reserved_bytes == GiB

        # the process dies: Ray starts it again where it was, and it registers again
        actor = ray.get_actor(f"{FLEET_PREFIX}tiny-1", namespace=NAMESPACE)
        old_pid = _pid(actor)
        ray.kill(actor, no_restart=False)
        _until("Ray restarts the actor", lambda: (_pid(actor) or old_pid) != old_pid)
        _until("the restarted worker registers again",  # the same id and port, from its new process
               lambda: [w for w in healthy() if w.instance != instance])
        with Client(router.grpc_address, timeout=60) as c:
            assert c.generate("The orchard", max_tokens=8, temperature=0, ignore_eos=True).token_ids == r.token_ids

        # stop with a stream in flight: it is drained first, then killed with no restart
        got, errors, first_chunk = [], [], threading.Event()

        def stream():
            try:
                with Client(router.grpc_address, timeout=120) as c:
                    for chunk in c.stream("Once upon a time", max_tokens=96, temperature=0, ignore_eos=True):
                        got.extend(chunk.token_ids)
                        first_chunk.set()
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                first_chunk.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first_chunk.wait(120)
        stopped = loop.run(nodes.stop(node_id, "tiny-1", 120.0), timeout=200)
        reader.join(120)
        assert not errors and len(got) == 96  # the request in flight finished on it
        assert stopped.state == "exited" and stopped.worker_id == "tiny-1"
        _until("the actor is gone", lambda: _pid(actor) is None)
        time.sleep(3)  # a restart (after its backoff) would have answered by now
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.pid.remote(), timeout=30)
        report = nodes.nodes()[0].report
        assert report.memory_reserved_bytes == 0 and list(report.workers) == []
    finally:
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"].startswith(FLEET_PREFIX):
                ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
        loop.run(router.stop(grace=0), timeout=60)


@pytest.mark.parametrize("argv, says", [
    ([], "nothing to serve: --model DIR"),
    (["--model", "m", "--catalog", "c.db"], "--model and --catalog: one or the other"),
    (["--catalog", "c.db", "--group-size", "2"], "--group-size with --catalog"),
    (["--catalog", "c.db", "--load-timeout", "0"], "--load-timeout must be > 0"),
    (["--catalog", "c.db", "--max-loaded", "-1"], "--max-loaded must be >= 0, not -1"),
])
def test_ray_up_says_what_is_wrong_with_what_it_serves_before_joining_ray(argv, says, monkeypatch, capsys):
    from cluster.cli import main

    monkeypatch.setenv("ORCHARD_JOIN_TOKEN", TOKEN)
    monkeypatch.setattr("cluster.ray_launcher._init", lambda address: pytest.fail("joined Ray"))
    assert main(["ray", "up", *argv]) == 2
    out = capsys.readouterr().out
    assert out.startswith("orchard ray up: ") and says in out and len(out.strip().splitlines()) == 1


def test_ray_up_with_a_catalog_loads_a_model_on_a_ray_node_when_a_request_names_it(ray_node, tiny_model_dir,
                                                                                  tmp_path, monkeypatch, capsys):
    """`orchard ray up --catalog FILE`: the router alone at first; `orchard models add`, then
    a request for the model: the router's fleet controller starts one worker actor for it on
    the Ray node, and it serves; `orchard models unload` drains and ends it, `load` starts it
    again; `orchard ray down` ends it with the router."""
    from cluster.cli import main
    from cluster.ray_launcher import ROUTER_NAME, existing_actors
    from cluster.sdk import Client
    from test_ray import _workers

    monkeypatch.setenv("ORCHARD_JOIN_TOKEN", TOKEN)
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / "tiny").symlink_to(tiny_model_dir, target_is_directory=True)
    try:
        assert main(["ray", "up", "--catalog", str(tmp_path / "catalog.db"), "--models-dir", str(models_dir),
                     "--host", "127.0.0.1", "--router-port", str(free_port()), "--router-http-port", "-1",
                     "--router-metrics-port", "-1", "--max-restarts", "3", "--fleet-context", "512",
                     "--timeout", "180"]) == 0
        assert existing_actors() == [ROUTER_NAME]  # no worker until a model is asked for
        router = ray.get(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE).addresses.remote(), timeout=30)["grpc"]
        assert main(["models", "add", "chat", "--source", "tiny", "--router", router]) == 0
        with Client(router, timeout=300) as c:
            r = c.generate("The orchard", model="chat", max_tokens=8, temperature=0, ignore_eos=True)
        assert len(r.token_ids) == 8
        (worker,) = [n for n in existing_actors() if n.startswith(FLEET_PREFIX)]
        assert worker == f"{FLEET_PREFIX}{r.worker_id}"
        capsys.readouterr()
        assert main(["models", "list", "--router", router]) == 0
        assert "serving on ray-" in capsys.readouterr().out
        assert main(["models", "unload", "chat", "--router", router]) == 0  # drained, then its actor killed
        _until("the unloaded model's actor is gone", lambda: existing_actors() == [ROUTER_NAME], timeout=60)
        # (the router forgets the stopped worker when it misses its heartbeats: a load before
        # that finds it still "serving", the controller's concern, not the node side's)
        _until("the router no longer counts the unloaded worker", lambda: not any(
            healthy for _, healthy in _workers(router).values()), timeout=60)
        assert main(["models", "load", "chat", "--router", router]) == 0  # loaded again by hand: a new actor
        assert [n for n in existing_actors() if n.startswith(FLEET_PREFIX)]
        assert main(["ray", "down"]) == 0
        _until("orchard ray down ends the router and the fleet's workers", lambda: existing_actors() == [],
               timeout=60)
    finally:
        for name in existing_actors():
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)


@pytest.mark.slow
def test_a_group_started_rank_by_rank_serves_and_stops(ray_node, loop, tiny_model_dir):
    """A pipeline group of 2 as the controller starts one: ports reserved on the node, rank 1
    (a member actor) and rank 0 (a worker actor) started with the ring's hosts; the router
    sees one worker of group size 2 that serves; stopping rank 0 (drained) and the member
    ends both actors."""
    from cluster.sdk import Client

    router = loop.run(_start_router(), timeout=60)
    nodes = _nodes(tiny_model_dir.parent, router=router.grpc_address)
    try:
        loop.run(nodes.refresh(), timeout=120)
        node_id = nodes.nodes()[0].report.node_id
        ring0, side = loop.run(nodes.reserve_ports(node_id, 2), timeout=60)
        (ring1,) = loop.run(nodes.reserve_ports(node_id, 1), timeout=60)
        assert len({ring0, side, ring1}) == 3
        common = dict(model="chat", source=tiny_model_dir.name, context=512, kv_cache_bytes=4 << 20,
                      reserved_bytes=GiB // 2, group_size=2, group_hosts=[f"127.0.0.1:{ring0}", f"127.0.0.1:{ring1}"],
                      group_port=side, group_shares="1,1", memory_budget_bytes=GiB // 2)
        for rank, worker_id in ((1, "g-rank-1"), (0, "g")):
            loop.run(nodes.start(node_id, pb.WorkerSpec(worker_id=worker_id, group_rank=rank, **common)), timeout=60)
        assert nodes.nodes()[0].report.memory_reserved_bytes == GiB

        def serving():
            return [w for w in router.registry.serving("chat") if w.state == HEALTHY and w.report.group.size == 2]

        (w,) = _until("the group registers with the router", serving)
        assert w.worker_id == "g"
        with Client(router.grpc_address, timeout=60) as c:
            assert len(c.generate("The orchard", model="chat", max_tokens=8, temperature=0,
                                  ignore_eos=True).token_ids) == 8
        actors = {w: ray.get_actor(f"{FLEET_PREFIX}{w}", namespace=NAMESPACE) for w in ("g", "g-rank-1")}

        # the member dies for good: reported exited (why, and its exit), its memory no longer reserved
        ray.kill(actors["g-rank-1"], no_restart=True)
        _until("the member is reported exited", lambda: loop.run(nodes.refresh(), timeout=120) or [
            w for w in nodes.nodes()[0].report.workers if w.worker_id == "g-rank-1" and w.state == "exited"])
        (member,) = [w for w in nodes.nodes()[0].report.workers if w.worker_id == "g-rank-1"]
        assert member.exit_code == 78 and member.reason
        assert nodes.nodes()[0].report.memory_reserved_bytes == GiB // 2
        for worker_id in actors:
            assert loop.run(nodes.stop(node_id, worker_id, 60.0), timeout=120).state == "exited"
        for worker_id, actor in actors.items():
            _until(f"{worker_id}'s actor is gone", lambda actor=actor: _pid(actor) is None)
        assert nodes.nodes()[0].report.memory_reserved_bytes == 0
    finally:
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"].startswith(FLEET_PREFIX):
                ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
        loop.run(router.stop(grace=0), timeout=60)
