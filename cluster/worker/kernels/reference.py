"""Pure-MLX varlen paged attention: the oracle for the Metal kernel and the CPU path.

The batch is packed: T query tokens from S sequences, sequence s owning query rows
`cu_seqlens_q[s]:cu_seqlens_q[s+1]`, which are the *last* q_len positions of a context of
`seq_lens[s]` tokens whose K/V already sit in the paged pool. A query at chunk position p
attends to keys `0 .. L - q_len + p` (causal within the chunk), and with a sliding
window W only to the last W of those.

On the CPU a per-token loop is far too slow, so the work is grouped on the host once per
step (`AttentionPlan`, shared by every layer): all decode rows (q_len == 1) form one
batched SDPA over their gathered blocks; each prefill chunk is one SDPA of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from cluster.worker import cpu_math


def _tolist(x) -> list[int]:
    return x.tolist() if isinstance(x, mx.array) else list(x)


@dataclass
class _Group:
    rows: mx.array  # token rows of the group's queries, in group order
    block_tables: mx.array  # [N, nb] int32
    q_len: int  # queries per sequence (padded for decode groups: 1)
    n_seqs: int
    lens: list[int]
    q_lens: list[int]


@dataclass
class AttentionPlan:
    """Host-side grouping of one varlen batch. Build once per step with `build`."""

    num_tokens: int
    block_size: int
    groups: list[_Group]
    restore: mx.array | None  # gather from concatenated group outputs back to token order
    _derived: dict = field(default_factory=dict)  # masks, biases, gather rows: built once per step

    @classmethod
    def build(cls, cu_seqlens_q, seq_lens, block_tables, block_size: int) -> "AttentionPlan":
        cu = _tolist(cu_seqlens_q)
        lens = _tolist(seq_lens)
        bt = block_tables if isinstance(block_tables, mx.array) else mx.array(block_tables, dtype=mx.int32)
        S = len(lens)
        q_lens = [cu[s + 1] - cu[s] for s in range(S)]
        groups: list[_Group] = []
        order: list[int] = []
        decode = [s for s in range(S) if q_lens[s] == 1]
        if decode:
            nb = max(-(-lens[s] // block_size) for s in decode)
            rows = [cu[s] for s in decode]
            groups.append(
                _Group(
                    rows=mx.array(rows, dtype=mx.int32),
                    block_tables=bt[mx.array(decode, dtype=mx.int32), :nb],
                    q_len=1,
                    n_seqs=len(decode),
                    lens=[lens[s] for s in decode],
                    q_lens=[1] * len(decode),
                )
            )
            order += rows
        for s in range(S):
            if q_lens[s] <= 1:
                continue
            nb = -(-lens[s] // block_size)
            rows = list(range(cu[s], cu[s + 1]))
            groups.append(
                _Group(
                    rows=mx.array(rows, dtype=mx.int32),
                    block_tables=bt[s : s + 1, :nb],
                    q_len=q_lens[s],
                    n_seqs=1,
                    lens=[lens[s]],
                    q_lens=[q_lens[s]],
                )
            )
            order += rows
        T = cu[-1]
        restore = None
        if order != list(range(T)):
            inverse = [0] * T
            for i, row in enumerate(order):
                inverse[row] = i
            restore = mx.array(inverse, dtype=mx.int32)
        return cls(num_tokens=T, block_size=block_size, groups=groups, restore=restore)

    def mask(self, gi: int, sliding_window: int) -> mx.array:
        """Boolean mask [N, 1, q_len, L] for group `gi` (True = attend)."""
        key = (gi, sliding_window)
        m = self._derived.get(key)
        if m is None:
            g = self.groups[gi]
            L = g.block_tables.shape[1] * self.block_size
            k_pos = mx.arange(L)[None, None, :]  # [1, 1, L]
            lens = mx.array(g.lens, dtype=mx.int32)[:, None, None]
            q_lens = mx.array(g.q_lens, dtype=mx.int32)[:, None, None]
            q_pos = lens - q_lens + mx.arange(g.q_len)[None, :, None]  # [N, q, 1]
            m = k_pos <= q_pos
            if sliding_window is not None and sliding_window > 0:
                m = m & (k_pos > q_pos - sliding_window)
            m = m[:, None]
            self._derived[key] = m
        return m

    def kv_rows(self, gi: int, num_kv_heads: int) -> mx.array:
        """Row indices [N, KVH, L] into the cache viewed as [num_blocks*block_size*KVH, D]:
        one gather yields K (or V) already laid out [N, KVH, L, D], no transpose copy."""
        key = ("rows", gi, num_kv_heads)
        rows = self._derived.get(key)
        if rows is None:
            g = self.groups[gi]
            N, nb = g.block_tables.shape
            L = nb * self.block_size
            pos = mx.arange(L, dtype=mx.int32)
            slots = g.block_tables[:, pos // self.block_size] * self.block_size + pos % self.block_size  # [N, L]
            heads = mx.arange(num_kv_heads, dtype=mx.int32)
            rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]
            self._derived[key] = rows
        return rows

    def bias(self, gi: int, sliding_window: int, group: int, dtype) -> mx.array:
        """Additive mask [N, 1, group*q, L] (0 / -inf), query heads of a KV head folded in."""
        key = (gi, sliding_window, group, dtype)
        b = self._derived.get(key)
        if b is None:
            m = _fold_mask(self.mask(gi, sliding_window), group)
            b = mx.where(m, mx.array(0.0, dtype), mx.array(-float("inf"), dtype))
            self._derived[key] = b
        return b


def _fold_mask(mask: mx.array, group: int) -> mx.array:
    """[N, 1, q, L] -> [N, 1, group*q, L], row g*q + i being query i of head g."""
    N, _, Lq, L = mask.shape
    if Lq == 1:
        return mask.reshape(N, 1, 1, L)
    return mx.broadcast_to(mask[:, :, None], (N, 1, group, Lq, L)).reshape(N, 1, group * Lq, L)


@mx.compile
def _attend_fused(q, k, v, bias, scale):
    """q [N, KVH, G*q, D]; k, v [N, KVH, L, D] contiguous; bias [N, 1, G*q | 1, L] additive."""
    scores = (q * scale) @ k.swapaxes(-1, -2) + bias
    return mx.softmax(scores, axis=-1, precise=True) @ v


@mx.compile
def _attend_fused_decode_fp32(q, k, v, bias, scale):
    """`_attend_fused` for decode rows in fp32, with the fused CPU softmax (cpu_math)."""
    scores = (q * scale) @ k.swapaxes(-1, -2) + bias
    return cpu_math.softmax(scores) @ v


def _attend(q, k, v, plan: AttentionPlan, gi: int, sliding_window: int, scale: float, softcap: float, sinks=None):
    """q [N, H, q, D]; k, v [N, KVH, L, D] for group `gi` of the plan.

    The G query heads sharing a KV head are folded into rows, so QK^T and PV are one
    matmul per (sequence, KV head). K/V come contiguous from the row gather
    (`AttentionPlan.kv_rows`): MLX's CPU matmul is several times slower on transposed views.
    """
    N, H, Lq, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    qg = q.reshape(N, KVH, G * Lq, D)
    if not softcap and sinks is None:
        bias = plan.bias(gi, sliding_window, G, q.dtype)
        fused = _attend_fused_decode_fp32 if Lq == 1 and q.dtype == mx.float32 else _attend_fused
        out = fused(qg, k, v, bias, mx.array(scale, q.dtype))
        return out.reshape(N, H, Lq, D)
    mask = _fold_mask(plan.mask(gi, sliding_window), G)
    scores = (qg * scale) @ k.swapaxes(-1, -2)  # [N, KVH, G*q, L]
    if softcap:
        scores = mx.tanh(scores / softcap) * softcap
    scores = mx.where(mask, scores, mx.array(-float("inf"), scores.dtype)).astype(mx.float32)
    if sinks is not None:  # one more logit per head (row g*q + i is head g of the KV head)
        sink = mx.repeat(sinks.astype(mx.float32).reshape(1, KVH, G, 1), Lq, axis=2)  # [1, KVH, G*q, 1]
        scores = mx.concatenate([scores, mx.broadcast_to(sink, (*scores.shape[:-1], 1))], axis=-1)
        probs = mx.softmax(scores, axis=-1, precise=True)[..., :-1].astype(v.dtype)
    else:
        probs = mx.softmax(scores, axis=-1, precise=True).astype(v.dtype)
    return (probs @ v).reshape(N, H, Lq, D)


def paged_attention_reference(
    q: mx.array,
    k_cache: mx.array,
    v_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    *,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    sinks: mx.array | None = None,
    plan: AttentionPlan | None = None,
) -> mx.array:
    """q [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] -> [T, H, D].
    `sinks` [H] (gpt-oss): one more logit per head in its softmax, with no value."""
    T, H, D = q.shape
    NB, BS, KVH, _ = k_cache.shape
    if plan is None:
        plan = AttentionPlan.build(cu_seqlens_q, seq_lens, block_tables, BS)
    outs = []
    for gi, g in enumerate(plan.groups):
        N = g.n_seqs
        rows = plan.kv_rows(gi, KVH)
        # [N, KVH, L, D], in the queries' dtype (a half-precision pool is widened as read)
        k = k_cache.reshape(-1, D)[rows].astype(q.dtype)
        v = v_cache.reshape(-1, D)[rows].astype(q.dtype)
        qg = q[g.rows].reshape(N, g.q_len, H, D).transpose(0, 2, 1, 3)
        o = _attend(qg, k, v, plan, gi, sliding_window, scale, softcap, sinks)
        outs.append(o.transpose(0, 2, 1, 3).reshape(N * g.q_len, H, D))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if plan.restore is not None:
        out = out[plan.restore]
    return out
