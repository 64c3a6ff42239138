"""Hybrid recurrent models (gated delta nets, Mamba-2, short convolutions beside attention
layers, or, in Falcon-H1, a Mamba-2 mixer beside the attention of every layer) under
continuous batching, against mlx-lm's own single-request greedy generation.

Tiny random-weight models of the real mlx-lm architectures (`orchard model create`), CPU,
float32. Prompts of different lengths (one of a single token) arrive together and one per
step; a small step budget chunks the prefills, so a recurrent state is carried from chunk
to chunk, and decode rows of several requests run as one batch beside prefill chunks; a
small pool preempts, so requests are recomputed from their tokens on a fresh slot.
Tokens must equal mlx-lm's and the chosen tokens' logprobs agree within 1e-4.
"""

from __future__ import annotations

import random
from dataclasses import replace

import mlx.core as mx
import pytest

from cluster.modelgen import create_model
from cluster.worker.block_manager import BlockManager
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.sampling_params import SamplingParams
from cluster.worker.scheduler import Scheduler
from cluster.worker.sequence import Sequence, SequenceStatus
from cluster.worker.state_slots import StateSlots

# 3 slots, a 24-token step and 7 blocks of 16 tokens (112) for ~400 tokens of demand
CONFIG = EngineConfig(num_kv_blocks=7, block_size=16, max_num_batched_tokens=24, max_num_seqs=3,
                      max_num_partial_prefills=2, max_long_partial_prefills=2)
LENGTHS = (37, 1, 70, 9, 52, 18)
MAX_TOKENS = (7, 5, 9, 12, 4, 8)
FAMILIES = ["qwen3_next", "qwen3_5", "nemotron_h", "lfm2", "granitemoehybrid", "falcon_h1"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = create_model(root / arch, arch, "tiny", seed=0)
        return made[arch]

    return get


def oracle(model, prompt, max_tokens):
    """mlx-lm's greedy generation: tokens and their logprobs."""
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for (tok, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
        tokens.append(int(tok))
        logprobs.append(lp[int(tok)].item())
    return tokens, logprobs


def serve(engine: Engine, prompts, max_tokens, together: int):
    """The first `together` prompts at once, then one more every step; the engine's
    invariants (blocks and state slots) checked after every step."""
    tokens = {i: [] for i in range(len(prompts))}
    logprobs = {i: [] for i in range(len(prompts))}
    params = lambda i: SamplingParams(max_tokens=max_tokens[i], temperature=0, ignore_eos=True, logprobs=0)  # noqa: E731
    pending = list(range(len(prompts)))
    for i in pending[:together]:
        engine.add_request(str(i), prompts[i], params(i))
    pending = pending[together:]
    most_slots = 0
    while engine.has_unfinished() or pending:
        if pending:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params(i))
        for out in engine.step():
            tokens[int(out.request_id)] += out.new_token_ids
            logprobs[int(out.request_id)] += out.logprobs
        engine.check_integrity()
        most_slots = max(most_slots, engine.stats.state_slots_used)
    return [tokens[i] for i in tokens], [logprobs[i] for i in logprobs], most_slots


def check_family(path, together: int):
    from mlx_lm.utils import load

    engine = Engine.from_pretrained(path, CONFIG)
    assert engine.state_slots is not None and engine.stats.state_slots_total == CONFIG.max_num_seqs
    assert not engine.block_manager.enable_prefix_caching  # off for recurrent layers
    model, _ = load(str(path))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    got, got_lp, most_slots = serve(engine, prompts, MAX_TOKENS, together)
    assert engine.stats.num_preemptions > 0, "the pool was meant to be too small"
    assert most_slots == CONFIG.max_num_seqs
    assert engine.state_slots.num_used == 0 and engine.stats.state_slots_used == 0  # all given back
    for i, prompt in enumerate(prompts):
        want, want_lp = oracle(model, prompt, MAX_TOKENS[i])
        assert got[i] == want, f"prompt {i} ({len(prompt)} tokens)"
        assert max(abs(a - b) for a, b in zip(got_lp[i], want_lp)) < 1e-4, f"prompt {i}"


@pytest.mark.parametrize("arch", FAMILIES)
def test_hybrid_matches_mlx_lm_chunked_batched_preempted(models, arch):
    check_family(models(arch), together=3)


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5", "falcon_h1"])
def test_hybrid_staggered_one_by_one(models, arch):
    check_family(models(arch), together=1)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "nemotron_h", "falcon_h1"])
def test_equal_length_chunks_run_as_one_batch(models, arch):
    """Prompts of one length arriving together: their chunks run through each recurrent
    layer as one [G, L] batch (fresh, then continuing), still mlx-lm's tokens."""
    from mlx_lm.utils import load

    from cluster.worker import recurrent

    path = models(arch)
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=32, block_size=16, max_num_batched_tokens=40,
                                                       max_num_seqs=4, max_num_partial_prefills=4,
                                                       max_long_partial_prefills=4, long_prefill_token_threshold=64))
    shapes = []
    plan_step = recurrent.plan_step

    def spy(scheduled):
        plan = plan_step(scheduled)
        shapes.append([(g.size, g.length, g.continues) for g in plan.groups])
        return plan

    from cluster.worker.kernels import cpu

    recurrences, convolutions, gated_delta, conv = [], [], cpu.gated_delta, cpu.depthwise_conv1d

    def count(calls, fn):
        return lambda *a: calls.append(a[0].shape[:2]) or fn(*a)

    recurrent.plan_step, cpu.gated_delta = spy, count(recurrences, gated_delta)
    cpu.depthwise_conv1d = count(convolutions, conv)
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(4)]
        got = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    finally:
        recurrent.plan_step, cpu.gated_delta, cpu.depthwise_conv1d = plan_step, gated_delta, conv
    assert (2, 20, False) in shapes[0] and [(4, 1, True)] in shapes  # two fresh prompts at once; 4 decodes
    if engine.runner.attention_backend == "cpu":  # the short convolutions (and qwen3_next's recurrence) ran in C
        k = 4  # the tiny models' convolution width: each input carries k - 1 steps of state
        assert (2, 20 + k - 1) in convolutions and (4, k) in convolutions
        gated_delta_family = arch in ("qwen3_next", "qwen3_5")
        assert not gated_delta_family or ((2, 20) in recurrences and (4, 1) in recurrences)
    model, _ = load(str(path))
    for prompt, tokens in zip(prompts, got):
        assert tokens == oracle(model, prompt, 6)[0]


@pytest.mark.parametrize("arch", FAMILIES)
def test_states_written_in_place_equal_the_scatter(models, arch, monkeypatch):
    """With the C kernels each step's new states go into their slots by a memcpy a slot;
    elsewhere (Metal) by MLX's scatter. Two engines on the same requests, one each way,
    step by step: the same state pools bit for bit, and the same tokens."""
    import numpy as np

    from cluster.worker.kernels import cpu

    engines = [Engine.from_pretrained(models(arch), CONFIG) for _ in range(2)]
    if not engines[0].runner.write_kv_in_c:
        pytest.skip("the states are written in place by the C kernels (CPU backend)")
    engines[1].runner.write_kv_in_c = False
    state_pools = {id(p) for c in engines[0].runner.state_caches for p in c.pools if p is not None}
    written, write_kv = [], cpu.write_kv
    monkeypatch.setattr(cpu, "write_kv", lambda pool, *a: written.append(id(pool)) or write_kv(pool, *a))
    rng = random.Random(11)
    for i, n in enumerate(LENGTHS):
        prompt = [rng.randrange(3, 500) for _ in range(n)]
        for e in engines:
            e.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0, ignore_eos=True))
    outputs: list[list] = [[], []]
    for _ in range(300):
        if not engines[0].has_unfinished():
            break
        for e, out in zip(engines, outputs):
            out += [(o.request_id, o.new_token_ids) for o in e.step()]
        for a, b in zip(*(e.runner.state_caches for e in engines)):
            for pa, pb in zip(a.pools, b.pools):
                if pa is not None:
                    np.testing.assert_array_equal(np.asarray(pa), np.asarray(pb))
    assert not engines[0].has_unfinished() and not engines[1].has_unfinished()
    assert outputs[0] == outputs[1] and outputs[0]
    assert state_pools <= set(written)  # the first engine's states went in by the C writer


def test_prefix_caching_is_off_and_abort_frees_the_slot(models, caplog):
    """A shared prefix is recomputed (its recurrent state is not cached); an aborted
    request's slot is free for the next one; the load report counts slots."""
    with caplog.at_level("INFO"):
        engine = Engine.from_pretrained(models("lfm2"), CONFIG)
    assert "prefix caching is off" in caplog.text and "recurrent state: 3 slots of" in caplog.text
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    long = list(range(3, 43))  # two full blocks a prefix cache would hit
    first = engine.generate([long], params)[0]
    prompt = long[:12]
    engine.add_request("a", prompt, params)
    engine.add_request("b", prompt[:8], params)
    engine.step()
    assert engine.stats.state_slots_used == 2
    assert engine.abort("a")
    assert engine.stats.state_slots_used == 1
    engine.check_integrity()
    assert engine.generate([long], params)[0] == first
    assert engine.stats.prefix_hits == 0 and engine.stats.prefix_queries > 0
    assert engine.stats.state_slots_used == 0


def test_state_slots_never_leak_or_double_free():
    """Random adds, aborts, steps (some finishing requests) and preemptions (a pool too
    small for the load) through the scheduler: after every operation, every slot is free
    or held by exactly one running request, and a waiting request holds none."""
    rng = random.Random(0)
    preemptions = 0
    for trial in range(40):
        cfg = EngineConfig(num_kv_blocks=rng.randint(4, 12), block_size=8, max_num_batched_tokens=rng.randint(8, 40),
                           max_num_seqs=rng.randint(1, 5), max_num_partial_prefills=2, max_long_partial_prefills=1)
        cfg = cfg.resolved(model_max_len=cfg.num_kv_blocks * cfg.block_size, num_kv_blocks=cfg.num_kv_blocks)
        bm = BlockManager(cfg.num_kv_blocks, cfg.block_size, enable_prefix_caching=False)
        slots = StateSlots(cfg.max_num_seqs)
        sched = Scheduler(cfg, bm, slots)
        live: list[Sequence] = []
        n = 0
        for _ in range(150):
            op = rng.random()
            if op < 0.3:
                seq = Sequence(f"r{n}", [rng.randrange(100) for _ in range(rng.randint(1, 24))],
                               SamplingParams(max_tokens=rng.randint(1, 20)))
                n += 1
                sched.add(seq)
                live.append(seq)
            elif op < 0.4 and live:
                seq = live.pop(rng.randrange(len(live)))
                sched.abort(seq)
                assert seq.state_slot == -1
            else:
                plan = sched.schedule()
                starts = {id(e.seq): e.start for e in plan.scheduled}
                for seq in plan.preempted:  # waiting without a slot, or admitted again from scratch
                    assert (seq.state_slot == -1 and seq.status is SequenceStatus.WAITING
                            or seq.state_slot >= 0 and starts.get(id(seq)) == 0)
                assert all(e.seq.state_slot >= 0 for e in plan.scheduled)
                assert len({e.seq.state_slot for e in plan.scheduled}) == len(plan.scheduled)
                sched.postprocess(plan, {id(e.seq): 1 for e in plan.scheduled if e.sample})
                for e in plan.scheduled:
                    seq = e.seq
                    if e.sample and seq.num_output_tokens >= seq.sampling_params.max_tokens \
                            or seq.num_tokens >= cfg.max_model_len:
                        sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                        live.remove(seq)
            slots.check_integrity(live)
            bm.check_integrity(live)
            for seq in live:
                assert (seq.state_slot >= 0) == (seq.status is SequenceStatus.RUNNING)
        for seq in list(live):
            sched.abort(seq)
        assert slots.num_free == slots.num_slots and bm.num_free_blocks == bm.num_blocks
        preemptions += sched.num_preemptions
    assert preemptions > 0


def test_a_slot_is_never_freed_twice_nor_by_another():
    slots = StateSlots(2)
    a, b = Sequence("a", [1], SamplingParams()), Sequence("b", [1], SamplingParams())
    assert slots.allocate(a) == 0 and slots.allocate(b) == 1
    with pytest.raises(AssertionError):
        slots.allocate(a)
    slots.free(a)
    slots.free(a)  # holds none now: nothing to free
    b2 = Sequence("b2", [1], SamplingParams())
    b2.state_slot = 1
    with pytest.raises(AssertionError, match="held by b"):
        slots.free(b2)
    slots.check_integrity([b])


@pytest.mark.slow
def test_a_worker_serves_a_hybrid_model_and_reports_its_state_slots(models, worker_process):
    """`orchard worker serve` on a hybrid: the openai client gets mlx-lm's greedy tokens;
    GetLoad and /metrics count the state slots beside the KV blocks."""
    import urllib.request

    import grpc
    import openai
    from mlx_lm.utils import load
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.proto.orchard.v1 import orchard_pb2 as pb
    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

    path = models("lfm2")
    worker = worker_process(path, "--num-kv-blocks", "64", "--max-num-seqs", "4")
    client = openai.OpenAI(base_url=f"http://{worker.http}/v1", api_key="none", max_retries=0, timeout=60)
    model, tokenizer = load(str(path))
    prompt = list(range(5, 45))
    got = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=6,
                                    temperature=0, extra_body={"ignore_eos": True})
    want = oracle(model, prompt, 6)[0]
    assert got.choices[0].text == tokenizer.decode(want) and got.usage.completion_tokens == 6
    with grpc.insecure_channel(worker.grpc) as channel:
        load_report = pb_grpc.WorkerAdminStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10)
    assert (load_report.state_slots_used, load_report.state_slots_total) == (0, 4)
    text = urllib.request.urlopen(f"http://{worker.metrics}/metrics", timeout=10).read().decode()
    gauges = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert gauges["orchard_state_slots_total"] == 4 and gauges["orchard_state_slots_used"] == 0


def test_n_samples_of_a_hybrid_model_each_get_their_own_state(models):
    """n > 1 on recurrent layers: each sample is forked with a slot of its own and
    recomputes the prompt (its state is not in the KV blocks); sample i equals a lone
    request seeded seed + i, and every slot is given back."""
    engine = Engine.from_pretrained(models("qwen3_next"), CONFIG)
    prompt = list(range(5, 37))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("n", prompt, replace(params, n=3))
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.index] += out.new_token_ids
        engine.check_integrity()
    assert engine.stats.state_slots_used == 0
    for i in range(3):
        (alone,) = engine.generate([prompt], replace(params, seed=11 + i))
        assert got[i] == alone, f"sample {i}"
