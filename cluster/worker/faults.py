"""Fault injection for the chaos benchmark and the fault tests (load/chaos.py): never on
unless ORCHARD_FAULT_DIR names a directory. Files in it, named for the worker, make its
engine thread misbehave the way real faults do, from outside the process:

    WORKER_ID.wedge   every step blocks while the file exists (a wedged engine)
    WORKER_ID.slow    every step takes FACTOR x longer (a worker that answers slowly;
                      FACTOR is the file's content, 10 if empty)

and a request whose text prompt contains POISON_MARK makes every step it is part of
raise (a poison request). A worker group's member (which sees token ids, not text) has
its own files, named for its rank (`MemberFaults`):

    rankR.poison      a step of rank R whose token ids contain the run of ids the file
                      lists (whitespace-separated) raises on that rank
    rankR.wedge       every step of rank R blocks while the file exists (a wedged member)

and for the disk KV tier (`slow_kv_writes`):

    kv-write.slow     every block the disk tier writes waits SECONDS first while the file
                      exists (its content, 0.05 if empty: a slow disk, so that a kill lands
                      while blocks are being written)
"""

from __future__ import annotations

import os
import time

import numpy as np

POISON_MARK = "ORCHARD-FAULT-POISON"


class FaultInjection:
    def __init__(self, directory: str, worker_id: str):
        self.wedge = os.path.join(directory, f"{worker_id}.wedge")
        self.slow = os.path.join(directory, f"{worker_id}.slow")
        self.poisoned: set[str] = set()  # engine request ids

    @classmethod
    def from_env(cls, worker_id: str) -> "FaultInjection | None":
        directory = os.environ.get("ORCHARD_FAULT_DIR")
        return cls(directory, worker_id) if directory else None

    def on_request(self, engine_id: str, text: str) -> None:
        if POISON_MARK in text:
            self.poisoned.add(engine_id)

    def before_step(self, live_ids: list[str]) -> float:
        """On the engine thread, before a step: block while wedged; raise for a poison in
        the batch. Returns how much longer the step should take (a slow worker)."""
        while os.path.exists(self.wedge):
            time.sleep(0.05)
        if self.poisoned.intersection(live_ids):
            raise RuntimeError("a poisoned request is in this step (fault injection)")
        try:
            with open(self.slow) as f:
                return float(f.read().strip() or 10)
        except (OSError, ValueError):
            return 0.0


class MemberFaults:
    """A group member's fault hook (see the module docstring)."""

    def __init__(self, directory: str, rank: int):
        self.rank = rank
        self.poison = os.path.join(directory, f"rank{rank}.poison")
        self.wedge = os.path.join(directory, f"rank{rank}.wedge")

    @classmethod
    def from_env(cls, rank: int) -> "MemberFaults | None":
        directory = os.environ.get("ORCHARD_FAULT_DIR")
        return cls(directory, rank) if directory else None

    def before_step(self, input_ids: np.ndarray) -> None:
        """Before this rank's part of a step: block while wedged; raise when its token ids
        hold the poison run."""
        while os.path.exists(self.wedge):
            time.sleep(0.05)
        try:
            with open(self.poison) as f:
                run = np.array([int(t) for t in f.read().split()], np.int64)
        except (OSError, ValueError):
            return
        if 0 < len(run) <= len(input_ids):
            windows = np.lib.stride_tricks.sliding_window_view(np.asarray(input_ids), len(run))
            if (windows == run).all(axis=1).any():
                raise RuntimeError(f"a poisoned request is in this step on rank {self.rank} (fault injection)")


def slow_kv_writes(store) -> None:
    """Under ORCHARD_FAULT_DIR, make the disk tier's `store` write slowly while the
    directory's kv-write.slow exists (see the module docstring); otherwise nothing."""
    directory = os.environ.get("ORCHARD_FAULT_DIR")
    if not directory:
        return
    flag = os.path.join(directory, "kv-write.slow")
    write = store.write

    def slow_write(*args, **kwargs):
        try:
            with open(flag) as f:
                time.sleep(float(f.read().strip() or 0.05))
        except (OSError, ValueError):
            pass
        return write(*args, **kwargs)

    store.write = slow_write
