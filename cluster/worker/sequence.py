"""A request's state inside the engine: plain counters, derived values as properties."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from cluster.formats.thinking import ThinkingTracker
    from cluster.worker.pooling import PoolState
    from cluster.worker.spec_decode.state import SpecState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Sequence:
    """Tokens `[0, num_computed_tokens)` have K/V in the pool; the rest are computed next.

    A step forwards positions `[num_computed_tokens, num_computed_tokens + n)`; when that
    reaches `num_tokens` the last row is sampled and one token is appended. Preemption
    resets `num_computed_tokens` to 0 and keeps every token: recompute, nothing lost.
    """

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission, for usage reports
    num_disk_tokens: int = 0  # of those, read back from the disk tier (worker/kv_tier.py)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks (kv/hashing.py)
    state_slot: int = -1  # a hybrid model's recurrent-state slot while running (state_slots.py)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    num_forwarded_tokens: int = 0  # all tokens ever forwarded (recompute included)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    matcher: LLMatcher | None = None  # over the output, for a structured output (structured.py)
    thinking: ThinkingTracker | None = None  # for a thinking budget
    forced: list[int] = field(default_factory=list)  # tokens the next steps must produce (a spent thinking budget)
    # n > 1: the request this sample belongs to and its index there (`request_id` is then
    # unique per sample: the request's own id for index 0)
    group_id: str = ""
    index: int = 0
    # prompt_logprobs: entry j is (token_ids[j + 1], its logprob, top [(id, logprob)]),
    # filled as prefill chunks are forwarded, handed out with the first output token
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    prompt_logprobs_sent: bool = False
    # a pooling request (sampling_params.pooling): what its chunks pooled so far, and whether
    # it must compute every position (no prefix-cache hit: pooling.py says why)
    pool_state: PoolState | None = None
    skip_prefix_cache: bool = False
    passed_by_generation: int = 0  # generation requests queued ahead of it (scheduler.py)
    # speculative decoding (spec_decode/): the draft tokens to verify in the next step (not
    # part of token_ids until kept), and the proposer's and policy's state for the request
    spec_token_ids: list[int] = field(default_factory=list)
    spec_state: SpecState | None = None
    # the disk tier (worker/kv_tier.py): its prefix is being read from disk (admission skips
    # it meanwhile), and the length it was last looked up at (not looked up again until it grows)
    kv_loading: bool = False
    kv_probed_len: int = 0

    def __post_init__(self):
        self.token_ids = list(self.token_ids)
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if not self.group_id:
            self.group_id = self.request_id
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None and self.index == 0:
            self.prompt_logprobs = []

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions whose logprobs are still to be computed (the prompt's last
        position predicts the first output token, which the sampler reports)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token to compute: a (re)prefill, possibly chunked."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
