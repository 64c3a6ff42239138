"""What speculative decoding keeps per request, on `Sequence.spec_state`."""

from __future__ import annotations

_PRIOR_WEIGHT = 2.0  # the proposal kind's engine-wide rate counts as this many of a request's drafts
_DECAY = 0.8  # weight of a request's history at each of its verify rounds


class SpecState:
    __slots__ = ("accepted", "scored", "kind", "proposer")

    def __init__(self):
        # a moving sum of accepted drafts, and of drafts whose fate was decided
        self.accepted = 0.0
        self.scored = 0.0
        self.kind = ""  # what kind of proposal the last drafts were (the policy's rates are by kind)
        self.proposer: object | None = None  # the proposer's own per-request state

    def rate(self, prior: float) -> float:
        """The chance a draft is accepted given that the drafts before it were: the
        request's own record, starting from `prior` (its proposal kind's engine-wide rate)."""
        return (self.accepted + prior * _PRIOR_WEIGHT) / (self.scored + _PRIOR_WEIGHT)

    def record(self, accepted: int, scored: int) -> None:
        self.accepted = _DECAY * self.accepted + accepted
        self.scored = _DECAY * self.scored + scored


def state_of(seq) -> SpecState:
    state = seq.spec_state
    if state is None:
        state = seq.spec_state = SpecState()
    return state
