"""A thinking budget inside the engine: each sample's thinking followed token by token
(`ThinkingTracker`, formats/thinking.py) and, once its budget is spent, its end marker's
tokens forced, one a step (`Sequence.forced`; the answer then follows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.formats.thinking import ThinkingTracker

if TYPE_CHECKING:
    from cluster.worker.sequence import Sequence


class ThinkingBudgets:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._piece_texts: dict[int, str] = {}  # token id -> its text, special tokens spelled (the markers)

    def start(self, seq: Sequence, resume_token_ids=()) -> None:
        """Follow a new sample's thinking from its prompt (a resumed request: through the
        tokens generated before); a budget of 0 in a thinking the prompt opened ends at once."""
        seq.thinking = ThinkingTracker(seq.sampling_params.thinking, self._piece_text)
        for t in resume_token_ids:
            self.follow(seq, int(t))
        _end_if_spent(seq)

    def follow(self, seq: Sequence, token: int) -> None:
        """The thinking after `token`, a token `seq` produced."""
        if seq.forced and seq.forced[0] == token:
            seq.forced.pop(0)
        seq.thinking.add(token)
        _end_if_spent(seq)

    def _piece_text(self, token_id: int) -> str:
        text = self._piece_texts.get(token_id)
        if text is None:
            text = self._piece_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _end_if_spent(seq: Sequence) -> None:
    if seq.thinking.must_end and not seq.forced:
        seq.forced = list(seq.sampling_params.thinking.end_ids)
