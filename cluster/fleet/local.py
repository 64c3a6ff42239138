"""A fleet on one machine: a router with a model catalog and N node agents, each with its
own models directory and memory budget, as local processes (what the fleet's end-to-end
tests and `load/bench_fleet.py` run; a real fleet runs one agent per Mac).

A node's models directory holds the model directories it "has on disk": `add_model` puts
one there (a symlink to a directory made with `orchard model create`, or a copy), so the
nodes can differ in what they hold, as Macs do.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.up import Child, LocalCluster, free_port, stop_children


@dataclass
class LocalNode:
    name: str
    models_dir: Path
    address: str
    memory_budget: int
    child: Child | None = None


class LocalFleet:
    """`with LocalFleet(budgets=[2 << 30, 2 << 30, 3 << 30], log_dir=d) as fleet:` starts
    the router (`--catalog` in `log_dir`) and one agent per budget, and waits until every
    node has registered."""

    def __init__(self, budgets: list[int], log_dir: str | os.PathLike, routers: int = 1,
                 router_args: list[str] | None = None, node_args: list[str] | None = None,
                 http: bool = True):
        self.log_dir = Path(log_dir)
        self.catalog_path = self.log_dir / "catalog.db"
        self.cluster = LocalCluster(
            "", workers=0, grpc_address=f"127.0.0.1:{free_port()}",
            http_address=f"127.0.0.1:{free_port()}" if http else None, metrics_address=f"127.0.0.1:{free_port()}",
            log_dir=self.log_dir, routers=routers,
            router_args=["--catalog", str(self.catalog_path), *(router_args or [])])
        self.node_args = node_args or []
        self.nodes = [LocalNode(f"node-{i}", self.log_dir / f"node-{i}" / "models", f"127.0.0.1:{free_port()}", b)
                      for i, b in enumerate(budgets)]
        for n in self.nodes:
            n.models_dir.mkdir(parents=True, exist_ok=True)

    # -- addresses ----------------------------------------------------------------------------
    @property
    def router_address(self) -> str:
        return self.cluster.router_address

    @property
    def router_addresses(self) -> list[str]:
        return self.cluster.router_addresses

    @property
    def http_url(self) -> str:
        return f"http://{self.cluster.http_address}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.cluster.metrics_address}/metrics"

    # -- models on the nodes' disks -----------------------------------------------------------
    def add_model(self, name: str, source: str | os.PathLike, nodes: list[int] | None = None,
                  copy: bool = False) -> None:
        """Put model `source` (a directory or a .gguf file) under `name` in the models
        directory of `nodes` (default: every node)."""
        source = Path(source).resolve()
        for i in range(len(self.nodes)) if nodes is None else nodes:
            dest = self.nodes[i].models_dir / name
            if dest.exists() or dest.is_symlink():
                continue
            if not copy:
                dest.symlink_to(source, target_is_directory=source.is_dir())
            elif source.is_dir():
                shutil.copytree(source, dest)
            else:
                shutil.copy2(source, dest)

    # -- processes ----------------------------------------------------------------------------
    def start_node(self, i: int) -> Child:
        n = self.nodes[i]
        args = ["node", "serve", "--router", ",".join(self.router_addresses), "--grpc", n.address,
                "--node-id", n.name, "--memory-budget", str(n.memory_budget), "--models-dir", str(n.models_dir),
                "--advertise", "127.0.0.1", *self.node_args]
        n.child = self.cluster._spawn(n.name, args)
        return n.child

    def stop_node(self, i: int, grace: float = 10.0) -> None:
        child = self.nodes[i].child
        if child is not None:
            stop_children([child], grace)

    def start(self, timeout: float = 120.0) -> None:
        for r in range(1 + len(self.cluster.extra_routers)):
            self.cluster.start_router(r)
        for i in range(len(self.nodes)):
            self.start_node(i)
        self.wait_nodes(len(self.nodes), timeout)

    def children(self) -> list[Child]:
        return [*(n.child for n in self.nodes if n.child is not None), *self.cluster.children()]

    def wait_nodes(self, n: int, timeout: float = 120.0) -> None:
        """Until `n` nodes are healthy on every router; a process that died says why."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [c for c in self.children() if c.proc.poll() is not None]
            if dead:
                c = dead[0]
                raise RuntimeError(f"{c.name} exited with code {c.proc.returncode}; its log ({c.log_path}):\n"
                                   f"{c.tail()}")
            if all(len(self.healthy_nodes(r)) >= n for r in self.router_addresses):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{n} healthy nodes not registered within {timeout:g} s (logs in {self.log_dir})")

    def healthy_nodes(self, router: str | None = None) -> list:  # of pb.NodeInfo
        import grpc

        from cluster.proto.orchard.v1 import orchard_pb2 as pb
        from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
        from cluster.security import channel

        try:
            with channel(router or self.router_address, self.cluster.client_security(admin=True), aio=False) as ch:
                resp = pb_grpc.FleetStub(ch).ListNodes(pb.ListNodesRequest(), timeout=2)
        except grpc.RpcError:
            return []
        return [n for n in resp.nodes if n.state == "healthy"]

    def stop(self, grace: float = 10.0) -> None:
        """The agents first (each stops the workers it started), then the routers."""
        stop_children([n.child for n in self.nodes if n.child is not None], grace)
        self.cluster.stop(grace)

    def __enter__(self) -> "LocalFleet":
        try:
            self.start()
        except BaseException:
            self.stop(grace=2)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
