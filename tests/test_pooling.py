"""Pooling requests (embeddings, reranker scores) in the engine, against mlx-lm's own forward.

The oracle: mlx-lm's model loaded on its own (`mlx_lm.utils.load`), run on one input
without Orchard's paged cache, its final hidden states (`model.model(x)`, after the last
norm) pooled as sentence-transformers would, or for a reranker its last logits.
"""

from __future__ import annotations

import json
import random
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from cluster.modelgen import create_model, set_pooling
from cluster.worker import kernels
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine, QueueFullError
from cluster.worker.pooling import Pooler, PoolingParams, UnsupportedPooling, yes_no_prompt
from cluster.worker.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedding_model_dir, reranker_model_dir):
    root = tmp_path_factory.mktemp("pooling")
    emb = embedding_model_dir
    out = {"last": emb, "reranker": reranker_model_dir}
    for mode, name in (("mean_tokens", "mean"), ("cls_token", "cls"), ("max_tokens", "max")):
        out[name] = root / f"emb-{name}"
        shutil.copytree(emb, out[name])
        set_pooling(out[name], mode)
    return out


_refs: dict = {}


def reference_hidden(path, ids: list[int]) -> np.ndarray:
    """mlx-lm's final hidden states [L, hidden] (float32) for one input."""
    if path not in _refs:
        _refs[path] = load(str(path))[0]
    return np.array(_refs[path].model(mx.array([ids]))[0].astype(mx.float32))


def reference_embedding(path, ids: list[int], pooling: str, dimensions: int | None = None) -> np.ndarray:
    h = reference_hidden(path, ids)
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0], "max": h.max(0)}[pooling]
    v = v[:dimensions] if dimensions else v
    return v / np.linalg.norm(v)


def reference_score(path, ids: list[int], yes: int, no: int) -> float:
    if path not in _refs:
        _refs[path] = load(str(path))[0]
    logits = np.array(_refs[path](mx.array([ids]))[0, -1].astype(mx.float32))
    pair = np.array([logits[no], logits[yes]], np.float64)
    return float(np.exp(pair[1] - np.logaddexp(pair[0], pair[1])))  # softmax over [no, yes], as the model card


def cosine(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], stagger: bool = False):
    """Add the requests (half at once, the rest one per step when `stagger`), step to the
    end; pooled results and generated tokens by id, and how many steps mixed pooling rows
    with generation rows."""
    pooled, tokens, mixed = {}, {rid: [] for rid in requests}, 0
    pending = list(requests.items())
    first = pending[: len(pending) // 2] if stagger else pending
    pending = pending[len(first):]
    for rid, (ids, params) in first:
        engine.add_request(rid, ids, params)
    steps = 0
    while engine.has_unfinished() or pending:
        if pending:
            rid, (ids, params) = pending.pop(0)
            engine.add_request(rid, ids, params)
        plan_kinds = set()
        real = engine.scheduler.schedule

        def spy():
            plan = real()
            plan_kinds.update("pool" if e.seq.sampling_params.pooling else "gen" for e in plan.scheduled)
            return plan

        engine.scheduler.schedule = spy
        try:
            outs = engine.step()
        finally:
            del engine.scheduler.schedule
        mixed += plan_kinds == {"pool", "gen"}
        for out in outs:
            if out.pooled is not None:
                pooled[out.request_id] = out
            tokens[out.request_id] += out.new_token_ids
        engine.check_integrity()
        steps += 1
        assert steps < 5000
    assert engine.block_manager.num_used_blocks == 0
    return pooled, tokens, mixed


def embed(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=1, pooling=PoolingParams(**kw))


def prompts(n: int, seed: int, lengths=(1, 2, 15, 16, 17, 40, 100, 150, 300)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.mark.parametrize("path_kind", ["host", "mlx"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls", "max"])
def test_embeddings_equal_mlx_lm_pooled_chunked_and_packed_with_generation(models, pooling, path_kind, monkeypatch):
    """Mixed lengths (1 .. 300 tokens), chunked by a 64-token step budget, packed into the
    same steps as greedy generation requests, whose tokens stay mlx-lm's."""
    if path_kind == "mlx":
        monkeypatch.setattr(kernels, "_forced", "reference")  # no host path: mlx-lm's modules
    path = models[pooling]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=96, max_num_batched_tokens=64, max_num_seqs=8,
                                                       max_num_partial_prefills=2))
    assert (engine.runner.host is not None) == (path_kind == "host")
    assert engine.pooler.pooling == pooling and engine.pooler.normalize
    inputs = prompts(9, seed=11)
    gen = prompts(3, seed=12, lengths=(20, 70, 5))
    requests = {f"e{i}": (ids, embed()) for i, ids in enumerate(inputs)}
    requests |= {f"g{i}": (ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
                 for i, ids in enumerate(gen)}
    pooled, tokens, mixed = run(engine, dict(sorted(requests.items(), key=lambda kv: random.Random(kv[0]).random())),
                                stagger=True)
    assert mixed > 0, "pooling and generation rows were meant to share steps"
    for i, ids in enumerate(inputs):
        out = pooled[f"e{i}"]
        assert out.finished and out.finish_reason == "stop" and out.new_token_ids == []
        assert out.pooled.dtype == np.float32 and out.pooled.shape == (128,)
        assert cosine(out.pooled, reference_embedding(path, ids, pooling)) > 0.9999, f"input {i} ({len(ids)} tokens)"
        assert abs(float(np.linalg.norm(out.pooled)) - 1) < 1e-5
    oracle = _refs.setdefault(path, load(str(path))[0])
    for i, ids in enumerate(gen):
        want = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), oracle, max_tokens=6), range(6))]
        assert tokens[f"g{i}"] == want


def test_a_prefix_cache_hit_serves_last_token_pooling_and_mean_pooling_bypasses_it(models):
    long = prompts(1, seed=5, lengths=(200,))[0]
    for pooling, hits in (("last", True), ("mean", False)):
        engine = Engine.from_pretrained(models[pooling], EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64))
        first, _, _ = run(engine, {"a": (long, embed())})
        second, _, _ = run(engine, {"b": (long[:150] + [7, 8, 9], embed()), "c": (long, embed())})
        want = reference_embedding(models[pooling], long, pooling)
        for out in (first["a"], second["c"]):
            assert cosine(out.pooled, want) > 0.9999
        want = reference_embedding(models[pooling], long[:150] + [7, 8, 9], pooling)
        assert cosine(second["b"].pooled, want) > 0.9999
        if hits:
            assert second["c"].num_cached_tokens == 192 and second["b"].num_cached_tokens == 144
        else:
            assert second["c"].num_cached_tokens == 0 and second["b"].num_cached_tokens == 0
        # a generation request still hits the blocks the pooling requests wrote
        engine.add_request("g", long + [11], SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished():
            engine.step()
        assert engine.stats.prefix_hits >= 192


def test_preempted_pooling_requests_restart_their_pooling(models):
    """A pool too small for the load: preempted requests are recomputed from position 0
    and pool only the recomputation (no chunk counted twice)."""
    path = models["mean"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=24, max_num_batched_tokens=64, max_num_seqs=6,
                                                       max_num_partial_prefills=3))
    inputs = prompts(6, seed=8, lengths=(120, 90, 200, 60))
    gen = {f"g{i}": (ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
           for i, ids in enumerate(prompts(3, seed=9, lengths=(100,)))}
    pooled, _, _ = run(engine, {**gen, **{f"e{i}": (ids, embed()) for i, ids in enumerate(inputs)}}, stagger=True)
    assert engine.stats.num_preemptions > 0
    for i, ids in enumerate(inputs):
        assert cosine(pooled[f"e{i}"].pooled, reference_embedding(path, ids, "mean")) > 0.9999


def test_matryoshka_dimensions_and_normalize(models):
    path = models["last"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=32))
    ids = prompts(1, seed=2, lengths=(30,))[0]
    pooled, _, _ = run(engine, {"d": (ids, embed(dimensions=32)), "raw": (ids, embed(normalize=False))})
    assert pooled["d"].pooled.shape == (32,)
    assert cosine(pooled["d"].pooled, reference_embedding(path, ids, "last", dimensions=32)) > 0.9999
    assert abs(float(np.linalg.norm(pooled["d"].pooled)) - 1) < 1e-5
    raw = reference_hidden(path, ids)[-1]
    assert np.allclose(pooled["raw"].pooled, raw, rtol=1e-4, atol=1e-4)  # not normalized: the hidden state itself
    with pytest.raises(ValueError, match="more than the model's 128"):
        engine.add_request("x", ids, embed(dimensions=129))
    config = json.loads((path / "config.json").read_text())
    no_mrl = Pooler.for_model(path, 128)
    assert no_mrl.matryoshka is True
    plain = Pooler(hidden_size=128, tasks=("embed",))
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        plain.check(PoolingParams(dimensions=64))
    listed = Pooler(hidden_size=128, tasks=("embed",), matryoshka=(32, 64, 128))
    with pytest.raises(ValueError, match="not one of the model's Matryoshka dimensions"):
        listed.check(PoolingParams(dimensions=48))
    assert config["is_matryoshka"] is True


def test_reranker_scores_equal_the_yes_no_logits_of_mlx_lm(models):
    path = models["reranker"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=96, max_num_batched_tokens=64))
    assert engine.pooler.tasks == ("score",) and engine.pooler.score_kind == "yes_no"
    yes, no = engine.pooler.yes_no_ids
    assert engine.tokenizer.convert_ids_to_tokens([yes, no]) == ["yes", "no"]
    docs = ["apples grow on trees in the orchard", "the router sends each basket to the cart", "42", "x " * 80]
    ids = [engine.tokenizer.encode(yes_no_prompt("where do apples grow?", d)) for d in docs]
    pooled, _, _ = run(engine, {f"s{i}": (x, SamplingParams(max_tokens=1, pooling=PoolingParams(task="score")))
                                for i, x in enumerate(ids)})
    got = [float(pooled[f"s{i}"].pooled[0]) for i in range(len(docs))]
    want = [reference_score(path, x, yes, no) for x in ids]
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5), (got, want)
    assert np.argsort(got).tolist() == np.argsort(want).tolist()
    with pytest.raises(ValueError, match="does not serve embed"):
        engine.add_request("e", ids[0], embed())


def test_the_reranker_prompt_is_qwen3_rerankers_model_card_format():
    """The oracles above build their input with `yes_no_prompt` as the worker does, so its
    text is pinned here to Qwen3-Reranker's model card (its prefix, format_instruction and
    suffix, written out), with the card's default instruction."""
    card = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the '
            'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
            '<Instruct>: {i}\n<Query>: {q}\n<Document>: {d}'
            '<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n')
    web = "Given a web search query, retrieve relevant passages that answer the query"
    assert yes_no_prompt("What is MLX?", "An array framework.") == card.format(i=web, q="What is MLX?",
                                                                               d="An array framework.")
    assert yes_no_prompt("q", "d", "Find code") == card.format(i="Find code", q="q", d="d")


def test_what_a_model_serves_and_refuses(models, tmp_path):
    assert Pooler.for_model(models["last"], 128).tasks == ("embed",)
    gen = Pooler.for_model(tmp_path, 128)  # no config files at all: a generation model
    assert gen.tasks == ("generate",)
    assert Pooler.for_model(tmp_path, 128, embeddings=True).tasks == ("generate", "embed")
    engine = Engine.from_pretrained(models["last"], EngineConfig(num_kv_blocks=32, task="generate", embeddings=True))
    assert engine.pooler.tasks == ("generate", "embed") and engine.pooler.pooling == "last"
    bad = tmp_path / "dense"
    shutil.copytree(models["last"], bad)
    modules = json.loads((bad / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (bad / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedPooling, match="Dense"):
        Pooler.for_model(bad, 128)
    (bad / "modules.json").write_text(json.dumps(modules[:3]))
    cfg = json.loads((bad / "1_Pooling" / "config.json").read_text())
    (bad / "1_Pooling" / "config.json").write_text(json.dumps(cfg | {"pooling_mode_mean_tokens": True}))
    with pytest.raises(UnsupportedPooling, match="pooling mode"):
        Pooler.for_model(bad, 128)


@pytest.mark.parametrize("generation_first", [True, False])
def test_a_generation_request_goes_ahead_of_an_embedding_backlog(models, generation_first):
    """With generation_first (the default) a chat's first token does not wait for a batch
    of embeddings queued before it; the embeddings are unchanged, only later. (Short
    inputs: a long one is passed over by the partial-prefill limits in any case.)"""
    path = models["last"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=4,
                                                       task="generate", embeddings=True, pooling_share=1.0,
                                                       generation_first=generation_first))
    backlog = prompts(12, seed=21, lengths=(40,))
    for i, ids in enumerate(backlog):
        engine.add_request(f"e{i}", ids, embed())
    pooled = {out.request_id: out.pooled for out in engine.step()}  # the first embeddings are running
    engine.add_request("g", prompts(1, seed=22, lengths=(10,))[0], SamplingParams(max_tokens=2, temperature=0))
    steps, first_token = 0, None
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            if out.request_id == "g" and out.new_token_ids and first_token is None:
                first_token = steps
            if out.pooled is not None:
                pooled[out.request_id] = out.pooled
    if generation_first:
        assert first_token <= 3, first_token  # behind what was running, ahead of the queue
    else:
        assert first_token >= 6, first_token  # behind the backlog (about 1.6 inputs a step)
    for i, ids in enumerate(backlog):
        assert cosine(pooled[f"e{i}"], reference_embedding(path, ids, "last")) > 0.9999


def test_a_generation_model_steps_without_looking_for_pooling_rows(models, monkeypatch):
    """A model that serves no embeddings or scores pays nothing per step for them: the
    plan is never walked for pooling requests (there can be none)."""
    engine = Engine.from_pretrained(models["last"], EngineConfig(num_kv_blocks=32, task="generate"))
    assert not engine.pooler.pools

    def looked(*args):
        pytest.fail("a generation model looked for pooling rows")

    monkeypatch.setattr(engine.pooling, "pick_rows", looked)
    assert len(engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0))[1]) == 3
    with pytest.raises(ValueError, match="does not serve embed"):
        engine.add_request("e", [5, 6, 7], embed())


def test_an_embedding_backlog_at_max_waiting_does_not_get_a_chat_refused(models):
    """Embedding inputs fill the waiting queue to max_waiting (a few large embedding
    requests do): another embedding input is refused (429), a chat request is not, since
    it queues ahead of them (generation_first)."""
    engine = Engine.from_pretrained(models["last"], EngineConfig(num_kv_blocks=64, max_waiting=8, task="generate",
                                                                 embeddings=True))
    for i in range(8):
        engine.add_request(f"e{i}", [5, 6, 7], embed())
    with pytest.raises(QueueFullError, match="8 requests"):
        engine.add_request("e8", [5, 6, 7], embed())
    engine.add_request("g0", [5, 6, 7], SamplingParams(max_tokens=2))
    assert [s.request_id for s in engine.scheduler.waiting][0] == "g0"
    for i in range(1, 8):
        engine.add_request(f"g{i}", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):  # eight chats waiting: the cap holds for them too
        engine.add_request("g8", [5, 6, 7], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_cross_encoder_classifier_scores_with_its_score_head(tmp_path, arch):
    """A *ForSequenceClassification checkpoint: mlx-lm's model with the checkpoint's
    `score` Linear; the score is sigmoid(score(h_last)), h_last from mlx-lm's own forward.
    A qwen3 one reads Qwen3-Reranker's prompt, another its tokenizer's (query, document) pair."""
    from mlx_lm.utils import load_model

    path = create_model(tmp_path / "cls", arch, "tiny", seed=6, kind="classifier")
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64))
    assert engine.pooler.tasks == ("score",) and engine.pooler.score_kind == "classifier"
    assert engine.pooler.score_format == ("qwen3" if arch == "qwen3" else "pair")
    assert engine.runner.host is not None  # still mlx-lm's family: the host path takes it
    ids = [engine.tokenizer.encode(yes_no_prompt("a query", d)) for d in ("one document", "another " * 30)]
    pooled, _, _ = run(engine, {f"s{i}": (x, SamplingParams(max_tokens=1, pooling=PoolingParams(task="score")))
                                for i, x in enumerate(ids)})
    backbone, _ = load_model(path, strict=False)  # mlx-lm's qwen3 without the head ...
    w = np.array(mx.load(str(path / "model.safetensors"))["score.weight"])  # ... and the head, by hand
    for i, x in enumerate(ids):
        h = np.array(backbone.model(mx.array([x]))[0, -1].astype(mx.float32))
        want = 1 / (1 + np.exp(-float(h @ w[0])))
        assert abs(float(pooled[f"s{i}"].pooled[0]) - want) < 1e-5


@pytest.mark.parametrize("tied", [True, False])
def test_an_official_style_bare_backbone_checkpoint_loads(models, tmp_path, tied):
    """Qwen ships Qwen3-Embedding as the bare backbone (keys without "model."; the 8B says
    untied and has no LM head): served as the same model, the same embeddings."""
    src = models["last"]
    path = tmp_path / "bare"
    shutil.copytree(src, path)
    weights = mx.load(str(path / "model.safetensors"))
    mx.save_safetensors(str(path / "model.safetensors"), {k.removeprefix("model."): v for k, v in weights.items()})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": tied}))
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=32))
    assert engine.runner.host is not None
    ids = prompts(2, seed=31, lengths=(25, 70))
    pooled, _, _ = run(engine, {f"e{i}": (x, embed()) for i, x in enumerate(ids)})
    for i, x in enumerate(ids):
        assert cosine(pooled[f"e{i}"].pooled, reference_embedding(src, x, "last")) > 0.9999


def test_pooling_beside_speculative_decoding(models):
    """Drafted decode rows (n-gram speculation) and pooling rows in the same packed steps:
    each keeps its own rows, the embeddings stay mlx-lm's and the tokens greedy mlx-lm's."""
    path = models["mean"]
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=96, max_num_batched_tokens=64, max_num_seqs=8,
                                                       task="generate", embeddings=True, speculative_config=spec))
    repetitive = [[7, 8, 9, 10] * 10, [11, 12] * 20]  # prompts n-grams find drafts in
    gen = {f"g{i}": (ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
           for i, ids in enumerate(repetitive)}
    inputs = prompts(6, seed=41, lengths=(30, 90, 5))
    pooled, tokens, mixed = run(engine, {**gen, **{f"e{i}": (x, embed()) for i, x in enumerate(inputs)}},
                                stagger=True)
    assert mixed > 0 and engine.stats.spec_decode.num_draft_tokens > 0
    for i, x in enumerate(inputs):
        assert cosine(pooled[f"e{i}"].pooled, reference_embedding(path, x, "mean")) > 0.9999
    oracle = _refs.setdefault(path, load(str(path))[0])
    for rid, (ids, _) in gen.items():
        want = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), oracle, max_tokens=12), range(12))]
        assert tokens[rid] == want


def test_pooling_takes_its_share_of_a_step_beside_generation(models):
    """While a generation request runs, pooling requests take at most pooling_share of each
    step's budget (its steps stay short); alone they take all of it. Results unchanged."""
    path = models["last"]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=8,
                                                       task="generate", embeddings=True, pooling_share=0.25))
    inputs = prompts(4, seed=51, lengths=(200,))
    for i, x in enumerate(inputs):
        engine.add_request(f"e{i}", x, embed())
    engine.add_request("g", prompts(1, seed=52, lengths=(8,))[0],
                       SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    pooled, shares = {}, []
    real = engine.scheduler.schedule

    def spy():
        plan = real()
        gen = any(e.seq.sampling_params.pooling is None for e in plan.scheduled)
        shares.append((gen, sum(e.num_new_tokens for e in plan.scheduled if e.seq.sampling_params.pooling)))
        return plan

    engine.scheduler.schedule = spy
    while engine.has_unfinished():
        for out in engine.step():
            if out.pooled is not None:
                pooled[out.request_id] = out.pooled
    beside = [n for gen, n in shares if gen]
    alone = [n for gen, n in shares if not gen]
    assert beside and max(beside) <= 16, beside
    assert alone[:4] and max(alone[:4]) <= 16, alone  # for a few steps after the chat, the share still holds
    assert max(alone) > 16, alone  # then the embeddings take the whole step
    for i, x in enumerate(inputs):
        assert cosine(pooled[f"e{i}"], reference_embedding(path, x, "last")) > 0.9999
