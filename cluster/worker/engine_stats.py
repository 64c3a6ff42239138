"""The engine's counters, for metrics and load reports."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.api.buckets import KV_USAGE_BUCKETS

if TYPE_CHECKING:
    from cluster.worker.kv_tier import KvTier
    from cluster.worker.spec_decode.speculator import SpecStats


# A step counts towards the prefill rate when it computed at least this many prompt tokens
# and they were most of its rows; the newest such step's weight in the moving average.
PREFILL_MIN_TOKENS = 32
PREFILL_RATE_WEIGHT = 0.2


@dataclass
class EngineStats:
    """Counters for metrics and load reports (read from any thread: plain ints)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    state_slots_used: int = 0  # a hybrid model's recurrent-state slots (0 / 0 otherwise)
    state_slots_total: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_steps: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    finished: dict = field(default_factory=dict)
    # Each step's KV usage (blocks held once the step is scheduled / total), counted into
    # KV_USAGE_BUCKETS: a load's peak from every step, not from when a scraper looked.
    kv_usage_step_counts: list = field(default_factory=lambda: [0] * len(KV_USAGE_BUCKETS))
    kv_usage_step_sum: float = 0.0
    spec_decode: SpecStats | None = None  # when speculating (vLLM's counters)
    kv_tier: KvTier | None = None  # with a disk tier (--kv-disk-dir): its `stats` and `counters()`
    # What placing a prompt here costs (the router's kv_aware policy): the prefill rate, a
    # moving average over steps that were mostly prefill, and the prompt tokens still to
    # compute (waiting, reading from disk or mid-prefill)
    prefill_tokens_per_second: float = 0.0
    queued_prefill_tokens: int = 0

    def refresh(self, scheduler, state_slots) -> None:
        """The queue and KV counts, from the engine's scheduler after a step."""
        bm = scheduler.block_manager
        self.num_running = len(scheduler.running)
        self.num_waiting = len(scheduler.waiting)
        self.num_blocks_used = bm.num_used_blocks
        if state_slots is not None:
            self.state_slots_used = state_slots.num_used
        self.num_preemptions = scheduler.num_preemptions
        self.prefix_queries = bm.prefix_queries
        self.prefix_hits = bm.prefix_hits
        self.queued_prefill_tokens = (sum(q.num_uncomputed_tokens for q in scheduler.waiting)
                                      + sum(q.num_uncomputed_tokens for q in scheduler.running if q.is_prefilling))

    def observe_step(self, plan, seconds: float) -> None:
        """A finished step (its `SchedulerOutput`) that took `seconds`; one that was mostly
        prefill rows updates the prefill rate."""
        self.num_steps += 1
        self.step_seconds += seconds
        prefill = sum(e.num_new_tokens for e in plan.scheduled if e.num_new_tokens > 1 + len(e.spec_token_ids))
        if 2 * prefill > plan.num_batched_tokens:
            self.observe_prefill(prefill, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step that computed `tokens` prompt tokens (most of its rows) in `seconds`."""
        if tokens < PREFILL_MIN_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_second
        self.prefill_tokens_per_second = rate if not old else old + PREFILL_RATE_WEIGHT * (rate - old)

    def observe_kv_usage(self, usage: float) -> None:
        self.kv_usage_step_counts[bisect.bisect_left(KV_USAGE_BUCKETS, usage)] += 1
        self.kv_usage_step_sum += usage
