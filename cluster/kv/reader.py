"""The disk tier's readers: a small thread pool reading a prompt's blocks from a DiskStore
into the engine's host buffers.

`submit(entries, out, done)` reads `entries` (a prefix's consecutive blocks) into `out`,
split across the threads in runs of consecutive blocks, and calls `done(k)` once, on a
reader thread: the first k blocks verified, in prefix order. Blocks after the first
failure are not used (the engine recomputes from there), and reading stops there. The
blocks are pinned in the store meanwhile, so the writer's LRU does not delete them.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from cluster.kv.disk_store import DiskStore, KvReadError

log = logging.getLogger(__name__)

Entry = tuple  # (hash, parent hash or None, tokens or None)
MIN_RUN = 8  # blocks a thread reads in one run: fewer is not worth a hand-off


class _Load:
    """One submit's progress: the first failed index, and the runs still reading."""

    def __init__(self, entries: Sequence[Entry], out: Sequence[Sequence[np.ndarray]],
                 done: Callable[[int], None], runs: int):
        self.entries, self.out, self.done = entries, out, done
        self.first_bad = len(entries)
        self.runs_left = runs
        self.lock = threading.Lock()

    def fail(self, i: int) -> None:
        with self.lock:
            self.first_bad = min(self.first_bad, i)

    def run_finished(self) -> bool:
        with self.lock:
            self.runs_left -= 1
            return self.runs_left == 0


class DiskReader:
    """`threads` threads reading blocks of `store` for the engine."""

    def __init__(self, store: DiskStore, threads: int = 4):
        self.store = store
        self.threads = max(1, int(threads))
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kv-disk-read")
        self._closed = False

    def submit(self, entries: Sequence[Entry], out: Sequence[Sequence[np.ndarray]],
               done: Callable[[int], None]) -> None:
        """Reads block i of `entries` into `out[i]` (one array per pool) and calls `done(k)`
        once: the first k are good. After `close`, `done(0)` at once."""
        if len(out) != len(entries):
            raise ValueError(f"DiskReader: {len(entries)} blocks but {len(out)} buffer sets")
        n = len(entries)
        run = max(MIN_RUN, math.ceil(n / self.threads))
        starts = list(range(0, n, run))
        if self._closed or not starts:
            done(0 if self._closed else n)
            return
        load = _Load(entries, out, done, len(starts))
        self.store.pin(e[0] for e in entries)
        for start in starts:
            self._pool.submit(self._read_run, load, start, min(start + run, n))

    def _read_run(self, load: _Load, start: int, stop: int) -> None:
        try:
            for i in range(start, stop):
                if i >= load.first_bad:
                    break  # an earlier block failed: these are not used
                if self._closed:
                    load.fail(i)
                    break
                h, parent, tokens = load.entries[i]
                try:
                    self.store.read(h, parent, tokens, load.out[i])
                except KvReadError:
                    load.fail(i)
                    break
                except Exception:  # noqa: BLE001 - a bug here costs a recompute, not the reader
                    log.exception("KV disk reader: block %s", h.hex())
                    load.fail(i)
                    break
        finally:
            if load.run_finished():
                self.store.unpin(e[0] for e in load.entries)
                load.done(load.first_bad)

    def close(self) -> None:
        """Stops reading: runs not started end at once (their loads get `done` with what was
        read before them); waits for the reads in progress."""
        self._closed = True
        self._pool.shutdown(wait=True)
