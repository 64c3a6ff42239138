"""The engine's counters, for metrics and load reports."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.api.buckets import KV_USAGE_BUCKETS

if TYPE_CHECKING:
    from cluster.worker.spec_decode.speculator import SpecStats


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

    def observe_kv_usage(self, usage: float) -> None:
        self.kv_usage_step_counts[bisect.bisect_left(KV_USAGE_BUCKETS, usage)] += 1
        self.kv_usage_step_sum += usage
