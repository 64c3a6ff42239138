"""One plan per step: decode rows and prefill chunks under a shared token budget.

Pure Python (no MLX). The policy, in order, each step:

1. Running decodes (one token each), oldest first.
2. Running partial prefills, oldest first. A short one (at most
   `long_prefill_token_threshold` tokens left) takes what it needs. Long ones share what
   is left after reserving room for the short waiting prompts that fit whole this step
   (at most half the budget), so one long prompt cannot starve the short ones.
3. Waiting requests, first come first served, admitted while there is budget, a free
   sequence slot and KV blocks (one whose prefix is being read from disk waits aside:
   `Sequence.kv_loading`, worker/kv_tier.py). A prompt whose whole prefill fits in what
   is left of the budget just runs. One that does not becomes a *partial* prefill, left
   mid-prefill after the step: at most `max_num_partial_prefills` prompts are partial at
   once and at most `max_long_partial_prefills` of them long (more than
   `long_prefill_token_threshold` tokens to compute). A prompt over its partial limit is
   skipped, so a short one behind it still starts (vLLM's concurrent partial prefills).
4. Budget still left (a reservation that went unused) goes to the partial prefills of
   the plan, oldest first, as far as free KV blocks allow. (A waiting prompt is admitted
   only with blocks for its whole chunk, as in vLLM: shrinking chunks to the last free
   blocks would only trade them for preemptions.)

A request with prompt logprobs sends every prompt row to the LM head, not just its last:
at most `MAX_PROMPT_LOGPROB_ROWS` such rows a step (its chunks shrink to fit), so a step's
logits stay bounded ([rows, vocab] float32: 512 rows of a 150k vocabulary are 300 MB).

Pooling requests (embeddings, scores: prefill only) take at most `pooling_share` of a
step's budget while generation requests run or wait, and a generation request queues ahead
of the pooling requests not yet started (`generation_first`): an embedding batch is
throughput work, a chat's first token and its next ones are waited for. The oldest of those
pooling requests lets at most `POOLING_MAX_PASSED` generation requests go ahead of it, so a
generation load that never lets the queue empty still lets embeddings start. A pooling
request mid-prefill does not count against a generation request's partial-prefill limits.

When a running request cannot get a block, the newest running request is preempted
(with generation_first, the newest pooling request while one runs): its blocks are freed
and it goes back to the front of the queue with all its tokens, to be recomputed later
(its output is unchanged). Waiting requests never preempt.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from cluster.worker.block_manager import BlockManager
from cluster.worker.config import EngineConfig
from cluster.worker.sequence import Sequence, SequenceStatus
from cluster.worker.state_slots import StateSlots

log = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position forwarded this step (= num_computed_tokens before it)
    num_new_tokens: int  # drafts included
    # speculative decoding: draft tokens forwarded after the sequence's last token (a
    # decode of 1 + len(spec_token_ids) rows, each of them sampled: spec_decode/)
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def sample(self) -> bool:
        """The chunk reaches the end of the sequence, so its last row is sampled (its last
        1 + len(spec_token_ids) rows, with drafts)."""
        return self.end == self.seq.num_tokens + len(self.spec_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        """The step's input tokens: positions [start, end) of the sequence, drafts last."""
        if self.spec_token_ids:
            return self.seq.token_ids[self.start :] + self.spec_token_ids
        return self.seq.token_ids[self.start : self.end]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# How far down the waiting queue admission looks past prompts it has to skip.
_LOOKAHEAD = 32
# Prompt rows with logprobs (all reach the LM head) per step at most.
MAX_PROMPT_LOGPROB_ROWS = 512
# Steps after the last generation request during which pooling keeps to its share.
POOLING_LINGER_STEPS = 4
# Generation requests that may queue ahead of the oldest pooling request not yet started
# (generation_first); the next one queues behind it.
POOLING_MAX_PASSED = 8


def _unstarted_pooling(seq: Sequence) -> bool:
    return seq.sampling_params.pooling is not None and not seq.num_preemptions


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, state_slots: StateSlots | None = None):
        """`state_slots`: a hybrid model's recurrent-state slots, taken at admission beside
        the KV blocks and given back with them (None: a model without recurrent layers)."""
        assert config.max_model_len and config.long_prefill_token_threshold, "pass a resolved EngineConfig"
        self.config = config
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._prompt_rows_left = 0  # this step's, while it is planned
        self._pooling_left = 0  # tokens pooling requests may still take this step, while it is planned
        self._steps_without_generation = POOLING_LINGER_STEPS + 1

    # -- requests in and out ------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int) -> None:
        """Refuse a prompt that could never run, with a message that says why."""
        cfg = self.config
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty: send at least one token")
        if num_prompt_tokens > cfg.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens, more than max_model_len={cfg.max_model_len}: "
                "shorten it or raise max_model_len"
            )
        pool_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        if num_prompt_tokens > pool_tokens:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens, more than the whole KV pool holds ({pool_tokens}): "
                "give the worker more KV blocks"
            )

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue `seq` (`front`: first in line, as a sample forked from a running request).
        With `generation_first`, a generation request goes ahead of the pooling requests
        (embeddings, scores) that have not started: a batch of embeddings is throughput
        work, a chat's first token is waited for. Only `POOLING_MAX_PASSED` of them go
        ahead of the oldest such pooling request; the next queues behind it."""
        self.check_fits(seq.num_tokens)
        seq.status = SequenceStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        elif self.config.generation_first and seq.sampling_params.pooling is None and self.waiting:
            at = len(self.waiting)
            while at and _unstarted_pooling(self.waiting[at - 1]):
                at -= 1
            if at < len(self.waiting):  # ahead of pooling requests: the oldest of them counts it
                oldest = self.waiting[at]
                if oldest.passed_by_generation >= POOLING_MAX_PASSED:
                    at += 1  # it has let enough go ahead: this one queues behind it
                else:
                    oldest.passed_by_generation += 1
            self.waiting.insert(at, seq)
        else:
            self.waiting.append(seq)

    def queue_full(self, pooling: bool) -> bool:
        """Whether the waiting queue is at `max_waiting` for a new request. With
        generation_first a generation request queues ahead of the pooling requests not yet
        started, so they do not count against it: an embedding backlog never gets a chat
        refused (the queue then holds at most twice max_waiting)."""
        cap = self.config.max_waiting
        if not cap or len(self.waiting) < cap:
            return False
        if pooling or not self.config.generation_first:
            return True
        return sum(1 for s in self.waiting if not _unstarted_pooling(s)) >= cap

    def abort(self, seq: Sequence) -> None:
        if seq.is_finished:
            return
        self.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._free_state(seq)
        seq.status = status

    def _free_state(self, seq: Sequence) -> None:
        if self.state_slots is not None:
            self.state_slots.free(seq)

    def drop(self, seq: Sequence) -> None:
        """Take `seq` out of the queues whatever state it is in (after a failed abort), mark
        it aborted and free its blocks if that still works: it is never scheduled again."""
        for queue_ in (self.running, self.waiting):
            if seq in queue_:  # Sequence compares by identity
                queue_.remove(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED
        try:
            self.block_manager.free(seq)
            self._free_state(seq)
        except Exception:
            log.exception("scheduler: freeing the blocks of %s failed", seq.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_runnable(self) -> bool:
        """Whether a step may do something now: a request that is not waiting for its
        prefix to come back from disk."""
        return bool(self.running) or any(not s.kv_loading for s in self.waiting)

    def is_long(self, seq: Sequence) -> bool:
        return seq.num_uncomputed_tokens > self.config.long_prefill_token_threshold

    # -- the plan -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's plan, in the module's order: decodes, running prefills, waiting
        requests, then what budget is left to the prompts still mid-prefill."""
        out = SchedulerOutput()
        scheduled: dict[int, ScheduledSeq] = {}  # id(seq) -> entry, in scheduling order
        budget = self.config.max_num_batched_tokens
        self._prompt_rows_left = MAX_PROMPT_LOGPROB_ROWS
        self._pooling_left = self._pooling_share(budget)
        budget = self._schedule_decodes(budget, scheduled, out)
        budget = self._schedule_prefills(budget, scheduled, out)
        budget = self._admit(budget, scheduled)
        self._extend_prefills(budget, scheduled)
        out.scheduled = list(scheduled.values())
        return out

    def _schedule_decodes(self, budget: int, scheduled: dict[int, ScheduledSeq], out: SchedulerOutput) -> int:
        """1. Each running decode, with its draft tokens (speculating) while budget and blocks
        allow: drafts never preempt anyone. Returns the budget left."""
        for seq in [s for s in self.running if not s.is_prefilling]:
            drafts, seq.spec_token_ids = seq.spec_token_ids[: max(0, budget - 1)], []
            if budget <= 0 or seq.status is not SequenceStatus.RUNNING:
                continue
            if drafts and self.block_manager.allocate_slots(seq, 1 + len(drafts)):
                scheduled[id(seq)] = ScheduledSeq(seq, seq.num_computed_tokens, 1 + len(drafts), drafts)
                budget -= 1 + len(drafts)
            else:
                budget = self._schedule_running(seq, 1, budget, scheduled, out)
        return budget

    def _schedule_prefills(self, budget: int, scheduled: dict[int, ScheduledSeq], out: SchedulerOutput) -> int:
        """2. Running partial prefills: short ones finish, long ones share what the short
        waiting prompts leave. Returns the budget left."""
        prefilling = [s for s in self.running if s.is_prefilling]
        reserve = self._short_waiting_reserve(budget // 2)
        for i, seq in enumerate(prefilling):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted above
            n = seq.num_uncomputed_tokens
            if self.is_long(seq):
                n = min(n, max(1, (budget - reserve) // (len(prefilling) - i)))
            n = self._cap_pooling(seq, min(n, budget))
            if n > 0:  # (a pooling request past its share waits a step)
                budget = self._schedule_running(seq, self._cap_prompt_rows(seq, n), budget, scheduled, out)
        return budget

    def _extend_prefills(self, budget: int, scheduled: dict[int, ScheduledSeq]) -> None:
        """4. What budget is left goes to the prompts still mid-prefill, in plan order, as
        far as free KV blocks allow."""
        for entry in scheduled.values():
            if budget <= 0:
                break
            seq = entry.seq
            left = seq.num_tokens - entry.end
            if left <= 0:
                continue  # a decode, or a prefill that finishes now
            extra = min(budget, left, self.block_manager.room(seq) - entry.num_new_tokens)
            if seq.wants_prompt_logprobs:
                extra = min(extra, self._prompt_rows_left)
                self._prompt_rows_left -= max(0, extra)
            extra = self._cap_pooling(seq, extra)
            if extra > 0 and self.block_manager.allocate_slots(seq, entry.num_new_tokens + extra):
                entry.num_new_tokens += extra
                budget -= extra

    def _schedule_running(self, seq: Sequence, n: int, budget: int, scheduled: dict[int, ScheduledSeq],
                          out: SchedulerOutput) -> int:
        """Plan `n` tokens of a running request, preempting the newest running requests for
        their blocks until they fit (or it is preempted itself). Returns the budget left."""
        while not self.block_manager.allocate_slots(seq, n):
            victim, freed = self._preempt_newest(scheduled, out)
            budget += freed
            if victim is seq:
                return budget
        scheduled[id(seq)] = ScheduledSeq(seq, seq.num_computed_tokens, n)
        return budget - n

    def _preempt_newest(self, scheduled: dict[int, ScheduledSeq], out: SchedulerOutput) -> tuple[Sequence, int]:
        """Preempt the `_victim`: its blocks and state freed, back to the front of the queue
        to be recomputed, out of the plan. Returns it and the tokens it had planned."""
        victim = self._victim()
        self.running.remove(victim)
        entry = scheduled.pop(id(victim), None)
        self.block_manager.free(victim)
        self._free_state(victim)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        return victim, entry.num_new_tokens if entry is not None else 0

    def _victim(self) -> Sequence:
        """The running request to preempt: the newest, or with generation_first the newest
        pooling request while there is one (an embedding's prefill never costs a chat its
        recomputation: it gives way, to wait for blocks)."""
        if self.config.generation_first:
            for seq in reversed(self.running):
                if seq.sampling_params.pooling is not None:
                    return seq
        return self.running[-1]

    def _short_waiting_reserve(self, limit: int, start: int = 0) -> int:
        """Tokens of the short waiting prompts (at most `long_prefill_token_threshold`)
        that could run whole this step, first come first served, up to `limit`: what
        a long prefill leaves for them. `start`: queue entries before it are being
        admitted (and take a sequence slot each)."""
        slots = self.config.max_num_seqs - len(self.running) - start
        reserve = n = 0
        for i in range(start, min(len(self.waiting), start + _LOOKAHEAD)):
            if n >= slots:
                break
            seq = self.waiting[i]
            if self.is_long(seq):
                continue
            if reserve + seq.num_uncomputed_tokens > limit:
                break
            reserve += seq.num_uncomputed_tokens
            n += 1
        return reserve

    def _admit(self, budget: int, scheduled: dict[int, ScheduledSeq]) -> int:
        """Admit waiting requests into the plan; returns the budget left."""
        cfg = self.config
        bm = self.block_manager
        # prompts left mid-prefill after this step (running ones not finishing now), counted
        # [all of them, generation requests only]: with generation_first, a pooling prefill
        # (at most its share of a step beside generation) holds no partial slot against a
        # generation request, else a long chat prompt would wait for a long embedding input
        # that its own arrival slowed down
        partial = [
            s for s in self.running
            if s.is_prefilling and (id(s) not in scheduled or scheduled[id(s)].end < s.num_tokens)
        ]
        generation_only = [s for s in partial if s.sampling_params.pooling is None]
        num_partial = [len(partial), len(generation_only)]
        num_long = [sum(1 for s in partial if self.is_long(s)), sum(1 for s in generation_only if self.is_long(s))]
        skipped: list[Sequence] = []
        slots = self.state_slots
        while (self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and len(skipped) < _LOOKAHEAD
               and (slots is None or slots.can_allocate())):
            seq = self.waiting[0]
            if seq.kv_loading:  # its prefix is on its way from disk (kv_tier.py): the ones behind it start
                skipped.append(self.waiting.popleft())
                continue
            # prompt logprobs need every prompt row forwarded: no prefix-cache hit (vLLM's rule)
            # (and pooling that reads every position: pooling.py)
            computed = [] if seq.wants_prompt_logprobs or seq.skip_prefix_cache else bm.get_computed_blocks(seq)
            remaining = seq.num_uncomputed_tokens - len(computed) * bm.block_size
            room = self._cap_pooling(seq, budget, take=False)  # a pooling request: its share of it
            if room <= 0:
                skipped.append(self.waiting.popleft())  # a pooling request past its share: the rest may start
                continue
            if remaining <= room and (not seq.wants_prompt_logprobs or remaining <= self._prompt_rows_left):
                n = remaining  # the whole prefill runs now: no partial slot needed
            else:
                long = self.is_long(seq)
                counted = 1 if cfg.generation_first and seq.sampling_params.pooling is None else 0
                if (num_partial[counted] >= cfg.max_num_partial_prefills
                        or (long and num_long[counted] >= cfg.max_long_partial_prefills)
                        or (seq.wants_prompt_logprobs and not self._prompt_rows_left)):
                    skipped.append(self.waiting.popleft())  # let a prompt behind it start
                    continue
                n = room
                if long:  # leave room for the short prompts behind it
                    n = max(1, room - self._short_waiting_reserve(room // 2, start=1))
                n = self._cap_prompt_rows(seq, n, take=False)
                for k in range(counted + 1):  # a generation request counts in both
                    num_partial[k] += 1
                    num_long[k] += long
            if not bm.allocate_slots(seq, n, computed):
                if self.running or not self._release_waiting_blocks(seq, skipped):
                    break
                continue  # the same head again, with the blocks given back
            self._cap_prompt_rows(seq, n)
            self._cap_pooling(seq, n)
            self.waiting.popleft()
            if slots is not None:
                slots.allocate(seq)
            if seq.num_preemptions == 0 and seq.index == 0:  # count each request's prefix lookup once
                seq.num_cached_tokens = len(computed) * bm.block_size
                bm.record_prefix_query(seq.num_tokens, seq.num_cached_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[id(seq)] = ScheduledSeq(seq, seq.num_computed_tokens, n)
            budget -= n
        for seq in reversed(skipped):
            self.waiting.appendleft(seq)
        return budget

    def _release_waiting_blocks(self, head: Sequence, skipped: list[Sequence]) -> bool:
        """Nothing runs and `head` does not fit: the only other blocks are held by waiting
        samples forked with their prompt's blocks (n > 1). Give them back (those samples
        recompute their prompt, or hit the prefix cache), so the queue cannot wedge.
        True if any block was freed."""
        freed = False
        for seq in [*skipped, *self.waiting]:
            if seq is not head and seq.block_table:
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                freed = True
        return freed

    def _pooling_share(self, budget: int) -> int:
        """Tokens the pooling requests (embeddings, scores) may take this step: beside
        generation requests, and for POOLING_LINGER_STEPS steps after the last one (a
        chat client's next request comes a moment after its last answer: it should not
        find a full-budget step in flight), at most `pooling_share` of the budget, so that
        an embedding load does not make every step of the chats beside it a full-budget
        prefill step; otherwise all of it. Called once a step."""
        share = self.config.pooling_share
        if share >= 1.0:
            return budget
        head = itertools.islice(self.waiting, _LOOKAHEAD)
        if any(s.sampling_params.pooling is None for s in itertools.chain(self.running, head)):
            self._steps_without_generation = 0
        else:
            self._steps_without_generation += 1
        if self._steps_without_generation <= POOLING_LINGER_STEPS:
            return max(1, int(budget * share))
        return budget

    def _cap_pooling(self, seq: Sequence, n: int, take: bool = True) -> int:
        """`n` cut to this step's pooling tokens left when `seq` is a pooling request (0:
        none left); `take`: count them as taken."""
        if seq.sampling_params.pooling is None:
            return n
        n = min(n, self._pooling_left)
        if take:
            self._pooling_left -= max(0, n)
        return n

    def _cap_prompt_rows(self, seq: Sequence, n: int, take: bool = True) -> int:
        """`n` cut to this step's prompt-logprob rows left when `seq` asks for them (at
        least 1, so it progresses); `take`: count them as taken."""
        if not seq.wants_prompt_logprobs:
            return n
        n = max(1, min(n, self._prompt_rows_left))
        if take:
            self._prompt_rows_left = max(0, self._prompt_rows_left - n)
        return n

    # -- after the forward ------------------------------------------------------------------
    def postprocess(self, plan: SchedulerOutput, sampled: dict[int, int | list[int]]) -> list[ScheduledSeq]:
        """Advance counters; append sampled tokens (`sampled[id(seq)]`: a token, or with
        drafts the kept ones: the accepted drafts and one more). K/V of rejected drafts is
        dropped: `num_computed_tokens` covers the kept tokens only, the prefix cache sees
        only them, and blocks past them are freed. Returns the entries that produced
        tokens. Stop checks are the engine's (it has the tokenizer)."""
        produced = []
        for entry in plan.scheduled:
            seq = entry.seq
            seq.num_forwarded_tokens += entry.num_new_tokens
            if not entry.sample or seq.sampling_params.pooling is not None:  # a pooling request samples nothing
                seq.num_computed_tokens = entry.end
                self.block_manager.cache_full_blocks(seq)
                continue
            kept = sampled[id(seq)]
            kept = [kept] if isinstance(kept, int) else list(kept)
            rejected = len(entry.spec_token_ids) - (len(kept) - 1)
            seq.num_computed_tokens = entry.end - rejected
            seq.token_ids += kept
            self.block_manager.cache_full_blocks(seq)
            if entry.spec_token_ids:
                self.block_manager.trim(seq, seq.num_tokens)
            produced.append(entry)
        return produced
