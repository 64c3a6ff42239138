"""The router's `Fleet` service: node agents register and report (the join token, checked
by `NodeRegistry`); `ListNodes` (the nodes of the router's node side: these agents, or
Ray's nodes under `orchard ray up --catalog`) and the catalog RPCs are admin RPCs (the admin key, checked
by the server's `AuthInterceptor` like the router's other admin RPCs). The catalog RPCs are
the fleet controller's (`catalog_rpcs`: an object with async methods of the same names
taking `(request, context)`); a router started without a catalog has none and says how to
start one."""

from __future__ import annotations

import grpc

from cluster.fleet import FleetError
from cluster.fleet.nodes import NodeRegistry, NodeSide
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
from cluster.security import peer_identity

NO_CATALOG = "this router has no model catalog: start it with --catalog FILE"


class FleetServicer(pb_grpc.FleetServicer):
    def __init__(self, nodes: NodeRegistry, catalog_rpcs=None, node_side: NodeSide | None = None):
        self.nodes = nodes
        self.catalog_rpcs = catalog_rpcs  # the controller's AddModel ... UnloadModel; None: no catalog
        self.node_side = node_side or nodes  # what ListNodes lists: where the controller places models

    async def RegisterNode(self, request, context):
        try:
            record = self.nodes.register(request.join_token, request.report, identity=peer_identity(context))
        except FleetError as e:
            await context.abort(e.code, e.message)
        interval_ms = int(self.nodes.config.heartbeat_interval * 1000)
        return pb.RegisterNodeResponse(node_id=record.node_id, heartbeat_interval_ms=interval_ms)

    async def NodeHeartbeat(self, request, context):
        try:
            known = self.nodes.heartbeat(request.join_token, request.report, identity=peer_identity(context))
        except FleetError as e:
            await context.abort(e.code, e.message)
        return pb.NodeHeartbeatResponse(known=known)

    async def ListNodes(self, request, context):
        return pb.ListNodesResponse(nodes=self.node_side.nodes())

    async def _catalog(self, method: str, request, context):
        if self.catalog_rpcs is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_CATALOG)
        return await getattr(self.catalog_rpcs, method)(request, context)

    async def AddModel(self, request, context):
        return await self._catalog("AddModel", request, context)

    async def RemoveModel(self, request, context):
        return await self._catalog("RemoveModel", request, context)

    async def ListCatalog(self, request, context):
        return await self._catalog("ListCatalog", request, context)

    async def LoadModel(self, request, context):
        return await self._catalog("LoadModel", request, context)

    async def UnloadModel(self, request, context):
        return await self._catalog("UnloadModel", request, context)
