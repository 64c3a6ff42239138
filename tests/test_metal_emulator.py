"""The Metal-on-CPU emulator runs small kernels with known answers.

Each kernel is written for `mx.fast.metal_kernel`; the `metal`-marked variants run the
same sources on a real GPU so the emulator's answers can be checked against Metal.
"""

import numpy as np
import pytest

import metal_emulator as emu
import mlx.core as mx


def _has_metal() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


IMPLS = [
    pytest.param("fibers", id="emu-fibers"),
    pytest.param("threads", id="emu-threads"),
    pytest.param(
        "metal", id="metal", marks=[pytest.mark.metal, pytest.mark.skipif(not _has_metal(), reason="no Metal GPU")]
    ),
]


@pytest.fixture(params=IMPLS)
def metal_kernel(request):
    """`mx.fast.metal_kernel` or the emulator's, with the emulator backend selected."""
    if request.param == "metal":
        yield mx.fast.metal_kernel
        return
    ok, why = emu.available()
    if not ok:
        pytest.skip(why)
    with emu.settings(backend=request.param):
        yield emu.metal_kernel


REDUCE = """
    threadgroup float partial[32];
    const uint lane = thread_index_in_simdgroup;
    const uint sg = simdgroup_index_in_threadgroup;
    float v = inp[thread_position_in_grid.x];
    float s = simd_sum(v);
    if (lane == 0) {
        partial[sg] = s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
        float t = lane < simdgroups_per_threadgroup ? partial[lane] : 0.0f;
        t = simd_sum(t);
        if (lane == 0) {
            out[threadgroup_position_in_grid.x] = t;
        }
    }
"""


def test_threadgroup_reduction_with_barriers_and_simd_sum(metal_kernel):
    x = mx.array(np.random.default_rng(0).standard_normal(6 * 256).astype(np.float32))
    k = metal_kernel(name="tg_reduce", input_names=["inp"], output_names=["out"], source=REDUCE)
    (out,) = k(inputs=[x], grid=(x.size, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(6,)],
               output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(out), np.array(x).reshape(6, 256).sum(1), rtol=1e-5, atol=1e-4)


def test_barrier_orders_threadgroup_memory(metal_kernel):
    """Each thread reads what another wrote before the barrier (reversal through shared memory)."""
    src = """
        threadgroup int buf[128];
        const uint i = thread_position_in_threadgroup.x;
        const uint n = threads_per_threadgroup.x;
        buf[i] = inp[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        int v = buf[n - 1 - i];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        buf[i] = v * 2;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = buf[(i + 1) % n];
    """
    x = mx.arange(3 * 128, dtype=mx.int32)
    k = metal_kernel(name="tg_reverse", input_names=["inp"], output_names=["out"], source=src)
    (out,) = k(inputs=[x], grid=(x.size, 1, 1), threadgroup=(128, 1, 1), output_shapes=[x.shape],
               output_dtypes=[mx.int32])
    rev = np.array(x).reshape(3, 128)[:, ::-1] * 2
    np.testing.assert_array_equal(np.array(out).reshape(3, 128), np.roll(rev, -1, axis=1))


SHUFFLES = """
    const uint lane = thread_index_in_simdgroup;
    const uint i = thread_position_in_grid.x;
    float v = inp[i];
    out[i * 8 + 0] = simd_shuffle_xor(v, 1);
    out[i * 8 + 1] = simd_shuffle_xor(v, 16);
    out[i * 8 + 2] = simd_shuffle_down(v, 3);
    out[i * 8 + 3] = simd_shuffle_up(v, 2);
    out[i * 8 + 4] = simd_broadcast(v, 5);
    out[i * 8 + 5] = simd_shuffle(v, (lane * 7) % 32);
    out[i * 8 + 6] = simd_max(v);
    out[i * 8 + 7] = simd_prefix_exclusive_sum(v);
"""


def test_simd_shuffles(metal_kernel):
    x = mx.arange(64, dtype=mx.float32) * 0.5 + 1
    k = metal_kernel(name="shuffles", input_names=["inp"], output_names=["out"], source=SHUFFLES)
    (out,) = k(inputs=[x], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64, 8)],
               output_dtypes=[mx.float32])
    got = np.array(out)
    xv = np.array(x).reshape(2, 32)
    lane = np.arange(32)
    want = np.zeros((2, 32, 8), np.float32)
    for s in range(2):
        v = xv[s]
        want[s, :, 0] = v[lane ^ 1]
        want[s, :, 1] = v[lane ^ 16]
        want[s, :, 2] = np.where(lane + 3 < 32, v[np.minimum(lane + 3, 31)], v)
        want[s, :, 3] = np.where(lane - 2 >= 0, v[np.maximum(lane - 2, 0)], v)
        want[s, :, 4] = v[5]
        want[s, :, 5] = v[(lane * 7) % 32]
        want[s, :, 6] = v.max()
        want[s, :, 7] = np.concatenate([[0], np.cumsum(v)[:-1]])
    np.testing.assert_allclose(got.reshape(2, 32, 8), want, rtol=1e-6)


TEMPLATED = """
    const uint i = thread_position_in_grid.x;
    float acc = 0.0f;
    for (int j = 0; j < N; j++) {
        acc += float(inp[i * N + j]);
    }
    if (NEGATE) {
        acc = -acc;
    }
    out[i] = static_cast<T>(acc * scale);
"""


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("negate", [False, True])
def test_templated_kernel_with_scalar_input(metal_kernel, dtype, negate):
    n = 5
    x = (mx.arange(7 * n, dtype=mx.float32) / 8).astype(dtype)
    k = metal_kernel(name="templated", input_names=["inp", "scale"], output_names=["out"], source=TEMPLATED)
    (out,) = k(inputs=[x, 0.5], template=[("T", dtype), ("N", n), ("NEGATE", negate)], grid=(7, 1, 1),
               threadgroup=(7, 1, 1), output_shapes=[(7,)], output_dtypes=[dtype])
    assert out.dtype == dtype
    want = np.array(x.astype(mx.float32)).reshape(7, n).sum(1) * 0.5 * (-1 if negate else 1)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), want, rtol=1e-2)


def test_reads_shape_strides_and_ndim(metal_kernel):
    src = """
        const uint r = thread_position_in_grid.y;
        const uint c = thread_position_in_grid.x;
        if (r < uint(a_shape[0]) && c < uint(a_shape[1])) {
            out[r * a_shape[1] + c] = a[r * a_strides[0] + c * a_strides[1]] + float(a_ndim) + small[1];
        }
    """
    a = mx.arange(15, dtype=mx.float32).reshape(3, 5)
    small = mx.array([10.0, 20.0, 30.0])  # < 8 elements: `constant` address space in MLX
    k = metal_kernel(name="shape_reader", input_names=["a", "small"], output_names=["out"], source=src)
    (out,) = k(inputs=[a, small], grid=(8, 4, 1), threadgroup=(4, 2, 1), output_shapes=[(3, 5)],
               output_dtypes=[mx.float32], init_value=-1)
    np.testing.assert_array_equal(np.array(out), np.array(a) + 2 + 20)


def test_edge_threadgroups_are_smaller(metal_kernel):
    """Non-uniform grids: the last threadgroup has only the remaining threads."""
    src = """
        out[thread_position_in_grid.x] = float(threads_per_threadgroup.x * 1000 + thread_index_in_threadgroup);
    """
    k = metal_kernel(name="edges", input_names=["a"], output_names=["out"], source=src)
    (out,) = k(inputs=[mx.zeros(1)], grid=(70, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(70,)],
               output_dtypes=[mx.float32])
    idx = np.arange(70)
    want = np.where(idx < 64, 32000, 6000) + idx % 32
    np.testing.assert_array_equal(np.array(out), want)


def test_atomic_outputs(metal_kernel):
    src = """
        atomic_fetch_add_explicit(&out[thread_position_in_grid.x % 4], inp[thread_position_in_grid.x],
                                  memory_order_relaxed);
    """
    x = mx.arange(256, dtype=mx.int32)
    k = metal_kernel(name="atomics", input_names=["inp"], output_names=["out"], source=src, atomic_outputs=True)
    (out,) = k(inputs=[x], grid=(256, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(4,)],
               output_dtypes=[mx.int32], init_value=0)
    np.testing.assert_array_equal(np.array(out), np.arange(256).reshape(64, 4).sum(0))


def test_header_helpers_and_vector_types(metal_kernel):
    header = """
    template <typename P>
    METAL_FUNC float4 load4(P p, uint i) {
        return float4(p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]);
    }
    """
    src = """
        const uint i = thread_position_in_grid.x;
        float4 v = load4(inp, i) * 2.0f + float4(1.0f);
        float4 s = simd_sum(v);
        out[i] = dot(v, float4(1.0f, 0.0f, 0.0f, 0.0f)) + s.w + metal::fast::exp(0.0f) + metal::precise::tanh(0.0f);
    """
    x = mx.arange(32 * 4, dtype=mx.float32)
    k = metal_kernel(name="vectors", input_names=["inp"], output_names=["out"], source=src, header=header)
    (out,) = k(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
               output_dtypes=[mx.float32])
    v = np.array(x).reshape(32, 4) * 2 + 1
    np.testing.assert_allclose(np.array(out), v[:, 0] + v[:, 3].sum() + 1)


# Emulator-only behaviour --------------------------------------------------------------


@pytest.fixture
def emulator():
    ok, why = emu.available()
    if not ok:
        pytest.skip(why)
    return emu


def test_divergent_barrier_is_reported_not_hung(emulator):
    src = """
        if (thread_index_in_threadgroup < 16) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[thread_position_in_grid.x] = 1.0f;
    """
    k = emu.metal_kernel(name="divergent", input_names=["a"], output_names=["out"], source=src)
    with pytest.raises(emu.EmulatorError, match="deadlock"):
        k(inputs=[mx.zeros(1)], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
          output_dtypes=[mx.float32])


def test_threadgroup_memory_limit(emulator):
    src = """
        threadgroup float big[9000];
        big[thread_index_in_threadgroup] = 1.0f;
        out[thread_position_in_grid.x] = big[0];
    """
    k = emu.metal_kernel(name="too_big", input_names=["a"], output_names=["out"], source=src)
    with pytest.raises(emu.EmulatorError, match="threadgroup memory"):
        k(inputs=[mx.zeros(1)], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
          output_dtypes=[mx.float32])


def test_threadgroup_size_limit(emulator):
    k = emu.metal_kernel(name="wide", input_names=["a"], output_names=["out"], source="out[0] = a[0];")
    with pytest.raises(ValueError, match="maximum allowed threads"):
        k(inputs=[mx.zeros(1)], grid=(2048, 1, 1), threadgroup=(2048, 1, 1), output_shapes=[(1,)],
          output_dtypes=[mx.float32])


def test_uninitialised_outputs_are_poisoned(emulator):
    k = emu.metal_kernel(name="half_written", input_names=["a"], output_names=["out"],
                         source="if (thread_position_in_grid.x == 0) { out[0] = 1.0f; }")
    (out,) = k(inputs=[mx.zeros(1)], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(2,)],
               output_dtypes=[mx.float32])
    got = np.array(out)
    assert got[0] == 1.0 and np.isnan(got[1])


def test_compile_errors_are_reported(emulator):
    k = emu.metal_kernel(name="broken", input_names=["a"], output_names=["out"], source="out[0] = a[0] +;")
    with pytest.raises(emu.CompileError):
        k(inputs=[mx.zeros(1)], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
          output_dtypes=[mx.float32])


def test_signature_matches_mlx_conventions(emulator):
    src = "out[thread_position_in_grid.x] = a[0] * s + float(b_shape[0]) + float(T(1));"
    k = emu.metal_kernel(name="sig", input_names=["a", "s", "b"], output_names=["out"], source=src)
    (out,) = k(inputs=[mx.ones(16), 2.0, mx.ones(3, dtype=mx.int32)], template=[("T", mx.float16)],
               grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.float32])
    np.testing.assert_array_equal(np.array(out), [6.0] * 4)
    sig = k.last_source.split("// ---- kernel")[1]
    assert "template <typename T>" in sig
    assert "const device float* a" in sig
    assert "const constant float& s" in sig  # 0-d input: by reference
    assert "const constant int32_t* b" in sig  # fewer than 8 elements: constant
    assert "const constant int* b_shape" in sig
    assert "device float* out" in sig
    assert "uint3 thread_position_in_grid" in sig
    assert "a_shape" not in sig  # only what the source uses


def test_threads_backend_agrees_with_fibers(emulator):
    x = mx.array(np.random.default_rng(1).standard_normal(4 * 96).astype(np.float32))
    results = []
    for backend in ("fibers", "threads"):
        with emu.settings(backend=backend):
            k = emu.metal_kernel(name="tg_reduce", input_names=["inp"], output_names=["out"], source=REDUCE)
            results.append(np.array(k(inputs=[x], grid=(x.size, 1, 1), threadgroup=(96, 1, 1),
                                      output_shapes=[(4,)], output_dtypes=[mx.float32])[0]))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[0], np.array(x).reshape(4, 96).sum(1), rtol=1e-5, atol=1e-4)
