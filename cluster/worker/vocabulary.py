"""A tokenizer's vocabulary id by id: each token's bytes and whether it is special.

The grammar engine (llguidance) masks logits by token id, so its view of the vocabulary
must equal the tokenizer's for every id. Handing llguidance the tokenizer's JSON does not
give that: it numbers added tokens as if they followed the base vocabulary in list order,
which real layouts break (Qwen: BPE, then special added tokens, then ordinary added ones
such as <tool_call>; Tekken, DeepSeek: control tokens at ids 0..). So the vocabulary is
read here, id by id, from the tokenizer itself, and handed over as a token list.

How a base token's string becomes bytes depends on the tokenizer's model:
- byte-level BPE (GPT-2's alphabet: Qwen, Llama 3, Tekken, gpt-oss, DeepSeek): each
  character stands for one byte;
- SentencePiece-style (Metaspace / byte fallback: Gemma, Llama 2, Mistral v1): "▁" is a
  space and <0xNN> is the byte NN.
Added tokens are their content's UTF-8; their `special` flag says which are special.
Ids past the tokenizer's size (a model's embedding padded to a round number) are empty.
"""

from __future__ import annotations

import json
import re
from typing import Callable

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE: each byte as the printable character a vocabulary uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def _piece_decoder(spec: dict) -> Callable[[str], bytes]:
    """How one base-vocabulary piece of the tokenizer described by `spec` (its JSON) becomes bytes."""
    shape = json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")], ensure_ascii=False)
    if "ByteLevel" in shape:
        to_byte = {c: b for b, c in byte_level_alphabet().items()}

        def byte_level(piece: str) -> bytes:
            if all(c in to_byte for c in piece):
                return bytes(to_byte[c] for c in piece)
            return piece.encode()

        return byte_level
    byte_fallback = bool((spec.get("model") or {}).get("byte_fallback")) or "ByteFallback" in shape
    metaspace = "Metaspace" in shape or "\u2581" in shape  # a Metaspace step, or a decoder's Replace("▁", " ")

    def sentencepiece(piece: str) -> bytes:
        if byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        return (piece.replace("\u2581", " ") if metaspace else piece).encode()

    return sentencepiece


class Vocabulary:
    """The tokenizer (a transformers fast tokenizer, or the `tokenizers.Tokenizer` inside one)
    id by id, in the shape llguidance's `TokenizerWrapper` reads: `tokens`
    (bytes per id, `vocab_size` of them), `special_token_ids`, `eos_token_id`,
    `bos_token_id`, and a call that tokenizes text as the model's tokenizer does."""

    def __init__(self, hf, vocab_size: int, eos_token_id: int | None = None):
        backend = getattr(hf, "backend_tokenizer", None) or (hf if hasattr(hf, "get_added_tokens_decoder") else None)
        if backend is None:
            raise ValueError("structured outputs need a fast (Rust `tokenizers`) tokenizer; this model's is "
                             f"{type(hf).__name__}")
        decode = _piece_decoder(json.loads(backend.to_str()))
        added = backend.get_added_tokens_decoder()
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(vocab_size):
            if i in added:
                self.tokens.append(added[i].content.encode())
                if added[i].special:
                    self.special_token_ids.append(i)
            else:
                piece = backend.id_to_token(i)
                self.tokens.append(b"" if piece is None else decode(piece))
        self.eos_token_id = getattr(hf, "eos_token_id", None) if eos_token_id is None else eos_token_id
        if self.eos_token_id is None:  # llguidance would add a token of its own for it
            raise ValueError("structured outputs need the model's end-of-sequence token: none is configured")
        self.bos_token_id = getattr(hf, "bos_token_id", None)
        self._backend = backend

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes for bytes; text is all it gets here
            raise TypeError("text, not bytes")
        return self._backend.encode(text, add_special_tokens=False).ids


def lltokenizer(hf, vocab_size: int, eos_token_ids=None):
    """llguidance's tokenizer for `hf` (a transformers fast tokenizer), `vocab_size` ids."""
    import llguidance

    eos = list(eos_token_ids or ())
    vocabulary = Vocabulary(hf, vocab_size, eos[0] if eos else None)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), n_vocab=vocab_size, eos_token=eos or None)
