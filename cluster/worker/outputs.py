"""What a step gives back for each request it moved (`RequestOutput`), built from the
request's sample after the stop checks: its new tokens and text, how it finished, its
logprobs when asked, and with its first token its prompt logprobs; or a pooling
request's vector or score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cluster.worker.detokenizer import IncrementalDetokenizer
    from cluster.worker.sequence import Sequence
    from cluster.worker.stop_checks import StopVerdict


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str  # the request's (its n samples share it; `index` tells them apart)
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None  # of new_token_ids, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_cached_tokens_disk: int = 0  # of those, read back from the disk tier
    index: int = 0  # which of the request's n samples
    # with the first token, when asked: for each prompt token after the first, (its id,
    # its logprob given the tokens before it, the top alternatives [(id, logprob)])
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # a pooling request's result, with its finish: the embedding (float32 [dimensions]) or
    # the score ([1]); no tokens
    pooled: np.ndarray | None = None
    # set when the request ended ("abort") for what it asked: its structured output could not
    # go on (the grammar ran past the constrained decoder's limits). The client's error.
    error: str | None = None


def token_output(seq: Sequence, detok: IncrementalDetokenizer, tokens: list[int], verdict: StopVerdict,
                 logprobs: list[float] | None, top_logprobs: list | None) -> RequestOutput:
    """The output of a step that appended `tokens` to `seq`, of which the stop checks kept
    `verdict.kept`; `logprobs`, `top_logprobs`: the tokens', when the request asks."""
    kept = verdict.kept
    out = RequestOutput(
        request_id=seq.group_id,
        index=seq.index,
        new_token_ids=list(tokens[:kept]),
        new_text=detok.take_delta(final=verdict.status is not None),
        finished=verdict.status is not None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.num_cached_tokens,
        num_cached_tokens_disk=seq.num_disk_tokens,
        error=verdict.error,
    )
    if seq.sampling_params.logprobs is not None:
        out.logprobs = list(logprobs[:kept])
        out.top_logprobs = [t or [] for t in top_logprobs[:kept]]
    if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
        out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
    return out


def pooled_output(seq: Sequence, pooled: np.ndarray) -> RequestOutput:
    """A pooling request's finish: its vector or score, no tokens."""
    return RequestOutput(request_id=seq.group_id, new_token_ids=[], new_text="", finished=True, finish_reason="stop",
                         num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                         pooled=pooled)
