"""Sampler filters and seeds; incremental detokenization; the model factory."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer

from cluster.modelgen import create_model, num_parameters
from cluster.worker.detokenizer import IncrementalDetokenizer
from cluster.worker.sampler import Sampler
from cluster.worker.sampling_params import SamplingParams


def _logits(rows: int, vocab: int = 64, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((rows, vocab)).astype(np.float32) * 3)


def test_greedy_rows_take_the_argmax_and_report_logprobs():
    logits = _logits(4)
    res = Sampler()(logits, [SamplingParams(temperature=0, logprobs=3)] * 4, [0] * 4)
    assert res.token_ids == np.argmax(np.array(logits), axis=-1).tolist()
    ref = np.array(logits) - np.log(np.exp(np.array(logits)).sum(-1, keepdims=True))
    assert np.allclose(res.logprobs, ref[np.arange(4), res.token_ids], atol=1e-5)
    for row, top in enumerate(res.top_logprobs):
        assert [t for t, _ in top] == np.argsort(-ref[row])[:3].tolist()


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(temperature=1.0, top_k=3), lambda lg, p: np.argsort(-lg)[:3]),
        (SamplingParams(temperature=1.0, top_p=0.5),
         lambda lg, p: np.argsort(-p)[: np.searchsorted(np.cumsum(np.sort(p)[::-1]), 0.5) + 1]),
        (SamplingParams(temperature=1.0, min_p=0.3), lambda lg, p: np.nonzero(p >= 0.3 * p.max())[0]),
    ],
)
def test_filters_only_ever_pick_allowed_tokens(params, allowed):
    sampler = Sampler(seed=3)
    logits = _logits(8, seed=1)
    lg = np.array(logits)
    probs = np.exp(lg - lg.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    seen = [set() for _ in range(8)]
    for step in range(40):
        res = sampler(logits, [params] * 8, [step] * 8)
        for row, tok in enumerate(res.token_ids):
            assert tok in set(allowed(lg[row], probs[row]).tolist()), (row, tok)
            seen[row].add(tok)
    assert any(len(s) > 1 for s in seen), "sampling should not be greedy"


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = _logits(3, vocab=256, seed=4)
    seeded = SamplingParams(temperature=1.0, seed=42)
    a = Sampler(seed=1)(logits, [seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0)], [5, 0, 0])
    b = Sampler(seed=2)(logits[::-1], [SamplingParams(temperature=0), SamplingParams(temperature=2.0), seeded],
                        [0, 9, 5])
    assert a.token_ids[0] == b.token_ids[2]


def test_sampling_params_validation_messages():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))  # would turn every logit into NaN
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    assert SamplingParams(stop="x").stop == ("x",)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return create_model(tmp_path_factory.mktemp("m") / "tiny", "qwen3", "tiny", seed=0)


class _Tok:
    def __init__(self, path):
        self.t = Tokenizer.from_file(str(path / "tokenizer.json"))

    def decode(self, ids, skip_special_tokens=True):
        return self.t.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, s):
        return self.t.encode(s).ids


def test_incremental_detokenizer_is_utf8_safe(tiny_dir):
    tok = _Tok(tiny_dir)
    text = "Caf\u00e9 \u4f60\u597d \U0001f34e and more words, 42!"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], ())
    deltas = []
    for t in ids:
        d.add(t)
        deltas.append(d.take_delta())
    deltas.append(d.take_delta(final=True))
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_stop_string_is_cut_and_never_streamed(tiny_dir):
    tok = _Tok(tiny_dir)
    text = "one two three STOP four"
    d = IncrementalDetokenizer(tok, [], ("STOP",))
    streamed = ""
    for t in tok.encode(text):
        hit = d.add(t)
        streamed += d.take_delta(final=hit is not None)
        if hit:
            break
    assert hit == "STOP"
    assert streamed == "one two three "


def test_model_create_is_deterministic_and_tiny(tmp_path, tiny_dir):
    again = create_model(tmp_path / "again", "qwen3", "tiny", seed=0)
    other = create_model(tmp_path / "other", "qwen3", "tiny", seed=1)
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(again) == digest(tiny_dir) != digest(other)
    assert (again / "tokenizer.json").read_text() == (tiny_dir / "tokenizer.json").read_text()
    assert num_parameters(tiny_dir) < 1_000_000
