"""Placement policies, the imbalance guard, the prefix index and the registry: plain Python."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.policy import LeastLoaded, PrefixAware, RoundRobin, make_policy
from cluster.router.prefix_index import PrefixIndex, chained_hashes, prompt_keys, token_chunks
from cluster.router.registry import DRAINING, HEALTHY, UNHEALTHY, Registry, RegistryConfig, RegistryError, WorkerRecord


@dataclass
class W:
    worker_id: str
    load: float = 0
    kv_usage: float = 0.0


def text_request(text: str, model: str = "m") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, model=model)


LONG_A = "system: you are a helpful orchard assistant. " * 20
LONG_B = "system: you are a terse botanist who answers in latin. " * 20


def place(policy, candidates, keys) -> str:
    """What the proxy does: choose a worker, which then accepts the request (its first chunk)."""
    worker_id = policy.choose(candidates, keys).worker_id
    policy.settled(worker_id, keys, accepted=True)
    return worker_id


# -- policies ----------------------------------------------------------------------------------
def test_round_robin_cycles_in_id_order():
    ws = [W("b"), W("a"), W("c")]
    rr = RoundRobin()
    assert [rr.choose(ws, []).worker_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_picks_lowest_load_and_spreads_ties():
    ll = LeastLoaded()
    assert ll.choose([W("a", 5), W("b", 1), W("c", 3)], []).worker_id == "b"
    picks = Counter(ll.choose([W("a", 2), W("b", 2)], []).worker_id for _ in range(10))
    assert picks == {"a": 5, "b": 5}
    # KV usage breaks ties in load.
    assert ll.choose([W("a", 2, 0.9), W("b", 2, 0.1)], []).worker_id == "b"


def test_prefix_aware_follows_the_prefix():
    pa = PrefixAware()
    ws = [W("a"), W("b")]
    keys_a = prompt_keys(text_request(LONG_A + "question 1"))
    keys_b = prompt_keys(text_request(LONG_B + "question 1"))
    first_a = place(pa, ws, keys_a)
    first_b = place(pa, ws, keys_b)
    assert first_a != first_b  # new prefixes go to the least loaded (ties rotate)
    for i in range(2, 10):
        assert place(pa, ws, prompt_keys(text_request(LONG_A + f"question {i}"))) == first_a
        assert place(pa, ws, prompt_keys(text_request(LONG_B + f"question {i}"))) == first_b


def test_prefix_aware_learns_only_what_a_worker_accepted():
    """A placement the worker then refused (a prompt too long for it, a bad field) records
    nothing: refused prompts neither fill the index nor point it at a cache without them.
    While a placement is unsettled, the same prefix follows it (a burst of one prompt)."""
    pa = PrefixAware()
    keys = prompt_keys(text_request(LONG_A))
    assert pa.choose([W("a"), W("b", 1)], keys).worker_id == "a"
    assert pa.choose([W("a", 1), W("b")], keys).worker_id == "a"
    pa.settled("a", keys, accepted=False)
    pa.settled("a", keys, accepted=False)
    assert len(pa.index) == 0 and not +pa.index.held and len(pa.placing) == 0
    assert pa.choose([W("a", 1), W("b")], keys).worker_id == "b"  # nothing learnt: the least loaded
    pa.settled("b", keys, accepted=True)
    assert len(pa.index) == len(keys) and +pa.index.held == {"b": len(keys)} and len(pa.placing) == 0
    assert pa.choose([W("a"), W("b", 1)], keys).worker_id == "b"


def test_prefix_aware_without_a_match_is_least_loaded():
    pa = PrefixAware()
    ws = [W("a", 3), W("b", 1)]
    assert pa.choose(ws, prompt_keys(text_request(LONG_A))).worker_id == "b"
    assert pa.choose(ws, []).worker_id == "b"


@pytest.mark.parametrize(
    "affine_load,least_load,expect",
    [
        (8, 0, "a"),  # gap 8 is not more than the absolute threshold: keep affinity
        (9, 0, "b"),  # gap 9 > 8 and 9 > 1.5 * 0: imbalanced
        (20, 12, "a"),  # gap 8: keep affinity
        (30, 21, "a"),  # gap 9 > 8, but 30 <= 1.5 * 21 = 31.5: keep affinity
        (40, 21, "b"),  # gap 19, 40 > 31.5: imbalanced
    ],
)
def test_imbalance_guard_needs_both_thresholds(affine_load, least_load, expect):
    pa = PrefixAware(balance_abs_threshold=8, balance_rel_threshold=1.5)
    keys = prompt_keys(text_request(LONG_A))
    pa.index.insert(keys, "a")
    ws = [W("a", affine_load), W("b", least_load)]
    assert pa.choose(ws, keys).worker_id == expect


def test_imbalance_guard_records_the_new_holder():
    pa = PrefixAware()
    keys = prompt_keys(text_request(LONG_A))
    pa.index.insert(keys, "a")
    assert place(pa, [W("a", 50), W("b", 0)], keys) == "b"
    # Both now hold it: the next one goes to whichever of them is less loaded.
    assert place(pa, [W("a", 50), W("b", 10)], keys) == "b"
    assert place(pa, [W("a", 10), W("b", 14)], keys) == "a"


def test_new_prefixes_spread_over_caches_within_the_guard():
    pa = PrefixAware()
    ws = [W("a", 1), W("b", 2)]
    groups = [prompt_keys(text_request(f"group {g}: " + LONG_A)) for g in range(6)]
    picks = [place(pa, ws, keys) for keys in groups]
    assert picks == ["a", "b"] * 3  # the emptier cache wins while the loads are close
    assert pa.index.held["a"] == pa.index.held["b"]
    busy = [W("a", 0), W("b", 20)]
    assert pa.choose(busy, prompt_keys(text_request("group 9: " + LONG_A))).worker_id == "a"  # b is too busy


def test_longest_match_wins():
    pa = PrefixAware()
    short = prompt_keys(text_request(LONG_A[:200]))
    full = prompt_keys(text_request(LONG_A))
    pa.index.insert(short, "a")
    pa.index.insert(full, "b")
    assert pa.index.match(full, ["a", "b"]) == {"a": len(short), "b": len(full)}
    assert pa.choose([W("a"), W("b", 2)], full).worker_id == "b"


def test_forget_drops_a_worker():
    pa = PrefixAware()
    keys = prompt_keys(text_request(LONG_A))
    pa.index.insert(keys, "a")
    pa.forget("a")
    assert len(pa.index) == 0


def test_make_policy():
    assert make_policy("prefix_aware").name == "prefix_aware"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


# -- prefix index --------------------------------------------------------------------------------
def test_keys_name_whole_prefixes():
    a = prompt_keys(pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(40)))))
    b = prompt_keys(pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(32)) + [7] * 8)))
    c = prompt_keys(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[99] + list(range(1, 40)))))
    assert len(a) == 2  # full 16-token blocks only
    assert a == b
    assert a[0] != c[0] and a[1] != c[1]  # a change in block 0 changes every later key
    chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="system", content=LONG_A)]))
    assert len(prompt_keys(chat)) > 5
    assert prompt_keys(text_request(LONG_A, model="x")) != prompt_keys(text_request(LONG_A, model="y"))


def test_index_is_lru_bounded():
    idx = PrefixIndex(max_keys=10)
    for i in range(5):
        idx.insert(chained_hashes([bytes([i, j]) for j in range(4)], seed=str(i)), f"w{i}")
    assert len(idx) == 10
    assert sum(idx.held.values()) == 10
    # The oldest prefixes went first.
    assert idx.match(chained_hashes([bytes([0, j]) for j in range(4)], seed="0"), ["w0"]) == {"w0": 0}
    assert idx.match(chained_hashes([bytes([4, j]) for j in range(4)], seed="4"), ["w4"]) == {"w4": 4}


@given(st.lists(st.integers(0, 3), min_size=0, max_size=80), st.integers(0, 80))
def test_match_is_the_common_block_prefix(ids, cut):
    idx = PrefixIndex()
    stored = chained_hashes(token_chunks(ids))
    idx.insert(stored, "w")
    probe_ids = ids[:cut] + [9] * 5
    probe = chained_hashes(token_chunks(probe_ids))
    common = 0
    while common < min(len(stored), len(probe)) and ids[: 16 * (common + 1)] == probe_ids[: 16 * (common + 1)]:
        common += 1
    assert idx.match(probe, ["w", "v"]) == {"w": common, "v": 0}


# -- registry ------------------------------------------------------------------------------------------
def report(worker_id="w1", model="m", running=0, waiting=0, draining=False):
    return pb.LoadReport(worker_id=worker_id, model=model, num_running=running, num_waiting=waiting,
                         kv_blocks_used=10, kv_blocks_total=100, draining=draining)


def test_load_is_report_plus_router_inflight_since_it():
    w = WorkerRecord("w", "addr")
    w.on_report(report(running=4), 0.0)
    assert w.load == 4
    w.inflight = 3  # placed 3 since the report
    assert w.load == 7
    w.on_report(report(running=7), 1.0)  # the report now includes them
    assert w.load == 7
    w.inflight = 1  # 2 of ours finished since
    assert w.load == 5
    w.on_report(report(running=0), 2.0)  # a lagging report never hides our own requests
    assert w.load == 1
    assert w.kv_usage == 0.1


def test_join_token_and_heartbeats():
    reg = Registry(RegistryConfig(join_token="secret"), connect=False)
    with pytest.raises(RegistryError) as e:
        reg.register("w1", "127.0.0.1:1", "wrong", report())
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    reg.register("w1", "127.0.0.1:1", "secret", report())
    assert reg.heartbeat("w1", "secret", report(running=2))
    assert reg.workers["w1"].report.num_running == 2
    assert not reg.heartbeat("w2", "secret", report("w2"))  # unknown: register again
    with pytest.raises(RegistryError):
        reg.heartbeat("w1", "nope", report())


def test_missed_heartbeats_then_removal():
    reg = Registry(RegistryConfig(heartbeat_interval=1.0, missed_heartbeats=3, remove_after=30), connect=False)
    w = reg.register("w1", "a:1", "", report())
    t0 = w.last_seen
    reg.sweep(t0 + 2.9)
    assert w.state == HEALTHY
    reg.sweep(t0 + 3.1)
    assert w.state == UNHEALTHY
    with pytest.raises(RegistryError) as e:
        reg.candidates("m")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    reg.heartbeat("w1", "", report())  # back
    assert w.state == HEALTHY
    reg.sweep(w.last_seen + 31)
    assert reg.workers == {}


def test_a_stalled_router_does_not_blame_its_workers():
    """The health loop: the time the router's own loop stalled is not the workers' silence
    (their beats wait unread in its sockets), but silence with the loop free still counts,
    and so does silence while every round is late. Each change of state wakes `wait_changed`."""

    async def main():
        reg = Registry(RegistryConfig(heartbeat_interval=0.05, missed_heartbeats=3), connect=False)
        w = reg.register("w1", "a:1", "", report())
        stop = asyncio.Event()
        loop_task = asyncio.create_task(reg.run(stop))
        try:
            await asyncio.sleep(0.02)
            time.sleep(0.4)  # noqa: ASYNC251 -- the router's loop stalls for 8 intervals
            await asyncio.sleep(0.01)  # the health loop wakes up late and sweeps first
            assert w.state == HEALTHY
            reg.heartbeat("w1", "", report())  # the beat that waited in the socket
            changed = asyncio.create_task(reg.wait_changed(5.0))
            await asyncio.sleep(0.6)  # now truly silent, with the loop free
            assert w.state == UNHEALTHY and changed.done() and changed.result() is True

            reg.heartbeat("w1", "", report())
            assert w.state == HEALTHY
            for _ in range(12):  # every round late (the loop busy 0.06 s at a time), no beats
                time.sleep(0.06)  # noqa: ASYNC251
                await asyncio.sleep(0)
            assert w.state == UNHEALTHY

            changed = asyncio.create_task(reg.wait_changed(5.0))
            await asyncio.sleep(0.01)
            assert not changed.done()
            reg.heartbeat("w1", "", report())
            assert await asyncio.wait_for(changed, 1.0) is True and w.state == HEALTHY
            assert await reg.wait_changed(0.05) is False
        finally:
            stop.set()
            await loop_task

    asyncio.run(main())


def test_static_workers_stay_and_drained_ones_get_nothing():
    reg = Registry(connect=False)
    s = reg.add_static("s:1", report("s1"))
    w = reg.register("w1", "a:1", "", report())
    reg.sweep(s.last_seen + 100)
    assert reg.find("s:1") is s and s.state == UNHEALTHY and "w1" not in reg.workers
    s.on_report(report("s1"), s.last_seen + 101)
    w = reg.register("w1", "a:1", "", report())
    w.drained = True
    assert w.state == DRAINING
    assert [c.worker_id for c in reg.candidates("m")] == ["s1"]
    w.drained = False
    w.on_report(report(draining=True), w.last_seen)  # drained on the worker itself
    assert [c.worker_id for c in reg.candidates("m")] == ["s1"]


def test_candidates_by_model():
    reg = Registry(connect=False)
    with pytest.raises(RegistryError) as e:
        reg.candidates("")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    reg.register("w1", "a:1", "", report(model="m1"))
    reg.register("w2", "a:2", "", report("w2", model="m2"))
    assert [w.worker_id for w in reg.candidates("m2")] == ["w2"]
    assert len(reg.candidates("")) == 2
    with pytest.raises(RegistryError) as e:
        reg.candidates("m3")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "m1" in str(e.value)
    assert [m.id for m in reg.models()] == ["m1", "m2"]


def test_reregistration_at_a_new_address_or_id():
    reg = Registry(connect=False)
    reg.register("w1", "a:1", "", report())
    reg.register("w1", "a:2", "", report())  # moved
    assert reg.workers["w1"].address == "a:2"
    reg.register("w9", "a:2", "", report("w9"))  # restarted with a new id at the same address
    assert list(reg.workers) == ["w9"]


def test_the_configs_policy_names_are_the_policies():
    from cluster.router.config import POLICY_NAMES
    from cluster.router.policy import POLICIES

    assert sorted(POLICY_NAMES) == sorted(POLICIES)
