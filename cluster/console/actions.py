"""The router's operator actions from the console: drain a worker, and with a fleet load,
unload, pin or unpin a catalog model. The same work as the gRPC calls of
`orchard router drain` and `orchard models ...`; the routes ask for the admin key first."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
from google.protobuf import json_format

from cluster.api import errors
from cluster.fleet import FleetError
from cluster.router.registry import RegistryError

if TYPE_CHECKING:
    from cluster.fleet.controller import FleetController
    from cluster.router.control import RouterControl


class RouterActions:
    def __init__(self, control: RouterControl, controller: FleetController | None = None):
        self.control = control
        self.controller = controller

    async def drain(self, worker_id: str, drain: bool) -> dict:
        try:
            info = await self.control.drain(worker_id, drain)
        except RegistryError as e:
            raise errors.from_status(e.code, str(e)) from None
        return {"worker": info.worker_id, "draining": drain}

    async def model(self, name: str, action: str) -> dict:
        controller = self.controller
        if controller is None:
            raise errors.from_status(grpc.StatusCode.FAILED_PRECONDITION,
                                     "this router has no fleet (start it with --catalog)")
        try:
            if action == "load":
                entry = await controller.load(name)
            elif action == "unload":
                entry = await controller.unload(name, "operator")
            else:
                entry = controller.catalog.require(name)
                entry.pin = action == "pin"
                await asyncio.to_thread(controller.catalog.add, entry, True)
                entry = controller.describe(name)
        except FleetError as e:
            raise errors.from_status(e.code, e.message) from None
        return json_format.MessageToDict(entry, preserving_proto_field_name=True)
