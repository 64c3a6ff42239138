"""`RayNodes`: the fleet's node side over Ray (`orchard ray up --catalog FILE`), the same
`NodeSide` the controller drives over node agents (`fleet/nodes.py`).

- A node is an alive Ray node that carries the worker resource (`--resource`, as
  `cluster/ray_launcher.py` uses it). Its memory budget is its Ray `memory` resource,
  within Metal's working set on a Mac, capped by `--memory-budget`; what it holds under
  `--models-dir` (the same path on every node), its free disk and its free memory come
  from a probe: a Ray task pinned to the node that runs `facts.scan`. Reports are
  refreshed every `refresh_interval` (a start or a stop changes them at once); `nodes()`
  answers from the last refresh.
- `start` creates a worker actor (a group's rank 0, or a plain worker: `FleetWorkerActor`,
  the launcher's `WorkerActor` serving the spec's `orchard worker serve` flags) or a group
  member (the launcher's `GroupMemberActor`) pinned to the node (hard node affinity), with
  the spec's reservation as its Ray `memory`, and `max_restarts`: Ray restarts it where it
  was, and it registers with the router again under the same worker id. The reservation is
  checked against the node's budget first, and the model against what the node holds.
- `stop` drains a worker (it takes no new requests; those it has finish, bounded by the
  drain timeout), stops its server, and kills the actor with no restart; a member is
  killed (it goes with its group).

The fleet's actors are named `orchard-worker-fleet-<worker id>` in the `orchard`
namespace, so `orchard ray down` ends them with the rest. This module imports Ray only
when used, and never MLX (it runs in the router).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import grpc

from cluster.config import human_bytes
from cluster.exit_codes import EXIT_PERMANENT
from cluster.fleet import FleetError, facts
from cluster.fleet.agent import OLLAMA_PREFIX, worker_argv
from cluster.net import free_ports
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.ray_launcher import NAMESPACE, WORKER_PREFIX, GroupMemberActor, RaySpec, WorkerActor, worker_nodes

log = logging.getLogger(__name__)

FLEET_PREFIX = f"{WORKER_PREFIX}fleet-"  # the fleet's actors: `orchard ray down` ends them too
PING_TIMEOUT = 2.0  # a serving worker's actor answers at once; one loading answers when loaded
LOADING_STOP_WAIT = 10.0  # a worker not seen serving, stopped: this long to answer before it is taken as loading


@functools.cache
def _metal_working_set() -> int | None:
    from cluster.platform import metal_working_set

    return metal_working_set()  # a machine's, asked once per process (it starts a Python)


def probe(models_dir: str) -> bytes:
    """Run on a node (a Ray task pinned there): what it holds under `models_dir`, its free
    disk and memory, its platform and (on a Mac) Metal's working set as its budget, as a
    serialized NodeReport (the rest is the router's)."""
    from cluster.fleet.facts import scan
    from cluster.platform import available_memory

    working_set = _metal_working_set()
    kind = "metal" if working_set else "cpu"
    report = pb.NodeReport(platform=kind, memory_available_bytes=available_memory(),
                           memory_budget_bytes=working_set or 0)
    where = Path(models_dir)
    if where.is_dir():
        report.disk_free_bytes = shutil.disk_usage(where).free
        report.models.extend(scan(where, kind))
    return report.SerializeToString()


def free_ports_here(count: int, host: str) -> list[int]:
    """Run on a node: `count` ports free there now."""
    return free_ports(count, host)


class _WorkerFlags(argparse.ArgumentParser):
    """`orchard worker serve`'s flags, parsed for a fleet worker: a bad one is an error."""

    def error(self, message: str):
        raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"worker flags: {message}")


def worker_options(argv: list[str]):
    """WorkerOptions from `orchard worker serve` flags (FleetError INVALID_ARGUMENT)."""
    from cluster.config import add_flags, from_args
    from cluster.worker.config import WorkerOptions

    parser = _WorkerFlags(prog="orchard worker serve", add_help=False)
    add_flags(parser, WorkerOptions)
    return from_args(WorkerOptions, parser.parse_args(argv))


def _placed_spec(spec: bytes) -> tuple[str, bytes]:
    import ray

    return ray.get_runtime_context().get_node_id(), spec


class FleetWorkerActor(WorkerActor):
    """A fleet worker (plain, or a group's rank 0) in a Ray actor: the launcher's
    WorkerActor serving the WorkerOptions the controller's spec made; Ray's restart re-runs
    the constructor, which serves again."""

    def __init__(self, options, spec: bytes):
        """`spec`: the serialized WorkerSpec (Ray does not pickle protobuf classes)."""
        from cluster import platform

        platform.preload_blas()  # before this actor's process imports MLX
        self._spec = spec
        self._serve(options)

    def spec(self) -> tuple[str, bytes]:
        """(its Ray node, its serialized spec): a restarted router finds its workers again."""
        return _placed_spec(self._spec)

    def drain(self) -> tuple[int, int]:
        """Take no new requests: (running, waiting) left."""
        response = self._loop.run(self.server.set_draining(True), timeout=30)
        return response.num_running, response.num_waiting

    def stop(self, timeout: float) -> None:
        """Stop serving (the streams left get the server's grace), before the actor is killed."""
        self._loop.run(self.server.stop(), timeout=timeout)


class FleetMemberActor(GroupMemberActor):
    """A fleet group's member (rank >= 1): the launcher's GroupMemberActor, with its spec."""

    def __init__(self, member: RaySpec, group, spec: bytes):
        self._spec = spec
        super().__init__(member, group)

    def spec(self) -> tuple[str, bytes]:
        return _placed_spec(self._spec)


@dataclass
class _Worker:
    node_id: str
    spec: pb.WorkerSpec
    handle: object  # the actor
    state: str = "starting"
    reason: str = ""
    exit_code: int = 0
    address: str = ""
    ping: object = None  # an ObjectRef: its `addresses()` call, while unanswered

    def managed(self) -> pb.ManagedWorker:
        s = self.spec
        return pb.ManagedWorker(worker_id=s.worker_id, model=s.model, state=self.state,
                                reserved_bytes=s.reserved_bytes, group_size=s.group_size or 1,
                                group_rank=s.group_rank, exit_code=self.exit_code, reason=self.reason,
                                address=self.address)


@dataclass
class _Node:
    ray_id: str  # Ray's NodeID (hex)
    ip: str
    ray_memory: int  # its Ray `memory` resource
    report: pb.NodeReport | None = None  # the last probe's
    reported_at: float = 0.0
    alive: bool = True


@functools.cache
def _remote(function: Callable):
    """`function` as a Ray task (made once: each `ray.remote` exports it anew)."""
    import ray

    return ray.remote(num_cpus=0)(function)


async def _get(ref, timeout: float):
    import ray

    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
    except asyncio.TimeoutError:
        try:
            ray.cancel(ref)
        except Exception as e:  # noqa: BLE001  (done meanwhile)
            log.debug("cancel: %s", e)
        raise


class RayNodes:
    """The fleet's `NodeSide` over Ray (see the module docstring). Needs Ray connected
    (`ray.init`, or running in an actor). `router`: the router's gRPC address(es) the
    workers register with, or a function giving them (known once the router is bound)."""

    def __init__(self, spec: RaySpec, router: str | Callable[[], str], models_dir: str,
                 memory_budget: int | None = None, max_loaded: int = 0, refresh_interval: float = 10.0,
                 probe_timeout: float = 60.0, drain_timeout: float = 120.0, clock=time.monotonic):
        self.spec = spec
        self._router = router
        self.models_dir = str(Path(models_dir).expanduser().absolute())
        self.memory_budget = memory_budget
        self.max_loaded = max_loaded
        self.refresh_interval = refresh_interval
        self.probe_timeout = probe_timeout
        self.drain_timeout = drain_timeout
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._workers: dict[str, _Worker] = {}
        self._adopting: dict[str, tuple] = {}  # actor name -> (handle, its spec() call)
        self._passed: set[str] = set()  # actor names not to adopt: killed here (listed a while after), not ours
        self._refreshed_at: float | None = None
        self._changed = asyncio.Event()
        self._refreshing: asyncio.Task | None = None

    # -- NodeSide ----------------------------------------------------------------------------
    def nodes(self) -> list[pb.NodeInfo]:
        """The nodes' latest reports (refreshed every `refresh_interval`); a node Ray lists
        as dead, or whose probe failed, is unhealthy."""
        self._refresh_if_due()
        now = self._clock()
        infos = []
        for node_id, node in sorted(self._nodes.items()):
            if node.report is None:
                continue
            healthy = node.alive and now - node.reported_at <= max(3 * self.refresh_interval, self.probe_timeout)
            infos.append(pb.NodeInfo(report=self._report(node_id, node), state="healthy" if healthy else "unhealthy",
                                     age_seconds=now - node.reported_at))
        return infos

    async def reserve_ports(self, node_id: str, count: int) -> list[int]:
        node = self._node(node_id)
        task = _remote(free_ports_here).options(scheduling_strategy=self._on(node))
        return list(await _get(task.remote(count, self._host(node)), self.probe_timeout))

    async def start(self, node_id: str, spec: pb.WorkerSpec) -> pb.ManagedWorker:
        """Start the spec's worker or group member on the node; returns at once ("starting"):
        it registers with the router when it has loaded. FleetError: NOT_FOUND (the node, the
        model on it), ALREADY_EXISTS (the worker id), RESOURCE_EXHAUSTED (the reservation
        does not fit the node's budget), INVALID_ARGUMENT (its flags)."""
        import ray

        node = self._node(node_id)
        for field in ("worker_id", "model", "source"):
            if not getattr(spec, field):
                raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"spec.{field} is required")
        name = f"{FLEET_PREFIX}{spec.worker_id}"
        if spec.worker_id in self._workers or name in self._adopting:
            raise FleetError(grpc.StatusCode.ALREADY_EXISTS, f"worker {spec.worker_id} already runs on the Ray "
                                                             "cluster")
        model = self._model_path(node_id, node, spec.source)
        budget = self._budget(node)
        free = budget - self._reserved(node_id)
        if spec.reserved_bytes > free:
            raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"worker {spec.worker_id} of {spec.model} needs {human_bytes(spec.reserved_bytes)}, "
                             f"node {node_id} has {human_bytes(max(0, free))} of {human_bytes(budget)} free")
        loaded = {w.spec.model for w in self._workers.values() if w.node_id == node_id and w.state != "exited"}
        if self.max_loaded and spec.model not in loaded and len(loaded) >= self.max_loaded:
            raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"node {node_id} runs {len(loaded)} models ({', '.join(sorted(loaded))}), its "
                             f"--max-loaded {self.max_loaded}: cannot start {spec.model}")
        port = spec.port or (await self.reserve_ports(node_id, 1))[0]
        options = worker_options(self.worker_flags(spec, model, self._host(node), port))
        options = replace(options, join_token=self.spec.join_token, security=self.spec.security)
        placed = dict(name=name, namespace=NAMESPACE, num_cpus=0,
                      memory=spec.reserved_bytes or None, max_restarts=self.spec.max_restarts, max_task_retries=0,
                      lifetime="detached" if self.spec.detached else None, scheduling_strategy=self._on(node))
        serialized = spec.SerializeToString()  # Ray does not pickle protobuf classes
        try:
            if spec.group_size > 1 and spec.group_rank > 0:
                member = replace(self.spec, model=options.model_path, engine=options.engine_config)
                handle = ray.remote(FleetMemberActor).options(**placed).remote(member, options.group, serialized)
            else:
                handle = ray.remote(FleetWorkerActor).options(**placed).remote(options, serialized)
        except ValueError as e:  # the name is taken: an actor of a router before this one, not found yet
            raise FleetError(grpc.StatusCode.ALREADY_EXISTS, f"worker {spec.worker_id}: {e}") from None
        worker = self._workers[spec.worker_id] = _Worker(node_id, pb.WorkerSpec(), handle)
        worker.spec.CopyFrom(spec)
        self._ping(worker)
        self._changed.set()
        log.info("fleet: started %s (%s) on %s, %s reserved", spec.worker_id, spec.model, node_id,
                 human_bytes(spec.reserved_bytes))
        return worker.managed()

    async def stop(self, node_id: str, worker_id: str, drain_timeout: float) -> pb.ManagedWorker:
        """Drain the worker (its requests finish, for at most `drain_timeout` s; 0: the
        default), stop it and kill its actor with no restart."""
        import ray

        worker = self._workers.get(worker_id)
        if worker is None or worker.node_id != node_id:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"no fleet worker {worker_id} on node {node_id}")
        worker.state = "stopping"
        timeout = drain_timeout or self.drain_timeout
        if worker.spec.group_rank == 0:  # a member goes with its group
            await self._drain(worker, timeout)
        ray.kill(worker.handle, no_restart=True)
        self._passed.add(f"{FLEET_PREFIX}{worker_id}")
        del self._workers[worker_id]
        worker.state, worker.reason = "exited", "stopped"
        self._changed.set()
        log.info("fleet: stopped %s on %s", worker_id, node_id)
        return worker.managed()

    async def fetch(self, node_id: str, request: pb.FetchModelRequest, progress) -> pb.FetchProgress:
        """A model the node holds is there already; Ray's nodes copy and pull nothing:
        UNIMPLEMENTED for any other (put it in --models-dir on each node, or run node agents)."""
        node = self._node(node_id)
        if not (request.source.startswith(OLLAMA_PREFIX) or self._held(node, request.source)):
            raise FleetError(grpc.StatusCode.UNIMPLEMENTED,
                             f"model {request.source!r} is not on Ray node {node_id}, and the fleet over Ray copies "
                             f"and pulls no models: put it in {self.models_dir} on that node, or run node agents "
                             "(`orchard node serve`)")
        return pb.FetchProgress(**{"from": "disk"}, done=True, path=self._model_path(node_id, node, request.source))

    async def describe(self, node_id: str, source: str) -> pb.DiskModel:
        """The facts of a model some node holds (the probes'); UNIMPLEMENTED for any other."""
        for node in self._nodes.values():
            if node.report is not None and self._held(node, source):
                return next(m for m in node.report.models for name in facts.model_names(source) if m.name == name)
        raise FleetError(grpc.StatusCode.UNIMPLEMENTED, f"no Ray node holds model {source!r}, and the fleet over "
                                                        "Ray describes only models on its nodes")

    @staticmethod
    def _held(node: _Node, source: str) -> bool:
        held = {m.name for m in node.report.models if not m.error}
        return any(name in held for name in facts.model_names(source))

    async def wait_changed(self, timeout: float) -> bool:
        """True when the reports changed (a refresh, a start, a stop) since the last call,
        or do within `timeout` s. Refreshes run in their own task: a caller that gives up
        waiting does not cancel one."""
        deadline = self._clock() + timeout
        while not self._changed.is_set():
            self._refresh_if_due()
            left = deadline - self._clock()
            if left <= 0:
                return False
            if self._refreshed_at is not None and (self._refreshing is None or self._refreshing.done()):
                left = min(left, max(0.05, self._refreshed_at + self.refresh_interval - self._clock()))
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        self._changed.clear()
        return True

    # -- reports -------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Probe every worker node (concurrently) and look at every fleet actor."""
        import ray

        alive = await asyncio.to_thread(worker_nodes, self.spec.resource)
        seen = set()
        for n in alive:
            node_id = self.node_id(n["NodeID"])
            seen.add(node_id)
            memory = int(n["Resources"].get("memory", 0))
            node = self._nodes.setdefault(node_id, _Node(n["NodeID"], n["NodeManagerAddress"], memory))
            node.ip, node.ray_memory, node.alive = n["NodeManagerAddress"], memory, True
        for node_id, node in self._nodes.items():
            node.alive = node_id in seen
        probes = {node_id: _remote(probe).options(scheduling_strategy=self._on(node)).remote(
            self.models_dir) for node_id, node in self._nodes.items() if node.alive}
        for node_id, ref in probes.items():
            try:
                report = pb.NodeReport.FromString(await _get(ref, self.probe_timeout))
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                log.warning("fleet: node %s did not report: %s", node_id, _last_line(e))
                continue
            self._nodes[node_id].report, self._nodes[node_id].reported_at = report, self._clock()
        await self._find_ours()
        await self._look_at_workers()
        self._refreshed_at = self._clock()
        self._changed.set()

    def _refresh_if_due(self) -> None:
        due = self._refreshed_at is None or self._clock() - self._refreshed_at >= self.refresh_interval
        if due and (self._refreshing is None or self._refreshing.done()):
            try:
                self._refreshing = asyncio.get_running_loop().create_task(self._refresh_logged(),
                                                                          name="ray nodes refresh")
            except RuntimeError:  # no loop here (a caller outside the router's): the next call in one refreshes
                pass

    async def _refresh_logged(self) -> None:
        """A refresh in the background: a failure is logged, and tried again an interval later."""
        try:
            await self.refresh()
        except Exception as e:  # noqa: BLE001  (Ray's GCS away for a moment, say)
            log.warning("fleet: the Ray nodes were not refreshed: %s", _last_line(e))
            self._refreshed_at = self._clock()

    async def _find_ours(self) -> None:
        """The fleet's actors started before this router was (it restarted): each is the
        fleet's again once it says where it runs and what (after it has loaded)."""
        import ray

        listed = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        known = {f"{FLEET_PREFIX}{w}" for w in self._workers} | self._passed
        for a in listed:
            name = a["name"]
            if a.get("namespace") == NAMESPACE and name.startswith(FLEET_PREFIX) and name not in known \
                    and name not in self._adopting:
                try:
                    handle = ray.get_actor(name, namespace=NAMESPACE)
                    self._adopting[name] = (handle, handle.spec.remote())
                except (ValueError, AttributeError):  # gone, or not a fleet worker
                    self._passed.add(name)
        for name, (handle, ref) in list(self._adopting.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            del self._adopting[name]
            try:
                ray_id, serialized = ray.get(ref)
            except ray.exceptions.RayError:  # gone meanwhile
                continue
            spec = pb.WorkerSpec.FromString(serialized)
            if spec.worker_id not in self._workers and name not in self._passed:
                self._workers[spec.worker_id] = _Worker(self.node_id(ray_id), spec, handle)
                log.info("fleet: found %s (%s) on %s", spec.worker_id, spec.model, self.node_id(ray_id))

    async def _look_at_workers(self) -> None:
        """Each worker's state from its actor: "running" when it answers (within
        PING_TIMEOUT), "starting" while it loads (or Ray restarts it: an actor answers
        once its constructor is done), "exited" when Ray will not start it again."""
        import ray

        looked = [w for w in self._workers.values() if w.state not in ("stopping", "exited")]
        for w in looked:
            if w.ping is None:
                self._ping(w)
        pings = [w.ping for w in looked if w.ping is not None]
        if pings:
            await asyncio.to_thread(ray.wait, pings, num_returns=len(pings), timeout=PING_TIMEOUT)
        for w in looked:
            if w.ping is None:
                continue  # answered meanwhile
            if ray.wait([w.ping], timeout=0)[0]:
                self._answered(w, w.ping)
            else:
                w.state = "starting"

    def _ping(self, w: _Worker) -> None:
        """Ask the worker's actor where it serves; its answer (once it has loaded: at once
        when it serves) settles its state as soon as it comes, not at the next refresh."""
        loop = asyncio.get_running_loop()
        ping = w.ping = w.handle.addresses.remote()
        ping.future().add_done_callback(lambda _: loop.call_soon_threadsafe(self._answered, w, ping))

    def _answered(self, w: _Worker, ping) -> None:
        import ray

        if w.ping is not ping or w.state in ("stopping", "exited"):
            return  # settled already, or being stopped
        w.ping = None
        try:
            addresses = ray.get(ping)
        except ray.exceptions.ActorDiedError as e:
            w.state, w.exit_code, w.reason = "exited", EXIT_PERMANENT, _last_line(e)
        except ray.exceptions.RayError:  # being restarted
            w.state = "starting"
        else:
            w.state, w.address = "running", addresses.get("grpc", "")
        self._changed.set()

    def _report(self, node_id: str, node: _Node) -> pb.NodeReport:
        report = pb.NodeReport()
        report.CopyFrom(node.report)
        report.node_id, report.address, report.instance_id = node_id, node.ip, node.ray_id
        report.advertise_host = self._host(node)
        report.memory_budget_bytes = self._budget(node)
        report.max_loaded = self.max_loaded
        report.memory_reserved_bytes = self._reserved(node_id)
        report.workers.extend(w.managed() for w in self._workers.values() if w.node_id == node_id)
        return report

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def node_id(ray_node_id: str) -> str:
        """The fleet's name of a Ray node: short, as `orchard nodes list` shows it."""
        return f"ray-{ray_node_id[:8]}"

    def worker_flags(self, spec: pb.WorkerSpec, model: str, host: str, port: int) -> list[str]:
        """The `orchard worker serve` flags of a spec, as the node agent gives them, on a
        node whose address is `host`."""
        argv = worker_argv(spec, model, self.router, host, host, port)
        return argv[argv.index("serve") + 1:]

    @property
    def router(self) -> str:
        return self._router() if callable(self._router) else self._router

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None or node.report is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"no Ray node {node_id} (nodes: "
                                                        f"{', '.join(sorted(self._nodes)) or 'none yet'})")
        if not node.alive:
            raise FleetError(grpc.StatusCode.UNAVAILABLE, f"Ray node {node_id} is not alive")
        return node

    def _host(self, node: _Node) -> str:
        return self.spec.host or node.ip

    @staticmethod
    def _on(node: _Node):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node.ray_id, soft=False)

    def _budget(self, node: _Node) -> int:
        """What a node gives models: its Ray memory, within Metal's working set on a Mac
        (the probe's), capped by --memory-budget."""
        limits = [m for m in (node.ray_memory, node.report.memory_budget_bytes, self.memory_budget) if m]
        return min(limits, default=0)

    def _reserved(self, node_id: str) -> int:
        return sum(w.spec.reserved_bytes for w in self._workers.values() if w.node_id == node_id
                   and w.state != "exited")

    def _model_path(self, node_id: str, node: _Node, source: str) -> str:
        """`--model` for catalog source `source` on the node, from what its probe found
        there: a directory or .gguf file of that name (as the agent's `find_model`), or an
        `ollama:` reference as it is."""
        if source.startswith(OLLAMA_PREFIX):
            return source  # the worker imports it from the node's Ollama store
        held = {m.name for m in node.report.models if not m.error}
        for name in facts.model_names(source):
            if source and name in held:
                return str(Path(self.models_dir) / name)
        raise FleetError(grpc.StatusCode.NOT_FOUND, f"model {source!r} is not on node {node_id}: {self.models_dir} "
                                                    f"has no model of that name")

    async def _drain(self, worker: _Worker, timeout: float) -> None:
        """Until the worker has no requests (bounded by `timeout`), then stop its server."""
        import ray

        deadline = self._clock() + timeout
        try:
            if worker.state != "running":  # loading (nothing in flight) unless it came up since the last look
                try:
                    await _get(worker.handle.addresses.remote(), LOADING_STOP_WAIT)
                except asyncio.TimeoutError:
                    return
            while True:
                running, waiting = await _get(worker.handle.drain.remote(), 30)
                if running + waiting == 0 or self._clock() >= deadline:
                    break
                await asyncio.sleep(0.5)
            if running + waiting:
                log.warning("fleet: %s still has %d request(s) after %g s of draining: stopping it",
                            worker.spec.worker_id, running + waiting, timeout)
            await _get(worker.handle.stop.remote(30.0), 45)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:  # dead or wedged: killed anyway
            log.warning("fleet: %s did not drain: %s", worker.spec.worker_id, _last_line(e))


def _last_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


__all__ = ["RayNodes", "FleetWorkerActor", "FLEET_PREFIX", "probe", "worker_options"]
