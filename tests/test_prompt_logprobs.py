"""Prompt logprobs and n > 1 in the engine, against mlx-lm's model run dense over the
whole prompt (the oracle): log-softmax in float32, each prompt token given its prefix."""

from __future__ import annotations

import random
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from cluster.modelgen import create_model
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.sampling_params import SamplingParams

ARCHS = ("qwen3", "gemma3_text")  # dense; sliding-window layers


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plp-models")
    return {arch: create_model(root / arch, arch, "tiny", seed=2) for arch in ARCHS}


_oracles: dict = {}


def dense_logprobs(path, prompt: list[int]) -> np.ndarray:
    """[len(prompt), vocab] float32 log-softmax of mlx-lm's logits, one dense forward."""
    if path not in _oracles:
        _oracles[path] = load(str(path))[0]
    logits = _oracles[path](mx.array(prompt)[None]).astype(mx.float32)[0]
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Add every request, step to the end; per request id: outputs in order."""
    for rid, (p, params) in requests.items():
        engine.add_request(rid, p, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
        engine.check_integrity()
        steps += 1
        assert steps < 5000
    return outs


def check_against_oracle(path, p: list[int], got, k: int) -> None:
    ref = dense_logprobs(path, p)
    assert [t for t, _, _ in got] == p[1:]  # the first prompt token has none (as in vLLM)
    want = ref[np.arange(len(p) - 1), p[1:]]
    np.testing.assert_allclose([lp for _, lp, _ in got], want, atol=1e-4)
    for pos, (_, _, top) in enumerate(got):
        assert len(top) == k
        order = np.argsort(-ref[pos])[:k]
        np.testing.assert_allclose([v for _, v in top], ref[pos][order], atol=1e-4)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        for tid, v in top:  # ids may swap where two values tie within rounding
            assert abs(ref[pos][tid] - v) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [512, 24])  # one chunk; chunks that cut the prompt mid-block
def test_prompt_logprobs_match_a_dense_forward(model_dirs, arch, budget):
    path = model_dirs[arch]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=128, max_num_batched_tokens=budget))
    prompts = {"a": prompt(70, 1), "b": prompt(5, 2), "c": prompt(2, 3)}
    plain = prompt(40, 4)
    requests = {rid: (p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=k))
                for (rid, p), k in zip(prompts.items(), (3, 0, 5))}
    requests["plain"] = (plain, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = run(engine, requests)
    for (rid, p), k in zip(prompts.items(), (3, 0, 5)):
        first = outs[rid][0]
        check_against_oracle(path, p, first.prompt_logprobs, k)
        assert all(o.prompt_logprobs is None for o in outs[rid][1:])  # handed out once
    assert all(o.prompt_logprobs is None for o in outs["plain"])
    # the same tokens as without prompt logprobs (only more rows reached the head)
    alone = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=128)).generate(
        list(prompts.values()), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [sum((o.new_token_ids for o in outs[rid]), []) for rid in prompts] == alone


def test_prompt_rows_per_step_are_bounded(model_dirs, monkeypatch):
    """At most MAX_PROMPT_LOGPROB_ROWS prompt rows reach the LM head a step (the step's
    logits stay bounded); the prompt is cut into more chunks and the logprobs are exact."""
    from cluster.worker import scheduler

    monkeypatch.setattr(scheduler, "MAX_PROMPT_LOGPROB_ROWS", 40)
    path = model_dirs["qwen3"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=128, max_num_batched_tokens=256))
    rows = []
    forward = engine.runner.forward
    engine.runner.forward = lambda batch: (rows.append(len(batch.logit_rows.tolist())), forward(batch))[1]
    prompts = {"a": prompt(150, 10), "b": prompt(90, 11)}
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = run(engine, {rid: (p, params) for rid, p in prompts.items()} | {"plain": (prompt(100, 12), SamplingParams(
        max_tokens=2, temperature=0))})
    assert max(rows) <= 40 + 3  # + each sequence's sampled row
    for rid, p in prompts.items():
        check_against_oracle(path, p, outs[rid][0].prompt_logprobs, 1)


def test_a_prefix_cache_hit_is_bypassed_for_prompt_logprobs(model_dirs):
    path = model_dirs["qwen3"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=128))
    p = prompt(50, 5)
    engine.generate([p], SamplingParams(max_tokens=2, temperature=0))  # caches 3 full blocks
    engine.add_request("plp", p, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    seq = engine.seqs["plp"]
    got = None
    while engine.has_unfinished():
        for o in engine.step():
            got = got or o.prompt_logprobs
    check_against_oracle(path, p, got, 2)
    assert seq.num_cached_tokens == 0 and seq.num_forwarded_tokens == len(p) + 1
    # a plain request still hits the cache
    engine.add_request("hit", p, SamplingParams(max_tokens=2, temperature=0))
    hit = engine.seqs["hit"]
    while engine.has_unfinished():
        engine.step()
    assert hit.num_cached_tokens == 48


def test_prompt_logprobs_survive_a_preemption(model_dirs):
    """A request preempted mid-prefill recomputes its prompt: each logprob is reported once."""
    path = model_dirs["qwen3"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=10, max_num_batched_tokens=16,
                                                       enable_prefix_caching=False))
    p = prompt(60, 6)
    engine.add_request("decoder", prompt(100, 7), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    while not engine.seqs["decoder"].num_output_tokens:
        engine.step()
    engine.step()
    engine.add_request("plp", p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1))
    got = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "plp" and o.prompt_logprobs is not None:
                assert got is None
                got = o.prompt_logprobs
        engine.check_integrity()
    assert engine.stats.num_preemptions > 0
    check_against_oracle(path, p, got, 1)


def collect(outs) -> dict[int, list[int]]:
    by_index: dict[int, list[int]] = {}
    for o in outs:
        by_index.setdefault(o.index, []).extend(o.new_token_ids)
    return by_index


@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_share_the_prompt_and_each_has_its_own_seed(model_dirs, caching):
    path = model_dirs["qwen3"]
    p = prompt(70, 8)
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, enable_prefix_caching=caching))
    engine.add_request("n", p, SamplingParams(max_tokens=6, temperature=1.0, seed=100, ignore_eos=True, n=4))
    parent = engine.seqs["n"]
    outs = []
    children = {}
    while engine.has_unfinished():
        outs += engine.step()
        children.update({s.index: s for s in engine.seqs.values() if s.group_id == "n"})
        engine.check_integrity()
    got = collect(outs)
    assert sorted(got) == [0, 1, 2, 3] and all(o.request_id == "n" for o in outs)
    assert sum(o.finished for o in outs) == 4
    # sample i is what a lone request with seed 100 + i gives
    for i in range(4):
        alone = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64)).generate(
            [p], SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i, ignore_eos=True))[0]
        assert got[i] == alone, i
    assert len({tuple(v) for v in got.values()}) > 1
    # the prompt was forwarded once; each fork only its tail past the last full block
    assert parent.num_forwarded_tokens == len(p) + 5
    for i in (1, 2, 3):
        assert children[i].num_forwarded_tokens == len(p) - 64 + 5
    assert engine.block_manager.num_used_blocks == 0


def test_n_with_greedy_gives_n_equal_samples_and_abort_stops_them_all(model_dirs):
    path = model_dirs["qwen3"]
    p = prompt(20, 9)
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64))
    outs = run(engine, {"g": (p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=3, prompt_logprobs=0))})
    got = collect(outs["g"])
    assert got[0] == got[1] == got[2]
    assert sum(o.prompt_logprobs is not None for o in outs["g"]) == 1  # once, with index 0
    engine.add_request("x", p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, n=3))
    for _ in range(3):
        engine.step()
    assert len(engine.seqs) == 3
    assert engine.live_request_ids() == ["x"]
    assert engine.abort("x")
    assert not engine.seqs and not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    engine.check_integrity()


@pytest.mark.parametrize("caching", [True, False])
def test_waiting_samples_cannot_wedge_a_small_pool(model_dirs, caching):
    """Forked samples wait holding their prompt's blocks; when everything running has
    been preempted and the head of the queue does not fit, those blocks are given back
    (the samples recompute): the engine finishes everything, a request sent later
    included, with exactly the tokens of lone seeded requests."""
    path = model_dirs["qwen3"]
    cfg = EngineConfig(num_kv_blocks=6, block_size=16, max_num_batched_tokens=256, max_num_seqs=2,
                       enable_prefix_caching=caching)
    engine = Engine.from_pretrained(path, cfg)
    a, b = prompt(40, 0), prompt(20, 1)
    sa = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request("a", a, replace(sa, n=3))
    engine.add_request("b", b, SamplingParams(max_tokens=30, temperature=1.0, seed=9, ignore_eos=True))
    outs = []
    for step in range(600):
        if step == 150:
            engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        if not engine.has_unfinished() and step > 150:
            break
        outs += engine.step()
        engine.check_integrity()
    assert not engine.has_unfinished(), "wedged"
    assert engine.stats.num_preemptions > 0  # the pool was meant to be too small
    got = collect([o for o in outs if o.request_id == "a"])
    lone = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64))
    for i in range(3):
        assert got[i] == lone.generate([a], replace(sa, seed=3 + i))[0], i
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "late") == 3
