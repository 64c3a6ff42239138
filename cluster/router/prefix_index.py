"""An approximate map from prompt prefixes to the workers likely to hold them in KV cache.

The router has no tokenizer, so a prompt is cut into chunks it can see: 16-token blocks
for token-id prompts (the workers' default block size; the router does not know a worker's
own, and another size only makes the hint coarser), 64-character chunks for text and chat.
Chunk i's key is a hash chained over chunks 0..i (with the model name as the seed), so a
key names a whole prefix, as in the worker's block manager. Each key remembers the
workers a request with that prefix was recently sent to. The table is an LRU bounded in
keys; workers forget cached blocks on their own, so the index is a hint, never the truth.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable

TOKEN_BLOCK = 16
TEXT_CHUNK = 64
# Only a prompt's first chunks are hashed (8,192 tokens, or 32 KiB of text): a huge prompt
# costs the router bounded work, and placement needs no more than its beginning.
MAX_CHUNKS = 512


def chained_hashes(chunks: Iterable[bytes], seed: str = "") -> list[bytes]:
    """h_i = H(h_{i-1} || chunk_i), h_{-1} = H(seed): equal keys mean equal prefixes."""
    prev = hashlib.blake2b(seed.encode(), digest_size=8).digest()
    keys = []
    for chunk in chunks:
        prev = hashlib.blake2b(prev + chunk, digest_size=8).digest()
        keys.append(prev)
    return keys


def token_chunks(token_ids, block: int = TOKEN_BLOCK, max_chunks: int = MAX_CHUNKS) -> list[bytes]:
    """Full blocks only (a partial last block is never cached by a worker), the first
    `max_chunks` of them."""
    n = min(len(token_ids) // block, max_chunks) * block
    return [b",".join(str(t).encode() for t in token_ids[i : i + block]) for i in range(0, n, block)]


def text_chunks(text: str, size: int = TEXT_CHUNK, max_chunks: int = MAX_CHUNKS) -> list[bytes]:
    data = text[: size * max_chunks].encode()[: size * max_chunks]
    n = len(data) // size * size
    return [data[i : i + size] for i in range(0, n, size)]


def prompt_keys(request, block: int = TOKEN_BLOCK, chunk: int = TEXT_CHUNK) -> list[bytes]:
    """Prefix keys of a GenerateRequest's prompt (text, token ids or chat messages)."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        chunks = token_chunks(request.token_ids.ids[: block * MAX_CHUNKS], block)
    elif kind == "chat":
        # Role and content with separators, as a chat template would lay them out.
        parts, size = [], 0
        for m in request.chat.messages:
            if size >= chunk * MAX_CHUNKS:
                break
            parts.append(f"\x1e{m.role}\x1f{m.content[: chunk * MAX_CHUNKS]}")
            size += len(parts[-1])
        chunks = text_chunks("".join(parts), chunk)
    else:
        chunks = text_chunks(request.text, chunk)
    return chained_hashes(chunks, seed=f"{kind}:{request.model}")


class PrefixIndex:
    """key -> {worker_id: last use tick}, LRU over keys, at most `max_keys` keys.
    `held[w]`: how many keys name worker w, a rough size of what w caches."""

    def __init__(self, max_keys: int = 200_000, max_workers_per_key: int = 4):
        self.max_keys = max_keys
        self.max_workers_per_key = max_workers_per_key
        self._table: OrderedDict[bytes, dict[str, int]] = OrderedDict()
        self._tick = 0
        self.held: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._table)

    def match(self, keys: list[bytes], candidates: Iterable[str]) -> dict[str, int]:
        """Per candidate worker: how many leading chunks of the prompt it likely holds."""
        alive = set(candidates)
        matched = dict.fromkeys(alive, 0)
        for i, key in enumerate(keys):
            owners = self._table.get(key)
            if not owners:
                break
            alive &= owners.keys()
            if not alive:
                break
            for w in alive:
                matched[w] = i + 1
        return matched

    def insert(self, keys: list[bytes], worker_id: str) -> None:
        """Record that `worker_id` now holds (or will hold) this prefix."""
        self._tick += 1
        for key in keys:
            owners = self._table.get(key)
            if owners is None:
                owners = self._table[key] = {}
            else:
                self._table.move_to_end(key)
            if worker_id not in owners:
                self.held[worker_id] += 1
            owners[worker_id] = self._tick
            if len(owners) > self.max_workers_per_key:
                oldest = min(owners, key=owners.__getitem__)
                del owners[oldest]
                self.held[oldest] -= 1
        while len(self._table) > self.max_keys:
            _, owners = self._table.popitem(last=False)
            self.held.subtract(owners.keys())

    def remove(self, keys: list[bytes], worker_id: str) -> None:
        """`worker_id` no longer holds this prefix; keys no worker holds are dropped."""
        for key in keys:
            owners = self._table.get(key)
            if owners is not None and owners.pop(worker_id, None) is not None:
                self.held[worker_id] -= 1
                if not owners:
                    del self._table[key]

    def remove_worker(self, worker_id: str) -> None:
        for key in [k for k, owners in self._table.items() if owners.pop(worker_id, None) is not None and not owners]:
            del self._table[key]
        self.held.pop(worker_id, None)
