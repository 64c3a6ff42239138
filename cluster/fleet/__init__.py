"""The fleet: many models served on demand over the Macs of a fleet (issue 40).

A node agent per Mac (`orchard node serve`) registers with the router and reports its
memory budget, free disk and the models it holds on disk; it starts and stops ordinary
`orchard worker serve` processes (and group members) when the router asks. In the router,
the FleetController keeps a catalog (SQLite, shared by the routers of a fleet, which claim a
load so only one of them starts it), loads a model when a request names it, and places it
by memory: a footprint (weights + the KV pool it is given + the runtime's overhead) against
each node's budget, preferring nodes that hold the weights, evicting idle unpinned models
fleet-wide or spanning a pipeline group over several nodes when no node has room.

    facts.py       DiskModel facts of a model on disk (node side; no MLX)
    hub.py         hf:ORG/REPO[@REVISION] sources: pull, describe, the hub cache (node side);
                   `orchard model pull`
    footprint.py   memory a worker of a model will hold: weights, KV pool, overhead (pure)
    catalog.py     the catalog and single-flight load claims (SQLite)
    placement.py   the placement policy (pure)
    scaling.py     the replica rule: when a loaded model gets one replica more or fewer (pure)
    nodes.py       NodeRegistry and the NodeSide the controller drives (agents over gRPC);
                   `orchard nodes list`
    service.py     the router's Fleet service: nodes register and report; the catalog RPCs
    agent.py       `orchard node serve`: the node agent (node_config.py: its flags)
    transfer.py    copying a model's files from a peer agent, and serving them to peers
    disk.py        the disk budget of the agent's fetched models (LRU, never one kept)
    ray_nodes.py   the same node side over Ray (`orchard ray up --catalog`): worker actors
    controller.py  FleetController: loads, unloads, keep-alive, the catalog RPCs
    config.py      the router's fleet flags (--catalog, --load-timeout, --default-keep-alive, ...)
    metrics.py     orchard_fleet_* metrics
    models_cli.py  `orchard models add|list|remove|load|unload`

No module here imports MLX: the router and the agent run without it.
"""

from __future__ import annotations

import grpc


class FleetError(Exception):
    """A fleet operation's failure: `code` is the gRPC status the caller sees, `message`
    says what failed and, for bad input, names the field, the limit and the value."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"
