"""The disk tier's writer: one thread writes the blocks the engine offers to a DiskStore.

The engine thread copies a block's rows out and `offer`s them; `offer` never blocks. The
queue is bounded in bytes: when it is full the block is dropped (counted
`dropped{queue_full}`), never the step delayed. A hash already queued or on disk is not
queued again. `flush(timeout)` waits for the queue to drain (a graceful stop), `close()`
stops the thread and abandons what is left.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cluster.kv.disk_store import DiskStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveJob:
    """One block to write: its hash, parent, tokens and one array per pool."""

    hash: bytes
    parent: bytes | None
    tokens: Sequence[int] | np.ndarray | None
    arrays: Sequence[np.ndarray]
    nbytes: int


class DiskWriter:
    """A thread writing offered blocks to `store`, at most `queue_bytes` of them waiting."""

    def __init__(self, store: DiskStore, queue_bytes: int = 256 << 20):
        self.store = store
        self.queue_bytes = int(queue_bytes)
        self._jobs: deque[SaveJob] = deque()
        self._queued: set[bytes] = set()  # hashes queued or being written
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        """Payload bytes waiting or being written."""
        return self._bytes

    def offer(self, h: bytes, parent: bytes | None, tokens: Sequence[int] | np.ndarray | None,
              arrays: Sequence[np.ndarray]) -> bool:
        """Queues block `h` (the arrays are the writer's now); False if it was dropped (the
        store not writable, the queue full, the writer closed). Never blocks on the disk."""
        if self.store.mode != "ok":
            if self.store.mode == "read_only":
                self.store.note_dropped("read_only")
            return False
        if self.store.contains(h):
            return True
        nbytes = sum(int(a.nbytes) for a in arrays)
        with self._cv:
            if h in self._queued:
                return True
            if self._closed:
                return False
            if self._bytes + nbytes > self.queue_bytes:
                full = True
            else:
                full = False
                self._jobs.append(SaveJob(h, parent, tokens, arrays, nbytes))
                self._queued.add(h)
                self._bytes += nbytes
                self._cv.notify()
        if full:
            self.store.note_dropped("queue_full")
        return not full

    def flush(self, timeout: float) -> bool:
        """Waits up to `timeout` s for every queued block to be written (or dropped); True
        if the queue drained."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread after the block it is writing; queued blocks are abandoned."""
        with self._cv:
            self._closed = True
            abandoned = len(self._jobs)
            self._jobs.clear()
            self._cv.notify_all()
        if abandoned:
            log.info("KV disk writer: %d queued blocks abandoned at close", abandoned)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    self._queued.clear()
                    self._bytes = 0
                    self._cv.notify_all()
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self.store.write(job.hash, job.parent, job.tokens, job.arrays)
            except Exception:  # noqa: BLE001 - one bad block must not stop the writer
                log.exception("KV disk writer: block %s not written", job.hash.hex())
                self.store.note_dropped("error")
            finally:
                with self._cv:
                    self._busy = False
                    self._queued.discard(job.hash)
                    self._bytes -= job.nbytes
                    self._cv.notify_all()
