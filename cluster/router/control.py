"""The router's `Router` service: registration, heartbeats, static workers, operations."""

from __future__ import annotations

import asyncio
import logging

import grpc

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.router.registry import Registry, RegistryError
from cluster.security import peer_identity

log = logging.getLogger(__name__)


class RouterControl(pb_grpc.RouterServicer):
    def __init__(self, registry: Registry, add_timeout: float = 5.0, fleet=None):
        self.registry = registry
        self.add_timeout = add_timeout
        self.fleet = fleet  # the FleetController: which node and catalog entry a placed worker is of

    async def RegisterWorker(self, request, context):
        try:
            w = self.registry.register(request.worker_id, request.address, request.join_token, request.load,
                                       identity=peer_identity(context), instance=request.instance_id)
        except RegistryError as e:
            await context.abort(e.code, str(e))
        interval_ms = int(self.registry.config.heartbeat_interval * 1000)
        return pb.RegisterWorkerResponse(worker_id=w.worker_id, heartbeat_interval_ms=interval_ms)

    async def Heartbeat(self, request, context):
        try:
            known = self.registry.heartbeat(request.worker_id, request.join_token, request.load,
                                            identity=peer_identity(context))
        except RegistryError as e:
            await context.abort(e.code, str(e))
        return pb.HeartbeatResponse(known=known, kv_ack=self.registry.kv_ack(request.worker_id) if known else None)

    async def ReportFailure(self, request, context):
        try:
            self.registry.report_failure(request.worker_id, request.join_token, request.model, request.reason,
                                         request.exit_code, request.permanent, identity=peer_identity(context))
        except RegistryError as e:
            await context.abort(e.code, str(e))
        return pb.ReportFailureResponse()

    async def AddWorker(self, request, context):
        if not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address is required")
        w = self.registry.add_static(request.address)
        if not w.healthy and w.admin is not None:
            await self.registry.poll(w, timeout=self.add_timeout)
        w = self.registry.find(request.address)
        if w is None or not w.healthy:
            if w is not None and not w.report.model:
                self.registry.remove(w.worker_id)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"could not reach a serving worker at {request.address} (GetLoad and gRPC health) "
                f"within {self.add_timeout:g} s",
            )
        return pb.AddWorkerResponse(worker_id=w.worker_id)

    async def RemoveWorker(self, request, context):
        if self.registry.remove(request.worker_id) is None and not self.registry.forget_failure(request.worker_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {request.worker_id!r}")
        return pb.RemoveWorkerResponse()

    async def ListWorkers(self, request, context):
        rows = [w.info() for w in self.registry.snapshot()]
        rows += [f.info() for f in list(self.registry.failures.values())]
        if self.fleet is not None:
            self.fleet.annotate(rows)
        return pb.ListWorkersResponse(workers=sorted(rows, key=lambda w: w.worker_id))

    async def DrainWorker(self, request, context):
        try:
            info = await self.drain(request.worker_id, request.drain)
        except RegistryError as e:
            await context.abort(e.code, str(e))
        return pb.DrainWorkerResponse(worker=info)

    async def drain(self, worker_id: str, drain: bool) -> pb.WorkerInfo:
        """Drain worker `worker_id` (or undo it): the gRPC call's and the console's.
        RegistryError NOT_FOUND for a worker not known here."""
        w = self.registry.find(worker_id)
        if w is None:
            raise RegistryError(grpc.StatusCode.NOT_FOUND, f"no worker {worker_id!r}")
        self.registry.set_drained(w, drain)
        # Tell the worker too, so that a drain outlives a router restart (the worker
        # re-registers with draining=true) and direct clients see it. Best effort.
        if w.admin is not None:
            try:
                await w.admin.Drain(pb.DrainRequest(drain=drain), timeout=self.add_timeout)
                report = await w.admin.GetLoad(self.registry.load_request(w), timeout=self.add_timeout)
                self.registry.record_report(w, report)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
                log.warning("could not forward drain=%s to %s: %s", drain, w.worker_id, e)
        log.info("worker %s %s", w.worker_id, "draining" if drain else "taking requests again")
        return w.info()
