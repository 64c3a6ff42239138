"""Paged KV blocks: a free list, ref counts, prefix caching by chained block hashes.

Pure Python (no MLX): the model runner owns the actual K/V pool, indexed by block id.

- A block is *used* while some sequence holds it (ref_count > 0), *free* otherwise.
- Free blocks sit in an LRU queue; a free block may still carry a hash and its tokens
  (a cached block): a later request with the same prefix takes it back (lazy eviction),
  and it is evicted only when the free queue hands it out for new data.
- A block's hash chains its parent's hash with its tokens, so equal hashes mean equal
  prefixes; a hit is still confirmed by comparing what was hashed (parent hash and
  tokens). Only a block whose parent is cached is cached, so under a hash collision a
  hit never holds another prefix's K/V.
- Several blocks may hold the same prefix (two requests computed it at once): each is a
  cached copy, and the hash stays cached while any copy is. A sequence frees its last
  block first, so its own copy of a parent outlives its children in the free queue, and
  a cached block's parent is always cached (evicting one copy never orphans a child).
- Hashes are `cluster.kv.hashing`'s (16 bytes, stable across processes): the disk tier
  and the router's KV map name blocks by them. `listener` (if set) hears each hash that
  enters the cache (its first copy) and each that leaves it (its last copy evicted): the
  memory tier's KV events.
- Invariant (`check_integrity`): every block is either free or used, never both; ref
  counts equal the number of block tables that hold the block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Protocol

from cluster.kv.hashing import hash_block


class _Seq(Protocol):
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    block_hashes: list[bytes]


class CacheListener(Protocol):
    def stored(self, hashes: list[bytes]) -> None: ...  # hashes now cached (first copy)

    def removed(self, hashes: list[bytes]) -> None: ...  # hashes no longer cached (last copy evicted)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    parent_hash: bytes | None = None  # the previous block's hash (None for a first block)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, dict[int, None]] = {}  # block hash -> the ids of its copies (ordered set)
        self.listener: CacheListener | None = None
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

    # -- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------
    def hash_block(self, parent: bytes | None, tokens: Iterable[int]) -> bytes:
        return hash_block(parent, tokens)

    def _extend_hashes(self, seq: _Seq, upto_tokens: int) -> None:
        """Hash the sequence's full blocks within its first `upto_tokens` tokens."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= upto_tokens:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            seq.block_hashes.append(self.hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, seq: _Seq) -> list[int]:
        """Cached blocks holding a prefix of `seq` (full blocks only; at least the last
        token is always left to compute, since its logits are needed)."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        limit = len(seq.token_ids) - 1
        self._extend_hashes(seq, limit)
        hits = []
        bs = self.block_size
        for i, h in enumerate(seq.block_hashes[: limit // bs]):
            copies = self.cached.get(h)
            if not copies:
                break
            # A copy in use costs no free block to take over: prefer one.
            bid = next((b for b in copies if self.blocks[b].ref_count), next(iter(copies)))
            block = self.blocks[bid]
            # Equal tokens are not enough: under a hash collision the block may hold the
            # same tokens after another prefix (or at another position).
            parent = seq.block_hashes[i - 1] if i else None
            if block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]) or block.parent_hash != parent:
                break
            hits.append(bid)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # -- allocation -------------------------------------------------------------------
    def can_allocate(self, seq: _Seq, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        return self._num_blocks_to_take(seq, num_new_tokens, computed_blocks) <= self.num_free_blocks

    def room(self, seq: _Seq, computed_blocks: list[int] = ()) -> int:
        """The most new tokens `allocate_slots(seq, n, computed_blocks)` can take now
        (0 when not even the computed blocks can be taken over)."""
        held = len(seq.block_table) + len(computed_blocks)
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if revived > self.num_free_blocks:
            return 0
        base = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        return max(0, (held + self.num_free_blocks - revived) * self.block_size - base)

    def _num_blocks_to_take(self, seq: _Seq, num_new_tokens: int, computed_blocks) -> int:
        held = len(seq.block_table) + len(computed_blocks)
        total = self.blocks_needed(seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens)
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return max(0, total - held) + revived

    def allocate_slots(self, seq: _Seq, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens after its computed ones
        (and after `computed_blocks`, prefix-cache hits it takes over first).
        Returns False, changing nothing, when the free blocks do not suffice."""
        if not self.can_allocate(seq, num_new_tokens, computed_blocks):
            return False
        for bid in computed_blocks:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_queue[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        seq.num_computed_tokens += len(computed_blocks) * self.block_size
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_free_block())
        return True

    def share_blocks(self, src: _Seq, dst: _Seq, num_blocks: int) -> None:
        """Give `dst` (holding nothing yet) `src`'s first `num_blocks` computed blocks,
        shared by reference (n > 1: a sample forked after its prompt's prefill)."""
        if dst.block_table or num_blocks * self.block_size > src.num_computed_tokens:
            raise ValueError("share_blocks: dst must hold no block, and src must have computed the shared ones")
        for bid in src.block_table[:num_blocks]:
            self.blocks[bid].ref_count += 1
            dst.block_table.append(bid)
        dst.num_computed_tokens = num_blocks * self.block_size

    def _take_free_block(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:  # evict: its contents are about to be overwritten
            self._forget(block)
        block.ref_count = 1
        return bid

    def _forget(self, block: Block) -> None:
        """Take `block` out of the prefix cache (the listener hears of its hash's last copy)."""
        copies = self.cached[block.hash]
        del copies[block.block_id]
        if not copies:
            del self.cached[block.hash]
            if self.listener is not None:
                self.listener.removed([block.hash])
        block.hash = None
        block.token_ids = None
        block.parent_hash = None

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Take free blocks `install_cached` put in the cache out again (their rows could not
        be written: never a hit), each to the front of the free queue, reused first."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0 and block.hash is not None:
                self._forget(block)
                self.free_queue.move_to_end(bid, last=False)

    def free(self, seq: _Seq) -> None:
        """Release `seq`'s blocks. A block with no cached prefix goes to the front of the
        free queue (reused first); cached ones go to the back, last block first, so a
        sequence's last blocks are evicted before its (more shareable) first ones."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            if block.ref_count <= 0:
                raise AssertionError(f"double free of block {bid}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_queue[bid] = None
                    self.free_queue.move_to_end(bid, last=False)
                else:
                    self.free_queue[bid] = None  # cached: most recently used, evicted last
        seq.block_table = []

    def trim(self, seq: _Seq, num_tokens: int) -> None:
        """Release `seq`'s blocks past its first `num_tokens` tokens (the rejected drafts'
        positions after a speculative step: nothing there is read again). Such a block is
        never cached (only computed full blocks are), so it goes to the front of the free
        queue, to be reused first."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            bid = seq.block_table.pop()
            block = self.blocks[bid]
            if block.ref_count <= 0:
                raise AssertionError(f"double free of block {bid}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[bid] = None
                if block.hash is None:
                    self.free_queue.move_to_end(bid, last=False)

    def cache_full_blocks(self, seq: _Seq) -> None:
        """Register `seq`'s computed full blocks in the prefix cache (after a forward)."""
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(seq, seq.num_computed_tokens)
        bs = self.block_size
        stored = []
        for i, h in enumerate(seq.block_hashes[: seq.num_computed_tokens // bs]):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = seq.block_hashes[i - 1] if i else None
            copies = self.cached.setdefault(h, {})
            if copies:
                twin = self.blocks[next(iter(copies))]
                if twin.token_ids != tokens or twin.parent_hash != parent:
                    break  # a hash collision: cache nothing after it (a cached block's parent is cached)
            if not copies:
                stored.append(h)
            block.hash = h
            block.token_ids = tokens
            block.parent_hash = parent
            copies[block.block_id] = None  # another copy of the same prefix, if there was one
        if stored and self.listener is not None:
            self.listener.stored(stored)

    def install_cached(self, entries: list[tuple[bytes, bytes | None, tuple[int, ...]]],
                       keep: list[int] = ()) -> list[int | None]:
        """Put blocks read from another tier (the disk) into the prefix cache, as free cached
        blocks a request takes over like any other hit. `entries`: (hash, parent hash or
        None, tokens) of consecutive blocks of one prefix; `keep`: the cached blocks of that
        prefix before them (a sequence's memory hits).

        Installs while the chain holds: the first entry's parent must be cached, and a hash
        cached already (with the same parent and tokens) is passed over (None in the result,
        its block is there). Takes at most half the free blocks not holding the chain, so
        the blocks taken never evict it; then the whole chain goes to the back of the free
        queue, its first block last, so that (as `free` leaves a sequence's blocks) a parent
        is evicted after its children. Returns, per entry accepted (a prefix of `entries`),
        the block id whose rows the caller must write before the next forward (or None)."""
        chain = [bid for bid in keep if self.blocks[bid].ref_count == 0]
        for h, _, _ in entries:  # copies already cached: part of the chain, not to be taken
            chain += [bid for bid in self.cached.get(h, ()) if self.blocks[bid].ref_count == 0]
        for bid in chain:
            self.free_queue.move_to_end(bid)
        budget = (self.num_free_blocks - len(chain)) // 2
        out: list[int | None] = []
        stored = []
        for h, parent, tokens in entries:
            if parent is not None and parent not in self.cached:
                break  # an orphan would break "a cached block's parent is cached"
            copies = self.cached.get(h)
            if copies:
                twin = self.blocks[next(iter(copies))]
                if twin.token_ids != tuple(tokens) or twin.parent_hash != parent:
                    break  # a hash collision
                out.append(None)
                continue
            if budget <= 0:
                break
            budget -= 1
            bid = self._take_free_block()
            block = self.blocks[bid]
            block.ref_count = 0
            block.hash, block.token_ids, block.parent_hash = h, tuple(tokens), parent
            self.cached[h] = {bid: None}
            self.free_queue[bid] = None
            stored.append(h)
            out.append(bid)
        order = [bid for bid in keep if self.blocks[bid].ref_count == 0]
        for (h, _, _), bid in zip(entries, out):
            order += [bid] if bid is not None else [b for b in self.cached[h] if self.blocks[b].ref_count == 0]
        for bid in reversed(order):  # the deepest block nearest the front: evicted first
            self.free_queue.move_to_end(bid)
        if stored and self.listener is not None:
            self.listener.stored(stored)
        return out

    # -- checks -----------------------------------------------------------------------
    def check_integrity(self, seqs: Iterable[_Seq] | None = None) -> None:
        """free + used == total; ref counts match the given live sequences' tables."""
        used = 0
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            if in_free == (block.ref_count > 0):
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count}, in free queue {in_free}")
            used += block.ref_count > 0
        if used + len(self.free_queue) != self.num_blocks:
            raise AssertionError(f"free {len(self.free_queue)} + used {used} != total {self.num_blocks}")
        if seqs is not None:
            refs = [0] * self.num_blocks
            for seq in seqs:
                for bid in seq.block_table:
                    refs[bid] += 1
            if refs != [b.ref_count for b in self.blocks]:
                raise AssertionError("ref counts do not match the live block tables")
        for h, copies in self.cached.items():
            if not copies:
                raise AssertionError(f"cached hash {h} has no block")
            for bid in copies:
                if self.blocks[bid].hash != h:
                    raise AssertionError(f"cached hash {h} points at block {bid} with hash {self.blocks[bid].hash}")
