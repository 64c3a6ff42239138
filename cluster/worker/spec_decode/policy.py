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
  processes' load leaves alone. Under busy loops a step's wall time grows far more than
  its CPU time and varies from step to step (MEASUREMENTS.md): a table of wall times
  would say that whichever row count was measured at a quiet moment was cheap, and keep
  drafts that do not pay.
- Each request's acceptance rate `a` (the chance a draft is accepted given the ones
  before it were) is a moving average of its own verify rounds, pulled toward the
  engine-wide rate of its proposal's kind (n-gram: continuing a copy, or a fresh match of
  n tokens). Draft j of a request is then worth a^j expected tokens.
- Drafts are taken in order of worth, and the count m kept is the one that maximises
  expected tokens per second, (decodes + sum of worths) / (T(decodes) + the m rows' cost
  in this step) (plus the draft model's own time for a draft model). A small batch on a
  memory-bound machine keeps all k; a large one keeps the likely drafts only, then none.
- Where the table says drafts pay but not by much (under `SURE`), `WallCheck` asks the
  wall clock, which is what a user waits on and what CPU time cannot see: on a machine
  other processes load, a step's wall time grows with its rows far faster than its CPU
  time (beside busy loops, CPU time can say drafts pay where the wall clock says they
  lose: `load/bench_spec.py`; MEASUREMENTS.md). It is a randomized trial by steps: per batch size, the decode-only steps
  that keep their drafts against those that drop them (one in 8, chosen by lot), in
  output tokens per wall second, compared within blocks of consecutive steps; once the
  drafts lose, they are dropped, and one step in 8 (fewer, the more they lose) keeps
  them to see whether that still holds. A step with a prefill chunk follows the verdict
  without joining the trial (the chunk's time would drown the drafts').
"""

from __future__ import annotations

import bisect
import math
import random
import time
from dataclasses import dataclass, field

from cluster.worker.spec_decode.state import state_of

# Row counts the step-time table keeps (a step's count snaps to the nearest): every count
# to 48, then coarser. A step's cost jumps just past a power of two, where a kernel's
# tiling adds a tile (MEASUREMENTS.md): the counts in between must not snap across a jump.
GRID = sorted(set(list(range(1, 49)) + list(range(52, 65, 4)) + list(range(72, 129, 8))
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


SURE = 1.5  # a predicted gain (tokens per second, with the drafts / without) the wall clock is not asked about


@dataclass
class _Trial:
    """The wall-clock trial of one batch size."""

    lots: list = field(default_factory=list)  # the current block's lots not yet drawn
    block: list = field(default_factory=lambda: [[0, 0.0], [0, 0.0]])  # [without, with]: [tokens, seconds]
    sum: float = 0.0  # decayed sum of the blocks' log(rate with / rate without)
    weight: float = 0.0
    blocks: int = 0
    pays: bool = True


class WallCheck:
    """Whether drafts pay in wall time, per batch size (up to its power of two): a
    randomized trial by steps between keeping the drafts the table chose and dropping
    them, in blocks of consecutive steps. A block is 2 steps, one of each, in an order
    drawn by lot, until `min_blocks` blocks; then 8 steps, one of them (its place drawn
    by lot) against the verdict. Once drafts do worse than 0.7x, a block is 8 / ratio^2
    steps: a step with drafts can take many times a plain one's wall time on a loaded
    CPU, and trying one every 8 steps would cost more than dropping them saves. Each
    block gives log(output tokens per wall second with drafts / without), and the
    verdict follows a moving mean of the last ~`window` blocks: drafts lose under 0.97x
    and pay again above 1.03x (the gap keeps noise from flipping it). Comparing steps
    only within their block, a few steps apart, keeps a burst of prompts or a load that
    comes and goes from being taken for the drafts' doing: it weighs on both sides of a
    block alike."""

    def __init__(self, block: int = 8, window: int = 16, min_blocks: int = 4, seed: int = 0):
        self.block_size, self.min_blocks = block, min_blocks
        self.decay = 1 - 1 / window
        self.trials: dict[int, _Trial] = {}
        self.rng = random.Random(seed)

    @staticmethod
    def bucket(decodes: int) -> int:
        """1, 2, 3-4, 5-8, ..., 17-32, ...: a batch of 2^i streams and one of its requests
        between prompts fall in the same."""
        return (decodes - 1).bit_length()

    def draw(self, bucket: int) -> bool:
        """Whether this step keeps its drafts."""
        t = self.trials.setdefault(bucket, _Trial())
        if not t.lots:  # a new block
            if t.blocks < self.min_blocks:
                t.lots = [True, False]
            elif t.pays:
                t.lots = [True] * (self.block_size - 1) + [False]
            else:  # the worse the drafts did (past 0.7x), the rarer the step that tries them again
                ratio = max(self.ratio(bucket), 1e-3)
                n = self.block_size
                if ratio < 0.7:
                    n = min(32 * self.block_size, math.ceil(self.block_size / ratio**2))
                t.lots = [False] * (n - 1) + [True]
            self.rng.shuffle(t.lots)
            t.block = [[0, 0.0], [0, 0.0]]
        return t.lots.pop()

    def verdict(self, bucket: int) -> bool:
        t = self.trials.get(bucket)
        return t is None or t.pays

    def record(self, bucket: int, kept: bool, tokens: int, seconds: float) -> None:
        """A step of the trial: its lot, output tokens and wall seconds."""
        t = self.trials.get(bucket)
        if t is None:
            return
        side = t.block[kept]
        side[0] += tokens
        side[1] += seconds
        without, with_ = t.block
        if not t.lots and without[1] > 0 and with_[1] > 0 and without[0] > 0 and with_[0] > 0:  # a block done
            t.sum = t.sum * self.decay + math.log((with_[0] / with_[1]) / (without[0] / without[1]))
            t.weight = t.weight * self.decay + 1
            t.blocks += 1
            t.block = [[0, 0.0], [0, 0.0]]
            if t.blocks >= self.min_blocks:
                ratio = self.ratio(bucket)
                t.pays = ratio > 1.03 if not t.pays else ratio >= 0.97

    def ratio(self, bucket: int) -> float | None:
        """Tokens per wall second with drafts / without (the blocks' moving geometric
        mean), once there are `min_blocks` blocks."""
        t = self.trials.get(bucket)
        if t is None or t.blocks < self.min_blocks:
            return None
        return math.exp(t.sum / t.weight)


class SpecPolicy:
    def __init__(self, k: int, initial_rate: float = 0.6):
        self.k = k
        self.times = StepTimes()
        self.check = WallCheck()
        self.arm: tuple[int, bool] | None = None  # the last `limits`' lot (bucket, drafts kept), for `observe_step`
        self.initial_rate = initial_rate
        # engine-wide acceptance by proposal kind (n-gram: a continued copy, or a fresh match of
        # n tokens), moving averages over verify rounds
        self.rates: dict[str, float] = {}
        self.draft_seconds_per_row = 0.0  # a draft model's time per drafted row (0: n-gram)

    def acceptance(self, seq) -> float:
        state = state_of(seq)
        return state.rate(self.rates.get(state.kind, self.initial_rate))

    def limits(self, decodes: list, proposed: list[int], num_rows: int, decode_rows: int | None = None) -> list[int]:
        """How many of its `proposed[i]` drafts each of `decodes` scores, in a step that
        has `num_rows` rows without any draft (decode rows and prefill chunks), of which
        `decode_rows` (default: one per decode in `decodes`) are decodes.

        The drafts are weighed against the decodes' own time, T(decode_rows), at the cost
        they add to this step, T(num_rows + m) - T(num_rows): a prefill chunk's rows are
        work the step must do anyway, not a cost to spread the drafts' tokens over (a step
        that is mostly a 512-row chunk would make any draft look free), and beside one the
        drafts' rows cost what a row costs at that size."""
        self.arm = None
        decode_rows = len(decodes) if decode_rows is None else max(decode_rows, len(decodes))
        t0 = self.times(decode_rows)
        if t0 is None:  # nothing measured yet: assume bound by memory (drafts free)
            return list(proposed)
        t_rows = self.times(num_rows)
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
        base_tokens = decode_rows
        best_m, best = 0, base_tokens / t0
        gained = 0.0
        for m, (w, _) in enumerate(worths, 1):
            gained += w
            t = t0 + self.times(num_rows + m) - t_rows + self.draft_seconds_per_row * m
            value = (base_tokens + gained) / t
            if value > best:
                best_m, best = m, value
        out = [0] * len(decodes)
        if best_m and best < SURE * base_tokens / t0:  # a small gain on the table: ask the wall clock
            bucket = self.check.bucket(decode_rows)
            if num_rows > decode_rows:  # beside a prefill chunk, whose time would swamp the trial's: its verdict
                keep = self.check.verdict(bucket)
            else:
                keep = self.check.draw(bucket)
                self.arm = (bucket, keep)
            if not keep:
                return out
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

    def observe_step(self, seconds: float, num_rows: int, arm: tuple[int, bool] | None = None, tokens: int = 0,
                     wall_seconds: float = 0.0) -> None:
        """A step of `num_rows` rows cost `seconds` (of `cost_clock`); if `limits` drew it
        for the wall-clock trial (`arm`), it gave `tokens` in `wall_seconds`."""
        self.times.observe(num_rows, seconds)
        if arm is not None:
            self.check.record(*arm, tokens, wall_seconds)
