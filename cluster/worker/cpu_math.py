"""Fast fp32 `exp` for MLX's CPU backend, and the two places a decode step needs it.

MLX's CPU `exp` is scalar libm: the SiLU of the MLP and the decode attention's softmax
are a large part of a small model's decode step. Written as range reduction plus a
degree-6 polynomial (relative error ~1.2e-7, fp32 rounding) inside `mx.compile`, it
becomes one fused, vectorised loop, several times faster; but for large prefill score
matrices MLX's single-op softmax stays faster, so only decode uses it (MEASUREMENTS.md).
CPU only; on Metal the native functions are fast and stay.
"""

from __future__ import annotations


import mlx.core as mx

_LOG2E = 1.4426950408889634
# Taylor coefficients of 2^f = e^(f ln 2) for f in [-0.5, 0.5]
_P = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
      2.402264791363012e-1, 6.931472028550421e-1, 1.0)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 x; exactly 0 for -inf (masked scores)."""
    t = mx.clip(x * _LOG2E, -126.0, 127.0)  # normal float32 range; saturates outside
    n = mx.floor(t + 0.5)
    f = t - n
    p = _P[0]
    for c in _P[1:]:
        p = p * f + c
    scale = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # 2^n
    return mx.where(x == -float("inf"), 0.0, p * scale)


@mx.compile
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's `swiglu`."""
    return gate * x / (1.0 + fast_exp(-gate))


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (call inside `mx.compile` to fuse it)."""
    e = fast_exp(x - mx.max(x, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)
