"""KV events: which blocks a worker holds, per tier, as a numbered series a router replays.

A `KvJournal` (one per worker process; its `epoch` names this start) mirrors the set of
block hashes each tier holds and numbers every change: `stored` when a hash enters a tier,
`removed` when it leaves, `cleared` when a tier empties at once. `seq` runs from 1 in one
series for both tiers. It keeps the last `kept` events, so a router that acked seq `s`
gets the events after `s` (`batch`), or, when it has no state, another epoch, asked for a
resync, or fell behind what is kept, a snapshot: every hash held as of one seq, sent in
parts over several reports when it is large (the router's ack names the part it needs
next, so a polled worker keeps nothing per router). The router's side is
`cluster/router/kv_map.py`.

The mirror counts copies: two engines of one process (pipelined virtual engines) may both
cache a hash, and it leaves the tier when the last one evicts it.

Thread-safe: the engine thread (memory tier, through `memory_listener()`), the disk
writer thread (disk tier, `disk_listener()`) and the asyncio side (`batch`) all call it.
`on_backlog` (called on the recording thread, outside the lock) asks for a report when
many events wait, at most every `BACKLOG_INTERVAL_S`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterable

from cluster.kv.hashing import HASH_BYTES, pack
from cluster.proto.orchard.v1 import orchard_pb2 as pb

log = logging.getLogger(__name__)

MEMORY, DISK = pb.KV_TIER_MEMORY, pb.KV_TIER_DISK
TIER_NAMES = {MEMORY: "memory", DISK: "disk"}
KINDS = ("stored", "removed", "cleared")
KEPT_EVENTS = 65_536  # events kept for routers that lag behind; further behind: a snapshot
MAX_BATCH_EVENTS = 8_192  # events in one report; the rest go with the next ones
PART_HASHES = (4 << 20) // HASH_BYTES  # hashes in one snapshot part (4 MiB)
KEPT_SNAPSHOTS = 4  # snapshots being sent in parts, by seq (routers resyncing at once share them)
BACKLOG_EVENTS = 256  # events waiting since the last batch that ask for a report now
BACKLOG_INTERVAL_S = 0.1


@dataclass(frozen=True)
class _Snapshot:
    seq: int
    memory: bytes  # packed hashes
    disk: bytes
    part_hashes: int

    @property
    def parts(self) -> int:
        total = (len(self.memory) + len(self.disk)) // HASH_BYTES
        return max(1, -(-total // self.part_hashes))

    def part(self, p: int) -> pb.KvSnapshot:
        """Part `p`: the p-th run of `part_hashes` hashes of memory's then disk's."""
        start, end = p * self.part_hashes * HASH_BYTES, (p + 1) * self.part_hashes * HASH_BYTES
        m = len(self.memory)
        return pb.KvSnapshot(seq=self.seq, memory_hashes=self.memory[start:end],
                             disk_hashes=self.disk[max(0, start - m):max(0, end - m)], part=p, parts=self.parts)


class _TierListener:
    """One tier's side of the journal: the BlockManager's `CacheListener` (memory) and the
    disk store's listener (disk) call it."""

    def __init__(self, journal: "KvJournal", tier: int):
        self.journal = journal
        self.tier = tier

    def stored(self, hashes: list[bytes]) -> None:
        self.journal.stored(self.tier, hashes)

    def removed(self, hashes: list[bytes]) -> None:
        self.journal.removed(self.tier, hashes)

    def cleared(self) -> None:
        self.journal.cleared(self.tier)


class KvJournal:
    def __init__(self, block_size: int, on_backlog: Callable[[], None] | None = None, kept: int = KEPT_EVENTS,
                 batch_events: int = MAX_BATCH_EVENTS, part_hashes: int = PART_HASHES):
        self.block_size = block_size
        self.epoch = uuid.uuid4().hex
        self.on_backlog = on_backlog
        self.batch_events = batch_events
        self.part_hashes = part_hashes
        self.seq = 0  # the last event's
        self.counts = {(tier, kind): 0 for tier in TIER_NAMES.values() for kind in KINDS}  # events recorded
        self.snapshots_sent = 0  # snapshots begun (their first part built)
        self._lock = threading.Lock()
        self._events: deque[pb.KvEvent] = deque(maxlen=kept)
        self._held: dict[int, dict[bytes, int]] = {MEMORY: {}, DISK: {}}  # hash -> copies
        self._snapshots: OrderedDict[int, _Snapshot] = OrderedDict()
        self._batched_seq = 0  # seq when a batch was last built
        self._woken_at = float("-inf")

    def memory_listener(self) -> _TierListener:
        return _TierListener(self, MEMORY)

    def disk_listener(self) -> _TierListener:
        return _TierListener(self, DISK)

    # -- recording (engine thread, disk writer) -------------------------------------------------
    def stored(self, tier: int, hashes: Iterable[bytes]) -> None:
        with self._lock:
            held, new = self._held[tier], []
            for h in hashes:
                n = held.get(h, 0)
                held[h] = n + 1
                if not n:
                    new.append(h)
            if new:
                self._record(tier, "stored", pb.KvEvent(tier=tier, stored=pb.KvBlocks(hashes=pack(new))))
        self._wake_if_backlogged()

    def removed(self, tier: int, hashes: Iterable[bytes]) -> None:
        with self._lock:
            held, gone = self._held[tier], []
            for h in hashes:
                n = held.get(h, 0)
                if n > 1:
                    held[h] = n - 1
                elif n == 1:
                    del held[h]
                    gone.append(h)
            if gone:
                self._record(tier, "removed", pb.KvEvent(tier=tier, removed=pb.KvBlocks(hashes=pack(gone))))
        self._wake_if_backlogged()

    def cleared(self, tier: int) -> None:
        with self._lock:
            if self._held[tier]:
                self._held[tier] = {}
                self._record(tier, "cleared", pb.KvEvent(tier=tier, cleared=True))
        self._wake_if_backlogged()

    def _record(self, tier: int, kind: str, event: pb.KvEvent) -> None:
        self.seq += 1
        event.seq = self.seq
        self._events.append(event)
        self.counts[TIER_NAMES[tier], kind] += 1

    def _wake_if_backlogged(self) -> None:
        if self.on_backlog is None or self.seq - self._batched_seq < BACKLOG_EVENTS:
            return
        now = time.monotonic()
        if now - self._woken_at >= BACKLOG_INTERVAL_S:
            self._woken_at = now
            try:
                self.on_backlog()
            except Exception:  # the engine's step must not fail for a report asked too late
                log.exception("asking for a KV events report failed")

    # -- reading (asyncio side) -----------------------------------------------------------------
    def held(self, tier: int) -> set[bytes]:
        """The hashes `tier` holds now."""
        with self._lock:
            return set(self._held[tier])

    def batch(self, ack: pb.KvAck | None) -> pb.KvEventBatch:
        """What a router that answered `ack` (None: nothing yet) needs next: the events after
        its seq (at most `batch_events`), or a snapshot's part."""
        with self._lock:
            self._batched_seq = self.seq
            out = pb.KvEventBatch(epoch=self.epoch, block_size=self.block_size)
            if ack is None or ack.resync or ack.epoch != self.epoch or ack.seq > self.seq:
                out.snapshot.CopyFrom(self._new_snapshot())
            elif ack.next_part:  # the router is taking a snapshot in parts
                snap = self._snapshots.get(ack.seq)
                fits = snap is not None and ack.next_part < snap.parts
                out.snapshot.CopyFrom(snap.part(ack.next_part) if fits else self._new_snapshot())
            else:
                first = self._events[0].seq if self._events else self.seq + 1
                if ack.seq + 1 < first:  # fallen behind what is kept
                    out.snapshot.CopyFrom(self._new_snapshot())
                else:
                    start = ack.seq + 1 - first
                    out.events.extend(islice(self._events, start, start + self.batch_events))
            return out

    def _new_snapshot(self) -> pb.KvSnapshot:
        snap = self._snapshots.get(self.seq)
        if snap is None:
            snap = _Snapshot(self.seq, pack(self._held[MEMORY]), pack(self._held[DISK]), self.part_hashes)
            self._snapshots[self.seq] = snap
            while len(self._snapshots) > KEPT_SNAPSHOTS:
                self._snapshots.popitem(last=False)
        self.snapshots_sent += 1
        return snap.part(0)


def implied_ack(batch: pb.KvEventBatch, ack: pb.KvAck | None) -> pb.KvAck | None:
    """The ack a router answers after applying `batch` (sent after `ack`): what a worker
    takes as its answer when the router's reply carries none (a registration's)."""
    if batch.HasField("snapshot"):
        s = batch.snapshot
        next_part = s.part + 1 if s.part + 1 < s.parts else 0
        return pb.KvAck(epoch=batch.epoch, seq=s.seq, next_part=next_part)
    if batch.events:
        return pb.KvAck(epoch=batch.epoch, seq=batch.events[-1].seq)
    return ack
