"""What a benchmark sends: a list of `SampleRequest`s.

Prompts are built as token ids. Over gRPC they go as ids, so the server sees exactly the
lengths asked for. Over HTTP they go as text: ids are decoded and the text re-encoded and
trimmed until its length matches (as close as the tokenizer allows); the server's usage
report gives the exact count afterwards.

- random: input and output lengths drawn uniformly in [len * (1 - r), len * (1 + r)]
- prefix-repetition: `num_prefixes` groups; every prompt of a group starts with the same
  prefix, followed by its own random suffix (exercises the prefix cache and affinity)
- text-slices: slices of a local text file at random offsets, an optional shared prefix
  taken from the start of the file
- custom: JSONL, one object per line: {"prompt": "text" | [ids]} or {"messages": [...]},
  optional "output_tokens"
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

DATASETS = ("random", "prefix-repetition", "text-slices", "custom")


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int] | None  # text or token ids; None when `messages` is set
    prompt_len: int  # tokens, as far as the client can tell (the server's usage is exact)
    output_len: int
    messages: tuple[tuple[str, str], ...] | None = None  # chat (role, content) pairs


class Tokenizer:
    """The few things a dataset needs from a tokenizer: encode, decode, ids to draw from."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if (path / "tokenizer.json").exists():
            from tokenizers import Tokenizer as _Fast

            self._tok = _Fast.from_file(str(path / "tokenizer.json"))
            self.vocab_size = self._tok.get_vocab_size()
            special = set(self._tok.get_added_tokens_decoder())
            self._encode = lambda text: self._tok.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: self._tok.decode(ids)
        else:  # anything transformers can load
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(path))
            self.vocab_size = len(self._tok)
            special = set(self._tok.all_special_ids)
            self._encode = lambda text: self._tok.encode(text, add_special_tokens=False)
            self._decode = lambda ids: self._tok.decode(ids)
        self.special_ids = frozenset(special)
        self.ordinary_ids = [i for i in range(self.vocab_size) if i not in self.special_ids]

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids))

    def random_ids(self, n: int, rng: random.Random) -> list[int]:
        return [rng.choice(self.ordinary_ids) for _ in range(n)]

    def text_of_length(self, ids: list[int], n: int) -> tuple[str, int]:
        """Text whose encoding is about `n` tokens, starting from `ids`: (text, its length)."""
        text = self.decode(ids)
        for _ in range(4):
            enc = self.encode(text)
            if len(enc) == n:
                break
            if len(enc) > n:
                enc = enc[:n]
            else:  # decoding merged some tokens: top up with more of the same ids
                enc = enc + ids[: n - len(enc)]
            text = self.decode(enc)
        return text, len(self.encode(text))


def _length(mean: int, ratio: float, rng: random.Random, minimum: int) -> int:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {ratio}")
    lo, hi = int(mean * (1 - ratio)), int(mean * (1 + ratio) + 0.5)
    return max(minimum, rng.randint(lo, max(lo, hi)))


def _finish(ids: list[int], tokenizer: Tokenizer, as_text: bool) -> tuple[str | list[int], int]:
    if not as_text:
        return ids, len(ids)
    return tokenizer.text_of_length(ids, len(ids))


def random_requests(tokenizer: Tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, as_text: bool = False, seed: int = 0) -> list[SampleRequest]:
    """`prefix_len` tokens shared by every prompt, then a random part of `input_len` (+- ratio)."""
    rng = random.Random(seed)
    prefix = tokenizer.random_ids(prefix_len, rng)
    out = []
    for _ in range(num):
        ids = prefix + tokenizer.random_ids(_length(input_len, range_ratio, rng, 1), rng)
        prompt, n = _finish(ids, tokenizer, as_text)
        out.append(SampleRequest(prompt, n, _length(output_len, range_ratio, rng, 1)))
    return out


def prefix_repetition_requests(tokenizer: Tokenizer, num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, as_text: bool = False, seed: int = 0) -> list[SampleRequest]:
    """`num` prompts in `num_prefixes` groups sharing a prefix, shuffled."""
    if num_prefixes < 1:
        raise ValueError("num_prefixes must be >= 1")
    rng = random.Random(seed)
    prefixes = [tokenizer.random_ids(prefix_len, rng) for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        prefix = prefixes[i % num_prefixes]
        if as_text:  # the same prefix text in every prompt of the group, then the suffix
            ptext, plen = tokenizer.text_of_length(prefix, prefix_len)
            stext, slen = tokenizer.text_of_length(tokenizer.random_ids(suffix_len, rng), suffix_len)
            out.append(SampleRequest(ptext + stext, plen + slen, output_len))
        else:
            ids = prefix + tokenizer.random_ids(suffix_len, rng)
            out.append(SampleRequest(ids, len(ids), output_len))
    rng.shuffle(out)
    return out


def text_slice_requests(tokenizer: Tokenizer, path: str | Path, num: int, input_len: int, output_len: int,
                        range_ratio: float = 0.0, prefix_len: int = 0, as_text: bool = False,
                        seed: int = 0) -> list[SampleRequest]:
    """Slices of a local text file: the file's first `prefix_len` tokens (shared), then
    `input_len` (+- ratio) tokens from a random offset, wrapping around the end."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise ValueError(f"{path}: not enough text to slice ({len(ids)} tokens)")
    rng = random.Random(seed)
    prefix = ids[:prefix_len]
    out = []
    for _ in range(num):
        n = _length(input_len, range_ratio, rng, 1)
        start = rng.randrange(len(ids))
        body = [ids[(start + k) % len(ids)] for k in range(n)]
        prompt, m = _finish(prefix + body, tokenizer, as_text)
        out.append(SampleRequest(prompt, m, _length(output_len, range_ratio, rng, 1)))
    return out


def custom_requests(path: str | Path, num: int | None, output_len: int,
                    tokenizer: Tokenizer | None = None) -> list[SampleRequest]:
    """JSONL lines {"prompt": str | [int]} or {"messages": [{"role", "content"}]}, optional
    "output_tokens". Fewer lines than `num` are cycled; `num=None` takes them all once."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
        out_len = int(row.get("output_tokens") or output_len)
        if "messages" in row:
            msgs = tuple((m["role"], m["content"]) for m in row["messages"])
            n = len(tokenizer.encode("".join(c for _, c in msgs))) if tokenizer else 0
            rows.append(SampleRequest(None, n, out_len, messages=msgs))
        elif isinstance(row.get("prompt"), str):
            n = len(tokenizer.encode(row["prompt"])) if tokenizer else 0
            rows.append(SampleRequest(row["prompt"], n, out_len))
        elif isinstance(row.get("prompt"), list):
            rows.append(SampleRequest([int(t) for t in row["prompt"]], len(row["prompt"]), out_len))
        else:
            raise ValueError(f"{path}:{lineno}: needs a 'prompt' (text or token ids) or 'messages'")
    if not rows:
        raise ValueError(f"{path}: no requests")
    if num is None:
        return rows
    return [rows[i % len(rows)] for i in range(num)]


def as_chat(requests: list[SampleRequest], tokenizer: Tokenizer | None) -> list[SampleRequest]:
    """For the chat endpoint: every prompt as one user message (token ids decoded)."""
    out = []
    for r in requests:
        if r.messages is not None:
            out.append(r)
            continue
        text = r.prompt if isinstance(r.prompt, str) else tokenizer.decode(r.prompt)
        out.append(SampleRequest(None, r.prompt_len, r.output_len, messages=(("user", text),)))
    return out
