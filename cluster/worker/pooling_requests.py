"""The engine's pooling requests (embeddings, scores) through a step: what the model
pools and how is `pooling.py`'s; this is where the engine's steps meet it.

A pooling request is checked when it is added (`check`, `start`). Before each forward,
the final hidden rows its chunk reads are put into the step's batch (`pick_rows`); after
it, they are folded into its pooling state (`accumulate`); once its last chunk has run,
it ends with its vector or its score (`results`), and nothing is sampled from it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from cluster.worker.pooling import Pooler, PoolState, sigmoid
from cluster.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.worker.model_runner import ModelRunner, StepBatch
    from cluster.worker.scheduler import ScheduledSeq, SchedulerOutput
    from cluster.worker.sequence import Sequence

# (entry index in the plan, first of its rows in `StepBatch.hidden_rows`, how many)
PooledRows = list[tuple[int, int, int]]


class PoolingRequests:
    def __init__(self, pooler: Pooler, runner: ModelRunner, model_name: str):
        self.pooler = pooler
        self.runner = runner
        self.model_name = model_name

    def check(self, params: SamplingParams, resume_token_ids) -> None:
        """ValueError for a pooling request this engine cannot serve."""
        self.pooler.check(params.pooling)
        if not self.runner.can_pool:
            raise ValueError(f"model {self.model_name!r} cannot serve embeddings or scores: its final hidden states "
                             "are not reachable apart from its logits (an mlx-lm family of the form head(model(x)) "
                             "is needed: llama, qwen2, qwen3, mistral, ...)")
        if params.pooling.task == "score" and self.pooler.score_kind == "yes_no" and self.pooler.yes_no_ids is None:
            raise ValueError("the reranker's yes / no tokens are unknown")
        if params.n != 1 or resume_token_ids or params.prompt_logprobs is not None or params.structured is not None:
            raise ValueError("a pooling request takes no n, resumed tokens, prompt logprobs or structured output")

    def start(self, seq: Sequence) -> None:
        """A new pooling request's empty state; whether it must compute every position."""
        seq.pool_state = PoolState()
        seq.skip_prefix_cache = self.pooler.needs_every_position(seq.sampling_params.pooling)

    def pick_rows(self, plan: SchedulerOutput, batch: StepBatch) -> PooledRows:
        """Put the rows the step's pooling requests read into `batch.hidden_rows`; returns
        (entry index, first of its rows there, how many) for each such entry."""
        scheduled = plan.scheduled
        pooled = [i for i, e in enumerate(scheduled) if e.seq.sampling_params.pooling is not None]
        if not pooled:
            return []
        firsts = [0, *itertools.accumulate(e.num_new_tokens for e in scheduled)]  # each entry's first row
        rows: list[int] = []
        found: PooledRows = []
        for i in pooled:
            e = scheduled[i]
            r = self.pooler.hidden_rows(e.seq.sampling_params.pooling, e.start, e.num_new_tokens, e.sample)
            found.append((i, len(rows), len(r)))
            rows += [firsts[i] + k for k in r]
        batch.hidden_rows = mx.array(rows, dtype=mx.int32)
        return found

    def accumulate(self, plan: SchedulerOutput, found: PooledRows) -> None:
        """Fold this step's final hidden states into each pooling request's state."""
        hidden = np.array(self.runner.hidden, dtype=np.float32) if self.runner.hidden is not None else None
        for i, first, n in found:
            e = plan.scheduled[i]
            rows = hidden[first : first + n] if n else np.zeros((0, 0), np.float32)
            self.pooler.accumulate(e.seq.pool_state, e.seq.sampling_params.pooling, e.start, rows)

    def results(self, entries: list[ScheduledSeq]) -> list[np.ndarray]:
        """The vector (an embedding) or the score ([1]) of each pooling request whose last
        chunk ran this step, in order."""
        results: dict[int, np.ndarray] = {}
        scored = []
        for e in entries:
            params = e.seq.sampling_params.pooling
            pooled = self.pooler.pooled(e.seq.pool_state, params)
            if params.task == "embed":
                results[id(e.seq)] = self.pooler.embedding(pooled, params)
            else:
                scored.append((e.seq, pooled))
        if scored:
            for (seq, _), score in zip(scored, self._scores(np.stack([p for _, p in scored]))):
                results[id(seq)] = np.array([score], dtype=np.float32)
        return [results[id(e.seq)] for e in entries]

    def _scores(self, pooled: np.ndarray) -> list[float]:
        """A reranker's scores from last-token hidden states [N, hidden] (pooling.py)."""
        h = mx.array(pooled).astype(self.runner.dtype)
        if self.pooler.score_kind == "classifier":
            logits = np.array(self.runner.model.score(h).astype(mx.float32))
            return [sigmoid(float(x)) for x in logits[:, 0]]
        yes, no = self.pooler.yes_no_ids
        logits = self.runner.head_logits(h)[:, mx.array([yes, no])].astype(mx.float32)
        logits = np.array(logits)
        return [sigmoid(float(y - n)) for y, n in logits]
