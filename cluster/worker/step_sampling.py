"""A step's sample / verify: the tokens each sampled entry keeps, from the step's logits.

`sample` draws every sampled row: one per entry, or 1 + k for an entry with k drafts, row
j as a plain decode would sample it after the entry's first j drafts (its penalties'
history, its grammar's state, its seed's noise for that output index). `verify` then keeps
each entry's drafts as far as they match what plain decoding would have produced
(spec_decode/verify.py), and one more token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from cluster.worker.spec_decode.verify import accept_drafts, verify_sampled_drafts
from cluster.worker.structured import allocate_bitmask, fill_bitmasks

if TYPE_CHECKING:
    from cluster.worker.sampler import Sampler, SampleResult
    from cluster.worker.scheduler import ScheduledSeq
    from cluster.worker.sequence import Sequence


@dataclass
class KeptTokens:
    """By `id(seq)`, what each sampled entry keeps: its tokens (its accepted drafts and one
    more), and their logprobs and top logprobs (None when the request does not ask)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, tuple[list | None, list | None]] = field(default_factory=dict)

    def of(self, seq: Sequence) -> tuple[list[int], list | None, list | None]:
        return self.tokens[id(seq)], *self.logprobs[id(seq)]


def history(entry: ScheduledSeq, j: int) -> tuple[list[int], int]:
    """The penalties' history of an entry's sampled row j: its tokens, then its first j drafts."""
    seq = entry.seq
    if j and seq.sampling_params.processes_logits:
        return seq.token_ids + entry.spec_token_ids[:j], seq.num_prompt_tokens
    return seq.token_ids, seq.num_prompt_tokens


def sample(sampler: Sampler, sampling: list[ScheduledSeq], logits: mx.array) -> SampleResult:
    """Sample every sampled row of `sampling` (the step's sampled entries, in order)."""
    rows = [(e, j) for e in sampling for j in range(1 + len(e.spec_token_ids))]
    masked = [i for i, (e, _) in enumerate(rows) if e.seq.matcher is not None or e.seq.forced]
    bitmask = None
    if masked:  # the grammar masks, on this thread, while MLX runs the forward
        mx.async_eval(logits)
        bitmask = masks([e for e in sampling if e.seq.matcher is not None or e.seq.forced], logits.shape[1])

    return sampler(
        logits, [e.seq.sampling_params for e, _ in rows], [e.seq.num_output_tokens + j for e, j in rows],
        [history(e, j) for e, j in rows], bitmask, masked,
    )


def masks(entries: list[ScheduledSeq], vocab_size: int) -> np.ndarray:
    """The allowed-token bitmask rows of `entries` (scheduled, in order): a grammar's
    (1 + drafts rows), or one row with only the token the entry is forced to (a spent
    thinking budget's end marker; such an entry has no drafts). A grammar that cannot
    take the forced token yet (the thinking's last token left a character's bytes
    unfinished) has its way until it can: at most three more tokens."""
    forced = [bool(e.seq.forced) and not e.spec_token_ids and
              (e.seq.matcher is None or e.seq.matcher.validate_tokens([e.seq.forced[0]]) == 1) for e in entries]
    grammar = [e for e, f in zip(entries, forced) if not f]
    rows = fill_bitmasks([e.seq.matcher for e in grammar], vocab_size,
                         [e.spec_token_ids for e in grammar]) if grammar else None
    if not any(forced):
        return rows
    blocks, k = [], 0
    for e, f in zip(entries, forced):
        if f:
            row = allocate_bitmask(1, vocab_size)
            row[:] = 0
            t = e.seq.forced[0]
            row.view(np.uint32)[0, t // 32] = np.uint32(1 << (t % 32))
            blocks.append(row)
        else:
            n = 1 + len(e.spec_token_ids)
            blocks.append(rows[k:k + n])
            k += n
    return np.concatenate(blocks)


def verify(sampling: list[ScheduledSeq], logits: mx.array, drawn: SampleResult) -> KeptTokens:
    """The tokens each entry of `sampling` keeps, from its rows of `logits` and `drawn`
    (what `sample` drew for them)."""
    kept = KeptTokens()
    row = 0
    for e in sampling:
        n = 1 + len(e.spec_token_ids)
        q = _draft_probs(e.seq)
        if q is not None and e.spec_token_ids:  # drafts drawn from the draft model's q
            tokens, lps = verify_sampled_drafts(logits[row : row + n], e.seq.sampling_params,
                                                [history(e, j) for j in range(n)], e.spec_token_ids, q[: n - 1])
        else:
            tokens = accept_drafts(e.spec_token_ids, drawn.token_ids[row : row + n])
            lps = drawn.logprobs[row : row + len(tokens)] if drawn.logprobs is not None else None
        kept.tokens[id(e.seq)] = tokens
        kept.logprobs[id(e.seq)] = (lps, drawn.top_logprobs[row : row + len(tokens)])
        row += n
    return kept


def _draft_probs(seq: Sequence) -> np.ndarray | None:
    """The distributions [k, V] a draft model sampled this step's drafts of `seq` from
    (None: point-mass drafts)."""
    return getattr(getattr(seq.spec_state, "proposer", None), "probs", None)
