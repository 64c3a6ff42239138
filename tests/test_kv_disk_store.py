"""The disk KV store, writer and reader as plain Python (no model): a block comes back bit for
bit, and every way a file can be wrong (truncated, a flipped byte, another model's, a full or
read-only disk, a writer killed mid-write) costs a recompute, never a wrong block."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.fleet import hub
from cluster.kv import disk_store, hashing
from cluster.kv.disk_store import HEADER_BYTES, DiskStore, KvReadError
from cluster.kv.identity import DIGEST_CACHE, KvIdentity, weights_digest
from cluster.kv.reader import DiskReader
from cluster.kv.writer import DiskWriter

BS = 4
SHAPE = (BS, 2, 8)  # [block_size, kv heads, head dim]
POOLS = 4  # K and V of two layers


def identity(weights: str = "w0", dtype: str = "float16", **fields) -> KvIdentity:
    return KvIdentity(weights=weights, block_size=BS, pool_layout=[(SHAPE, dtype)] * POOLS, backend="host", **fields)


class Chain:
    """A prompt's blocks: hashes, parents, tokens and random K/V per pool."""

    def __init__(self, n: int, seed: int = 0, dtype: str = "float16"):
        rng = np.random.default_rng(seed)
        self.tokens = rng.integers(0, 50_000, n * BS).tolist()
        self.hashes = hashing.block_hashes(self.tokens, BS)
        self.arrays = [[rng.standard_normal(SHAPE).astype(dtype) for _ in range(POOLS)] for _ in range(n)]

    def block(self, i: int) -> tuple:
        """(hash, parent, tokens) of block i."""
        return self.hashes[i], self.hashes[i - 1] if i else None, self.tokens[i * BS:(i + 1) * BS]

    def write(self, store: DiskStore, indices=None) -> None:
        for i in range(len(self.hashes)) if indices is None else indices:
            assert store.write(*self.block(i), self.arrays[i])

    def read(self, store: DiskStore, i: int) -> list[np.ndarray]:
        out = [np.empty(SHAPE, np.float16) for _ in range(POOLS)]
        store.read(*self.block(i), out)
        return out


class Events:
    """A DISK-tier listener that records what it hears."""

    def __init__(self):
        self.disk: set[bytes] = set()
        self.log: list[tuple] = []

    def stored(self, hashes):
        self.disk.update(hashes)
        self.log.append(("stored", list(hashes)))

    def removed(self, hashes):
        self.disk.difference_update(hashes)
        self.log.append(("removed", list(hashes)))

    def cleared(self):
        self.disk.clear()
        self.log.append(("cleared",))


def open_store(root, ident=None, budget=1 << 30, listener=None) -> DiskStore:
    return DiskStore.open(root, ident or identity(), budget, 0, listener)


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path)
    yield s
    s.close()


def file_bytes(store: DiskStore) -> int:
    return store.file_bytes


# -- identity -------------------------------------------------------------------------------

def test_an_identity_is_named_by_everything_in_it():
    a = identity()
    assert a.id == identity().id and len(a.id) == 32 and a == KvIdentity.from_json(a.canonical)
    assert len({a.id, identity(weights="w1").id, identity(dtype="bfloat16").id, identity(rank=1).id}) == 4
    assert a.payload_bytes == POOLS * np.prod(SHAPE) * 2
    with pytest.raises(ValueError, match="block_size 4"):
        KvIdentity(weights="w", block_size=BS, pool_layout=[((8, 2, 8), "float16")])
    with pytest.raises(TypeError):
        KvIdentity(weights="w", block_size=BS, pool_layout=[(SHAPE, "float16")], backend=object())


def test_weights_digest_names_blobs_and_hashes_other_files_once(tmp_path, monkeypatch):
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    sha = "ab" * 32
    (blobs / sha).write_bytes(b"weights held by the hub")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(blobs / sha)
    (model / "config.json").write_text('{"num_hidden_layers": 2}')
    cache = tmp_path / "kv"
    first = weights_digest(model, cache)
    assert (cache / DIGEST_CACHE).exists()

    def no_reading(path, algorithm):
        raise AssertionError(f"{path} read again")

    monkeypatch.setattr(hub, "digest", no_reading)  # a restart: every sum comes from the cache file
    assert weights_digest(model, cache) == first
    monkeypatch.undo()
    (model / "config.json").write_text('{"num_hidden_layers": 3}')
    assert weights_digest(model, cache) != first
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert weights_digest(gguf) != weights_digest(model)


# -- round trip and verification -----------------------------------------------------------

def test_a_block_round_trips_bit_for_bit(store):
    chain = Chain(5)
    events = Events()
    store.listener = events
    chain.write(store)
    assert store.mode == "ok" and len(store) == 5 and store.used_bytes == 5 * file_bytes(store)
    assert events.disk == set(chain.hashes)
    assert store.lookup(chain.hashes) == 5 and store.lookup([b"x" * 16, *chain.hashes]) == 0
    for i in range(5):
        got = chain.read(store, i)
        assert all(np.array_equal(g, a) for g, a in zip(got, chain.arrays[i]))
    store.read(*chain.block(0)[:2], None, [np.empty(SHAPE, np.float16) for _ in range(POOLS)])  # tokens unchecked
    assert store.stats.blocks_read == 6 and store.stats.blocks_written == 5
    assert store.stats.bytes_read == 6 * store.file_bytes == 6 * store.stats.bytes_written / 5
    assert not list((store.dir / "tmp").iterdir())


def test_a_read_refuses_buffers_of_another_layout(store):
    chain = Chain(1)
    chain.write(store)
    with pytest.raises(ValueError, match="C-contiguous"):
        store.read(*chain.block(0), [np.empty((BS, 2, 4), np.float16) for _ in range(POOLS)])


def _corrupt(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset, kind", [(5, "header"), (30, "header"), (HEADER_BYTES + 1, "tokens"),
                                          (-1, "checksum"), (HEADER_BYTES + 4 * BS + 3, "checksum")])
def test_a_flipped_byte_is_refused_and_the_file_deleted(store, offset, kind):
    chain = Chain(3)
    events = Events()
    store.listener = events
    chain.write(store)
    path = store.path(chain.hashes[1])
    _corrupt(path, offset % path.stat().st_size)
    with pytest.raises(KvReadError) as e:
        chain.read(store, 1)
    assert e.value.kind == kind
    assert not path.exists() and not store.contains(chain.hashes[1]) and chain.hashes[1] not in events.disk
    assert store.stats.errors[kind] == 1
    assert store.lookup(chain.hashes) == 1  # the prefix stops before the bad block
    chain.read(store, 2)  # the others still verify


def test_a_truncated_file_is_refused(store):
    chain = Chain(2)
    chain.write(store)
    path = store.path(chain.hashes[1])
    os.truncate(path, path.stat().st_size - 7)
    with pytest.raises(KvReadError, match="truncated"):
        chain.read(store, 1)
    os.truncate(store.path(chain.hashes[0]), 40)
    with pytest.raises(KvReadError, match="truncated"):
        chain.read(store, 0)
    assert len(store) == 0 and store.stats.errors["truncated"] == 2


def test_a_block_asked_for_other_tokens_or_parent_is_refused(store):
    chain, other = Chain(2), Chain(2, seed=1)
    chain.write(store)
    h, parent, tokens = chain.block(1)
    with pytest.raises(KvReadError, match="tokens"):
        store.read(h, parent, other.tokens[:BS], [np.empty(SHAPE, np.float16) for _ in range(POOLS)])
    chain.write(store)
    with pytest.raises(KvReadError, match="tokens"):
        store.read(h, other.hashes[0], tokens, [np.empty(SHAPE, np.float16) for _ in range(POOLS)])


def test_a_file_from_another_model_is_refused(tmp_path):
    chain = Chain(2)
    theirs = open_store(tmp_path, identity(weights="other"))
    chain.write(theirs)
    theirs.close()
    ours = open_store(tmp_path)
    assert ours.dir != theirs.dir and ours.lookup(chain.hashes) == 0
    for h in chain.hashes:  # moved into our directory by hand: same size, refused by its header
        ours.path(h).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(theirs.path(h), ours.path(h))
    ours.close()
    ours = open_store(tmp_path)
    assert ours.lookup(chain.hashes) == 2
    with pytest.raises(KvReadError, match="identity"):
        chain.read(ours, 0)
    assert not ours.path(chain.hashes[0]).exists()
    ours.close()
    other_layout = open_store(tmp_path, identity(dtype="float32"))  # another size: dropped at open
    for h in chain.hashes:
        other_layout.path(h).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(theirs.path(h), other_layout.path(h))
    other_layout.close()
    assert open_store(tmp_path, identity(dtype="float32")).lookup(chain.hashes) == 0


def test_warnings_are_one_per_kind_a_minute(store, caplog):
    chain = Chain(4)
    chain.write(store)
    for i in range(3):
        _corrupt(store.path(chain.hashes[i]), -1 % store.file_bytes)
    with caplog.at_level(logging.WARNING, logger="cluster.kv.disk_store"):
        for i in range(3):
            with pytest.raises(KvReadError):
                chain.read(store, i)
    assert len([r for r in caplog.records if "not served" in r.message]) == 1
    assert store.stats.errors["checksum"] == 3


# -- the reader ------------------------------------------------------------------------------

def _submit(reader: DiskReader, chain: Chain, n: int) -> tuple[int, list]:
    out = [[np.zeros(SHAPE, np.float16) for _ in range(POOLS)] for _ in range(n)]
    got, done = [], threading.Event()
    reader.submit([chain.block(i) for i in range(n)], out, lambda k: (got.append(k), done.set()))
    assert done.wait(30)
    return got[0], out


def test_the_reader_reads_a_prefix_and_stops_at_the_first_bad_block(store):
    chain = Chain(40)
    chain.write(store)
    reader = DiskReader(store, threads=3)
    try:
        k, out = _submit(reader, chain, 40)
        assert k == 40 and all(np.array_equal(o, a) for i in range(40) for o, a in zip(out[i], chain.arrays[i]))
        _corrupt(store.path(chain.hashes[25]), -1 % store.file_bytes)
        k, out = _submit(reader, chain, 40)
        assert k == 25 and all(np.array_equal(o, a) for i in range(25) for o, a in zip(out[i], chain.arrays[i]))
        assert not store._pinned
    finally:
        reader.close()
    got = []
    reader.submit([chain.block(0)], [chain.arrays[0]], got.append)
    assert got == [0]


# -- the writer -------------------------------------------------------------------------------

def test_a_full_queue_drops_without_blocking(store, monkeypatch):
    chain = Chain(4)
    release = threading.Event()
    writing = threading.Event()
    real_write = store.write

    def slow_write(*args):
        writing.set()
        assert release.wait(30)
        return real_write(*args)

    monkeypatch.setattr(store, "write", slow_write)
    block = sum(a.nbytes for a in chain.arrays[0])
    writer = DiskWriter(store, queue_bytes=2 * block)
    try:
        assert writer.offer(*chain.block(0), chain.arrays[0])
        assert writing.wait(30)  # the writer holds block 0: block 1 fills the queue
        assert writer.offer(*chain.block(1), chain.arrays[1])
        assert writer.offer(*chain.block(1), chain.arrays[1])  # queued already: deduplicated
        start = time.monotonic()
        assert not writer.offer(*chain.block(2), chain.arrays[2])
        assert time.monotonic() - start < 5  # dropped at once, not waiting for the disk
        assert store.stats.dropped["queue_full"] == 1 and writer.queued_bytes == 2 * block
        assert not writer.flush(0.05)
        release.set()
        assert writer.flush(30) and writer.queued_bytes == 0
        assert store.lookup(chain.hashes) == 2
        assert writer.offer(*chain.block(0), chain.arrays[0])  # on disk already
    finally:
        release.set()
        writer.close()


# -- full and read-only disks -------------------------------------------------------------------

def test_a_full_disk_drops_the_block_evicts_and_goes_on(tmp_path, monkeypatch, caplog):
    chain = Chain(30)
    store = open_store(tmp_path, budget=40 * (HEADER_BYTES + 4 * BS + identity().payload_bytes))
    chain.write(store, range(20))

    def enospc(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", enospc)
    with caplog.at_level(logging.WARNING, logger="cluster.kv.disk_store"):
        assert not store.write(*chain.block(20), chain.arrays[20])
    monkeypatch.undo()
    assert store.stats.dropped["disk_full"] == 1 and store.mode == "ok"
    assert store.stats.evictions == 2 and store.lookup(chain.hashes[2:]) == 18  # 5% of the budget: the LRU two
    assert not list((store.dir / "tmp").iterdir())
    assert any("No space left" in r.message for r in caplog.records)
    chain.write(store, [21])
    assert store.contains(chain.hashes[21])
    store.close()


def test_min_free_evicts_and_then_drops(tmp_path, monkeypatch):
    chain = Chain(6)
    size = HEADER_BYTES + 4 * BS + identity().payload_bytes
    store = DiskStore.open(tmp_path, identity(), 1 << 30, min_free_bytes=10 * size)
    disk = [13 * size]  # what the filesystem has for the store

    class Vfs:
        f_frsize = 1

        @property
        def f_bavail(self):
            return max(0, disk[0] - store.used_bytes)

    monkeypatch.setattr(os, "statvfs", lambda path: Vfs())
    monkeypatch.setattr(disk_store, "STATVFS_INTERVAL", 0.0)
    chain.write(store, range(3))
    assert len(store) == 3 and store.stats.evictions == 0  # 10 blocks free: at the floor
    assert store.write(*chain.block(3), chain.arrays[3]) and store.stats.evictions == 1
    disk[0] = 0  # something else filled the disk
    assert not store.write(*chain.block(4), chain.arrays[4])
    assert len(store) == 0 and store.stats.dropped["disk_full"] == 1
    store.close()


_EFBIG_WRITER = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, sys.argv[2])
    from test_kv_disk_store import Chain, open_store
    chain = Chain(2)
    store = open_store(sys.argv[1])
    chain.write(store, [0])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (store.file_bytes // 2, resource.RLIM_INFINITY))
    ok = store.write(*chain.block(1), chain.arrays[1])
    print(ok, store.mode, store.stats.dropped["disk_full"], len(store))
""")


def test_a_file_size_limit_drops_the_block(tmp_path):
    done = subprocess.run([sys.executable, "-c", _EFBIG_WRITER, str(tmp_path), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "ok", "1", "0"]  # block 0 evicted (5% of the budget)
    store = open_store(tmp_path)
    assert not list((store.dir / "tmp").iterdir())
    store.close()


def test_a_read_only_directory_serves_verified_reads_and_writes_nothing(tmp_path, monkeypatch):
    chain = Chain(3)
    store = open_store(tmp_path)
    chain.write(store, range(2))
    store.close()
    real_open = os.open

    def read_only_fs(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_fs)
    events = Events()
    store = open_store(tmp_path, listener=events)
    assert store.mode == "read_only" and "Read-only file system" in store.reason
    assert events.disk == set(chain.hashes[:2])
    assert np.array_equal(chain.read(store, 1)[0], chain.arrays[1][0])
    assert not store.write(*chain.block(2), chain.arrays[2]) and store.stats.dropped["read_only"] == 1
    _corrupt(store.path(chain.hashes[0]), -1 % store.file_bytes)
    with pytest.raises(KvReadError, match="checksum"):
        chain.read(store, 0)
    assert store.path(chain.hashes[0]).exists() and store.lookup(chain.hashes) == 0  # forgotten, not deleted
    store.close()


def test_a_directory_that_turns_read_only_stops_writing(store, monkeypatch):
    chain = Chain(3)
    chain.write(store, [0])

    def erofs(fd, buffers):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "writev", erofs)
    assert not store.write(*chain.block(1), chain.arrays[1])
    assert store.mode == "read_only" and store.stats.dropped["read_only"] == 1
    chain.read(store, 0)


def test_a_store_directory_removed_under_it_is_made_again(store):
    chain = Chain(3)
    chain.write(store, [0])
    shutil.rmtree(store.dir)
    assert not store.write(*chain.block(1), chain.arrays[1]) and store.stats.dropped["error"] == 1
    with pytest.raises(KvReadError, match="io"):
        chain.read(store, 0)
    chain.write(store, [1, 2])
    assert store.mode == "ok" and store.lookup(chain.hashes) == 0 and len(store) == 2
    chain.read(store, 2)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 0o555")
def test_a_chmod_read_only_directory_opens_read_only(tmp_path):
    chain = Chain(1)
    store = open_store(tmp_path)
    chain.write(store)
    store.close()
    for path in [tmp_path, *tmp_path.rglob("*")]:
        if path.is_dir():
            path.chmod(0o555)
    try:
        store = open_store(tmp_path)
        assert store.mode == "read_only"
        chain.read(store, 0)
    finally:
        for path in [tmp_path, *tmp_path.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)


def test_an_unusable_directory_turns_the_tier_off(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    store = open_store(tmp_path / "file")
    assert store.mode == "off" and "cannot create" in store.reason
    assert store.lookup([b"x" * 16]) == 0 and not store.write(*Chain(1).block(0), Chain(1).arrays[0])


def test_a_second_process_opens_read_only(tmp_path):
    chain = Chain(2)
    first = open_store(tmp_path)
    chain.write(first, [0])
    second = open_store(tmp_path)
    assert second.mode == "read_only" and f"pid {os.getpid()}" in second.reason
    assert second.lookup(chain.hashes) == 1
    first.close()
    second.close()
    assert open_store(tmp_path).mode == "ok"


# -- restarts -------------------------------------------------------------------------------------

def test_the_store_survives_a_restart_with_its_lru_order(tmp_path):
    chain = Chain(4)
    store = open_store(tmp_path)
    chain.write(store)
    chain.read(store, 0)
    chain.read(store, 2)  # least recent first now: 1, 3, 0, 2
    store.close()
    events = Events()
    size = store.file_bytes
    store = open_store(tmp_path, budget=2 * size, listener=events)  # a smaller budget: the LRU two go
    assert store.lookup(chain.hashes) == 1 and store.contains(chain.hashes[2]) and len(store) == 2
    assert events.disk == {chain.hashes[0], chain.hashes[2]}
    chain.read(store, 2)
    store.close()


_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[2])
    from test_kv_disk_store import Chain, open_store
    chain = Chain(6)
    store = open_store(sys.argv[1])
    chain.write(store, range(5))
    real_writev = os.writev
    def stalled(fd, buffers):  # half a block on disk, then the kill lands
        real_writev(fd, buffers[:2])
        print("mid-write", flush=True)
        time.sleep(600)
    os.writev = stalled
    store.write(*chain.block(5), chain.arrays[5])
""")


def test_a_writer_killed_mid_write_reopens_clean(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), str(Path(__file__).parent)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mid-write"
        store_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
        assert [p.name.endswith(".part") for p in (store_dir / "tmp").iterdir()] == [True]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    chain = Chain(6)
    store = open_store(tmp_path)
    assert store.mode == "ok"  # the dead writer's lock went with it
    assert not list((store.dir / "tmp").iterdir())
    assert store.lookup(chain.hashes) == 5
    for i in range(5):
        chain.read(store, i)
    store.close()


# -- LRU within the budget ------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["write", "read"]), st.integers(0, 11)), max_size=40),
       budget_blocks=st.integers(1, 6))
def test_the_store_keeps_the_most_recently_used_blocks_within_its_budget(tmp_path_factory, ops, budget_blocks):
    chain = _LRU_CHAIN
    root = tmp_path_factory.mktemp("lru")
    size = HEADER_BYTES + 4 * BS + identity().payload_bytes
    store = open_store(root, budget=budget_blocks * size)
    recent: list[int] = []  # the model: least recent first
    for op, i in ops:
        if op == "write":
            if i not in recent:
                assert store.write(*chain.block(i), chain.arrays[i])
                recent.append(i)
        elif i in recent:
            chain.read(store, i)
            recent.remove(i)
            recent.append(i)
        recent = recent[-budget_blocks:]
        assert store.used_bytes <= budget_blocks * size
        assert {h for h in chain.hashes if store.contains(h)} == {chain.hashes[j] for j in recent}
    store.close()
    reopened = open_store(root, budget=budget_blocks * size)
    assert {h for h in chain.hashes if reopened.contains(h)} == {chain.hashes[j] for j in recent}
    reopened.close()


_LRU_CHAIN = Chain(12, seed=7)
