"""The CPU kernels (C, via ctypes): attention against the same two oracles as the Metal
kernel, SwiGLU against MLX's own `silu(gate) * x`.

Triangle: the C kernel, the pure-MLX reference and a naive dense float64 attention agree
on every case of `test_paged_attention_kernel` (at float32, the kernel's only dtype),
on poisoned caches it must never read, and on random small batches. Then the dispatcher:
the kernel is the CPU default when it builds, and the reference serves when it cannot.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx.core as mx
from cluster.worker import kernels
from cluster.worker.kernels import cpu
from test_paged_attention_kernel import CASES, MIXED, Case, _f64, make_batch, naive_attention, small_batches

def _compiler() -> str | None:
    import os
    import shutil

    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


# Skipped only where there is no compiler at all; with one, a build that fails is a failure.
pytestmark = pytest.mark.skipif(_compiler() is None, reason="no C compiler: the CPU kernels cannot be built")


def test_the_kernels_build_where_there_is_a_compiler():
    assert cpu.available(), f"the CPU kernels did not build: {cpu.build_error()}"

TOL = 2e-4  # float32 kernel vs float64 dense


def run_cpu(case: Case, b) -> mx.array:
    out = cpu.paged_attention_cpu(*b.args(), scale=b.scale, sliding_window=case.window, softcap=case.softcap,
                                  sinks=b.sinks)
    mx.eval(out)
    return out


def fp32(case: Case) -> Case:
    return dataclasses.replace(case, dtype="float32")


@pytest.mark.parametrize("case", [fp32(c) for c in CASES], ids=lambda c: c.id)
def test_cpu_kernel_matches_reference_and_dense(case):
    b = make_batch(case, seed=zlib.crc32(case.id.encode()) % 1000)
    got = run_cpu(case, b)
    assert got.shape == b.q.shape and got.dtype == mx.float32
    dense = naive_attention(b, case.window, case.softcap)
    ref = paged_attention_reference_f64(case, b)
    np.testing.assert_allclose(_f64(got), dense, rtol=TOL, atol=TOL, err_msg="cpu kernel vs dense")
    np.testing.assert_allclose(_f64(got), ref, rtol=TOL, atol=TOL, err_msg="cpu kernel vs reference")


def paged_attention_reference_f64(case: Case, b) -> np.ndarray:
    return _f64(kernels.paged_attention_reference(*b.args(), scale=b.scale, sliding_window=case.window,
                                                  softcap=case.softcap, sinks=b.sinks))


def test_never_reads_outside_the_context():
    """Unreferenced blocks, padding entries and slots past each context are NaN."""
    case = Case(MIXED, 8, 2, 64, 16, "float32", window=128)
    b = make_batch(case, seed=3, poison=True)
    got = _f64(run_cpu(case, b))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, naive_attention(b, case.window), rtol=TOL, atol=TOL)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=small_batches(), seed=st.integers(0, 2**16))
def test_small_random_batches(case, seed):
    """Windows of 1, q_len == context, empty query rows, GQA 1/2/3, poisoned caches."""
    b = make_batch(case, seed=seed, poison=True)
    np.testing.assert_allclose(_f64(run_cpu(case, b)), naive_attention(b, case.window, case.softcap),
                               rtol=1e-4, atol=1e-4)


def test_strided_queries_are_read_correctly():
    """q as the model hands it over: a transposed view, not a contiguous [T, H, D]."""
    case = Case(((1, 40), (6, 30)), 4, 2, 64, 16, "float32")
    b = make_batch(case, seed=11)
    T, H, D = b.q.shape
    strided = mx.array(np.array(b.q).reshape(T, H, D).transpose(1, 0, 2).copy()).transpose(1, 0, 2)
    got = cpu.paged_attention_cpu(strided, *b.args()[1:], scale=b.scale)
    np.testing.assert_allclose(_f64(got), naive_attention(b), rtol=TOL, atol=TOL)


def test_unsupported_shapes_and_dtypes_are_refused():
    b = make_batch(Case(((1, 20),), 4, 2, 64, 16, "float16"), seed=1)
    with pytest.raises(TypeError, match="float32"):
        cpu.paged_attention_cpu(*b.args(), scale=b.scale)
    b = make_batch(Case(((1, 20),), 4, 2, 64, 16, "float32", kv_dtype="float16"), seed=1)
    with pytest.raises(TypeError, match="one dtype for K and V"):
        cpu.paged_attention_cpu(b.q, b.k_cache, b.v_cache.astype(mx.float32), *b.args()[3:], scale=b.scale)
    b = make_batch(Case(((1, 20),), 64, 1, 64, 16, "float32"), seed=1)  # 64 query heads per KV head
    with pytest.raises(ValueError, match="H / KVH <= 32"):
        cpu.paged_attention_cpu(*b.args(), scale=b.scale)


def test_dispatcher_picks_the_cpu_kernel_and_falls_back_for_other_dtypes(monkeypatch):
    monkeypatch.setattr(kernels, "_forced", None)
    if not mx.metal.is_available():
        assert kernels.backend() == "cpu" and not kernels.needs_plan()
    calls = []
    real = cpu.paged_attention_cpu
    monkeypatch.setattr(cpu, "paged_attention_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(kernels, "_forced", "cpu")
    for dtype, kv in (("float32", ""), ("bfloat16", ""), ("float32", "float16"), ("float32", "bfloat16")):
        case = Case(((1, 30), (4, 9)), 4, 2, 64, 16, dtype, kv_dtype=kv)
        b = make_batch(case, seed=2)
        out = kernels.paged_attention(*b.args(), scale=b.scale)
        np.testing.assert_allclose(_f64(out), naive_attention(b), rtol=3e-2, atol=3e-2)
    assert calls == [1, 1, 1], "float32 queries (over any pool) through the C kernel, bfloat16 through the reference"


def test_unknown_backend_names_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="metal, cpu, reference"):
        kernels.set_backend("cuda")
    monkeypatch.setattr(kernels, "_forced", "cuda")  # as ORCHARD_ATTENTION=cuda would
    with pytest.raises(ValueError, match="ORCHARD_ATTENTION='cuda'"):
        kernels.backend()


def test_without_a_compiler_the_reference_serves(monkeypatch, caplog):
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_error", None)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(kernels, "_forced", None)
    with caplog.at_level(logging.WARNING, logger="cluster.worker.kernels.cpu"):
        assert not cpu.available()
    assert "pure-MLX reference" in caplog.text
    if not mx.metal.is_available():
        assert kernels.backend() == "reference" and kernels.needs_plan()
    with pytest.raises(RuntimeError, match="unavailable"):
        b = make_batch(Case(((1, 20),), 4, 2, 64, 16, "float32"), seed=1)
        cpu.paged_attention_cpu(*b.args(), scale=b.scale)


def test_inconsistent_batches_are_refused_before_the_c_code_reads_them():
    b = make_batch(Case(((2, 20), (1, 9)), 4, 2, 64, 16, "float32"), seed=1)
    q, k, v, bt, lens, cu = b.args()
    NB = k.shape[0]
    bad = {
        "block tables name blocks outside": dict(block_tables=mx.full(bt.shape, NB, mx.int32)),
        "fit its block table": dict(seq_lens=mx.array([20, 9 + 16 * bt.shape[1]], mx.int32)),
        "cover its queries": dict(seq_lens=mx.array([1, 9], mx.int32)),
        "does not split": dict(cu_seqlens_q=mx.array([0, 2, 2], mx.int32)),
    }
    for message, change in bad.items():
        args = dict(block_tables=bt, seq_lens=lens, cu_seqlens_q=cu) | change
        with pytest.raises(ValueError, match=message):
            cpu.paged_attention_cpu(q, k, v, args["block_tables"], args["seq_lens"], args["cu_seqlens_q"],
                                    scale=b.scale)


def test_largest_group_and_head_size():
    """32 query heads on one KV head, head size 576 (DeepSeek's MLA row: latent 512 + rope
    key 64; Gemma 4's global layers: 512): the kernel's limits."""
    for case in (Case(((1, 70), (9, 40)), 32, 1, 576, 16, "float32", window=32, softcap=50.0),
                 Case(((1, 50), (20, 30)), 8, 2, 512, 16, "float32", sinks=True)):
        b = make_batch(case, seed=13)
        np.testing.assert_allclose(_f64(run_cpu(case, b)), naive_attention(b, case.window, case.softcap),
                                   rtol=TOL, atol=TOL)


def test_beyond_the_c_kernel_s_limits_the_reference_serves(monkeypatch):
    """DeepSeek-V3's MLA as the engine serves it: 128 query heads on one KV head of 576, more
    than one work item holds: the dispatcher gives it to the reference, still exact."""
    monkeypatch.setattr(kernels, "_forced", "cpu")
    called = []
    monkeypatch.setattr(cpu, "paged_attention_cpu", lambda *a, **k: called.append(1))
    case = Case(((1, 20), (6, 12)), 128, 1, 576, 16, "float32")
    b = make_batch(case, seed=3)
    got = kernels.paged_attention(*b.args(), scale=b.scale)
    assert not called
    np.testing.assert_allclose(_f64(got), naive_attention(b), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kv", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("heads, kv_heads", [(40, 40), (36, 12), (12, 3)])
def test_decode_rows_take_kv_heads_in_groups(heads, kv_heads, kv):
    """A decode row's work item takes up to 32 / G KV heads at once (their rows of a slot
    are contiguous): 40 KV heads of group 1 are items of 32 and 8, 12 of group 3 items of
    10 and 2, 3 of group 4 one item; beside prefill chunks (one KV head an item), with a
    window and sinks, over each pool dtype."""
    case = Case(((1, 70), (1, 33), (1, 1), (9, 40), (1, 130)), heads, kv_heads, 64, 16, "float32",
                window=64, sinks=True, kv_dtype=kv)
    b = make_batch(case, seed=heads + kv_heads)
    np.testing.assert_allclose(_f64(run_cpu(case, b)), naive_attention(b, case.window), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("heads, kv_heads, head_size", [(8, 4, 80), (6, 2, 96), (4, 1, 40), (3, 3, 8)])
def test_head_sizes_off_the_vector_width(heads, kv_heads, head_size):
    """Prefill blocks (several rows per item) with head sizes that are not a multiple of
    the 32-column register tile, next to decode rows: every path of the kernel."""
    case = Case(((1, 90), (40, 75), (33, 33), (2, 5)), heads, kv_heads, head_size, 16, "float32", window=64)
    b = make_batch(case, seed=head_size)
    np.testing.assert_allclose(_f64(run_cpu(case, b)), naive_attention(b, case.window), rtol=TOL, atol=TOL)


def test_a_fresh_build_loads_without_flushing_denormals(monkeypatch, tmp_path):
    """Built into an empty cache with a CC that carries flags; loading it must leave the
    process's floating point alone (a -ffast-math link turns on flush-to-zero)."""
    import shutil

    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path))
    monkeypatch.setenv("CC", f"{shutil.which('cc') or shutil.which('gcc')} -Wall")
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_error", None)
    assert cpu.available(), cpu.build_error()
    assert list((tmp_path / "kernels").glob("cpu_kernels-*.so")), "built into $ORCHARD_HOME/kernels"
    tiny = np.float32(1e-40)  # a float32 subnormal
    assert tiny * np.float32(1.0) != 0
    assert mx.array(1e-40, mx.float32).item() * 1.0 != 0 and (mx.array(1e-40) * 1.0).item() != 0
    case = Case(((1, 30), (3, 12)), 4, 2, 64, 16, "float32")
    b = make_batch(case, seed=4)
    np.testing.assert_allclose(_f64(run_cpu(case, b)), naive_attention(b), rtol=TOL, atol=TOL)


def test_swiglu_matches_mlx_over_the_whole_range():
    edges = [0.0, -0.0, 1e-30, -1e-30, 1e4, -1e4]
    g = mx.array(np.concatenate([np.linspace(-120, 120, 4001), edges]).astype(np.float32))
    x = mx.array(np.random.default_rng(0).standard_normal(g.shape).astype(np.float32))
    got = np.array(cpu.swiglu(g, x), np.float64)
    g64, x64 = np.array(g, np.float64), np.array(x, np.float64)
    with np.errstate(over="ignore"):
        want = g64 / (1 + np.exp(-g64)) * x64
    assert np.isfinite(got).all()
    # float32 range reduction: ~1e-7 relative near 0, a few 1e-6 far in the tail (|g| > 40)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)
    small = np.abs(g64) < 20
    np.testing.assert_allclose(got[small], want[small], rtol=1e-6, atol=1e-30)


def test_swiglu_on_model_shaped_strided_inputs():
    rng = np.random.default_rng(1)
    g = mx.array(rng.standard_normal((37, 1, 96)).astype(np.float32) * 6)
    x = mx.array(rng.standard_normal((96, 1, 37)).astype(np.float32)).transpose(2, 1, 0)  # a strided view
    got = cpu.swiglu(g, x)
    assert got.shape == (37, 1, 96) and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(mx.sigmoid(g) * g * x), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="float32 arrays of one shape"):
        cpu.swiglu(g, x[:, :, :10])
    with pytest.raises(TypeError, match="float32 arrays of one shape"):
        cpu.swiglu(g.astype(mx.float16), x.astype(mx.float16))


def test_the_engine_runs_its_mlps_through_the_c_swiglu(tmp_path, monkeypatch):
    from cluster.modelgen import create_model
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams

    calls = []
    real = cpu.swiglu
    monkeypatch.setattr(cpu, "swiglu", lambda g, x: calls.append(g.shape) or real(g, x))
    monkeypatch.setattr(kernels, "_forced", None)
    engine = Engine.from_pretrained(create_model(tmp_path / "m", "llama", "tiny", seed=3),
                                    EngineConfig(num_kv_blocks=32))
    engine.runner.host = None  # the MLX path's swaps, as every family has them (test_host_forward: the other)
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0]) == 3
    n_layers = len(engine.runner.model.layers)
    if not mx.metal.is_available():
        assert len(calls) == 3 * n_layers, "one C SwiGLU per layer per step (prefill + 2 decode steps)"


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_half_pools_are_widened_exactly_subnormals_and_signs_included(kv):
    """Values a float16 pool holds only as subnormals (below 6.1e-5) come back as they are:
    V scaled into that range, compared relatively."""
    case = Case(((1, 40), (3, 33)), 4, 2, 64, 16, "float32", kv_dtype=kv)
    b = make_batch(case, seed=11)
    b.v_cache = (b.v_cache.astype(mx.float32) * 3e-6).astype(DTYPES_KV[kv])
    got, want = _f64(run_cpu(case, b)), naive_attention(b)
    assert np.abs(want).max() < 6.1e-5 and np.abs(want).max() > 1e-7
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-11)


DTYPES_KV = {"float16": mx.float16, "bfloat16": mx.bfloat16}


@pytest.mark.parametrize("kv", ["float32", "float16", "bfloat16"])
def test_step_rows_are_written_into_the_pools_in_place_as_a_scatter_would(kv):
    """`write_kv` (the C path of PagedKVCache) against MLX's own scatter of the same rows:
    the same bytes in every slot, written into the pool arrays the engine holds (no copy),
    nothing else touched; a pool that holds K only (MLA) takes no V; slots outside the
    pool are refused before the C code writes."""
    dtype = getattr(mx, kv)
    rng = np.random.default_rng(7)
    pool_k = mx.array(rng.standard_normal((64, 2, 8)).astype(np.float32)).astype(dtype)
    pool_v = mx.array(rng.standard_normal((64, 2, 8)).astype(np.float32)).astype(dtype)
    mx.eval(pool_k, pool_v)
    want_k, want_v = mx.array(pool_k), mx.array(pool_v)
    slots = mx.array([5, 17, 63, 0, 40], dtype=mx.int32)
    keys = mx.array(rng.standard_normal((5, 2, 1, 8)).astype(np.float32) * 300)  # rounding matters
    values = mx.array(rng.standard_normal((5, 2, 1, 8)).astype(np.float32))
    want_k[slots] = keys.reshape(5, 2, 8).astype(dtype)
    want_v[slots] = values.reshape(5, 2, 8).astype(dtype)
    mx.eval(want_k, want_v)
    cpu.write_kv(pool_k, pool_v, slots, keys, values)
    def raw(a):  # the bytes, as unsigned words (numpy has no bfloat16)
        return np.asarray(a.view(mx.uint16 if dtype.size == 2 else mx.uint32))

    for got, want in ((pool_k, want_k), (pool_v, want_v)):
        np.testing.assert_array_equal(raw(got), raw(want))
    before_v = raw(pool_v).copy()
    cpu.write_kv(pool_k, None, slots[:2], keys[:2] * 2, None)  # K only
    np.testing.assert_array_equal(raw(pool_v), before_v)
    np.testing.assert_array_equal(raw(pool_k[slots[:2]]), raw((keys[:2] * 2).reshape(2, 2, 8).astype(dtype)))
    with pytest.raises(ValueError, match="outside the pool"):
        cpu.write_kv(pool_k, pool_v, mx.array([3, 64], dtype=mx.int32), keys[:2], values[:2])


def test_one_row_sliced_from_a_longer_array_is_written_as_one_row():
    """A single new row that is a slice of a longer array (a Mamba conv state is
    `padded_input[:, -3:]`): numpy calls it contiguous whatever its first axis's stride,
    so the row's size must come from the pool (it once came from that stride, and the
    memcpy ran past both buffers)."""
    pool = mx.zeros((4, 3, 5))
    mx.eval(pool)
    padded = mx.arange(40 * 5, dtype=mx.float32).reshape(1, 40, 5)
    row = padded[:, -3:, :]
    mx.eval(row)
    assert np.asarray(memoryview(row)).strides[0] == 40 * 5 * 4  # the stride that misled
    cpu.write_kv(pool, None, mx.array([2], dtype=mx.int32), row, None)
    want = np.zeros((4, 3, 5), np.float32)
    want[2] = np.asarray(row)[0]
    np.testing.assert_array_equal(np.asarray(pool), want)


def test_the_engine_writes_kv_in_c_and_matches_the_scatter_path(tmp_path, monkeypatch):
    """The same model and prompts with the C row writer and with MLX's scatter (the
    reference backend's path): the same greedy tokens, and the same pool contents."""
    from cluster.modelgen import create_model
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams

    if mx.metal.is_available():
        pytest.skip("the C row writer serves the CPU backend")
    path = create_model(tmp_path / "m", "qwen3", "tiny", seed=5)
    prompts = [[5 + i, 6, 7, 8, 9 + i] * (3 + i) for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs, writes = {}, []
    real = cpu.write_kv
    monkeypatch.setattr(cpu, "write_kv", lambda *a: writes.append(1) or real(*a))
    monkeypatch.setattr(kernels, "_forced", "cpu")
    for in_c in (True, False):
        engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=32, block_size=8))
        engine.runner.host = None  # the MLX path (the host path writes its rows in C, always)
        assert engine.runner.write_kv_in_c
        engine.runner.write_kv_in_c = in_c
        writes.clear()
        runs[in_c] = (engine.generate(prompts, params), [np.asarray(p) for p in engine.runner.pool_arrays()])
        assert bool(writes) == in_c
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("vector_gate", [False, True])
@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv", [(1, 1, 2, 4, 32, 32), (5, 1, 1, 3, 16, 8), (2, 37, 2, 2, 64, 48)])
def test_gated_delta_rule_in_c_is_mlx_lms(B, T, Hk, Hv, Dk, Dv, vector_gate):
    """The C gated delta rule against mlx-lm's `gated_delta_ops` (what its models run on a
    CPU): decode rows (T = 1) and a prefill chunk, value heads sharing key heads, scalar
    and per-key gates; the outputs and the new state agree to float32 rounding."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    rng = np.random.default_rng(B * 100 + T)
    def arr(*shape, lo=None):
        a = rng.standard_normal(shape).astype(np.float32)
        return mx.array(a if lo is None else lo + (1 - lo) / (1 + np.exp(-a)))  # in (lo, 1)

    q, k = arr(B, T, Hk, Dk) / Dk**0.5, arr(B, T, Hk, Dk) / Dk**0.5
    v = arr(B, T, Hv, Dv)
    g = arr(B, T, Hv, Dk, lo=0.5) if vector_gate else arr(B, T, Hv, lo=0.5)
    beta, state = arr(B, T, Hv, lo=0.0), arr(B, Hv, Dv, Dk)
    want_y, want_state = gated_delta_ops(q, k, v, g, beta, state)
    y, new = cpu.gated_delta(q, k, v, g, beta, state)
    assert y.shape == want_y.shape and new.shape == want_state.shape
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new), np.asarray(want_state), rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="float32"):
        cpu.gated_delta(q.astype(mx.float16), k, v, g, beta, state)


@pytest.mark.parametrize("B,L,C,K,bias", [(1, 4, 24, 4, False), (32, 4, 64, 4, True), (2, 40, 16, 3, True)])
def test_depthwise_convolution_in_c_is_mlxs(B, L, C, K, bias):
    """The C depthwise convolution against mlx's `Conv1d(groups=C)`: decode rows (L = K,
    one output) and a chunk, with and without bias."""
    import mlx.nn as nn

    conv = nn.Conv1d(C, C, K, groups=C, bias=bias)
    if bias:
        conv.bias = mx.array(np.random.default_rng(1).standard_normal(C).astype(np.float32))
    x = mx.array(np.random.default_rng(B + L).standard_normal((B, L, C)).astype(np.float32))
    want = conv(x)
    got = cpu.depthwise_conv1d(x, conv.weight, conv.bias if bias else None)
    assert got.shape == want.shape == (B, L - K + 1, C)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="depthwise"):
        cpu.depthwise_conv1d(x, mx.zeros((C, K, 2)), None)


@pytest.mark.parametrize("M,K,N,bias", [(1, 64, 24, False), (3, 40, 7, True), (2, 13, 5, False),
                                        (4, 64, 12, False), (8, 72, 25, True), (16, 512, 96, True),
                                        (5, 13, 9, False), (21, 40, 13, True), (24, 64, 8, False),
                                        (32, 128, 130, False), (45, 24, 7, True)])
def test_linear_in_c_is_numpys(M, K, N, bias):
    """The C linear (few-row x @ W.T + b) against numpy in float64, through both kernels
    and every tile shape: the dot kernel (1-3 rows; full 3 x 4 blocks and the edges: a
    weight-row count not a multiple of 4, K not a multiple of 8) and the broadcast kernel
    (4+ rows: tiles of 1, 2 and 3 vectors of x rows, pairs of vectors past 24 rows, padded
    rows, a last block of fewer weight rows), on an aligned weight copy and on the
    original; a leading batch axis is kept."""
    rng = np.random.default_rng(M * K + N)
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((1, M, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    want = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if b is None else b)
    wa = cpu.aligned_copy(mx.array(w))
    assert np.asarray(memoryview(wa)).ctypes.data % 64 == 0
    np.testing.assert_array_equal(np.asarray(wa), w)
    for weight in (wa, mx.array(w)):
        got = cpu.linear(mx.array(x), weight, None if b is None else mx.array(b))
        assert got.shape == (1, M, N)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * K**0.5)


def test_the_engine_runs_decode_linears_in_c_and_prefill_chunks_in_blas(tmp_path, monkeypatch):
    """With the C kernels a model's Linears and tied LM head take the C path for a decode
    step's few rows and BLAS for a long prefill chunk; the tokens are mlx-lm's."""
    from mlx_lm.utils import load

    from cluster.modelgen import create_model
    from cluster.worker import cpu_layers
    from cluster.worker.config import EngineConfig
    from cluster.worker.engine import Engine
    from cluster.worker.sampling_params import SamplingParams

    if mx.metal.is_available():
        pytest.skip("the C linear serves the CPU backend")
    monkeypatch.setattr(kernels, "_forced", "cpu")
    path = create_model(tmp_path / "m", "qwen3", "tiny", seed=3)
    engine = Engine.from_pretrained(path, EngineConfig(num_kv_blocks=64, block_size=16))
    engine.runner.host = None  # the MLX path's swaps, as every family has them (test_host_forward: the other)
    modules = [type(m) for _, m in engine.runner.model.named_modules()]
    assert {cpu_layers.CLinear, cpu_layers.CEmbedding, cpu_layers.CRoPE} <= set(modules)
    assert nn_linear_count(engine.runner.model) == 0  # every float32 Linear swapped
    rows, ropes, real, real_rope = [], [], cpu.linear, cpu.rope
    monkeypatch.setattr(cpu, "linear", lambda x, *a: rows.append(x.size // x.shape[-1]) or real(x, *a))
    monkeypatch.setattr(cpu, "rope", lambda x, *a: ropes.append(x.shape[0]) or real_rope(x, *a))
    prompt = [(7 * i) % 500 + 3 for i in range(80)]  # 80 rows: BLAS
    got = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert rows and max(rows) < cpu_layers.C_LINEAR_MAX_ROWS and 1 in rows
    assert 80 in ropes and 1 in ropes  # the prompt's rows and each decode row: RoPE in C
    assert [cpu_layers.c_rows(n) for n in (1, 12, 16, 24, 32, 47, 48, 80)] == [True] * 6 + [False, False]
    model, _ = load(str(path))
    from mlx_lm.generate import generate_step

    want = [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=5), range(5))]
    assert got == want


def nn_linear_count(model) -> int:
    import mlx.nn as nn

    return sum(type(m) is nn.Linear for _, m in model.named_modules())


@pytest.mark.parametrize("dims,traditional,base,scale", [(64, False, 1e6, 1.0), (64, True, 1e4, 1.0),
                                                         (16, False, 1e7, 1.0), (32, False, 1e4, 0.25)])
def test_rope_in_c_is_mlxs(dims, traditional, base, scale):
    """The C RoPE against mlx's `fast.rope` with a position per row (the packed step):
    halves and pairs, partial rotation (the features past `dims` untouched), a position
    scale; positions up to 8,000. Equal to float32 rounding of the angle's cos and sin."""
    rng = np.random.default_rng(dims)
    x = mx.array(rng.standard_normal((16, 8, 1, 64)).astype(np.float32))
    positions = mx.array(rng.integers(0, 8000, 16).astype(np.int32))
    want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=positions)
    got = cpu.rope(x, positions, dims, traditional, cpu.rope_frequencies(dims, base), scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got)[..., dims:], np.asarray(x)[..., dims:])
