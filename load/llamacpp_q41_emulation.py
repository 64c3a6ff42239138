"""Why llama.cpp and Orchard part ways on SmolLM2's Q4_1 GGUF: llama.cpp's CPU arithmetic, emulated.

    .venv/bin/python load/llamacpp_q41_emulation.py                 # 20 prompts, 64 tokens
    .venv/bin/python load/llamacpp_q41_emulation.py --ablate        # + which step moves the logprobs how much
    .venv/bin/python load/llamacpp_q41_emulation.py --prompts 4 --max-tokens 16

llama-server (the build load/gguf_vs_llamacpp.py uses; default settings: f16 KV cache, flash
attention on) generates greedily from each prompt and reports its top-5 logprobs at every
step. Orchard's worker serves the same file (float32 on its dequantized weights) and gives its
logprobs along llama.cpp's tokens (prompt_logprobs). A numpy forward pass of the same model,
written from the GGUF's raw blocks and the vendored llama.cpp source (ggml-cpu, x86 AVX2 build,
the kernels this build runs), recomputes llama.cpp's logprobs along the same tokens:

- token_embd is Q8_0 (and, no output.weight in the file, the tied output head): get_rows
  dequantizes (d * q, exact in float32); the head's mul_mat quantizes its input to Q8_0
  (quantize_row_q8_0: d = amax/127 stored fp16, q = rint(x * 127/amax)) and llamafile's
  tinyBLAS sums d_w * d_x * (q_w . q_x) per 32-block.
- every other matrix is Q4_1 (no repack or llamafile path for Q4_1 on x86): its input is
  quantized to Q8_1 (quantize_row_q8_1: as Q8_0, plus s = fp16(d * sum q) computed with the
  float32 d) and ggml_vec_dot_q4_1_q8_1 returns sum_b d4 * fp16(d) * (q4 . q8) + m * s.
- K and V are stored fp16 in the cache; flash attention (ops.cpp) takes, for fewer than 64
  query rows at once (every decode step, and prompts shorter than 64 tokens), the "one_chunk"
  kernel: Q rounded to fp16, K.Q summed in float32, an online softmax whose V accumulator is
  an fp16 vector (ggml_vec_mad_f16 / ggml_vec_scale_f16 round it after every key); 64 rows or
  more take the tiled kernel (float32 Q and accumulator). 512 cached keys or more in a decode
  step take a split-KV path this script does not emulate (it says so).
- rms_norm sums squares in double, RoPE is llama's "normal" mode (adjacent pairs, on the
  file's interleaved Q/K rows) with llama.cpp's float32 theta recurrence, SwiGLU in float32.

Printed: at each prompt's first divergence (Orchard's greedy token differs from llama.cpp's),
llama.cpp's top-2 logprobs and margin, and the same two tokens' logprobs from Orchard and from
the emulation; then over every generated step of every prompt, the max and mean |difference|
between llama.cpp's top-5 logprobs and Orchard's / the emulation's, and how often each one's
argmax is llama.cpp's token. Where libggml-cpu.so is built, quantize_row_q8_1 and
ggml_vec_dot_q4_1_q8_1 are called on real activations and checked against the emulation.

Also printed: the same roundings with the sums done in float64 instead of llama.cpp's float32
order. Expect it as far from llama.cpp as float32 is: once activations are rounded to 8 bits, a
difference in a last bit flips a rounding somewhere, and the flips cascade through the layers,
so only llama.cpp's own order reproduces its logprobs.

--ablate also runs llama-server with its roundings taken away (f32 KV cache and no flash
attention; the file's float32 twin) against a float32 forward along its own tokens, to show
which of them account for the difference.

Slow: the bit-for-bit pass is numpy emulating float32 FMA chains lane by lane, about 40 minutes
for the default 20 prompts on two busy cores (--prompts 3 --max-tokens 16: a few minutes);
--save/--load reuse the servers' results.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

TOP = 5  # llama.cpp's n_probs
F32 = np.float32
F64 = np.float64


def f16(x) -> np.ndarray:
    """float32 -> fp16 -> float32 (round to nearest even, as F16C's _cvtss_sh(x, 0))."""
    return np.asarray(x, F32).astype(np.float16).astype(F32)


def fma(a, b, c) -> np.ndarray:
    """float32 fused multiply-add, rounded once (as _mm256_fmadd_ps / a contracted a*b + c).
    a*b of two float32 is exact in float64, and so is the sum but where the exponents are far
    apart; then rounding the float64 sum to float32 is wrong only if it landed exactly halfway
    between two float32 (29 low mantissa bits 1000...0): those few are redone exactly."""
    p = np.asarray(a, F32).astype(F64) * np.asarray(b, F32).astype(F64)
    p, c = np.broadcast_arrays(p, np.asarray(c, F32).astype(F64))
    s = np.asarray(p + c)
    r = s.astype(F32)
    tie = (s.view(np.uint64) & np.uint64(0x1FFFFFFF)) == np.uint64(0x10000000)
    if tie.any():
        r[tie] = _fma_exact(p[tie], c[tie])
    return r


def _fma_exact(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """round-to-float32 of p + c (float64 each) from the float64 sum and its exact error (TwoSum)."""
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # s + err == p + c exactly
    r = s.astype(F32)
    back = r.astype(F64)
    side = np.sign(s - back)
    with np.errstate(invalid="ignore"):
        other = np.nextafter(r, np.where(side > 0, F32(np.inf), F32(-np.inf)).astype(F32))
        midway = (side != 0) & ((s - back) * 2 == other.astype(F64) - back)
    return np.where(midway & (np.sign(err) == side), other, r)


class LibM:
    """glibc's expf, cosf, sinf, powf, the functions ggml's scalar code calls (not always
    correctly rounded: the last bit matters here). Without glibc: correctly rounded values."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libm.so.6")
        except OSError:
            lib = None
        self.glibc = lib is not None
        self._f = {}
        for name in ("expf", "cosf", "sinf"):
            if lib is not None:
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
                self._f[name] = np.frompyfunc(fn, 1, 1)
        if lib is not None:
            lib.powf.restype, lib.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
        self._pow = lib.powf if lib is not None else None

    def _call(self, name: str, x, fallback) -> np.ndarray:
        x = np.asarray(x, F32)
        if not self.glibc:
            with np.errstate(over="ignore"):
                return fallback(x.astype(F64)).astype(F32)
        return self._f[name](x).astype(F32)

    def expf(self, x):
        return self._call("expf", x, np.exp)

    def cosf(self, x):
        return self._call("cosf", x, np.cos)

    def sinf(self, x):
        return self._call("sinf", x, np.sin)

    def powf(self, x: float, y: float) -> F32:
        return F32(self._pow(float(x), float(y))) if self._pow else F32(np.float64(x) ** np.float64(y))


LIBM = LibM()


def hsum8(v: np.ndarray) -> np.ndarray:
    """hsum_float_8 (x86 quants.c) of 8 float32 lanes on axis 0: ((v4+v0)+(v6+v2)) + ((v5+v1)+(v7+v3))."""
    v = np.asarray(v, F32)
    return ((v[4] + v[0]) + (v[6] + v[2])) + ((v[5] + v[1]) + (v[7] + v[3]))


def reduce_f32x8(acc: list[np.ndarray]) -> np.ndarray:
    """GGML_F32x8_REDUCE of four 8-lane accumulators (lanes on the last axis)."""
    x0 = (acc[0] + acc[2]) + (acc[1] + acc[3])  # offset 2, then offset 1
    t0 = x0[..., 0:4] + x0[..., 4:8]
    return (t0[..., 0] + t0[..., 1]) + (t0[..., 2] + t0[..., 3])  # _mm_hadd_ps twice


def hexf(text: str) -> F32:
    return F32(float.fromhex(text))


def v_expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (vec.h, AVX2 + FMA): exp by a degree-5 polynomial, float32 op for op."""
    x = np.asarray(x, F32)
    r = hexf("0x1.8p23")
    z = fma(x, hexf("0x1.715476p+0"), r)
    n = z - r
    b = fma(-n, hexf("0x1.7f7d1cp-20"), fma(-n, hexf("0x1.62e4p-1"), x))  # fnmadd(a, b, c) = -(a*b) + c
    e = (z.view(np.uint32) << np.uint32(23)).astype(np.uint32)
    k = (e + np.asarray(F32(1)).view(np.uint32)).astype(np.uint32).view(F32)
    c = np.abs(n) > F32(126)
    u = b * b
    j = fma(fma(fma(hexf("0x1.0e4020p-7"), b, hexf("0x1.573e2ep-5")), u,
                fma(hexf("0x1.555e66p-3"), b, hexf("0x1.fffdb6p-2"))),
            u, hexf("0x1.ffffecp-1") * b)
    out = fma(j, k, k)
    if c.any():
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.uint32)
        s1 = (g + np.uint32(0x7F000000)).astype(np.uint32).view(F32)
        s2 = (e - g).astype(np.uint32).view(F32)
        out = np.where(np.abs(n) > F32(192), s1 * s1, np.where(c, fma(s2, j, s2) * s1, out))
    return out


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ggml_vec_swiglu_f32 (AVX2 + FMA): ggml_v_silu(x) * g, silu = x / (1 + v_expf(0 - x))."""
    assert gate.shape[-1] % 8 == 0, "leftover lanes take the scalar silu (not emulated)"
    return (gate / (F32(1) + v_expf(F32(0) - gate))) * up


# ---------------------------------------------------------------- llama.cpp's blocks and kernels


def quantize_q8(x: np.ndarray, with_sum: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """quantize_row_q8_0 / quantize_row_q8_1 (x86 AVX2 path) of rows x (..., n), n % 32 == 0.
    Returns q (int values as float32, (..., n/32, 32)), d as stored (fp16 value), and for Q8_1
    s as stored: fp16(d * sum(q)) with the float32 d."""
    b = np.asarray(x, F32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(b * inv[..., None])  # _mm256_round_ps(_MM_ROUND_NEAREST): ties to even
    s = f16(d * q.sum(-1, dtype=F32)) if with_sum else None
    return q, f16(d), s


def quantize_q8_1_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_1_ref (ggml-quants.c, the generic C): roundf (ties away from zero) of
    x * (1/d), s from the float32 d; what a build without AVX would compute."""
    b = np.asarray(x, F32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    v = b * inv[..., None]
    q = np.sign(v) * np.floor(np.abs(v) + F32(0.5))
    return q, f16(d), f16(d * q.sum(-1, dtype=F32))


@dataclass
class Q41:
    """A Q4_1 matrix (rows, cols): w = d * q + m per 32-block; d, m fp16 in the file."""

    q: np.ndarray  # (nb, 8, 4, rows) uint8: block b, lane l (elements 4l..4l+3), element, row
    d: np.ndarray  # (rows, nb) float32
    m: np.ndarray  # (rows, nb) float32
    raw: np.ndarray  # (rows, nb, 20) the blocks, for calling llama.cpp's own kernel

    @classmethod
    def from_blocks(cls, raw: np.ndarray, rows: int, cols: int) -> Q41:
        b = np.ascontiguousarray(raw).reshape(rows, cols // 32, 20)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(F32)
        qs = b[..., 4:20]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # low nibbles are elements 0..15
        lanes = np.ascontiguousarray(q.reshape(rows, cols // 32, 8, 4).transpose(1, 2, 3, 0))
        return cls(lanes, d, m, b)

    def float32(self) -> np.ndarray:
        """llama.cpp's dequantize_row_q4_1: q * d + m in float32 (what Orchard serves)."""
        nb, _, _, rows = self.q.shape
        q = self.q.transpose(3, 0, 1, 2).reshape(rows, nb, 32).astype(F32)
        return (q * self.d[..., None] + self.m[..., None]).reshape(rows, nb * 32)

    def dot_q8_1(self, x: np.ndarray) -> np.ndarray:
        """x (N, cols) @ W.T as llama.cpp computes it: x quantized by quantize_row_q8_1, then
        ggml_vec_dot_q4_1_q8_1 (AVX2) for every (row, output): eight float32 lanes, each the
        FMA chain over blocks of d4 * d8 times the integer dot of its 4 elements, summed by
        hsum_float_8, plus the float32 sum over blocks of m * s."""
        q8, d8, s8 = quantize_q8(x, with_sum=True)
        nb, _, _, rows = self.q.shape
        n = x.shape[0]
        a = np.ascontiguousarray(q8.reshape(n, nb, 8, 4).transpose(1, 2, 0, 3)).astype(F64)  # (nb, 8, N, 4)
        acc = np.zeros((8, n, rows), F64)  # float32 values
        summs = np.zeros((n, rows), F32)
        half = np.uint64(0x10000000)
        for b in range(nb):
            # the FMA chain acc = d0*d1 * lanes + acc, rounded to float32 once per block: lanes are
            # integer dots (exact), d0*d1 a product of two fp16 (exact), their product exact in float64
            p = a[b] @ self.q[b].astype(F64)  # (8, N, rows)
            p *= (d8[:, b, None] * self.d[None, :, b]).astype(F64)
            s = p + acc
            r = s.astype(F32)
            tie = (s.view(np.uint64) & np.uint64(0x1FFFFFFF)) == half  # halfway between two float32
            if tie.any():
                r[tie] = _fma_exact(p[tie], acc[tie])
            acc = r.astype(F64)
            summs += self.m[None, :, b] * s8[:, b, None]  # m * s: exact in float32
        acc = acc.astype(F32)
        return hsum8(acc) + summs


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A Q8_0 matrix dequantized: d * q per 32-block (exact in float32)."""
    b = np.ascontiguousarray(raw).reshape(rows, cols // 32, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    q = b[..., 2:].copy().view(np.int8).astype(F32)
    return (d[..., None] * q).reshape(rows, cols)


# ------------------------------------------------------------------------------- the emulation


@dataclass(frozen=True)
class Arith:
    """Which of llama.cpp's roundings the forward pass applies (all False: float32, as Orchard)."""

    act_q8: bool = False  # Q4_1 matmul inputs quantized to Q8_1 (fp16 d and s)
    head_q8: bool = False  # the output head's input quantized to Q8_0
    kv_f16: bool = False  # K and V rounded to fp16 (the cache)
    fa_f16: bool = False  # flash attention's one_chunk kernel: Q in fp16, V accumulated in fp16
    order: bool = False  # llama.cpp's float32 operation order (FMA lanes, reductions, glibc/ggml exp)

    def name(self) -> str:
        on = [k for k, v in self.__dict__.items() if v]
        return "+".join(on) if on else "float32"


LLAMACPP = Arith(True, True, True, True, True)


class Model:
    def __init__(self, path: Path):
        import gguf

        r = gguf.GGUFReader(str(path))
        md = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
        assert md["general.architecture"] == "llama", md["general.architecture"]
        self.n_layer = int(md["llama.block_count"])
        self.n_head = int(md["llama.attention.head_count"])
        self.n_kv = int(md["llama.attention.head_count_kv"])
        self.dim = int(md["llama.embedding_length"])
        self.hd = self.dim // self.n_head
        self.n_rot = int(md.get("llama.rope.dimension_count", self.hd))
        self.eps = F32(md["llama.attention.layer_norm_rms_epsilon"])
        self.base = F32(md.get("llama.rope.freq_base", 10000.0))
        assert "llama.rope.scaling.type" not in md or md["llama.rope.scaling.type"] == "none"
        t = {x.name: x for x in r.tensors}
        if "output.weight" in t:
            raise SystemExit("this emulation covers a tied output head (SmolLM2); the file has output.weight")
        emb = t["token_embd.weight"]
        assert emb.tensor_type.name == "Q8_0", emb.tensor_type.name
        cols, rows = (int(v) for v in emb.shape)
        self.embed = q8_0_blocks(np.asarray(emb.data), rows, cols)  # also the head's d_w * q_w
        self.out_norm = np.asarray(t["output_norm.weight"].data, F32)
        self.layers = []
        for i in range(self.n_layer):
            L = {}
            for k in ("attn_norm", "ffn_norm"):
                L[k] = np.asarray(t[f"blk.{i}.{k}.weight"].data, F32)
            for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
                x = t[f"blk.{i}.{k}.weight"]
                assert x.tensor_type.name == "Q4_1", (x.name, x.tensor_type.name)
                cols, rows = (int(v) for v in x.shape)
                L[k] = Q41.from_blocks(np.asarray(x.data), rows, cols)
            self.layers.append(L)

    # -- ops, each as ggml's CPU kernel computes it

    def rms_norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """ggml_compute_forward_rms_norm_f32: float32 squares summed in order in double."""
        sq = np.cumsum((x * x).astype(F64), axis=-1)[..., -1]
        mean = (sq / x.shape[-1]).astype(F32)
        scale = F32(1) / np.sqrt(mean + self.eps)
        return (x * scale[..., None]) * w

    @staticmethod
    def matmul(x: np.ndarray, w: Q41, a: Arith) -> np.ndarray:
        if a.act_q8 and a.order:
            return w.dot_q8_1(x)
        if a.act_q8:  # the same quantization, summed in float64
            q, d, s = quantize_q8(x, with_sum=True)
            xq = (q * d[..., None]).reshape(x.shape)
            rows = w.q.shape[3]
            dq = (w.q.transpose(3, 0, 1, 2).reshape(rows, -1).astype(F32) * np.repeat(w.d, 32, axis=1))
            y = xq.astype(F64) @ dq.T.astype(F64) + s.astype(F64) @ w.m.T.astype(F64)
            return y.astype(F32)
        return (x.astype(F64) @ w.float32().T.astype(F64)).astype(F32)

    def rope_table(self, n: int, a: Arith) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin (n positions, n_rot/2) as ggml_rope_cache_init makes them: theta_i =
        p * theta_scale^i by float32 recurrence, glibc's powf, cosf and sinf."""
        half = self.n_rot // 2
        theta_scale = LIBM.powf(self.base, -2.0 / self.n_rot)
        theta = np.arange(n).astype(F32)
        ths = np.empty((n, half), F32)
        for i in range(half):
            ths[:, i] = theta
            theta = theta * theta_scale
        if a.order:
            return LIBM.cosf(ths), LIBM.sinf(ths)
        return np.cos(ths.astype(F64)).astype(F32), np.sin(ths.astype(F64)).astype(F32)

    def rope(self, x: np.ndarray, pos: np.ndarray, table: tuple[np.ndarray, np.ndarray], a: Arith) -> np.ndarray:
        """llama's rope (GGML_ROPE_TYPE_NORM): pairs (2i, 2i+1) of each head, on the file's
        interleaved Q/K rows; the rotation contracted to FMAs as the compiler does."""
        cos, sin = table[0][pos], table[1][pos]
        x0, x1 = x[..., 0:self.n_rot:2], x[..., 1:self.n_rot:2]
        c, s = cos[:, None, :], sin[:, None, :]  # (rows, 1, n_rot/2): x is (rows, heads, head_dim)
        out = x.copy()
        if a.order:
            out[..., 0:self.n_rot:2] = fma(x0, c, -(x1 * s))
            out[..., 1:self.n_rot:2] = fma(x0, s, x1 * c)
        else:
            out[..., 0:self.n_rot:2] = x0 * c - x1 * s
            out[..., 1:self.n_rot:2] = x0 * s + x1 * c
        return out

    def attention(self, q, k, v, lens: np.ndarray, rows_f16: np.ndarray, a: Arith) -> np.ndarray:
        """Causal attention, P sequences padded to T positions: q (P, T, H, D), k and v (P, T, KV, D);
        lens (P,) the real lengths; rows_f16 (P, T): the rows that run flash attention's one_chunk
        kernel (the others: the tiled kernel, float32 softmax attention over fp16 K/V)."""
        P, T, H, D = q.shape
        g = H // k.shape[2]
        if a.kv_f16:
            k, v = f16(k), f16(v)
        k = np.repeat(k, g, axis=2)  # q head h reads kv head h // g, as ggml's broadcast
        v = np.repeat(v, g, axis=2)
        scale = F32(1 / np.sqrt(D))
        causal = np.tril(np.ones((T, T), bool))
        qq = np.where(rows_f16[..., None, None], f16(q), q) if a.fa_f16 else q
        if a.order and a.fa_f16:
            # ggml_vec_dot_f16 (AVX2, D = 64): four 8-lane FMA accumulators over two steps of 32
            assert D == 64, "the exact K.Q order is written for head_dim 64"
            sc = np.empty((P, H, T, T), F32)
            for i in range(P):  # one sequence at a time (the lanes are (H, T, T, 32))
                qd = qq[i].transpose(1, 0, 2).reshape(H, T, 1, 2, 4, 8)
                kd = k[i].transpose(1, 0, 2).reshape(H, 1, T, 2, 4, 8)
                lane = fma(qd[..., 1, :, :], kd[..., 1, :, :], qd[..., 0, :, :] * kd[..., 0, :, :])  # (H,T,K,4,8)
                sc[i] = reduce_f32x8([lane[..., j, :] for j in range(4)]) * scale
        else:
            sc = np.einsum("pthd,pkhd->phtk", qq.astype(F64), k.astype(F64)).astype(F32) * scale
        sm = np.where(causal, sc, -np.inf)
        p = np.exp(sm - sm.max(-1, keepdims=True))
        out = (np.einsum("phtk,pkhd->pthd", p, v.astype(F64)) /
               p.sum(-1).transpose(0, 2, 1)[..., None]).astype(F32)
        if not (a.fa_f16 and rows_f16.any()):
            return out
        # one_chunk: keys in order, online softmax, the V accumulator an fp16 vector
        sc = sc.transpose(0, 2, 1, 3)  # (P, T, H, K)
        M = np.full((P, T, H), -np.inf, F32)
        S = np.zeros((P, T, H), F32)
        acc = np.zeros((P, T, H, D), F32)  # holds fp16 values
        row = np.arange(T)
        for ic in range(T):
            live = (ic <= row)[None, :, None] & (ic < lens)[:, None, None]  # masked keys are skipped
            sv = sc[..., ic]
            new = (sv > M) & live
            arg = np.where(new, M - sv, sv - M).astype(F32)  # expf(Mold - M) or expf(s - M)
            ex = np.ones_like(arg)
            lv = np.broadcast_to(live, arg.shape)
            ex[lv] = LIBM.expf(arg[lv]) if a.order else np.exp(arg[lv].astype(F64)).astype(F32)
            ms = np.where(new, ex, F32(1))
            vs = np.where(new, F32(1), ex)
            acc = np.where(new[..., None], f16(acc * ms[..., None]), acc)  # ggml_vec_scale_f16
            if a.order:
                upd = f16(fma(v[:, ic][:, None], vs[..., None], acc))  # ggml_vec_mad_f16
                S = np.where(live, fma(S, ms, vs), S)  # S = S*ms + vs, contracted
            else:
                upd = f16(acc + v[:, ic][:, None] * vs[..., None])
                S = np.where(live, S * ms + vs, S).astype(F32)
            acc = np.where(live[..., None], upd, acc)
            M = np.where(new, sv, M)
        return np.where(rows_f16[..., None, None], acc * (F32(1) / S)[..., None], out)

    def logprobs(self, seqs: list[list[int]], prompt_lens: list[int], a: Arith) -> list[np.ndarray]:
        """Each sequence's log-softmax (float64) at positions prompt_len-1 .. len-1.
        A sequence's first prompt_len rows were one batch (llama.cpp's prompt ubatch), the rest one
        token each (decode). All sequences go through each matmul together (rows are independent)."""
        P, T = len(seqs), max(len(s) for s in seqs)
        lens = np.asarray([len(s) for s in seqs])
        pad = np.concatenate([i * T + np.arange(n) for i, n in enumerate(lens)])  # packed row -> (sequence, position)
        pos = pad % T
        pl = np.asarray(prompt_lens)[:, None]
        # one_chunk for every decode row; for the prompt's rows when its batch has < 64 of them
        rows_f16 = (np.arange(T)[None] >= pl) | (pl < 64)
        H, KV, D = self.n_head, self.n_kv, self.hd

        def padded(y: np.ndarray) -> np.ndarray:  # packed rows -> (P, T, heads, D) for attention
            out = np.zeros((P * T, *y.shape[1:]), y.dtype)
            out[pad] = y
            return out.reshape(P, T, *y.shape[1:])

        table = self.rope_table(T, a)
        x = self.embed[np.concatenate([np.asarray(s, np.int64) for s in seqs])]  # (rows, dim), no padding
        for L in self.layers:
            h = self.rms_norm(x, L["attn_norm"])
            q = self.rope(self.matmul(h, L["attn_q"], a).reshape(-1, H, D), pos, table, a)
            k = self.rope(self.matmul(h, L["attn_k"], a).reshape(-1, KV, D), pos, table, a)
            v = self.matmul(h, L["attn_v"], a).reshape(-1, KV, D)
            o = self.attention(padded(q), padded(k), padded(v), lens, rows_f16, a)
            x = x + self.matmul(o.reshape(P * T, H * D)[pad], L["attn_output"], a)
            h = self.rms_norm(x, L["ffn_norm"])
            gate, up = self.matmul(h, L["ffn_gate"], a), self.matmul(h, L["ffn_up"], a)
            x = x + self.matmul(swiglu(gate, up) if a.order else (gate / (F32(1) + np.exp(-gate))) * up,
                                L["ffn_down"], a)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        sel = np.concatenate([o + np.arange(n - 1, len(s)) for o, s, n in zip(starts, seqs, prompt_lens)])
        h = self.rms_norm(x[sel], self.out_norm)
        if a.head_q8:
            q8, d, _ = quantize_q8(h, with_sum=False)
            h = (q8 * d[..., None]).reshape(h.shape)
        z = np.concatenate([(h.astype(F64) @ self.embed[i:i + 8192].T.astype(F64))
                            for i in range(0, len(self.embed), 8192)], axis=1).astype(F32).astype(F64)
        z -= z.max(-1, keepdims=True)
        z -= np.log(np.exp(z).sum(-1, keepdims=True))
        cuts = np.cumsum([len(s) - n + 1 for s, n in zip(seqs, prompt_lens)])[:-1]
        return np.split(z, cuts)


# ------------------------------------------------------------- llama.cpp's own kernels, called


def check_kernels(model: Model, lib_dir: Path) -> str:
    """quantize_row_q8_1 and ggml_vec_dot_q4_1_q8_1 from the built libggml-cpu.so, on layer 0's
    real input (the embedded, normed prompt of a sentence), against the emulation."""
    base, cpu = lib_dir / "libggml-base.so", lib_dir / "libggml-cpu.so"
    if not cpu.exists():
        return f"(no {cpu}: llama.cpp's kernels not cross-checked)"
    ctypes.CDLL(str(base), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(cpu))
    lib.ggml_cpu_init()
    lib.quantize_row_q8_1.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ggml_vec_dot_q4_1_q8_1.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ids = [504, 3575, 282, 4649, 314, 2] * 6
    x = model.rms_norm(model.embed[ids], model.layers[0]["attn_norm"])
    x = np.ascontiguousarray(np.concatenate([x, x * F32(3.7), x * F32(1e-3)]), F32)
    n = x.shape[1]
    q, d, s = quantize_q8(x, with_sum=True)
    w = model.layers[0]["attn_q"]
    ours = w.dot_q8_1(x)
    bad_q = same = total = 0
    out = np.zeros(1, F32)
    for r in range(len(x)):
        blocks = np.zeros(n // 32 * 36, np.uint8)
        lib.quantize_row_q8_1(x[r].ctypes.data, blocks.ctypes.data, n)
        b = blocks.reshape(-1, 36)
        dd = b[:, 0:2].copy().view(np.float16)[:, 0].astype(F32)
        ss = b[:, 2:4].copy().view(np.float16)[:, 0].astype(F32)
        qq = b[:, 4:].copy().view(np.int8).astype(F32)
        bad_q += not (np.array_equal(dd, d[r]) and np.array_equal(ss, s[r]) and np.array_equal(qq, q[r]))
        for o in range(len(w.d)):
            lib.ggml_vec_dot_q4_1_q8_1(n, out.ctypes.data, 0, w.raw[o].ctypes.data, 0, blocks.ctypes.data, 0, 1)
            same += out[0] == ours[r, o]
            total += 1
    return (f"llama.cpp's own kernels ({cpu.name}) on {len(x)} real rows: quantize_row_q8_1 bit-identical to the "
            f"emulation's (d, s, q) for {len(x) - bad_q}/{len(x)}; ggml_vec_dot_q4_1_q8_1 bit-identical to the "
            f"emulated one for {same}/{total} outputs")


# ------------------------------------------------------------------------------------ the runs


def render_prompts(model_dir: Path, n: int) -> list[str]:
    from gguf_vs_llamacpp import QUESTIONS, TEXTS
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             if tok.chat_template else q for q in QUESTIONS] + TEXTS
    return (texts * (n // len(texts) + 1))[:n]


def run_llama(binary: Path, gguf: Path, texts: list[str], max_tokens: int,
              extra: list[str] = ()) -> tuple[list[dict], str]:
    """llama-server's greedy tokens from each text and its top-5 logprobs at each step."""
    from bench_vs_llamacpp import start_llama
    from gguf_vs_llamacpp import post

    llama, url = start_llama(binary, gguf, 1, 4096, list(extra))
    out = []
    try:
        for text in texts:
            ids = post(f"{url}/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
            r = post(f"{url}/completion", {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "n_probs": TOP,
                                           "cache_prompt": False, "post_sampling_probs": False})
            steps = r["completion_probabilities"]
            out.append({"text": text, "ids": ids, "tokens": [p["id"] for p in steps],
                        "top": [[(t["id"], t["logprob"]) for t in p["top_logprobs"]] for p in steps]})
    finally:
        llama.stop()
    return out, " ".join(extra) or "defaults: -fa auto (on for the CPU), f16 K and V cache"


def run_orchard(gguf: Path, runs: list[dict]) -> None:
    """Orchard's greedy tokens, and its logprobs along llama.cpp's tokens (prompt_logprobs, top 20)."""
    from _common import start_orchard

    from cluster.sdk import Client

    orchard, _, info = start_orchard(gguf, ["--max-model-len", "4096"])
    try:
        with Client(info["grpc"]) as client:
            for run in runs:
                c = client.generate(run["ids"] + run["tokens"], max_tokens=1, temperature=0, prompt_logprobs=20,
                                    timeout=600)
                lps = c.prompt_logprobs[len(run["ids"]) - 1:]
                run["orchard"] = [{t[0]: t[1] for t in lp.top} | {lp.token_id: lp.logprob} for lp in lps]
                g = client.generate(run["ids"], max_tokens=len(run["tokens"]), temperature=0, timeout=600)
                run["orchard_greedy"] = list(g.token_ids)
    finally:
        orchard.stop()


def divergence(run: dict) -> int | None:
    """The first step where Orchard's greedy token is not llama.cpp's (None: identical)."""
    want, got = run["tokens"], run["orchard_greedy"]
    same = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    return None if same >= len(want) or (same == len(got) and len(got) < len(want) and not got) else same


def diffs(runs: list[dict], key: str) -> tuple[np.ndarray, int, int]:
    """|logprob - llama.cpp's| for llama.cpp's top-5 tokens at every step `key` has; the steps
    whose argmax is llama.cpp's token, and the steps."""
    d, agree, n = [], 0, 0
    for run in runs:
        for j, ours in enumerate(run[key]):
            d += [abs(ours[tid] - lp) for tid, lp in run["top"][j] if tid in ours]
            n += 1
            agree += max(ours, key=ours.get) == run["tokens"][j]
    return np.asarray(d), agree, n


def emulate(model: Model, runs: list[dict], a: Arith, key: str, steps: list[int], batch: int = 10) -> float:
    """The emulation's logprobs along llama.cpp's tokens, for each run's first steps[i] steps:
    run[key][j] = {token: logprob} for its top 10 and llama.cpp's top 5 at step j."""
    t0 = time.monotonic()
    for i in range(0, len(runs), batch):
        part, n = runs[i:i + batch], steps[i:i + batch]
        lps = model.logprobs([r["ids"] + r["tokens"][:k - 1] for r, k in zip(part, n)],
                             [len(r["ids"]) for r in part], a)
        for run, lp, k in zip(part, lps, n):
            run[key] = [{int(t): float(lp[j, t]) for t in np.argpartition(-lp[j], 10)[:10]} |
                        {tid: float(lp[j, tid]) for tid, _ in run["top"][j]} for j in range(k)]
    return time.monotonic() - t0


def stats(d: np.ndarray) -> str:
    return f"max {d.max():.2e}  mean {d.mean():.2e}" if len(d) else "(none)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=0,
                   help="emulate this many generated steps of each prompt (default: through its first divergence "
                        "and 4 more; 16 for a prompt without one)")
    p.add_argument("--ablate", action="store_true",
                   help="also llama-server without each rounding (f32 KV, no flash attention, float32 weights)")
    p.add_argument("--save", type=Path, default=None, help="write the servers' results (JSON) for --load")
    p.add_argument("--load", type=Path, default=None, help="reuse a --save file instead of running the servers")
    args = p.parse_args()

    from bench_vs_llamacpp import LLAMA_CPP_PYTHON, CannotBuild, llama_server

    from cluster.models_cache import real_gguf, resolve_model

    t0 = time.monotonic()
    gguf = args.gguf or real_gguf("smollm2-135m-instruct")
    try:
        binary = llama_server(LLAMA_CPP_PYTHON)
    except CannotBuild as e:
        print(f"cannot run llama-server here: {e}", file=sys.stderr)
        return 2
    if args.load:
        saved = json.loads(args.load.read_text())
        runs, how = saved["runs"], saved["how"]
        for run in runs:
            run["orchard"] = [{int(k): v for k, v in step.items()} for step in run["orchard"]]
            run["top"] = [[tuple(t) for t in step] for step in run["top"]]
    else:
        texts = render_prompts(resolve_model(str(gguf)), args.prompts)
        runs, how = run_llama(binary, gguf, texts, args.max_tokens)
        run_orchard(gguf, runs)
        if args.save:
            args.save.write_text(json.dumps({"runs": runs, "how": how}))
    model = Model(gguf)
    print(check_kernels(model, binary.parent))
    if not LIBM.glibc:
        print("note: no glibc here: expf/cosf/sinf are correctly rounded, not glibc's (not bit-exact)")
    longest = max(len(r["ids"]) + len(r["tokens"]) for r in runs)
    if longest > 256 or any(len(r["ids"]) >= 64 for r in runs):
        print("note: a prompt of 64+ tokens (flash attention's tiled kernel) or a decode step over 512+ keys "
              "(split-KV) is emulated in float32, not bit for bit")
    div = [divergence(r) for r in runs]
    steps = [min(len(r["tokens"]), args.steps or (16 if d is None else d + 5)) for r, d in zip(runs, div)]
    secs = emulate(model, runs, LLAMACPP, "emu", steps)
    emulate(model, runs, replace(LLAMACPP, order=False), "unordered", steps)
    emulate(model, runs, Arith(), "f32", steps)
    for run, k in zip(runs, steps):
        run["orchard_cut"] = run["orchard"][:k]

    print(f"\n{gguf.name}: {len(runs)} prompts, greedy up to {args.max_tokens} tokens; llama-server {how}; "
          "logprobs of llama.cpp's top two tokens where Orchard's greedy tokens first differ")
    print(f"{'prompt':30} {'matched':>7}  {'llama.cpp: top-2 logprobs':>26} {'margin':>6}  {'Orchard f32':>15}  "
          f"{'emulation':>15}  {'|emu - llama.cpp|':>17}")
    for run, d in zip(runs, div):
        text = run["text"].replace("\n", " ")[-30:]
        if d is None:
            print(f"{text:30} {len(run['tokens']):>3}/{len(run['tokens']):<3}  identical")
            continue
        (t1, l1), (t2, l2) = run["top"][d][:2]
        o, e = run["orchard"][d], run["emu"][d]

        def two(m: dict, t1=t1, t2=t2) -> str:
            return f"{m.get(t1, float('nan')):7.4f} {m.get(t2, float('nan')):7.4f}"

        gap = max(abs(e[t1] - l1), abs(e[t2] - l2))
        print(f"{text:30} {d:>3}/{len(run['tokens']):<3}  {t1:>6} {l1:7.4f} {t2:>6} {l2:7.4f} {l1 - l2:6.3f}  "
              f"{two(o)}  {two(e)}  {gap:17.1e}")
    d_o, ag_o, n = diffs(runs, "orchard_cut")
    d_e, ag_e, _ = diffs(runs, "emu")
    d_u, ag_u, _ = diffs(runs, "unordered")
    d_fo = np.asarray([abs(r["f32"][j][t] - v) for r in runs for j, step in enumerate(r["orchard_cut"])
                       for t, v in step.items() if t in r["f32"][j]])
    print(f"\n|logprob - llama.cpp's| of llama.cpp's top-{TOP} tokens over the {n} steps emulated "
          f"({sum(len(r['tokens']) for r in runs)} generated), and how often the argmax is llama.cpp's token:")
    print(f"  Orchard (float32 on the dequantized weights)         {stats(d_o)}   argmax {ag_o}/{n}")
    print(f"  emulation of llama.cpp, bit for bit                  {stats(d_e)}   argmax {ag_e}/{n}")
    print(f"  the same roundings, summed in float64 instead        {stats(d_u)}   argmax {ag_u}/{n}")
    print(f"  (the emulation with every rounding off against Orchard's own logprobs: {stats(d_fo)}; "
          f"{secs:.0f} s for the bit-for-bit pass)")
    if args.ablate:
        ablate(binary, gguf, runs, model, args.max_tokens)
    print(f"({time.monotonic() - t0:.0f} s)")
    return 0


def ablate(binary: Path, gguf: Path, runs: list[dict], model: Model, max_tokens: int) -> None:
    """llama-server with its roundings taken away one by one, each against a float32 forward
    along its own tokens (the emulation with every rounding off: Orchard's arithmetic)."""
    from gguf_vs_llamacpp import float32_twin

    twin = float32_twin(gguf, binary)
    exact = ["--cache-type-k", "f32", "--cache-type-v", "f32", "-fa", "off"]
    configs = [(gguf, [], "Q4_1 file, defaults (f16 KV, flash attention)"),
               (gguf, exact, "Q4_1 file, f32 KV, no flash attention"),
               (twin, [], "float32 twin, f16 KV, flash attention"),
               (twin, exact, "float32 twin, f32 KV, no flash attention")]
    texts = [r["text"] for r in runs]
    print("\nllama-server without each of its roundings, against a float32 forward along its own tokens "
          f"(|logprob difference| of its top-{TOP}, all steps):")
    for path, extra, what in configs:
        theirs, _ = run_llama(binary, path, texts, max_tokens, extra)
        emulate(model, theirs, Arith(), "f32", [len(r["tokens"]) for r in theirs])
        d, ag, n = diffs(theirs, "f32")
        print(f"  {what:48} {stats(d)}   argmax {ag}/{n}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
