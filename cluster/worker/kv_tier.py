"""The disk tier of the prefix cache, inside the engine (`--kv-disk-dir`; the store itself is
`cluster/kv/disk_store.py`).

Write-through: each hash that enters the memory prefix cache (the block manager's
listener) is copied out at the end of the step that cached it (`save_blocks`: its rows
are final, and nothing overwrites a free cached block before the next forward) and offered
to the disk writer, which never blocks: a full queue drops the block, the step goes on.

Reads: before each schedule, `probe` looks at the head of the waiting queue. A prompt
whose next full blocks after its memory hits are on disk has them read, on the reader
threads, into host buffers, and waits aside (`Sequence.kv_loading`) while the others step.
`complete_loads` (before the schedule, on the engine thread) installs the good ones as
free cached blocks (`BlockManager.install_cached`) and writes their rows into the pool;
the admission then takes them as memory hits. Reads never touch the pool, so an aborted
request's read lands nowhere; a block evicted before its request is admitted is
recomputed, never served wrong. A file that fails its checks (truncated, corrupt, another
model's) is refused by the store: that block and the ones after it are recomputed.

The store is keyed by the model's identity (its weights' digest, dtypes, KV layout, block
size, the compute path: host or MLX), so no file crosses models or paths. Hashing the
weights reads every byte of them once: it runs on a thread of its own, and the tier is
off ("hashing weights") until it is done.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from cluster.kv.disk_store import DiskStats, DiskStore
from cluster.kv.identity import KvIdentity
from cluster.kv.reader import DiskReader
from cluster.kv.writer import DiskWriter
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.worker.faults import slow_kv_writes

if TYPE_CHECKING:
    from cluster.worker.block_manager import BlockManager
    from cluster.worker.config import EngineConfig
    from cluster.worker.sequence import Sequence

log = logging.getLogger(__name__)

# How far down the waiting queue `probe` looks (the scheduler's admission lookahead).
PROBE_LOOKAHEAD = 32
# Reads in flight hold at most this share of the pool's bytes in host buffers.
STAGING_SHARE = 0.25
# The read rate's moving average: the newest load's weight.
RATE_WEIGHT = 0.2
RECURRENT_REASON = "recurrent layers: prefix caching is off"
READ_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ListenerChain:
    """Several cache listeners as one (the block manager and the disk store take one): the
    tier's write-through and the KV events journal both hear each tier."""

    def __init__(self, *listeners):
        self.listeners = [x for x in listeners if x is not None]

    def add(self, listener) -> None:
        self.listeners.append(listener)

    def stored(self, hashes: list[bytes]) -> None:
        for x in self.listeners:
            x.stored(hashes)

    def removed(self, hashes: list[bytes]) -> None:
        for x in self.listeners:
            x.removed(hashes)

    def cleared(self) -> None:
        for x in self.listeners:
            cleared = getattr(x, "cleared", None)
            if cleared is not None:
                cleared()


def chain_listener(current, listener) -> ListenerChain:
    """`current` (None, a listener or a chain) with `listener` added: one chain."""
    if isinstance(current, ListenerChain):
        current.add(listener)
        return current
    return ListenerChain(current, listener)


@dataclass
class KvTierStats:
    """The engine side's counters (the store keeps its own: bytes, errors, evictions)."""

    hit_tokens: int = 0  # prompt tokens installed from disk
    loads: int = 0  # reads completed
    blocks_read: int = 0  # good blocks read
    # each load's read time, counted into READ_SECONDS_BUCKETS (the last: +Inf)
    read_seconds_counts: list = field(default_factory=lambda: [0] * (len(READ_SECONDS_BUCKETS) + 1))
    read_seconds_sum: float = 0.0
    dropped_queue_full: int = 0  # blocks evicted before the writer's queue had room for them
    loading: int = 0  # requests waiting for their reads
    read_tokens_per_second: float = 0.0  # moving average over loads


@dataclass
class _Load:
    seq: Sequence
    first: int  # the seq's block index of entries[0] (its memory hits before it)
    entries: list[tuple[bytes, bytes | None, tuple[int, ...]]]
    buffers: list[np.ndarray]  # per pool [len(entries), block_size, ...]
    cut: bool  # fewer blocks than the disk held (the staging budget)
    started: float
    good: int = -1  # set by the reader: the first `good` entries read and checked
    ticket: object = None  # a worker group's name for it on every rank (`peers`)


class KvTier:
    """The disk tier of one engine: `probe` / `complete_loads` before each schedule,
    `save_blocks` after each step, `info()` for load reports, `flush` / `close` at stop."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, runner, identity: dict | None,
                 weights: Callable[[], str] | None = None, reason: str = "", shared: KvTier | None = None,
                 disk_listener=None):
        """`identity`: the model's facts but its weights' digest, which `weights()` computes
        on a thread of its own (None with `reason`: the tier stays off). `shared`: another
        engine's tier in this process whose store this one uses (a worker group's
        pipelined virtual engines: one store a process). `disk_listener`: hears the DISK
        tier's events (the KV journal), from before the store opens: its index's first."""
        self.config = config
        self.bm = block_manager
        self.runner = runner
        self.block_size = block_manager.block_size
        self.reason = reason or "hashing weights"
        self.store = self.writer = self.reader = None
        self.stats = shared.stats if shared is not None else KvTierStats()  # (one engine thread steps both)
        self.disk_listeners = ListenerChain(disk_listener)  # the DISK tier's events
        # a worker group's other ranks (group/kv.py): `save(blocks)`, `read(entries, reader,
        # out, done) -> ticket`, `apply(ticket, rows)`: they do what this tier does, in step
        self.peers = None
        self.wake: Callable[[], None] | None = None  # called on a reader thread when a read is done
        self._saves: list[bytes] = []  # hashes cached and not yet offered to the writer
        self._deferred: set[bytes] = set()  # of those, the ones the writer's queue had no room for
        self._loads: dict[int, _Load] = {}  # id(seq) -> its read in flight
        self._done: list[_Load] = []
        self._lock = threading.Lock()
        self._done_event = threading.Event()
        self._ready = threading.Event()
        self._staged_blocks = 0
        layout = runner.kv_pool_layout()
        self._pool_shapes = [(shape, np.uint16 if dtype in ("float16", "bfloat16") else np.dtype(dtype))
                             for _, _, shape, dtype in layout]
        self.block_bytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in self._pool_shapes)
        self._staging_limit = max(1, int(block_manager.num_blocks * STAGING_SHARE))
        if identity is None and shared is None:
            log.warning("the disk KV tier is off: %s", reason)
            self._ready.set()
            return
        block_manager.listener = chain_listener(block_manager.listener, self)
        if shared is not None:
            threading.Thread(target=self._share, args=(shared,), name="orchard-kv-open", daemon=True).start()
            return
        threading.Thread(target=self._open, args=(identity, weights), name="orchard-kv-open", daemon=True).start()

    # -- opening -----------------------------------------------------------------------------
    def _open(self, identity: dict, weights: Callable[[], str] | None) -> None:
        cfg = self.config
        try:
            ident = KvIdentity(**identity, weights=weights() if weights is not None else "")
            store = DiskStore.open(Path(cfg.kv_disk_dir), ident, cfg.kv_disk_size, cfg.kv_disk_min_free,
                                   listener=self.disk_listeners, fsync=cfg.kv_disk_fsync)
        except Exception as e:  # the store never raises; the digest may (a file gone)
            log.exception("the disk KV tier is off")
            self.reason = f"could not open: {type(e).__name__}: {e}"
            self._ready.set()
            return
        slow_kv_writes(store)  # fault tests only (ORCHARD_FAULT_DIR)
        if store.mode != "off":
            self.reader = DiskReader(store, cfg.kv_disk_read_threads)
            if store.mode == "ok":
                self.writer = DiskWriter(store, cfg.kv_disk_queue_bytes)
                if cfg.kv_disk_queue_bytes < self.block_bytes:
                    log.warning("--kv-disk-queue-bytes %d is less than one KV block (%d bytes): nothing will be "
                                "written to disk", cfg.kv_disk_queue_bytes, self.block_bytes)
        self.reason = store.reason if store.mode != "ok" else ""
        self.store = store  # last: the engine thread reads it unlocked
        log.info("disk KV tier at %s: %s%s; %.1f KiB of KV a token, %d tokens a block", cfg.kv_disk_dir, store.mode,
                 f" ({store.reason})" if store.reason else "", self.block_bytes / cfg.block_size / 1024, cfg.block_size)
        self._ready.set()

    def _share(self, other: KvTier) -> None:
        other._ready.wait()
        self.reader, self.writer, self.reason = other.reader, other.writer, other.reason
        self.store = other.store  # last, as in _open
        self._ready.set()

    def wait_ready(self, timeout: float) -> bool:
        """Whether the store is open (or the tier settled off) within `timeout` seconds."""
        return self._ready.wait(timeout)

    @property
    def enabled(self) -> bool:
        return self.store is not None and self.store.mode != "off"

    # -- the memory tier's events (the block manager's listener) ----------------------------------
    def stored(self, hashes: list[bytes]) -> None:
        self._saves += hashes

    def removed(self, hashes: list[bytes]) -> None:
        pass

    # -- write-through (engine thread, after a step) ------------------------------------------------
    def save_blocks(self) -> None:
        """Offer the blocks cached since the last call to the writer (those not on disk yet),
        as many as its queue has room for; the others wait for a later step while they stay
        cached (their rows are intact while a cached copy holds them), and count as dropped
        if they are evicted first. Before the store is open, they wait the same way."""
        if not self._saves:
            return
        store = self.store  # set last when opening: the writer is there once it is
        if store is None or self.writer is None:
            if self._ready.is_set():
                self._saves = []  # read-only or off: nothing is written
            elif len(self._saves) > self.bm.num_blocks:
                self._saves = [h for h in dict.fromkeys(self._saves) if h in self.bm.cached]
            return
        writer = self.writer
        if self.config.kv_disk_queue_bytes < self.block_bytes:  # no block ever fits (warned at open)
            self._saves = []
            return
        hashes, self._saves = self._saves, []
        picked: list[tuple[bytes, int]] = []
        for h in dict.fromkeys(hashes):
            copies = self.bm.cached.get(h)
            if not copies:
                self.stats.dropped_queue_full += h in self._deferred  # evicted before the queue had room
            elif not store.contains(h):
                picked.append((h, next(iter(copies))))
        room = max(0, (self.config.kv_disk_queue_bytes - writer.queued_bytes) // max(1, self.block_bytes))
        self._saves = [h for h, _ in picked[room:]]
        self._deferred = set(self._saves)
        picked = picked[:room]
        if not picked:
            return
        rows = self.runner.read_blocks([bid for _, bid in picked])
        for j, (h, bid) in enumerate(picked):
            block = self.bm.blocks[bid]
            writer.offer(h, block.parent_hash, block.token_ids, [a[j] for a in rows])  # a drop: the store counts it
        if self.peers is not None:
            self.peers.save([(bid, h, self.bm.blocks[bid].parent_hash) for h, bid in picked])

    # -- reads (engine thread, before the schedule) -------------------------------------------------
    def probe(self, waiting) -> None:
        """Start reads for the waiting prompts (the first PROBE_LOOKAHEAD) whose blocks after
        their memory hits are on disk, within the staging budget."""
        if self.reader is None:
            return
        bm, bs = self.bm, self.block_size
        for seq in list(waiting)[:PROBE_LOOKAHEAD]:
            if (seq.kv_loading or seq.block_table or seq.kv_probed_len >= seq.num_tokens
                    or seq.wants_prompt_logprobs or seq.skip_prefix_cache or seq.sampling_params.pooling is not None):
                continue
            room = self._staging_limit - self._staged_blocks
            if room <= 0:
                return
            seq.kv_probed_len = seq.num_tokens
            first = len(bm.get_computed_blocks(seq))  # hashes the blocks up to the last token's
            hashes = seq.block_hashes[first : (seq.num_tokens - 1) // bs]
            n = self.store.lookup(hashes) if hashes else 0
            if n:
                self._start(seq, first, min(n, room), cut=n > room)

    def _start(self, seq: Sequence, first: int, n: int, cut: bool) -> None:
        bs = self.block_size
        entries = []
        for i in range(first, first + n):
            parent = seq.block_hashes[i - 1] if i else None
            entries.append((seq.block_hashes[i], parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        buffers = [np.empty((n, *shape), dtype) for shape, dtype in self._pool_shapes]
        load = _Load(seq, first, entries, buffers, cut, time.perf_counter())
        seq.kv_loading = True
        self._loads[id(seq)] = load
        self._staged_blocks += n
        self.stats.loading = len(self._loads)
        out = [[b[j] for b in buffers] for j in range(n)]
        if self.peers is None:
            self.reader.submit(entries, out, lambda good: self._read_done(load, good))
        else:  # done with the fewest good blocks any rank read
            load.ticket = self.peers.read(entries, self.reader, out, lambda good: self._read_done(load, good))

    def _read_done(self, load: _Load, good: int) -> None:
        """On a reader thread."""
        load.good = good
        with self._lock:
            self._done.append(load)
        self._done_event.set()
        wake = self.wake
        if wake is not None:
            wake()

    def complete_loads(self) -> None:
        """Install the finished reads of the requests still waiting (the others' are dropped)."""
        with self._lock:
            done, self._done = self._done, []
            self._done_event.clear()
        for i, load in enumerate(done):
            rows = None
            try:
                rows = self._complete(load)
            except BaseException:
                with self._lock:  # (the step fails) the reads after it are installed at the next one
                    self._done[:0] = done[i + 1 :]
                raise
            finally:  # the other ranks install the same blocks (or drop their reads)
                if self.peers is not None:
                    self.peers.apply(load.ticket, rows or [])

    def _complete(self, load: _Load) -> list[tuple[int, int]] | None:
        """Installs a finished read: its (index in the read, block id) rows installed."""
        seq, bs = load.seq, self.block_size
        del self._loads[id(seq)]
        self._staged_blocks -= len(load.entries)
        self.stats.loading = len(self._loads)
        seq.kv_loading = False
        took = time.perf_counter() - load.started
        self._count_read(load.good, took)
        if seq.is_finished or seq.block_table or load.good <= 0:
            return  # aborted meanwhile (or admitted by other means): its buffers go
        computed = self.bm.get_computed_blocks(seq)
        skip = len(computed) - load.first  # < 0: memory hits evicted meanwhile (recomputed)
        if skip < 0:
            return
        entries = load.entries[skip : load.good]
        ids = self.bm.install_cached(entries, keep=computed)
        rows = [(skip + j, bid) for j, bid in enumerate(ids) if bid is not None]
        if rows:
            picked = [j for j, _ in rows]
            if picked[-1] - picked[0] == len(picked) - 1:  # consecutive (the usual case): views, no copy
                arrays = [b[picked[0] : picked[-1] + 1] for b in load.buffers]
            else:
                arrays = [b[picked] for b in load.buffers]
            try:
                self.runner.write_blocks([bid for _, bid in rows], arrays)
            except BaseException:
                self.bm.uncache([bid for _, bid in rows])  # cached without their rows: never a hit
                raise
        installed = len(ids)
        self.stats.hit_tokens += len(rows) * bs
        if seq.num_preemptions == 0:
            seq.num_disk_tokens += len(rows) * bs
        if load.cut and installed == len(entries):
            seq.kv_probed_len = 0  # the staging budget cut it: the next probe reads on
        return rows

    def _count_read(self, good: int, took: float) -> None:
        s = self.stats
        s.loads += 1
        s.blocks_read += max(0, good)
        s.read_seconds_counts[bisect.bisect_left(READ_SECONDS_BUCKETS, took)] += 1
        s.read_seconds_sum += took
        if good > 0 and took > 0:
            rate = good * self.block_size / took
            s.read_tokens_per_second = rate if not s.read_tokens_per_second else (
                (1 - RATE_WEIGHT) * s.read_tokens_per_second + RATE_WEIGHT * rate)

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    def wait(self, timeout: float) -> bool:
        """Wait for a read to finish (a caller that steps the engine itself, with nothing
        else runnable); whether one did."""
        return self._done_event.wait(timeout)

    # -- reports and stopping -------------------------------------------------------------------------
    def info(self) -> pb.KvDiskInfo:
        store = self.store
        if store is None or store.mode == "off":
            return pb.KvDiskInfo(enabled=False, reason=self.reason if store is None else store.reason)
        return pb.KvDiskInfo(enabled=True, reason=self.reason, used_bytes=store.used_bytes,
                             budget_bytes=store.budget_bytes,
                             read_tokens_per_second=self.stats.read_tokens_per_second)

    def counters(self) -> dict:
        """The store's and the writer's counters for metrics (any thread): bytes and blocks
        written and read, blocks dropped by reason, read errors by kind, evictions, queue
        and disk bytes; zeros while the store is not open."""
        store, writer = self.store, self.writer
        stats = store.stats if store is not None else DiskStats()
        dropped = Counter(stats.dropped)
        dropped["queue_full"] += self.stats.dropped_queue_full
        return dict(
            enabled=self.enabled, used_bytes=store.used_bytes if store is not None else 0,
            budget_bytes=store.budget_bytes if store is not None else self.config.kv_disk_size,
            queue_bytes=writer.queued_bytes if writer is not None else 0,
            bytes_written=stats.bytes_written, blocks_written=stats.blocks_written, bytes_read=stats.bytes_read,
            evictions=stats.evictions, dropped=dict(dropped), errors=dict(stats.errors),
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Write what waits, the blocks still waiting for the queue's room included, for up
        to `timeout` seconds (default --kv-disk-flush-timeout); whether it all landed. On
        the engine's thread, or once it has stopped."""
        deadline = time.monotonic() + (self.config.kv_disk_flush_timeout if timeout is None else timeout)
        while True:
            self.save_blocks()
            if self.writer is None:
                return True
            if not self.writer.flush(max(0.0, deadline - time.monotonic())):
                return False
            if not self._saves:
                return True
            if time.monotonic() >= deadline:
                return False

    def flush_and_close(self) -> None:
        """At the engine's stop: `flush`, warning about what it abandons, then `close`."""
        if not self.flush():
            log.warning("disk KV tier: writes still waiting after %.0f s are abandoned",
                        self.config.kv_disk_flush_timeout)
        self.close()

    def close(self) -> None:
        """Stop the reader and writer threads (what is still queued is abandoned) and close
        the store (its lock released)."""
        for part in (self.writer, self.reader, self.store):
            if part is not None:
                part.close()


def params_digest(model) -> str:
    """The sha256 of a model's parameters in memory (an engine built from a model object,
    with no directory to hash): their names, dtypes, shapes and bytes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda x: x[0]):
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)};".encode())
        raw = p.view(mx.uint16) if p.dtype.size == 2 else p
        mx.eval(raw)
        h.update(memoryview(raw).cast("B"))
    return h.hexdigest()


def model_identity(runner, quantized: bool) -> dict:
    """The facts of a model's K/V that a block's bytes depend on (`KvIdentity`'s fields), but
    its weights' digest: the block's layout, the dtypes, the owned layers' geometry and the
    path that computes it (host or MLX, and the attention backend: exactness is per path)."""
    specs = [(s.layer, s.num_kv_heads, s.head_dim, s.latent) for s in runner.specs
             if s.owns_kv and s.layer in runner.stage.layers]
    return dict(
        block_size=runner.block_size, pool_layout=[(shape, dtype) for _, _, shape, dtype in runner.kv_pool_layout()],
        kv_dtype=str(runner.kv_dtype).rpartition(".")[2],
        compute_dtype=str(runner.dtype).rpartition(".")[2], quantized=quantized, layers=specs,
        backend=("host" if runner.host is not None else "mlx") + "/" + runner.attention_backend,
        # a worker group's rank: {"parallel", "rank", "size"} (group/kv.py)
        **({"group": group} if (group := getattr(runner, "group_identity", None)) else {}),
    )


def disk_tier(config: EngineConfig, block_manager: BlockManager, runner, journal, model, model_path, hybrid: bool
              ) -> KvTier:
    """An engine's disk tier (--kv-disk-dir): off, saying why, where the cache cannot be
    reused; its disk events go to the engine's KV `journal`. `model_path`: where the
    weights came from (the identity hashes its files; None: the parameters in memory)."""
    if hybrid:
        return KvTier(config, block_manager, runner, None, reason=RECURRENT_REASON)
    if not config.enable_prefix_caching:
        return KvTier(config, block_manager, runner, None, reason="prefix caching is off (--no-prefix-caching)")
    from cluster.worker.dequantize import quantized_layers

    identity = model_identity(runner, bool(quantized_layers(model)))
    if model_path is None:
        digest = params_digest(model)  # on this thread: MLX arrays stay on the engine's
        weights = lambda: digest  # noqa: E731
    else:
        from cluster.kv.identity import weights_digest

        # on the tier's own thread (it reads every byte once; the sums are kept in the dir)
        weights = lambda: weights_digest(model_path, cache_dir=config.kv_disk_dir)  # noqa: E731
    # the disk tier's KV events: the journal listens before the store opens (on another thread)
    return KvTier(config, block_manager, runner, identity, weights, disk_listener=journal.disk_listener())
