"""Where a model is loaded, and what is unloaded for it: the fleet's one placement policy
(pure: no I/O, no clock of its own, no asyncio; the controller gives it what it knows).

How Orchard places a model
--------------------------
Each node gives models a memory budget. A model's footprint is its weights, the KV cache
its worker is given and the runtime's own overhead; a node's free room is its budget less
the footprints of the models it runs. Every healthy node is considered: one that holds
the model's files, and one that can fetch them first (copied from a node that holds them,
or pulled from the hub when none does). Fetching costs its time: the weights' bytes at the
copy rate, or at the hub's, slower. So a node that holds the files comes first, and a copy
beats the hub.

1. If a node has room for the model (and runs fewer models than its --max-loaded), the
   model goes there: first a node that holds its files, then the one with the most room.
   When only nodes without the files have room, unloading idle models on a node that holds
   them (as in 2a) is taken instead if it serves sooner than the fetch.
2. If none has room, Orchard weighs two ways and takes the one that serves sooner:
   a. Unload idle models on one node to make room. What is unloaded is chosen across the
      whole fleet: never a pinned model, never one with requests in flight or still
      loading; first the models that cost least to lose, the time to load them again
      times how much they were used lately (a request counts for less the longer ago it
      was); a model whose keep-alive is negative only when nothing else will do. The node
      whose unloads cost least is used.
   b. Span the model over several nodes as a pipeline group, in their free room only,
      unloading nothing: the fewest nodes that can (at most the model's max_nodes; of those,
      the ones that hold its files when they serve sooner), each given a run of consecutive
      layers in proportion to its free room.
   How soon each serves is estimated from the bytes each node reads at its read rate, and
   fetches first where it lacks them (a group's nodes fetch and read their parts at once,
   then take a while to join); unloading an idle model takes a moment. On a tie the group
   wins: it keeps every loaded model serving. Among nodes where unloading costs the same, a
   node that holds the files comes first, then the shortest fetch.
3. A model bigger than any node's budget is always a group. When the nodes' free room is
   not enough for it, idle models on the group's nodes are unloaded as in 2a.
4. When nothing fits, the error says how much the model needs and how much each node has
   free of its budget, and what holds the rest.

Keep-alive: a model idle for its keep-alive is unloaded (0: as soon as its request ends;
negative: never for being idle). A pinned model is never unloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping, Union

import grpc

from cluster.fleet import FleetError
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.worker.group.split import split_layers

if TYPE_CHECKING:
    from cluster.fleet.footprint import Footprint

GIB = 1 << 30
PEER, HUB = "peer", "hub"  # where a node without a model's files fetches them from
USE_HALF_LIFE_SECONDS = 600.0  # a request's weight in a model's recent use halves over this


@dataclass(frozen=True)
class Costs:
    """The estimates placement weighs ways to serve by (seconds)."""

    read_bytes_per_second: float = float(GIB)  # a node reads weights from its disk at this rate
    copy_bytes_per_second: float = GIB / 4  # a node copies weights from a peer node (the agents' LAN)
    hub_bytes_per_second: float = GIB / 32  # a node pulls weights from the hub (a home connection)
    unload_seconds: float = 2.0  # stopping idle workers (in parallel)
    group_start_seconds: float = 10.0  # a group's ranks finding each other once loaded
    use_half_life: float = USE_HALF_LIFE_SECONDS

    def fetch_seconds(self, weight_bytes: int, fetch: str) -> float:
        """Time to fetch `weight_bytes` onto a node: `fetch` is "" (it holds them), PEER or HUB."""
        if not fetch:
            return 0.0
        return weight_bytes / (self.copy_bytes_per_second if fetch == PEER else self.hub_bytes_per_second)

    def load_seconds(self, weight_bytes: int, fetch: str = "") -> float:
        """Time to load `weight_bytes` on a node, after fetching them (`fetch_seconds`)."""
        return weight_bytes / self.read_bytes_per_second + self.fetch_seconds(weight_bytes, fetch)


@dataclass(frozen=True)
class NodeView:
    """A node as placement sees it (from its latest NodeReport)."""

    node_id: str
    budget: int  # bytes it gives models
    reserved: int  # bytes set aside for the workers it runs
    available: int = 0  # the machine's free memory now (shown; the budget is what a node promises)
    platform: str = "metal"
    models: frozenset[str] = frozenset()  # sources it holds on disk, by name
    max_loaded: int = 0  # models it runs at once (0: no limit)
    healthy: bool = True

    @property
    def free(self) -> int:
        return max(self.budget - self.reserved, 0)


def node_view(info: pb.NodeInfo, pending: int = 0) -> NodeView:
    """A node's view from its latest report; `pending`: bytes the controller set aside
    there that its report does not show yet (workers started since)."""
    r = info.report
    names = [m.name for m in r.models if not m.error]
    # a source NAME is held as NAME or NAME.gguf (`facts.model_names`)
    names += [n.removesuffix(".gguf") for n in names if n.endswith(".gguf")]
    return NodeView(r.node_id, r.memory_budget_bytes, r.memory_reserved_bytes + pending, r.memory_available_bytes,
                    r.platform or "metal", frozenset(names), r.max_loaded, info.state == "healthy")


@dataclass(frozen=True)
class Loaded:
    """A model the fleet runs: where and how much, and whether it may be unloaded."""

    model: str
    reserved: Mapping[str, int]  # bytes per node it runs on (a group: several)
    pinned: bool = False
    in_flight: int = 0  # requests running or waiting on it
    loading: bool = False  # starting, loading or unloading: never chosen
    idle_since: float = 0.0  # when its last request ended (or its load did)
    keep_alive: float = 300.0  # seconds; 0: unload after each request; negative: never for idleness
    load_seconds: float = 0.0  # the time to load it again (`Costs.load_seconds`)
    uses: float = 0.0  # its recent requests as of idle_since, decayed (`used`)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(self.reserved)

    @property
    def evictable(self) -> bool:
        return not self.pinned and self.in_flight == 0 and not self.loading


@dataclass(frozen=True)
class ToPlace:
    """The model to place: its footprint on each node that could run it (nodes differ in
    platform; a node left out cannot, e.g. it lacks the weights and cannot fetch them)."""

    model: str
    source: str  # its name under --models-dir (what NodeView.models lists)
    footprints: Mapping[str, Footprint]
    num_layers: int = 0  # 0: not known, never a group
    max_nodes: int = 0  # a group over at most this many nodes (0: any; 1: never a group)


@dataclass(frozen=True)
class Single:
    """Run the model as one worker on `node_id`, after unloading `evict`."""

    node_id: str
    bytes: int  # its reservation there
    evict: tuple[str, ...] = ()
    seconds: float = 0.0  # estimated time until it serves
    why: str = ""


@dataclass(frozen=True)
class Rank:
    """A group member: its node, its layers (first and last, inclusive) and its reservation."""

    node_id: str
    first_layer: int
    last_layer: int
    bytes: int


@dataclass(frozen=True)
class Group:
    """Run the model as a pipeline group, `ranks` in rank order (rank 0 holds the last
    layers and the head, as the group's stages run in reverse rank order), after
    unloading `evict`."""

    ranks: tuple[Rank, ...]
    evict: tuple[str, ...] = ()
    seconds: float = 0.0
    why: str = ""

    @property
    def shares(self) -> str:
        """`--group-shares` in rank order as each rank's layers (first-last): the group
        splits exactly as planned, so a rank that fetched only its layers' files has them."""
        return ",".join(f"{r.first_layer}-{r.last_layer}" for r in self.ranks)


@dataclass(frozen=True)
class NoRoom:
    """Nothing fits: `message` says what the model needs and what each node has."""

    message: str

    def error(self) -> FleetError:
        return FleetError(grpc.StatusCode.RESOURCE_EXHAUSTED, self.message)


Plan = Union[Single, Group, NoRoom]


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


# -- recent use and keep-alive ------------------------------------------------------------------

def decayed(uses: float, since: float, now: float, half_life: float = USE_HALF_LIFE_SECONDS) -> float:
    """`uses` counted at `since`, as it counts at `now` (halved every `half_life`)."""
    return uses * 0.5 ** (max(now - since, 0.0) / half_life)


def used(uses: float, since: float, now: float, half_life: float = USE_HALF_LIFE_SECONDS) -> float:
    """A model's recent use after one more request ends at `now` (its new `Loaded.uses`,
    with `idle_since` = now)."""
    return decayed(uses, since, now, half_life) + 1.0


def expired(loaded: list[Loaded], now: float) -> list[str]:
    """The models idle past their keep-alive, to unload now: not pinned, nothing in flight,
    a keep-alive of 0 or more (0: once its request has ended)."""
    return [m.model for m in loaded if m.evictable and 0 <= m.keep_alive <= now - m.idle_since]


def _cost(m: Loaded, now: float, half_life: float) -> tuple[bool, float]:
    """What losing `m` costs: a negative keep-alive first, then reload time x recent use."""
    return (m.keep_alive < 0, m.load_seconds * decayed(m.uses, m.idle_since, now, half_life))


def eviction_order(loaded: list[Loaded], now: float, half_life: float = USE_HALF_LIFE_SECONDS) -> list[Loaded]:
    """The models that may be unloaded, cheapest to lose first: those with a finite
    keep-alive before those with a negative one, then by reload time x recent use, then
    the longest idle."""
    return sorted((m for m in loaded if m.evictable), key=lambda m: (*_cost(m, now, half_life), m.idle_since, m.model))


def victims_for(node_id: str, loaded: list[Loaded], now: float, need_bytes: int = 0, need_slots: int = 0,
                half_life: float = USE_HALF_LIFE_SECONDS, chosen: tuple[str, ...] = ()) -> list[str] | None:
    """The cheapest models to unload on `node_id` (`eviction_order`) that free `need_bytes`
    there and `need_slots` places under its --max-loaded, counting those already `chosen`;
    None when its idle models cannot."""
    on_node = [m for m in loaded if m.reserved.get(node_id, 0) > 0]
    freed = sum(m.reserved[node_id] for m in on_node if m.model in chosen)
    slots = sum(1 for m in on_node if m.model in chosen)
    picked: list[Loaded] = []
    for m in eviction_order([m for m in on_node if m.model not in chosen], now, half_life):
        if freed >= need_bytes and slots >= need_slots:
            break
        picked.append(m)
        freed, slots = freed + m.reserved[node_id], slots + 1
    if freed < need_bytes or slots < need_slots:
        return None
    for m in sorted(picked, key=lambda m: _cost(m, now, half_life), reverse=True):  # keep what is not needed
        if freed - m.reserved[node_id] >= need_bytes and slots - 1 >= need_slots:
            picked.remove(m)
            freed, slots = freed - m.reserved[node_id], slots - 1
    return [m.model for m in picked]


# -- the plan ---------------------------------------------------------------------------------------

@dataclass
class _Fleet:
    """What one `plan` call works over."""

    want: ToPlace
    nodes: list[NodeView]
    loaded: list[Loaded]
    now: float
    costs: Costs
    hosts: list[NodeView] = field(default_factory=list)

    def count(self, node_id: str) -> int:
        return sum(1 for m in self.loaded if m.reserved.get(node_id, 0) > 0)

    def slots_needed(self, node: NodeView) -> int:
        return max(self.count(node.node_id) + 1 - node.max_loaded, 0) if node.max_loaded else 0

    def holds(self, node: NodeView) -> bool:
        return self.want.source in node.models

    def fetch(self, node: NodeView) -> str:
        """Where `node` fetches the model's files from: "" (it holds them), PEER or HUB."""
        if self.holds(node):
            return ""
        return PEER if any(n.healthy and self.holds(n) for n in self.nodes) else HUB

    def fetch_seconds(self, node: NodeView) -> float:
        return self.costs.fetch_seconds(self.footprint(node).weights, self.fetch(node))

    def footprint(self, node: NodeView) -> Footprint:
        return self.want.footprints[node.node_id]

    def cost_of(self, victims: list[str] | tuple[str, ...]) -> tuple[int, float]:
        """(how many never expire, their reload time x recent use together)."""
        by_name = {m.model: m for m in self.loaded}
        costs = [_cost(by_name[v], self.now, self.costs.use_half_life) for v in victims]
        return (sum(c[0] for c in costs), sum(c[1] for c in costs))

    def freed(self, node_id: str, victims: tuple[str, ...]) -> int:
        return sum(m.reserved.get(node_id, 0) for m in self.loaded if m.model in victims)

    def evictable_on(self, node_id: str) -> int:
        return sum(m.reserved.get(node_id, 0) for m in self.loaded if m.evictable and m.model != self.want.model)


def plan(want: ToPlace, nodes: list[NodeView], loaded: list[Loaded], now: float, costs: Costs = Costs()) -> Plan:
    """Where to load `want` (the rule is the module's docstring): a `Single`, a `Group` or
    `NoRoom`. A plan never reserves more on a node than its free room plus what the plan
    unloads there, and never unloads a pinned model or one in flight or loading."""
    loaded = [m for m in loaded if m.model != want.model]
    f = _Fleet(want, nodes, loaded, now, costs)
    f.hosts = [n for n in nodes if n.healthy and n.node_id in want.footprints]
    if not f.hosts:
        return NoRoom(_no_room(f))
    room = [n for n in f.hosts if f.footprint(n).total <= n.free and not f.slots_needed(n)]
    if room:
        best = max(room, key=lambda n: (f.holds(n), -f.fetch_seconds(n), n.free - f.footprint(n).total, n.node_id))
        seconds = _single_seconds(f, best, ())
        if f.holds(best):
            return Single(best.node_id, f.footprint(best).total, (), seconds,
                          f"{best.node_id} holds its weights and has the most room ({gib(best.free)} GiB free)")
        fetching = f"{best.node_id} has the most room ({gib(best.free)} GiB free), " + _fetching(f, best)
        sooner = _evicting(f, [n for n in f.hosts if f.holds(n)])
        if sooner is not None and sooner.seconds < seconds:
            return replace(sooner, why=f"{sooner.why}: serves in about {sooner.seconds:.0f} s, sooner than "
                                       f"{fetching} (about {seconds:.0f} s)")
        return Single(best.node_id, f.footprint(best).total, (), seconds, fetching)
    evicting, group = _evicting(f), _group(f, evict=False)
    if evicting and group:
        if evicting.seconds < group.seconds:
            return Single(evicting.node_id, evicting.bytes, evicting.evict, evicting.seconds,
                          f"{evicting.why}: serves in about {evicting.seconds:.0f} s, a group in about "
                          f"{group.seconds:.0f} s")
        return Group(group.ranks, (), group.seconds, f"{group.why}: serves in about {group.seconds:.0f} s, "
                                                     f"unloading in about {evicting.seconds:.0f} s")
    return evicting or group or _group(f, evict=True) or NoRoom(_no_room(f))


def _single_seconds(f: _Fleet, node: NodeView, evict: tuple[str, ...]) -> float:
    return (f.costs.unload_seconds if evict else 0.0) + f.costs.load_seconds(f.footprint(node).weights, f.fetch(node))


def _fetching(f: _Fleet, node: NodeView) -> str:
    return "its weights copied from a node that holds them" if f.fetch(node) == PEER else \
        "its weights pulled from the hub (no healthy node holds them)"


def _evicting(f: _Fleet, hosts: list[NodeView] | None = None) -> Single | None:
    """2a: the node (of `hosts`, by default every host) where unloading idle models makes
    room at the least cost."""
    options = []
    for n in f.hosts if hosts is None else hosts:
        need = f.footprint(n).total
        if need > n.budget:
            continue
        victims = victims_for(n.node_id, f.loaded, f.now, need - n.free, f.slots_needed(n), f.costs.use_half_life)
        if victims is not None:
            options.append((f.cost_of(victims), len(victims), not f.holds(n), f.fetch_seconds(n),
                            -(n.free + f.freed(n.node_id, tuple(victims)) - need), n.node_id, n, tuple(victims)))
    if not options:
        return None
    *_, n, victims = min(options, key=lambda o: o[:6])
    why = f"unloads {', '.join(victims)} on {n.node_id}"
    return Single(n.node_id, f.footprint(n).total, victims, _single_seconds(f, n, victims),
                  why if f.holds(n) else f"{why}, {_fetching(f, n)}")


def _layer_capacity(f: _Fleet, n: NodeView, room: int) -> int:
    """Layers of the model a rank on `n` holds in `room` bytes (beside its overhead)."""
    fp, layers = f.footprint(n), f.want.num_layers
    per_layer = (fp.weights + fp.kv) / layers
    if room <= fp.overhead:
        return 0
    return layers if per_layer <= 0 else min(layers, math.floor((room - fp.overhead) / per_layer))


def _group(f: _Fleet, evict: bool) -> Group | None:
    """2b (evict=False: free room only) or 3 (evict=True: idle models on its nodes too): a
    pipeline group over the fewest nodes whose room holds the model."""
    layers, limit = f.want.num_layers, f.want.max_nodes or len(f.hosts)
    if layers < 2 or limit < 2:
        return None
    room = {n.node_id: n.free + (f.evictable_on(n.node_id) if evict else 0) for n in f.hosts}
    members = [n for n in f.hosts if not f.slots_needed(n) or (evict and f.evictable_on(n.node_id))]
    capacity = {n.node_id: _layer_capacity(f, n, room[n.node_id]) for n in members}
    members = [n for n in members if capacity[n.node_id] > 0]
    # the most capacity first (the fewest nodes), or the nodes that hold the files first (no
    # fetch): of the fewest nodes either finds, the one that serves sooner
    orders = [sorted(members, key=lambda n: (capacity[n.node_id], room[n.node_id], f.holds(n), n.node_id),
                     reverse=True),
              sorted(members, key=lambda n: (f.holds(n), -f.fetch_seconds(n), capacity[n.node_id], room[n.node_id],
                                             n.node_id), reverse=True)]
    for size in range(2, min(limit, len(members), layers) + 1):
        found = [g for order in orders if (g := _group_of(f, order[:size], room, capacity, evict)) is not None]
        if found:
            return min(found, key=lambda g: g.seconds)
    return None


def _group_of(f: _Fleet, chosen: list[NodeView], room: dict[str, int], capacity: dict[str, int],
              evict: bool) -> Group | None:
    """A group over the `chosen` nodes, or None when their capacity does not hold the model."""
    layers = f.want.num_layers
    if sum(capacity[n.node_id] for n in chosen) < layers:
        return None
    # Rank 0 (the last layers and the head, and the router's side) on the node with most room.
    by_rank = sorted(chosen, key=lambda n: (room[n.node_id], n.node_id), reverse=True)
    counts = _layer_counts(layers, [room[n.node_id] for n in by_rank], [capacity[n.node_id] for n in by_rank])
    return None if counts is None else _grouped(f, by_rank, counts, evict)


def _layer_counts(layers: int, rooms: list[int], caps: list[int]) -> list[int] | None:
    """Layers per rank (rank order) in proportion to room, none over its capacity; the
    stages (reverse rank order) are split as the group splits its layers."""
    by_stage = split_layers([1] * layers, [float(r) for r in reversed(rooms)])
    counts = [len(r) for r in reversed(by_stage)]
    spill = sum(max(c - cap, 0) for c, cap in zip(counts, caps))
    counts = [min(c, cap) for c, cap in zip(counts, caps)]
    for i in sorted(range(len(counts)), key=lambda i: caps[i] - counts[i], reverse=True):
        more = min(spill, caps[i] - counts[i])
        counts[i], spill = counts[i] + more, spill - more
    return None if spill else counts


def _grouped(f: _Fleet, by_rank: list[NodeView], counts: list[int], evict: bool) -> Group | None:
    layers = f.want.num_layers
    ranks, victims, seconds = [], (), 0.0
    end = layers  # rank 0 holds the last layers
    for n, count in zip(by_rank, counts):
        fp = f.footprint(n)
        size = math.ceil((fp.weights + fp.kv) * count / layers) + fp.overhead
        ranks.append(Rank(n.node_id, end - count, end - 1, size))
        end -= count
        seconds = max(seconds, f.costs.load_seconds(math.ceil(fp.weights * count / layers), f.fetch(n)))
        if evict:
            more = victims_for(n.node_id, f.loaded, f.now, size - n.free, f.slots_needed(n),
                               f.costs.use_half_life, chosen=victims)
            if more is None:
                return None
            victims += tuple(more)
    seconds += f.costs.group_start_seconds + (f.costs.unload_seconds if victims else 0.0)
    nodes = " and ".join(n.node_id for n in by_rank)
    bigger = all(f.footprint(n).total > n.budget for n in f.hosts)
    why = (f"bigger than any node's budget: a group over {nodes}" if bigger else f"a group over {nodes}")
    if victims:
        why += f", unloading {', '.join(victims)}"
    return Group(tuple(ranks), victims, seconds, why)


def _no_room(f: _Fleet) -> str:
    want = f.want
    hosts = f.hosts or [n for n in f.nodes if n.node_id in want.footprints]
    needs = sorted({want.footprints[n.node_id].total for n in hosts} or {0})
    fp = min((want.footprints[n.node_id] for n in hosts), key=lambda fp: fp.total, default=None)
    head = f"model {want.model!r} needs {gib(needs[0])} GiB"
    if fp is not None:
        head += f" (weights {gib(fp.weights)} + KV cache {gib(fp.kv)} + overhead {gib(fp.overhead)})"
    if len(needs) > 1:
        head += f" to {gib(needs[-1])} GiB by platform"
    if not f.nodes:
        return head + "; no node has joined the fleet"
    if not f.hosts:
        return head + f"; no healthy node holds its weights ({want.source!r} under --models-dir): " + "; ".join(
            f"{n.node_id} {'unhealthy' if not n.healthy else 'does not hold them'}" for n in f.nodes)
    parts = []
    for n in f.nodes:
        if n not in f.hosts:
            parts.append(f"{n.node_id} {'unhealthy' if not n.healthy else 'does not hold its weights'}")
            continue
        held = [m for m in f.loaded if m.reserved.get(n.node_id, 0) > 0 and not m.evictable]
        text = f"{n.node_id} {gib(n.free)} of {gib(n.budget)} GiB free"
        if held:
            text += " (" + ", ".join(f"{m.model} {gib(m.reserved[n.node_id])} GiB "
                                     f"{'pinned' if m.pinned else 'loading' if m.loading else 'busy'}"
                                     for m in held) + ")"
        if n.max_loaded and f.count(n.node_id) >= n.max_loaded:
            text += f", at its --max-loaded {n.max_loaded}"
        parts.append(text)
    limit = (f"; its max_nodes is {want.max_nodes}" if want.max_nodes else "") + \
        ("; its layers are not known, so no group" if want.num_layers < 2 else "")
    return f"{head}; no node has room and no group fits{limit}: " + "; ".join(parts)
