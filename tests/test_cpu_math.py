"""The CPU fast paths equal MLX's own functions to fp32 rounding."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cluster.worker import cpu_math


def test_fast_exp_matches_exp_over_the_float32_range():
    x = mx.array(np.concatenate([np.linspace(-87, 88, 100_001), [-float("inf"), 0.0]]).astype(np.float32))
    got, want = np.array(cpu_math.fast_exp(x)), np.array(mx.exp(x))
    assert got[-2] == 0.0 and got[-1] == 1.0
    assert np.max(np.abs(got - want) / np.maximum(want, 1e-30)) < 5e-7


def test_swiglu_and_softmax_match_mlx():
    rng = np.random.default_rng(0)
    g, u = (mx.array(rng.standard_normal((64, 300)).astype(np.float32) * 6) for _ in range(2))
    assert np.allclose(np.array(cpu_math.swiglu(g, u)), np.array(nn.silu(g) * u), rtol=1e-5, atol=1e-5)
    s = mx.array(rng.standard_normal((4, 2, 7, 50)).astype(np.float32) * 10)
    s = mx.where(mx.arange(50) < 30, s, -float("inf"))  # masked keys
    got = np.array(cpu_math.softmax(s))
    assert np.allclose(got, np.array(mx.softmax(s, axis=-1)), rtol=1e-5, atol=1e-7)
    assert (got[..., 30:] == 0).all()
