"""load/llamacpp_q41_emulation.py, the numpy emulation of llama.cpp's CPU arithmetic on a Q4_1
GGUF, checked piece by piece. Without llama.cpp: the Q8_1 quantization of activations on known
values (ties to even, s from the float32 d, both stored fp16), the Q4_1 block layout, the FMA and
the Q4_1 x Q8_1 dot product against exact rational arithmetic, the forward pass with every
rounding off against mlx-lm on SmolLM2, batching and the flash-attention kernel's online
softmax. Slow: llama.cpp's own quantize_row_q8_0/q8_1 and ggml_vec_dot_q4_1_q8_1, compiled from
its source, bit for bit against the emulation (x86 with AVX2 only: the kernels emulated)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("llamacpp_q41_emulation", ROOT / "load" / "llamacpp_q41_emulation.py")
emu = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = emu  # dataclasses look their module up
_spec.loader.exec_module(emu)
F32 = np.float32
f16 = emu.f16
# A research script's test: out of the default run (scripts/test under CI=true runs it).
pytestmark = pytest.mark.slow


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


# ------------------------------------------------ exact references (Python fractions), no llama.cpp


def round_f32(x: Fraction) -> F32:
    """The float32 nearest to an exact rational, ties to even: the reference for one rounding."""
    r = F32(float(x))  # may be off by one (float64 first, then float32): the neighbours decide
    cands = [np.nextafter(r, F32(-np.inf)), r, np.nextafter(r, F32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - x), int(c.view(np.uint32)) & 1))


def test_fma_equals_exact_arithmetic_rounded_once():
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(3000) * 2.0 ** rng.integers(-20, 20, 3000)).astype(F32)
    b = (rng.standard_normal(3000) * 2.0 ** rng.integers(-20, 20, 3000)).astype(F32)
    c = (rng.standard_normal(3000) * 2.0 ** rng.integers(-40, 40, 3000)).astype(F32)
    # a third where c nearly cancels a * b, and a third with c exactly -a*b's float32 rounding
    # nudged by a few ulps: where a float64 sum rounded to float32 goes wrong, if anywhere
    ab = a.astype(np.float64) * b.astype(np.float64)
    c[1000:2000] = (-ab[1000:2000] * (1 + rng.integers(-3, 4, 1000) * 2.0 ** -24)).astype(F32)
    c[2000:] = -(ab[2000:] + ab[2000:] * 2.0 ** -25).astype(F32)
    got = emu.fma(a, b, c)
    want = [round_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)]
    assert got.view(np.uint32).tolist() == np.asarray(want, F32).view(np.uint32).tolist()


def q4_1_dot_reference(block_row: np.ndarray, x: np.ndarray) -> F32:
    """ggml_vec_dot_q4_1_q8_1's AVX2 path restated one scalar at a time, every rounding exact:
    x quantized to Q8_1 (quantize_q8, checked above and against llama.cpp below); per block, lane l
    (elements 4l..4l+3) gets acc_l = fl(d4 * d8 * (q4 . q8 over its 4 elements) + acc_l); the
    result is hsum_float_8(acc) + (m * s summed over blocks in float32)."""
    q8, d8, s8 = emu.quantize_q8(x[None], with_sum=True)
    acc = [F32(0)] * 8
    summs = F32(0)
    for b, blk in enumerate(block_row):
        d4 = F32(blk[0:2].view(np.float16)[0])
        m4 = F32(blk[2:4].view(np.float16)[0])
        q4 = [int(v) & 15 for v in blk[4:20]] + [int(v) >> 4 for v in blk[4:20]]
        dd = d4 * F32(d8[0, b])  # two fp16: exact in float32
        for lane in range(8):
            p = sum(q4[4 * lane + i] * int(q8[0, b, 4 * lane + i]) for i in range(4))
            acc[lane] = round_f32(Fraction(float(dd)) * p + Fraction(float(acc[lane])))
        summs = summs + m4 * F32(s8[0, b])
    v = acc
    return ((v[4] + v[0]) + (v[6] + v[2])) + ((v[5] + v[1]) + (v[7] + v[3])) + summs


def random_q4_1(rng, rows: int, cols: int) -> np.ndarray:
    blocks = np.zeros((rows, cols // 32, 20), np.uint8)
    blocks[..., 0:2] = np.float16(rng.uniform(0.001, 0.05, (rows, cols // 32))).view(np.uint8).reshape(rows, -1, 2)
    blocks[..., 2:4] = np.float16(rng.uniform(-0.3, 0, (rows, cols // 32))).view(np.uint8).reshape(rows, -1, 2)
    blocks[..., 4:] = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    return blocks


def test_q4_1_dot_equals_the_scalar_restatement_and_the_exact_value():
    rng = np.random.default_rng(2)
    n, rows = 576, 12
    x = (rng.standard_normal((4, n)) * rng.uniform(0.01, 30, (4, 1))).astype(F32)
    x[1, 5] = 400  # an outlier: its block's other elements quantize to a few levels
    blocks = random_q4_1(rng, rows, n)
    w = emu.Q41.from_blocks(blocks, rows, n)
    got = w.dot_q8_1(x)
    for r in range(len(x)):
        for o in range(rows):
            assert got[r, o] == q4_1_dot_reference(blocks[o], x[r]), (r, o)
    # and near the exact dot of the same quantized values (float32 roundings only)
    q8, d8, s8 = emu.quantize_q8(x, with_sum=True)
    exact = (q8 * d8[..., None]).reshape(x.shape).astype(np.float64) @ w.float32().T.astype(np.float64)
    exact += (s8 - (q8.sum(-1) * d8)).astype(np.float64) @ w.m.T.astype(np.float64)  # s is fp16(d * sum q)
    assert np.allclose(got, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    # the float64-summed matmul of the same roundings (the script's "unordered" arithmetic) agrees as closely
    assert np.allclose(emu.Model.matmul(x, w, emu.Arith(act_q8=True)), exact, rtol=0,
                       atol=1e-5 * np.abs(exact).max())


# ------------------------------------------------------------------------------ the forward pass


def tiny_model(rng) -> emu.Model:
    """A two-layer llama of random Q4_1 blocks (head_dim 64, as SmolLM2's; 2 query heads on 1 KV head)."""
    m = emu.Model.__new__(emu.Model)
    m.n_layer, m.n_head, m.n_kv, m.dim, m.hd, m.n_rot = 2, 2, 1, 128, 64, 64
    m.eps, m.base = F32(1e-5), F32(10000)
    m.embed = (rng.integers(-127, 128, (300, 128)) * f16(rng.uniform(1e-4, 1e-3, (300, 1)))).astype(F32)
    m.out_norm = f16(rng.uniform(0.5, 1.5, 128))
    shapes = {"attn_q": (128, 128), "attn_k": (64, 128), "attn_v": (64, 128), "attn_output": (128, 128),
              "ffn_gate": (256, 128), "ffn_up": (256, 128), "ffn_down": (128, 256)}
    m.layers = [{"attn_norm": f16(rng.uniform(0.5, 1.5, 128)), "ffn_norm": f16(rng.uniform(0.5, 1.5, 128))} |
                {k: emu.Q41.from_blocks(random_q4_1(rng, r, c), r, c) for k, (r, c) in shapes.items()}
                for _ in range(2)]
    return m


def test_llamacpp_arithmetic_on_a_batch_is_each_sequence_alone():
    """Sequences padded together give each one's logprobs bit for bit; llama.cpp's roundings
    move them from float32's, by a little."""
    model = tiny_model(np.random.default_rng(4))
    seqs = [[1, 50, 35, 28, 46, 31, 2, 60], [1, 96, 198, 50], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    prompt = [5, 2, 11]
    together = model.logprobs(seqs, prompt, emu.LLAMACPP)
    for s, p, t in zip(seqs, prompt, together):
        alone = model.logprobs([s], [p], emu.LLAMACPP)[0]
        assert t.shape == (len(s) - p + 1, len(model.embed)) and np.array_equal(t, alone)
        assert np.allclose(np.exp(t).sum(-1), 1)
    plain = model.logprobs(seqs, prompt, emu.Arith())
    moved = max(np.abs(a - b).max() for a, b in zip(together, plain))
    assert 1e-3 < moved < 0.5


def test_flash_attention_one_chunk_is_a_softmax_within_fp16():
    """The one_chunk kernel's online softmax with an fp16 V accumulator against plain float32
    attention over the same fp16 K and V, sequences of different lengths padded together."""
    rng = np.random.default_rng(3)
    model = tiny_model(rng)
    P, T, H, KV, D = 2, 9, 4, 2, 64
    q = rng.standard_normal((P, T, H, D)).astype(F32)
    k = (rng.standard_normal((P, T, KV, D)) * 2).astype(F32)
    v = rng.standard_normal((P, T, KV, D)).astype(F32)
    lens = np.array([T, 6])
    rows = np.ones((P, T), bool)
    fa = model.attention(q, k, v, lens, rows, emu.LLAMACPP)
    plain = model.attention(f16(q), k, v, lens, rows, emu.Arith(kv_f16=True))
    assert np.abs(fa - plain)[0].max() < 4e-3 and np.abs(fa - plain)[1, :6].max() < 4e-3
    assert not np.array_equal(fa, plain)
    # a padded sequence's rows never see the padding: the same as the sequence alone
    alone = model.attention(q[1:, :6], k[1:, :6], v[1:, :6], lens[1:], rows[1:, :6], emu.LLAMACPP)
    assert np.array_equal(fa[1, :6], alone[0])


@pytest.mark.slow  # opens the 135M model's GGUF twice (the emulation's reader, mlx-lm's import)
def test_forward_without_roundings_is_mlx_lms_on_the_dequantized_weights(smollm2_gguf, smollm2_dir):
    """The emulation's model code on SmolLM2's file (llama's RoPE on the file's interleaved Q/K
    rows, grouped KV heads, the tied Q8_0 head) with every rounding off is Orchard's arithmetic:
    mlx-lm's logprobs on the imported directory, dequantized to float32, along the same tokens."""
    import mlx.core as mx  # (conftest loaded OpenBLAS first)
    from mlx_lm.utils import load

    from cluster.worker.dequantize import maybe_dequantize

    ref, _ = load(str(smollm2_dir))
    maybe_dequantize(ref, "yes")
    seq = [1, 504, 3575, 282, 4649, 314, 2, 60, 504, 3575, 282]
    want = ref(mx.array([seq]))[0].astype(mx.float32)
    want = np.asarray(want - mx.logsumexp(want, axis=-1, keepdims=True), np.float64)[3:]
    got = emu.Model(smollm2_gguf).logprobs([seq], [4], emu.Arith())[0]
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


# ------------------------------------------------- llama.cpp's own kernels, built from its source


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


@pytest.fixture(scope="module")
def ggml_quants():
    """llama.cpp's ggml-cpu/arch/x86/quants.c (from the llama-cpp-python sdist on PyPI that
    load/bench_vs_llamacpp.py builds llama-server from) compiled as its CMake build does on an
    AVX2 machine (-O3, gnu11; AVX2, FMA, F16C), into a small library, once."""
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("the emulation is of llama.cpp's x86 AVX2 kernels; this CPU runs others")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build llama.cpp's kernels with")
    from bench_vs_llamacpp import CACHE, LLAMA_CPP_PYTHON, CannotBuild, llama_source

    lib = CACHE / f"kernels-{LLAMA_CPP_PYTHON}" / "x86-quants.so"
    if not lib.exists():
        try:
            ggml = llama_source(LLAMA_CPP_PYTHON) / "ggml"
        except CannotBuild as e:
            if os.environ.get("CI"):
                raise
            pytest.skip(f"llama.cpp's source could not be had: {e}")
        lib.parent.mkdir(parents=True, exist_ok=True)
        # what quants.c takes from the rest of ggml: fp16's table (filled below); the others are not used here
        stub = lib.with_name("stub.c")
        stub.write_text("float ggml_table_f32_f16[1 << 16], ggml_table_f32_e8m0_half[256], ggml_table_f32_ue4m3[256];\n"
                        "void quantize_row_q8_K_ref(void) { __builtin_trap(); }\n")
        tmp = lib.with_name(f"x86-quants.{os.getpid()}.so")
        subprocess.run([cc, "-O3", "-std=gnu11", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-DNDEBUG",
                        f"-I{ggml}/include", f"-I{ggml}/src", f"-I{ggml}/src/ggml-cpu",
                        f"{ggml}/src/ggml-cpu/arch/x86/quants.c", str(stub), "-o", str(tmp)],
                       check=True, capture_output=True, timeout=300)
        tmp.rename(lib)
    k = ctypes.CDLL(str(lib))
    # fp16 -> float32 is a table lookup on x86 (simd-mappings.h), filled as ggml_cpu_init fills it
    table = (ctypes.c_float * (1 << 16)).in_dll(k, "ggml_table_f32_f16")
    ctypes.memmove(table, np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F32).ctypes.data, 1 << 18)
    k.quantize_row_q8_0.argtypes = k.quantize_row_q8_1.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    k.ggml_vec_dot_q4_1_q8_1.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                         ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return k


@pytest.mark.slow  # downloads llama.cpp's source (74 MB) and compiles one file of it, once
def test_against_llama_cpps_own_kernels_bit_for_bit(ggml_quants):
    rng = np.random.default_rng(0)
    n, rows = 256, 24
    x = (rng.standard_normal((7, n)) * rng.uniform(0.01, 30, (7, 1))).astype(F32)
    x[6, :32] = [127, 0.5, 1.5, 2.5, -0.5, -2.5, 3.49, -126.51] + [127] * 16 + [2] * 8  # ties: to even
    blocks = random_q4_1(rng, rows, n)
    w = emu.Q41.from_blocks(blocks, rows, n)
    q, d, s = emu.quantize_q8(x, with_sum=True)
    ours = w.dot_q8_1(x)
    out = np.zeros(1, F32)
    for r in range(len(x)):
        row = np.ascontiguousarray(x[r])
        y = np.zeros((n // 32, 36), np.uint8)
        ggml_quants.quantize_row_q8_1(row.ctypes.data, y.ctypes.data, n)
        assert y[:, 0:2].copy().view(np.float16)[:, 0].astype(F32).tolist() == d[r].tolist()
        assert y[:, 2:4].copy().view(np.float16)[:, 0].astype(F32).tolist() == s[r].tolist()
        assert y[:, 4:].copy().view(np.int8).astype(F32).tolist() == q[r].tolist()
        y0 = np.zeros((n // 32, 34), np.uint8)  # Q8_0, the output head's input: the same d and q
        ggml_quants.quantize_row_q8_0(row.ctypes.data, y0.ctypes.data, n)
        assert np.array_equal(y0[:, 0:2], y[:, 0:2]) and np.array_equal(y0[:, 2:], y[:, 4:])
        for o in range(rows):
            wr = np.ascontiguousarray(blocks[o])
            ggml_quants.ggml_vec_dot_q4_1_q8_1(n, out.ctypes.data, 0, wr.ctypes.data, 0, y.ctypes.data, 0, 1)
            assert out[0] == ours[r, o], (r, o)
