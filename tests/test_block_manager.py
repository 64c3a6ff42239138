"""The block manager as plain Python: known answers, then a hypothesis state machine.

No MLX here. The state machine keeps a shadow KV pool: each slot records the token
prefix whose K/V was written there (K/V at position p depends on tokens[:p+1]), so a
prefix-cache hit or a block table that points at the wrong content shows up as a
mismatch, not just as bad accounting.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.worker.block_manager import BlockManager
from cluster.worker.sampling_params import SamplingParams
from cluster.worker.sequence import Sequence


class ShadowKV:
    """A shadow KV pool for the state machines: each slot records the token prefix whose
    K/V a fake forward wrote there (K/V at position p depends on tokens[:p+1])."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix

    def write(self, seq: Sequence, start: int, end: int) -> None:
        bs = self.bm.block_size
        for p in range(start, end):
            bid = seq.block_table[p // bs]
            assert self.bm.blocks[bid].ref_count == 1, f"{seq.request_id} writes into shared block {bid}"
            self.slots[(bid, p % bs)] = tuple(seq.token_ids[: p + 1])

    def check(self, seq: Sequence, end: int) -> None:
        """Every position before `end` reads the K/V of its own prefix."""
        bs = self.bm.block_size
        for p in range(end):
            got = self.slots.get((seq.block_table[p // bs], p % bs))
            assert got == tuple(seq.token_ids[: p + 1]), f"{seq.request_id}: wrong K/V at position {p}"


def make_seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams())


def compute(bm: BlockManager, seq: Sequence, n: int, computed_blocks=()) -> None:
    """What a step does to the block manager: allocate, forward (advance), cache."""
    assert bm.allocate_slots(seq, n, list(computed_blocks))
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def run_prompt(bm: BlockManager, tokens, rid="r") -> Sequence:
    """Admit a prompt the way the scheduler does (prefix hits first) and compute it all."""
    seq = make_seq(tokens, rid)
    hits = bm.get_computed_blocks(seq)
    compute(bm, seq, seq.num_tokens - len(hits) * bm.block_size, hits)
    return seq


# -- accounting ------------------------------------------------------------------------------


def test_allocation_and_free_accounting():
    bm = BlockManager(10, 16)
    seq = make_seq(range(40))
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0 and bm.usage == 0.0
    assert bm.blocks_needed(40) == 3 and bm.blocks_needed(48) == 3 and bm.blocks_needed(49) == 4
    assert bm.allocate_slots(seq, 40)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage) == (7, 3, 0.3)
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    bm.check_integrity([seq])

    # A second sequence asking for more than is free gets nothing and changes nothing.
    big = make_seq(range(1000, 1200), "big")
    assert not bm.can_allocate(big, 200)
    assert not bm.allocate_slots(big, 200)
    assert big.block_table == [] and bm.num_free_blocks == 7
    bm.check_integrity([seq, big])

    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    bm.check_integrity([seq, big])


def test_chunked_allocation_grows_the_table_block_by_block():
    bm = BlockManager(8, 8)
    seq = make_seq(range(30))
    for n, expected_blocks in [(5, 1), (3, 1), (1, 2), (10, 3), (11, 4)]:
        compute(bm, seq, n)
        assert len(seq.block_table) == expected_blocks
        assert bm.num_used_blocks == expected_blocks
        bm.check_integrity([seq])
    assert seq.num_computed_tokens == 30


# -- prefix caching ----------------------------------------------------------------------------


def test_prefix_cache_hits_full_blocks_of_a_shared_prefix():
    bs = 16
    bm = BlockManager(32, bs)
    base = list(range(100, 140))  # 2 full blocks + 8 tokens
    a = run_prompt(bm, base, "a")
    assert bm.cached and len(bm.cached) == 2  # only full blocks are cached

    # Shares 2 full blocks, then differs: both blocks hit.
    b = make_seq(base[:32] + [7, 7, 7], "b")
    assert bm.get_computed_blocks(b) == a.block_table[:2]
    # Shares 1.5 blocks: only the full block hits (a partial block is never a hit).
    c = make_seq(base[:24] + [7] * 20, "c")
    assert bm.get_computed_blocks(c) == a.block_table[:1]
    # Differs in the first block: no hit, even though block 2 matches.
    d = make_seq([0] + base[1:], "d")
    assert bm.get_computed_blocks(d) == []
    # Exactly two full blocks: the last token is never a hit, so only one block is.
    e = make_seq(base[:32], "e")
    assert bm.get_computed_blocks(e) == a.block_table[:1]
    # One token more: both blocks hit, one token left to compute.
    f = make_seq(base[:33], "f")
    assert bm.get_computed_blocks(f) == a.block_table[:2]

    # Taking the hits shares the blocks (ref counts) and skips their tokens.
    hits = bm.get_computed_blocks(b)
    assert bm.allocate_slots(b, 3, hits)
    assert b.num_computed_tokens == 32 and b.block_table[:2] == a.block_table[:2] and len(b.block_table) == 3
    assert [bm.blocks[x].ref_count for x in b.block_table] == [2, 2, 1]
    bm.check_integrity([a, b])
    bm.free(a)
    bm.check_integrity([b])
    assert [bm.blocks[x].ref_count for x in b.block_table] == [1, 1, 1]


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(16, 8, enable_prefix_caching=False)
    a = run_prompt(bm, range(40), "a")
    assert bm.cached == {}
    assert bm.get_computed_blocks(make_seq(range(40), "b")) == []
    bm.free(a)
    bm.check_integrity([])


def test_a_sequence_that_holds_blocks_gets_no_hits():
    bm = BlockManager(16, 8)
    run_prompt(bm, range(20), "a")
    b = make_seq(range(20), "b")
    compute(bm, b, 3)
    assert bm.get_computed_blocks(b) == []


def test_hash_collision_is_confirmed_by_tokens(monkeypatch):
    """Every block hashes to the same value: a hit must still hold the right prefix."""
    monkeypatch.setattr(BlockManager, "hash_block", lambda self, parent, tokens: 42)
    bs = 8
    bm = BlockManager(16, bs)
    a = run_prompt(bm, [1] * bs + [2] * bs + [9], "a")
    assert list(bm.cached) == [42]
    # Same first block: a true hit. Its second block collides but is not cached.
    assert bm.get_computed_blocks(make_seq([1] * bs + [3] * bs + [9])) == a.block_table[:1]
    # Different first block, same hash: no hit.
    assert bm.get_computed_blocks(make_seq([5] * bs + [2] * bs + [9])) == []
    # Block 1 has the same tokens as the cached block 0 and the same (colliding) hash,
    # but it sits after a prefix: its K/V is not that block's. Only block 0 hits.
    assert bm.get_computed_blocks(make_seq([1] * bs + [1] * bs + [1] * bs + [9])) == a.block_table[:1]
    # ...and a sequence starting with something else gets nothing at all.
    assert bm.get_computed_blocks(make_seq([4] * bs + [1] * bs + [9])) == []


def test_hash_collision_in_an_earlier_uncached_block_gives_no_false_hit(monkeypatch):
    """Two different first blocks collide. The second one cannot be cached (the hash is
    taken), so what was computed after it must never be served after the first one."""
    real = BlockManager.hash_block
    monkeypatch.setattr(
        BlockManager, "hash_block", lambda self, parent, tokens: 0 if parent is None else real(self, parent, tokens)
    )
    bs = 8
    bm = BlockManager(8, bs)
    w = run_prompt(bm, [1] * bs + [9], "w")
    run_prompt(bm, [2] * bs + [3] * bs + [9], "x")  # block 0 collides with w's; block 1 = [3]*8 after it
    assert bm.get_computed_blocks(make_seq([1] * bs + [3] * bs + [9])) == w.block_table[:1]
    assert bm.get_computed_blocks(make_seq([2] * bs + [3] * bs + [9])) == []


def test_freed_cached_blocks_are_revived_by_a_later_identical_prefix():
    bs = 8
    bm = BlockManager(6, bs)
    prompt = list(range(2 * bs + 3))
    a = run_prompt(bm, prompt, "a")
    cached_blocks = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6  # free, but still cached (lazy eviction)
    assert all(bm.blocks[b].hash is not None for b in cached_blocks)

    b = make_seq(prompt, "b")
    hits = bm.get_computed_blocks(b)
    assert hits == cached_blocks
    assert bm.can_allocate(b, 3, hits)
    compute(bm, b, 3, hits)
    assert b.block_table[:2] == cached_blocks
    assert bm.num_free_blocks == 3  # two revived blocks left the free queue, one new block
    assert all(bm.blocks[x].ref_count == 1 for x in b.block_table)
    bm.check_integrity([b])


def test_revival_counts_against_free_blocks():
    """Reviving a free cached block uses a free block: the pool must have room for it."""
    bs = 8
    bm = BlockManager(4, bs)
    prompt = list(range(2 * bs + 1))
    a = run_prompt(bm, prompt, "a")
    bm.free(a)
    hog = make_seq(range(500, 500 + bs), "hog")
    compute(bm, hog, bs)  # takes the uncached partial block: 3 free, 2 of them cached
    assert bm.num_free_blocks == 3
    b = make_seq(prompt, "b")
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert bm._num_blocks_to_take(b, 1, hits) == 3  # 2 revived + 1 new
    assert bm.can_allocate(b, 1, hits)
    assert not bm.can_allocate(b, bs + 1, hits)  # would need a fourth block
    compute(bm, b, 1, hits)
    assert bm.num_free_blocks == 0
    bm.check_integrity([hog, b])


def test_eviction_happens_only_when_a_block_is_handed_out_for_new_data():
    bs = 8
    bm = BlockManager(4, bs)
    prompt = list(range(2 * bs + 1))  # blocks 0, 1 full (cached), block 2 partial
    a = run_prompt(bm, prompt, "a")
    first, second, tail = a.block_table
    bm.free(a)
    # Free queue order (evicted first -> last): uncached blocks, then the cached tail,
    # then the cached head (a sequence's first blocks are the most shareable).
    assert list(bm.free_queue) == [tail, 3, second, first]

    c = make_seq(range(900, 900 + 2 * bs + 1), "c")  # unrelated, needs 3 blocks
    compute(bm, c, c.num_tokens)
    assert c.block_table == [tail, 3, second]
    assert bm.blocks[second].hash is None  # evicted: handed out for new data
    assert bm.blocks[first].hash is not None  # still cached
    assert bm.get_computed_blocks(make_seq(prompt)) == [first]
    bm.check_integrity([c])


def test_lru_order_across_sequences():
    """Blocks freed earlier are evicted before blocks freed later."""
    bs = 8
    bm = BlockManager(4, bs)
    a = run_prompt(bm, list(range(100, 100 + bs + 1)), "a")  # 1 cached + 1 partial block
    b = run_prompt(bm, list(range(200, 200 + bs + 1)), "b")
    a_head, b_head = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    assert list(bm.free_queue)[-2:] == [a_head, b_head]
    x = make_seq(range(300, 300 + 3 * bs), "x")
    compute(bm, x, x.num_tokens)  # takes the two uncached blocks, then evicts a_head
    assert a_head in x.block_table and b_head not in x.block_table
    assert bm.get_computed_blocks(make_seq(list(range(100, 100 + bs + 1)))) == []
    assert bm.get_computed_blocks(make_seq(list(range(200, 200 + bs + 1)))) == [b_head]


def test_a_block_in_use_is_never_evicted():
    bs = 8
    bm = BlockManager(3, bs)
    a = run_prompt(bm, list(range(2 * bs)), "a")  # 2 blocks in use, first cached
    x = make_seq(range(500, 500 + 2 * bs), "x")
    assert not bm.allocate_slots(x, 2 * bs)  # one free block only
    compute(bm, x, bs)
    assert set(x.block_table).isdisjoint(a.block_table)
    assert bm.blocks[a.block_table[0]].hash is not None
    bm.check_integrity([a, x])


def test_duplicate_content_is_cached_in_each_copy_and_what_follows_it_still_is():
    bs = 8
    bm = BlockManager(8, bs)
    a = make_seq(range(bs + 1), "a")
    b = make_seq(range(2 * bs + 1), "b")
    compute(bm, a, bs + 1)
    compute(bm, b, 2 * bs + 1)  # its own copy of a's block 0 (as if admitted before a's was cached)
    # both copies of block 0 are cached; b's block 1 follows the same content, so it is
    # cached too (a multi-turn chat continuing b's prompt reuses it)
    assert list(bm.cached[a.block_hashes[0]]) == [a.block_table[0], b.block_table[0]]
    assert bm.cached[b.block_hashes[1]] == {b.block_table[1]: None}
    c = run_prompt(bm, range(2 * bs + 1), "c")
    assert c.block_table[:2] == [a.block_table[0], b.block_table[1]] and len(bm.cached) == 2
    bm.check_integrity([a, b, c])


def test_evicting_one_copy_of_a_parent_never_orphans_a_cached_child():
    """Found by the state machine below: when only the first copy of a prefix was cached,
    its eviction (its request finished first) left the other request's cached next block
    with an uncached parent: unreachable, and against the cache's own invariant."""
    bs = 8
    bm = BlockManager(6, bs)
    a = make_seq(range(bs + 1), "a")
    b = make_seq(range(2 * bs + 1), "b")
    compute(bm, a, bs + 1)
    compute(bm, b, 2 * bs + 1)
    bm.free(a)  # a's copy of block 0 is free now, b's is in use
    hog = make_seq([500 + i for i in range(3 * bs)], "hog")
    compute(bm, hog, 3 * bs)  # takes every free block: a's copy of block 0 is evicted
    parent = b.block_hashes[0]
    assert parent in bm.cached and list(bm.cached[parent]) == [b.block_table[0]]
    bm.free(hog)
    d = run_prompt(bm, range(2 * bs + 1), "d")  # b's whole prefix is still a hit
    assert d.block_table[:2] == b.block_table[:2]
    bm.check_integrity([b, d])


def test_a_colliding_block_stops_caching_what_follows_it(monkeypatch):
    bs = 8
    bm = BlockManager(8, bs)
    monkeypatch.setattr(bm, "hash_block", lambda parent, tokens: 7 if parent is None else hash((parent, tuple(tokens))))
    a = make_seq([1] * bs + [9], "a")
    b = make_seq([2] * bs + [3] * bs + [9], "b")  # first block collides with a's
    compute(bm, a, bs + 1)
    compute(bm, b, 2 * bs + 1)
    assert all(bm.blocks[x].hash is None for x in b.block_table)  # not after a collision
    assert bm.get_computed_blocks(make_seq([1] * bs + [3] * bs + [9])) == [a.block_table[0]]


# -- misuse and corruption ----------------------------------------------------------------------


def _entries(tokens, bs, first=0, n=None):
    """(hash, parent, tokens) of blocks first.. of a prompt: what the disk tier installs."""
    from cluster.kv.hashing import block_hashes

    hashes = block_hashes(tokens, bs)
    n = len(hashes) - first if n is None else n
    return [(hashes[i], hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]))
            for i in range(first, first + n)]


class Heard:
    """A cache listener that remembers what it heard."""

    def __init__(self):
        self.stored_hashes: list[bytes] = []

    def stored(self, hashes):
        self.stored_hashes += hashes

    def removed(self, hashes):
        pass


def test_installed_blocks_are_free_cached_hits_in_prefix_order():
    bm = BlockManager(16, 4)
    heard = Heard()
    bm.listener = heard
    tokens = list(range(100, 121))  # 5 full blocks
    ids = bm.install_cached(_entries(tokens, 4, n=3))
    assert len(ids) == 3 and None not in ids and heard.stored_hashes == [e[0] for e in _entries(tokens, 4, n=3)]
    assert bm.num_free_blocks == 16 and all(bm.blocks[b].ref_count == 0 for b in ids)
    seq = make_seq(tokens)
    assert bm.get_computed_blocks(seq) == ids  # taken over as memory hits
    bm.check_integrity([])
    # the next ones extend the chain; one cached already is passed over (None), not copied
    again = bm.install_cached(_entries(tokens, 4, first=2, n=3), keep=ids[:2])
    assert again[0] is None and None not in again[1:] and len(bm.get_computed_blocks(seq)) == 5
    bm.check_integrity([])


def test_install_refuses_an_orphan_and_keeps_the_prefix_it_extends():
    bm = BlockManager(8, 4)
    tokens = list(range(50, 50 + 4 * 6))
    assert bm.install_cached(_entries(tokens, 4, first=1, n=2)) == []  # block 0 not cached: no orphans
    first = run_prompt(bm, tokens[:8] + [1])  # blocks 0, 1 cached (then freed: at the LRU's back)
    bm.free(first)
    hits = bm.get_computed_blocks(make_seq(tokens))
    assert len(hits) == 2
    ids = bm.install_cached(_entries(tokens, 4, first=2, n=4), keep=hits)
    # at most half the free blocks not kept: (8 - 2) // 2
    assert len(ids) == 3
    assert bm.get_computed_blocks(make_seq(tokens)) == hits + ids, "the kept prefix was not evicted"
    bm.check_integrity([])


def test_double_free_raises():
    bm = BlockManager(4, 8)
    a = make_seq(range(10), "a")
    compute(bm, a, 10)
    stale = make_seq(range(10), "stale")
    stale.block_table = list(a.block_table)  # a second owner that the manager never counted
    bm.free(a)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(stale)


def test_freeing_twice_through_the_same_sequence_is_a_no_op():
    bm = BlockManager(4, 8)
    a = make_seq(range(10), "a")
    compute(bm, a, 10)
    bm.free(a)
    bm.free(a)  # its table is empty now
    assert bm.num_free_blocks == 4
    bm.check_integrity([a])


def _state_with_two_seqs():
    bm = BlockManager(8, 8)
    a = run_prompt(bm, range(20), "a")
    b = run_prompt(bm, range(20), "b")  # shares a's two full blocks
    bm.check_integrity([a, b])
    return bm, a, b


def test_check_integrity_catches_corruption():
    bm, a, b = _state_with_two_seqs()
    bm.blocks[a.block_table[-1]].ref_count += 1  # leaked reference
    with pytest.raises(AssertionError, match="ref counts"):
        bm.check_integrity([a, b])

    bm, a, b = _state_with_two_seqs()
    bm.free_queue[a.block_table[-1]] = None  # a used block on the free list
    with pytest.raises(AssertionError, match="in free queue"):
        bm.check_integrity()

    bm, a, b = _state_with_two_seqs()
    del bm.free_queue[next(iter(bm.free_queue))]  # a free block lost
    with pytest.raises(AssertionError):
        bm.check_integrity()

    bm, a, b = _state_with_two_seqs()
    b.block_table.append(b.block_table[-1])  # a table the ref counts do not know about
    with pytest.raises(AssertionError, match="ref counts"):
        bm.check_integrity([a, b])

    bm, a, b = _state_with_two_seqs()
    h = next(iter(bm.cached))
    bm.cached[h] = {a.block_table[-1]: None}  # cache entry pointing at the wrong block
    with pytest.raises(AssertionError, match="cached hash"):
        bm.check_integrity([a, b])


def test_constructor_rejects_an_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 16)


# -- the state machine --------------------------------------------------------------------------

def weak_hash(buckets: int):
    """A block hash with few values, the same in every process (hash(None) is not)."""
    return lambda parent, tokens: hash((-1 if parent is None else parent, tuple(tokens))) % buckets


VOCAB = 4  # a tiny vocabulary, and runs of one token: equal blocks at different positions


def token_lists(max_runs: int = 5) -> st.SearchStrategy[list[int]]:
    """Token lists made of runs (so blocks repeat) or drawn token by token."""
    runs = st.lists(st.tuples(st.integers(0, VOCAB - 1), st.integers(1, 40)), min_size=1, max_size=max_runs)
    return st.one_of(
        runs.map(lambda rs: [t for t, n in rs for _ in range(n)][:100]),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=80),
    )


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences come and go (admit with prefix hits, compute chunks, sample, preempt,
    free) against a shadow KV pool. Each slot remembers the prefix whose K/V it holds."""

    @initialize(
        block_size=st.sampled_from([8, 16, 32]),
        num_blocks=st.integers(1, 12),
        caching=st.booleans(),
        hash_buckets=st.sampled_from([None, 1, 4, 32]),
        bases=st.lists(token_lists(), min_size=1, max_size=3),
    )
    def setup(self, block_size, num_blocks, caching, hash_buckets, bases):
        self.bm = BlockManager(num_blocks, block_size, caching)
        if hash_buckets:  # a weak hash (1 bucket: all blocks collide): hits must still be right
            self.bm.hash_block = weak_hash(hash_buckets)
        self.bases = bases
        self.live: list[Sequence] = []  # hold blocks (or may)
        self.parked: list[Sequence] = []  # preempted: no blocks, tokens kept
        self.kv = ShadowKV(self.bm)
        self.n = 0
        # a disk tier written through: each block as it entered the cache (hash -> parent,
        # tokens, each slot's prefix), read back by `install_from_disk`; with a strong hash
        # only (under a weak one, equal hashes and tokens need not be equal prefixes)
        self.disk: dict = {}
        if not hash_buckets:
            self.bm.listener = self

    def _admit(self, seq: Sequence, chunk: int) -> None:
        free_before = self.bm.num_free_blocks
        hits = self.bm.get_computed_blocks(seq)
        bs = self.bm.block_size
        assert len(hits) * bs < seq.num_tokens  # the last token is never a hit
        if not self.bm.enable_prefix_caching:
            assert hits == []
        n = min(chunk, seq.num_tokens - len(hits) * bs)
        if not self.bm.allocate_slots(seq, n, hits):
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            assert self.bm.num_free_blocks == free_before
            self.parked.append(seq)
            return
        assert seq.num_computed_tokens == len(hits) * bs
        self.kv.check(seq, seq.num_computed_tokens)  # the hits hold this very prefix
        self.kv.write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)
        self.live.append(seq)

    # the block manager's listener: the disk tier's write-through
    def stored(self, hashes):
        bs = self.bm.block_size
        for h in hashes:
            if h in self.disk:
                continue  # there already (an install from it: its rows are written after this)
            block = self.bm.blocks[next(iter(self.bm.cached[h]))]
            contents = [self.kv.slots[(block.block_id, j)] for j in range(bs)]
            self.disk[h] = (block.parent_hash, block.token_ids, contents)

    def removed(self, hashes):
        pass

    # rules
    @precondition(lambda self: self.disk)
    @rule(base=st.integers(0, 2), cut=st.integers(0, 100), suffix=st.lists(st.integers(0, VOCAB - 1), max_size=20))
    def install_from_disk(self, base, cut, suffix):
        """What the disk tier does for a waiting prompt: its blocks after its memory hits,
        as far as the disk holds them, installed as free cached blocks."""
        tokens = self.bases[base % len(self.bases)][:cut] + suffix
        if len(tokens) < 2:
            return
        seq = make_seq(tokens, "probe")
        hits = self.bm.get_computed_blocks(seq)
        bs = self.bm.block_size
        entries, contents = [], []
        for i in range(len(hits), (len(tokens) - 1) // bs):
            h, parent = seq.block_hashes[i], seq.block_hashes[i - 1] if i else None
            held = self.disk.get(h)
            if held is None or held[:2] != (parent, tuple(tokens[i * bs : (i + 1) * bs])):
                break
            entries.append((h, parent, held[1]))
            contents.append(held[2])
        free_before = self.bm.num_free_blocks
        ids = self.bm.install_cached(entries, keep=hits)
        assert self.bm.num_free_blocks == free_before  # installed blocks are free (cached) ones
        for bid, rows in zip(ids, contents):
            if bid is not None:
                for j, prefix in enumerate(rows):
                    self.kv.slots[(bid, j)] = prefix
        assert self.bm.get_computed_blocks(make_seq(tokens, "again"))[: len(hits)] == hits, "the hits were kept"

    @rule(base=st.integers(0, 2), cut=st.integers(0, 100), suffix=st.lists(st.integers(0, VOCAB - 1), max_size=20),
          chunk=st.integers(1, 64))
    def admit_new(self, base, cut, suffix, chunk):
        tokens = self.bases[base % len(self.bases)][:cut] + suffix
        if not tokens:
            return
        self.n += 1
        self._admit(make_seq(tokens, f"s{self.n}"), chunk)

    @precondition(lambda self: self.parked)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 64))
    def readmit(self, i, chunk):
        self._admit(self.parked.pop(i % len(self.parked)), chunk)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 64), token=st.integers(0, VOCAB - 1))
    def step(self, i, chunk, token):
        seq = self.live[i % len(self.live)]
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(token)  # sampled after the last chunk
        n = min(chunk, seq.num_uncomputed_tokens)
        free_before, table_before = self.bm.num_free_blocks, list(seq.block_table)
        if not self.bm.allocate_slots(seq, n):
            assert seq.block_table == table_before and self.bm.num_free_blocks == free_before
            return
        assert len(seq.block_table) == self.bm.blocks_needed(seq.num_computed_tokens + n)
        self.kv.write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)
        assert seq.block_table == []

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def preempt(self, i):
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        self.parked.append(seq)

    # invariants
    @invariant()
    def integrity(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        bm.check_integrity(self.live + self.parked)
        assert bm.num_free_blocks == sum(b.ref_count == 0 for b in bm.blocks)
        for seq in self.parked:
            assert seq.block_table == []
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
            self.kv.check(seq, seq.num_computed_tokens)
        # a cached block is full, holds its tokens, follows a cached block
        for h, bid in ((h, b) for h, copies in bm.cached.items() for b in copies):
            block = bm.blocks[bid]
            slots = [self.kv.slots.get((bid, j)) for j in range(bm.block_size)]
            assert all(slots) and block.token_ids == tuple(s[-1] for s in slots)
            assert block.parent_hash is None or block.parent_hash in bm.cached

    def teardown(self):
        if not hasattr(self, "bm") or sys.exc_info()[0] is not None:
            return  # a rule already failed: report that, not a consequence of it
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_integrity([])
        assert self.bm.num_free_blocks == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class DiskTierMachine(BlockManagerMachine):
    """The same, with a disk tier always there (caching on, the real hash), so that blocks
    evicted from memory come back through `install_from_disk` and are taken as hits."""

    @initialize(block_size=st.sampled_from([8, 16]), num_blocks=st.integers(3, 12),
                bases=st.lists(token_lists(), min_size=1, max_size=3))
    def setup(self, block_size, num_blocks, bases):
        BlockManagerMachine.setup.__wrapped__(self, block_size, num_blocks, True, None, bases)


TestDiskTierMachine = DiskTierMachine.TestCase
TestDiskTierMachine.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_room_is_the_most_that_allocate_slots_takes():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = make_seq(range(10), "a")
    assert bm.room(a) == 24
    compute(bm, a, 10)  # 3 blocks, the last one half full
    assert bm.room(a) == 2 + 3 * 4  # the rest of its last block and the 3 free ones
    assert bm.can_allocate(a, bm.room(a)) and not bm.can_allocate(a, bm.room(a) + 1)
    bm.free(a)
    b = make_seq(list(range(10)) + [99], "b")
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2  # two full cached blocks, now free: taking them over costs two
    assert bm.room(b, hits) == (2 + 6 - 2) * 4 - 8
    assert bm.can_allocate(b, bm.room(b, hits), hits) and not bm.can_allocate(b, bm.room(b, hits) + 1, hits)
