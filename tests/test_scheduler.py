"""The scheduler as plain Python: known plans, then a hypothesis state machine.

No MLX here: a fake forward stands in for the model. It writes a shadow KV pool (each
slot records the token prefix whose K/V it holds) and checks that every scheduled chunk
reads the right K/V for all its positions, so a plan that recomputes, skips or shares
the wrong blocks fails here, not only in the engine's oracle tests.
"""

from __future__ import annotations

import itertools
import random
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster.worker.block_manager import BlockManager
from cluster.worker.config import EngineConfig
from cluster.worker.sampling_params import SamplingParams
from cluster.worker.pooling import PoolingParams
from cluster.worker.scheduler import POOLING_MAX_PASSED, Scheduler, SchedulerOutput
from cluster.worker.sequence import Sequence, SequenceStatus
from test_block_manager import ShadowKV


def make_scheduler(block_size=16, num_blocks=64, model_max_len=4096, **kw) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, **kw).resolved(model_max_len=model_max_len, num_kv_blocks=num_blocks)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, cfg.enable_prefix_caching))


def add(sched: Scheduler, rid: str, tokens, max_tokens: int = 16) -> Sequence:
    seq = Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    return seq


def step(sched: Scheduler, token: int = 1) -> SchedulerOutput:
    """schedule -> (fake forward) -> postprocess; every sampled row gets `token`.
    The plan comes back with `sampled`: the request ids whose chunk was sampled
    (`ScheduledSeq.sample` is only meaningful before postprocess appends the token)."""
    plan = sched.schedule()
    plan.sampled = [e.seq.request_id for e in plan.scheduled if e.sample]
    sched.postprocess(plan, {id(e.seq): token for e in plan.scheduled if e.sample})
    return plan


def rows(plan: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(e.seq.request_id, e.start, e.num_new_tokens) for e in plan.scheduled]


def live(sched: Scheduler) -> list[Sequence]:
    return list(sched.running) + list(sched.waiting)


# -- known plans -----------------------------------------------------------------------------------


def test_token_budget():
    s = make_scheduler(max_num_batched_tokens=8)
    a = add(s, "A", range(20))
    plans = [step(s) for _ in range(3)]
    assert [rows(p) for p in plans] == [[("A", 0, 8)], [("A", 8, 8)], [("A", 16, 4)]]
    assert [p.sampled for p in plans] == [[], [], ["A"]]  # the chunk that reaches the end
    assert a.num_output_tokens == 1
    b = add(s, "B", range(20))
    c = add(s, "C", range(20))
    for _ in range(20):
        assert step(s).num_batched_tokens <= 8
        s.block_manager.check_integrity(live(s))
    assert b.num_output_tokens >= 1 and c.num_output_tokens >= 1


def test_decode_rows_and_a_prefill_chunk_share_one_plan():
    s = make_scheduler(max_num_batched_tokens=16)
    a = add(s, "A", range(4))
    assert rows(step(s)) == [("A", 0, 4)]
    assert a.token_ids == [0, 1, 2, 3, 1]
    add(s, "B", range(100, 140))
    plan = step(s)
    assert rows(plan) == [("A", 4, 1), ("B", 0, 15)]
    assert plan.sampled == ["A"]
    assert plan.num_batched_tokens == 16


def test_chunked_prefill_never_recomputes_a_position():
    s = make_scheduler(max_num_batched_tokens=16)
    seq = add(s, "A", range(50))
    starts = []
    while seq.num_output_tokens == 0:
        computed = seq.num_computed_tokens
        (entry,) = s.schedule().scheduled
        assert entry.start == computed == seq.num_computed_tokens
        starts.append((entry.start, entry.num_new_tokens, entry.sample))
        s.postprocess(SchedulerOutput([entry]), {id(seq): 7})
    assert starts == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert seq.num_forwarded_tokens == 50 and seq.token_ids == list(range(50)) + [7]


def test_prefix_cache_hit_skips_the_shared_blocks():
    s = make_scheduler(block_size=16)
    shared = list(range(1000, 1032))
    a = add(s, "A", shared + [1, 2, 3])
    step(s)
    b = add(s, "B", shared + [4, 5])
    plan = step(s)
    assert rows(plan) == [("A", 35, 1), ("B", 32, 2)]
    assert b.num_cached_tokens == 32 and b.block_table[:2] == a.block_table[:2]
    assert (s.block_manager.prefix_queries, s.block_manager.prefix_hits) == (35 + 34, 32)


def test_preemption_of_the_newest_running_request():
    # 3 blocks of 8 tokens each for 3 requests of 15 tokens (2 blocks each): the third
    # request's decode at position 16 needs a new block, so someone must go.
    s = make_scheduler(
        block_size=8, num_blocks=6, max_num_partial_prefills=3, max_long_partial_prefills=3, enable_prefix_caching=False
    )
    a, b, c = (add(s, rid, range(i * 100, i * 100 + 15)) for i, rid in enumerate("ABC"))
    assert [r[0] for r in rows(step(s))] == ["A", "B", "C"]  # all admitted in one plan
    step(s)  # decode position 15: still 2 blocks each
    plan = step(s)  # decode position 16: A needs a third block
    assert plan.preempted == [c]  # the newest one, not B
    assert rows(plan) == [("A", 16, 1), ("B", 16, 1)]
    assert c.status is SequenceStatus.WAITING and s.waiting[0] is c
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.token_ids == list(range(200, 215)) + [1, 1]
    s.block_manager.check_integrity(live(s))


def test_preempted_request_recomputes_from_zero_with_its_tokens_intact():
    s = make_scheduler(
        block_size=8, num_blocks=4, max_num_partial_prefills=2, max_long_partial_prefills=2, enable_prefix_caching=False
    )
    a = add(s, "A", range(15))
    b = add(s, "B", range(100, 115))
    assert rows(step(s, token=5)) == [("A", 0, 15), ("B", 0, 15)]
    assert rows(step(s, token=6)) == [("A", 15, 1), ("B", 15, 1)]
    plan = step(s, token=7)
    assert plan.preempted == [b] and rows(plan) == [("A", 16, 1)]  # no room to take B back yet
    assert b.token_ids == list(range(100, 115)) + [5, 6] and s.num_preemptions == 1
    assert rows(step(s, token=8)) == [("A", 17, 1)]
    s.block_manager.check_integrity(live(s))

    s.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert a.block_table == [] and s.block_manager.num_free_blocks == 4
    plan = step(s, token=9)
    assert rows(plan) == [("B", 0, 17)]  # every position again, from 0
    assert plan.sampled == ["B"]
    assert b.token_ids == list(range(100, 115)) + [5, 6, 9]
    assert b.num_forwarded_tokens == 15 + 1 + 17
    s.block_manager.check_integrity(live(s))


def test_short_prompt_behind_two_long_ones_finishes_prefill_first():
    s = make_scheduler(
        max_num_batched_tokens=64,
        max_num_partial_prefills=2,
        max_long_partial_prefills=1,
        long_prefill_token_threshold=32,
    )
    l1 = add(s, "L1", range(200))
    l2 = add(s, "L2", range(1000, 1200))
    short = add(s, "S", range(5000, 5020))
    first = step(s)
    assert {e.seq.request_id for e in first.scheduled} == {"L1", "S"}  # L2 waits: one long at a time
    assert "S" in first.sampled  # S's whole prompt in plan 1
    assert short.num_output_tokens == 1
    assert l1.is_prefilling and l2.is_prefilling and l2.num_computed_tokens == 0
    assert list(s.waiting) == [l2]

    long_at_once = []
    while l1.is_prefilling or l2.is_prefilling:
        step(s)
        prefilling = [q for q in s.running if q.is_prefilling]
        assert len(prefilling) <= 2
        long_at_once.append(sum(s.is_long(q) for q in prefilling))
    assert max(long_at_once) <= 1
    assert l1.num_output_tokens >= 1 and l2.num_output_tokens >= 1


def test_a_burst_of_short_prompts_fills_every_step_first_come_first_served():
    # 16 prompts arrive at once (a closed-loop load's first wave). Each step must spend its
    # whole budget, finishing prompts in arrival order; a step that ran a 51-token share
    # of a partial prefill while the short prompts behind it could not fit was the old bug.
    s = make_scheduler(block_size=16, num_blocks=512, max_num_batched_tokens=256, model_max_len=8192)
    seqs = [add(s, f"P{i}", range(1000 * i, 1000 * i + 206)) for i in range(16)]
    first_token_step = {}
    for n in range(1, 40):
        plan = step(s)
        waiting_before = any(q.is_prefilling for q in seqs)
        for rid in plan.sampled:
            first_token_step.setdefault(rid, n)
        if len(first_token_step) < 16:
            assert plan.num_batched_tokens == 256, rows(plan)
        if not waiting_before:
            break
        s.block_manager.check_integrity(live(s))
    order = sorted(first_token_step, key=lambda r: (first_token_step[r], int(r[1:])))
    assert order == [f"P{i}" for i in range(16)]
    # the whole wave's prefill (16 x 206 tokens, plus one decode row per finished prompt)
    # in as few 256-token steps as the budget allows
    assert first_token_step["P15"] <= -(-(16 * 206 + 15 * 8) // 256)


def test_a_long_prefill_leaves_room_for_short_prompts_and_takes_the_rest():
    s = make_scheduler(block_size=16, num_blocks=512, max_num_batched_tokens=512, model_max_len=8192)
    long = add(s, "L", range(5000))
    assert rows(step(s)) == [("L", 0, 512)]  # alone: the whole budget
    shorts = [add(s, f"S{i}", range(9000 + 300 * i, 9000 + 300 * i + 100)) for i in range(3)]
    plan = step(s)
    # short prompts run whole, up to half the budget (two of them); the long one the rest
    assert rows(plan) == [("L", 512, 312), ("S0", 0, 100), ("S1", 0, 100)]
    plan = step(s)
    assert rows(plan) == [("S0", 100, 1), ("S1", 100, 1), ("L", 824, 410), ("S2", 0, 100)]
    assert [q.num_output_tokens for q in shorts] == [2, 2, 1] and long.is_prefilling
    # with nothing short waiting, the long prefill takes everything but the decodes
    assert rows(step(s)) == [("S0", 101, 1), ("S1", 101, 1), ("S2", 100, 1), ("L", 1234, 509)]


def test_left_over_budget_tops_up_a_partial_prefill_as_far_as_blocks_allow():
    # A short prompt reserved room in the budget but cannot get blocks; the long partial
    # prefill takes the rest of the budget up to the end of its last free block.
    s = make_scheduler(block_size=16, num_blocks=40, max_num_batched_tokens=128, model_max_len=640,
                       long_prefill_token_threshold=64)
    d = add(s, "D", range(400), max_tokens=1000)
    while d.is_prefilling:
        step(s)
    long = add(s, "L", range(2000, 2480))
    assert rows(step(s)) == [("D", 400, 1), ("L", 0, 127)]
    add(s, "S", range(1000, 1040))
    plan = s.schedule()
    assert rows(plan) == [("D", 401, 1), ("L", 127, 97)]  # not 87: S's reservation went back to L
    assert s.block_manager.num_free_blocks == 0 and len(long.block_table) * 16 == 127 + 97
    assert [q.request_id for q in s.waiting] == ["S"]


# -- pooling requests (embeddings, scores) beside generation ---------------------------------------


def add_pooling(sched: Scheduler, rid: str, tokens) -> Sequence:
    seq = Sequence(rid, list(tokens), SamplingParams(max_tokens=1, pooling=PoolingParams()))
    sched.add(seq)
    return seq


def step_and_finish(sched: Scheduler) -> SchedulerOutput:
    """`step`, then what the engine does after it: a pooling request whose last chunk ran
    and a generation request at its max_tokens finish."""
    plan = step(sched)
    for e in plan.scheduled:
        seq, params = e.seq, e.seq.sampling_params
        if (params.pooling is not None and not seq.is_prefilling) or seq.num_output_tokens >= params.max_tokens:
            sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    return plan


def test_embeddings_start_under_a_generation_load_that_never_lets_the_queue_empty():
    """Generation requests queue ahead of unstarted embeddings (generation_first), but only
    so many ahead of the oldest one: a chat load that always has requests waiting does
    not starve an embedding forever."""
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    chats = itertools.count()
    for _ in range(4):
        add(s, f"G{next(chats)}", range(10), max_tokens=3)
    emb = add_pooling(s, "E", range(100, 120))
    started = None
    for n in range(200):
        while sum(q.sampling_params.pooling is None for q in s.waiting) < 4:  # the chats never stop coming
            add(s, f"G{next(chats)}", range(10), max_tokens=3)
        step_and_finish(s)
        if emb.status is not SequenceStatus.WAITING:
            started = n
            break
    assert started is not None, "the embedding never started"
    # it let at most POOLING_MAX_PASSED chats that came after it go ahead (2 run at a time, 3 steps each)
    assert started <= 3 * (4 + POOLING_MAX_PASSED) // 2 + 3, started


def test_a_long_chat_prompt_does_not_wait_for_a_long_embeddings_partial_prefill():
    """A long embedding input is mid-prefill (the one partial prefill allowed); a long chat
    prompt arriving then starts at once beside it instead of waiting for it to finish."""
    s = make_scheduler(max_num_batched_tokens=64, num_blocks=256, model_max_len=2048, max_num_partial_prefills=1,
                       long_prefill_token_threshold=64)
    emb = add_pooling(s, "E", range(1500))
    step_and_finish(s)
    chat = add(s, "G", range(5000, 5300), max_tokens=2)
    plan = step_and_finish(s)
    assert {e.seq.request_id for e in plan.scheduled} == {"E", "G"}, rows(plan)
    assert dict((r, n) for r, _, n in rows(plan))["E"] <= 16  # pooling keeps to its share beside the chat
    while chat.num_output_tokens == 0:
        step_and_finish(s)
    assert emb.is_prefilling  # the chat's first token came long before the embedding's end


def test_an_embeddings_prefill_gives_way_instead_of_preempting_a_chat():
    """Blocks run out while a long embedding input is mid-prefill beside a chat admitted
    after it: the embedding is preempted (it waits for blocks), never the chat, which was
    the newest running request and would have recomputed its prompt and output."""
    s = make_scheduler(max_num_batched_tokens=64, num_blocks=12, model_max_len=192, long_prefill_token_threshold=32)
    emb = add_pooling(s, "E", range(150))
    step_and_finish(s)  # alone: a full-budget chunk
    chat = add(s, "G", range(1000, 1040), max_tokens=100)
    steps = 0
    while s.has_unfinished() and steps < 500:
        step_and_finish(s)
        s.block_manager.check_integrity(live(s))
        steps += 1
    assert chat.status is SequenceStatus.FINISHED_STOPPED and emb.status is SequenceStatus.FINISHED_STOPPED
    assert chat.num_preemptions == 0 and emb.num_preemptions > 0, (chat.num_preemptions, emb.num_preemptions)


@pytest.mark.parametrize(
    "kw, n, message",
    [
        (dict(model_max_len=64, num_blocks=64), 65, "max_model_len=64"),
        (dict(model_max_len=4096, num_blocks=2), 33, r"whole KV pool holds \(32\)"),
        (dict(), 0, "empty"),
    ],
)
def test_add_refuses_a_prompt_that_could_never_run(kw, n, message):
    s = make_scheduler(block_size=16, **kw)
    with pytest.raises(ValueError, match=message):
        add(s, "X", range(n))
    assert not s.has_unfinished()


def test_a_prompt_that_just_fits_is_accepted():
    s = make_scheduler(block_size=16, num_blocks=2, model_max_len=32)
    seq = add(s, "X", range(32), max_tokens=1)
    assert rows(step(s)) == [("X", 0, 32)]
    assert seq.num_output_tokens == 1


def test_abort_and_finish_free_blocks():
    s = make_scheduler(block_size=8, num_blocks=16, max_num_batched_tokens=16)
    a = add(s, "A", range(30))
    b = add(s, "B", range(40, 70))
    step(s)
    assert a.block_table and a.status is SequenceStatus.RUNNING
    s.abort(a)
    s.abort(b)
    assert a.status is SequenceStatus.FINISHED_ABORTED and b.status is SequenceStatus.FINISHED_ABORTED
    assert a.block_table == [] and b.block_table == [] and not s.has_unfinished()
    s.abort(a)  # aborting a finished request does nothing
    assert a.status is SequenceStatus.FINISHED_ABORTED
    s.block_manager.check_integrity([])
    assert s.block_manager.num_used_blocks == 0

    c = add(s, "C", range(10))
    step(s)
    s.finish(c, SequenceStatus.FINISHED_STOPPED)
    assert c.finish_reason == "stop" and c.block_table == [] and s.block_manager.num_used_blocks == 0


# -- the state machine --------------------------------------------------------------------------

def weak_hash(buckets: int):
    """A block hash with few values, the same in every process (hash(None) is not)."""
    return lambda parent, tokens: hash((-1 if parent is None else parent, tuple(tokens))) % buckets


VOCAB = 4  # tiny: prompts and sampled tokens often share prefixes


def token_lists() -> st.SearchStrategy[list[int]]:
    """Runs of one token (so equal blocks are common) or tokens drawn one by one."""
    runs = st.lists(st.tuples(st.integers(0, VOCAB - 1), st.integers(1, 40)), min_size=1, max_size=5)
    return st.one_of(
        runs.map(lambda rs: [t for t, n in rs for _ in range(n)][:100]),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=80),
    )


@st.composite
def configs(draw) -> EngineConfig:
    block_size = draw(st.sampled_from([8, 16, 32]))
    num_blocks = draw(st.integers(1, 12))
    partial = draw(st.integers(1, 3))
    cfg = EngineConfig(
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.one_of(st.integers(1, 8), st.integers(9, 128))),
        enable_prefix_caching=draw(st.booleans()),
        max_num_partial_prefills=partial,
        max_long_partial_prefills=draw(st.integers(1, partial)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 1, 4, 16, 40])),
    )
    # As the engine does: a request never outgrows the pool (max_model_len <= pool tokens).
    pool_tokens = num_blocks * block_size
    model_max_len = draw(st.one_of(st.just(pool_tokens), st.integers(1, pool_tokens)))
    return cfg.resolved(model_max_len=model_max_len, num_kv_blocks=num_blocks)


class SchedulerMachine(RuleBasedStateMachine):
    """Requests are added, aborted, finished and stepped in any order; tiny pools force
    preemption. Each step's plan is checked, then run by a fake forward and postprocess."""

    @initialize(
        cfg=configs(),
        bases=st.lists(token_lists(), min_size=1, max_size=3),
        seed=st.integers(0, 2**32 - 1),
        hash_buckets=st.sampled_from([None, None, 4]),
    )
    def setup(self, cfg, bases, seed, hash_buckets):
        self.cfg = cfg
        self.bm = BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        if hash_buckets:  # a weak hash: prefix-cache hits must still be right
            self.bm.hash_block = weak_hash(hash_buckets)
        self.sched = Scheduler(cfg, self.bm)
        self.bases = bases
        self.rng = random.Random(seed)  # the fake sampler
        self.seqs: list[Sequence] = []  # everything ever added
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}  # what the fake sampler gave each request
        self.admitted: dict[int, int] = {}  # id(seq) -> admission counter (running order)
        self.num_admissions = 0
        self.kv = ShadowKV(self.bm)  # the fake forward's KV pool

    def _step(self) -> SchedulerOutput:
        s, cfg, bs = self.sched, self.cfg, self.cfg.block_size
        running_before = list(s.running)
        had_work = s.has_unfinished()
        computed_before = {id(q): q.num_computed_tokens for q in running_before}

        plan = s.schedule()

        # The plan.
        assert bool(plan.scheduled) == had_work, "a step with work to do scheduled nothing"
        assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        scheduled_ids = [id(e.seq) for e in plan.scheduled]
        assert len(set(scheduled_ids)) == len(scheduled_ids), "a sequence appears twice in a plan"
        preempted = {id(q) for q in plan.preempted}
        assert len(preempted) == len(plan.preempted)
        for e in plan.scheduled:
            q = e.seq
            assert q.status is SequenceStatus.RUNNING and q in s.running
            assert 1 <= e.num_new_tokens and e.end <= q.num_tokens
            assert e.start == q.num_computed_tokens
            assert len(q.block_table) * bs >= e.end
            if id(q) in computed_before and id(q) not in preempted:
                assert e.start == computed_before[id(q)], "a chunk recomputes (or skips) positions"
            else:  # admitted now: from 0, or after whole blocks found in the prefix cache
                assert e.start % bs == 0 and (cfg.enable_prefix_caching or e.start == 0)
                self.num_admissions += 1
                self.admitted[id(q)] = self.num_admissions
        if plan.num_batched_tokens < cfg.max_num_batched_tokens:
            # Budget left over: every running request is in the plan, and a prompt left
            # mid-prefill could not get the block for one more token.
            assert all(id(q) in scheduled_ids for q in s.running), "budget left idle while a request waits"
            for e in plan.scheduled:
                if e.end < e.seq.num_tokens:
                    assert not self.bm.can_allocate(e.seq, e.num_new_tokens + 1), "budget left idle mid-prefill"
        for q in plan.preempted:
            assert q in running_before
            if id(q) not in scheduled_ids:
                assert q.status is SequenceStatus.WAITING and q in s.waiting
                assert q.block_table == [] and q.num_computed_tokens == 0
        kept = [q for q in running_before if id(q) not in preempted]
        for v in plan.preempted:  # the newest running requests go first
            assert all(self.admitted[id(r)] < self.admitted[id(v)] for r in kept if id(r) in self.admitted)
        # Running requests absent from the plan did not move.
        for q in s.running:
            if id(q) not in scheduled_ids:
                assert q.num_computed_tokens == computed_before[id(q)]

        # The forward: write every chunk's K/V, then every chunk reads positions [0, end).
        for e in plan.scheduled:
            self.kv.write(e.seq, e.start, e.end)
        for e in plan.scheduled:
            self.kv.check(e.seq, e.end)

        sampled = {id(e.seq): self.rng.randrange(VOCAB) for e in plan.scheduled if e.sample}
        produced = s.postprocess(plan, sampled)
        assert [id(e.seq) for e in produced] == list(sampled)
        for e in plan.scheduled:
            assert e.seq.num_computed_tokens == e.end
        for e in produced:  # the engine's length check
            q = e.seq
            self.outputs[q.request_id].append(sampled[id(q)])
            if q.num_output_tokens >= q.sampling_params.max_tokens or q.num_tokens >= cfg.max_model_len:
                s.finish(q, SequenceStatus.FINISHED_LENGTH)
        # Prompts left mid-prefill by this step (a prompt whose whole prefill ran is not).
        mid_prefill = [q for q in s.running if q.is_prefilling]
        assert len(mid_prefill) <= cfg.max_num_partial_prefills
        assert sum(s.is_long(q) for q in mid_prefill) <= cfg.max_long_partial_prefills
        return plan

    # -- rules ----------------------------------------------------------------------------------
    def _add(self, tokens: list[int], max_tokens: int) -> None:
        rid = f"r{len(self.seqs)}"
        seq = Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens))
        self.sched.add(seq)
        self.seqs.append(seq)
        self.prompts[rid] = list(tokens)
        self.outputs[rid] = []

    @rule(
        requests=st.lists(
            st.tuples(
                st.integers(0, 2),  # which shared base
                st.integers(0, 100),  # how much of it
                st.lists(st.integers(0, VOCAB - 1), max_size=12),  # own suffix
                st.integers(1, 12),  # max_tokens
            ),
            min_size=1,
            max_size=3,
        )
    )
    def add(self, requests):
        for base, cut, suffix, max_tokens in requests:
            tokens = (self.bases[base % len(self.bases)][:cut] + suffix)[: self.cfg.max_model_len]
            if tokens:
                self._add(tokens, max_tokens)

    @rule(extra=st.integers(0, 20))
    def add_refused(self, extra):
        """An empty prompt, or one longer than max_model_len, is refused and never queued."""
        for n in (0, self.cfg.max_model_len + 1 + extra):
            with pytest.raises(ValueError):
                self.sched.add(Sequence("refused", [0] * n, SamplingParams()))
        assert all(q.request_id != "refused" for q in live(self.sched))

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            self._step()

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        seqs = live(self.sched)
        self.sched.abort(seqs[i % len(seqs)])

    @precondition(lambda self: self.sched.running)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        seq = self.sched.running[i % len(self.sched.running)]
        self.sched.finish(seq, SequenceStatus.FINISHED_STOPPED)

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "sched"):
            return
        s, bs = self.sched, self.cfg.block_size
        self.bm.check_integrity(live(s))
        assert len(s.running) <= self.cfg.max_num_seqs
        assert {id(q) for q in live(s)} == {id(q) for q in self.seqs if not q.is_finished}
        assert len(live(s)) == len({id(q) for q in live(s)})
        for q in self.seqs:
            assert q.token_ids == self.prompts[q.request_id] + self.outputs[q.request_id]
            assert q.num_prompt_tokens == len(self.prompts[q.request_id])
            if q.is_finished:
                assert q.block_table == []
        for q in s.waiting:
            assert q.status is SequenceStatus.WAITING and q.block_table == [] and q.num_computed_tokens == 0
        for q in s.running:
            assert q.status is SequenceStatus.RUNNING
            assert 0 < q.num_uncomputed_tokens  # the last token is always left to compute
            assert len(set(q.block_table)) == len(q.block_table)
            assert len(q.block_table) * bs >= q.num_computed_tokens
            self.kv.check(q, q.num_computed_tokens)

    def teardown(self):
        """Liveness: with no new requests, stepping finishes everything within a bound."""
        if not hasattr(self, "sched") or sys.exc_info()[0] is not None:
            return  # a rule already failed: report that, not a consequence of it
        s = self.sched
        work = sum(q.num_tokens + q.sampling_params.max_tokens for q in live(s))
        bound = 4 * work + 10
        steps = 0
        while s.has_unfinished():
            steps += 1
            assert steps <= bound, f"not drained after {bound} steps"
            self._step()
            self.consistent()
        self.bm.check_integrity([])
        assert self.bm.num_used_blocks == 0
        for q in self.seqs:
            assert q.is_finished and q.block_table == []
            if q.status is SequenceStatus.FINISHED_LENGTH:
                assert q.num_output_tokens == q.sampling_params.max_tokens or q.num_tokens >= self.cfg.max_model_len


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
