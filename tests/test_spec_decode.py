"""Speculative decoding: the output is what the engine produces without it.

Greedy requests must come out token for token the same (and equal to mlx-lm's own
generation), seeded sampling too (drafts are verified by sampling each row with the
request's own noise), and sampling from a draft distribution must keep the target
distribution (a chi-square test that a planted bug fails). Every test checks that drafts
were proposed, accepted and rejected, so none of them passes by never speculating.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats as scipy_stats

from cluster.modelgen import create_model, truncated_copy
from cluster.worker.block_manager import BlockManager
from cluster.worker.config import EngineConfig
from cluster.worker import kernels
from cluster.worker.engine import Engine
from cluster.worker.sampling_params import SamplingParams, StructuredOutput
from cluster.worker.spec_decode import verify
from cluster.worker.spec_decode.config import SpeculativeConfig
from cluster.worker.spec_decode.ngram import NgramProposer, find_match
from cluster.worker.spec_decode.policy import SpecPolicy, StepTimes, WallCheck
from cluster.worker.sequence import Sequence
from test_engine import oracle

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    # llama: steps on the host path (host_forward), or through mlx-lm's modules with the
    # reference attention; gemma3_text (sliding windows): through mlx-lm's modules. Seed 0
    # gives outputs that loop at times and wander at others: drafts kept and rejected.
    return {arch: create_model(root / arch, arch, "tiny", seed=0) for arch in ("llama", "gemma3_text")}


@pytest.fixture
def every_draft(monkeypatch):
    """The policy keeps every draft (its own tests are below): each test speculates at
    every step it can, whatever this machine's step times say."""
    monkeypatch.setattr(SpecPolicy, "limits", lambda self, decodes, proposed, rows, decode_rows=None: list(proposed))


def repetitive_prompts(n: int, seed: int, vocab: int = 512) -> list[list[int]]:
    """Prompts made of a repeated random phrase and noise: n-gram lookup finds matches
    in them and in what a random model makes of them (it often loops)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))]
        noise = [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 20))]
        out.append((noise + phrase * rng.randrange(2, 12) + noise[:5])[: 20 + 37 * (i % 6)])
    return out


def run(path, prompts, params_for, spec: str | None = NGRAM, stagger: int = 2, **config):
    """Half the prompts at once, the rest one every `stagger` steps; every step checks the
    block manager. Returns ({(request, index): [tokens, logprobs, text, finish, stop reason]}, engine)."""
    engine = Engine.from_pretrained(path, EngineConfig(speculative_config=spec, **config))
    out: dict = {}
    pending = list(range(len(prompts)))
    for i in pending[: len(prompts) // 2]:
        engine.add_request(f"r{i}", prompts[i], params_for(i))
    pending = pending[len(prompts) // 2 :]
    step = 0
    while engine.has_unfinished() or pending:
        if pending and step % stagger == 0:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], params_for(i))
        for o in engine.step():
            r = out.setdefault((o.request_id, o.index), [[], [], "", None, None])
            r[0] += o.new_token_ids
            r[1] += o.logprobs or []
            r[2] += o.new_text
            if o.finished:
                r[3], r[4] = o.finish_reason, o.stop_reason
                assert o.num_output_tokens == len(r[0])
        engine.check_integrity()
        step += 1
        assert step < 5000
    assert engine.block_manager.num_used_blocks == 0
    return out, engine


def speculated(engine: Engine) -> None:
    """Drafts were proposed, some accepted, some rejected: the run exercised both."""
    s = engine.speculator.stats
    assert s.num_draft_tokens > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens, s


def same(a: dict, b: dict, logprob_tol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        ta, la, xa, fa, sa = a[key]
        tb, lb, xb, fb, sb = b[key]
        assert ta == tb, key
        assert (xa, fa, sa) == (xb, fb, sb), key
        assert len(la) == len(lb) and all(abs(p - q) < logprob_tol for p, q in zip(la, lb)), key


# -- greedy: unchanged, token for token --------------------------------------------------------------


@pytest.mark.parametrize("arch, attention", [("llama", "cpu"), ("llama", "reference"), ("gemma3_text", "cpu")])
def test_greedy_is_unchanged_under_chunking_preemption_and_prefix_caching(models, arch, attention, every_draft,
                                                                          monkeypatch):
    """A 48-token budget chunks every longer prompt, 24 blocks preempt, prompts sharing a
    prefix hit the prefix cache: with drafts the tokens and logprobs are those without,
    and mlx-lm's, on the host path and through mlx-lm's modules."""
    monkeypatch.setattr(kernels, "_forced", attention)
    path = models[arch]
    prompts = repetitive_prompts(12, seed=7)
    shared = prompts[1] + prompts[2][:9]
    prompts += [shared, shared + prompts[3][:7]]  # the last one hits the prefix cache
    max_tokens = [24 + (i * 7) % 19 for i in range(len(prompts))]
    params = lambda i: SamplingParams(max_tokens=max_tokens[i], temperature=0, ignore_eos=True, logprobs=0)  # noqa: E731
    config = dict(num_kv_blocks=24, max_num_batched_tokens=48, max_num_seqs=8, max_num_partial_prefills=2)
    on, engine = run(path, prompts, params, **config)
    off, plain = run(path, prompts, params, spec=None, **config)
    speculated(engine)
    assert engine.stats.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    same(on, off)
    for i in range(0, len(prompts), 3):
        assert on[(f"r{i}", 0)][0] == oracle(path, prompts[i], max_tokens[i])[0], i


def test_stop_strings_stop_ids_max_tokens_and_eos(models, every_draft):
    """Whatever ends a request mid-way through a run of kept drafts ends it at the same
    token, with the same text, as without drafts (the tokens after it are dropped)."""
    path = models["llama"]
    prompts = repetitive_prompts(8, seed=11)
    free, plain = run(path, prompts, lambda i: SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), spec=None)
    eos = sorted(plain.eos_token_ids)
    plans = []
    for i in range(len(prompts)):
        tokens, text = free[(f"r{i}", 0)][0], free[(f"r{i}", 0)][2]
        kind = i % 4
        if kind == 0 and len(text) > 12:  # a stop string from the middle of the text
            plans.append(dict(stop=[text[len(text) // 2 : len(text) // 2 + 3]]))
        elif kind == 1:  # a stop token id from the middle of the output
            plans.append(dict(stop_token_ids=[tokens[len(tokens) // 2]]))
        elif kind == 2:  # the model's EOS (biased up so that it comes)
            plans.append(dict(ignore_eos=False))
        else:
            plans.append(dict(max_tokens=7 + i))

    def params(i):
        kw = dict(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1) | plans[i]
        if i % 4 == 2 and eos:  # bias the EOS token up after some output (the bias applies to every row)
            kw["logit_bias"] = {eos[0]: 9.0}
        return SamplingParams(**kw)

    on, engine = run(path, prompts, params)
    off, _ = run(path, prompts, params, spec=None)
    speculated(engine)
    same(on, off)
    reasons = {v[3] for v in on.values()}
    assert "stop" in reasons and "length" in reasons


def test_penalties_logit_bias_and_logprobs(models, every_draft):
    """Each verify row takes its penalties over the tokens before it (the context and the
    drafts ahead of it), so penalised greedy output and its logprobs are unchanged."""
    path = models["llama"]
    prompts = repetitive_prompts(8, seed=13)
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7), dict(presence_penalty=1.1),
             dict(logit_bias={7: 3.0, 11: -5.0}), dict(frequency_penalty=-0.6)]
    params = lambda i: SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=3 + i % 3,  # noqa: E731
                                      **kinds[i % len(kinds)])
    on, engine = run(path, prompts, params)
    off, _ = run(path, prompts, params, spec=None)
    speculated(engine)
    same(on, off)


def test_structured_outputs(models, every_draft):
    """The grammar's mask for each verify row is its state after the drafts before that
    row, drafts the grammar refuses are never scored, and the matcher ends where it would."""
    path = models["llama"]
    prompts = repetitive_prompts(6, seed=17)
    specs = [StructuredOutput("regex", "(ab|cd|ef)+[0-9]{3}(ab|cd)+"), StructuredOutput("json_object"),
             StructuredOutput("choice", ("apple pie", "apple tart", "pear")),
             StructuredOutput("regex", "(the |a |one )+(cat|dog)( and (the |a )+(cat|dog))*\\.")]
    params = lambda i: SamplingParams(max_tokens=40, temperature=0 if i % 2 else 0.8, seed=i,  # noqa: E731
                                      structured=specs[i % len(specs)], logprobs=0)
    on, engine = run(path, prompts, params)
    off, _ = run(path, prompts, params, spec=None)
    assert engine.speculator.stats.num_draft_tokens > 0
    same(on, off)


def test_seeded_sampling_n_samples_and_per_request_switch(models, every_draft):
    """Sampled rows draw with the request's own noise for each output index: a seeded
    request gets the same tokens with or without drafts, each of n > 1 samples too (the
    samples share the prompt's blocks); `speculative=False` opts one request out."""
    path = models["llama"]
    prompts = repetitive_prompts(6, seed=19)

    def params(i):
        return SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=100 + i, ignore_eos=True,
                              n=3 if i % 3 == 0 else 1, speculative=False if i == 4 else None, logprobs=0)

    on, engine = run(path, prompts, params, num_kv_blocks=64)
    off, _ = run(path, prompts, params, spec=None, num_kv_blocks=64)
    speculated(engine)
    same(on, off)
    assert ("r0", 2) in on


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_resume_after_failover(models, draft, every_draft, method):
    """A request resumed from the tokens another worker sent continues exactly (a draft
    model first catches up on the prompt and the resumed output)."""
    path = models["llama"]
    prompt = repetitive_prompts(3, seed=23)[2]
    spec = NGRAM if method == "ngram" else draft_config(draft)
    for params in (SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=30, temperature=0.9, seed=5, ignore_eos=True)):
        full = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64)).generate([prompt], params)[0]
        engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, speculative_config=spec))
        engine.add_request("r", prompt, params, resume_token_ids=full[:9])
        rest = []
        while engine.has_unfinished():
            for out in engine.step():
                rest += out.new_token_ids
        assert rest == full[9:]
        assert engine.speculator.stats.num_draft_tokens > 0


def test_rollback_frees_the_rejected_positions_blocks(models, every_draft):
    """After each step a speculating request holds blocks for its kept tokens only, and
    the prefix cache holds only blocks of kept tokens."""
    path = models["llama"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, block_size=8, speculative_config=
                                                       json.dumps({"num_speculative_tokens": 12})))
    engine.add_request("r", repetitive_prompts(1, seed=29)[0], SamplingParams(max_tokens=60, temperature=0,
                                                                               ignore_eos=True))
    seq = engine.seqs["r"]
    rejected_steps = 0
    while engine.has_unfinished():
        drafted = engine.speculator.stats.num_draft_tokens
        accepted = engine.speculator.stats.num_accepted_tokens
        engine.step()
        if seq.is_finished:
            break
        assert len(seq.block_table) <= -(-seq.num_tokens // 8)  # nothing past the kept tokens
        assert seq.num_computed_tokens == seq.num_tokens - 1
        bm = engine.block_manager
        for i, bid in enumerate(seq.block_table):
            block = bm.blocks[bid]
            if block.hash is not None:
                assert block.token_ids == tuple(seq.token_ids[i * 8 : (i + 1) * 8])
        new_drafts = engine.speculator.stats.num_draft_tokens - drafted
        rejected_steps += new_drafts > engine.speculator.stats.num_accepted_tokens - accepted
    assert rejected_steps > 0
    engine.check_integrity()


def test_refusals(models, tmp_path, embedding_model_dir):
    with pytest.raises(ValueError, match="mlx-lm drops the multi-token-prediction weights.*deepseek_v3"):
        SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 1}')
    with pytest.raises(ValueError, match="unknown key.*draft_tensor_parallel_size"):
        SpeculativeConfig.parse('{"method": "ngram", "draft_tensor_parallel_size": 1}')
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 16\], got 40"):
        EngineConfig(speculative_config='{"num_speculative_tokens": 40}').validate()
    with pytest.raises(ValueError, match="prompt_lookup_min \\(5\\) is more than prompt_lookup_max \\(3\\)"):
        SpeculativeConfig.parse('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}')
    with pytest.raises(ValueError, match="needs \"model\""):
        SpeculativeConfig.parse('{"method": "draft_model"}')
    assert SpeculativeConfig.parse('{"prompt_lookup_max": 6}').prompt_lookup_min == 6  # vLLM's rule
    assert SpeculativeConfig.parse('{"model": "/m"}').method == "draft_model"
    assert SpeculativeConfig.parse(None) is None
    hybrid = create_model(tmp_path / "lfm2", "lfm2", "tiny", seed=0)
    with pytest.raises(ValueError, match="lfm2.*recurrent layers' state.*cannot be rolled back"):
        Engine.from_pretrained(hybrid, EngineConfig(num_kv_blocks=16, speculative_config=NGRAM))
    plain = Engine.from_pretrained(models["llama"], EngineConfig(num_kv_blocks=16))
    with pytest.raises(ValueError, match="speculative decoding is off on this worker.*--speculative-config"):
        plain.add_request("x", [1, 2, 3], SamplingParams(speculative=True))
    # an embedding model generates nothing to draft: it was accepted, and ignored
    with pytest.raises(ValueError, match="cannot serve tiny-emb: it serves embed requests only.*start it without "
                                         "--speculative-config"):
        Engine.from_pretrained(embedding_model_dir, EngineConfig(num_kv_blocks=16, speculative_config=NGRAM))


def test_speculating_on_an_embedding_model_is_one_clear_line_at_start(embedding_model_dir):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "cluster", "worker", "serve", "--model", str(embedding_model_dir),
                          "--grpc", "127.0.0.1:0", "--metrics", "off", "--speculative-config", NGRAM],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 78 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "speculative decoding cannot serve tiny-emb: it serves embed requests only" in last, last


# -- the pieces ----------------------------------------------------------------------------------------


def test_ngram_lookup():
    ctx = np.array([1, 2, 3, 4, 2, 3, 9, 9, 2, 3], np.int32)
    # longest suffix first: [9, 2, 3] does not occur before; [2, 3] does, latest at 4
    assert find_match(ctx, 2, 3) == (6, 2)
    assert find_match(ctx, 3, 3) == (-1, 0)
    assert find_match(np.array([5, 6, 7, 5, 6], np.int32), 2, 4) == (2, 2)
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    seq = Sequence("s", [10, 11, 12, 13, 14, 15, 50, 11, 12], SamplingParams())
    assert proposer.propose(seq, 3) == [13, 14, 15] and seq.spec_state.kind == "ngram-2"
    seq.token_ids += [13, 14]  # two drafts kept, then 14 (not 15): the source continues no more...
    assert proposer.propose(seq, 2) == [15, 50]  # ...but [13, 14] matches at the same place
    seq.token_ids += [15, 50, 11]
    # the remembered source continues: after [50, 11] comes 12 at index 8 (the latest would be the same)
    assert proposer.propose(seq, 4) == [12, 13, 14, 15] and seq.spec_state.kind == "ngram-continued"
    seq.token_ids += [77, 78]
    assert proposer.propose(seq, 4) == []


def test_block_manager_trim():
    bm = BlockManager(8, 4)
    seq = Sequence("s", list(range(6)), SamplingParams())
    assert bm.allocate_slots(seq, 6 + 9)  # 15 positions: 4 blocks
    seq.num_computed_tokens = 7
    bm.cache_full_blocks(seq)
    bm.trim(seq, 8)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.check_integrity([seq])


def test_step_times_and_policy():
    t = StepTimes()
    assert t(5) is None
    t.observe(1, 0.050)
    t.observe(9, 0.090)
    assert t(5) == pytest.approx(0.070) and t(18) == pytest.approx(0.180) and t(1) == 0.050
    t.observe(9, 0.300)  # a step slowed by other work moves the estimate a little
    assert 0.090 < t(9) < 0.110
    t.observe(9, 0.080)  # a fast one a lot
    assert t(9) < 0.095
    t.observe(4, 0.200)  # noise saying 4 rows cost more than 9: the table stays non-decreasing
    assert t(1) <= t(4) <= t(9) and t(4) == t(9)
    seqs = [Sequence(f"s{i}", [1, 2, 3], SamplingParams()) for i in range(32)]
    # memory-bound (a step costs the same at 1 to 200 rows): every draft pays
    flat = SpecPolicy(4)
    for rows in (1, 8, 32, 64, 200):
        flat.times.observe(rows, 0.05)
    assert flat.limits(seqs[:1], [4], 1) == [4]
    assert flat.limits(seqs, [4] * 32, 32) == [4] * 32
    # compute-bound (10 ms a row, 100 ms a step): at 32 decodes a token costs 13 ms, so a
    # draft accepted 60% of the time does not pay for its row; one accepted 99% of the time
    # does, as far as it is likely
    linear = SpecPolicy(4)
    linear.check.draw = lambda bucket: True  # the table's verdict alone (the wall-clock trial: below)
    for rows in (1, 8, 32, 64, 200):
        linear.times.observe(rows, 0.1 + 0.01 * rows)
    assert linear.limits(seqs, [4] * 32, 32) == [0] * 32
    sure = seqs[0]
    for _ in range(30):
        linear.record(sure, 4, 4)
    assert linear.limits([sure], [4], 32, 32)[0] == 4  # beside 31 decodes that do not speculate
    for seq in seqs[1:]:  # the rest, each with its own record: half its drafts kept
        for _ in range(30):
            linear.record(seq, 4, 1)
    assert linear.limits(seqs[1:], [4] * 31, 31) == [0] * 31
    # beside a 512-row prefill chunk: a step costs 35 ms for its first rows, 4 ms a row past
    # 16. The chunk is no reason to keep 32 decodes' drafts (their rows cost 4 ms each against
    # the decodes' own 3.8 ms a token); one decode's drafts stay worth their rows (35 ms a token).
    roofline = SpecPolicy(4)
    roofline.check.draw = lambda bucket: True
    for rows in (1, 8, 16, 32, 64, 128, 512):
        roofline.times.observe(rows, 0.035 + 0.004 * max(0, rows - 16))
    for seq in seqs:
        for _ in range(30):
            roofline.record(seq, 4, 2)  # 2 of 4 kept: an acceptance of 2/3
    assert roofline.limits(seqs, [4] * 32, 32 + 512, 32) == [0] * 32
    assert roofline.limits(seqs, [4] * 32, 32) == [0] * 32
    assert roofline.limits(seqs[:1], [4], 1 + 512, 1)[0] >= 3  # (the 4th: 0.2 of a token, break-even)


def test_the_table_sees_a_steps_cost_jump_just_past_a_power_of_two():
    """A step's cost jumps where a kernel's tiling adds a tile (MEASUREMENTS.md has one
    machine's figures, which this test's table copies). Calibrated at `CALIBRATION_ROWS`, the table holds 17
    rows' own cost, so one sure request's 4 drafts beside 15 decodes, worth ~3.9 tokens
    for +36% of the step, are dropped; a table that only knew 16 and 24 rows would put
    them at +19% and keep them."""
    from cluster.worker.spec_decode.calibration import CALIBRATION_ROWS

    def cost(rows):
        return 0.08 + 0.0005 * rows + 0.03 * (rows > 16) + 0.03 * (rows > 32)

    seqs = [Sequence(f"s{i}", [1, 2, 3], SamplingParams()) for i in range(16)]
    for _ in range(60):
        for seq in seqs:
            SpecPolicy(4).record(seq, 4, 4)  # every request's own record: all kept
    tables = {}
    for name, rows in (("calibrated", CALIBRATION_ROWS), ("coarse", (1, 2, 4, 8, 16, 24, 32, 48, 64, 128))):
        policy = tables[name] = SpecPolicy(4)
        policy.check.draw = lambda bucket: True  # the table's verdict alone
        for r in rows:
            policy.times.observe(r, cost(r))
    assert tables["calibrated"].times(17) == pytest.approx(cost(17))
    assert tables["calibrated"].times(20) == pytest.approx(cost(20), rel=0.02)
    assert tables["calibrated"].limits(seqs, [4] + [0] * 15, 16) == [0] * 16
    assert tables["coarse"].limits(seqs, [4] + [0] * 15, 16)[0] == 4


@pytest.mark.parametrize("seed", range(5))
def test_wall_check_drops_drafts_that_lose_in_wall_time(seed):
    """A randomized trial by steps, per batch size: drafts that give 1.3x the tokens in 1.5x
    the wall time (what a loaded CPU does to a larger step) are found to lose and dropped,
    but about one step in 8 still tries them; drafts that win keep running, one step in 8
    without. Noise of +-30% per step, and a load that doubles every step's time halfway
    through, leave either verdict wrong on at most 5% of the steps after the first 100
    (over 300 seeds: 19 steps of 500 at worst)."""
    rng = random.Random(seed)
    for gain, slower, pays in ((1.3, 1.5, False), (1.3, 1.1, True)):
        check = WallCheck(seed=1000 + seed)
        b = check.bucket(16)
        kept, wrong = [], 0
        for step in range(600):
            on = check.draw(b)
            kept.append(on)
            load = 1.0 if step < 300 else 2.0
            check.record(b, on, round(16 * gain) if on else 16,
                         0.1 * (slower if on else 1.0) * load * rng.uniform(0.7, 1.3))
            wrong += step >= 100 and check.verdict(b) is not pays
        late = sum(kept[100:]) / 500
        assert wrong <= 25, (gain, slower, wrong)
        assert (0.05 < late < 0.25) if not pays else (0.75 < late < 0.95), (gain, slower, late)
    assert WallCheck.bucket(17) == WallCheck.bucket(32) != WallCheck.bucket(16) == WallCheck.bucket(9)
    # drafts that make a step 10x slower for 1.5x the tokens: tried again far more rarely
    check = WallCheck(seed=seed)
    kept = []
    for step in range(1000):
        on = check.draw(3)
        kept.append(on)
        check.record(3, on, 12 if on else 8, (1.0 if on else 0.1) * rng.uniform(0.7, 1.3))
    assert 0.002 < sum(kept[200:]) / 800 < 0.03 and check.ratio(3) < 0.2


def test_policy_asks_the_wall_clock_only_about_small_gains():
    seqs = [Sequence(f"s{i}", [1, 2, 3], SamplingParams()) for i in range(16)]
    flat = SpecPolicy(4)  # memory-bound: one stream's drafts are a large gain, never put to the trial
    for rows in (1, 8, 32, 64, 200):
        flat.times.observe(rows, 0.05)
    for _ in range(50):
        assert flat.limits(seqs[:1], [4], 1) == [4] and flat.arm is None
    # a step that costs more with every row: 16 decodes' drafts gain a little on the table
    sloped = SpecPolicy(4)
    for rows in (1, 8, 16, 32, 64, 200):
        sloped.times.observe(rows, 0.04 + 0.001 * rows)
    kept_steps = 0
    for step in range(300):
        limits = sloped.limits(seqs, [4] * 16, 16)
        assert sloped.arm is not None and sloped.arm[1] == (sum(limits) > 0)
        kept_steps += sloped.arm[1]
        # on this machine's wall clock the drafts' rows cost 3x what the table says
        drafts = sum(limits)
        sloped.observe_step(0.04 + 0.001 * (16 + drafts), 16 + drafts, sloped.arm, 16 + drafts // 2,
                            0.056 + 0.003 * drafts)
    assert sloped.check.verdict(sloped.check.bucket(16)) is False
    assert kept_steps < 120  # even at first, then one step in 8
    # a step with a prefill chunk beside the decodes follows the verdict, outside the trial
    for _ in range(20):
        assert sloped.limits(seqs, [4] * 16, 16 + 64, 16) == [0] * 16 and sloped.arm is None


@pytest.mark.parametrize("seed", range(5))
def test_wall_check_compares_steps_within_their_block(seed):
    """The trial's lot is even at first and 1 in 8 later. When steps slow down for a
    while for both arms alike (a burst of prompts, a load), most of the slow steps fall
    in whichever arm the lot favours then; comparing steps only within their block keeps
    them from being taken for the drafts' doing. Here drafts win 1.25x throughout, and
    steps 20-80 are 10x slower for both arms."""
    rng = random.Random(seed)
    check = WallCheck(seed=2000 + seed)
    b = check.bucket(32)
    wrong = 0
    for step in range(300):
        on = check.draw(b)
        slow = 10.0 if 20 <= step < 80 else 1.0
        check.record(b, on, 40 if on else 32, 0.1 * slow * rng.uniform(0.8, 1.2))
        wrong += step >= 30 and not check.verdict(b)
    assert wrong <= 70, wrong  # of 270 steps; over 300 seeds: 0 in most, 65 at worst (a noisy early verdict)


def test_step_costs_are_read_with_the_cost_clock(models, monkeypatch):
    """The policy's table is fed in seconds of `cost_clock()`: CPU time on a CPU (which a
    competing process does not inflate, where wall time grows many-fold), wall time on a
    GPU. A fake clock that ticks a fixed amount per read shows every cost the engine
    reports, at start-up and at each step, is read with it and nothing else."""
    import time

    import mlx.core as mx

    from cluster.worker.spec_decode import policy, speculator

    assert policy.cost_clock() is (time.process_time if mx.default_device() == mx.cpu else time.perf_counter)
    ticks = iter(range(0, 10**6, 7))
    monkeypatch.setattr(speculator, "cost_clock", lambda: lambda: next(ticks))
    engine = Engine.from_pretrained(models["llama"], EngineConfig(speculative_config=NGRAM, num_kv_blocks=256))
    engine.warm_up()
    times = engine.speculator.policy.times
    assert times.seconds and set(times.seconds.values()) == {7}  # the calibration, one tick per step
    engine.add_request("a", repetitive_prompts(1, 3)[0], SamplingParams(max_tokens=12, temperature=0.0))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps and set(times.seconds.values()) == {7}  # and every step's
    assert sum(times.samples.values()) >= steps


def test_accept_drafts():
    assert verify.accept_drafts([], [5]) == [5]
    assert verify.accept_drafts([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert verify.accept_drafts([1, 2, 3], [1, 7, 3, 4]) == [1, 7]
    assert verify.accept_drafts([1, 2, 3], [9, 2, 3, 4]) == [9]


# -- sampling: unchanged in distribution ------------------------------------------------------------------


def _first_tokens(p, q, draws: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Draws of rejection sampling's first and second output tokens, the drafts sampled
    from q: `draws` independent requests of one shape."""
    rng = np.random.default_rng(seed)
    R, (k, V) = draws, q.shape
    drafts = np.stack([rng.choice(V, size=R, p=q[j]) for j in range(k)], axis=1)
    tokens, n = verify.rejection_sample(np.broadcast_to(p, (R, k + 1, V)), np.broadcast_to(q, (R, k, V)), drafts, rng)
    assert (n >= 1).all() and (n <= k + 1).all()
    second = np.where(n >= 2, tokens[:, 1], -1)
    return tokens[:, 0], second


def _chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum():
        return 0.0  # drew a token the target gives no probability: the distribution is wrong for sure
    return scipy_stats.chisquare(counts[keep], expected[keep]).pvalue


P = np.array([[0.45, 0.25, 0.15, 0.1, 0.05, 0.0],  # the target at verify rows 0, 1, 2
              [0.1, 0.4, 0.2, 0.2, 0.05, 0.05],
              [0.3, 0.3, 0.2, 0.1, 0.05, 0.05]])
Q = np.array([[0.1, 0.2, 0.3, 0.2, 0.1, 0.1],  # the draft's, far from the target
              [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]])


def _check_distribution(draws: int = 200_000, seed: int = 0) -> float:
    """The p-value of a chi-square test of the first output token's draws against P[0]."""
    first, _ = _first_tokens(P, Q, draws, seed)
    return _chi2_p(np.bincount(first, minlength=6), P[0])


def test_rejection_sampling_keeps_the_target_distribution():
    """200,000 draws of the first token, drafts sampled from a distribution far from the
    target's: a chi-square test does not reject the target distribution (the planted bugs
    below it rejects at p < 0.001). The second token given the first draft was kept, and
    point-mass drafts (n-gram's q), too."""
    assert _check_distribution() > 0.001
    rng = np.random.default_rng(1)
    R = 200_000
    drafts = np.stack([rng.choice(6, size=R, p=Q[0]), rng.choice(6, size=R, p=Q[1])], axis=1)
    tokens, n = verify.rejection_sample(np.broadcast_to(P, (R, 3, 6)), np.broadcast_to(Q, (R, 2, 6)), drafts, rng)
    kept_first = (n >= 2) & (tokens[:, 0] == 1)  # first token 1, accepted as a draft
    assert _chi2_p(np.bincount(tokens[kept_first, 1], minlength=6), P[1]) > 0.001
    onehot = np.zeros((2, 6))
    onehot[0, 3] = onehot[1, 1] = 1.0
    first, _ = _first_tokens(P, onehot, R, 2)
    assert _chi2_p(np.bincount(first, minlength=6), P[0]) > 0.001


PLANTED = {
    "unnormalised residual": ("normalise", lambda w: w),
    "drawn from the target after a rejection, not the residual": ("residual", lambda p, q: p),
    "accepted with probability p(d), q ignored": ("acceptance", lambda pd, qd: pd),
    "residual max(0, q - p)": ("residual", lambda p, q: np.maximum(q - p, 0.0)),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_rejection_sampling_chi_square_catches_planted_bugs(monkeypatch, bug):
    name, wrong = PLANTED[bug]
    monkeypatch.setattr(verify, name, wrong)
    assert _check_distribution() < 0.001, bug


# -- the API, the metrics, a worker ------------------------------------------------------------------


def test_the_api_carries_the_per_request_switch():
    from cluster.api.bodies import ChatBody, CompletionBody
    from cluster.api.errors import InvalidRequest
    from cluster.api.limits import RequestLimits
    from cluster.sdk import build_request
    from cluster.worker.prompt import sampling_params_from_proto

    def make_request(body, chat, request_id):
        return (ChatBody if chat else CompletionBody).parse(body, RequestLimits()).request(request_id, RequestLimits())

    r = make_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "speculative": False}, True, "x")
    assert r.sampling.HasField("speculative") and r.sampling.speculative is False
    assert sampling_params_from_proto(r).speculative is False
    r = make_request({"model": "m", "prompt": "hi"}, False, "y")
    assert not r.sampling.HasField("speculative") and sampling_params_from_proto(r).speculative is None
    assert sampling_params_from_proto(build_request("hi", speculative=True)).speculative is True
    with pytest.raises(InvalidRequest, match="'speculative' must be a bool"):
        make_request({"model": "m", "prompt": "hi", "speculative": "yes"}, False, "z")


def test_metrics_have_vllms_spec_decode_counters():
    from cluster.bench.server_metrics import parse, total
    from cluster.worker.engine import EngineStats
    from cluster.worker.metrics import WorkerMetrics
    from cluster.worker.spec_decode.speculator import SpecStats

    stats = EngineStats(spec_decode=SpecStats(7, 20, 12, [6, 4, 2, 0]))
    values = parse(WorkerMetrics("m", "w", lambda: stats).render().decode())
    assert total(values, "orchard_spec_decode_num_drafts_total") == 7
    assert total(values, "orchard_spec_decode_num_draft_tokens_total") == 20
    assert total(values, "orchard_spec_decode_num_accepted_tokens_total") == 12
    assert total(values, "orchard_spec_decode_num_accepted_tokens_per_pos_total", position="1") == 4
    plain = parse(WorkerMetrics("m", "w", lambda: EngineStats()).render().decode())
    assert not any(n.startswith("orchard_spec_decode") for n, _ in plain)


# -- a draft model -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft(models, tmp_path_factory):
    """The target's first layer with its embedding, norm and head: a weak draft of the same
    tokenizer (the real case: a smaller sibling), so drafts are both kept and rejected."""
    return truncated_copy(models["llama"], tmp_path_factory.mktemp("draft") / "llama-1-layer", 1)


def draft_config(path, k: int = 3) -> str:
    return json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": k})


def test_draft_model_greedy_seeded_and_structured_are_unchanged(models, draft, every_draft):
    """Chunked prefill (the draft catches up on each prompt in pieces), preemption (its
    pool's contents are dropped with the blocks), prefix-cache hits and n > 1 samples (it
    drafts their shared prompt again), structured outputs (greedy drafts, cut to what the
    grammar accepts): every request's tokens are those without speculation."""
    path = models["llama"]
    prompts = repetitive_prompts(10, seed=31)
    shared = prompts[1] + prompts[2][:9]
    prompts += [shared, shared + prompts[3][:7]]

    def params(i):
        if i % 4 == 1:
            return SamplingParams(max_tokens=24, temperature=0.8, seed=i, n=2, ignore_eos=True, logprobs=0)
        if i % 4 == 2:
            return SamplingParams(max_tokens=30, temperature=0, structured=StructuredOutput("json_object"))
        return SamplingParams(max_tokens=20 + i, temperature=0, ignore_eos=True, logprobs=2)

    config = dict(num_kv_blocks=28, max_num_batched_tokens=48, max_num_seqs=8, max_num_partial_prefills=2)
    on, engine = run(path, prompts, params, spec=draft_config(draft), **config)
    off, _ = run(path, prompts, params, spec=None, **config)
    speculated(engine)
    assert engine.stats.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    same(on, off)


def _outcomes(path, spec, params: SamplingParams, prompt: list[int], samples: int, rejects: bool = True) -> dict:
    """How often each output (a tuple of tokens) comes out of `samples` draws (n samples of
    one request at a time). With `spec`, drafts were scored and (`rejects`) some rejected."""
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=256, max_num_seqs=64, speculative_config=spec))
    counts: dict = {}
    for r in range(0, samples, 64):
        engine.add_request(f"q{r}", prompt, replace(params, n=min(64, samples - r)))
        outs: dict = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.index, []).extend(o.new_token_ids)
        for tokens in outs.values():
            counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    if spec is not None and rejects:
        speculated(engine)
    elif spec is not None:  # the planted bug took effect: every draft kept
        s = engine.speculator.stats
        assert 0 < s.num_accepted_tokens == s.num_draft_tokens, s
    return counts


def _same_distribution_p(a: dict, b: dict) -> float:
    """A chi-square test of homogeneity over the outcomes of two samples (rare outcomes pooled)."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, 0) + b.get(k, 0)))
    table = [[a.get(k, 0), b.get(k, 0)] for k in keys]
    while len(table) > 2 and sum(table[-1]) < 10:  # pool the rare tail into one cell
        last = table.pop()
        table[-1] = [table[-1][0] + last[0], table[-1][1] + last[1]]
    return scipy_stats.chi2_contingency(np.array(table).T).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("bug", [None, "drafts always accepted", "unnormalised residual"])
def test_sampled_drafts_keep_the_distribution(models, draft, every_draft, monkeypatch, bug):
    """Unseeded sampled requests draw their drafts from the draft model's q and keep them by
    rejection sampling: 3,000 three-token outputs with drafts against 3,000 without, a
    chi-square test of homogeneity. The real code passes; a planted bug fails at p < 0.001."""
    path = models["llama"]
    prompt = repetitive_prompts(1, seed=37)[0]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    if bug == "drafts always accepted":
        monkeypatch.setattr(verify, "acceptance", lambda pd, qd: np.ones_like(pd))
    elif bug == "unnormalised residual":
        monkeypatch.setattr(verify, "normalise", lambda w: w)
    base = _outcomes(path, None, params, prompt, 3000)
    spec = _outcomes(path, draft_config(draft, 2), params, prompt, 3000, rejects=bug != "drafts always accepted")
    p = _same_distribution_p(base, spec)
    assert (p > 0.001) if bug is None else (p < 0.001), (bug, p)


@pytest.mark.slow
@pytest.mark.parametrize("bug", [None, "drafts always kept"])
def test_sampled_ngram_drafts_keep_the_distribution(models, every_draft, monkeypatch, bug):
    """Unseeded sampled requests with n-gram drafts (point masses): each verify row draws
    with its own noise and the drafts are kept while they match what was drawn, which is
    rejection sampling with q a point mass. 3,000 four-token outputs with drafts against
    3,000 without, a chi-square test of homogeneity: the real code passes; keeping every
    draft fails at p < 0.001. The prompt is a phrase followed by 8 of the model's own
    sampled continuations of it, then the phrase again (answering from a document): the
    continuation drawn now is often one of those, so drafts are kept and rejected."""
    from cluster.worker import step_sampling

    path = models["llama"]
    phrase = repetitive_prompts(1, seed=37)[0][:12]
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)
    plain = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64))
    seen = [plain.generate([phrase], replace(params, max_tokens=6, seed=i))[0] for i in range(8)]
    prompt = [t for s in seen for t in phrase + s] + phrase
    ngram = json.dumps({"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    if bug is not None:
        monkeypatch.setattr(step_sampling, "accept_drafts", lambda drafts, drawn: list(drafts) + [drawn[len(drafts)]])
    base = _outcomes(path, None, params, prompt, 3000)
    spec = _outcomes(path, ngram, params, prompt, 3000, rejects=bug is None)
    p = _same_distribution_p(base, spec)
    assert (p > 0.001) if bug is None else (p < 0.001), (bug, p)


def test_a_worker_speculates_over_http_and_reports_it(tiny_model_dir, worker_process, tiny_worker, tmp_path,
                                                      capsys):
    """`orchard worker serve --speculative-config`: chat completions through the openai
    package come out as they do from a worker without it, a request opts out with
    `speculative: false`, /metrics counts drafts and acceptances, `orchard bench` prints
    the run's acceptance rate from them; a worker without it answers `speculative: true`
    with a 400 saying no worker of the model runs it; the load report names the feature."""
    import urllib.request

    import grpc
    import openai
    from cluster.bench.serve import build_parser as bench_parser, main as bench_main
    from cluster.bench.server_metrics import parse, total
    from cluster.proto.orchard.v1 import orchard_pb2 as pb
    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

    spec = worker_process(tiny_model_dir, "--num-kv-blocks", "512", "--max-model-len", "512",
                          "--speculative-config", NGRAM)
    fast = openai.OpenAI(base_url=f"http://{spec.http}/v1", api_key="none", max_retries=0)
    plain = openai.OpenAI(base_url=f"http://{tiny_worker.http}/v1", api_key="none", max_retries=0)
    text = "apple pear plum " * 12
    body = dict(model="", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    for extra in ({}, {"speculative": False}):
        messages = [{"role": "user", "content": text}]
        got = fast.chat.completions.create(messages=messages, **(body | {"extra_body": body["extra_body"] | extra}))
        want = plain.chat.completions.create(messages=messages, **body)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens == 40
    values = parse(urllib.request.urlopen(f"http://{spec.metrics}/metrics", timeout=10).read().decode())
    assert total(values, "orchard_spec_decode_num_draft_tokens_total") > 0
    assert total(values, "orchard_spec_decode_num_accepted_tokens_total") >= 0
    with pytest.raises(openai.BadRequestError, match="no worker of model 'tiny-qwen3' runs speculative decoding") as e:
        plain.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                      **(body | {"extra_body": {"speculative": True}}))
    assert "--speculative-config" not in str(e.value)
    # what the router places by: the worker's load report names the feature
    with grpc.insecure_channel(spec.grpc) as ch, grpc.insecure_channel(tiny_worker.grpc) as ch2:
        assert list(pb_grpc.WorkerAdminStub(ch).GetLoad(pb.GetLoadRequest(), timeout=30).features) == ["speculative"]
        assert not pb_grpc.WorkerAdminStub(ch2).GetLoad(pb.GetLoadRequest(), timeout=30).features
    # `orchard bench` against it: the acceptance rate of its run's drafts (/metrics after - before)
    before = parse(urllib.request.urlopen(f"http://{spec.metrics}/metrics", timeout=10).read().decode())
    result = tmp_path / "bench.json"
    args = bench_parser().parse_args(
        ["--disable-tqdm", "--target", spec.grpc, "--tokenizer", str(tiny_model_dir), "--dataset", "prefix-repetition",
         "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
         "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "24", "--num-prompts", "8",
         "--max-concurrency", "4", "--ignore-eos", "--metrics-url", spec.metrics, "--result-file", str(result)])
    assert bench_main(args) == 0
    after = parse(urllib.request.urlopen(f"http://{spec.metrics}/metrics", timeout=10).read().decode())
    drafted, accepted = (total(after, name) - total(before, name)
                         for name in ("orchard_spec_decode_num_draft_tokens_total",
                                      "orchard_spec_decode_num_accepted_tokens_total"))
    server = json.loads(result.read_text())["server"]
    assert drafted > 0 and server["spec_draft_tokens"] == drafted and server["spec_accepted_tokens"] == accepted
    assert server["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    printed = capsys.readouterr().out
    rate = re.search(r"^Spec-decode acceptance rate \(%\):\s+([0-9.]+)\s*$", printed, re.M)
    assert rate and float(rate.group(1)) == pytest.approx(100 * accepted / drafted, abs=0.01), printed
    assert "Acceptance by draft position (%):" in printed


@pytest.mark.slow
def test_failover_resumes_a_speculating_stream(tiny_model_dir, tiny_worker, tmp_path):
    """A router and two workers with `--speculative-config`, 12 greedy streams; kill -9 of
    the worker serving most of them mid-stream: the router resumes each on the other,
    which speculates on from the tokens already sent. Every stream's tokens are those of
    a worker without speculation."""
    import asyncio
    import os
    import signal
    import urllib.request

    import grpc
    from cluster.bench.server_metrics import parse, total
    from cluster.proto.orchard.v1 import orchard_pb2 as pb
    from cluster.proto.orchard.v1 import orchard_pb2_grpc as pb_grpc
    from cluster.up import LocalCluster, free_ports

    prompts = [f"Stream {i}: the router keeps every token of" for i in range(12)]
    max_tokens = 300  # still running when about 16 tokens of each have arrived
    killed: list[int] = []

    async def streams(target: str, kill=None) -> list[list[int]]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = pb_grpc.GenerationStub(ch)
            seen, serving = [0], {}

            async def one(i: int, text: str) -> list[int]:
                req = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                               ignore_eos=True))
                tokens = []
                async for c in stub.Generate(req):
                    tokens += c.token_ids
                    seen[0] += len(c.token_ids)
                    serving[i] = c.worker_id
                    if c.finish_reason:
                        serving.pop(i, None)
                    if kill is not None and not killed and serving and seen[0] >= 12 * 16:
                        busiest = max(set(serving.values()), key=list(serving.values()).count)
                        killed.append(int(busiest.split("-")[1]))
                        kill(killed[0])
                return tokens

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    def run(coro):
        return asyncio.run(asyncio.wait_for(coro, 300))

    reference = run(streams(tiny_worker.grpc))
    grpc_port, http_port, metrics_port = free_ports(3)
    with LocalCluster(tiny_model_dir, workers=2, grpc_address=f"127.0.0.1:{grpc_port}",
                      http_address=f"127.0.0.1:{http_port}", metrics_address=f"127.0.0.1:{metrics_port}",
                      worker_port_base=0, worker_metrics_port_base=0, log_dir=tmp_path / "logs",
                      router_args=["--heartbeat-interval", "0.2"],
                      worker_args=["--num-kv-blocks", "1024", "--max-num-seqs", "64", "--speculative-config", NGRAM]
                      ) as c:

        def scrape(address: str) -> list:
            return parse(urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode())

        drafts_before = [total(scrape(m), "orchard_spec_decode_num_draft_tokens_total") for m in c.worker_metrics]
        got = run(streams(c.router_address, kill=lambda w: os.kill(c.workers[w].proc.pid, signal.SIGKILL)))
        assert killed
        survivor = 1 - killed[0]
        assert got == reference
        assert all(len(t) == max_tokens for t in got)
        resumed = total(scrape(c.metrics_address), "orchard_router_retries_total", kind="resume")
        assert resumed >= 1
        drafted = total(scrape(c.worker_metrics[survivor]), "orchard_spec_decode_num_draft_tokens_total")
        assert drafted > drafts_before[survivor]


def test_orchard_bench_reads_the_acceptance_rate():
    from cluster.bench.server_metrics import ServerMetricsSampler, ServerSample, parse
    from cluster.worker.engine import EngineStats
    from cluster.worker.metrics import WorkerMetrics
    from cluster.worker.spec_decode.speculator import SpecStats

    spec = SpecStats(2, 8, 5, [2, 2, 1, 0])
    metrics = WorkerMetrics("m", "w0", lambda: EngineStats(spec_decode=spec))
    s = ServerMetricsSampler(["127.0.0.1:1"])
    url = s.urls[0]
    s._before[url] = before = parse(metrics.render().decode())
    spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens = 12, 48, 30  # the run: 10 rounds, 40 drafts
    spec.accepted_per_pos = [10, 9, 6, 0]
    after = parse(metrics.render().decode())
    s.samples = [ServerSample(0.0, url, before), ServerSample(1.0, url, after)]
    summary = s.summarize({url: after})
    assert summary.spec_draft_tokens == 40 and summary.spec_accepted_tokens == 25
    assert summary.spec_acceptance_rate == pytest.approx(25 / 40)
    assert summary.spec_acceptance_by_position == pytest.approx([0.8, 0.7, 0.5, 0.0])
