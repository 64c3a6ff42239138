"""Speculation's calibration: the step times by rows that the policy weighs drafts against
(`policy.StepTimes`), measured on the engine's own model before the first request (the
engine's warm-up), so that its first decisions do not wait for real steps of each size."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from cluster.worker.scheduler import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from cluster.worker.model_runner import ModelRunner
    from cluster.worker.sequence import Sequence
    from cluster.worker.spec_decode.speculator import Speculator

# The step sizes measured: the policy interpolates between them. With each power of two,
# the count just past it (9, 17, 33), where a kernel's tiling adds a tile and the cost
# jumps (`policy.GRID`): interpolating across such a jump would price a draft beside 16
# decodes far below its cost (MEASUREMENTS.md).
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 96, 128)


def calibrate(speculator: Speculator, runner: ModelRunner, seq: Sequence, context: int, max_rows: int,
              block_size: int) -> None:
    """Time steps of each of CALIBRATION_ROWS up to `max_rows` rows (in seconds of the
    speculator's clock, the best of three) after `context` tokens of `seq`, a warm-up
    sequence on free blocks outside the scheduler, into the policy's table."""

    def timed(rows: int) -> float:
        seq.token_ids = [0] * (context + rows)
        seq.block_table = list(range(-(-(context + rows) // block_size)))
        plan = SchedulerOutput([ScheduledSeq(seq, context, rows)])
        t = speculator.clock()
        logits = runner.forward(runner.prepare(plan))
        mx.eval(logits, *runner.pool_arrays())
        return speculator.clock() - t

    for rows in CALIBRATION_ROWS:
        if rows <= max_rows:
            speculator.policy.times.observe(rows, min(timed(rows) for _ in range(3)))
