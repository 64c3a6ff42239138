"""The disk KV tier in a worker group (cluster/worker/group/kv.py): a 2-rank pipeline group,
each rank with a directory of its own, restarted, serves a prompt's prefix from disk with
the tokens and logprobs of the single process serving it from memory, bit for bit; a
member missing or failing a block's file has the group recompute it, never serve it
wrong; pipelined virtual engines share one store a process; and the wire's KV messages."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_group import models, run_group  # noqa: F401  (models: the fixture)

from cluster.kv.hashing import block_hashes
from cluster.worker.group import wire


@pytest.fixture(scope="module")
def model(models):  # noqa: F811
    return models("qwen3", layers=4, files=2)


_single: dict = {}


def single(model: Path, phase: str) -> dict:
    """The single process on the same workload, the prefix from memory: `first` then
    `second` ("warm" then "again" on one engine), or `short` then `second` ("short")."""
    if phase not in _single:
        from group_driver import KV_CONFIG, run_kv

        from cluster.worker.config import EngineConfig
        from cluster.worker.engine import Engine

        engine = Engine.from_pretrained(model, EngineConfig(**KV_CONFIG))
        engine.warm_up()
        if phase == "again":
            run_kv(engine, "warm")
        _single[phase] = run_kv(engine, phase)
    return _single[phase]


def group(model: Path, dirs: list[Path], phase: str, inflight: int = 1) -> dict:
    return run_group(model, 2, kv_disk_dir=str(dirs[0]), kv_phase=phase, inflight=inflight, timeout=300,
                     members_extra=("--kv-disk-dir", str(dirs[1])))


@pytest.fixture(scope="module")
def warmed(model, tmp_path_factory):
    """Each rank's directory after a group served `first` (its blocks written through)."""
    root = tmp_path_factory.mktemp("group-kv-warm")
    dirs = [root / "rank0", root / "rank1"]
    group(model, dirs, "warm")
    return dirs


def copy(dirs: list[Path], to: Path) -> list[Path]:
    return [Path(shutil.copytree(d, to / d.name)) for d in dirs]


def block_file(disk_dir: Path, index: int) -> Path:
    """The file of `second`'s block `index` in a rank's store."""
    from group_driver import kv_prompts

    h = block_hashes(kv_prompts()["second"], 16)[index].hex()
    found = list(disk_dir.glob(f"*/blocks/*/{h}.kvb"))
    assert len(found) == 1, f"block {index}'s file in {disk_dir}: {found}"
    return found[0]


def same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == want["logprobs"], "logprobs differ (bit for bit)"
    assert got["top"] == want["top"]


def test_a_restarted_group_serves_the_prefix_from_disk_as_the_single_process_from_memory(model, warmed, tmp_path):
    dirs = copy(warmed, tmp_path)
    for d in dirs:  # each rank's own store: its layers' identity
        assert len(list(d.glob("*/blocks/*/*.kvb"))) >= 5
    assert {p.parent.name for p in dirs[0].glob("*/identity.json")} != {p.parent.name for p in
                                                                       dirs[1].glob("*/identity.json")}
    got, want = group(model, dirs, "again"), single(model, "again")
    assert want["second"]["cached"] == 80 and want["second"]["disk"] == 0  # the reference: from memory
    assert got["second"]["cached"] == 80 and got["second"]["disk"] == 80, "the prefix came from disk"
    same(got["second"], want["second"])
    same(got["seeded"], want["seeded"])
    assert got["hit_tokens"] == 80


@pytest.mark.slow
def test_a_prefix_evicted_from_a_groups_memory_is_read_back_from_each_ranks_disk(model, tmp_path):
    """In one run: `first`'s blocks written through on every rank, pushed out of the pool by
    longer prompts, then `second`'s prefix read back (each member after its own writes)."""
    got, want = group(model, [tmp_path / "rank0", tmp_path / "rank1"], "evict"), single(model, "again")
    assert got["second"]["cached"] == 80 and got["second"]["disk"] == 80
    same(got["second"], want["second"])
    same(got["seeded"], want["seeded"])


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["missing", "corrupt"])
def test_a_member_missing_or_failing_a_block_has_the_group_recompute_it(model, warmed, tmp_path, fault):
    """The member's file of the prefix's last block is gone, or a payload byte flipped: the
    group installs the 4 blocks every rank read and computes the rest, as the single
    process does with a 64-token prefix in memory."""
    dirs = copy(warmed, tmp_path)
    path = block_file(dirs[1], 4)
    if fault == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    block_file(dirs[0], 4)  # rank 0 still holds it
    got, want = group(model, dirs, "again"), single(model, "short")
    assert want["second"]["cached"] == 64
    assert got["second"]["cached"] == 64 and got["second"]["disk"] == 64
    same(got["second"], want["second"])


@pytest.mark.slow
def test_pipelined_virtual_engines_share_one_store(model, tmp_path):
    """Two batches in flight (two virtual engines, the prompts in the second one's share of
    the pool): one store a rank, and the prefix from disk after a restart is exact."""
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    group(model, dirs, "warm", inflight=2)
    assert len(list(dirs[0].glob("*/identity.json"))) == 1
    got, want = group(model, dirs, "again", inflight=2), single(model, "again")
    assert got["second"]["disk"] == 80 and got["hit_tokens"] == 80  # the engines' counters are one
    same(got["second"], want["second"])
    same(got["seeded"], want["seeded"])


@pytest.mark.slow
def test_a_restarted_tensor_parallel_group_serves_the_prefix_from_disk_as_from_memory(model, tmp_path):
    """Tensor parallelism (each rank a slice of every layer's heads): the prefix from disk
    after a restart equals it from memory in the same group, bit for bit."""
    def tensor(dirs: list[Path], phase: str) -> dict:
        return run_group(model, 2, parallel="tensor", kv_disk_dir=str(dirs[0]), kv_phase=phase, timeout=300,
                         members_extra=("--kv-disk-dir", str(dirs[1])))

    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    tensor(dirs, "warm")
    got, want = tensor(dirs, "again"), tensor([tmp_path / "m0", tmp_path / "m1"], "memory")
    assert want["second"]["disk"] == 0 and got["second"]["cached"] == 80 and got["second"]["disk"] == 80
    same(got["second"], want["second"])
    same(got["seeded"], want["seeded"])


# -- the wire ------------------------------------------------------------------------------------------

def test_kv_messages_round_trip_and_refuse_malformed_ones():
    h = [bytes([i]) * 15 + b"\0" for i in range(1, 4)]  # a trailing zero byte survives
    blocks = [(3, h[0], None), (7, h[1], h[0])]
    assert wire.read_kv_save(wire.kv_save(blocks), 8) == blocks
    assert wire.read_kv_read(wire.kv_read(9, [(h[0], None), (h[2], h[0])])) == (9, [(h[0], None), (h[2], h[0])])
    assert wire.read_kv_apply(wire.kv_apply(9, [(0, 5), (1, 2)]), 8) == (9, [(0, 5), (1, 2)])
    assert wire.read_kv_read_done(wire.KV_READ_DONE_MSG.pack(9, 2)) == (9, 2)
    with pytest.raises(wire.ProtocolError, match="outside the pool of 4 blocks"):
        wire.read_kv_save(wire.kv_save(blocks), 4)
    with pytest.raises(wire.ProtocolError, match="outside the pool"):
        wire.read_kv_apply(wire.kv_apply(9, [(0, 8)]), 8)
    with pytest.raises(wire.ProtocolError, match="negative index"):
        wire.read_kv_apply(wire.kv_apply(9, [(-1, 1)]), 8)
    with pytest.raises(wire.ProtocolError, match="bytes for 2 blocks"):
        wire.read_kv_read(wire.kv_read(9, [(h[0], None), (h[1], None)])[:-1])
    with pytest.raises(wire.ProtocolError, match="at most 65536"):
        wire.read_kv_read(wire.KV_TICKET.pack(1, wire.MAX_KV_BLOCKS + 1))
    with pytest.raises(wire.ProtocolError, match="shorter than its header"):
        wire.read_kv_save(b"\1", 8)
    with pytest.raises(wire.ProtocolError, match="KV_READ_DONE message of 3 bytes"):
        wire.read_kv_read_done(b"abc")


def test_orchard_up_gives_each_rank_of_a_group_its_own_disk_tier(monkeypatch):
    import argparse
    from dataclasses import replace

    from cluster.config import add_flags, from_args
    from cluster.up import LocalCluster, UpConfig, local_cluster

    parser = argparse.ArgumentParser()
    add_flags(parser, UpConfig)
    config = from_args(UpConfig, parser.parse_args(["--kv-disk-dir", "/kv", "--group-size", "2"]))
    spawned = {}
    monkeypatch.setattr(LocalCluster, "_spawn", lambda self, name, args, cpus, env: spawned.setdefault(name, args))
    local_cluster(replace(config, log_dir="/tmp/unused"), "/m").start_worker(0)
    dirs = {name: args[args.index("--kv-disk-dir") + 1] for name, args in spawned.items()}
    assert dirs == {"worker-0": "/kv/worker-0", "worker-0-rank-1": "/kv/worker-0-rank-1"}


# -- rank 0's and a member's ends, on fakes ---------------------------------------------------------------

class _Leader:
    def __init__(self):
        self.members = {1: object(), 2: object()}
        self.kv_read_done = None
        self.sent: list[tuple[int, bytes]] = []

    def broadcast(self, kind: int, payload: bytes = b"") -> None:
        self.sent.append((kind, payload))


class _Reader:
    def __init__(self):
        self.calls = []

    def submit(self, entries, out, done):
        self.calls.append((entries, out, done))


def _entries(n: int):
    hs = block_hashes(list(range(16 * n)), 16)
    return [(h, hs[i - 1] if i else None, tuple(range(16 * i, 16 * i + 16))) for i, h in enumerate(hs)]


def test_a_read_is_done_with_the_fewest_good_blocks_any_rank_read():
    from cluster.worker.group.kv import LeaderKv

    leader, reader, got = _Leader(), _Reader(), []
    kv = LeaderKv(leader, timeout=60)
    ticket = kv.peers(8).read(_entries(3), reader, [], got.append)
    assert leader.sent[0][0] == wire.KV_READ
    assert wire.read_kv_read(leader.sent[0][1]) == (ticket, [(h, p) for h, p, _ in _entries(3)])
    reader.calls[0][2](3)  # rank 0's own read: all good
    leader.kv_read_done(2, ticket, 1)  # a member failed its second block
    assert got == []  # rank 1 has not answered
    leader.kv_read_done(1, ticket, 3)
    assert got == [1]
    leader.kv_read_done(1, ticket, 3)  # a repeat, or a late one: nothing
    assert got == [1]
    kv.peers(8).apply(ticket, [(0, 2)])  # block ids offset into the virtual engine's share
    assert wire.read_kv_apply(leader.sent[-1][1], 64) == (ticket, [(0, 10)])


def test_a_member_that_never_answers_a_read_costs_a_recompute_not_a_wedge(caplog):
    from cluster.worker.group.kv import LeaderKv

    leader, reader, got = _Leader(), _Reader(), threading.Event()
    kv = LeaderKv(leader, timeout=0.2)
    good = []
    ticket = kv.read(_entries(2), reader, [], lambda k: (good.append(k), got.set()))
    leader.kv_read_done(1, ticket, 2)
    reader.calls[0][2](2)
    assert got.wait(30), "the read never finished"
    assert good == [0] and "rank(s) 2 did not answer a read" in caplog.text
    leader.kv_read_done(2, ticket, 2)  # too late: nothing more
    assert good == [0]


class _Runner:
    num_blocks = 8

    def __init__(self):
        self.pool = np.zeros((8, 16, 2), np.uint16)
        self.written = []

    def kv_pool_layout(self):
        return [(0, "k", (16, 2), "float16")]

    def read_blocks(self, ids):
        return [self.pool[ids]]

    def write_blocks(self, ids, arrays):
        self.written.append(ids)
        self.pool[ids] = arrays[0]


class _Store:
    def __init__(self, blocks):
        self.blocks = blocks  # hash -> rows

    def contains(self, h):
        return h in self.blocks


class _Writer:
    def __init__(self, store):
        self.store = store

    def offer(self, h, parent, tokens, arrays):
        assert tokens is None  # a member's files carry no tokens
        self.store.blocks[h] = arrays[0].copy()
        return True

    def flush(self, timeout):
        return True


class _StoreReader:
    def __init__(self, store):
        self.store = store

    def submit(self, entries, out, done):
        good = 0
        for (h, _, _), bufs in zip(entries, out):
            if h not in self.store.blocks:
                break
            bufs[0][...] = self.store.blocks[h]
            good += 1
        done(good)


def _member(store=True):
    from cluster.worker.group.kv import MemberKv

    sent = []
    runner = _Runner()
    kv = MemberKv(lambda kind, payload: sent.append((kind, payload)), runner)
    if store:
        kv.store = _Store({})
        kv.writer, kv.reader = _Writer(kv.store), _StoreReader(kv.store)
    return kv, runner, sent


def _answers(sent, n: int, seconds: float = 30) -> list[tuple[int, int]]:
    deadline = time.monotonic() + seconds
    while len(sent) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return [wire.read_kv_read_done(p) for k, p in sent if k == wire.KV_READ_DONE]


def test_a_member_saves_reads_and_installs_as_rank_0_says():
    kv, runner, sent = _member()
    entries = [(h, p) for h, p, _ in _entries(3)]
    runner.pool[2], runner.pool[5] = 7, 9
    kv.handle(wire.KV_SAVE, wire.kv_save([(2, entries[0][0], None), (5, entries[1][0], entries[0][0])]))
    assert set(kv.store.blocks) == {entries[0][0], entries[1][0]}
    kv.handle(wire.KV_READ, wire.kv_read(4, entries))  # its third block was never saved here
    assert _answers(sent, 1) == [(4, 2)]
    kv.handle(wire.KV_APPLY, wire.kv_apply(4, [(0, 6), (1, 1)]))
    assert runner.written == [[6, 1]] and (runner.pool[6] == 7).all() and (runner.pool[1] == 9).all()
    kv.handle(wire.KV_READ, wire.kv_read(5, entries))
    with pytest.raises(wire.ProtocolError, match="past the 2 this rank read"):  # never a block it did not read
        _answers(sent, 2)
        kv.handle(wire.KV_APPLY, wire.kv_apply(5, [(2, 3)]))


def test_a_member_without_a_store_answers_none_good_and_drops_what_rank_0_gave_up():
    kv, runner, sent = _member(store=False)
    kv.handle(wire.KV_SAVE, wire.kv_save([(2, bytes(range(16)), None)]))  # nothing to write to
    kv.handle(wire.KV_READ, wire.kv_read(1, [(bytes(range(16)), None)]))
    assert _answers(sent, 1) == [(1, 0)]
    kv.handle(wire.KV_APPLY, wire.kv_apply(1, []))
    with pytest.raises(wire.ProtocolError, match="does not hold"):
        kv.handle(wire.KV_APPLY, wire.kv_apply(9, [(0, 1)]))
    assert runner.written == []


def test_a_read_rank_0_gave_up_on_is_dropped_once_it_is_read():
    from types import SimpleNamespace

    kv, runner, sent = _member()
    held = []
    kv.reader = SimpleNamespace(submit=lambda entries, out, done: held.append(done))
    kv.handle(wire.KV_READ, wire.kv_read(3, [(h, p) for h, p, _ in _entries(2)]))
    deadline = time.monotonic() + 30
    while not held and time.monotonic() < deadline:
        time.sleep(0.01)
    kv.handle(wire.KV_APPLY, wire.kv_apply(3, []))  # rank 0 stopped waiting for this rank
    held[0](2)
    assert sent == [] and not kv._reads and runner.written == []


# -- a group worker, served ------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_restarted_group_worker_serves_a_prompt_from_disk(model, tmp_path):
    """`orchard worker serve` as a 2-rank group (two batches in flight, as by default), a
    directory per rank: a prompt served, SIGTERM (every rank's writes land), started again:
    the prompt's blocks come from disk (usage says so) and its tokens are the cold run's."""
    import random

    from test_group_lifecycle import _rank, _ready, _stop
    from test_kv_tier_restart import ask, tier_ready

    from cluster.up import free_port, free_ports

    *ring, port = free_ports(3)
    hosts, grpc = ",".join(f"127.0.0.1:{p}" for p in ring), f"127.0.0.1:{free_port()}"
    rng = random.Random(3)
    prompt = [rng.randrange(3, 400) for _ in range(200)]
    outputs = []
    for run in range(2):
        rank0 = _rank(model, 0, hosts, port, "--grpc", grpc, "--kv-disk-dir", str(tmp_path / "rank0"))
        member = _rank(model, 1, hosts, port, "--kv-disk-dir", str(tmp_path / "rank1"))
        try:
            _ready(rank0)
            tier_ready(grpc)
            outputs.append(ask(grpc, prompt)[1])
            rank0.send_signal(signal.SIGTERM)
            assert rank0.wait(timeout=120) == 0 and member.wait(timeout=120) == 0
        finally:
            _stop(rank0, member)
    cold, warm = outputs
    assert cold.usage.cached_tokens_disk == 0
    assert warm.usage.cached_tokens == warm.usage.cached_tokens_disk == 192, "the prefix's 12 blocks, from disk"
    assert warm.token_ids == cold.token_ids


def test_a_group_whose_member_runs_no_disk_tier_runs_none(caplog):
    """Rank 0 with --kv-disk-dir, its member without: every read would be recomputed, so
    rank 0's tier is off, saying which rank runs none."""
    from dataclasses import replace

    from cluster.worker.config import EngineConfig
    from cluster.worker.group.leader import _disk_tier_on_every_rank

    config = EngineConfig(kv_disk_dir="/kv")
    assert _disk_tier_on_every_rank(config, {1: {"kv_disk": True}, 2: {"kv_disk": True}}) is config
    assert _disk_tier_on_every_rank(config, {1: {"kv_disk": True}, 2: {}}) == replace(config, kv_disk_dir=None)
    assert "rank(s) 2 of the group run none" in caplog.text
