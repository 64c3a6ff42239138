"""When speculation pays: how many drafts each decode scores this step, from measured
step times and each request's measured acceptance.

A step reads every weight once whether it scores one row or five, as long as it is bound
by memory bandwidth (a Mac's decode of a small batch): drafts then cost almost nothing,
and every accepted one is a token for free. As the batch grows the step becomes bound by
compute, each row costs its share, and drafts that are often rejected cost more than
they bring. So, each step:

- `StepTimes` holds the measured cost of a step by its number of rows (a moving estimate
  per row count, interpolated between the counts measured; the worker measures a grid
  of steps at start-up, and every real step updates it). The cost is read with
  `cost_clock()`: on a GPU the wall time; on a CPU the process's CPU time, which other
  processes' load leaves alone. Under two busy loops on this 2-core machine a 32-row
  step's wall time went from 78 to 137-256 ms and a 48-row one's from 130 ms to 0.7-3.9 s
  (OpenMP's threads wait their turn at every barrier), while their CPU time moved by
  5-20%: a table of wall times said that whichever row count was measured at a quiet
  moment was cheap, and kept drafts that did not pay.
- Each request's acceptance rate `a` (the chance a draft is accepted given the ones
  before it were) is a moving average of its own verify rounds, pulled toward the
  engine-wide rate of its proposal's kind (n-gram: continuing a copy, or a fresh match of
  n tokens). Draft j of a request is then worth a^j expected tokens.
- Drafts are taken in order of worth, and the count m kept is the one that maximises
  expected tokens per second, (decodes + sum of worths) / T(rows + m) (plus the draft
  model's own time for a draft model). A small batch on a memory-bound machine keeps
  all k; a large one keeps the likely drafts only, then none.
"""

from __future__ import annotations

import bisect
import time

from cluster.worker.spec_decode.state import state_of

# Row counts the step-time table keeps (a step's count snaps to the nearest): every count
# to 16, then coarser.
GRID = sorted(set(list(range(1, 17)) + list(range(18, 33, 2)) + list(range(36, 65, 4)) + list(range(72, 129, 8))
                  + [int(128 * 1.25 ** i) for i in range(1, 20)]))
_DOWN, _UP = 0.3, 0.05  # weight of a new step-time sample below / above the estimate


def cost_clock():
    """The clock a step's cost is read with: the process's CPU time (every thread's: MLX's,
    OpenBLAS's, the C kernels') when the model runs on the CPU, the wall time on a GPU,
    whose work that clock does not see. Only ratios of costs matter to the policy."""
    import mlx.core as mx

    return time.process_time if mx.default_device() == mx.cpu else time.perf_counter


class StepTimes:
    """Seconds a step takes by its number of rows.

    Each row count keeps a moving estimate that follows a fast sample quickly and a slow
    one slowly (a low quantile, not the mean): on a machine shared with other work a
    step only ever takes longer than its own cost, never shorter. Read back, the table is
    made non-decreasing in rows (pool-adjacent-violators, weighted by samples), so noise
    never says that more rows cost less."""

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self.samples: dict[int, int] = {}
        self._smooth: tuple[list[int], list[float]] | None = None

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
        if old is None:
            self.seconds[key] = seconds
        else:
            self.seconds[key] = old + (_DOWN if seconds < old else _UP) * (seconds - old)
        self.samples[key] = self.samples.get(key, 0) + 1
        self._smooth = None

    def _table(self) -> tuple[list[int], list[float]]:
        if self._smooth is None:
            blocks: list[list[float]] = []  # [value, weight, first key index, last]
            keys = sorted(self.seconds)
            for i, k in enumerate(keys):
                blocks.append([self.seconds[k], float(min(self.samples[k], 20)), i, i])
                while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                    b = blocks.pop()
                    a = blocks[-1]
                    w = a[1] + b[1]
                    a[0], a[1], a[3] = (a[0] * a[1] + b[0] * b[1]) / w, w, b[3]
            values = [0.0] * len(keys)
            for v, _, lo, hi in blocks:
                for i in range(lo, hi + 1):
                    values[i] = v
            self._smooth = (keys, values)
        return self._smooth

    def __call__(self, rows: int) -> float | None:
        """The expected time of a step of `rows` rows (None before any was measured):
        linear between measured counts; beyond the largest, proportional to rows (as
        bound by compute); below the smallest, the smallest's."""
        if not self.seconds:
            return None
        keys, values = self._table()
        i = bisect.bisect_left(keys, rows)
        if i < len(keys) and keys[i] == rows:
            return values[i]
        if i == 0:
            return values[0]
        if i == len(keys):
            return values[-1] * rows / keys[-1]
        lo, hi = keys[i - 1], keys[i]
        w = (rows - lo) / (hi - lo)
        return (1 - w) * values[i - 1] + w * values[i]


class SpecPolicy:
    def __init__(self, k: int, initial_rate: float = 0.6):
        self.k = k
        self.times = StepTimes()
        self.initial_rate = initial_rate
        # engine-wide acceptance by proposal kind (n-gram: a continued copy, or a fresh match of
        # n tokens), moving averages over verify rounds
        self.rates: dict[str, float] = {}
        self.draft_seconds_per_row = 0.0  # a draft model's time per drafted row (0: n-gram)

    def acceptance(self, seq) -> float:
        state = state_of(seq)
        return state.rate(self.rates.get(state.kind, self.initial_rate))

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
        state = state_of(seq)
        state.record(accepted, scored)
        if scored:
            old = self.rates.get(state.kind, self.initial_rate)
            self.rates[state.kind] = 0.95 * old + 0.05 * accepted / scored

    def observe_step(self, seconds: float, num_rows: int) -> None:
        self.times.observe(num_rows, seconds)
