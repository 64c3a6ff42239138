"""N-gram prompt lookup (vLLM's `ngram` method): propose what followed the last n tokens
the previous time they occurred in the request's prompt or output.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens are looked
for earlier in the context; the longest n that occurs wins, at its latest occurrence, and
the (at most k) tokens that followed it there are the proposal (a source that runs into
the end of the context repeats: after "a b a b" comes "a b a b"). A request copying its
prompt (an edit, an answer quoting a document, JSON repeating a schema's keys) then
drafts whole runs of tokens, where plain chat finds few matches and drafts little.

One refinement over a fresh search each step: the place the last proposal came from is
remembered, and while the context keeps matching it (the request is copying), the next
proposal continues from there. A repeated phrase elsewhere (`return x` in code) would
otherwise send a search to its latest occurrence, not the one being copied.

Pure numpy on the host: a search is a few vectorised comparisons over the context, and
the context is kept per request as an int32 array appended to as tokens are accepted.
"""

from __future__ import annotations

import numpy as np

from cluster.worker.spec_decode.config import SpeculativeConfig
from cluster.worker.spec_decode.state import state_of


class _Context:
    """A request's tokens as an int32 array (grown by doubling), and where its last
    proposal came from."""

    __slots__ = ("buf", "size", "source", "proposed_at")

    def __init__(self):
        self.buf = np.empty(256, np.int32)
        self.size = 0
        self.source = -1  # index in the context of the last proposal's first token
        self.proposed_at = 0  # the context's length when it was proposed

    def sync(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if n < self.size:  # never happens to a live request (tokens only grow); start over
            self.size, self.source = 0, -1
        if n > self.buf.shape[0]:
            grown = np.empty(max(n, 2 * self.buf.shape[0]), np.int32)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        if n > self.size:
            self.buf[self.size : n] = tokens[self.size :]
            self.size = n
        return self.buf[:n]


class NgramProposer:
    free = True  # proposing costs nothing worth counting: propose first, let the policy trim

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, seq, k: int) -> list[int]:
        """Up to `k` draft tokens for `seq` (a running decode), or [] when nothing matches."""
        if k <= 0:
            return []
        spec = state_of(seq)
        state = spec.proposer
        if not isinstance(state, _Context):
            state = spec.proposer = _Context()
        ctx = state.sync(seq.token_ids)
        L = ctx.shape[0]
        start, n = self._continued(state, ctx), 0
        if start >= 0:
            spec.kind = "ngram-continued"
        else:
            start, n = find_match(ctx, self.min_n, self.max_n)
            spec.kind = f"ngram-{n}"
        state.source, state.proposed_at = start, L
        if start < 0:
            return []
        out = ctx[start : start + k].tolist()
        period = L - start
        while len(out) < k:  # the source runs into the suffix itself: what it copies repeats
            out.append(out[len(out) - period])
        return out

    def _continued(self, state: _Context, ctx: np.ndarray) -> int:
        """Where the last proposal's source continues, if the context still matches there."""
        if state.source < 0:
            return -1
        L, n = ctx.shape[0], self.min_n
        c = state.source + (L - state.proposed_at)
        if not n <= c < L or not np.array_equal(ctx[c - n : c], ctx[L - n :]):
            return -1
        return c


def find_match(ctx: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """(index of the token that followed the latest earlier occurrence of the context's
    longest suffix of min_n..max_n tokens, that length n), or (-1, 0): none occurs."""
    L = ctx.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # candidates i < L - n: ctx[i : i + n] == ctx[L - n :], with a token after it
        hits = ctx[: L - n] == ctx[L - n]
        for j in range(1, n):
            if not hits.any():
                break
            hits &= ctx[j : L - n + j] == ctx[L - n + j]
        found = np.flatnonzero(hits)
        if found.size:
            return int(found[-1]) + n, n
    return -1, 0
