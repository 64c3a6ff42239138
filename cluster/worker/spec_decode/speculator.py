"""The engine's one handle on speculative decoding: propose before the plan, count after.

Each step, before the scheduler plans it, `propose` gives every running decode that
speculates its draft tokens (`Sequence.spec_token_ids`): at most k, never past its
max_tokens or max_model_len, only a prefix its grammar accepts (structured outputs), and
as many as the policy says pay at this batch size (`policy.py`). The scheduler turns a
decode with drafts into one entry of 1 + k rows (or 1 when the budget or the blocks
fall short: drafts never preempt anyone); the runner sends all 1 + k rows to the LM head;
the engine samples each row as a plain decode would and keeps the drafts that match
(`verify.accept_drafts`); the scheduler rolls `num_computed_tokens` back to the kept
tokens and frees the blocks past them; `step_done` counts drafts and acceptances
(`record`: vLLM's metrics, and the policy's acceptance rates) and the step's cost (the
policy's step times, and its wall-clock trial).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.worker.sequence import Sequence, SequenceStatus
from cluster.worker.spec_decode.config import SpeculativeConfig
from cluster.worker.spec_decode.ngram import NgramProposer
from cluster.worker.spec_decode.policy import SpecPolicy, cost_clock

if TYPE_CHECKING:
    from cluster.worker.scheduler import ScheduledSeq, Scheduler

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """vLLM's spec-decode counters (read by the metrics from any thread: plain ints)."""

    num_drafts: int = 0  # verify rounds: requests that scored at least one draft in a step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)  # [j]: drafts accepted at position j


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer=None, policy: SpecPolicy | None = None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = 0  # attach()
        self.proposer = proposer if proposer is not None else NgramProposer(config)
        self.policy = policy if policy is not None else SpecPolicy(self.k)
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self.clock = cost_clock()  # what the engine reads a step's cost with, for the policy
        self._step_start = 0.0  # `clock` when the step's forward began

    def kv_bytes_per_block(self, block_size: int, kv_dtype) -> int:
        """What the proposer adds to each KV block (a draft model's own pool)."""
        per_block = getattr(self.proposer, "kv_bytes_per_block", None)
        return per_block(block_size, kv_dtype) if per_block is not None else 0

    def attach(self, config, block_manager, kv_dtype=None) -> None:
        """Once the engine has its resolved config and block manager."""
        self.max_model_len = config.max_model_len
        if hasattr(self.proposer, "attach"):
            self.proposer.attach(block_manager, config.max_num_batched_tokens, kv_dtype)

    @staticmethod
    def speculates(seq: Sequence) -> bool:
        """Per request: `speculative` False turns it off; None (unset) or True: on. Not for a
        thinking with a budget: the engine forces its end marker a token a step."""
        params = seq.sampling_params
        budget = params.thinking is not None and params.thinking.budget is not None
        return params.speculative is not False and params.pooling is None and not budget

    def room(self, seq: Sequence) -> int:
        """Drafts `seq` may score now: k, less what would pass its max_tokens (the one more
        token every step gives counts) or max_model_len."""
        params = seq.sampling_params
        return max(0, min(self.k, params.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens - 1))

    def propose(self, running: list[Sequence], num_rows: int) -> tuple[int, bool] | None:
        """Set `spec_token_ids` on the running decodes (empty on everyone else). `num_rows`:
        the step's rows without drafts, as far as the caller can tell (decodes and the
        prefill chunks that will run beside them). Returns the step's lot in the policy's
        wall-clock trial (None when it is not in it), for `observe_step`."""
        decodes, decode_rows = [], 0
        for seq in running:
            seq.spec_token_ids = []
            if seq.status is SequenceStatus.RUNNING and not seq.is_prefilling:
                decode_rows += 1
                if self.speculates(seq):
                    decodes.append(seq)
        if not decodes:
            return None
        rooms = [self.room(seq) for seq in decodes]
        if getattr(self.proposer, "free", False):  # propose first; the policy keeps what pays
            drafts = [self._drafts(seq, k) for seq, k in zip(decodes, rooms)]
            limits = self.policy.limits(decodes, [len(d) for d in drafts], num_rows, decode_rows)
            for seq, d, k in zip(decodes, drafts, limits):
                seq.spec_token_ids = d[:k]
        else:  # a draft model's drafts cost its forwards: decide how many first
            self.policy.draft_seconds_per_row = self.proposer.seconds_per_row()
            limits = [min(a, b) for a, b in zip(self.policy.limits(decodes, rooms, num_rows, decode_rows), rooms)]
            for seq, d in zip(decodes, self.proposer.propose_batch(decodes, limits, len(running))):
                seq.spec_token_ids = self._grammar_prefix(seq, d)
        return self.policy.arm

    def _drafts(self, seq: Sequence, k: int) -> list[int]:
        return self._grammar_prefix(seq, self.proposer.propose(seq, k)) if k > 0 else []

    @staticmethod
    def _grammar_prefix(seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts a structured output's grammar accepts (the rest could never be kept)."""
        if drafts and seq.matcher is not None:
            return drafts[: seq.matcher.validate_tokens(drafts)]
        return drafts

    def record(self, drafts: list[int], kept: list[int], seq: Sequence) -> None:
        """After verification: `kept` (accepted drafts + one more) for `drafts`."""
        if not drafts:
            return
        accepted = len(kept) - 1
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += accepted
        for j in range(accepted):
            s.accepted_per_pos[j] += 1
        self.policy.record(seq, len(drafts), accepted)

    def observe_step(self, seconds: float, num_rows: int, arm: tuple[int, bool] | None = None, tokens: int = 0,
                     wall_seconds: float = 0.0) -> None:
        """A step done: its cost in seconds of `clock`, its rows, and for one in the policy's
        wall-clock trial (`arm`, from `propose`), its output tokens and wall time."""
        self.policy.observe_step(seconds, num_rows, arm, tokens, wall_seconds)

    # -- around the engine's step ------------------------------------------------------
    def forward_started(self) -> None:
        """The step's forward begins: its cost is read from here to `step_done`."""
        self._step_start = self.clock()

    def step_done(self, sampling: list[ScheduledSeq], kept: dict[int, list[int]], num_rows: int,
                  wall_trial: tuple[int, bool] | None, wall_seconds: float) -> None:
        """After verification: `kept[id(seq)]`, the tokens each of the step's sampled
        entries keeps; `num_rows`, the step's rows; `wall_trial`, its lot from `propose`;
        `wall_seconds`, its wall time from before it was planned."""
        for e in sampling:
            self.record(e.spec_token_ids, kept[id(e.seq)], e.seq)
        self.observe_step(self.clock() - self._step_start, num_rows, wall_trial,
                          sum(len(t) for t in kept.values()), wall_seconds)


def next_step_rows(scheduler: Scheduler, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The next step's rows before drafts, for `Speculator.propose`: its decodes, and the
    prefill tokens that will run beside them as far as the budget allows."""
    decodes = sum(1 for q in scheduler.running if not q.is_prefilling)
    pending = sum(q.num_uncomputed_tokens for q in scheduler.running if q.is_prefilling)
    if len(scheduler.running) < max_num_seqs:
        pending += sum(q.num_uncomputed_tokens for q in itertools.islice(scheduler.waiting, 8))
    return decodes + min(pending, max(0, max_num_batched_tokens - decodes))
