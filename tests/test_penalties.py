"""Presence, frequency and repetition penalties and logit bias: the sampler against a
numpy reference on mixed batches, the engine against mlx-lm's logits re-processed in
numpy, and bias that moves greedy output as OpenAI specifies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cluster.modelgen import create_model
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.sampler import Sampler, process_logits
from cluster.worker.sampling_params import SamplingParams

V = 96


def reference(logits: np.ndarray, p: SamplingParams, tokens: list[int], num_prompt: int) -> np.ndarray:
    """vLLM's order: bias, then the repetition penalty over prompt + output, then the
    frequency and presence penalties over the output."""
    x = logits.astype(np.float64).copy()
    for t, b in p.logit_bias:
        x[t] += b
    seen = np.zeros(len(x), bool)
    seen[tokens] = True
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    counts = np.bincount(tokens[num_prompt:], minlength=len(x)).astype(np.float64)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, presence_penalty=1.5),
    SamplingParams(temperature=0, frequency_penalty=-0.7),
    SamplingParams(temperature=0, repetition_penalty=1.8),
    SamplingParams(temperature=0, logit_bias={3: 100.0, 7: -100.0, 95: 2.5}),
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5,
                   logit_bias={0: -1.0}),
]


def test_processed_logits_match_numpy_on_a_mixed_batch():
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((len(MIXED), V)).astype(np.float32) * 4
    histories = []
    for i in range(len(MIXED)):
        n = int(rng.integers(1, 20))
        histories.append((rng.integers(0, V, n + int(rng.integers(0, 30))).tolist(), n))
    out = np.array(process_logits(mx.array(raw), MIXED, histories))
    for i, p in enumerate(MIXED):
        expected = reference(raw[i], p, *histories[i])
        np.testing.assert_allclose(out[i], expected, rtol=1e-6, atol=1e-5)
        if not p.processes_logits:
            assert np.array_equal(out[i], raw[i])  # untouched, bit for bit


def test_bitmask_rows_only_allow_their_tokens():
    raw = np.random.default_rng(1).standard_normal((3, V)).astype(np.float32)
    words = (V + 31) // 32
    mask = np.zeros((2, words), np.int32)
    allowed = {0: [5, 40, 95], 2: [31, 32, 63]}
    for r, row in enumerate((0, 2)):
        for t in allowed[row]:
            mask[r, t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-2**31)
    res = Sampler()(mx.array(raw), [SamplingParams(temperature=0, logprobs=5)] * 3, [0] * 3, None, mask, [0, 2])
    for row in (0, 2):
        assert res.token_ids[row] == max(allowed[row], key=lambda t: raw[row, t])
        assert {t for t, _ in res.top_logprobs[row]} == set(allowed[row])  # -inf ones are never listed
    assert res.token_ids[1] == int(np.argmax(raw[1]))


def test_logprobs_are_the_processed_ones():
    raw = np.random.default_rng(2).standard_normal((2, V)).astype(np.float32)
    params = [SamplingParams(temperature=0, logprobs=2, logit_bias={9: 100.0}),
              SamplingParams(temperature=0, logprobs=2)]
    res = Sampler()(mx.array(raw), params, [0, 0], [([1, 2], 1), ([1, 2], 1)])
    assert res.token_ids == [9, int(np.argmax(raw[1]))]
    x = reference(raw[0], params[0], [1, 2], 1)
    assert abs(res.logprobs[0] - (x[9] - np.log(np.exp(x).sum()))) < 1e-4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = create_model(tmp_path_factory.mktemp("pen") / "qwen3", "qwen3", "tiny", seed=3)
    return Engine.from_pretrained(path, EngineConfig(num_kv_blocks=128, max_model_len=512)), path


def test_bias_moves_greedy_output(engine):
    eng, _ = engine
    prompt = [5, 17, 99, 230, 41]
    base = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    banned = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                   logit_bias={base[0]: -100.0}))[0]
    assert banned[0] != base[0]
    forced = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                   logit_bias={321: 100.0}))[0]
    assert forced == [321] * 4


def test_penalised_greedy_equals_numpy_over_mlx_lm_logits(engine):
    """Each token of a penalised greedy run is the argmax of mlx-lm's logits for that
    prefix after the numpy reference's penalties; repetition drops measurably."""
    from mlx_lm.utils import load

    eng, path = engine
    model, _ = load(str(path))
    prompt = [7, 7, 12, 40, 7, 300, 12]
    n = 24
    plain = eng.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.6,
                       repetition_penalty=1.3)
    rid = "pen"
    eng.add_request(rid, prompt, SamplingParams(**{**p.__dict__, "logprobs": 0}))
    got, lps = [], []
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
            lps += o.logprobs
    for i, tok in enumerate(got):
        tokens = prompt + got[:i]
        raw = np.array(model(mx.array([tokens]))[0, -1].astype(mx.float32))
        x = reference(raw, p, tokens, len(prompt))
        assert tok == int(np.argmax(x)), f"step {i}"
        assert abs(lps[i] - (x[tok] - np.log(np.exp(x - x.max()).sum()) - x.max())) < 1e-3
    repeats = lambda out: len(out) - len(set(out))  # noqa: E731
    print(f"repeated tokens in {n}: {repeats(plain)} plain, {repeats(got)} penalised")
    assert repeats(got) < repeats(plain)
