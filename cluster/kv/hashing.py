"""Chained token-block hashes, the same in every process and on every machine.

A block's hash covers its parent's hash and its tokens, so equal hashes mean equal
prefixes; the worker's prefix cache, its disk tier and the router's KV map all name
blocks by them. blake2b (16 bytes) rather than Python's `hash`: that one changes between
Python builds and is not collision-resistant, and these names outlive the process (disk
files, events read by another machine).
"""

from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Iterable, Sequence

HASH_BYTES = 16
# The parent of a prompt's first block; a new version string changes every hash.
SEED = blake2b(b"orchard-kv-v1", digest_size=HASH_BYTES).digest()


def hash_block(parent: bytes | None, tokens: Iterable[int]) -> bytes:
    """The hash of a block holding `tokens` after the block hashed `parent` (None: the
    prompt's first block)."""
    h = blake2b(parent or SEED, digest_size=HASH_BYTES)
    h.update(array("I", tokens).tobytes())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[bytes]:
    """The hashes of the full blocks of `token_ids` (at most `max_blocks`), in order."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[bytes] = []
    parent = None
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def pack(hashes: Iterable[bytes]) -> bytes:
    """Hashes as one bytes value (KvBlocks.hashes)."""
    return b"".join(hashes)


def unpack(data: bytes) -> list[bytes]:
    """KvBlocks.hashes back into hashes; a length that is no multiple of 16 is refused."""
    if len(data) % HASH_BYTES:
        raise ValueError(f"KV block hashes: {len(data)} bytes is not a multiple of {HASH_BYTES}")
    return [data[i : i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]
