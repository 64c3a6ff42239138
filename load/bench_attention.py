"""Paged attention: Metal kernel vs pure-MLX reference vs dense `mx.fast.scaled_dot_product_attention`.

    python load/bench_attention.py [--quick] [--dtype float16] [--heads 32 --kv-heads 8 --head-size 128]

Microseconds per call (one layer's attention) over a grid of batch shapes:
  decode  B x L      : B sequences, one query row each, contexts of L tokens
  prefill q @ L      : one chunk of q query rows ending a context of L tokens
  mixed              : decode rows and a prefill chunk in one varlen batch
The paged inputs use shuffled block tables; the dense SDPA gets the same K/V already
contiguous per sequence (what paging costs is the gap between the two). The reference's
host-side plan is built once per shape, outside the timing, as the engine does once
per step for all layers. Without a Metal GPU the kernel cannot run: the script says so
and times the reference and SDPA alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import platform  # noqa: E402

platform.preload_blas()  # before MLX is imported
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from cluster.worker.kernels import metal as km  # noqa: E402
from cluster.worker.kernels.reference import AttentionPlan, paged_attention_reference  # noqa: E402

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

FULL_GRID = [
    ("decode", [(1, 1)] * 1, 512),
    ("decode", [(1, 1)] * 8, 1024),
    ("decode", [(1, 1)] * 32, 1024),
    ("decode", [(1, 1)] * 64, 2048),
    ("decode", [(1, 1)] * 4, 8192),
    ("prefill", [(128, 0)], 128),
    ("prefill", [(512, 0)], 512),
    ("prefill", [(512, 0)], 2048),
    ("mixed", [(1, 1)] * 16 + [(256, 0)], 1024),
]
QUICK_GRID = [
    ("decode", [(1, 1)] * 1, 256),
    ("decode", [(1, 1)] * 8, 512),
    ("decode", [(1, 1)] * 32, 1024),
    ("prefill", [(128, 0)], 128),
    ("prefill", [(256, 0)], 1024),
    ("mixed", [(1, 1)] * 8 + [(128, 0)], 512),
]


def build(rows, context: int, H: int, KVH: int, D: int, BS: int, dtype, seed: int = 0):
    """Paged inputs for sequences of `context` tokens; `rows` gives each one's q_len."""
    rng = np.random.default_rng(seed)
    q_lens = [q for q, _ in rows]
    S = len(q_lens)
    nb = -(-context // BS)
    num_blocks = S * nb + 8
    phys = rng.permutation(num_blocks)[: S * nb].reshape(S, nb).astype(np.int32)
    T = sum(q_lens)
    q = mx.array(rng.standard_normal((T, H, D)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((num_blocks, BS, KVH, D)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((num_blocks, BS, KVH, D)).astype(np.float32)).astype(dtype)
    cu = mx.array(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    lens = mx.array(np.full(S, context, np.int32))
    bt = mx.array(phys)
    # Dense, contiguous copies for SDPA: [S, KVH, L, D].
    pos = np.arange(context)
    flat = phys[:, pos // BS] * BS + pos % BS  # [S, L] slots
    kd = mx.contiguous(k.reshape(-1, KVH, D)[mx.array(flat)].transpose(0, 2, 1, 3))
    vd = mx.contiguous(v.reshape(-1, KVH, D)[mx.array(flat)].transpose(0, 2, 1, 3))
    mx.eval(q, k, v, kd, vd)
    return q, k, v, bt, lens, cu, kd, vd


def timeit(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - t0) / iters * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small grid (seconds on a CPU)")
    ap.add_argument("--dtype", choices=DTYPES, help="default: float16 on Metal, float32 on the CPU")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=0, help="timed calls per shape (default: 20 on Metal, 5 on CPU)")
    args = ap.parse_args(argv)

    metal = platform.has_metal()
    dtype = DTYPES[args.dtype] if args.dtype else (mx.float16 if metal else mx.float32)
    iters = args.iters or (20 if metal else 5)
    H, KVH, D, BS = args.heads, args.kv_heads, args.head_size, args.block_size
    scale = D**-0.5
    grid = QUICK_GRID if args.quick else FULL_GRID

    print(f"paged attention, H={H} KVH={KVH} D={D} block={BS} {str(dtype).split('.')[-1]}, {iters} calls per shape")
    if not metal:
        print("No Metal GPU here: the Metal kernel cannot run; timing the reference and SDPA only.")
    header = f"{'shape':<22}{'rows':>6}{'kernel us':>12}{'split':>7}{'reference us':>15}{'sdpa us':>11}"
    print(header)
    print("-" * len(header))
    for kind, rows, context in grid:
        # decode rows have q_len 1; a prefill chunk's q_len is its first field (context >= q_len)
        rows = [(q, 0) for q, _ in rows]
        q, k, v, bt, lens, cu, kd, vd = build(rows, context, H, KVH, D, BS, dtype)
        T = q.shape[0]
        plan = AttentionPlan.build(cu, lens, bt, BS)
        label = {"decode": f"decode {len(rows)} x {context}", "prefill": f"prefill {rows[0][0]} @ {context}",
                 "mixed": f"mixed {len(rows) - 1}+{rows[-1][0]} @ {context}"}[kind]

        ref_us = timeit(lambda: paged_attention_reference(q, k, v, bt, lens, cu, scale=scale, plan=plan), iters)

        sdpa_us = float("nan")
        if kind == "decode":
            qd = q.reshape(len(rows), 1, H, D).transpose(0, 2, 1, 3)
            sdpa_us = timeit(lambda: mx.fast.scaled_dot_product_attention(qd, kd, vd, scale=scale), iters)
        elif kind == "prefill":
            qd = q.reshape(1, T, H, D).transpose(0, 2, 1, 3)
            sdpa_us = timeit(
                lambda: mx.fast.scaled_dot_product_attention(qd, kd, vd, scale=scale, mask="causal"), iters
            )

        kern_us, split = float("nan"), "-"
        if metal:
            split = "yes" if km.use_partitions(T, H, KVH, context) else "no"
            kern_us = timeit(lambda: km.paged_attention_metal(q, k, v, bt, lens, cu, scale=scale, plan=plan), iters)

        def fmt(x):
            return f"{x:>11.0f}" if x == x else f"{'-':>11}"

        print(f"{label:<22}{T:>6}{fmt(kern_us):>12}{split:>7}{fmt(ref_us):>15}{fmt(sdpa_us):>11}")


if __name__ == "__main__":
    main()
