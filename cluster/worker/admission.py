"""Admission: a request checked and made a `Sequence` before the engine queues it, and for
n > 1 its other samples, forked from the first once its prompt is computed.

Every refusal is raised before the request takes anything (a ValueError naming what is
wrong, or QueueFullError); a sequence comes out with what its request asks set up: its
pooling state, its grammar's matcher, its thinking budget.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Mapping

from cluster.worker.sampling_params import SamplingParams
from cluster.worker.sequence import Sequence

if TYPE_CHECKING:
    from cluster.worker.block_manager import BlockManager
    from cluster.worker.config import EngineConfig
    from cluster.worker.pooling_requests import PoolingRequests
    from cluster.worker.scheduler import Scheduler
    from cluster.worker.structured import GrammarCompiler
    from cluster.worker.thinking_budget import ThinkingBudgets


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`: try again later (HTTP 429 / RESOURCE_EXHAUSTED)."""


class Admission:
    def __init__(self, config: EngineConfig, vocab_size: int, scheduler: Scheduler, block_manager: BlockManager,
                 grammars: GrammarCompiler, thinking: ThinkingBudgets, pooling: PoolingRequests, speculates: bool,
                 recurrent: bool):
        """`speculates`: speculative decoding is on; `recurrent`: the model keeps a recurrent
        state per sequence (a hybrid), which no sample can take from another's blocks."""
        self.config = config
        self.vocab_size = vocab_size
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.grammars = grammars
        self.thinking = thinking
        self.pooling = pooling
        self.speculates = speculates
        self.recurrent = recurrent

    def check(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, resume_token_ids,
              live: Mapping[str, Sequence]) -> None:
        """Refuse a request this engine cannot take now; `live`: the live samples by id."""
        if request_id in live:
            raise ValueError(f"request id {request_id!r} is already in use")
        wrong = out_of_vocabulary((*prompt_token_ids, *resume_token_ids), self.vocab_size)
        if wrong:
            raise ValueError(wrong)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: send at least one token")
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary (0 .. {self.vocab_size - 1})")
        if len(resume_token_ids) >= params.max_tokens:
            raise ValueError(f"{len(resume_token_ids)} resumed tokens already reach max_tokens={params.max_tokens}")
        self.scheduler.check_fits(len(prompt_token_ids) + len(resume_token_ids))
        if self.scheduler.queue_full(params.pooling is not None):
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests): retry later")
        if params.n > 1 and resume_token_ids:
            raise ValueError("a request with n > 1 cannot be resumed")
        if params.speculative and not self.speculates:
            raise ValueError("speculative: true, but speculative decoding is off on this worker: start it with "
                             "--speculative-config (or leave speculative unset)")
        if params.n > 1 and any(rid.startswith(request_id + "#") for rid in live):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.pooling is not None:
            self.pooling.check(params, resume_token_ids)

    def sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, resume_token_ids,
                 arrival_time: float | None) -> Sequence:
        """The checked request's first sample (`resume_token_ids` count as its output)."""
        prompt = [int(t) for t in prompt_token_ids]
        seq = Sequence(request_id, prompt + [int(t) for t in resume_token_ids], params, num_prompt_tokens=len(prompt))
        if params.pooling is not None:
            self.pooling.start(seq)
        if params.structured is not None:
            seq.matcher = self.grammars.matcher_for(params.structured, resume_token_ids)
        if params.thinking is not None:
            self.thinking.start(seq, resume_token_ids)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        return seq

    def fork(self, parent: Sequence, indices: range) -> list[Sequence]:
        """Samples `indices` of `parent`'s request, now that its prompt is computed: each
        takes the prompt's full blocks by reference (all but the block of the last prompt
        token, whose logits each sample computes itself), so only that tail is forwarded
        again, with or without prefix caching. Sample i draws from seed + i when the
        request has a seed."""
        rid = parent.request_id
        params = parent.sampling_params
        shared = (parent.num_prompt_tokens - 1) // self.block_manager.block_size
        if self.recurrent:
            shared = 0  # a recurrent state is not in the blocks: each sample prefills the whole prompt
        children = []
        for i in indices:
            seed = None if params.seed is None else (params.seed + i) & 0xFFFF_FFFF_FFFF_FFFF
            child = Sequence(f"{rid}#{i}", parent.token_ids[: parent.num_prompt_tokens],
                             replace(params, seed=seed, prompt_logprobs=None),
                             arrival_time=parent.arrival_time, group_id=rid, index=i)
            child.num_cached_tokens = parent.num_cached_tokens
            if params.structured is not None:  # each sample walks its own grammar
                child.matcher = self.grammars.matcher_for(params.structured, ())
            if params.thinking is not None:
                self.thinking.start(child)
            self.block_manager.share_blocks(parent, child, shared)
            children.append(child)
        return children


def out_of_vocabulary(ids, vocab_size: int) -> str | None:
    """What is wrong with prompt token `ids` outside the vocabulary, or None."""
    bad = [t for t in ids if not 0 <= int(t) < vocab_size]
    return f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}" if bad else None
