"""An in-memory stand-in for the disk tier's store (`cluster/kv/`: DiskStore, DiskWriter,
DiskReader, KvIdentity), with the same interface: the engine's tier is tested against it
where the real store's files do not matter. Blocks outlive an engine (a "restart") in
`FakeDisk.stores`, keyed by directory and identity."""

from __future__ import annotations

import hashlib
import json
import threading
from types import SimpleNamespace

import numpy as np


class KvReadError(Exception):
    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


class KvIdentity:
    def __init__(self, **fields):
        self.fields = fields
        self.id = hashlib.blake2b(json.dumps(fields, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


class DiskStore:
    stores: dict = {}  # (root, identity id) -> {hash: (parent, tokens, [arrays])}

    def __init__(self, blocks: dict, budget: int, listener):
        self.blocks = blocks
        self.mode, self.reason = "ok", ""
        self.budget_bytes = budget
        self.listener = listener
        self.corrupt: set[bytes] = set()  # hashes whose next read fails ("checksum")
        self.reads = 0

    @classmethod
    def open(cls, root, identity, budget_bytes, min_free_bytes, listener=None) -> "DiskStore":
        return cls(cls.stores.setdefault((str(root), identity.id), {}), budget_bytes, listener)

    @property
    def used_bytes(self) -> int:
        return sum(a.nbytes for _, _, arrays in self.blocks.values() for a in arrays)

    def contains(self, h: bytes) -> bool:
        return h in self.blocks

    def lookup(self, hashes) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def read(self, h, parent, tokens, out) -> None:
        self.reads += 1
        if h in self.corrupt or h not in self.blocks:
            self.blocks.pop(h, None)
            raise KvReadError("checksum")
        p, t, arrays = self.blocks[h]
        if p != parent or (tokens is not None and tuple(t) != tuple(tokens)):
            raise KvReadError("tokens")
        for dst, src in zip(out, arrays):
            dst[...] = src

    def write(self, h, parent, tokens, arrays) -> bool:
        self.blocks[h] = (parent, tuple(tokens), [np.array(a) for a in arrays])
        if self.listener is not None:
            self.listener.stored([h])
        return True


class DiskWriter:
    def __init__(self, store: DiskStore, queue_bytes: int):
        self.store = store
        self.queued_bytes = 0

    def offer(self, h, parent, tokens, arrays) -> bool:
        return self.store.write(h, parent, tokens, arrays)  # synchronous: nothing ever queued

    def flush(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


class DiskReader:
    def __init__(self, store: DiskStore, threads: int):
        self.store = store
        self.gate: threading.Event | None = None  # set by a test to hold reads back

    def submit(self, entries, out, done) -> None:
        def run():
            if self.gate is not None:
                self.gate.wait(30)
            good = 0
            for (h, parent, tokens), buffers in zip(entries, out):
                try:
                    self.store.read(h, parent, tokens, buffers)
                except KvReadError:
                    break
                good += 1
            done(good)

        threading.Thread(target=run, daemon=True).start()


def backend() -> SimpleNamespace:
    return SimpleNamespace(KvIdentity=KvIdentity, DiskStore=DiskStore, DiskWriter=DiskWriter, DiskReader=DiskReader)
