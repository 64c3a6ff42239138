"""KV events: the worker's journal (cluster/kv/events.py), the router's map (router/kv_map.py)
replaying it, and the two wired through a worker's registration with a router."""

from __future__ import annotations

import asyncio
import threading

from hypothesis import given, settings
from prometheus_client import generate_latest
from hypothesis import strategies as st

from cluster.kv.events import DISK, MEMORY, KvJournal, implied_ack
from cluster.kv.hashing import block_hashes, hash_block, unpack
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.kv_map import EPOCH, GAP, NO_STATE, KvMap
from tests.conftest import run


def h(i: int) -> bytes:
    return hash_block(None, [i])


def hashes(*ids: int) -> list[bytes]:
    return [h(i) for i in ids]


def kinds(batch: pb.KvEventBatch) -> list[tuple[int, str, list[bytes]]]:
    out = []
    for e in batch.events:
        kind = e.WhichOneof("kind")
        out.append((e.seq, kind, unpack(getattr(e, kind).hashes) if kind != "cleared" else []))
    return out


def replay(journal: KvJournal, kv: KvMap, worker: str, ack: pb.KvAck | None, rounds: int = 100) -> pb.KvAck:
    """Batches and acks until the router is up to date; the last ack."""
    for _ in range(rounds):
        batch = journal.batch(ack)
        ack = kv.apply(worker, batch)
        if kv.complete(worker) and ack.seq == journal.seq and not ack.next_part:
            return ack
    raise AssertionError("the map did not catch up")


def assert_mirrors(kv: KvMap, worker: str, journal: KvJournal) -> None:
    assert kv.complete(worker)
    for tier in (MEMORY, DISK):
        assert kv._workers[worker].tiers[tier] == journal.held(tier)


# -- the journal -----------------------------------------------------------------------------------
def test_events_are_numbered_in_one_series_and_counted_per_tier():
    j = KvJournal(16)
    j.stored(MEMORY, hashes(1, 2))
    j.stored(DISK, hashes(1))
    j.removed(MEMORY, hashes(2, 9))  # 9 was never held: nothing to say about it
    j.cleared(DISK)
    j.cleared(DISK)  # already empty: no event
    batch = j.batch(pb.KvAck(epoch=j.epoch, seq=0))
    assert batch.epoch == j.epoch and batch.block_size == 16 and not batch.HasField("snapshot")
    assert kinds(batch) == [(1, "stored", hashes(1, 2)), (2, "stored", hashes(1)), (3, "removed", hashes(2)),
                            (4, "cleared", [])]
    assert [e.tier for e in batch.events] == [MEMORY, DISK, MEMORY, DISK]
    assert j.counts["memory", "stored"] == 1 and j.counts["disk", "cleared"] == 1
    assert kinds(j.batch(pb.KvAck(epoch=j.epoch, seq=3))) == [(4, "cleared", [])]
    assert kinds(j.batch(pb.KvAck(epoch=j.epoch, seq=4))) == []


def test_copies_are_counted_a_hash_leaves_with_its_last_copy():
    """Two engines of one process (pipelined virtual engines) may both cache a hash."""
    j = KvJournal(16)
    j.stored(MEMORY, hashes(1))
    j.stored(MEMORY, hashes(1, 2))
    j.removed(MEMORY, hashes(1))
    assert j.held(MEMORY) == set(hashes(1, 2))
    j.removed(MEMORY, hashes(1))
    assert kinds(j.batch(pb.KvAck(epoch=j.epoch))) == [
        (1, "stored", hashes(1)), (2, "stored", hashes(2)), (3, "removed", hashes(1))]


def test_a_snapshot_when_the_router_has_no_state_another_epoch_or_asks():
    j = KvJournal(16)
    j.stored(MEMORY, hashes(1, 2))
    j.stored(DISK, hashes(3))
    for ack in (None, pb.KvAck(epoch="another", seq=1), pb.KvAck(epoch=j.epoch, seq=2, resync=True)):
        batch = j.batch(ack)
        assert not batch.events
        s = batch.snapshot
        assert (s.seq, s.part, s.parts) == (2, 0, 1)
        assert set(unpack(s.memory_hashes)) == set(hashes(1, 2)) and unpack(s.disk_hashes) == hashes(3)
    assert j.snapshots_sent == 3


def test_overflow_sends_a_snapshot_instead_of_events_it_no_longer_holds():
    j = KvJournal(16, kept=4, batch_events=3)
    for i in range(6):
        j.stored(MEMORY, hashes(i))
    assert j.batch(pb.KvAck(epoch=j.epoch, seq=1)).HasField("snapshot")  # event 2 is gone
    batch = j.batch(pb.KvAck(epoch=j.epoch, seq=2))  # events 3.. are kept: at most 3 a batch
    assert [e.seq for e in batch.events] == [3, 4, 5]


def test_a_snapshot_in_parts_resumes_at_the_part_the_router_needs():
    j = KvJournal(16, part_hashes=2)
    j.stored(MEMORY, hashes(1, 2, 3))
    j.stored(DISK, hashes(4, 5))
    first = j.batch(None).snapshot
    assert (first.seq, first.part, first.parts) == (2, 0, 3)
    j.stored(MEMORY, hashes(6))  # after the snapshot's seq: sent as an event once it is in
    parts = [first] + [j.batch(pb.KvAck(epoch=j.epoch, seq=2, next_part=p)).snapshot for p in (1, 2)]
    assert [p.part for p in parts] == [0, 1, 2] and {p.seq for p in parts} == {2}
    memory = [x for p in parts for x in unpack(p.memory_hashes)]
    disk = [x for p in parts for x in unpack(p.disk_hashes)]
    assert set(memory) == set(hashes(1, 2, 3)) and set(disk) == set(hashes(4, 5))
    assert len(memory) + len(disk) == 5
    # a part of a snapshot the journal no longer keeps: a new snapshot
    assert j.batch(pb.KvAck(epoch=j.epoch, seq=1, next_part=1)).snapshot.part == 0


def test_backlog_asks_for_a_report_at_most_every_interval():
    asked = []
    j = KvJournal(16, on_backlog=lambda: asked.append(j.seq))
    for i in range(255):
        j.stored(MEMORY, hashes(i))
    assert not asked
    j.stored(MEMORY, hashes(255))
    assert asked == [256]
    j.stored(MEMORY, hashes(256))  # within the interval: not again
    assert asked == [256]
    j.batch(None)
    j.stored(MEMORY, hashes(257))  # a batch took them: nothing waits
    assert asked == [256]


def test_implied_ack_is_what_the_map_answers():
    j = KvJournal(16, part_hashes=1)
    j.stored(MEMORY, hashes(1, 2))
    kv = KvMap()
    batch = j.batch(None)
    assert implied_ack(batch, None) == kv.apply("w", batch)
    j.stored(MEMORY, hashes(3))
    ack = replay(j, kv, "w", None)
    j.stored(MEMORY, hashes(4))
    batch = j.batch(ack)
    answer = kv.apply("w", batch)
    assert implied_ack(batch, ack) == answer
    empty = j.batch(answer)
    assert not empty.events and implied_ack(empty, answer) == answer == kv.apply("w", empty)


def test_the_journal_takes_events_from_several_threads():
    j = KvJournal(16)

    def feed(tier: int, base: int) -> None:
        for i in range(200):
            j.stored(tier, hashes(base + i))
            if i % 2:
                j.removed(tier, hashes(base + i - 1))

    threads = [threading.Thread(target=feed, args=(tier, base)) for tier, base in ((MEMORY, 0), (DISK, 1000))]
    kv, ack = KvMap(), None
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        ack = kv.apply("w", j.batch(ack))
    for t in threads:
        t.join()
    replay(j, kv, "w", ack)
    assert_mirrors(kv, "w", j)
    assert len(j.held(MEMORY)) == 100 and len(j.held(DISK)) == 100


# -- the router's map --------------------------------------------------------------------------
def test_match_counts_memory_then_disk_blocks():
    j = KvJournal(16)
    j.stored(MEMORY, hashes(1, 2))
    j.stored(DISK, hashes(1, 2, 3, 4))
    kv = KvMap()
    replay(j, kv, "w", None)
    assert kv.match("w", hashes(1, 2, 3, 4, 5)) == (2, 2)
    assert kv.match("w", hashes(3, 4)) == (0, 2)
    assert kv.match("w", hashes(5, 1)) == (0, 0)
    assert kv.match("w", []) == (0, 0)
    assert kv.match("other", hashes(1)) == (0, 0)
    assert kv.blocks("w") == {MEMORY: 2, DISK: 4} and kv.block_size("w") == 16


def test_a_gap_drops_the_map_and_asks_for_a_resync():
    j = KvJournal(16)
    j.stored(MEMORY, hashes(1))
    kv = KvMap()
    ack = replay(j, kv, "w", None)
    j.stored(MEMORY, hashes(2))
    j.stored(MEMORY, hashes(3))
    batch = j.batch(ack)
    del batch.events[0]  # event 2 lost
    answer = kv.apply("w", batch)
    assert answer.resync and not kv.complete("w") and kv.match("w", hashes(1)) == (0, 0)
    assert kv.resyncs[GAP] == 1
    replay(j, kv, "w", answer)
    assert_mirrors(kv, "w", j)


def test_a_lost_answer_resends_and_nothing_is_applied_twice():
    j = KvJournal(16)
    kv = KvMap()
    ack = replay(j, kv, "w", None)
    j.stored(MEMORY, hashes(1, 2))
    kv.apply("w", j.batch(ack))  # applied; its answer lost: the worker still holds `ack`
    j.removed(MEMORY, hashes(1))
    j.stored(MEMORY, hashes(1))  # stored again after its removal: a replayed "stored" must not be doubled
    before = kv.events_applied["w"]
    ack = kv.apply("w", j.batch(ack))
    assert ack.seq == j.seq and not ack.resync
    assert kv.events_applied["w"] == before + 2  # 2 and 3; event 1 skipped
    assert_mirrors(kv, "w", j)


def test_a_worker_restart_is_a_new_epoch_a_snapshot_replaces_its_map():
    old, kv = KvJournal(16), KvMap()
    old.stored(MEMORY, hashes(1, 2))
    ack = replay(old, kv, "w", None)
    new = KvJournal(16)  # the worker restarted: its memory is empty, its disk holds 2
    new.stored(DISK, hashes(2))
    batch = new.batch(ack)  # the router's ack names the old epoch
    assert batch.HasField("snapshot")
    kv.apply("w", batch)
    assert kv.match("w", hashes(1, 2)) == (0, 0) and kv.match("w", hashes(2)) == (0, 1)
    assert kv.resyncs[EPOCH] == 1
    assert_mirrors(kv, "w", new)
    # events of an epoch the map does not hold (a stale batch): resync
    stale = old.batch(pb.KvAck(epoch=old.epoch, seq=0))
    assert kv.apply("w", stale).resync and kv.resyncs[EPOCH] == 2


def test_a_router_restart_sends_no_ack_and_gets_a_snapshot():
    j = KvJournal(16)
    j.stored(MEMORY, hashes(1))
    replay(j, KvMap(), "w", None)
    j.stored(DISK, hashes(1))
    restarted = KvMap()
    events = j.batch(pb.KvAck(epoch=j.epoch, seq=1))  # what the worker would send the old router
    assert restarted.apply("w", events).resync and restarted.resyncs[NO_STATE] == 1
    replay(j, restarted, "w", None)
    assert_mirrors(restarted, "w", j)


def test_snapshot_parts_out_of_order_or_repeated():
    j = KvJournal(16, part_hashes=1)
    j.stored(MEMORY, hashes(1, 2, 3))
    kv = KvMap()
    ack = kv.apply("w", j.batch(None))
    assert ack.next_part == 1 and not kv.complete("w") and kv.match("w", hashes(1)) == (0, 0)
    part1 = j.batch(ack)
    ack2 = kv.apply("w", part1)
    assert kv.apply("w", part1) == ack2  # its answer lost: sent again, nothing changes
    last = j.batch(ack2)
    done = kv.apply("w", last)
    assert kv.complete("w") and done.seq == 1 and not done.next_part
    assert kv.apply("w", last) == done  # the last part again: still whole
    assert_mirrors(kv, "w", j)
    fresh = KvMap()  # a part of a snapshot it never began: resync
    assert fresh.apply("w", part1).resync


def test_bad_hashes_ask_for_a_resync():
    kv = KvMap()
    batch = pb.KvEventBatch(epoch="e", block_size=16, snapshot=pb.KvSnapshot(memory_hashes=b"x" * 17, parts=1))
    assert kv.apply("w", batch).resync and not kv.complete("w")


def test_forget():
    j, kv = KvJournal(16), KvMap()
    j.stored(MEMORY, hashes(1))
    replay(j, kv, "w", None)
    kv.forget("w")
    assert not kv.complete("w") and "w" not in kv.workers() and "w" not in kv.events_applied


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared", "beat", "lost", "restart"]),
                          st.sampled_from([MEMORY, DISK]), st.lists(st.integers(0, 12), max_size=4)),
                max_size=60))
def test_the_map_always_catches_up_with_the_journal(script):
    """Whatever the events and however answers are lost, a router that keeps answering
    ends up holding exactly the journal's blocks."""
    j, kv, ack = KvJournal(4, kept=8, batch_events=3, part_hashes=3), KvMap(), None
    for op, tier, ids in script:
        if op == "stored":
            j.stored(tier, hashes(*ids))
        elif op == "removed":
            j.removed(tier, hashes(*ids))
        elif op == "cleared":
            j.cleared(tier)
        elif op == "beat":
            ack = kv.apply("w", j.batch(ack))
        elif op == "lost":
            kv.apply("w", j.batch(ack))  # applied, the answer lost
        else:
            kv, ack = KvMap(), None  # the router restarted
    replay(j, kv, "w", ack)
    assert_mirrors(kv, "w", j)


def test_two_routers_each_get_what_they_have_not_acked():
    j = KvJournal(16)
    j.stored(MEMORY, hashes(1))
    a, b = KvMap(), KvMap()
    ack_a = replay(j, a, "w", None)
    j.stored(MEMORY, hashes(2))
    ack_b = replay(j, b, "w", None)  # b took its snapshot after 2
    j.removed(MEMORY, hashes(1))
    assert [e.seq for e in j.batch(ack_a).events] == [2, 3] and [e.seq for e in j.batch(ack_b).events] == [3]
    replay(j, a, "w", ack_a)
    replay(j, b, "w", ack_b)
    assert_mirrors(a, "w", j)
    assert_mirrors(b, "w", j)


def test_the_disk_tier_through_the_journal(tmp_path):
    """The disk store's events (its index at open, writes, LRU evictions) reach the map's
    DISK tier; a restarted process (a new journal) announces what it finds on disk."""
    import numpy as np

    from cluster.kv.disk_store import DiskStore
    from cluster.kv.identity import KvIdentity

    bs, shape = 4, (4, 2, 8)
    identity = KvIdentity(weights="w", block_size=bs, pool_layout=[(shape, "float16")] * 2)
    block = [np.zeros(shape, np.float16)] * 2
    chain = block_hashes(list(range(4 * bs)), bs)
    j, kv = KvJournal(bs), KvMap()
    store = DiskStore.open(tmp_path, identity, budget_bytes=1 << 20, min_free_bytes=0, listener=j.disk_listener())
    assert store.mode == "ok", store.reason
    parent = None
    for i, h in enumerate(chain):
        assert store.write(h, parent, list(range(i * bs, (i + 1) * bs)), block)
        parent = h
    ack = replay(j, kv, "w", None)
    assert kv.match("w", chain) == (0, 4)
    store.drop(chain[2:])
    replay(j, kv, "w", ack)
    assert kv.match("w", chain) == (0, 2)
    assert_mirrors(kv, "w", j)
    store.close()
    again = KvJournal(bs)  # the worker restarted
    reopened = DiskStore.open(tmp_path, identity, 1 << 20, 0, listener=again.disk_listener())
    kv.apply("w", again.batch(ack))  # the old epoch's ack: a snapshot
    assert kv.match("w", chain) == (0, 2)
    assert_mirrors(kv, "w", again)
    reopened.close()


def test_pipelined_virtual_engines_share_one_journal(tiny_model_dir):
    """Two engines of one process caching one prefix: it stays in the memory tier until
    the last of them evicts it."""
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.group.pipelined import PipelinedEngine
    from cluster.worker.model_runner import load_model
    from cluster.worker.sampling_params import SamplingParams

    model, tokenizer = load_model(str(tiny_model_dir))
    engines = [Engine(model, tokenizer, EngineConfig(num_kv_blocks=8, block_size=16, max_num_seqs=2))
               for _ in range(2)]
    pipelined = PipelinedEngine(engines, group=None)
    j = pipelined.kv_journal
    assert all(e.kv_journal is j for e in engines)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = list(range(1, 50))
    for e in engines:
        e.generate([prompt], greedy)
    shared = set(block_hashes(prompt, 16))
    assert shared and shared <= set(engines[0].block_manager.cached) & set(engines[1].block_manager.cached)
    assert j.held(MEMORY) == set(engines[0].block_manager.cached) | set(engines[1].block_manager.cached)
    engines[0].generate([list(range(100, 220))], greedy)  # takes every block of engine 0
    assert not shared & set(engines[0].block_manager.cached)
    assert shared <= j.held(MEMORY)  # engine 1 still holds them
    assert j.held(MEMORY) == set(engines[0].block_manager.cached) | set(engines[1].block_manager.cached)


# -- end to end: a worker, registered with a router and polled by another ------------------------
def sample(text: str, name: str, **labels: str) -> float:
    """The value of metric `name` with `labels` (among others) in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
    raise AssertionError(f"no {name} {labels}")


async def _until(condition, what: str, timeout: float = 60.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        value = condition()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{what} not within {timeout} s")


async def _generate(address: str, token_ids: list[int], max_tokens: int = 2) -> None:
    import grpc

    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=token_ids),
                                     sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))
        async for _ in pb_grpc.GenerationStub(ch).Generate(request, timeout=60):
            pass


def test_the_routers_map_is_the_workers_prefix_cache(tiny_model_dir):
    """A worker registered with one router and polled (static) by another: after requests,
    each router's map of it holds exactly the hashes its prefix cache holds; evicted ones
    leave it; a restarted router resyncs."""
    from cluster.router.config import RouterConfig
    from cluster.router.server import RouterServer
    from cluster.up import free_port
    from cluster.worker.config import EngineConfig, WorkerOptions
    from cluster.worker.server import WorkerServer

    async def main():
        address = f"127.0.0.1:{free_port()}"

        def router_at(grpc_address: str) -> RouterServer:
            return RouterServer(RouterConfig(grpc_address=grpc_address, http_address=None, metrics_address=None,
                                             heartbeat_interval=0.2))

        router = router_at(address)
        await router.start()
        poller = router_at("127.0.0.1:0")
        await poller.start()
        worker = WorkerServer(WorkerOptions(
            model_path=str(tiny_model_dir),
            engine_config=EngineConfig(num_kv_blocks=12, block_size=16, max_model_len=128),
            grpc_address="127.0.0.1:0", metrics_address=None, router=address, worker_id="w0",
            heartbeat_interval=0.2))
        await worker.start()
        bm = worker.engine_loop.engine.block_manager
        assert worker.kv_journal is worker.engine_loop.engine.kv_journal

        def in_step(r: RouterServer, wid: str = "w0") -> bool:
            kv = r.registry.kv_map
            return kv.complete(wid) and kv._workers[wid].tiers[MEMORY] == set(bm.cached)

        try:
            poller.registry.add_static(worker.addresses["grpc"])
            first = list(range(1, 65))  # 4 blocks
            await _generate(worker.addresses["grpc"], first)
            hashes4 = block_hashes(first, 16)
            assert set(hashes4[:3]) <= set(bm.cached)  # the last token's block is not all computed
            await _until(lambda: in_step(router), "the router's map equal to the worker's cache")
            await _until(lambda: in_step(poller), "the polling router's map equal to the worker's cache")
            assert router.registry.kv_map.match("w0", hashes4)[0] >= 3
            assert not router.registry.workers["w0"].report.HasField("kv")  # ListWorkers never shows it
            worker_metrics = worker.service.metrics.render().decode()
            assert sample(worker_metrics, "orchard_kv_events_total", tier="memory", kind="stored") >= 1
            assert sample(worker_metrics, "orchard_kv_event_snapshots_total") >= 2  # the registration, the poll
            router_metrics = generate_latest(router.metrics.prometheus).decode()
            assert sample(router_metrics, "orchard_router_kv_map_blocks", worker="w0", tier="memory") == len(bm.cached)
            assert sample(router_metrics, "orchard_router_kv_resyncs_total", reason="no_state") == 0
            # other prompts take every block: the first prompt's are evicted
            for base in (100, 200, 300):
                await _generate(worker.addresses["grpc"], list(range(base, base + 100)))
            assert not set(hashes4) & set(bm.cached)
            await _until(lambda: in_step(router), "the map after evictions")
            await _until(lambda: in_step(poller), "the polling router's map after evictions")
            assert router.registry.kv_map.match("w0", hashes4) == (0, 0)
            # the router restarts: the worker registers again and sends a snapshot
            await router.stop(grace=0)
            router = router_at(address)
            await router.start()
            await _until(lambda: in_step(router), "the restarted router's map")
            assert router.registry.kv_map.events_applied.get("w0", 0) == 0  # a snapshot, no events
            await _generate(worker.addresses["grpc"], first)
            await _until(lambda: in_step(router), "the restarted router's map after a request")
            assert router.registry.kv_map.events_applied["w0"] >= 1
            assert worker.kv_journal.snapshots_sent >= 3  # two registrations and a poll
        finally:
            await worker.stop()
            await router.stop(grace=0)
            await poller.stop(grace=0)

    run(main(), 180)


def test_the_bench_counts_events_snapshots_and_resyncs():
    from cluster.bench.server_metrics import ServerMetricsSampler, parse

    def exposition(stored: int, snapshots: int, gaps: int) -> str:
        return (f'orchard_kv_events_total{{model="m",worker="w0",tier="memory",kind="stored"}} {stored}\n'
                f'orchard_kv_events_total{{model="m",worker="w0",tier="disk",kind="removed"}} 1\n'
                f'orchard_kv_event_snapshots_total{{model="m",worker="w0"}} {snapshots}\n'
                f'orchard_router_kv_resyncs_total{{reason="gap"}} {gaps}\n'
                f'orchard_router_kv_resyncs_total{{reason="epoch"}} 0\n')

    sampler = ServerMetricsSampler(["127.0.0.1:1"])
    url = sampler.urls[0]
    sampler._before[url] = parse(exposition(3, 1, 0))
    summary = sampler.summarize({url: parse(exposition(10, 2, 1))})
    assert summary.kv_events == 7 and summary.kv_event_snapshots == 1
    assert summary.router_kv_resyncs_by_reason == {"gap": 1, "epoch": 0}


def test_the_routers_map_holds_the_disk_tier_across_a_worker_restart(tiny_model_dir, tmp_path):
    """With --kv-disk-dir the router's map holds the worker's disk blocks too (written
    through as they are cached); a restarted worker's new epoch brings a snapshot in
    which its memory is empty and its disk still holds the prompt: match says (0, n)."""
    from cluster.router.config import RouterConfig
    from cluster.router.server import RouterServer
    from cluster.worker.config import EngineConfig, WorkerOptions
    from cluster.worker.server import WorkerServer

    async def main():
        router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                           heartbeat_interval=0.2))
        await router.start()
        options = WorkerOptions(
            model_path=str(tiny_model_dir),
            engine_config=EngineConfig(num_kv_blocks=32, block_size=16, max_model_len=128,
                                       kv_disk_dir=str(tmp_path / "kv")),
            grpc_address="127.0.0.1:0", metrics_address=None, router=router.grpc_address, worker_id="w0",
            heartbeat_interval=0.2)

        async def start_worker() -> WorkerServer:
            worker = WorkerServer(options)
            await worker.start()
            tier = worker.engine_loop.engine.kv_tier
            assert await asyncio.to_thread(tier.wait_ready, 60) and tier.enabled, tier.reason
            return worker

        kv = router.registry.kv_map
        prompt = list(range(1, 66))
        hashes4 = block_hashes(prompt, 16)
        worker = await start_worker()
        try:
            await _generate(worker.addresses["grpc"], prompt)
            store = worker.engine_loop.engine.kv_tier.store
            await _until(lambda: store.lookup(hashes4) == 4, "the prompt's blocks on disk")
            await _until(lambda: kv.complete("w0") and kv.blocks("w0").get(DISK) == len(store),
                         "the router's disk tier of the worker")
            assert kv.match("w0", hashes4) == (4, 0)  # memory first
            await worker.stop()
            worker = await start_worker()  # a new process: nothing in memory, the same disk
            await _until(lambda: kv.complete("w0") and kv.match("w0", hashes4) == (0, 4),
                         "the restarted worker's disk blocks at the router")
            assert kv._workers["w0"].epoch == worker.kv_journal.epoch
        finally:
            await worker.stop()
            await router.stop(grace=0)

    run(main(), 180)


def test_many_events_are_reported_before_the_next_heartbeat(tiny_model_dir, monkeypatch):
    """Heartbeats every 30 s: a backlog of events asks for a report at once."""
    from cluster.kv import events
    from cluster.router.config import RouterConfig
    from cluster.router.server import RouterServer
    from cluster.worker.config import EngineConfig, WorkerOptions
    from cluster.worker.server import WorkerServer

    monkeypatch.setattr(events, "BACKLOG_EVENTS", 3)

    async def main():
        router = RouterServer(RouterConfig(grpc_address="127.0.0.1:0", http_address=None, metrics_address=None,
                                           heartbeat_interval=30.0))
        await router.start()
        worker = WorkerServer(WorkerOptions(
            model_path=str(tiny_model_dir), engine_config=EngineConfig(num_kv_blocks=8, block_size=16),
            grpc_address="127.0.0.1:0", metrics_address=None, router=router.grpc_address, worker_id="w0",
            heartbeat_interval=30.0))
        await worker.start()
        kv = router.registry.kv_map
        try:
            await _until(lambda: kv.complete("w0"), "the registration's snapshot", 20)
            for base in (1, 100):  # the second prompt evicts the first's blocks
                await _generate(worker.addresses["grpc"], list(range(base, base + 100)))
            assert worker.kv_journal.seq >= 3
            await _until(lambda: kv._workers["w0"].seq >= 3, "the events, long before the next heartbeat", 20)
        finally:
            await worker.stop()
            await router.stop(grace=0)

    run(main(), 120)


def test_a_report_that_comes_after_its_worker_was_removed_leaves_no_map():
    """A drain's GetLoad (router/control.py) answered after the worker was removed: its
    events are not replayed, so the removed worker's map does not come back for good."""
    from cluster.router.registry import Registry

    journal = KvJournal(16)
    journal.stored(MEMORY, hashes(1, 2))
    reg = Registry(connect=False)
    w = reg.register("w1", "a:1", "", pb.LoadReport(worker_id="w1", kv=journal.batch(None)))
    assert reg.kv_map.complete("w1")
    reg.remove("w1")
    reg.record_report(w, pb.LoadReport(worker_id="w1", kv=journal.batch(None)))
    assert reg.kv_map.workers() == []


def test_a_batch_over_the_limits_is_refused_with_a_resync(monkeypatch):
    """Too many events, too many hashes in one report, or a map grown past its bound (a
    worker that never sends removals): the map is dropped and a resync asked for."""
    from cluster.router import kv_map

    monkeypatch.setattr(kv_map, "MAX_BATCH_EVENTS", 4)
    monkeypatch.setattr(kv_map, "MAX_BATCH_HASH_BYTES", 8 * 16)
    monkeypatch.setattr(kv_map, "MAX_WORKER_HASHES", 10)
    kv = KvMap()

    def fresh() -> tuple[KvJournal, pb.KvAck]:
        journal = KvJournal(16)
        journal.stored(MEMORY, hashes(0))
        ack = kv.apply("w", journal.batch(None))
        assert kv.complete("w") and not ack.resync
        return journal, ack

    journal, ack = fresh()
    for i in range(1, 6):  # five events
        journal.stored(MEMORY, hashes(i))
    assert kv.apply("w", journal.batch(ack)).resync and not kv.complete("w")

    journal, ack = fresh()
    journal.stored(MEMORY, hashes(*range(1, 10)))  # nine hashes in one event
    assert kv.apply("w", journal.batch(ack)).resync and not kv.complete("w")

    journal, ack = fresh()
    for start in range(1, 13, 4):  # within a report's limits, past the map's
        journal.stored(DISK, hashes(*range(start, start + 4)))
        ack = kv.apply("w", journal.batch(ack))
    assert ack.resync and kv.workers() == []
    assert kv.resyncs["invalid"] == 3
