"""Rank 0's view of a pipeline's steps, from the notices it sees: each step's plan goes
out from rank 0, and every stage's "my hidden state is on its way" notice passes through
it (the side channel is a star). From their times, for each member:

- its part of each step: from when its input was there (the plan, for the first stage;
  the stage before it done, otherwise) or it finished its previous step, whichever came
  later, to its own notice. The slow Mac of a group is the rank whose parts are longest
  (`orchard_group_rank_step_seconds`, `orchard router workers`).
- which rank a step in flight waits on now, and since when: the first stage, in pipeline
  order, that has not finished it. A stall names it.

Stages run in reverse rank order (rank N-1 first, rank 0 last: `stage.py`). Pure Python,
read and written from several threads under one lock.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from dataclasses import dataclass

from cluster.api.buckets import ITL_BUCKETS

STEP_BUCKETS = ITL_BUCKETS  # a rank's part of a step is an inter-token latency's share
RECENT_WEIGHT = 0.1  # the moving average's weight of the newest part
KEEP_STEPS = 1024  # notices kept for steps this far behind the newest (steps never finished are dropped)


@dataclass(frozen=True)
class Late:
    """The rank step `step` waits on, and for how long."""

    rank: int
    step: int
    seconds: float


class StepProgress:
    def __init__(self, size: int, clock=time.monotonic):
        self.size = size
        self.clock = clock
        self._lock = threading.Lock()
        self._sent: dict[int, float] = {}  # step -> when its plan went out
        self._done: dict[int, dict[int, float]] = {r: {} for r in range(1, size)}  # rank -> step -> its notice
        self._last: dict[int, tuple[int, float]] = {r: (0, 0.0) for r in range(1, size)}  # rank -> its last step, when
        # per member rank: seconds of its parts summed, parts counted, per bucket, and a moving average
        self.seconds = {r: 0.0 for r in range(1, size)}
        self.parts = {r: 0 for r in range(1, size)}
        self.buckets = {r: [0] * (len(STEP_BUCKETS) + 1) for r in range(1, size)}
        self.recent = {r: 0.0 for r in range(1, size)}

    def sent(self, step: int, at: float | None = None) -> None:
        """Step `step`'s plan went out (every member runs every step, in this order)."""
        with self._lock:
            self._sent[step] = self.clock() if at is None else at
            self._sent.pop(step - KEEP_STEPS, None)

    def finished(self, rank: int, step: int, at: float | None = None) -> None:
        """Rank `rank` says its part of step `step` is done (its notice to the next stage)."""
        at = self.clock() if at is None else at
        with self._lock:
            if rank not in self._done:
                return
            start = self._start(rank, step)
            self._last[rank] = (step, at)
            done = self._done[rank]
            done[step] = at
            done.pop(step - KEEP_STEPS, None)
            if rank == self.size - 1:
                self._sent.pop(step, None)
            else:
                self._done[rank + 1].pop(step, None)  # its next reader is this rank, now done with it
            if start is None:
                return
            part = max(0.0, at - start)
            self.seconds[rank] += part
            self.parts[rank] += 1
            self.buckets[rank][bisect_left(STEP_BUCKETS, part)] += 1
            self.recent[rank] = part if self.parts[rank] == 1 else (
                (1 - RECENT_WEIGHT) * self.recent[rank] + RECENT_WEIGHT * part)

    def _start(self, rank: int, step: int) -> float | None:
        """When rank `rank` could begin step `step` (None: not known, a notice missed)."""
        given = self._sent.get(step) if rank == self.size - 1 else self._done[rank + 1].get(step)
        if given is None:
            return None
        last_step, last_at = self._last[rank]
        return max(given, last_at) if last_step == step - 1 else given

    def late(self, step: int, now: float | None = None) -> Late | None:
        """The member step `step` waits on now (None: every member has done its part)."""
        now = self.clock() if now is None else now
        with self._lock:
            for rank in range(self.size - 1, 0, -1):  # pipeline order
                if self._last[rank][0] < step:
                    start = self._start(rank, step)
                    return Late(rank, step, now - start if start is not None else 0.0)
        return None
