"""The Metal varlen paged attention kernel against two oracles.

Triangle: the kernel (its exact Metal source, run on the CPU by tests/metal_emulator, or
on a real GPU for `metal`-marked tests), the pure-MLX reference and a naive dense
attention in float64 numpy must agree pairwise. The default cases cover every value of
every axis (batch kind, GQA ratio, head size, block size, window, soft-cap, dtype,
single pass / split-K, simdgroups per threadgroup); the full product is `slow`.
Block tables are shuffled (physical blocks out of order) with padding entries.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metal_emulator as emu
import mlx.core as mx
from cluster.worker import kernels
from cluster.worker.kernels import metal as km
from cluster.worker.kernels.reference import paged_attention_reference


def _has_metal() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOL = {"float32": 1e-3, "float16": 1.5e-2, "bfloat16": 3e-2}

# (q_len, context length) per sequence
DECODE = ((1, 1300), (1, 17), (1, 640), (1, 1), (1, 257), (1, 96))
PREFILL_SHORT = ((129, 129), (40, 300))
PREFILL_LONG = ((129, 1300), (7, 7))
PREFILL_MID = ((64, 200), (129, 700))
MIXED = ((1, 1000), (129, 1290), (1, 33), (17, 80), (1, 512), (2, 2))


@dataclass(frozen=True)
class Case:
    seqs: tuple
    heads: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    window: int = -1
    softcap: float = 0.0
    partition: int = 0  # 0: single pass; > 0: split-K with partitions of this many keys
    simdgroups: int = km.NUM_SIMDGROUPS
    sinks: bool = False  # a learned logit per head (gpt-oss)
    kv_dtype: str = ""  # the pool's dtype when not the queries' (--kv-cache-dtype)

    @property
    def pool_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def tol(self) -> float:
        return max(TOL[self.dtype], TOL[self.pool_dtype])

    @property
    def id(self) -> str:
        kind = {DECODE: "decode", PREFILL_SHORT: "prefill", PREFILL_LONG: "prefill-long",
                PREFILL_MID: "prefill-mid", MIXED: "mixed"}.get(self.seqs, "custom")
        parts = [kind, f"H{self.heads}/{self.kv_heads}", f"D{self.head_size}", f"BS{self.block_size}", self.dtype]
        if self.window > 0:
            parts.append(f"W{self.window}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.kv_dtype:
            parts.append(f"kv-{self.kv_dtype}")
        if self.partition:
            parts.append(f"split{self.partition}")
        if self.simdgroups != km.NUM_SIMDGROUPS:
            parts.append(f"sg{self.simdgroups}")
        return "-".join(parts)


CASES = [
    # decode only: GQA 1, 4, 8, 5
    Case(DECODE, 4, 4, 64, 16, "float32"),
    Case(DECODE, 8, 2, 128, 8, "float16", window=128, simdgroups=1),
    Case(DECODE, 8, 1, 64, 32, "bfloat16", softcap=50.0),
    Case(DECODE, 5, 1, 128, 16, "float32", window=128, softcap=50.0),
    # prefill only
    Case(PREFILL_SHORT, 2, 2, 128, 32, "float32"),
    Case(PREFILL_LONG, 4, 1, 64, 16, "bfloat16", window=128),
    Case(PREFILL_MID, 5, 1, 64, 8, "float16", softcap=50.0),
    # decode rows and prefill chunks together
    Case(MIXED, 8, 1, 128, 16, "float32", window=128, softcap=50.0),
    Case(MIXED, 8, 2, 64, 32, "float16", simdgroups=8),
    Case(MIXED, 2, 2, 128, 8, "bfloat16", softcap=50.0),
    # long-context path (split-K + log-sum-exp merge)
    Case(DECODE, 8, 2, 64, 16, "float32", partition=256),
    Case(MIXED, 5, 1, 128, 32, "bfloat16", window=128, partition=128),
    Case(PREFILL_LONG, 8, 1, 64, 8, "float16", softcap=50.0, partition=512),
    # other head sizes (not multiples of 32 included)
    Case(DECODE, 4, 2, 96, 16, "float32"),
    Case(PREFILL_SHORT, 2, 1, 80, 16, "float16", softcap=50.0),
    Case(MIXED, 4, 4, 32, 8, "float32", window=128, partition=256),
    # attention sinks: with GQA, a window, soft-cap, decode and prefill, and split-K
    Case(DECODE, 8, 2, 64, 16, "float32", sinks=True),
    Case(MIXED, 8, 1, 64, 16, "float32", window=128, sinks=True),
    Case(PREFILL_MID, 4, 2, 64, 8, "float16", softcap=50.0, sinks=True),
    Case(MIXED, 8, 2, 64, 16, "bfloat16", window=128, partition=256, sinks=True),
    # float32 queries over a half-precision pool (--kv-cache-dtype float16 / bfloat16)
    Case(DECODE, 8, 2, 64, 16, "float32", kv_dtype="float16"),
    Case(MIXED, 8, 1, 128, 16, "float32", window=128, softcap=50.0, kv_dtype="bfloat16"),
    Case(PREFILL_MID, 4, 2, 96, 8, "float32", sinks=True, kv_dtype="float16"),
    Case(MIXED, 5, 1, 64, 32, "float32", partition=256, kv_dtype="float16"),
]


def _slow_cases():
    """Every (batch kind, GQA, head size, block size, dtype) combination; window / soft-cap
    and the split-K path rotate through them."""
    kinds = (DECODE, PREFILL_MID, MIXED)
    gqa = ((4, 4), (8, 2), (8, 1), (5, 1))
    feats = ((-1, 0.0), (128, 0.0), (-1, 50.0), (128, 50.0))
    combos = itertools.product(kinds, gqa, (64, 128), (8, 16, 32), DTYPES)
    for i, (seqs, (h, kvh), d, bs, dt) in enumerate(combos):
        w, cap = feats[i % len(feats)]
        yield Case(seqs, h, kvh, d, bs, dt, window=w, softcap=cap, partition=256 if i % 3 == 0 else 0)


# ------------------------------------------------------------------------------ inputs


@dataclass
class Batch:
    q: mx.array
    k_cache: mx.array
    v_cache: mx.array
    block_tables: mx.array
    seq_lens: mx.array
    cu_seqlens_q: mx.array
    scale: float
    sinks: mx.array | None = None

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.cu_seqlens_q


def make_batch(case: Case, seed: int = 0, poison: bool = False) -> Batch:
    """Random batch; physical blocks shuffled, block tables padded with random valid ids.

    poison: every cache entry no query may read (unreferenced blocks, the tail of each
    sequence's last block) is NaN, and padding entries point at poisoned blocks.
    """
    rng = np.random.default_rng(seed)
    BS, D, KVH, H = case.block_size, case.head_size, case.kv_heads, case.heads
    q_lens = [ql for ql, _ in case.seqs]
    lens = [L for _, L in case.seqs]
    nbs = [-(-L // BS) for L in lens]
    num_blocks = sum(nbs) + 5
    phys = rng.permutation(num_blocks)
    max_blocks = max(nbs) + 2
    free = phys[sum(nbs):]  # never referenced by a sequence
    bt = rng.choice(free, size=(len(lens), max_blocks)).astype(np.int32)
    i = 0
    for s, n in enumerate(nbs):
        bt[s, :n] = phys[i : i + n]
        i += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(cu[-1])
    k = rng.standard_normal((num_blocks, BS, KVH, D)).astype(np.float32)
    v = rng.standard_normal((num_blocks, BS, KVH, D)).astype(np.float32)
    if poison:
        live = np.zeros((num_blocks, BS), bool)
        for s, L in enumerate(lens):
            pos = np.arange(L)
            live[bt[s, pos // BS], pos % BS] = True
        k[~live] = np.nan
        v[~live] = np.nan
    dtype, pool = DTYPES[case.dtype], DTYPES[case.pool_dtype]
    return Batch(
        q=mx.array(rng.standard_normal((T, H, D)).astype(np.float32)).astype(dtype),
        k_cache=mx.array(k).astype(pool),
        v_cache=mx.array(v).astype(pool),
        block_tables=mx.array(bt),
        seq_lens=mx.array(np.array(lens, np.int32)),
        cu_seqlens_q=mx.array(cu),
        scale=D**-0.5,
        # sinks comparable to the scores, so that they matter
        sinks=mx.array((2 * rng.standard_normal(H)).astype(np.float32)) if case.sinks else None,
    )


def _f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float64)


def naive_attention(b: Batch, window: int = -1, softcap: float = 0.0) -> np.ndarray:
    """Dense float64 attention, one sequence at a time, straight from the contract (a
    sink is one more logit per head in the softmax, with no value)."""
    q, k, v = _f64(b.q), _f64(b.k_cache), _f64(b.v_cache)
    bt, lens, cu = np.array(b.block_tables), np.array(b.seq_lens), np.array(b.cu_seqlens_q)
    T, H, D = q.shape
    BS, KVH = k.shape[1], k.shape[2]
    heads = np.arange(H) // (H // KVH)
    out = np.zeros((T, H, D))
    for s in range(len(lens)):
        L, r0, r1 = int(lens[s]), int(cu[s]), int(cu[s + 1])
        if r1 == r0:
            continue
        pos = np.arange(L)
        ks = k[bt[s, pos // BS], pos % BS][:, heads]  # [L, H, D]
        vs = v[bt[s, pos // BS], pos % BS][:, heads]
        scores = np.einsum("qhd,khd->hqk", q[r0:r1], ks) * b.scale
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        hi = L - (r1 - r0) + np.arange(r1 - r0)  # last key each query sees
        allowed = pos[None, :] <= hi[:, None]
        if window > 0:
            allowed &= pos[None, :] > hi[:, None] - window
        scores = np.where(allowed[None], scores, -np.inf)
        if b.sinks is None:
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
        else:
            sink = np.array(b.sinks, np.float64)[:, None, None]  # [H, 1, 1]
            m = np.maximum(scores.max(-1, keepdims=True), sink)
            p = np.exp(scores - m)
            p /= p.sum(-1, keepdims=True) + np.exp(sink - m)
        out[r0:r1] = np.einsum("hqk,khd->qhd", p, vs)
    return out


# ------------------------------------------------------------------------------ running


@pytest.fixture(params=[
    pytest.param("emulator", id="emu"),
    pytest.param("metal", id="metal",
                 marks=[pytest.mark.metal, pytest.mark.skipif(not _has_metal(), reason="no Metal GPU")]),
])
def impl(request, monkeypatch):
    if request.param == "emulator":
        ok, why = emu.available()
        if not ok:
            pytest.skip(why)
        monkeypatch.setattr(mx.fast, "metal_kernel", emu.metal_kernel)
    return request.param


def run_kernel(case: Case, b: Batch) -> mx.array:
    out = km.paged_attention_kernel(
        *b.args(), scale=b.scale, sliding_window=case.window, softcap=case.softcap, sinks=b.sinks,
        partition_size=case.partition, num_simdgroups=case.simdgroups,
    )
    mx.eval(out)
    return out


def check_triangle(case: Case, b: Batch, out: mx.array) -> None:
    tol = case.tol
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    dense = naive_attention(b, case.window, case.softcap)
    ref = paged_attention_reference(*b.args(), scale=b.scale, sliding_window=case.window, softcap=case.softcap,
                                    sinks=b.sinks)
    got, ref = _f64(out), _f64(ref)
    np.testing.assert_allclose(got, dense, rtol=tol, atol=tol, err_msg="kernel vs dense")
    np.testing.assert_allclose(ref, dense, rtol=tol, atol=tol, err_msg="reference vs dense")
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol, err_msg="kernel vs reference")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference_and_dense(impl, case):
    b = make_batch(case, seed=zlib.crc32(case.id.encode()) % 1000)
    check_triangle(case, b, run_kernel(case, b))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_slow_cases()), ids=lambda c: c.id)
def test_kernel_full_grid(impl, case):
    b = make_batch(case, seed=7)
    check_triangle(case, b, run_kernel(case, b))


@pytest.mark.parametrize("partition", [0, 128])
def test_never_reads_outside_the_context(impl, partition):
    """Unreferenced blocks, padding entries and slots past the context are NaN."""
    case = Case(MIXED, 8, 2, 64, 16, "float32", window=128, partition=partition)
    b = make_batch(case, seed=3, poison=True)
    got = _f64(run_kernel(case, b))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, naive_attention(b, case.window), rtol=1e-3, atol=1e-3)


@st.composite
def small_batches(draw):
    """Small random batches: contexts shorter than the window, q_len == context, window 1..."""
    n = draw(st.integers(1, 4))
    seqs = []
    for _ in range(n):
        L = draw(st.integers(1, 70))
        seqs.append((draw(st.integers(0, min(L, 20))), L))
    if not any(q for q, _ in seqs):
        seqs[0] = (1, seqs[0][1])
    kv_heads, group = draw(st.sampled_from([(1, 1), (2, 3), (1, 2)]))
    return Case(
        tuple(seqs), kv_heads * group, kv_heads, 32, draw(st.sampled_from([8, 16])), "float32",
        window=draw(st.sampled_from([-1, 1, 5, 32])), softcap=draw(st.sampled_from([0.0, 2.0])),
        partition=draw(st.sampled_from([0, 32])), simdgroups=draw(st.sampled_from([1, 4])),
        sinks=draw(st.booleans()),
    )


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=small_batches(), seed=st.integers(0, 2**16))
def test_small_random_batches(impl, case, seed):
    b = make_batch(case, seed=seed, poison=True)
    got = _f64(run_kernel(case, b))
    np.testing.assert_allclose(got, naive_attention(b, case.window, case.softcap), rtol=1e-4, atol=1e-4)


def test_empty_sequences_in_the_batch(impl):
    """A sequence with no query rows this step (cu_seqlens_q repeats) is skipped."""
    case = Case(((1, 40), (0, 30), (5, 60), (0, 9), (1, 3)), 4, 2, 64, 8, "float32")
    b = make_batch(case, seed=5)
    np.testing.assert_allclose(_f64(run_kernel(case, b)), naive_attention(b), rtol=1e-3, atol=1e-3)


def test_kernel_under_os_threads(monkeypatch):
    """The same source with one OS thread per GPU thread (no fiber interleaving)."""
    if not emu.available()[0]:
        pytest.skip(emu.available()[1])
    monkeypatch.setattr(mx.fast, "metal_kernel", emu.metal_kernel)
    case = Case(((1, 45), (3, 20)), 4, 2, 64, 8, "float16", softcap=50.0, partition=16, simdgroups=2)
    b = make_batch(case, seed=17)
    with emu.settings(backend="threads"):
        out = run_kernel(case, b)
    check_triangle(case, b, out)


def test_no_rows(impl):
    case = Case(((0, 5),), 4, 2, 64, 8, "float32")
    b = make_batch(case)
    out = run_kernel(case, b)
    assert out.shape == (0, 4, 64)


def test_dispatcher_runs_the_kernel_when_metal_is_forced(impl, monkeypatch):
    built = []

    def spy(name, *args, **kwargs):
        built.append(name)
        return emu.metal_kernel(name, *args, **kwargs) if impl == "emulator" else real(name, *args, **kwargs)

    real = mx.fast.metal_kernel
    monkeypatch.setattr(mx.fast, "metal_kernel", spy)
    case = Case(MIXED, 8, 2, 64, 16, "float32", softcap=50.0)
    b = make_batch(case, seed=11)
    monkeypatch.setattr(kernels, "_forced", "metal")  # set_backend("metal"), undone after the test
    out = kernels.paged_attention(*b.args(), scale=b.scale, softcap=case.softcap)
    assert built == ["orchard_paged_attention"]
    check_triangle(case, b, out)


def test_long_contexts_switch_to_split_k(impl, monkeypatch):
    """paged_attention_metal picks the partitioned path for long contexts and few rows."""
    built = []
    real = mx.fast.metal_kernel

    def spy(name, *args, **kwargs):
        built.append(name)
        return emu.metal_kernel(name, *args, **kwargs) if impl == "emulator" else real(name, *args, **kwargs)

    monkeypatch.setattr(mx.fast, "metal_kernel", spy)
    monkeypatch.setattr(km, "PARTITION_SIZE", 256)
    monkeypatch.setattr(km, "LONG_CONTEXT_MIN_KEYS", 1024)
    case = Case(DECODE, 8, 1, 64, 16, "float16", window=-1, softcap=0.0)
    b = make_batch(case, seed=13)
    assert km.use_partitions(b.q.shape[0], 8, 1, 1300)
    assert not km.use_partitions(b.q.shape[0], 8, 1, 1000)
    out = km.paged_attention_metal(*b.args(), scale=b.scale)
    assert built == ["orchard_paged_attention_partition", "orchard_paged_attention_merge"]
    check_triangle(case, b, out)


def test_unsupported_head_size_falls_back_to_the_reference(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("no kernel should be built")

    monkeypatch.setattr(mx.fast, "metal_kernel", refuse)
    case = Case(((3, 20), (1, 9)), 2, 1, 320, 8, "float32")
    b = make_batch(case)
    out = km.paged_attention_metal(*b.args(), scale=b.scale)
    np.testing.assert_allclose(_f64(out), naive_attention(b), rtol=1e-3, atol=1e-3)


def test_queries_per_group():
    assert [km.queries_per_group(h, kvh) for h, kvh in [(8, 8), (8, 2), (8, 1), (5, 1), (32, 2), (12, 1), (7, 1)]] == [
        1, 4, 8, 5, 8, 6, 7
    ]


# ------------------------------------------------------------------------------ the engine


def test_engine_matches_the_oracle_with_attention_through_the_kernel(impl, monkeypatch, tmp_path):
    """mlx-lm's own generation vs the engine whose attention runs the kernel source.

    Chunked prefill (64-token budget) with two partial prefills at once and staggered
    arrivals, so the kernel sees decode rows and prefill chunks in the same launch.
    """
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from cluster.modelgen import create_model
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams

    built, launches = [], []
    factory = mx.fast.metal_kernel

    def spy(name, *args, **kwargs):
        built.append(name)
        kernel = factory(name, *args, **kwargs)

        def launch(**call):
            if name == "orchard_paged_attention":
                launches.append(np.diff(np.array(call["inputs"][5])).tolist())  # q_len per sequence
            return kernel(**call)

        return launch

    monkeypatch.setattr(mx.fast, "metal_kernel", spy)
    path = create_model(tmp_path / "qwen3", "qwen3", "tiny", seed=1)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (1, 17, 40, 100, 150, 3, 230, 64)]
    max_tokens = [6, 9, 5, 7, 4, 8, 5, 6]

    monkeypatch.setattr(kernels, "_forced", "metal")  # set_backend("metal"), undone after the test
    cfg = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8, max_num_partial_prefills=2)
    engine = Engine.from_pretrained(path, cfg)
    ids = [f"r{i}" for i in range(len(prompts))]
    tokens = {r: [] for r in ids}
    logprobs = {r: [] for r in ids}
    pending = list(range(len(prompts)))
    step = 0
    while engine.has_unfinished() or pending:
        if pending and step % 2 == 0:
            i = pending.pop(0)
            engine.add_request(
                ids[i], prompts[i],
                SamplingParams(max_tokens=max_tokens[i], temperature=0, ignore_eos=True, logprobs=0),
            )
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
        step += 1
        assert step < 1000
    assert "orchard_paged_attention" in built
    assert any(1 in q_lens and max(q_lens) > 1 for q_lens in launches), "no launch mixed decode and prefill"

    model, _ = load(str(path))
    for i, prompt in enumerate(prompts):
        want, want_lp = [], []
        for (tok, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens[i]), range(max_tokens[i])):
            want.append(int(tok))
            want_lp.append(lp[int(tok)].item())
        assert tokens[ids[i]] == want, f"prompt {i} ({len(prompt)} tokens)"
        assert max(abs(a - b) for a, b in zip(logprobs[ids[i]], want_lp)) < 1e-3
