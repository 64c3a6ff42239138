"""A fleet's node side in process (`cluster.fleet.nodes.NodeSide`), for controller tests.

Nodes have a memory budget and models on disk (`DiskModel`s). `start` reserves the spec's
bytes (RESOURCE_EXHAUSTED past the budget, NOT_FOUND for a model not on disk), lists the
worker as "loading" in the node's report, and after `load_delay` seconds brings it up: a
group member is "running"; a worker (a group's rank 0) registers with every router's
`Registry`, as a real worker does. With `serve`, it is a `FakeWorker` answering gRPC
(the router's real proxy path); else a registry record only. `stop` drains: it waits until
no router has requests in flight on the worker, then removes it. With `stale`, as real
nodes do, a stopped worker stays in the routers' registries (until it misses heartbeats)
and in its node's report (until `heartbeat()`, its next one).

`fetch` copies a model's `DiskModel` from the first peer whose report lists it, else from
`hub` (models "on the hub" by canonical name), into the node's report (`fetched`), after
`fetch_steps` progress callbacks; `fetch_gate`, when set, holds a fetch at its first
progress until the test sets it. `describe` answers from the node's disk, else `hub`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from cluster.fleet import FleetError
from cluster.fleet.controller import source_name
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.registry import Registry
from cluster.up import free_port
from tests.fake_worker import FakeWorker

GiB = 2**30


def disk_model(name: str, weight_gib: float, layers: int = 8, kv_bytes_per_token: int = 1024,
               max_context: int = 4096) -> pb.DiskModel:
    weights = int(weight_gib * GiB)
    return pb.DiskModel(name=name, file_bytes=weights, weight_bytes=weights, kv_bytes_per_token=kv_bytes_per_token,
                        num_layers=layers, max_context=max_context, tasks=["generate"])


class FakeNodes:
    def __init__(self, registries: list[Registry], load_delay: float = 0.05, serve: bool = False,
                 stale: bool = False):
        self.registries = registries
        self.load_delay = load_delay
        self.serve = serve
        self.stale = stale
        self.unreported: list[tuple[str, pb.ManagedWorker]] = []  # stopped since the last `heartbeat()`
        self.reports: dict[str, pb.NodeReport] = {}
        self.healthy: dict[str, bool] = {}
        self.silent: dict[str, float] = {}  # node -> seconds since its last report (NodeInfo.age_seconds)
        self.started: list[tuple[str, pb.WorkerSpec]] = []
        self.stopped: list[str] = []
        self.served: dict[str, FakeWorker] = {}
        self.exit_on_start: str | None = None  # a worker started exits at once with this reason
        self.hub: dict[str, pb.DiskModel] = {}  # canonical hf: name -> its facts (`describe`, `fetch`)
        self.fetches: list[tuple[str, pb.FetchModelRequest, str]] = []  # (node, request, from)
        self.described: list[tuple[str, str]] = []  # (node, source)
        self.fetch_steps = 4
        self.fetch_gate: asyncio.Event | None = None
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def add_node(self, node_id: str, budget_gib: float, models: list[pb.DiskModel], platform: str = "cpu") -> None:
        self.reports[node_id] = pb.NodeReport(
            node_id=node_id, address=f"127.0.0.1:{free_port()}", advertise_host="127.0.0.1",
            memory_budget_bytes=int(budget_gib * GiB), memory_available_bytes=int(budget_gib * GiB),
            models=models, platform=platform)
        self.healthy[node_id] = True
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- NodeSide ---------------------------------------------------------------------------------
    def nodes(self) -> list[pb.NodeInfo]:
        return [pb.NodeInfo(report=r, state="healthy" if self.healthy[n] else "unhealthy",
                            age_seconds=self.silent.get(n, 0.0)) for n, r in sorted(self.reports.items())]

    async def wait_changed(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def reserve_ports(self, node_id: str, count: int) -> list[int]:
        return [free_port() for _ in range(count)]

    async def describe(self, node_id: str, source: str) -> pb.DiskModel:
        self.described.append((node_id, source))
        name = source_name(source)
        held = next((m for m in self.reports[node_id].models if m.name == name), None) or self.hub.get(name)
        if held is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"{source} is neither on node {node_id} nor on the hub")
        return held

    async def fetch(self, node_id: str, request: pb.FetchModelRequest,
                    progress: Callable[[pb.FetchProgress], None]) -> pb.FetchProgress:
        report = self.reports[node_id]
        name = source_name(request.source)
        if any(m.name == name for m in report.models):
            return pb.FetchProgress(**{"from": "disk"}, done=True)
        peer = next((p.node_id for p in request.peers
                     if any(m.name == name for m in self.reports[p.node_id].models)), None)
        model = next(m for m in self.reports[peer].models if m.name == name) if peer else self.hub.get(name)
        if model is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"{request.source}: no peer holds it and it is not on the hub")
        origin = peer or "hub"
        self.fetches.append((node_id, request, origin))
        for step in range(self.fetch_steps):
            progress(pb.FetchProgress(**{"from": origin}, bytes_done=model.file_bytes * step // self.fetch_steps,
                                      bytes_total=model.file_bytes))
            if step == 0 and self.fetch_gate is not None:
                await self.fetch_gate.wait()
            await asyncio.sleep(0.01)
        fetched = report.models.add()
        fetched.CopyFrom(model)
        fetched.fetched = True
        self._notify()
        return pb.FetchProgress(**{"from": origin}, bytes_done=model.file_bytes, bytes_total=model.file_bytes,
                                done=True)

    async def start(self, node_id: str, spec: pb.WorkerSpec) -> pb.ManagedWorker:
        report = self.reports.get(node_id)
        if report is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"no node {node_id!r}")
        if "/" in spec.worker_id or spec.worker_id.startswith(".") or len(spec.worker_id) > 200:  # as the agent
            raise FleetError(grpc.StatusCode.INVALID_ARGUMENT, f"spec.worker_id {spec.worker_id!r} is no file name")
        if not any(m.name == source_name(spec.source) for m in report.models):
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"{spec.source} is not on node {node_id}")
        loaded = {w.model for w in report.workers if w.state != "exited"}
        if report.max_loaded and spec.model not in loaded and len(loaded) >= report.max_loaded:  # as the agent
            raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"node {node_id} runs {len(loaded)} models, its --max-loaded: cannot start {spec.model}")
        free = report.memory_budget_bytes - report.memory_reserved_bytes + sum(
            w.reserved_bytes for n, w in self.unreported if n == node_id)  # its own count, not its last report's
        if spec.reserved_bytes > free:
            raise FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"needs {spec.reserved_bytes / GiB:.2f} GiB, node has {free / GiB:.2f} GiB free")
        self.started.append((node_id, spec))
        worker = report.workers.add(worker_id=spec.worker_id, model=spec.model, state="loading",
                                    reserved_bytes=spec.reserved_bytes, group_size=spec.group_size or 1,
                                    group_rank=spec.group_rank)
        report.memory_reserved_bytes += spec.reserved_bytes
        self._notify()
        task = asyncio.create_task(self._come_up(node_id, spec))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return worker

    async def _come_up(self, node_id: str, spec: pb.WorkerSpec) -> None:
        await asyncio.sleep(self.load_delay)
        worker = self._worker(node_id, spec.worker_id)
        if worker is None:  # stopped while loading
            return
        if self.exit_on_start is not None:
            worker.state, worker.exit_code, worker.reason = "exited", 78, self.exit_on_start
            self._notify()
            return
        worker.state = "running"
        if spec.group_rank == 0:
            self.register(spec.worker_id, spec.model)
        self._notify()

    def register(self, worker_id: str, model: str) -> None:
        """The worker registers with every router (again after a router restart)."""
        address = f"fake-{worker_id}"
        if self.serve:
            fake = self.served.get(worker_id)
            if fake is None:
                raise RuntimeError("serve=True: call register_served")
            address = fake.address
        for registry in self.registries:
            registry.register(worker_id, address, "", pb.LoadReport(worker_id=worker_id, model=model,
                                                                     max_model_len=2048, kv_blocks_total=100))

    def _worker(self, node_id: str, worker_id: str) -> pb.ManagedWorker | None:
        return next((w for w in self.reports[node_id].workers if w.worker_id == worker_id), None)

    async def stop(self, node_id: str, worker_id: str, drain_timeout: float) -> pb.ManagedWorker:
        worker = self._worker(node_id, worker_id)
        if worker is None:
            raise FleetError(grpc.StatusCode.NOT_FOUND, f"no worker {worker_id!r} on {node_id}")
        worker.state = "stopping"
        loop = asyncio.get_running_loop()
        until = loop.time() + drain_timeout
        while loop.time() < until and any(r.workers[worker_id].inflight for r in self.registries
                                           if worker_id in r.workers):
            await asyncio.sleep(0.01)
        self.stopped.append(worker_id)
        gone = pb.ManagedWorker()
        gone.CopyFrom(worker)
        gone.state = "exited"
        fake = self.served.pop(worker_id, None)
        if fake is not None:
            await fake.server.stop(grace=None)
        if self.stale:
            worker.state = "running"  # the report the router has is from before the stop
            self.unreported.append((node_id, worker))
            return gone
        self._unlist(node_id, worker)
        for registry in self.registries:
            registry.remove(worker_id)
        self._notify()
        return gone

    def _unlist(self, node_id: str, worker: pb.ManagedWorker) -> None:
        report = self.reports[node_id]
        report.memory_reserved_bytes -= worker.reserved_bytes
        report.workers.remove(worker)

    def heartbeat(self) -> None:
        """The nodes report: the workers stopped since are gone from their reports."""
        for node_id, worker in self.unreported:
            self._unlist(node_id, worker)
        self.unreported.clear()
        self._notify()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for fake in self.served.values():
            await fake.server.stop(grace=None)


class ServingNodes(FakeNodes):
    """FakeNodes whose workers answer gRPC: a `FakeWorker` started for each worker."""

    def __init__(self, registries: list[Registry], load_delay: float = 0.05):
        super().__init__(registries, load_delay, serve=True)

    async def _come_up(self, node_id: str, spec: pb.WorkerSpec) -> None:
        if spec.group_rank == 0:
            self.served[spec.worker_id] = await FakeWorker(spec.worker_id, model=spec.model).start()
        await super()._come_up(node_id, spec)
