"""The fleet's placement policy (cluster/fleet/placement.py): each branch of the rule in its
docstring, keep-alive expiry, and a seeded property test over random fleets (a plan never
over-commits a node and never unloads a pinned, busy or loading model)."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass

import grpc
import pytest

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.fleet.placement import (
    Costs,
    Group,
    Loaded,
    NodeView,
    NoRoom,
    Single,
    ToPlace,
    decayed,
    eviction_order,
    expired,
    node_view,
    plan,
    used,
    victims_for,
)

G = 1 << 30


@dataclass(frozen=True)
class FP:
    """A footprint as cluster/fleet/footprint.py's Footprint: weights, KV pool, overhead."""

    weights: int
    kv: int = 0
    overhead: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.overhead


def node(node_id, budget_gib, reserved_gib=0.0, models=("m",), **kw) -> NodeView:
    return NodeView(node_id, int(budget_gib * G), int(reserved_gib * G), models=frozenset(models), **kw)


def want(footprint_gib, nodes, model="new", layers=32, max_nodes=0, kv_gib=0.0, overhead_gib=0.0) -> ToPlace:
    fp = FP(int(footprint_gib * G), int(kv_gib * G), int(overhead_gib * G))
    return ToPlace(model, "m", {n.node_id: fp for n in nodes}, num_layers=layers, max_nodes=max_nodes)


def loaded(model, where: dict, **kw) -> Loaded:
    kw.setdefault("load_seconds", 5.0)
    kw.setdefault("idle_since", 0.0)
    return Loaded(model, {n: int(g * G) for n, g in where.items()}, **kw)


def test_node_view_from_a_report():
    report = pb.NodeReport(node_id="mac-1", memory_budget_bytes=48 * G, memory_reserved_bytes=8 * G,
                           memory_available_bytes=50 * G, platform="cpu", max_loaded=3,
                           models=[pb.DiskModel(name="qwen"), pb.DiskModel(name="broken", error="no config.json")])
    n = node_view(pb.NodeInfo(report=report, state="healthy"), pending=2 * G)
    assert n == NodeView("mac-1", 48 * G, 10 * G, 50 * G, "cpu", frozenset({"qwen"}), 3, True)
    assert n.free == 38 * G
    assert not node_view(pb.NodeInfo(report=report, state="unhealthy")).healthy


def test_a_gguf_file_holds_the_source_named_without_its_suffix():
    """A catalog source NAME is looked up as NAME, then NAME.gguf (`facts.model_names`): a node
    holding smollm.gguf holds the weights of source "smollm" (placement prefers it)."""
    report = pb.NodeReport(node_id="mac-1", memory_budget_bytes=8 * G, models=[pb.DiskModel(name="smollm.gguf")])
    assert {"smollm", "smollm.gguf"} <= node_view(pb.NodeInfo(report=report, state="healthy")).models


# -- 1: a node with room ------------------------------------------------------------------------------

def test_a_node_holding_the_weights_is_preferred_to_more_room():
    a, b = node("a", 16, models=("m",)), node("b", 64, models=())
    p = plan(want(8, [a, b]), [a, b], [], now=0)
    assert isinstance(p, Single) and p.node_id == "a" and p.evict == () and "holds its weights" in p.why


def test_then_the_most_room():
    a, b, c = node("a", 16, 4), node("b", 32, 4), node("c", 32, 20)
    p = plan(want(8, [a, b, c]), [a, b, c], [], now=0)
    assert isinstance(p, Single) and p.node_id == "b" and p.bytes == 8 * G


def test_the_footprint_counts_kv_and_overhead():
    a = node("a", 10)
    assert isinstance(plan(want(8, [a], kv_gib=1, overhead_gib=1), [a], [], now=0), Single)
    p = plan(want(8, [a], kv_gib=1.5, overhead_gib=1, layers=0), [a], [], now=0)
    assert isinstance(p, NoRoom) and "needs 10.5 GiB (weights 8.0 + KV cache 1.5 + overhead 1.0)" in p.message


def test_unhealthy_nodes_and_nodes_without_a_footprint_are_not_used():
    a, b, c = node("a", 64, healthy=False), node("b", 64), node("c", 16)
    w = ToPlace("new", "m", {"a": FP(8 * G), "c": FP(8 * G)}, num_layers=32)  # b cannot run it
    p = plan(w, [a, b, c], [], now=0)
    assert isinstance(p, Single) and p.node_id == "c"


def test_max_loaded_counts_the_models_a_node_runs():
    a, b = node("a", 64, 8, max_loaded=1), node("b", 32, 8)
    m = loaded("x", {"a": 8})
    p = plan(want(8, [a, b]), [a, b], [m], now=100)
    assert isinstance(p, Single) and p.node_id == "b"  # a has more room but runs its one model


def test_max_loaded_on_the_only_node_unloads_one_though_memory_fits():
    a = node("a", 64, 8, max_loaded=1)
    p = plan(want(8, [a]), [a], [loaded("x", {"a": 8})], now=100)
    assert isinstance(p, Single) and p.evict == ("x",)


# -- 2a: unloading idle models, chosen fleet-wide ---------------------------------------------------

def test_eviction_picks_the_cheapest_to_lose_across_the_fleet():
    a, b = node("a", 16, 16), node("b", 16, 16)
    # reload time x recent use: "hot" (used a lot) on a, "cold" (unused, though slow to reload) on b
    hot = loaded("hot", {"a": 16}, uses=20, load_seconds=2, idle_since=90)
    cold = loaded("cold", {"b": 16}, uses=0, load_seconds=60, idle_since=10)
    p = plan(want(12, [a, b], layers=0), [a, b], [hot, cold], now=100)
    assert isinstance(p, Single) and (p.node_id, p.evict) == ("b", ("cold",))


def test_eviction_takes_only_what_it_needs():
    a = node("a", 16, 16)
    small = loaded("small", {"a": 2}, uses=0, load_seconds=1)
    big = loaded("big", {"a": 10}, uses=1, load_seconds=10, idle_since=100)
    other = loaded("other", {"a": 4}, uses=0, load_seconds=3)
    p = plan(want(9, [a], layers=0), [a], [small, big, other], now=100)
    # cheapest first: small, other (6 GiB freed), then big (16): small and other are then not needed
    assert isinstance(p, Single) and p.evict == ("big",)


def test_never_pinned_never_in_flight_never_loading():
    a, b, c = node("a", 16, 16), node("b", 16, 16), node("c", 16, 16)
    models = [loaded("pinned", {"a": 16}, pinned=True), loaded("busy", {"b": 16}, in_flight=1),
              loaded("loading", {"c": 16}, loading=True)]
    p = plan(want(8, [a, b, c], layers=0), [a, b, c], models, now=1000)
    assert isinstance(p, NoRoom)
    assert "pinned 16.0 GiB pinned" in p.message and "busy 16.0 GiB busy" in p.message
    assert "loading 16.0 GiB loading" in p.message


def test_a_negative_keep_alive_is_unloaded_last():
    a, b = node("a", 16, 16), node("b", 16, 16)
    forever = loaded("forever", {"a": 16}, keep_alive=-1, uses=0)
    used_lots = loaded("used", {"b": 16}, keep_alive=300, uses=50, idle_since=99)
    p = plan(want(8, [a, b], layers=0), [a, b], [forever, used_lots], now=100)
    assert isinstance(p, Single) and p.evict == ("used",)
    p = plan(want(8, [a], layers=0), [a, b], [forever, used_lots], now=100)
    assert isinstance(p, Single) and p.evict == ("forever",)  # when nothing else will do


def test_unloading_a_group_frees_every_node_of_it():
    a, b = node("a", 16, 10), node("b", 16, 10)
    grp = loaded("grp", {"a": 10, "b": 10})
    p = plan(want(12, [a, b], layers=0), [a, b], [grp], now=100)
    assert isinstance(p, Single) and p.evict == ("grp",)


def test_the_order_of_eviction():
    models = [loaded("used", {"a": 1}, uses=4, load_seconds=5, idle_since=100),
              loaded("stale", {"a": 1}, uses=4, load_seconds=5, idle_since=100 - 6000),  # its uses decayed away
              loaded("never", {"a": 1}, keep_alive=-5),
              loaded("old", {"a": 1}, idle_since=1), loaded("older", {"a": 1}, idle_since=0),
              loaded("busy", {"a": 1}, in_flight=2)]
    assert [m.model for m in eviction_order(models, now=100)] == ["older", "old", "stale", "used", "never"]


# -- 2: unloading against a group -------------------------------------------------------------------

def fleet_for_choice():
    """Two nodes with 12 GiB free each, each also running an idle 20 GiB model."""
    a, b = node("a", 32, 20), node("b", 32, 20)
    return [a, b], [loaded("x", {"a": 20}), loaded("y", {"b": 20})]


def test_a_small_model_unloads_rather_than_forming_a_group():
    nodes, models = fleet_for_choice()
    p = plan(want(14, nodes), nodes, models, now=100, costs=Costs(read_bytes_per_second=G))
    # unload: 2 s + 14 s to read; group: 7 s each in parallel + 10 s to join
    assert isinstance(p, Single) and len(p.evict) == 1 and p.seconds == pytest.approx(16)
    assert "serves in about 16 s, a group in about 17 s" in p.why


def test_a_big_model_forms_a_group_rather_than_unloading():
    nodes, models = fleet_for_choice()
    p = plan(want(22, nodes), nodes, models, now=100, costs=Costs(read_bytes_per_second=G))
    # unload: 2 + 22 s; group: 11 + 10 s
    assert isinstance(p, Group) and p.evict == () and p.seconds == pytest.approx(21)
    assert {r.node_id for r in p.ranks} == {"a", "b"}


def test_on_a_tie_the_group_wins():
    nodes, models = fleet_for_choice()
    costs = Costs(read_bytes_per_second=G, unload_seconds=0, group_start_seconds=10)
    p = plan(want(20, nodes), nodes, models, now=100, costs=costs)  # 20 s either way
    assert isinstance(p, Group)


def test_fetching_weights_counts_in_a_plans_time():
    a, b = node("a", 32, 20, models=()), node("b", 32, 20, models=())
    models = [loaded("x", {"a": 20}), loaded("y", {"b": 20})]
    slow_fetch = Costs(read_bytes_per_second=G, hub_bytes_per_second=G / 10)
    assert Costs().load_seconds(G, "hub") > Costs().load_seconds(G, "peer") > Costs().load_seconds(G)
    p = plan(want(16, [a, b]), [a, b], models, now=100, costs=slow_fetch)
    # nobody holds it: unload: 2 + 16 + 160 s; group: 8 + 80 + 10 s
    assert isinstance(p, Group) and p.seconds == pytest.approx(98)


# -- nodes without the files: fetched first -----------------------------------------------------------

FETCH = Costs(read_bytes_per_second=G, copy_bytes_per_second=G / 2, hub_bytes_per_second=G / 8)


def test_a_model_no_node_holds_is_pulled_from_the_hub_onto_the_node_with_most_room():
    a, b = node("a", 16, models=()), node("b", 32, models=())
    p = plan(want(8, [a, b]), [a, b], [], now=0, costs=FETCH)
    assert isinstance(p, Single) and p.node_id == "b" and p.seconds == pytest.approx(8 + 64)
    assert "pulled from the hub" in p.why


def test_a_copy_from_a_holder_costs_less_than_the_hub():
    a, b = node("a", 16, 12, models=("m",)), node("b", 32, models=())  # a holds it, has no room
    p = plan(want(8, [a, b]), [a, b], [], now=0, costs=FETCH)
    assert isinstance(p, Single) and p.node_id == "b" and p.seconds == pytest.approx(8 + 16)
    assert "copied from a node that holds them" in p.why
    # the holder unhealthy: the hub
    sick = node("a", 16, 12, models=("m",), healthy=False)
    p = plan(want(8, [sick, b]), [sick, b], [], now=0, costs=FETCH)
    assert p.node_id == "b" and p.seconds == pytest.approx(8 + 64)


def test_unloading_on_a_holder_beats_a_fetch_that_takes_longer():
    a, b = node("a", 16, 12, models=("m",)), node("b", 32, models=())
    idle = [loaded("x", {"a": 12})]
    p = plan(want(8, [a, b]), [a, b], idle, now=100, costs=FETCH)  # unload 2 + read 8 s, copy 16 + 8 s
    assert isinstance(p, Single) and p.node_id == "a" and p.evict == ("x",)
    assert "sooner than b has the most room" in p.why
    quick = Costs(read_bytes_per_second=G, copy_bytes_per_second=8 * G)  # copy 1 s
    p = plan(want(8, [a, b]), [a, b], idle, now=100, costs=quick)
    assert isinstance(p, Single) and p.node_id == "b" and p.evict == ()


def test_where_unloading_costs_the_same_a_holder_then_the_shortest_fetch():
    a, b, c = node("a", 16, 12, models=()), node("b", 16, 12, models=("m",)), node("c", 16, 12, models=())
    idle = [loaded(x, {n: 12}, idle_since=0.0) for x, n in (("x", "a"), ("y", "b"), ("z", "c"))]
    w = ToPlace("new", "m", {"a": FP(8 * G), "b": FP(8 * G), "c": FP(4 * G)}, num_layers=0)
    assert plan(w, [a, b, c], idle, now=100, costs=FETCH).node_id == "b"
    assert plan(w, [a, c], [idle[0], idle[2]], now=100, costs=FETCH).node_id == "c"  # 4 GiB to fetch, not 8


# -- groups ------------------------------------------------------------------------------------------------

def ranks_are_contiguous(p: Group, layers: int) -> None:
    assert p.ranks[0].last_layer == layers - 1 and p.ranks[-1].first_layer == 0
    for upper, lower in zip(p.ranks, p.ranks[1:]):
        assert lower.last_layer == upper.first_layer - 1
    assert all(r.first_layer <= r.last_layer for r in p.ranks)


def test_a_model_bigger_than_any_node_is_a_group_with_shares_by_free_room():
    a, b, c = node("a", 24), node("b", 36), node("c", 8)
    p = plan(want(40, [a, b, c], layers=30), [a, b, c], [], now=0)
    assert isinstance(p, Group) and p.evict == () and "bigger than any node's budget" in p.why
    assert [r.node_id for r in p.ranks] == ["b", "a"]  # two nodes; rank 0 on the most room
    ranks_are_contiguous(p, 30)
    assert [r.last_layer - r.first_layer + 1 for r in p.ranks] == [18, 12]  # 36 : 24 GiB free
    assert p.shares == "12-29,0-11"  # each rank's layers, as the group is told them
    assert all(r.bytes <= n.free for r, n in zip(p.ranks, [b, a]))


def test_a_group_takes_the_fewest_nodes():
    nodes = [node(f"n{i}", 10) for i in range(5)]
    p = plan(want(25, nodes, layers=25), nodes, [], now=0)
    assert isinstance(p, Group) and len(p.ranks) == 3


def test_max_nodes_bounds_a_group():
    nodes = [node(f"n{i}", 10) for i in range(5)]
    p = plan(want(25, nodes, layers=25, max_nodes=2), nodes, [], now=0)
    assert isinstance(p, NoRoom) and "its max_nodes is 2" in p.message
    p = plan(want(15, nodes, layers=25, max_nodes=1), nodes, [], now=0)
    assert isinstance(p, NoRoom) and "its max_nodes is 1" in p.message


def test_no_layers_known_no_group():
    a, b = node("a", 10), node("b", 10)
    p = plan(want(15, [a, b], layers=0), [a, b], [], now=0)
    assert isinstance(p, NoRoom) and "layers are not known" in p.message


def test_a_rank_never_gets_more_layers_than_its_room_holds():
    # by room a would take 7 of 10 layers, but a layer weighs 2 GiB there (a CPU's float32)
    # and 0.5 GiB on b: a holds 5 at most
    a, b = node("a", 12, platform="cpu"), node("b", 5)
    w = ToPlace("new", "m", {"a": FP(20 * G, 0, G // 2), "b": FP(5 * G, 0, G // 2)}, num_layers=10)
    p = plan(w, [a, b], [], now=0)
    assert isinstance(p, Group) and [r.node_id for r in p.ranks] == ["a", "b"]
    assert [r.last_layer - r.first_layer + 1 for r in p.ranks] == [5, 5]
    assert p.ranks[0].bytes <= a.free and p.ranks[1].bytes <= b.free


def test_a_group_that_free_room_cannot_hold_unloads_idle_models_on_its_nodes():
    a, b = node("a", 24, 16), node("b", 24, 16)
    models = [loaded("x", {"a": 16}), loaded("y", {"b": 8}), loaded("z", {"b": 8}, pinned=True)]
    p = plan(want(30, [a, b], layers=30), [a, b], models, now=100)
    assert isinstance(p, Group) and set(p.evict) <= {"x", "y"} and p.evict
    freed = {"a": 16 * G if "x" in p.evict else 0, "b": 8 * G if "y" in p.evict else 0}
    for r in p.ranks:
        assert r.bytes <= {"a": a, "b": b}[r.node_id].free + freed[r.node_id]
    ranks_are_contiguous(p, 30)


# -- nothing fits -------------------------------------------------------------------------------------------

def test_no_room_says_what_is_needed_and_what_each_node_has():
    a, b = node("a", 16, 10), node("b", 8, 2)
    c, d = node("c", 64, healthy=False), node("d", 64, models=())
    w = ToPlace("big", "m", {"a": FP(20 * G), "b": FP(20 * G), "c": FP(20 * G)}, num_layers=32)
    p = plan(w, [a, b, c, d], [loaded("chat", {"a": 10}, pinned=True)], now=0)
    assert isinstance(p, NoRoom)
    m = p.message
    assert m.startswith("model 'big' needs 20.0 GiB")
    assert "a 6.0 of 16.0 GiB free (chat 10.0 GiB pinned)" in m and "b 6.0 of 8.0 GiB free" in m
    assert "c unhealthy" in m and "d does not hold its weights" in m
    err = p.error()
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.message == m


def test_no_node_holds_it():
    a = node("a", 64, models=())
    p = plan(ToPlace("new", "m", {}, num_layers=8), [a], [], now=0)
    assert isinstance(p, NoRoom) and "no healthy node holds its weights ('m' under --models-dir)" in p.message
    assert "a does not hold them" in p.message
    assert "no node has joined" in plan(ToPlace("new", "m", {}), [], [], now=0).message


def test_the_model_itself_is_never_a_victim():
    a = node("a", 16, 16)
    p = plan(want(8, [a], model="x", layers=0), [a], [loaded("x", {"a": 16})], now=100)
    assert isinstance(p, NoRoom)  # a second copy never unloads the first


# -- keep-alive and use -------------------------------------------------------------------------------------

def test_keep_alive_expiry():
    models = [loaded("zero", {"a": 1}, keep_alive=0, idle_since=100),
              loaded("five", {"a": 1}, keep_alive=300, idle_since=100),
              loaded("done", {"a": 1}, keep_alive=300, idle_since=0),
              loaded("never", {"a": 1}, keep_alive=-1, idle_since=-1e9),
              loaded("pinned", {"a": 1}, keep_alive=0, pinned=True),
              loaded("busy", {"a": 1}, keep_alive=0, in_flight=1),
              loaded("loading", {"a": 1}, keep_alive=0, loading=True)]
    assert expired(models, now=100) == ["zero"]
    assert expired(models, now=399) == ["zero", "done"]
    assert expired(models, now=400) == ["zero", "five", "done"]


def test_recent_use_decays():
    assert decayed(8, 0, 600) == pytest.approx(4) and decayed(8, 0, 0) == 8
    assert decayed(8, 10, 5) == 8  # a clock read out of order never adds use
    assert used(0, 0, 50) == 1 and used(2, 0, 1200) == pytest.approx(1.5)


def test_victims_for_max_loaded():
    models = [loaded("a1", {"a": 2}, uses=3, idle_since=100), loaded("a2", {"a": 2}),
              loaded("a3", {"a": 2}, pinned=True), loaded("b1", {"b": 2})]
    assert victims_for("a", models, now=100, need_slots=1) == ["a2"]
    assert victims_for("a", models, now=100, need_slots=2) == ["a2", "a1"]
    assert victims_for("a", models, now=100, need_slots=3) is None
    assert victims_for("a", models, now=100, need_bytes=5 * G) is None
    assert victims_for("a", models, now=100) == []


def test_placement_imports_no_mlx():
    code = ("import sys; sys.modules['mlx'] = None\n"
            "import cluster.fleet.placement\n"
            "assert not any(m == 'mlx' or m.startswith('mlx.') for m, v in sys.modules.items() if v is not None)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- the property: random fleets ---------------------------------------------------------------------------

def random_case(rng: random.Random):
    nodes = []
    for i in range(rng.randint(1, 5)):
        nodes.append(NodeView(f"n{i}", rng.randint(4, 64) * G, 0, platform=rng.choice(["metal", "cpu"]),
                              models=frozenset({"m"} if rng.random() < 0.8 else ()),
                              max_loaded=rng.choice([0, 0, 1, 2, 3]), healthy=rng.random() < 0.9))
    reserved = {n.node_id: 0 for n in nodes}
    models = []
    for j in range(rng.randint(0, 8)):
        where = rng.sample([n.node_id for n in nodes], k=min(len(nodes), rng.choice([1, 1, 1, 2])))
        sizes = {}
        for nid in where:
            budget = next(n.budget for n in nodes if n.node_id == nid)
            sizes[nid] = min(rng.randint(1, 24) * G, budget - reserved[nid])
        if any(s <= 0 for s in sizes.values()):
            continue
        for nid, s in sizes.items():
            reserved[nid] += s
        models.append(Loaded(f"x{j}", sizes, pinned=rng.random() < 0.2, in_flight=rng.choice([0, 0, 0, 2]),
                             loading=rng.random() < 0.1, idle_since=rng.uniform(0, 1000),
                             keep_alive=rng.choice([-1, 0, 300]), load_seconds=rng.uniform(0, 60),
                             uses=rng.uniform(0, 10)))
    static = {n.node_id: rng.choice([0, 0, rng.randint(0, 4) * G]) for n in nodes}  # workers outside the fleet
    nodes = [NodeView(n.node_id, n.budget, reserved[n.node_id] + static[n.node_id], platform=n.platform,
                      models=n.models, max_loaded=n.max_loaded, healthy=n.healthy) for n in nodes]
    weights = rng.randint(1, 60) * G
    fetches = rng.random() < 0.5  # nodes without the files may fetch them (else they cannot run it)
    footprints = {n.node_id: FP(weights * (2 if n.platform == "cpu" else 1), rng.randint(0, 4) * G, G // 2)
                  for n in nodes if "m" in n.models or fetches}
    w = ToPlace("new", "m", footprints, num_layers=rng.choice([0, 2, 8, 40]), max_nodes=rng.choice([0, 1, 2, 3]))
    costs = Costs(read_bytes_per_second=rng.choice([0.5, 1, 4]) * G, unload_seconds=rng.uniform(0, 5),
                  group_start_seconds=rng.uniform(0, 30), copy_bytes_per_second=rng.choice([0.25, 1, 8]) * G,
                  hub_bytes_per_second=rng.choice([0.01, 0.1, 1]) * G)
    return nodes, models, w, costs


def check_plan(p, nodes, models, w) -> None:
    by_node = {n.node_id: n for n in nodes}
    by_model = {m.model: m for m in models}
    if isinstance(p, NoRoom):
        assert "needs" in p.message
        hosts = [n for n in nodes if n.healthy and n.node_id in w.footprints]
        for n in hosts:  # nor would unloading every idle model on one node make room there
            idle = [m for m in models if n.node_id in m.reserved and m.evictable]
            running = sum(1 for m in models if n.node_id in m.reserved) - len(idle)
            assert not (w.footprints[n.node_id].total <= n.free + sum(m.reserved[n.node_id] for m in idle)
                        and (not n.max_loaded or running < n.max_loaded)), n
        return
    evict = p.evict
    assert len(set(evict)) == len(evict)
    for v in evict:
        m = by_model[v]
        assert not m.pinned and m.in_flight == 0 and not m.loading
    placed = [(p.node_id, p.bytes)] if isinstance(p, Single) else [(r.node_id, r.bytes) for r in p.ranks]
    assert len({nid for nid, _ in placed}) == len(placed)
    for nid, size in placed:
        n = by_node[nid]
        assert n.healthy and nid in w.footprints
        freed = sum(by_model[v].reserved.get(nid, 0) for v in evict)
        assert size <= n.free + freed, (nid, size, n.free, freed)
        if n.max_loaded:
            running = sum(1 for m in models if nid in m.reserved and m.model not in evict)
            assert running + 1 <= n.max_loaded
    if isinstance(p, Single):
        assert p.bytes == w.footprints[p.node_id].total
        if p.evict:  # unloading only when no node had room, or only one without the files, fetching longer
            room = [n for n in nodes if n.healthy and n.node_id in w.footprints
                    and w.footprints[n.node_id].total <= n.free and not n.max_loaded]
            assert not any("m" in n.models for n in room)
            assert not room or "m" in by_node[p.node_id].models and "sooner than" in p.why
    else:
        assert 2 <= len(p.ranks) and (not w.max_nodes or len(p.ranks) <= w.max_nodes)
        ranks_are_contiguous(p, w.num_layers)


def test_random_fleets_never_overcommit_nor_evict_the_protected():
    kinds = {(kind, evicts): 0 for kind in (Single, Group) for evicts in (False, True)}
    kinds[NoRoom, False] = 0
    for seed in range(2000):
        rng = random.Random(seed)
        nodes, models, w, costs = random_case(rng)
        p = plan(w, nodes, models, now=1000.0, costs=costs)
        check_plan(p, nodes, models, w)
        kinds[type(p), bool(getattr(p, "evict", ()))] += 1
    assert all(kinds.values()), kinds  # every branch was exercised


def test_a_group_over_the_nodes_that_hold_the_files_rather_than_fetch_onto_one_with_more_room():
    a, b = node("a", 10, models=("m",)), node("b", 10, models=("m",))
    c = node("c", 14, models=())  # the most room, no files
    p = plan(want(16, [a, b, c]), [a, b, c], [], now=0, costs=FETCH)
    assert isinstance(p, Group) and {r.node_id for r in p.ranks} == {"a", "b"}
    quick = Costs(read_bytes_per_second=G, copy_bytes_per_second=64 * G)  # a copy costs next to nothing
    p = plan(want(16, [a, b, c]), [a, b, c], [], now=0, costs=quick)
    assert isinstance(p, Group) and len(p.ranks) == 2
