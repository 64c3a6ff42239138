"""Varlen paged attention: one function for the engine, three backends.

`paged_attention(...)` runs the Metal kernel on a Metal GPU; elsewhere the C kernel of
`cpu.py` (built on first use with the system compiler), and the pure-MLX reference where
that cannot be built. `ORCHARD_ATTENTION=metal|cpu|reference` (or `set_backend`) forces one.
The reference is the oracle both kernels are tested against.

Contract (all three):
  q            [T, H, D]      packed queries of all sequences this step
  k_cache      [num_blocks, block_size, KVH, D]   (v_cache the same); its dtype may
               differ from q's (--kv-cache-dtype): read, it is widened to q's
  block_tables [S, max_blocks] int32   physical block ids per sequence (padding: any valid id)
  seq_lens     [S] int32      context length including this step's tokens
  cu_seqlens_q [S + 1] int32  query row offsets
  scale, sliding_window (-1 off), softcap (0 off), sinks ([H] logits, None off)
  -> [T, H, D]
A query at chunk position p of a chunk of q_len in a context of L attends keys
0 .. L - q_len + p, and with a window W only the last W of them.
"""

from __future__ import annotations

import os

import mlx.core as mx

from cluster.worker.kernels.reference import AttentionPlan, paged_attention_reference

__all__ = ["AttentionPlan", "paged_attention", "paged_attention_reference", "backend", "set_backend"]

BACKENDS = ("metal", "cpu", "reference")

_forced: str | None = os.environ.get("ORCHARD_ATTENTION") or None


def set_backend(name: str | None) -> None:
    """Force 'metal', 'cpu' or 'reference'; None restores the automatic choice."""
    global _forced
    if name not in (None, *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}: use one of {', '.join(BACKENDS)}")
    _forced = name


def backend() -> str:
    if _forced:
        if _forced not in BACKENDS:
            raise ValueError(f"ORCHARD_ATTENTION={_forced!r}: use one of {', '.join(BACKENDS)}")
        return _forced
    try:
        if mx.metal.is_available():
            return "metal"
    except Exception:
        pass
    from cluster.worker.kernels import cpu

    return "cpu" if cpu.available() else "reference"


def c_kernel_serves(name: str, q_dtype, kv_dtype=mx.float32, shape: tuple[int, int, int] | None = None) -> bool:
    """The C kernel runs for backend `name` on float32 queries over float32 / float16 /
    bfloat16 caches and, given (H, KVH, D), shapes it supports; else the reference."""
    if name != "cpu" or q_dtype != mx.float32 or kv_dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return False
    if shape is None:
        return True
    from cluster.worker.kernels.cpu import MAX_GROUP, MAX_HEAD_DIM

    H, KVH, D = shape
    return H % KVH == 0 and H // KVH <= MAX_GROUP and D <= MAX_HEAD_DIM


def needs_plan(dtype=mx.float32, kv_dtype=None) -> bool:
    """Whether attention for `dtype` queries over a `kv_dtype` pool (default: the same)
    uses the host-side `AttentionPlan` (the C kernel does not)."""
    return not c_kernel_serves(backend(), dtype, dtype if kv_dtype is None else kv_dtype)


def check_backend() -> str:
    """Resolve the backend now, building the CPU kernel if it is the one: the model runner
    calls this at start-up, so a cold build never lands on a request and a forced backend
    that cannot run is one clear error instead of a failure in every step."""
    name = backend()
    if name == "cpu":
        from cluster.worker.kernels import cpu

        if not cpu.available():
            raise RuntimeError("ORCHARD_ATTENTION=cpu, but the CPU attention kernel cannot be built: "
                               f"{cpu.build_error()}")
    return name


def paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale, sliding_window=-1, softcap=0.0, sinks=None,
    plan=None
):
    name = backend()
    if name == "metal":
        from cluster.worker.kernels.metal import paged_attention_metal

        return paged_attention_metal(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
            scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, plan=plan,
        )
    if c_kernel_serves(name, q.dtype, k_cache.dtype, shape=(q.shape[1], k_cache.shape[2], q.shape[2])):
        from cluster.worker.kernels.cpu import paged_attention_cpu

        return paged_attention_cpu(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
            scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
        )
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
        scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, plan=plan,
    )
