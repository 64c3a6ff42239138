"""The router's exact prefix map: the block hashes each worker holds, per tier, from its KV events.

Each worker's `KvJournal` (`cluster/kv/events.py`) sends, with its load reports, the
events after the seq this map acked, or a snapshot. `apply` replays them and returns the
ack for the worker's next report:
- a snapshot (all its parts) replaces the worker's map; until its last part the map is
  not `complete`;
- events of another epoch than the map's (the worker restarted) or for no map (this
  router restarted, or lost track) ask for a resync;
- an event after a gap (first seq > the map's seq + 1) drops the worker's map and asks for
  a resync; events already applied (a lost answer made the worker send them again) are
  skipped.

A batch over `MAX_BATCH_EVENTS` events or `MAX_BATCH_HASH_BYTES` of hashes (a worker's
own stay within half of each), or one that would make a worker's map hold more than
`MAX_WORKER_HASHES`, is refused before it is applied: the map is dropped and a resync
asked for (its snapshot comes in bounded parts), so a faulty worker costs the event loop
and the router's memory a bounded amount.

`match(worker, hashes)` is what a placement reads: how many of a prompt's leading block
hashes the worker holds in memory, then how many of the following ones on disk (the
engine reads back only those that follow its memory hits). A map not `complete` matches
nothing. All of it runs on the router's event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from cluster.kv.events import MAX_BATCH_EVENTS as SENT_EVENTS
from cluster.kv.events import PART_HASHES
from cluster.kv.hashing import HASH_BYTES, unpack
from cluster.proto.orchard.v1 import orchard_pb2 as pb

log = logging.getLogger(__name__)

MEMORY, DISK = pb.KV_TIER_MEMORY, pb.KV_TIER_DISK
GAP, EPOCH, NO_STATE, INVALID = "gap", "epoch", "no_state", "invalid"  # why a resync was asked for
MAX_BATCH_EVENTS = 2 * SENT_EVENTS  # events in one report
MAX_BATCH_HASH_BYTES = 2 * PART_HASHES * HASH_BYTES  # hashes in one report (a snapshot part's, twice)
MAX_WORKER_HASHES = 1 << 22  # hashes held for one worker, both tiers


@dataclass
class _WorkerBlocks:
    epoch: str
    block_size: int
    seq: int = 0  # the last event applied (or the snapshot's)
    tiers: dict[int, set[bytes]] = field(default_factory=lambda: {MEMORY: set(), DISK: set()})
    complete: bool = False
    snapshot_seq: int = -1  # the snapshot being taken or last taken, and how many of its parts are in
    parts_in: int = 0


class KvMap:
    def __init__(self):
        self._workers: dict[str, _WorkerBlocks] = {}
        self.events_applied: dict[str, int] = {}  # by worker
        self.resyncs: dict[str, int] = {GAP: 0, EPOCH: 0, NO_STATE: 0}  # by reason

    def apply(self, worker_id: str, batch: pb.KvEventBatch) -> pb.KvAck:
        """Replay `worker_id`'s batch; the ack for its next report."""
        try:
            _check_size(batch)
            if batch.HasField("snapshot"):
                return self._apply_snapshot(worker_id, batch)
            return self._apply_events(worker_id, batch)
        except ValueError as e:  # hashes that are no whole number of hashes, a tier that is none
            log.warning("worker %s sent KV events that cannot be read (%s): resync", worker_id, e)
            return self._resync(worker_id, batch.epoch, INVALID)

    def match(self, worker_id: str, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(m, d): `hashes[:m]` are in the worker's memory, `hashes[m:m + d]` on its disk."""
        w = self._workers.get(worker_id)
        if w is None or not w.complete:
            return 0, 0
        memory, disk = w.tiers[MEMORY], w.tiers[DISK]
        m = 0
        while m < len(hashes) and hashes[m] in memory:
            m += 1
        d = m
        while d < len(hashes) and hashes[d] in disk:
            d += 1
        return m, d - m

    def complete(self, worker_id: str) -> bool:
        """Whether the worker's map is whole (not waiting for a resync or a snapshot's parts)."""
        w = self._workers.get(worker_id)
        return w is not None and w.complete

    def block_size(self, worker_id: str) -> int:
        """The worker's block size (0: no map)."""
        w = self._workers.get(worker_id)
        return 0 if w is None else w.block_size

    def blocks(self, worker_id: str) -> dict[int, int]:
        """Hashes held per tier (empty: no map)."""
        w = self._workers.get(worker_id)
        return {} if w is None else {tier: len(held) for tier, held in w.tiers.items()}

    def workers(self) -> list[str]:
        return list(self._workers)

    def forget(self, worker_id: str) -> None:
        """The worker is gone (removed from the registry)."""
        self._workers.pop(worker_id, None)
        self.events_applied.pop(worker_id, None)

    # -- replay ---------------------------------------------------------------------------------
    def _apply_snapshot(self, worker_id: str, batch: pb.KvEventBatch) -> pb.KvAck:
        s = batch.snapshot
        w = self._workers.get(worker_id)
        if s.part == 0:
            if w is not None and w.epoch != batch.epoch:  # the worker restarted: its blocks are its new process's
                self.resyncs[EPOCH] += 1
            w = self._workers[worker_id] = _WorkerBlocks(batch.epoch, batch.block_size, seq=s.seq,
                                                         snapshot_seq=s.seq)
        elif w is None or w.epoch != batch.epoch or w.snapshot_seq != s.seq or s.part > w.parts_in:
            return self._resync(worker_id, batch.epoch, NO_STATE)  # a part of a snapshot not begun here
        elif s.part < w.parts_in:  # a part applied already: its answer was lost
            return self._ack(w, s.parts)
        _check_held(w, (len(s.memory_hashes) + len(s.disk_hashes)) // HASH_BYTES)
        w.tiers[MEMORY].update(unpack(s.memory_hashes))
        w.tiers[DISK].update(unpack(s.disk_hashes))
        w.parts_in = s.part + 1
        w.complete = w.parts_in >= s.parts
        return self._ack(w, s.parts)

    def _apply_events(self, worker_id: str, batch: pb.KvEventBatch) -> pb.KvAck:
        w = self._workers.get(worker_id)
        if w is not None and w.epoch != batch.epoch:
            return self._resync(worker_id, batch.epoch, EPOCH)
        if w is None or not w.complete:
            return self._resync(worker_id, batch.epoch, NO_STATE)
        applied = 0
        for event in batch.events:
            if event.seq <= w.seq:
                continue  # sent again: the worker did not get the answer to the batch that had it
            if event.seq != w.seq + 1:
                log.info("worker %s's KV events skip from %d to %d: resync", worker_id, w.seq, event.seq)
                self.events_applied[worker_id] = self.events_applied.get(worker_id, 0) + applied
                return self._resync(worker_id, batch.epoch, GAP)
            held = w.tiers.get(event.tier)
            if held is None:
                raise ValueError(f"KV event {event.seq} names tier {event.tier}")
            kind = event.WhichOneof("kind")
            if kind == "stored":
                held.update(unpack(event.stored.hashes))
            elif kind == "removed":
                held.difference_update(unpack(event.removed.hashes))
            elif kind == "cleared":
                held.clear()
            w.seq = event.seq
            applied += 1
        self.events_applied[worker_id] = self.events_applied.get(worker_id, 0) + applied
        _check_held(w, 0)
        return self._ack(w, 0)

    def _ack(self, w: _WorkerBlocks, parts: int) -> pb.KvAck:
        next_part = w.parts_in if not w.complete and w.parts_in < parts else 0
        return pb.KvAck(epoch=w.epoch, seq=w.seq, next_part=next_part)

    def _resync(self, worker_id: str, epoch: str, reason: str) -> pb.KvAck:
        """Drop what is known of the worker (it is wrong or incomplete) and ask for a snapshot."""
        self._workers.pop(worker_id, None)
        self.resyncs[reason] = self.resyncs.get(reason, 0) + 1
        return pb.KvAck(epoch=epoch, resync=True)


def _check_size(batch: pb.KvEventBatch) -> None:
    """ValueError for a batch over the limits of one report (before any of it is read)."""
    if batch.HasField("snapshot"):
        size = len(batch.snapshot.memory_hashes) + len(batch.snapshot.disk_hashes)
    else:
        if len(batch.events) > MAX_BATCH_EVENTS:
            raise ValueError(f"{len(batch.events)} events in one report, over the limit of {MAX_BATCH_EVENTS}")
        size = sum(len(e.stored.hashes) + len(e.removed.hashes) for e in batch.events)
    if size > MAX_BATCH_HASH_BYTES:
        raise ValueError(f"{size} bytes of hashes in one report, over the limit of {MAX_BATCH_HASH_BYTES}")


def _check_held(w: _WorkerBlocks, more: int) -> None:
    """ValueError when the worker's map would hold more than MAX_WORKER_HASHES hashes."""
    held = sum(len(t) for t in w.tiers.values()) + more
    if held > MAX_WORKER_HASHES:
        raise ValueError(f"{held} hashes held, over the limit of {MAX_WORKER_HASHES} a worker")
