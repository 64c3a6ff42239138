"""The engine against mlx-lm's own generation (the oracle) on the same weights."""

from __future__ import annotations

import dataclasses
import random
import zlib

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from cluster.modelgen import create_model
from cluster.worker import kernels
from cluster import platform
from cluster.worker.config import EngineConfig
from cluster.worker.dequantize import quantized_layers
from cluster.worker.engine import Engine
from cluster.worker.kernels import cpu as cpu_kernel
from cluster.worker.sampling_params import SamplingParams

# sliding windows of 32 tokens: gemma3_text, ministral3, gpt_oss, olmo3, cohere2, gemma4_text, exaone4;
# soft-capped logits: gemma2; sinks: gpt_oss; shared K/V and per-layer head sizes: gemma4_text;
# multi-head latent attention: deepseek_v3
ARCHS = ("qwen3", "llama", "qwen2", "gemma3_text", "ministral3", "gemma2", "gpt_oss", "olmo3", "cohere2",
         "gemma4_text", "exaone4", "deepseek_v3")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: create_model(root / arch, arch, "tiny", seed=1) for arch in ARCHS}


def oracle(path, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """mlx-lm's single-request greedy generation: tokens and their logprobs."""
    model, _ = _oracle_model(path)
    tokens, logprobs = [], []
    for (tok, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
        tokens.append(int(tok))
        logprobs.append(lp[int(tok)].item())
    return tokens, logprobs


_oracles: dict = {}


def _oracle_model(path):
    if path not in _oracles:
        _oracles[path] = load(str(path))
    return _oracles[path]


def random_prompts(n: int, seed: int, vocab: int = 512, lengths=(1, 3, 16, 17, 40, 64, 100, 150, 255, 300)):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def run_staggered(engine: Engine, prompts, params_for, stagger_every: int = 2):
    """Submit half the prompts at once and the rest one every few steps; collect outputs."""
    ids = [f"req-{i}" for i in range(len(prompts))]
    tokens = {rid: [] for rid in ids}
    logprobs = {rid: [] for rid in ids}
    pending = list(range(len(prompts)))
    for i in pending[: len(prompts) // 2]:
        engine.add_request(ids[i], prompts[i], params_for(i))
    pending = pending[len(prompts) // 2 :]
    step = 0
    while engine.has_unfinished() or pending:
        if pending and step % stagger_every == 0:
            i = pending.pop(0)
            engine.add_request(ids[i], prompts[i], params_for(i))
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
        engine.check_integrity()
        step += 1
        assert step < 10_000
    return [tokens[r] for r in ids], [logprobs[r] for r in ids]


@pytest.mark.parametrize("attention", ["cpu", "reference"])
@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_parity_with_chunking_and_preemption(model_dirs, arch, attention, monkeypatch):
    if attention == "cpu" and cpu_kernel.load() is None and "no C compiler" in (cpu_kernel._error or ""):
        pytest.skip("no C compiler: the CPU attention kernel cannot be built here")
    monkeypatch.setattr(kernels, "_forced", attention)  # set_backend(attention), undone after the test
    calls = []  # the C attention kernel's calls, from the MLX path or the host path (host_forward)
    lib = cpu_kernel.load()
    if lib is not None:
        real = lib.orch_paged_attention
        monkeypatch.setattr(lib, "orch_paged_attention", lambda *a: calls.append(1) or real(*a))
    path = model_dirs[arch]
    # 64-token budget forces chunked prefill of every prompt over 64 tokens; 48 blocks of
    # 16 (768 tokens) for ~1,600 tokens of demand forces preemption.
    cfg = EngineConfig(num_kv_blocks=48, max_num_batched_tokens=64, max_num_seqs=8, max_num_partial_prefills=2)
    engine = Engine.from_pretrained(path, cfg)
    prompts = random_prompts(14, seed=zlib.crc32(arch.encode()) % 1000)  # stable across processes
    max_tokens = [4 + (i * 7) % 13 for i in range(len(prompts))]
    tokens, logprobs = run_staggered(
        engine, prompts, lambda i: SamplingParams(max_tokens=max_tokens[i], temperature=0, ignore_eos=True, logprobs=0)
    )
    assert engine.stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert engine.block_manager.num_used_blocks == 0
    assert bool(calls) == (attention == "cpu"), "attention ran through the backend under test"
    for i, prompt in enumerate(prompts):
        want, want_lp = oracle(path, prompt, max_tokens[i])
        assert tokens[i] == want, f"prompt {i} ({len(prompt)} tokens)"
        assert max(abs(a - b) for a, b in zip(logprobs[i], want_lp)) < 1e-4


@pytest.mark.parametrize("arch", ["gemma3_text", "ministral3", "gpt_oss", "olmo3", "cohere2", "gemma4_text", "exaone4"])
def test_sliding_window_layers_with_a_prefix_hit_across_the_window(model_dirs, arch):
    """A prompt that reuses 64 cached tokens of another (twice the 32-token window) and
    runs on past it: the windowed layers see exactly the last 32 keys, as in mlx-lm."""
    path = model_dirs[arch]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64))
    assert engine.runner.windows[:2] == [32, -1]  # layer 0 slides, layer 1 sees everything
    shared = random_prompts(1, seed=7, lengths=(70,))[0]
    first, second = shared + [5, 6, 7], shared + [9, 10, 11, 12]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)
    engine.generate([first], params)
    engine.add_request("b", second, params)
    seq = engine.seqs["b"]
    out, lps = [], []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
            lps += o.logprobs or []
    assert seq.num_cached_tokens == 64
    want, want_lp = oracle(path, second, 40)
    assert out == want
    assert max(abs(a - b) for a, b in zip(lps, want_lp)) < 1e-4


# a feature of a family and the LayerSpec change that switches it off in the engine
FEATURES = [("gemma3_text", "window", -1), ("gpt_oss", "window", -1), ("gemma4_text", "window", -1),
            ("gemma2", "softcap", 0.0), ("gpt_oss", "sinks", False)]


@pytest.mark.parametrize("arch, field, off", FEATURES)
def test_the_parity_tests_would_catch_a_feature_ignored(model_dirs, arch, field, off):
    """With the feature switched off in the engine alone, its tokens differ from mlx-lm's on
    the parity tests' kind of prompts: the tiny models make every feature count."""
    path = model_dirs[arch]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64))
    assert any(getattr(c.spec, field) != off for c in engine.runner.caches), f"{arch} has no {field} to switch off"
    for c in engine.runner.caches:
        c.spec = dataclasses.replace(c.spec, **{field: off})
    prompts = random_prompts(3, seed=11, lengths=(100, 150, 255))
    got = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert any(g != oracle(path, p, 8)[0] for g, p in zip(got, prompts))


def test_prefix_caching_reuses_blocks_and_keeps_output(model_dirs):
    path = model_dirs["qwen3"]
    rng = random.Random(7)
    shared = [rng.randrange(3, 512) for _ in range(70)]  # 4 full blocks + 6 tokens
    first = shared + [rng.randrange(3, 512) for _ in range(9)]
    second = shared + [rng.randrange(3, 512) for _ in range(12)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    cached = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64))
    cached.generate([first], params)
    cached.add_request("b", second, params)
    seq = cached.seqs["b"]
    out = []
    while cached.has_unfinished():
        for o in cached.step():
            out += o.new_token_ids
            assert o.num_cached_tokens == 64
    assert seq.num_cached_tokens == 64  # 4 full blocks of the shared prefix
    assert seq.num_forwarded_tokens == len(second) - 64 + len(out) - 1
    assert cached.stats.prefix_hits == 64

    plain = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, enable_prefix_caching=False))
    assert plain.generate([second], params)[0] == out
    assert plain.stats.prefix_hits == 0


def test_short_prompt_is_not_starved_by_long_ones(model_dirs):
    cfg = EngineConfig(
        num_kv_blocks=128, max_num_batched_tokens=64, max_num_partial_prefills=2, max_long_partial_prefills=1,
        long_prefill_token_threshold=32,
    )
    engine = Engine.from_pretrained(model_dirs["qwen3"], cfg)
    long1, long2, short = random_prompts(3, seed=3, lengths=(400, 400, 10))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for rid, p in (("long1", long1), ("long2", long2), ("short", short)):
        engine.add_request(rid, p, params)
    seqs = {rid: engine.seqs[rid] for rid in ("long1", "long2", "short")}
    first_token_step = {}
    prefill_done_step = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            first_token_step.setdefault(out.request_id, step)
        for rid, s in seqs.items():
            if s.num_computed_tokens >= s.num_prompt_tokens:
                prefill_done_step.setdefault(rid, step)
        step += 1
    assert first_token_step["short"] < prefill_done_step["long1"]
    assert first_token_step["short"] < prefill_done_step["long2"]
    assert first_token_step["short"] <= 1


def test_chunked_prefill_forwards_each_position_once(model_dirs):
    cfg = EngineConfig(num_kv_blocks=256, max_num_batched_tokens=32, enable_prefix_caching=False)
    engine = Engine.from_pretrained(model_dirs["llama"], cfg)
    prompts = random_prompts(4, seed=11, lengths=(300, 97, 33, 1))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    seqs = [engine.seqs[f"r{i}"] for i in range(len(prompts))]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_preemptions == 0
    for p, s in zip(prompts, seqs):
        # the prompt once, then one forward per generated token but the last
        assert s.num_forwarded_tokens == len(p) + s.num_output_tokens - 1
        assert s.num_output_tokens == 5


def test_seeded_sampling_is_independent_of_the_batch(model_dirs):
    path = model_dirs["qwen2"]
    prompt = random_prompts(1, seed=5, lengths=(20,))[0]
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64)).generate([prompt], seeded)[0]

    crowded = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=48))
    others = random_prompts(5, seed=9, lengths=(7, 60, 33, 2, 90))
    noisy = SamplingParams(max_tokens=9, temperature=1.3, ignore_eos=True)
    for i, p in enumerate(others):
        crowded.add_request(f"other{i}", p, noisy)
    crowded.step()
    crowded.add_request("seeded", prompt, seeded)
    got = []
    while crowded.has_unfinished():
        for out in crowded.step():
            if out.request_id == "seeded":
                got += out.new_token_ids
    assert got == alone
    different = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=99, ignore_eos=True)
    runs = [Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64)).generate([prompt], different)[0]
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0] != alone  # another seed: its own, also reproducible


def test_abort_frees_blocks_at_once(model_dirs):
    engine = Engine.from_pretrained(model_dirs["qwen3"], EngineConfig(num_kv_blocks=64, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("a", random_prompts(1, seed=1, lengths=(100,))[0], params)
    engine.add_request("b", random_prompts(1, seed=2, lengths=(40,))[0], params)
    for _ in range(3):
        engine.step()
    used = engine.block_manager.num_used_blocks
    assert used >= 7 + 3
    assert engine.abort("a")
    assert engine.block_manager.num_used_blocks == used - engine.block_manager.blocks_needed(100 + 2)
    assert not engine.abort("a")  # already gone
    engine.check_integrity()
    assert engine.abort("b")
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished()
    assert engine.stats.finished == {"abort": 2}


def test_abort_all_when_abort_raises_leaves_nothing_runnable(model_dirs, monkeypatch):
    """If aborting a request raises (half-way: after the engine let go of it, before the
    scheduler did), `abort_all` still takes it out of the engine and the scheduler's
    queues (never scheduled again) and aborts the other requests too."""
    engine = Engine.from_pretrained(model_dirs["qwen3"], EngineConfig(num_kv_blocks=64, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    for rid, seed in (("a", 1), ("b", 2)):
        engine.add_request(rid, random_prompts(1, seed=seed, lengths=(40,))[0], params)
    engine.step()  # both running, with blocks
    seqs = list(engine.scheduler.running)
    real_abort = engine.scheduler.abort

    def abort(seq):
        if seq.request_id == "a":
            raise RuntimeError("abort failed")
        real_abort(seq)

    monkeypatch.setattr(engine.scheduler, "abort", abort)
    assert sorted(engine.abort_all()) == ["a", "b"]
    assert engine.seqs == {} and engine.detoks == {}
    assert not engine.has_unfinished()
    assert all(s.is_finished and s.block_table == [] for s in seqs)
    assert engine.block_manager.num_free_blocks == 64


def test_refuses_requests_that_can_never_fit(model_dirs):
    engine = Engine.from_pretrained(model_dirs["qwen3"], EngineConfig(num_kv_blocks=8, max_model_len=100))
    with pytest.raises(ValueError, match="max_model_len=100"):
        engine.add_request("long", [5] * 101)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        engine.add_request("oov", [5, 512])
    small_pool = Engine.from_pretrained(model_dirs["qwen3"], EngineConfig(num_kv_blocks=4))
    assert small_pool.config.max_model_len == 64  # capped by what the pool holds
    with pytest.raises(ValueError, match="64"):
        small_pool.add_request("big", [5] * 65)
    assert not engine.has_unfinished()
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]


def test_stop_strings_and_stop_tokens(model_dirs):
    engine = Engine.from_pretrained(model_dirs["qwen3"], EngineConfig(num_kv_blocks=64))
    tok = engine.tokenizer
    for seed in range(50):  # a prompt whose greedy continuation is clean, varied text
        prompt = random_prompts(1, seed=seed, lengths=(12,))[0]
        free = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
        text = tok.decode(free)
        if "\ufffd" not in text and len(set(text)) > 5:
            break
    assert "\ufffd" not in text
    # stop on the 4th generated token id
    got = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[free[3]]))[0]
    assert got == free[: free.index(free[3]) + 1]
    # a stop string taken from the middle of the text: output text ends before it
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    engine.add_request("s", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))
    pieces, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            last = out
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert "".join(pieces) == text[: text.index(stop)]


QUANTIZATIONS = {  # as mlx-lm's convert writes them (mlx-community's models)
    "4bit-g64": dict(q_bits=4, q_group_size=64),
    "8bit-g32": dict(q_bits=8, q_group_size=32),
    "4bit-g32": dict(q_bits=4, q_group_size=32),
    "mixed_3_6": dict(quant_predicate="mixed_3_6", q_group_size=64),  # per-layer bits in config.json
    "mxfp4": dict(q_mode="mxfp4", q_bits=4, q_group_size=32),
}


@pytest.mark.parametrize("quant", sorted(QUANTIZATIONS))
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "deepseek_v3"])
def test_quantized_models_match_the_oracle(model_dirs, tmp_path, arch, quant):
    """Quantized models (what most Mac users run) go through the same paged path."""
    from mlx_lm import convert

    q = tmp_path / quant
    convert(str(model_dirs[arch]), mlx_path=str(q), quantize=True, **QUANTIZATIONS[quant])
    engine = Engine.from_pretrained(q, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=48))
    # on the CPU the weights are dequantized to float32 at load (fast there); on a Mac they stay quantized
    assert bool(quantized_layers(engine.runner.model)) == platform.has_metal()
    prompts = random_prompts(4, seed=8, lengths=(5, 50, 120, 1))
    # mlx-lm's mxfp4 embedding gives bfloat16 activations (its scales are 8-bit exponents);
    # dequantized, the engine runs float32 throughout, as it does any model on the CPU
    tolerance = 5e-2 if quant == "mxfp4" and not platform.has_metal() else 1e-4
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    for prompt in prompts:
        engine.add_request(str(len(engine.seqs)), prompt, params)
    outs = collect(engine)
    for i, prompt in enumerate(prompts):
        want, want_lp = oracle(q, prompt, 6)  # mlx-lm on the quantized weights
        assert outs[str(i)][0] == want
        assert max(abs(a - b) for a, b in zip(outs[str(i)][1], want_lp)) < tolerance


def collect(engine) -> dict[str, tuple[list[int], list[float]]]:
    """Step the engine to the end: each request's tokens and their logprobs."""
    outs: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, lps = outs.setdefault(o.request_id, ([], []))
            tokens += o.new_token_ids
            lps += o.logprobs or []
    return outs


def test_quantized_layers_stay_quantized_when_asked(model_dirs, tmp_path):
    from mlx_lm import convert

    q = tmp_path / "q4"
    convert(str(model_dirs["qwen3"]), mlx_path=str(q), quantize=True, q_bits=4, q_group_size=64)
    engine = Engine.from_pretrained(q, EngineConfig(num_kv_blocks=64, cpu_dequantize="no"))
    assert quantized_layers(engine.runner.model)
    prompt = random_prompts(1, seed=9, lengths=(30,))[0]
    assert engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0] == \
        oracle(q, prompt, 6)[0]


def test_half_precision_weights_run_in_fp32_on_the_cpu(model_dirs, tmp_path):
    import shutil

    from mlx.utils import tree_flatten

    from cluster import platform

    bf16 = tmp_path / "bf16"
    shutil.copytree(model_dirs["llama"], bf16)
    weights = mx.load(str(bf16 / "model.safetensors"))
    mx.save_safetensors(str(bf16 / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    engine = Engine.from_pretrained(bf16, EngineConfig(num_kv_blocks=16))
    dtypes = {p.dtype for _, p in tree_flatten(engine.runner.model.parameters())}
    if platform.has_metal():
        assert dtypes == {mx.bfloat16}
    else:
        assert dtypes == {mx.float32} and engine.runner.dtype == mx.float32
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]) == 3


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 77)])
def test_resume_continues_exactly_where_another_worker_stopped(model_dirs, temperature, seed):
    """Failover: tokens generated elsewhere come back as resume_token_ids; the rest of the
    output (greedy or seeded) is what the uninterrupted run would have produced."""
    path = model_dirs["qwen3"]
    prompt = random_prompts(1, seed=31, lengths=(37,))[0]
    params = SamplingParams(max_tokens=14, temperature=temperature, seed=seed, ignore_eos=True)
    full = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64)).generate([prompt], params)[0]
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64))
    engine.add_request("r", prompt, params, resume_token_ids=full[:5])
    rest, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            rest += out.new_token_ids
            last = out
    assert rest == full[5:]
    assert last.num_output_tokens == 14 and last.num_prompt_tokens == len(prompt)
    with pytest.raises(ValueError, match="already reach max_tokens"):
        engine.add_request("done", prompt, params, resume_token_ids=full)


def test_warm_up_leaves_no_trace(model_dirs):
    """The worker's start-up forward writes free KV blocks only: afterwards the engine
    serves exactly what a cold one serves (greedy, seeded and unseeded sampling), with
    no stats, no blocks held and no prefix-cache entries."""
    path = model_dirs["qwen3"]
    prompts = random_prompts(4, seed=21, lengths=(30, 5, 70, 18))
    kinds = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)]
    config = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=96)
    cold = Engine.from_pretrained(path, config)
    warm = Engine.from_pretrained(path, config)
    assert warm.warm_up() > 0
    assert warm.block_manager.num_used_blocks == 0 and not warm.block_manager.cached
    assert warm.stats.num_steps == 0 and warm.stats.prompt_tokens == 0 and warm.stats.generation_tokens == 0
    for params in kinds:
        assert warm.generate(prompts, params) == cold.generate(prompts, params)
    assert warm.warm_up() == 0.0  # only a fresh engine: now its blocks hold cached prefixes


def test_a_failed_step_is_pinned_on_its_cause_and_the_rest_continue_exactly(model_dirs):
    """The engine thread isolates a step failure: requests batched with the one that breaks
    the step come back one at a time, resumed after the tokens they had emitted, and end
    with exactly the tokens and text of a run without the failure (seeded sampling too);
    only the cause fails."""
    import threading

    from cluster.worker.engine import RequestOutput
    from cluster.worker.engine_loop import AddRequest, EngineLoop, Failed

    prompts = random_prompts(3, seed=11, lengths=(40, 70, 25))
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=5 + i, ignore_eos=True) for i in range(3)]

    def run(with_poison: bool):
        engine = Engine.from_pretrained(model_dirs["qwen3"], EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64))
        prepare = engine.runner.prepare

        def poisoned(plan):
            if any(e.seq.request_id == "poison" for e in plan.scheduled):
                raise RuntimeError("poisoned")
            return prepare(plan)

        engine.runner.prepare = poisoned
        out = {f"r{i}": ([], "") for i in range(3)}
        failed, done = {}, threading.Event()

        def sink(now, events):
            for ev in events:
                if isinstance(ev, Failed):
                    failed[ev.request_id] = ev.message
                elif isinstance(ev, RequestOutput) and ev.request_id in out:
                    toks, text = out[ev.request_id]
                    out[ev.request_id] = (toks + ev.new_token_ids, text + ev.new_text)
                if sum(len(t) for t, _ in out.values()) == 72 and (failed or not with_poison):
                    done.set()

        loop = EngineLoop(lambda: engine, sink)
        loop.start(timeout=60)
        try:
            for i in range(3):
                loop.submit(AddRequest(f"r{i}", prompts[i], params[i], 0.0))
                if i == 1 and with_poison:  # mid-prefill of the others
                    loop.submit(AddRequest("poison", [5] * 30, SamplingParams(max_tokens=4), 0.0))
            assert done.wait(120)
        finally:
            loop.stop(10)
        return out, failed

    clean, _ = run(False)
    faulty, failed = run(True)
    assert list(failed) == ["poison"] and "poisoned" in failed["poison"]
    assert faulty == clean


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_a_half_precision_kv_cache_drifts_little_from_float32(model_dirs, kv):
    """--kv-cache-dtype float16 / bfloat16 halves the pool; the float32 cache stays the exact
    one (every oracle test above). The drift is bounded: on the common prefix of the
    greedy outputs the chosen tokens' logprobs stay within a few hundredths."""
    path = model_dirs["qwen3"]
    prompts = random_prompts(4, seed=21, lengths=(40, 90, 7, 150))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    runs = {}
    for dtype in ("float32", kv):
        engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64,
                                                           kv_cache_dtype=dtype))
        assert {p.dtype for p in engine.runner.pool_arrays()} == {getattr(mx, dtype)}
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        runs[dtype] = collect(engine)
    drift, same = 0.0, 0
    for i in map(str, range(len(prompts))):
        (t32, lp32), (th, lph) = runs["float32"][i], runs[kv][i]
        n = next((j for j, (a, b) in enumerate(zip(t32, th)) if a != b), len(t32))
        same += n
        drift = max([drift] + [abs(a - b) for a, b in zip(lp32[:n], lph[:n])])
    print(f"{kv} cache: {same}/{24 * len(prompts)} greedy tokens before the first divergence, "
          f"logprob drift at most {drift:.2e}")
    assert same >= 0.75 * 24 * len(prompts)
    assert drift < (5e-3 if kv == "float16" else 5e-2)


def test_kv_bytes_follow_the_cache_dtype(model_dirs):
    path = model_dirs["qwen3"]
    sizes = {dtype: Engine.from_pretrained(path, EngineConfig(kv_cache_memory_bytes=1 << 22,
                                                              kv_cache_dtype=dtype)).config.num_kv_blocks
             for dtype in ("float32", "float16")}
    assert sizes["float16"] == 2 * sizes["float32"]
