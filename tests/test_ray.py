"""`orchard ray up` on a local Ray instance: the router and 2 workers as actors serve
requests; killing a worker actor makes Ray restart it (max_restarts), it registers with
the router again, and requests keep succeeding throughout.

Skipped when Ray is not installed (`.venv/bin/pip install -e '.[ray]'`)."""

from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (.venv/bin/pip install -e '.[ray]')")

from cluster.cli import main  # noqa: E402
from cluster.ray_launcher import NAMESPACE, ROUTER_NAME, _share, existing_actors  # noqa: E402
from cluster.sdk import Client  # noqa: E402
from cluster.up import free_port  # noqa: E402

# ~30 s on 2 cores (Ray start, 3 actor processes, a restart): in the default run when Ray is installed.


def test_share_of_a_node_resource():
    assert _share(1, 2) == 0.5 and _share(1, 3) == 0.3333 and _share(4, 2) == 2.0 and _share(4, 3) == 1.0


def _workers(router: str):
    import grpc

    from cluster.proto.orchard.v1 import orchard_pb2 as pb
    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

    with grpc.insecure_channel(router) as ch:
        resp = pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5)
    return {w.worker_id: (w.address, w.state == pb.WORKER_STATE_HEALTHY) for w in resp.workers}


def test_an_empty_join_token_is_refused_unless_insecure(tiny_model_dir, monkeypatch, capsys):
    """Open registration on a LAN is a choice, never a default."""
    monkeypatch.delenv("ORCHARD_JOIN_TOKEN", raising=False)
    assert main(["ray", "up", "--model", str(tiny_model_dir)]) == 2
    assert "no join token" in capsys.readouterr().out


def test_router_and_workers_as_ray_actors_survive_a_killed_worker(tiny_model_dir, monkeypatch):
    import shutil
    import tempfile

    monkeypatch.setenv("ORCHARD_JOIN_TOKEN", "ray-test-token")  # from the environment, not the command line
    temp_dir = tempfile.mkdtemp(prefix="oray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray.init(num_cpus=2, resources={"orchard_worker": 1}, include_dashboard=False, _node_ip_address="127.0.0.1",
             namespace=f"orchard-test-{free_port()}", logging_level="WARNING", _temp_dir=temp_dir)
    try:
        # `orchard ray up`, as an operator runs it (detached actors in the "orchard" namespace)
        assert main(["ray", "up", "--model", str(tiny_model_dir), "--workers-per-node", "2", "--host", "127.0.0.1",
                     "--router-port", str(free_port()), "--router-http-port", "-1", "--router-metrics-port", "0",
                     "--worker-port", "0", "--worker-metrics-port", "0", "--max-restarts", "3",
                     "--policy", "round_robin", "--num-kv-blocks", "256", "--max-model-len", "512",
                     "--timeout", "180"]) == 0
        names = existing_actors()
        assert len(names) == 3 and ROUTER_NAME in names
        workers = {n: ray.get_actor(n, namespace=NAMESPACE) for n in names if n != ROUTER_NAME}
        router = ray.get(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE).addresses.remote(), timeout=30)["grpc"]
        before = _workers(router)
        assert len(before) == 2 and all(healthy for _, healthy in before.values())

        with Client(router, timeout=30) as c:
            served = {c.generate("The orchard", max_tokens=8, temperature=0, ignore_eos=True).worker_id
                      for _ in range(6)}
        assert served == set(before)  # round robin: both workers serve

        # Requests keep flowing while one worker actor is killed and restarted.
        errors, done, stop = [], [], threading.Event()

        def load():
            with Client(router, timeout=30) as c:
                deadline, i = time.monotonic() + 120, 0
                while not stop.is_set() and time.monotonic() < deadline:
                    i += 1
                    try:
                        r = c.generate(f"Once upon a time {i}", max_tokens=16, temperature=0, ignore_eos=True)
                        assert len(r.token_ids) == 16
                        done.append(r.worker_id)
                    except Exception as e:  # noqa: BLE001
                        errors.append(repr(e))
                    time.sleep(0.05)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        name, victim = sorted(workers.items())[0]
        old_pid = ray.get(victim.pid.remote(), timeout=30)
        time.sleep(1)
        ray.kill(victim, no_restart=False)  # as if the process died: Ray restarts it

        deadline = time.monotonic() + 120
        new_pid = None
        while time.monotonic() < deadline:  # ray.kill is asynchronous: the old process may answer once more
            try:
                new_pid = ray.get(victim.pid.remote(), timeout=10)
                if new_pid != old_pid:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            time.sleep(0.5)
        assert new_pid is not None and new_pid != old_pid, "Ray did not restart the worker actor"

        worker_id = name.removeprefix("orchard-")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # registered again, under the same id, at its new address
            now = _workers(router)
            if now.get(worker_id, ("", False))[1] and now[worker_id][0] != before[worker_id][0]:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the restarted worker did not register again: {_workers(router)}")
        n_before = len(done)
        deadline = time.monotonic() + 30
        while worker_id not in done[n_before:] and time.monotonic() < deadline:
            time.sleep(0.2)  # the restarted worker serves again
        stop.set()
        loader.join(60)
        assert worker_id in done[n_before:], "no request was served by the restarted worker"
        assert not errors, errors[:3]
        assert len(done) > 10

        assert main(["ray", "status"]) == 0
        assert main(["ray", "down"]) == 0
        deadline = time.monotonic() + 30
        while existing_actors() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert existing_actors() == []
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _free_run(n: int) -> int:
    """A port p with p .. p+n-1 and p+1000 free (a group's ring ports and rank 0's side channel)."""
    import socket

    for _ in range(100):
        p = free_port()
        if p + 1000 > 65535:
            continue
        socks = []
        try:
            for q in [*range(p, p + n), p + 1000]:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free run of ports")


@pytest.mark.slow
def test_a_worker_group_as_ray_actors_is_restarted_when_a_member_dies(tiny_model_dir, monkeypatch):
    """`orchard ray up --group-size 2`: a placement group of 2 bundles (PACK here: one node),
    rank 0 a worker actor, rank 1 a member actor; the router sees one worker with its
    group. Killing the member loses the group: Ray restarts both actors, the group forms
    again and serves; `orchard ray down` removes the actors and the placement group."""
    import shutil
    import tempfile

    from ray.util.placement_group import placement_group_table

    monkeypatch.setenv("ORCHARD_JOIN_TOKEN", "ray-group-token")
    temp_dir = tempfile.mkdtemp(prefix="orayg", dir="/tmp")
    ray.init(num_cpus=2, resources={"orchard_worker": 2}, include_dashboard=False, _node_ip_address="127.0.0.1",
             namespace=f"orchard-test-{free_port()}", logging_level="WARNING", _temp_dir=temp_dir)
    try:
        assert main(["ray", "up", "--model", str(tiny_model_dir), "--group-size", "2", "--group-strategy", "PACK",
                     "--group-port", str(_free_run(2)), "--host", "127.0.0.1", "--router-port", str(free_port()),
                     "--router-http-port", "-1", "--router-metrics-port", "0", "--worker-port", "0",
                     "--worker-metrics-port", "0", "--max-restarts", "3", "--num-kv-blocks", "128",
                     "--max-model-len", "512", "--timeout", "240"]) == 0
        names = existing_actors()
        assert sorted(names) == [ROUTER_NAME, "orchard-worker-g0", "orchard-worker-g0-rank1"]
        router = ray.get(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE).addresses.remote(), timeout=30)["grpc"]
        import grpc

        from cluster.proto.orchard.v1 import orchard_pb2 as pb
        from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

        def listed():
            with grpc.insecure_channel(router) as ch:
                return pb_grpc.RouterStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers

        (w,) = listed()
        assert w.worker_id == "worker-g0" and w.load.group.size == 2
        with Client(router, timeout=60) as c:
            first = c.generate("The orchard", max_tokens=8, temperature=0, ignore_eos=True).token_ids
        member = ray.get_actor("orchard-worker-g0-rank1", namespace=NAMESPACE)
        rank0 = ray.get_actor("orchard-worker-g0", namespace=NAMESPACE)
        pids = (ray.get(member.pid.remote(), timeout=30), ray.get(rank0.pid.remote(), timeout=30))
        ray.kill(member, no_restart=False)  # the member's process dies: the group is lost
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                now = (ray.get(member.pid.remote(), timeout=10), ray.get(rank0.pid.remote(), timeout=10))
                ws = listed()
                if now[0] != pids[0] and now[1] != pids[1] and ws and ws[0].state == pb.WORKER_STATE_HEALTHY \
                        and ws[0].address != w.address:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, grpc.RpcError):
                pass
            time.sleep(1)
        else:
            pytest.fail("the group did not come back after its member died")
        with Client(router, timeout=60) as c:
            again = c.generate("The orchard", max_tokens=8, temperature=0, ignore_eos=True).token_ids
        assert again == first
        assert main(["ray", "down"]) == 0
        deadline = time.monotonic() + 30
        while existing_actors() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert existing_actors() == []
        assert all(i["state"] == "REMOVED" for i in placement_group_table().values()
                   if i.get("name", "").startswith("orchard-group-"))
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_an_insecure_ray_group_gets_a_join_token_of_its_own(tiny_model_dir, monkeypatch):
    """`orchard ray up --insecure --group-size 2` with no join token: the router is open, but
    a group never runs without a token (its ranks refuse to start), so the launcher makes one
    for the group's actors, and the group forms and serves."""
    import shutil
    import tempfile

    monkeypatch.delenv("ORCHARD_JOIN_TOKEN", raising=False)
    temp_dir = tempfile.mkdtemp(prefix="orayi", dir="/tmp")
    ray.init(num_cpus=2, resources={"orchard_worker": 2}, include_dashboard=False, _node_ip_address="127.0.0.1",
             namespace=f"orchard-test-{free_port()}", logging_level="WARNING", _temp_dir=temp_dir)
    try:
        assert main(["ray", "up", "--model", str(tiny_model_dir), "--insecure", "--group-size", "2",
                     "--group-strategy", "PACK", "--group-port", str(_free_run(2)), "--host", "127.0.0.1",
                     "--router-port", str(free_port()), "--router-http-port", "-1", "--router-metrics-port", "0",
                     "--worker-port", "0", "--worker-metrics-port", "0", "--max-restarts", "0",
                     "--num-kv-blocks", "128", "--max-model-len", "512", "--timeout", "240"]) == 0
        router = ray.get(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE).addresses.remote(), timeout=30)["grpc"]
        with Client(router, timeout=60) as c:
            assert len(c.generate("The orchard", max_tokens=4, temperature=0, ignore_eos=True).token_ids) == 4
        assert main(["ray", "down"]) == 0
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# -- restarts: a backoff between Ray's restarts, none after a permanent failure -------------------

class _Clock:
    def __init__(self):
        self.now = 1000.0
        self.slept = []

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_a_restarted_actor_waits_a_growing_backoff_first(monkeypatch, tmp_path):
    """Ray restarts a dead actor at once (a group lost, a member late: exit 75): each
    restart waits 1, 2, 4 ... s, capped at 60 s, and a run past the reset time starts over."""
    import cluster.ray_launcher as rl

    clock = _Clock()
    context = type("Context", (), {"was_current_actor_reconstructed": False, "get_actor_id": lambda self: "a1"})()
    monkeypatch.setattr(rl, "time", clock)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    assert rl.back_off_if_restarted(state_dir=str(tmp_path)) == 0  # the first start waits nothing
    context.was_current_actor_reconstructed = True
    delays = []
    for _ in range(8):
        clock.now += 2  # it ran 2 s and died
        delays.append(rl.back_off_if_restarted(state_dir=str(tmp_path)))
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60] and clock.slept == delays
    clock.now += 400  # a healthy run
    assert rl.back_off_if_restarted(state_dir=str(tmp_path)) == 1


def test_an_actor_that_fails_for_good_is_killed_with_no_restart(monkeypatch):
    """A permanent failure (78) kills the actor with no_restart (an exit would be restarted
    by Ray for ever, reloading the model each time); a transient one exits for Ray to restart."""
    import cluster.ray_launcher as rl

    killed, exited = [], []

    class Ended(Exception):
        pass

    def kill(handle, no_restart):
        killed.append((handle, no_restart))
        raise Ended

    def exit_(code):
        exited.append(code)
        raise Ended

    monkeypatch.setattr(ray, "kill", kill)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("C", (), {"current_actor": "me"})())
    monkeypatch.setattr(rl.os, "_exit", exit_)
    monkeypatch.setattr(rl.logging, "shutdown", lambda: None)
    with pytest.raises(Ended):
        rl.end_actor(78, "group rank 1")
    assert killed == [("me", True)] and exited == []
    with pytest.raises(Ended):
        rl.end_actor(75, "group rank 1")
    assert exited == [75] and len(killed) == 1


@pytest.mark.slow
def test_ray_does_not_restart_a_member_refused_for_good():
    """A member actor with a wrong join token (max_restarts=-1): refused once, killed with
    no restart; it used to exit 75 and be restarted (and refused) for ever."""
    import tempfile

    from cluster.ray_launcher import GroupMemberActor, RaySpec
    from cluster.worker.group.channel import Leader
    from cluster.worker.group.config import GroupOptions

    leader = Leader(("127.0.0.1", 0), 2, "the-token", 5.0, on_lost=lambda reason: None)
    tries, handshake = [], leader._handshake
    leader._handshake = lambda sock, deadline: tries.append(1) or handshake(sock, deadline)
    threading.Thread(target=leader.admit, args=(time.monotonic() + 120,), daemon=True).start()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             namespace=f"orchard-test-{free_port()}", _temp_dir=tempfile.mkdtemp(prefix="oray", dir="/tmp"))
    try:
        options = GroupOptions(size=2, rank=1, port=leader.address[1], join_timeout=30,
                               hosts=f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}")
        actor = ray.remote(GroupMemberActor).options(max_restarts=-1, num_cpus=0).remote(
            RaySpec(model="unused", join_token="not-the-token"), options)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                ray.get(actor.addresses.remote(), timeout=10)
            except ray.exceptions.ActorDiedError:
                break
            time.sleep(0.5)
        else:
            raise TimeoutError("the refused member's actor is still alive")
        time.sleep(5)  # a restart (after a 1 s backoff) would have tried to join again by now
        with pytest.raises(ray.exceptions.ActorDiedError):
            ray.get(actor.addresses.remote(), timeout=10)
        assert len(tries) == 1, "the member tried to join again: it was restarted"
    finally:
        ray.shutdown()
        leader.close()


def test_a_group_actor_finds_the_ranks_where_their_bundles_are_as_it_starts():
    """Where a group's ranks are is found inside each of its actors as it starts (again at
    each restart): its own address from its node, the others' from the nodes that hold
    their bundles now; never `--host` (one address for every rank, on every node)."""
    import shutil
    import tempfile

    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.ray_launcher import GROUP_PREFIX, RaySpec, group_hosts

    temp_dir = tempfile.mkdtemp(prefix="orayh", dir="/tmp")
    ray.init(num_cpus=2, resources={"orchard_worker": 2}, include_dashboard=False, _node_ip_address="127.0.0.1",
             namespace=f"orchard-test-{free_port()}", logging_level="WARNING", _temp_dir=temp_dir)
    try:
        spec = RaySpec(model="unused", host="10.9.8.7", group_size=2, group_port=40000)
        pg = placement_group([{"orchard_worker": 1}] * 2, strategy="PACK", name=f"{GROUP_PREFIX}1")
        ray.get(pg.ready(), timeout=60)
        (node,) = ray.nodes()
        ip = node["NodeManagerAddress"]  # what Ray lists for the node (not necessarily _node_ip_address)
        resolve = ray.remote(num_cpus=0)(group_hosts)
        for rank in range(2):
            in_bundle = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
            assert ray.get(resolve.options(scheduling_strategy=in_bundle).remote(spec, 1, rank),
                           timeout=60) == f"{ip}:40002,{ip}:40003"
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
