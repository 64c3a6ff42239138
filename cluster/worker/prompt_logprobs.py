"""Prompt logprobs: for each prompt token after the first, its logprob given the tokens
before it and the top alternatives, computed from the logit rows of the prefill chunks
that ask for them (`StepBatch.prompt_rows`), and kept on the sequence
(`Sequence.prompt_logprobs`) until its first output token takes them out."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from cluster.worker.model_runner import StepBatch
    from cluster.worker.scheduler import SchedulerOutput


def add_prompt_logprobs(plan: SchedulerOutput, batch: StepBatch, logits: mx.array) -> None:
    """Log-softmax the prompt rows of this step (float32, the raw model distribution,
    as the sampler's logprobs) and append each one's target token, logprob and top k
    to its sequence."""
    rows, targets = [], []
    for i, first, positions in batch.prompt_rows:
        seq = plan.scheduled[i].seq
        rows += range(first, first + len(positions))
        targets += seq.token_ids[positions.start + 1 : positions.stop + 1]
    x = logits[mx.array(rows, dtype=mx.int32)]
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    target_ids = mx.array(targets, dtype=mx.int32)
    chosen = mx.take_along_axis(lp, target_ids[:, None], axis=-1)[:, 0]
    k = max(plan.scheduled[i].seq.sampling_params.prompt_logprobs for i, _, _ in batch.prompt_rows)
    top_ids = top_vals = None
    if k:
        top_ids = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        top_vals = mx.take_along_axis(lp, top_ids, axis=-1)
        mx.eval(chosen, top_ids, top_vals)
        top_ids, top_vals = top_ids.tolist(), top_vals.tolist()
    chosen = chosen.tolist()
    r = 0
    for i, _, positions in batch.prompt_rows:
        seq = plan.scheduled[i].seq
        kk = seq.sampling_params.prompt_logprobs
        for _ in positions:
            top = sorted(zip(top_ids[r], top_vals[r]), key=lambda t: -t[1])[:kk] if kk else []
            seq.prompt_logprobs.append((targets[r], chosen[r], top))
            r += 1
