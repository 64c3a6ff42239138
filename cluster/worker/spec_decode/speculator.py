"""The engine's one handle on speculative decoding: propose before the plan, count after.

Each step, before the scheduler plans it, `propose` gives every running decode that
speculates its draft tokens (`Sequence.spec_token_ids`): at most k, never past its
max_tokens or max_model_len, only a prefix its grammar accepts (structured outputs), and
as many as the policy says pay at this batch size (`policy.py`). The scheduler turns a
decode with drafts into one entry of 1 + k rows (or 1 when the budget or the blocks
fall short: drafts never preempt anyone); the runner sends all 1 + k rows to the LM head;
the engine samples each row as a plain decode would and keeps the drafts that match
(`verify.accept_drafts`); the scheduler rolls `num_computed_tokens` back to the kept
tokens and frees the blocks past them; `record` counts drafts and acceptances (vLLM's
metrics) and feeds the policy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cluster.worker.sequence import Sequence, SequenceStatus
from cluster.worker.spec_decode.config import SpeculativeConfig
from cluster.worker.spec_decode.ngram import NgramProposer
from cluster.worker.spec_decode.policy import SpecPolicy, cost_clock

log = logging.getLogger(__name__)
# The step sizes the worker measures at start (warm-up): the policy interpolates between
# them. With each power of two, the count just past it (9, 17, 33), where a kernel's tiling
# adds a tile and the cost jumps (`policy.GRID`): interpolating 16 -> 24 rows put one draft
# beside 16 decodes at +6% of the step where it costs +39%.
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64, 96, 128)


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

    def calibrate(self, time_rows, max_rows: int) -> None:
        """Measure steps of 1 .. `max_rows` rows (`time_rows(rows)` -> seconds of `clock`;
        the best of three each) for the policy's table, before the first request."""
        for rows in CALIBRATION_ROWS:
            if rows <= max_rows:
                self.policy.times.observe(rows, min(time_rows(rows) for _ in range(3)))

    def observe_step(self, seconds: float, num_rows: int, arm: tuple[int, bool] | None = None, tokens: int = 0,
                     wall_seconds: float = 0.0) -> None:
        """A step done: its cost in seconds of `clock`, its rows, and for one in the policy's
        wall-clock trial (`arm`, from `propose`), its output tokens and wall time."""
        self.policy.observe_step(seconds, num_rows, arm, tokens, wall_seconds)
