"""Incremental, UTF-8-safe detokenization with stop strings.

Text is decoded from a short window of tokens (the last few already-emitted ones plus
the new ones) so each step costs O(1), and a delta ending in U+FFFD (a multi-byte
character split across tokens) is held back until the character completes. Text that
could still become a stop string is held back too, so a stop string is never streamed.
"""

from __future__ import annotations

# Tokens of context kept before the new ones: enough for tokenizers whose decode of a
# token depends on its left neighbours (SentencePiece spaces, byte fallback).
_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # all output text so far (truncated at a stop string)
        self.sent = 0  # characters of `text` already handed out
        self.stopped_on: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Feed one token. Returns the stop string if the text now contains one."""
        if self.stopped_on is not None:
            return self.stopped_on
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        # A character split across tokens decodes to U+FFFD until it completes; a UTF-8
        # character spans at most 4 byte tokens, so past that the bytes are just invalid.
        pending = len(self.ids) - self.read_offset
        if len(full) > len(prefix) and (not full.endswith("\ufffd") or pending >= 4):
            before = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if len(self.ids) > 4 * _CONTEXT:  # keep the window short
                drop = self.prefix_offset
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            if self.stop:
                return self._find_stop(before)
        return None

    def _find_stop(self, before: int) -> str | None:
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped_on = best[1]
        return self.stopped_on

    def _holdback(self) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        if self.stopped_on is not None or not self.stop:
            return 0
        n = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), n, -1):
                if self.text.endswith(s[:k]):
                    n = k
                    break
        return n

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out; at the end (`final`) nothing is held back."""
        if final and self.stopped_on is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.ids)
        end = len(self.text) if final else len(self.text) - self._holdback()
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
