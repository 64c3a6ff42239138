"""When speculation pays: how many drafts each decode scores this step, from measured
step times and each request's measured acceptance.

A step reads every weight once whether it scores one row or five, as long as it is bound
by memory bandwidth (a Mac's decode of a small batch): drafts then cost almost nothing,
and every accepted one is a token for free. As the batch grows the step becomes bound by
compute, each row costs its share, and drafts that are often rejected cost more than
they bring. So, each step:

- `StepTimes` holds the measured time of a step by its number of rows (a moving average
  per row count, interpolated between the counts measured; the worker measures a grid
  of decode steps at start-up, and every real step updates it).
- Each request's acceptance rate `a` (the chance a draft is accepted given the ones
  before it were) is a moving average of its own verify rounds, starting from the
  engine-wide rate. Draft j of a request is then worth a^j expected tokens.
- Drafts are taken in order of worth, and the count m kept is the one that maximises
  expected tokens per second, (decodes + sum of worths) / T(rows + m) (plus the draft
  model's own time for a draft model). A small batch on a memory-bound machine keeps
  all k; a large one keeps the likely drafts only, then none.
"""

from __future__ import annotations

import bisect

from cluster.worker.spec_decode.state import state_of

# Row counts the step-time table keeps (a step's count snaps to the nearest): every count
# to 16, then coarser.
GRID = sorted(set(list(range(1, 17)) + list(range(18, 33, 2)) + list(range(36, 65, 4)) + list(range(72, 129, 8))
                  + [int(128 * 1.25 ** i) for i in range(1, 20)]))
_EMA = 0.2  # weight of a new step-time sample


class StepTimes:
    """Seconds a step takes by its number of rows."""

    def __init__(self):
        self.seconds: dict[int, float] = {}

    @staticmethod
    def snap(rows: int) -> int:
        i = bisect.bisect_left(GRID, rows)
        if i == len(GRID):
            return GRID[-1]
        if i and rows - GRID[i - 1] < GRID[i] - rows:
            return GRID[i - 1]
        return GRID[i]

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or seconds <= 0:
            return
        key = self.snap(rows)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def __call__(self, rows: int) -> float | None:
        """The expected time of a step of `rows` rows (None before any was measured):
        linear between measured counts; beyond the largest, proportional to rows (as
        bound by compute); below the smallest, the smallest's."""
        if not self.seconds:
            return None
        keys = sorted(self.seconds)
        i = bisect.bisect_left(keys, rows)
        if i < len(keys) and keys[i] == rows:
            return self.seconds[rows]
        if i == 0:
            return self.seconds[keys[0]]
        if i == len(keys):
            last = keys[-1]
            return self.seconds[last] * rows / last
        lo, hi = keys[i - 1], keys[i]
        w = (rows - lo) / (hi - lo)
        return (1 - w) * self.seconds[lo] + w * self.seconds[hi]


class SpecPolicy:
    def __init__(self, k: int, initial_rate: float = 0.6):
        self.k = k
        self.times = StepTimes()
        self.rate = initial_rate  # engine-wide acceptance (moving average over verify rounds)
        self.draft_seconds_per_row = 0.0  # a draft model's time per drafted row (0: n-gram)

    def acceptance(self, seq) -> float:
        return state_of(seq, self.rate).rate

    def limits(self, decodes: list, proposed: list[int], num_rows: int) -> list[int]:
        """How many of its `proposed[i]` drafts each of `decodes` scores, in a step that
        has `num_rows` rows without any draft (decode rows and prefill chunks)."""
        t0 = self.times(num_rows)
        if t0 is None:  # nothing measured yet: assume bound by memory (drafts free)
            return list(proposed)
        worths = []
        for i, (seq, n) in enumerate(zip(decodes, proposed)):
            a = min(self.acceptance(seq), 0.999)
            w = 1.0
            for _ in range(n):
                w *= a
                worths.append((w, i))
        if not worths:
            return [0] * len(decodes)
        worths.sort(key=lambda t: -t[0])
        base_tokens = len(decodes)
        best_m, best = 0, base_tokens / t0
        gained = 0.0
        for m, (w, _) in enumerate(worths, 1):
            gained += w
            t = self.times(num_rows + m) + self.draft_seconds_per_row * m
            value = (base_tokens + gained) / t
            if value > best:
                best_m, best = m, value
        out = [0] * len(decodes)
        for _, i in worths[:best_m]:
            out[i] += 1
        return out

    def record(self, seq, drafted: int, accepted: int) -> None:
        """A verify round of `seq`: `accepted` of its `drafted` drafts kept."""
        scored = accepted + (1 if accepted < drafted else 0)  # drafts whose acceptance was decided
        state_of(seq, self.rate).record(accepted, scored)
        if scored:
            self.rate = 0.95 * self.rate + 0.05 * accepted / scored

    def observe_step(self, seconds: float, num_rows: int) -> None:
        self.times.observe(num_rows, seconds)
