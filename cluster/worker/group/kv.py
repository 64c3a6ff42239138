"""The disk KV tier in a worker group (`--kv-disk-dir` on every rank, each its own directory).

Every rank keeps a disk store of its own layers' K/V (`cluster/kv/`; its identity names the
rank's layers and the group's mode, rank and size). Rank 0's tier (`worker/kv_tier.py`)
decides everything; the members do the same to their own layers, in step:

- Saves: the blocks rank 0's tier offers its writer go to the members as KV_SAVE (block
  id, hash, parent) right after, in order with the steps: a member copies the same blocks'
  rows out after the step that cached them and before the next one runs, and offers them
  to its own writer.
- Loads: rank 0 reads a prompt's disk hits into host buffers and sends KV_READ (a ticket,
  the hashes and parents); each member reads its layers' rows of the same blocks and
  answers KV_READ_DONE (the ticket, how many leading blocks were good). The read is done
  with the fewest good blocks any rank has, and when rank 0 installs them, KV_APPLY (the
  ticket, index in the read -> block id) has every member write the same rows into the
  same blocks before the next step's plan. A member that loses a file, fails a check or
  never answers (past `--group-timeout`: none good) costs a recompute, never a wrong block.

Pipelined virtual engines share one store a process (`KvTier(shared=...)`); their block
ids are offset into the one pool (`TierPeers.offset`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster.worker.group import wire

log = logging.getLogger(__name__)


@dataclass
class _Read:
    """A read of rank 0's: the good count each rank reported (rank 0's own: `local`)."""

    done: object  # done(good): the tier's callback
    waiting: set[int]  # ranks yet to report (0: rank 0's own read)
    good: int
    timer: threading.Timer | None = None
    finished: bool = False


class LeaderKv:
    """Rank 0's end: sends the members its tier's saves, reads and installs, and gathers
    their reads' answers (`Leader.kv_read_done`). One a group, shared by its virtual engines."""

    def __init__(self, leader, timeout: float):
        self.leader = leader
        self.timeout = timeout  # a member's answer later than this: none of its blocks good
        self._tickets = itertools.count(1)
        self._reads: dict[int, _Read] = {}
        self._lock = threading.Lock()
        leader.kv_read_done = self._reported

    def peers(self, block_offset: int = 0) -> TierPeers:
        """What one engine's tier calls (`KvTier.peers`), its block ids offset by `block_offset`."""
        return TierPeers(self, block_offset)

    def read(self, entries, reader, out, done) -> int:
        ticket = next(self._tickets)
        members = set(self.leader.members)
        r = _Read(done, {0, *members}, len(entries))
        with self._lock:  # (answers to other reads come in on other threads meanwhile)
            self._reads[ticket] = r
        if members:
            self.leader.broadcast(wire.KV_READ, wire.kv_read(ticket, [(h, p) for h, p, _ in entries]))
            r.timer = threading.Timer(self.timeout, self._expire, args=(ticket,))
            r.timer.daemon = True
            r.timer.start()
        reader.submit(entries, out, lambda good: self._reported(0, ticket, good))
        return ticket

    def _reported(self, rank: int, ticket: int, good: int) -> None:
        """A rank's answer (rank 0's own read on a reader thread, a member's on its
        connection's thread); the read is done once every rank answered."""
        with self._lock:
            r = self._reads.get(ticket)
            if r is None or r.finished or rank not in r.waiting:
                return  # late (expired), or not asked
            r.waiting.discard(rank)
            r.good = min(r.good, max(0, good))
            if r.waiting:
                return
            r.finished = True
            del self._reads[ticket]
        if r.timer is not None:
            r.timer.cancel()
        r.done(r.good)

    def _expire(self, ticket: int) -> None:
        """The members that have not answered by now count as none good."""
        with self._lock:
            r = self._reads.get(ticket)
            late = sorted(r.waiting - {0}) if r is not None and not r.finished else []
        if late:
            log.warning("disk KV tier: rank(s) %s did not answer a read within %.0f s: its blocks are recomputed",
                        ", ".join(map(str, late)), self.timeout)
        for rank in late:
            self._reported(rank, ticket, 0)

    def save(self, blocks: list[tuple[int, bytes, bytes | None]]) -> None:
        if blocks and self.leader.members:
            self.leader.broadcast(wire.KV_SAVE, wire.kv_save(blocks))

    def apply(self, ticket: int, rows: list[tuple[int, int]]) -> None:
        if self.leader.members:
            self.leader.broadcast(wire.KV_APPLY, wire.kv_apply(ticket, rows))


@dataclass
class TierPeers:
    """`KvTier.peers` for one (virtual) engine: its block ids offset into the group's pool."""

    kv: LeaderKv
    offset: int = 0

    def save(self, blocks: list[tuple[int, bytes, bytes | None]]) -> None:
        self.kv.save([(b + self.offset, h, p) for b, h, p in blocks])

    def read(self, entries, reader, out, done) -> int:
        return self.kv.read(entries, reader, out, done)

    def apply(self, ticket: int, rows: list[tuple[int, int]]) -> None:
        self.kv.apply(ticket, [(j, b + self.offset) for j, b in rows])


@dataclass
class _MemberRead:
    buffers: list[np.ndarray]
    good: int = -1  # set once read
    dropped: bool = False  # rank 0 gave up on it before it was read


@dataclass
class MemberKv:
    """A member's end: its own store, writer and reader, run on the member's step thread in
    the order rank 0 sent (`handle`). Without a store (no --kv-disk-dir here, or it could
    not open) every read answers none good: rank 0's prompt is recomputed."""

    send: object  # send(kind, payload) to rank 0
    runner: object
    store: object = None
    writer: object = None
    reader: object = None
    flush_timeout: float = 10.0
    _reads: dict[int, _MemberRead] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, send, runner, model, config, model_path: str) -> MemberKv:
        """The member's tier as its `config` (--kv-disk-*) says, keyed by its own layers'
        identity (`runner.group_identity` names the rank; the weights' digest is of its
        layers' files, kept in the directory across restarts); off (answering none good)
        without a directory or where the store does not open."""
        kv = cls(send, runner, flush_timeout=config.kv_disk_flush_timeout)
        if config.kv_disk_dir is None:
            return kv
        try:
            from cluster.kv.disk_store import DiskStore
            from cluster.kv.identity import KvIdentity, weights_digest
            from cluster.kv.reader import DiskReader
            from cluster.kv.writer import DiskWriter
            from cluster.worker.dequantize import quantized_layers
            from cluster.worker.kv_tier import model_identity

            identity = model_identity(runner, bool(quantized_layers(model)))
            layers = runner.stage.layers
            own = (layers.start, layers.stop - 1) if runner.group_identity["parallel"] == "pipeline" else None
            ident = KvIdentity(**identity, weights=weights_digest(model_path, config.kv_disk_dir, own))
            store = DiskStore.open(Path(config.kv_disk_dir), ident, config.kv_disk_size, config.kv_disk_min_free,
                                   fsync=config.kv_disk_fsync)
        except Exception:  # noqa: BLE001  (the tier off, serving goes on)
            log.exception("disk KV tier: off on this rank")
            return kv
        log.info("disk KV tier at %s: %s%s", config.kv_disk_dir, store.mode,
                 f" ({store.reason})" if store.reason else "")
        if store.mode == "off":
            return kv
        kv.store = store
        kv.reader = DiskReader(store, config.kv_disk_read_threads)
        if store.mode == "ok":
            kv.writer = DiskWriter(store, config.kv_disk_queue_bytes)
        return kv

    def handle(self, kind: int, payload: bytes) -> None:
        """One of rank 0's KV messages (ProtocolError for a malformed one)."""
        num_blocks = self.runner.num_blocks
        if kind == wire.KV_SAVE:
            self._save(wire.read_kv_save(payload, num_blocks))
        elif kind == wire.KV_READ:
            self._read(*wire.read_kv_read(payload))
        elif kind == wire.KV_APPLY:
            self._apply(*wire.read_kv_apply(payload, num_blocks))

    def _save(self, blocks: list[tuple[int, bytes, bytes | None]]) -> None:
        if self.writer is None or not blocks:
            return
        rows = self.runner.read_blocks([b for b, _, _ in blocks])
        for j, (_, h, parent) in enumerate(blocks):
            if not self.store.contains(h):
                self.writer.offer(h, parent, None, [a[j] for a in rows])  # a drop: the store counts it

    def _read(self, ticket: int, entries: list[tuple[bytes, bytes | None]]) -> None:
        if self.reader is None or not entries:
            self._answer(ticket, 0)
            return
        n = len(entries)
        buffers = [np.empty((n, *shape), _numpy_dtype(dtype)) for _, _, shape, dtype in self.runner.kv_pool_layout()]
        with self._lock:
            self._reads[ticket] = _MemberRead(buffers)
        out = [[b[j] for b in buffers] for j in range(n)]
        # after this rank's writes queued before it (rank 0 read what it had written): on a
        # thread of its own, so the steps go on meanwhile
        threading.Thread(target=self._read_after_writes, args=(ticket, [(h, p, None) for h, p in entries], out),
                         name="orchard-kv-member-read", daemon=True).start()

    def _read_after_writes(self, ticket: int, entries, out) -> None:
        if self.writer is not None:
            self.writer.flush(self.flush_timeout)
        self.reader.submit(entries, out, lambda good: self._read_done(ticket, good))

    def _read_done(self, ticket: int, good: int) -> None:
        with self._lock:
            r = self._reads.get(ticket)
            if r is None:
                return
            if r.dropped:  # rank 0 gave up on it
                del self._reads[ticket]
                return
            r.good = good
        self._answer(ticket, good)

    def _answer(self, ticket: int, good: int) -> None:
        try:
            self.send(wire.KV_READ_DONE, wire.KV_READ_DONE_MSG.pack(ticket, good))
        except OSError:  # rank 0 gone: the group is lost anyway
            pass

    def _apply(self, ticket: int, rows: list[tuple[int, int]]) -> None:
        with self._lock:
            r = self._reads.get(ticket)
            if r is None:
                if rows:
                    raise wire.ProtocolError(f"KV_APPLY of read {ticket}, which this rank does not hold")
                return
            if r.good < 0:  # not read yet (rank 0 gave up waiting): dropped once it is
                if rows:
                    raise wire.ProtocolError(f"KV_APPLY of read {ticket} before this rank read it")
                r.dropped = True
                return
            del self._reads[ticket]
        if not rows:
            return
        if max(j for j, _ in rows) >= r.good:
            raise wire.ProtocolError(f"KV_APPLY of read {ticket}'s block past the {r.good} this rank read")
        index = [j for j, _ in rows]
        self.runner.write_blocks([b for _, b in rows], [buf[index] for buf in r.buffers])

    def close(self) -> None:
        """The writes queued land (within --kv-disk-flush-timeout), then the store closes."""
        if self.writer is not None and not self.writer.flush(self.flush_timeout):
            log.warning("disk KV tier: writes still queued after %.0f s were dropped", self.flush_timeout)
        for part in (self.writer, self.reader, self.store):
            if part is not None:
                part.close()


def _numpy_dtype(dtype: str):
    """A pool's dtype as its raw numpy elements (`ModelRunner.read_blocks`'s form)."""
    return np.uint16 if dtype in ("float16", "bfloat16") else np.dtype(dtype)
