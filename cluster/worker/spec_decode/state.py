"""What speculative decoding keeps per request, on `Sequence.spec_state`."""

from __future__ import annotations

_PRIOR_WEIGHT = 2.0  # the engine-wide rate counts as this many verify rounds for a new request
_DECAY = 0.8  # weight of a request's history at each of its verify rounds


class SpecState:
    __slots__ = ("accepted", "scored", "proposer")

    def __init__(self, prior_rate: float):
        # acceptance: a moving sum of accepted drafts over drafts whose fate was decided
        self.accepted = prior_rate * _PRIOR_WEIGHT
        self.scored = _PRIOR_WEIGHT
        self.proposer: object | None = None  # the proposer's own per-request state

    @property
    def rate(self) -> float:
        """The chance a draft is accepted given that the drafts before it were."""
        return self.accepted / self.scored

    def record(self, accepted: int, scored: int) -> None:
        self.accepted = _DECAY * self.accepted + accepted
        self.scored = _DECAY * self.scored + scored


def state_of(seq, prior_rate: float = 0.6) -> SpecState:
    state = seq.spec_state
    if state is None:
        state = seq.spec_state = SpecState(prior_rate)
    return state
