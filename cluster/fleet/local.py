"""A fleet on one machine: a router with a model catalog and N node agents, each with its
own models directory and memory budget, as local processes (what the fleet's end-to-end
tests and `load/bench_fleet.py` run; a real fleet runs one agent per Mac).

A node's models directory holds the model directories it "has on disk": `add_model` puts
one there (a symlink to a directory made with `orchard model create`, or a copy), so the
nodes can differ in what they hold, as Macs do.

`FIVE_MODELS` is the catalog the end-to-end tests and the benchmark serve (two dense models
of different sizes, a MoE, a 4-bit quantized one and an embedding model, made with
`orchard model create`'s code), and `mixed_trace` the seeded requests that name them in turn.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cluster.up import Child, LocalCluster, free_port, stop_children


@dataclass(frozen=True)
class ModelRecipe:
    """A random-weight model `orchard model create` makes (`quantize_bits`: then converted
    by mlx-lm, group 64, as mlx-community's quantized models are)."""

    name: str  # its catalog name and its directory's
    arch: str = "qwen3"
    size: str = "tiny"
    seed: int = 0
    kind: str = "generate"
    layers: int = 0
    quantize_bits: int = 0

    @property
    def task(self) -> str:
        return "embed" if self.kind == "embedding" else "generate"


FIVE_MODELS = (
    ModelRecipe("chat", "qwen3", seed=0),
    ModelRecipe("coder", "llama", "small", seed=1, layers=2),  # dense, several times chat's weights
    ModelRecipe("moe", "qwen3_moe", seed=2),
    ModelRecipe("chat-4bit", "qwen3", seed=5, quantize_bits=4),
    ModelRecipe("embed", "qwen3", seed=3, kind="embedding"),
)


def make_model(recipe: ModelRecipe, root: str | os.PathLike) -> Path:
    """`recipe`'s model directory under `root`, made once (kept while its config.json is there)."""
    path = Path(root) / recipe.name
    if (path / "config.json").exists():
        return path
    from cluster.modelgen import create_model

    if not recipe.quantize_bits:
        return create_model(path, recipe.arch, recipe.size, recipe.seed, recipe.kind, recipe.layers)
    from mlx_lm import convert

    src = create_model(Path(root) / f"{recipe.name}.float", recipe.arch, recipe.size, recipe.seed, recipe.kind,
                       recipe.layers)
    convert(str(src), mlx_path=str(path), quantize=True, q_bits=recipe.quantize_bits, q_group_size=64)
    return path


@dataclass(frozen=True)
class TraceRequest:
    model: str
    task: str  # "generate": a completion; "embed": an embedding
    prompt: str
    max_tokens: int


TRACE_WORDS = ("apple pear plum cherry quince orchard branch root leaf blossom harvest basket ladder soil rain sun "
               "frost graft prune bee hive cider press barn fence gate path").split()


def mixed_trace(models: tuple[ModelRecipe, ...], rounds: int, seed: int = 0, max_tokens: int = 8,
                per_turn: tuple[int, int] = (1, 3)) -> list[TraceRequest]:
    """`rounds` rounds; each names every model once, in a seeded order, with a seeded number
    (within `per_turn`) of requests of a few words each."""
    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        for m in rng.sample(models, len(models)):
            for i in range(rng.randint(*per_turn)):
                words = " ".join(rng.choice(TRACE_WORDS) for _ in range(rng.randint(3, 12)))
                out.append(TraceRequest(m.name, m.task, f"Request {r}.{i} for {m.name}: {words}", max_tokens))
    return out


@dataclass
class LocalNode:
    name: str
    models_dir: Path
    address: str
    memory_budget: int
    log_path: Path
    child: Child | None = None

    @property
    def state_dir(self) -> Path:
        """Its agent's workers' logs and process ids (each node its own: an agent stops what
        an earlier agent of the same state dir left running)."""
        return self.models_dir.parent / "state"


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
        self.nodes = [LocalNode(f"node-{i}", self.log_dir / f"node-{i}" / "models", f"127.0.0.1:{free_port()}", b,
                                self.log_dir / f"node-{i}.log") for i, b in enumerate(budgets)]
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

    @property
    def metrics_urls(self) -> list[str]:
        """Every router's /metrics, in `router_addresses`' order."""
        return [self.metrics_url, *(f"http://{m}/metrics" for m in self.cluster.extra_router_metrics)]

    def metric(self, name: str, router: int | None = None, **labels: str) -> float:
        """The sum of metric `name`'s samples with `labels` on router `router` (None: on
        every router)."""
        from cluster.bench.server_metrics import parse, total

        urls = self.metrics_urls if router is None else [self.metrics_urls[router]]
        out = 0.0
        for url in urls:
            with urllib.request.urlopen(url, timeout=10) as r:
                out += total(parse(r.read().decode()), name, **labels)
        return out

    def catalog(self, router: int = 0) -> dict:  # name -> pb.CatalogModel
        from cluster.proto.orchard.v1 import orchard_pb2 as pb
        from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
        from cluster.security import channel

        with channel(self.router_addresses[router], self.cluster.client_security(admin=True), aio=False) as ch:
            resp = pb_grpc.FleetStub(ch).ListCatalog(pb.ListCatalogRequest(), timeout=30)
        return {m.name: m for m in resp.models}

    def worker_starts(self, model: str | None = None) -> int:
        """Workers the agents started (for `model`), from their logs: a load of a model on
        one node is one start, a group's one per rank."""
        pattern = re.compile(r"starting worker \S+ of " + (re.escape(model) if model else r"\S+") + r" \(")
        return sum(len(pattern.findall(n.log_path.read_text(errors="replace")))
                   for n in self.nodes if n.log_path.exists())

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
                "--state-dir", str(n.state_dir), "--advertise", "127.0.0.1", *self.node_args]
        n.child = self.cluster._spawn(n.name, args)
        return n.child

    def stop_router(self, i: int = 0, grace: float = 10.0, kill: bool = False) -> None:
        """Router `i` stopped (SIGTERM, or SIGKILL with `kill`); `cluster.start_router(i)`
        starts it again on the same addresses and catalog."""
        child = self.cluster.router if i == 0 else self.cluster.extra_routers[i - 1]
        if child is not None and kill:
            child.proc.kill()
            child.proc.wait()
        elif child is not None:
            stop_children([child], grace)

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
