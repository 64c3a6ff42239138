"""`orchard ray up|down|status`: the router and the workers as Ray actors on an existing
Ray cluster.

- The router runs on the node where `orchard ray up` runs (the driver's node).
- Workers run on every alive node that carries the Ray resource you name (default
  `orchard_worker`: start those nodes with `ray start --resources '{"orchard_worker": 1}'`),
  `--workers-per-node` of them per node, pinned there. Each takes an equal share of the
  node's amount of that resource, so a second `ray up` cannot double-book a node.
- Every actor is created with `max_restarts`: when one dies (crash, OOM, `ray.kill`), Ray
  starts it again on the same node; a restarted worker registers with the router again
  (same worker id), the router forgets the dead stream and places new requests on it.
  Ray restarts at once, so a restarted worker or member waits its backoff first
  (`cluster/exit_codes.py`: 1 s doubling to 60 s). A permanent failure (exit code 78: a
  model that does not load, a wrong join token, a model that is not rank 0's) ends the
  actor for good (an error in its constructor, or `ray.kill(no_restart=True)`), the
  reason in its log: Ray does not start it again.
- Actors are named (`orchard-router`, `orchard-worker-<node>-<i>`) in the `orchard`
  namespace and detached by default, so they outlive `orchard ray up`; `orchard ray down`
  kills them.
- `--group-size N`: each worker is a worker group (one model over N Macs,
  `cluster/worker/group/`): a placement group of N bundles, one per node (STRICT_SPREAD),
  rank 0 a worker actor in the first bundle (`orchard-worker-g<i>`), the other ranks
  member actors in the others (`orchard-worker-g<i>-rank<r>`), over MLX's ring on the
  nodes' Ray IPs. Each actor finds the addresses when it starts, not at launch: its own
  from the node it runs on, rank 0's from the node that holds rank 0's bundle now; rank 0
  learns each member's from the member as it joins and hands the ring to every rank
  (`cluster/worker/group/`). When one of them dies the others exit (the group is lost)
  and Ray restarts each actor; they find each other again, wherever their bundles are by
  then. `--host` is the router's and the workers' gRPC address; a
  group's ring is always on each node's own IP.
- `--catalog FILE` (instead of `--model`): a fleet. Only the router starts; its fleet
  controller loads the catalog's models on demand as worker actors (and groups) on the
  resource's nodes, from `--models-dir`, by memory (`cluster/fleet/ray_nodes.py`).

Each actor runs the same server objects as the CLI (`RouterServer`, `WorkerServer`) on
its own asyncio loop in a thread; the model directory must exist at the same path on every
worker node.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn

from cluster import platform
from cluster.config import ByteSize, default_of, port_of, setting
from cluster.exit_codes import EXIT_TRANSIENT, Backoff, describe, exit_code, is_permanent
from cluster.fleet.config import FleetConfig
from cluster.fleet.node_config import DEFAULT_MODELS_DIR
from cluster.router.config import RouterConfig, policy_names
from cluster.security import SecurityConfig, inference_keys
from cluster.worker.config import EngineConfig, WorkerOptions

log = logging.getLogger(__name__)

NAMESPACE = "orchard"
ROUTER_NAME = "orchard-router"
WORKER_PREFIX = "orchard-worker-"


@dataclass(frozen=True)
class RaySpec:
    """`orchard ray up`: what the router and worker actors run. Ports default to the
    router's and the worker's own default addresses; the other settings are theirs."""

    model: str | None = setting(None, "mlx-lm model directory, at the same path on every worker node (none with "
                                      "--catalog)")
    workers_per_node: int = setting(1, "worker actors on each worker node")
    resource: str = setting("orchard_worker", "Ray resource that marks worker nodes")
    host: str | None = setting(None, "the router's and workers' bind/advertise address (default: each node's Ray "
                                      "IP; a group's ring is always on each node's own)")
    router_port: int = setting(port_of(RouterConfig.grpc_address),
                               "router gRPC port (0: any free one, and a restart moves the router)")
    router_http_port: int | None = setting(port_of(RouterConfig.http_address), "OpenAI HTTP port (-1: off)", off=-1)
    router_metrics_port: int | None = setting(port_of(RouterConfig.metrics_address), "router metrics port (-1: off)",
                                              off=-1)
    worker_port: int = setting(port_of(WorkerOptions.grpc_address), "worker i on a node: port+i (0: free ports)")
    worker_metrics_port: int | None = setting(port_of(WorkerOptions.metrics_address),
                                              "worker i: port+i (0: free, -1: off)", off=-1)
    join_token: str = setting(RouterConfig.join_token, "workers present it to the router",
                              env="ORCHARD_JOIN_TOKEN")
    policy: str = setting(RouterConfig.policy, "the router's placement policy", choices=policy_names)
    max_restarts: int = setting(-1, "Ray restarts of a dead actor, each after a backoff (1 s doubling to 60 s; -1: "
                                    "for ever); a permanent failure (a model that does not load) is not restarted")
    timeout: float = setting(600.0, "seconds to wait for the workers")
    insecure: bool = setting(False, "allow an empty join token: anyone on the network may then register a worker")
    group_size: int = setting(1, "nodes per worker group (one model over several Macs; 1: a worker per node)")
    parallel: str = setting("pipeline", "how a group splits the model", choices=("pipeline", "tensor"))
    group_port: int = setting(32323, "a group's ring ports: rank r of group g on this + g x group-size + r")
    group_strategy: str = setting("STRICT_SPREAD", "how a group's bundles are placed: one a node (STRICT_SPREAD), "
                                                   "or PACK / SPREAD (several on one node: for testing)",
                                  choices=("STRICT_SPREAD", "SPREAD", "PACK"))
    detached: bool = True
    engine: EngineConfig = setting(default_factory=lambda: default_of(WorkerOptions, "engine_config"), group="engine")
    # --catalog FILE: no workers at start; the router's fleet controller loads the catalog's
    # models on demand as worker actors on the resource's nodes (cluster/fleet/ray_nodes.py)
    fleet: FleetConfig = setting(default_factory=FleetConfig, group="fleet (models loaded on demand on the Ray nodes)")
    models_dir: str = setting(DEFAULT_MODELS_DIR, "with --catalog: where the nodes hold the catalog's models (the same "
                                                  "path on every node)", metavar="DIR")
    memory_budget: ByteSize | None = setting(None, "with --catalog: the memory a node gives models at most (default: "
                                                   "its Ray memory resource)", metavar="SIZE")
    max_loaded: int = setting(0, "with --catalog: models a node runs at once at most (0: no limit but memory)",
                              metavar="N")
    # keys and TLS for the router and every worker (certificate files at the same paths on
    # every node; with --tls-ca, one certificate serves them all, so worker ids are not
    # bound to per-Mac names: issue one per Mac and use launchd for that)
    security: SecurityConfig = setting(default_factory=SecurityConfig, group="security")


@dataclass(frozen=True)
class RayAddress:
    """Which Ray cluster `orchard ray up|down|status` joins."""

    address: str = setting("auto", "Ray cluster address (default: auto)")


class _LoopThread:
    """An asyncio loop in a daemon thread: actors call into it with `run(coro)`."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _addr(host: str, port: int | None) -> str | None:
    return None if port is None else f"{host}:{port}"


def group_hosts(spec: RaySpec, g: int, rank: int) -> str:
    """`--group-hosts` for rank `rank` of group `g`, found inside its actor (in the
    group's placement group) as it starts, again at each restart (a bundle may have moved):
    each rank's address is its node's as Ray lists it (the node this actor runs on, for
    its own rank; for the others, the nodes that hold their bundles now). ConnectionError
    while a bundle is not placed (its node is gone and Ray has not placed it again yet):
    starting again later can help."""
    import ray
    from ray.util.placement_group import get_current_placement_group, placement_group_table

    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError("group_hosts runs in a group's actor (in its placement group)")
    where = dict(placement_group_table(pg)["bundles_to_node_id"])
    where[rank] = ray.get_runtime_context().get_node_id()
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    hosts = []
    for r in range(spec.group_size):
        ip = ips.get(where.get(r))
        if ip is None:
            raise ConnectionError(f"group {g}'s bundle {r} is on no live node now")
        hosts.append(f"{ip}:{spec.group_port + g * spec.group_size + r}")
    return ",".join(hosts)


def back_off_if_restarted(backoff: Backoff | None = None, state_dir: str | None = None) -> float:
    """Ray starts a dead actor again at once: a restarted one waits its backoff here first.
    The count is kept in a file on the node (an actor is pinned to its node), keyed by the
    actor's id, which a restart keeps. Returns the seconds waited."""
    import ray

    if not ray.is_initialized():  # not in an actor (a test runs the actor's class alone)
        return 0.0
    context = ray.get_runtime_context()
    path = Path(state_dir or tempfile.gettempdir()) / "orchard-ray-restarts" / f"{context.get_actor_id()}.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    delay, failures = 0.0, 0
    if context.was_current_actor_reconstructed:
        backoff = backoff or Backoff()
        backoff.failures = int(state.get("failures", 0))
        delay = backoff.next_delay(time.time() - float(state.get("started", time.time())))
        failures = backoff.failures
        log.warning("restarted by Ray: starting again in %g s (backoff)", delay)
        time.sleep(delay)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"failures": failures, "started": time.time()}))
    return delay


def end_actor(code: int, what: str) -> NoReturn:
    """End this actor's process as `code` says (`cluster/exit_codes.py`). A process that
    exits is started again by Ray (max_restarts), so a transient end exits; a permanent
    one is killed with no restart, after one line in the log saying why."""
    if is_permanent(code):
        import ray

        log.error("%s failed for good (%s): Ray does not start it again; fix the cause and `orchard ray up` again",
                  what, describe(code))
        logging.shutdown()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        time.sleep(60)  # the kill ends this process; should it not, exit anyway
    logging.shutdown()
    os._exit(code)


class RouterActor:
    """`orchard router serve` inside a Ray actor."""

    def __init__(self, spec: RaySpec, node_side: type | None = None):
        """`node_side`: under a catalog, the fleet's node side class (`orchard ray up` gives
        `cluster.fleet.ray_nodes.RayNodes`, which builds on this module's actors)."""
        from cluster.router.server import RouterConfig, RouterServer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        host = spec.host or _node_ip()
        config = RouterConfig(
            grpc_address=f"{host}:{spec.router_port}", http_address=_addr(host, spec.router_http_port),
            metrics_address=_addr(host, spec.router_metrics_port), policy=spec.policy, join_token=spec.join_token,
            security=spec.security, fleet=spec.fleet,
        )
        self._loop = _LoopThread("orchard-router")

        async def start():
            nodes = None
            if spec.fleet.enabled:  # the fleet's workers: actors on the Ray nodes, registering here
                if node_side is None:
                    raise ValueError("a router with a catalog on Ray needs its node side (RayNodes)")
                nodes = node_side(spec, lambda: server.grpc_address, spec.models_dir, spec.memory_budget,
                                  spec.max_loaded)
                await nodes.refresh()  # the first request finds the nodes
            server = RouterServer(config, nodes)
            await server.start()
            return server

        self.server = self._loop.run(start(), timeout=60)

    def addresses(self) -> dict:
        s = self.server
        return {"grpc": s.grpc_address, "http": s.http_address, "metrics": s.metrics_address}

    def pid(self) -> int:
        return os.getpid()


class WorkerActor:
    """`orchard worker serve --router ...` inside a Ray actor; serving starts in the
    constructor, so a restart by Ray (which re-runs it) brings the worker back."""

    def __init__(self, spec: RaySpec, router: str, index: int, worker_id: str, group=None):
        """`group`: rank 0's GroupOptions of a worker group."""
        platform.preload_blas()  # before this actor's process imports MLX
        from cluster.worker.group.config import GroupOptions
        from cluster.worker.server import WorkerOptions

        host = spec.host or _node_ip()
        port = spec.worker_port + index if spec.worker_port else 0
        mport = None if spec.worker_metrics_port is None else (
            spec.worker_metrics_port + index if spec.worker_metrics_port else 0)
        options = WorkerOptions(
            model_path=spec.model, engine_config=spec.engine, grpc_address=f"{host}:{port}",
            metrics_address=_addr(host, mport), worker_id=worker_id, router=router, join_token=spec.join_token,
            security=spec.security, group=group or GroupOptions(),
        )

        def where(options):
            if group is not None and not group.hosts:  # rank 0 of group `index`: where the ranks are now
                return replace(options, group=replace(group, hosts=group_hosts(spec, index, 0)))
            return options

        self._serve(options, where)

    def _serve(self, options, where=lambda options: options) -> None:
        """Start serving `options` (WorkerOptions) after the restart backoff; `where`
        completes them as the actor starts. A failure ends the actor as its exit code says."""
        from cluster.worker.server import WorkerServer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        worker_id = options.worker_id
        back_off_if_restarted()
        self._loop = _LoopThread("orchard-worker")
        try:
            options = where(options)
            self.server = WorkerServer(options)
            self._loop.run(self.server.start(), timeout=600)
        except Exception as e:
            code = exit_code(e.__cause__ or e)
            if is_permanent(code):  # an error in the constructor: Ray does not start the actor again
                log.error("worker %s cannot start (%s): %s; Ray does not start it again", worker_id,
                          describe(code), e)
                raise
            log.error("worker %s cannot start (%s): %s", worker_id, describe(code), e)
            end_actor(EXIT_TRANSIENT, f"worker {worker_id}")

    def addresses(self) -> dict:
        return dict(self.server.addresses)

    def pid(self) -> int:
        return os.getpid()


class GroupMemberActor:
    """A worker group's member (rank >= 1) inside a Ray actor: joins rank 0 and runs the
    steps it plans. When it ends (the group lost, or it could not join) the process exits
    and Ray starts it again."""

    def __init__(self, spec: RaySpec, group, g: int | None = None):
        """`group`: the member's GroupOptions; where the ranks are is found as it starts
        from group `g`'s placement group when `group.hosts` does not say."""
        platform.preload_blas()  # before this actor's process imports MLX
        from cluster.worker.group.member import run_member

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        back_off_if_restarted()
        self.rank = group.rank

        def member() -> None:
            what = f"group rank {group.rank}"
            try:
                options = group if group.hosts else replace(group, hosts=group_hosts(spec, g, group.rank))
            except ConnectionError as e:
                log.error("%s cannot find its group (%s): %s", what, describe(EXIT_TRANSIENT), e)
                end_actor(EXIT_TRANSIENT, what)
            end_actor(run_member(spec.model, options, spec.join_token, spec.engine), what)

        self.thread = threading.Thread(target=member, name="orchard-group-member", daemon=True)
        self.thread.start()

    def addresses(self) -> dict:
        return {"rank": self.rank, "serving": self.thread.is_alive()}

    def pid(self) -> int:
        return os.getpid()


def _share(amount: float, n: int) -> float:
    """An equal share of a node's resource that Ray accepts (<= 1: 4 decimals; > 1: whole)."""
    share = amount / n
    return math.floor(share * 10000) / 10000 if share <= 1 else float(math.floor(share))


def worker_nodes(resource: str) -> list[dict]:
    """Alive Ray nodes that carry `resource`, sorted by id."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(resource, 0) > 0]
    return sorted(nodes, key=lambda n: n["NodeID"])


@dataclass
class RayDeployment:
    spec: RaySpec
    router: object  # actor handle
    router_addresses: dict
    workers: dict[str, object]  # actor name -> handle (a group's rank 0)
    members: dict[str, object] = field(default_factory=dict)  # worker groups' other ranks

    def wait_ready(self, timeout: float | None = None, n: int | None = None) -> None:
        """Until the router reports `n` (default: all) healthy workers."""
        import time

        import grpc

        from cluster.proto.orchard.v1 import orchard_pb2 as pb
        from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

        n = len(self.workers) if n is None else n
        timeout = self.spec.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        from cluster.security import channel

        with channel(self.router_addresses["grpc"], self.spec.security.client(), aio=False) as ch:
            stub = pb_grpc.RouterStub(ch)
            while time.monotonic() < deadline:
                try:
                    resp = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
                    if sum(w.state == pb.WORKER_STATE_HEALTHY for w in resp.workers) >= n:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"{n} healthy workers not registered within {timeout:g} s")

    def shutdown(self) -> None:
        import ray

        for handle in [*self.members.values(), *self.workers.values(), self.router]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as e:  # noqa: BLE001  (already gone)
                log.debug("kill: %s", e)


def launch(spec: RaySpec, worker_timeout: float | None = None, node_side: type | None = None) -> RayDeployment:
    """Start the router on this node and the workers on the resource's nodes (needs
    `ray.init()` first). Returns once the router is up and every worker actor is serving
    (within `worker_timeout`, default `spec.timeout`). `node_side`: a catalog's (`RouterActor`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    worker_timeout = spec.timeout if worker_timeout is None else worker_timeout
    if spec.workers_per_node < 1:
        raise ValueError("workers_per_node must be >= 1")
    nodes = worker_nodes(spec.resource)
    if not nodes:
        raise RuntimeError(f"no alive Ray node carries the resource {spec.resource!r}: start worker nodes with "
                           f"ray start --resources '{{\"{spec.resource}\": 1}}'")
    common = dict(namespace=NAMESPACE, max_restarts=spec.max_restarts, max_task_retries=0, num_cpus=0,
                  lifetime="detached" if spec.detached else None)
    here = ray.get_runtime_context().get_node_id()
    router = ray.remote(RouterActor).options(
        name=ROUTER_NAME, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False), **common,
    ).remote(spec, node_side)
    router_addresses = ray.get(router.addresses.remote(), timeout=120)
    if spec.fleet.enabled:  # the router starts the workers as requests name models
        return RayDeployment(spec, router, router_addresses, {})
    if spec.group_size > 1:
        return _launch_groups(spec, nodes, router, router_addresses, common, worker_timeout)
    workers = {}
    for node in nodes:
        node_id = node["NodeID"]
        share = _share(node["Resources"][spec.resource], spec.workers_per_node)
        for i in range(spec.workers_per_node):
            name = f"{WORKER_PREFIX}{node_id[:8]}-{i}"
            workers[name] = ray.remote(WorkerActor).options(
                name=name, resources={spec.resource: share},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **common,
            ).remote(spec, router_addresses["grpc"], i, name.removeprefix("orchard-"))
    ray.get([w.addresses.remote() for w in workers.values()], timeout=worker_timeout)
    return RayDeployment(spec, router, router_addresses, workers)


GROUP_PREFIX = "orchard-group-"  # placement groups of worker groups


def _launch_groups(spec: RaySpec, nodes: list[dict], router, router_addresses: dict, common: dict,
                   worker_timeout: float) -> RayDeployment:
    """Worker groups: a placement group of `group_size` bundles each (one per node under
    STRICT_SPREAD), rank 0 a WorkerActor in bundle 0, the members in the others."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.worker.group.config import GroupOptions

    size = spec.group_size
    slots = len(nodes) if spec.group_strategy == "STRICT_SPREAD" else int(
        sum(n["Resources"][spec.resource] for n in nodes))
    if slots < size:
        raise RuntimeError(f"a group of {size} needs {size} nodes with the resource {spec.resource!r} "
                           f"({spec.group_strategy}); there are {slots}")
    # a group never runs without a join token: with an open router (--insecure) its ranks
    # get one made here (in the actors' arguments; the router takes any token)
    spec = replace(spec, join_token=spec.join_token or secrets.token_urlsafe(24))
    workers, members = {}, {}
    for g in range(slots // size):
        pg = placement_group([{spec.resource: 1}] * size, strategy=spec.group_strategy, name=f"{GROUP_PREFIX}{g}",
                             lifetime="detached" if spec.detached else None)
        ray.get(pg.ready(), timeout=120)
        for r in range(size):  # where the ranks are: found by each actor as it starts (group_hosts)
            options = GroupOptions(size=size, parallel=spec.parallel, rank=r)
            placed = dict(common, resources={spec.resource: 1},
                          scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r))
            if r == 0:
                name = f"{WORKER_PREFIX}g{g}"
                workers[name] = ray.remote(WorkerActor).options(name=name, **placed).remote(
                    spec, router_addresses["grpc"], g, name.removeprefix("orchard-"), options)
            else:
                name = f"{WORKER_PREFIX}g{g}-rank{r}"
                members[name] = ray.remote(GroupMemberActor).options(name=name, **placed).remote(spec, options, g)
    ray.get([w.addresses.remote() for w in [*members.values(), *workers.values()]], timeout=worker_timeout)
    return RayDeployment(spec, router, router_addresses, workers, members)


def _remove_placement_groups() -> list[str]:
    """The worker groups' placement groups (they hold their nodes' resources until removed)."""
    import ray
    from ray.util.placement_group import placement_group_table

    gone = []
    for info in placement_group_table().values():
        name = info.get("name", "")
        if name.startswith(GROUP_PREFIX) and info.get("state") != "REMOVED":
            ray.util.remove_placement_group(ray.util.get_placement_group(name))
            gone.append(name)
    return gone


def existing_actors() -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(("orchard-router", WORKER_PREFIX)))


# -- CLI ---------------------------------------------------------------------------------------
def _init(address: str):
    try:
        import ray
    except ImportError:
        raise SystemExit("Ray is not installed: pip install 'orchard[ray]'") from None
    if not ray.is_initialized():  # (tests and notebooks connect first)
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    return ray


def _check_what_serves(spec: RaySpec) -> str | None:
    """What is wrong with what `ray up` is asked to serve (--model, or --catalog and its flags)."""
    if spec.fleet.enabled:
        if spec.model:
            return "--model and --catalog: one or the other (a catalog's models are loaded on demand)"
        if spec.group_size > 1:
            return "--group-size with --catalog: the fleet forms the groups a model needs itself"
        if spec.memory_budget is not None and spec.memory_budget < 1:
            return f"--memory-budget must be a positive size, not {spec.memory_budget}"
        if spec.max_loaded < 0:
            return f"--max-loaded must be >= 0, not {spec.max_loaded}"
        try:
            spec.fleet.check()
        except ValueError as e:
            return str(e)
    elif not spec.model:
        return "nothing to serve: --model DIR (a worker of it per node), or --catalog FILE (models on demand)"
    return None


def _absolute_paths(spec: RaySpec) -> RaySpec:
    """The paths the actors get, made absolute here (the router's actor runs on this node;
    the workers' paths are the same on every node)."""
    if spec.fleet.enabled:
        return replace(spec, fleet=replace(spec.fleet, catalog=os.path.abspath(spec.fleet.catalog)),
                       models_dir=os.path.abspath(os.path.expanduser(spec.models_dir)))
    return replace(spec, model=os.path.abspath(spec.model))


def run_up(spec: RaySpec, ray_address: RayAddress, node_side: type | None = None) -> int:
    if not spec.join_token and not spec.insecure:
        print("orchard ray up: no join token: anyone on the network could register a worker and receive prompts. "
              "Set $ORCHARD_JOIN_TOKEN (e.g. `export ORCHARD_JOIN_TOKEN=$(openssl rand -hex 16)`), or pass "
              "--insecure for a trusted network", flush=True)
        return 2
    problem = _check_what_serves(spec)
    if problem:
        print(f"orchard ray up: {problem}", flush=True)
        return 2
    # The actors run elsewhere, without this shell's environment: resolve the keys here.
    sec = spec.security
    spec = replace(spec, security=replace(sec, api_keys=inference_keys(sec.api_keys, sec.api_key_file),
                                          api_key_file=None))
    ray = _init(ray_address.address)
    if existing_actors():
        print(f"orchard is already running on this Ray cluster ({', '.join(existing_actors())}); "
              "`orchard ray down` first", flush=True)
        return 1
    spec = _absolute_paths(spec)
    try:
        dep = launch(spec, node_side=node_side)
        dep.wait_ready()
    except (RuntimeError, TimeoutError, ray.exceptions.RayError) as e:
        print(f"orchard ray up: {e}", flush=True)
        return 1
    a = dep.router_addresses
    serving = (f"a fleet: the models of {spec.fleet.catalog} loaded on demand from {spec.models_dir} on the nodes "
               f"with {spec.resource}" if spec.fleet.enabled
               else f"{len(dep.workers)} worker(s) serving {os.path.basename(spec.model)}")
    print(f"Orchard is up on Ray: {serving}\n"
          f"  router gRPC  {a['grpc']}\n  HTTP         {a['http'] or 'off'}\n  metrics      {a['metrics'] or 'off'}\n"
          + "".join(f"  {name}\n" for name in dep.workers)
          + "".join(f"  {name} (a group member)\n" for name in dep.members)
          + "Actors are detached: `orchard ray down` stops them.", flush=True)
    return 0


def run_down(ray_address: RayAddress) -> int:
    ray = _init(ray_address.address)
    names = existing_actors()
    for name in names:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        print(f"killed {name}")
    for name in _remove_placement_groups():
        print(f"removed placement group {name}")
    if not names:
        print("no orchard actors on this Ray cluster")
    return 0


def run_status(ray_address: RayAddress) -> int:
    ray = _init(ray_address.address)
    names = existing_actors()
    if not names:
        print("no orchard actors on this Ray cluster")
        return 1
    for name in names:
        handle = ray.get_actor(name, namespace=NAMESPACE)
        try:
            addresses = ray.get(handle.addresses.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001
            addresses = f"not answering ({type(e).__name__})"
        print(f"{name}: {addresses}")
    return 0


__all__ = ["RaySpec", "RayAddress", "RayDeployment", "RouterActor", "WorkerActor", "GroupMemberActor", "launch",
           "worker_nodes", "existing_actors"]
