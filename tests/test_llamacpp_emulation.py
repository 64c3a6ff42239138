"""load/llamacpp_q41_emulation.py's pieces of llama.cpp's CPU arithmetic, on known values: the
Q8_1 quantization of activations (ties to even, s from the float32 d, both stored fp16), the
Q4_1 block layout, a float32 FMA rounded once, hsum_float_8's order; and, where the cached
llama.cpp build exists, its own quantize_row_q8_1 / ggml_vec_dot_q4_1_q8_1 bit for bit."""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("llamacpp_q41_emulation", ROOT / "load" / "llamacpp_q41_emulation.py")
emu = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = emu  # dataclasses look their module up
_spec.loader.exec_module(emu)
F32 = np.float32


def test_q8_1_block_rounds_ties_to_even_and_stores_fp16_d_and_s():
    # amax 127: d = 1, id = 1, so q = rint(x) exactly; the AVX2 path rounds .5 to even
    x = np.zeros(32, F32)
    x[:8] = [127, 0.5, 1.5, 2.5, -0.5, -2.5, 3.49, -126.51]
    x[8:24] = 127  # sum q = 127 + 0 + 2 + 2 - 0 - 2 + 3 - 127 + 16 * 127 = 2037
    x[24:] = 2  # + 8 * 2 = 2053: fp16 holds 2052 or 2054 here (spacing 2), the tie goes to 2052
    q, d, s = emu.quantize_q8(x[None], with_sum=True)
    assert q[0, 0, :8].tolist() == [127, 0, 2, 2, 0, -2, 3, -127]
    assert d.tolist() == [[1.0]]
    assert q.sum() == 2053 and s.tolist() == [[2052.0]]
    # llama.cpp's generic C (quantize_row_q8_1_ref) rounds half away from zero instead
    q_ref, _, _ = emu.quantize_q8_1_ref(x[None])
    assert q_ref[0, 0, :6].tolist() == [127, 1, 2, 3, -1, -3]


def test_q8_1_s_comes_from_the_float32_d_not_the_stored_fp16_one():
    amax = F32(1.015625)
    x = np.zeros((1, 32), F32)
    x[0, 0], x[0, 1] = amax, F32(-6) * amax / F32(127)  # q = 127 and -6: sum 121
    q, d, s = emu.quantize_q8(x, with_sum=True)
    assert q[0, 0, :2].tolist() == [127, -6] and q.sum() == 121
    d32 = amax / F32(127)
    assert d[0, 0] == np.float16(d32) != d32
    assert s[0, 0] == np.float16(d32 * F32(121)) == np.float16(0.968)
    assert s[0, 0] != np.float16(F32(d[0, 0]) * F32(121))  # the stored d gives 0.9673


def test_q4_1_block_layout_low_nibbles_first():
    # one block: d = 0.5, m = -1, byte i holds element i (low nibble) and element i + 16 (high)
    block = np.zeros(20, np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    block[2:4] = np.frombuffer(np.float16(-1.0).tobytes(), np.uint8)
    block[4:] = [(15 - i) << 4 | i for i in range(16)]
    w = emu.Q41.from_blocks(block[None], 1, 32)
    want = np.concatenate([np.arange(16), 15 - np.arange(16)]) * 0.5 - 1
    assert w.float32()[0].tolist() == want.tolist()


def test_fma_rounds_once():
    e = F32(2.0**-12)
    a = F32(1) + e  # a * a = 1 + 2^-11 + 2^-24: a float32 midpoint
    assert emu.fma(a, a, F32(0)) == F32(1 + 2.0**-11)  # the tie goes to even
    # + 2^-80 puts the exact value just above the midpoint; a float64 sum loses it
    assert emu.fma(a, a, F32(2.0**-80)) == F32(1 + 2.0**-11 + 2.0**-23)
    assert (np.float64(a) * np.float64(a) + 2.0**-80).astype(F32) == F32(1 + 2.0**-11)
    b = F32(1) + F32(2.0**-23)
    assert emu.fma(b, b, -(F32(1) + F32(2.0**-22))) == F32(2.0**-46)  # mul then add gives 0
    assert b * b - (F32(1) + F32(2.0**-22)) == 0


def test_hsum_float_8_order():
    v = np.array([2.0**24, 1, 1, 1, 1, 1, 1, 1], F32)
    assert emu.hsum8(v) == F32(2.0**24 + 6)  # ((v4+v0)+(v6+v2)) + ((v5+v1)+(v7+v3))
    left_to_right = F32(0)
    for x in v:
        left_to_right = left_to_right + x
    assert left_to_right == F32(2.0**24)


def test_ggml_v_expf_is_an_exp():
    x = np.linspace(-30, 30, 2001).astype(F32)
    got, want = emu.v_expf(x), np.exp(x.astype(np.float64))
    assert emu.v_expf(np.array([0], F32))[0] == 1
    assert np.max(np.abs(got / want - 1)) < 4e-7


def _ggml_cpu():
    build = Path.home() / ".cache" / "orchard" / "llama.cpp"
    libs = sorted(build.glob("build-*/bin/libggml-cpu.so"))
    if not libs:
        pytest.skip("no llama.cpp build cached (load/bench_vs_llamacpp.py makes one)")
    ctypes.CDLL(str(libs[-1].with_name("libggml-base.so")), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(libs[-1]))
    lib.ggml_cpu_init()
    lib.quantize_row_q8_1.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ggml_vec_dot_q4_1_q8_1.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def test_against_llama_cpps_own_kernels_bit_for_bit():
    lib = _ggml_cpu()
    rng = np.random.default_rng(0)
    n, rows = 256, 24
    x = (rng.standard_normal((6, n)) * rng.uniform(0.01, 30, (6, 1))).astype(F32)
    blocks = np.zeros((rows, n // 32, 20), np.uint8)
    blocks[..., 0:2] = np.float16(rng.uniform(0.001, 0.05, (rows, n // 32))).view(np.uint8).reshape(rows, -1, 2)
    blocks[..., 2:4] = np.float16(rng.uniform(-0.3, 0, (rows, n // 32))).view(np.uint8).reshape(rows, -1, 2)
    blocks[..., 4:] = rng.integers(0, 256, (rows, n // 32, 16), dtype=np.uint8)
    w = emu.Q41.from_blocks(blocks, rows, n)
    q, d, s = emu.quantize_q8(x, with_sum=True)
    ours = w.dot_q8_1(x)
    out = np.zeros(1, F32)
    for r in range(len(x)):
        row = np.ascontiguousarray(x[r])
        y = np.zeros((n // 32, 36), np.uint8)
        lib.quantize_row_q8_1(row.ctypes.data, y.ctypes.data, n)
        assert y[:, 0:2].copy().view(np.float16)[:, 0].astype(F32).tolist() == d[r].tolist()
        assert y[:, 2:4].copy().view(np.float16)[:, 0].astype(F32).tolist() == s[r].tolist()
        assert y[:, 4:].copy().view(np.int8).astype(F32).tolist() == q[r].tolist()
        for o in range(rows):
            wr = np.ascontiguousarray(blocks[o])
            lib.ggml_vec_dot_q4_1_q8_1(n, out.ctypes.data, 0, wr.ctypes.data, 0, y.ctypes.data, 0, 1)
            assert out[0] == ours[r, o], (r, o)
