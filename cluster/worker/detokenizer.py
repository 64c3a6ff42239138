"""Incremental, UTF-8-safe detokenization with stop strings.

Text is decoded from a short window of tokens (the last few already-emitted ones plus
the new ones) so each step costs O(1), and a delta ending in U+FFFD (a multi-byte
character split across tokens) is held back until the character completes. Text that
could still become a stop string is held back too, so a stop string is never streamed.

Each token costs O(new text + the longest stop string), never O(the text so far): only
the text not yet handed out and the last few characters (as many as the longest stop
string can need) are kept; a request limits its stop strings' number and length
(cluster/api/wire.py), so a long generation cannot slow the engine step down.
"""

from __future__ import annotations

# Tokens of context kept before the new ones: enough for tokenizers whose decode of a
# token depends on its left neighbours (SentencePiece spaces, byte fallback).
_CONTEXT = 5


def decode_keeping(tokenizer, ids: list[int], kept: frozenset[int] = frozenset(),
                   skip_special_tokens: bool = True) -> str:
    """`ids` as text, special tokens skipped except those in `kept` (a family's thinking
    and tool-call markers, which its parsers read), spelled as their text."""
    if not kept or kept.isdisjoint(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    parts, run = [], []
    for t in ids:
        if t in kept:
            if run:
                parts.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            parts.append(tokenizer.decode([t], skip_special_tokens=False))
        else:
            run.append(t)
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
    return "".join(parts)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, kept_special: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(stop)
        self._longest = max((len(x) for x in self.stop), default=0)
        self.skip_special_tokens = skip_special_tokens
        self.kept_special = kept_special  # special tokens whose text is kept (a family's markers)
        self.unsent = ""  # output text not handed out yet (truncated at a stop string)
        self.tail = ""  # the last characters of all output text: where a stop string may begin
        self.stopped_on: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return decode_keeping(self.tokenizer, ids, self.kept_special, self.skip_special_tokens)

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
            self._append(full[len(prefix) :])
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if len(self.ids) > 4 * _CONTEXT:  # keep the window short
                drop = self.prefix_offset
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            return self.stopped_on
        return None

    def _append(self, delta: str) -> None:
        """Add new text; cut it at the first stop string that now appears."""
        if not self.stop:
            self.unsent += delta
            return
        # a stop string ending in `delta` starts at most longest - 1 characters before it
        window = self.tail + delta
        base = len(self.tail)  # window[base:] is `delta`
        best = None
        for s in self.stop:
            i = window.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            self.unsent += delta
            self.tail = window[-(self._longest - 1):] if self._longest > 1 else ""
            return
        i, s = best
        cut = i - base  # characters of `delta` before the stop string (negative: it began earlier)
        if cut >= 0:
            self.unsent += delta[:cut]
        else:  # held back, never handed out: drop the part of the stop string already there
            self.unsent = self.unsent[: len(self.unsent) + cut]
        self.stopped_on = s

    def _holdback(self) -> int:
        """Length of the longest end of the text that begins some stop string (held back)."""
        if self.stopped_on is not None or not self.stop:
            return 0
        n = 0
        tail = self.tail
        for s in self.stop:
            # candidates start where s's first character does, within the last len(s) - 1
            lo = max(0, len(tail) - len(s) + 1)
            i = tail.find(s[0], lo)
            while i >= 0 and len(tail) - i > n:
                if s.startswith(tail[i:]):
                    n = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return min(n, len(self.unsent))

    def take_delta(self, final: bool = False) -> str:
        """Text not yet handed out; at the end (`final`) nothing is held back."""
        if final and self.stopped_on is None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.unsent += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.ids)
        end = len(self.unsent) if final else len(self.unsent) - self._holdback()
        if end <= 0:
            return ""
        delta, self.unsent = self.unsent[:end], self.unsent[end:]
        return delta


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_LEVEL = _byte_level_decoder()


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """A token's own bytes, from its vocabulary entry: a byte-level BPE piece or a
    SentencePiece byte fallback (<0xE2>); None when neither."""
    try:
        piece = tokenizer.convert_ids_to_tokens(token_id)
    except Exception:
        return None
    if not isinstance(piece, str) or not piece:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None
