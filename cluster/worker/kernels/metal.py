"""Metal varlen paged attention: decode rows and prefill chunks in one launch per layer
(two on the long-context path).

Layout (one threadgroup per query row and group of query heads):
- grid z = query row t (the packed token), grid y = a group of QPG query heads that share
  one KV head (QPG = the largest divisor of H/KVH that is <= MAX_QUERIES_PER_GROUP), and
  for the long-context path grid x = context partition.
- A threadgroup is NSG simdgroups of 32 lanes. Each lane owns E = ceil(D/32) contiguous
  elements of the head dimension, so one simdgroup step reads one whole K (then V) row
  with coalesced, vectorisable loads; `simd_sum` finishes each dot product.
- Keys go round-robin to simdgroups (key k to simdgroup k mod NSG): even a short
  context spreads over all of them. Each simdgroup keeps an online softmax (running
  max, sum, output) per query head in registers, in float32 whatever the input dtype;
  at the end the simdgroups merge through threadgroup memory.
- The QPG heads of a group reuse every K/V row they load (GQA decode is bound by memory
  bandwidth), and the registers for QPG queries stay bounded.
- Each threadgroup finds its sequence by binary search over `cu_seqlens_q`, then visits
  only the keys its row may see: causal within the chunk (keys 0 .. L - q_len + p) and,
  with a sliding window W, only the last W of them. Soft-capping is
  `softcap * tanh(score / softcap)` on the scaled score. A head's sink (gpt-oss) is one
  more logit in its softmax's denominator, added when the partial softmaxes are merged.

Long contexts (split-K): with few rows and long contexts a threadgroup per row leaves
the GPU idle, so the context is cut into partitions of PARTITION_SIZE keys, one
threadgroup each, writing an unnormalised partial output with its max and sum; a second
small kernel merges them with a log-sum-exp reduction. When to switch is decided on the
host (`use_partitions`); the thresholds are constants to tune on a Mac.

`mx.fast.metal_kernel` is looked up each time a kernel object is built, and built
kernels are cached per factory, so a test can substitute a CPU emulator of Metal
(tests/metal_emulator) and run this exact source on Linux.

Portability note: MLX passes inputs of fewer than 8 elements in the `constant` address
space, so helpers take their pointers as template parameters (a `device` pointer
parameter would not accept them).
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx

from cluster.worker.kernels.reference import paged_attention_reference

log = logging.getLogger(__name__)

# Tunables (measure on a Mac before changing; nothing here could be timed on Linux).
NUM_SIMDGROUPS = 4  # simdgroups per threadgroup (128 threads)
MAX_QUERIES_PER_GROUP = 8  # query heads per threadgroup: registers grow with it
PARTITION_SIZE = 512  # keys per threadgroup on the long-context path
LONG_CONTEXT_MIN_KEYS = 2048  # split only when the longest context is at least this long...
LONG_CONTEXT_MAX_THREADGROUPS = 1024  # ...and the single-pass grid has fewer threadgroups than this
NO_SINK = -3.0e38  # ORCH_NEG: a head without a sink
MAX_HEAD_SIZE = 256  # E = D/32 elements per lane and query head live in registers

_HEADER = r"""
constexpr constant float ORCH_NEG = -3.0e38f;  // finite "minus infinity": safe under fast math

// The sequence owning packed query row `row`: the largest s with cu[s] <= row.
template <typename CuPtr>
METAL_FUNC int orch_find_seq(CuPtr cu, int num_seqs, int row) {
  int lo = 0;
  int hi = num_seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (cu[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Online softmax over keys [k_lo, k_hi] of one row for QPG query heads h0 .. h0+QPG-1,
// this simdgroup taking keys k_lo + sg, k_lo + sg + NSG, ...
template <typename T, int D, int BS, int QPG, int NSG, typename QPtr, typename KPtr, typename VPtr, typename BPtr>
METAL_FUNC void orch_attend(
    QPtr q, KPtr k_cache, VPtr v_cache, BPtr block_row,
    int row, int h0, int kvh, int H, int KVH, int k_lo, int k_hi,
    float scale, float softcap, uint sg, uint lane,
    thread float (&m)[QPG], thread float (&l)[QPG], thread float (&o)[QPG][(D + 31) / 32]) {
  constexpr int E = (D + 31) / 32;
  constexpr bool FULL = (D % 32) == 0;
  const int d0 = int(lane) * E;
  float qv[QPG][E];
  for (int g = 0; g < QPG; g++) {
    const size_t qbase = (size_t(row) * H + h0 + g) * D + d0;
    for (int e = 0; e < E; e++) {
      qv[g][e] = (FULL || d0 + e < D) ? float(q[qbase + e]) * scale : 0.0f;
      o[g][e] = 0.0f;
    }
    m[g] = ORCH_NEG;
    l[g] = 0.0f;
  }
  for (int k = k_lo + int(sg); k <= k_hi; k += NSG) {
    const int phys = block_row[uint(k) / BS];
    const size_t base = ((size_t(phys) * BS + uint(k) % BS) * KVH + kvh) * D + d0;
    float kk[E];
    float vv[E];
    for (int e = 0; e < E; e++) {
      const bool in_head = FULL || d0 + e < D;
      kk[e] = in_head ? float(k_cache[base + e]) : 0.0f;
      vv[e] = in_head ? float(v_cache[base + e]) : 0.0f;
    }
    for (int g = 0; g < QPG; g++) {
      float s = 0.0f;
      for (int e = 0; e < E; e++) {
        s += qv[g][e] * kk[e];
      }
      s = simd_sum(s);
      if (softcap > 0.0f) {
        s = softcap * precise::tanh(s / softcap);
      }
      const float m_new = max(m[g], s);
      const float f = fast::exp(m[g] - m_new);
      const float p = fast::exp(s - m_new);
      l[g] = l[g] * f + p;
      for (int e = 0; e < E; e++) {
        o[g][e] = o[g][e] * f + p * vv[e];
      }
      m[g] = m_new;
    }
  }
}

// Key range of packed row `row`: [k_lo, k_hi], both inclusive.
template <typename CuPtr, typename LenPtr>
METAL_FUNC int orch_key_range(CuPtr cu, LenPtr seq_lens, int num_seqs, int row, int window,
                              thread int& k_lo, thread int& k_hi) {
  const int s = orch_find_seq(cu, num_seqs, row);
  const int q_len = cu[s + 1] - cu[s];
  k_hi = seq_lens[s] - q_len + (row - cu[s]);
  k_lo = window > 0 ? max(0, k_hi - window + 1) : 0;
  return s;
}

// Merges the simdgroups' softmax states for head g (call for g = 0, 1, ... in order): max M, sum total,
// rescaled outputs in tg_o.
template <int D, int QPG, int NSG>
METAL_FUNC void orch_merge_head(
    int g, thread const float (&m)[QPG], thread const float (&l)[QPG], thread const float (&o)[QPG][(D + 31) / 32],
    threadgroup float* tg_m, threadgroup float* tg_l, threadgroup float* tg_o, uint sg, uint lane,
    thread float& M, thread float& total) {
  constexpr int E = (D + 31) / 32;
  constexpr bool FULL = (D % 32) == 0;
  if (g == 0) {  // publish every head's max and sum once (uniform over the threadgroup)
    if (lane == 0) {
      for (int h = 0; h < QPG; h++) {
        tg_m[sg * QPG + h] = m[h];
        tg_l[sg * QPG + h] = l[h];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  M = ORCH_NEG;
  for (int j = 0; j < NSG; j++) {
    M = max(M, tg_m[j * QPG + g]);
  }
  total = 0.0f;
  for (int j = 0; j < NSG; j++) {
    total += tg_l[j * QPG + g] * fast::exp(tg_m[j * QPG + g] - M);
  }
  const float f = fast::exp(m[g] - M);
  const int d0 = int(lane) * E;
  for (int e = 0; e < E; e++) {
    if (FULL || d0 + e < D) {
      tg_o[sg * D + d0 + e] = o[g][e] * f;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
"""

# Single pass: the whole key range of a row in one threadgroup.
_SOURCE = r"""
  constexpr int E = (D + 31) / 32;
  const int H = q_shape[1];
  const int KVH = k_cache_shape[2];
  const int num_seqs = seq_lens_shape[0];
  const int max_blocks = block_tables_shape[1];
  const int row = int(threadgroup_position_in_grid.z);
  const int h0 = int(threadgroup_position_in_grid.y) * QPG;
  const int kvh = h0 / (H / KVH);
  const uint sg = simdgroup_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint tid = sg * 32 + lane;

  int k_lo, k_hi;
  const int s = orch_key_range(cu_seqlens_q, seq_lens, num_seqs, row, window, k_lo, k_hi);

  float m[QPG];
  float l[QPG];
  float o[QPG][E];
  orch_attend<T, D, BS, QPG, NSG>(
      q, k_cache, v_cache, block_tables + size_t(s) * max_blocks, row, h0, kvh, H, KVH, k_lo, k_hi,
      scale, softcap, sg, lane, m, l, o);

  threadgroup float tg_m[NSG * QPG];
  threadgroup float tg_l[NSG * QPG];
  threadgroup float tg_o[NSG * D];
  for (int g = 0; g < QPG; g++) {
    float M, total;
    orch_merge_head<D, QPG, NSG>(g, m, l, o, tg_m, tg_l, tg_o, sg, lane, M, total);
    // the head's sink: one more logit in the denominator (ORCH_NEG when there is none)
    const float sink = sinks[h0 + g];
    const float M2 = max(M, sink);
    const float keep = fast::exp(M - M2);
    const float inv = keep / (total * keep + fast::exp(sink - M2));
    const size_t obase = (size_t(row) * H + h0 + g) * D;
    for (int d = int(tid); d < D; d += NSG * 32) {
      float acc = 0.0f;
      for (int j = 0; j < NSG; j++) {
        acc += tg_o[j * D + d];
      }
      out[obase + d] = static_cast<T>(acc * inv);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
"""

# Long-context pass 1: partition x of a row's keys; writes unnormalised partials.
_PARTITION_SOURCE = r"""
  constexpr int E = (D + 31) / 32;
  const int H = q_shape[1];
  const int KVH = k_cache_shape[2];
  const int num_seqs = seq_lens_shape[0];
  const int max_blocks = block_tables_shape[1];
  const int part = int(threadgroup_position_in_grid.x);
  const int num_parts = int(threadgroups_per_grid.x);
  const int row = int(threadgroup_position_in_grid.z);
  const int h0 = int(threadgroup_position_in_grid.y) * QPG;
  const int kvh = h0 / (H / KVH);
  const uint sg = simdgroup_index_in_threadgroup;
  const uint lane = thread_index_in_simdgroup;
  const uint tid = sg * 32 + lane;

  int k_lo, k_hi;
  const int s = orch_key_range(cu_seqlens_q, seq_lens, num_seqs, row, window, k_lo, k_hi);
  k_lo = max(k_lo, part * PS);
  k_hi = min(k_hi, part * PS + PS - 1);
  if (k_lo > k_hi) {  // nothing to see here (uniform over the threadgroup)
    for (int g = 0; g < QPG; g++) {
      const size_t pidx = (size_t(row) * H + h0 + g) * num_parts + part;
      if (tid == 0) {
        part_max[pidx] = ORCH_NEG;
        part_sum[pidx] = 0.0f;
      }
      for (int d = int(tid); d < D; d += NSG * 32) {
        part_out[pidx * D + d] = 0.0f;
      }
    }
    return;
  }

  float m[QPG];
  float l[QPG];
  float o[QPG][E];
  orch_attend<T, D, BS, QPG, NSG>(
      q, k_cache, v_cache, block_tables + size_t(s) * max_blocks, row, h0, kvh, H, KVH, k_lo, k_hi,
      scale, softcap, sg, lane, m, l, o);

  threadgroup float tg_m[NSG * QPG];
  threadgroup float tg_l[NSG * QPG];
  threadgroup float tg_o[NSG * D];
  for (int g = 0; g < QPG; g++) {
    float M, total;
    orch_merge_head<D, QPG, NSG>(g, m, l, o, tg_m, tg_l, tg_o, sg, lane, M, total);
    const size_t pidx = (size_t(row) * H + h0 + g) * num_parts + part;
    if (tid == 0) {
      part_max[pidx] = M;
      part_sum[pidx] = total;
    }
    for (int d = int(tid); d < D; d += NSG * 32) {
      float acc = 0.0f;
      for (int j = 0; j < NSG; j++) {
        acc += tg_o[j * D + d];
      }
      part_out[pidx * D + d] = acc;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
"""

# Long-context pass 2: one simdgroup per (row, head) merges the partitions.
_MERGE_SOURCE = r"""
  const int num_parts = part_max_shape[2];
  const int row = int(threadgroup_position_in_grid.z);
  const int h = int(threadgroup_position_in_grid.y);
  const int H = int(threadgroups_per_grid.y);
  const uint lane = thread_index_in_simdgroup;
  const size_t base = (size_t(row) * H + h) * num_parts;

  float M = ORCH_NEG;
  for (int j = int(lane); j < num_parts; j += 32) {
    M = max(M, part_max[base + j]);
  }
  M = simd_max(M);
  float total = 0.0f;
  for (int j = int(lane); j < num_parts; j += 32) {
    total += part_sum[base + j] * fast::exp(part_max[base + j] - M);
  }
  total = simd_sum(total);
  const float sink = sinks[h];  // ORCH_NEG when there is none
  const float M2 = max(M, sink);
  const float inv = 1.0f / (total * fast::exp(M - M2) + fast::exp(sink - M2));
  M = M2;
  for (int d = int(lane); d < D; d += 32) {
    float acc = 0.0f;
    for (int j = 0; j < num_parts; j++) {
      acc += part_out[(base + j) * D + d] * fast::exp(part_max[base + j] - M);
    }
    out[(size_t(row) * H + h) * D + d] = static_cast<T>(acc * inv);
  }
"""

_INPUTS = ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_seqlens_q", "scale", "softcap", "window",
           "sinks"]

_kernels: dict = {}
_warned: set = set()


def _kernel(kind: str):
    """The kernel object for `kind`, built once per `mx.fast.metal_kernel` implementation."""
    factory = mx.fast.metal_kernel
    key = (kind, factory)
    k = _kernels.get(key)
    if k is None:
        if kind == "single":
            k = factory(name="orchard_paged_attention", input_names=_INPUTS, output_names=["out"],
                        source=_SOURCE, header=_HEADER)
        elif kind == "partition":
            k = factory(name="orchard_paged_attention_partition", input_names=_INPUTS,
                        output_names=["part_out", "part_max", "part_sum"], source=_PARTITION_SOURCE, header=_HEADER)
        else:
            k = factory(name="orchard_paged_attention_merge", input_names=["part_out", "part_max", "part_sum", "sinks"],
                        output_names=["out"], source=_MERGE_SOURCE, header=_HEADER)
        _kernels[key] = k
    return k


def queries_per_group(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per threadgroup: the largest divisor of H/KVH up to MAX_QUERIES_PER_GROUP."""
    g = num_heads // num_kv_heads
    return max(d for d in range(1, min(g, MAX_QUERIES_PER_GROUP) + 1) if g % d == 0)


def use_partitions(num_rows: int, num_heads: int, num_kv_heads: int, max_context: int) -> bool:
    """Whether the split-K path should pay: long contexts and too few threadgroups otherwise."""
    if max_context < LONG_CONTEXT_MIN_KEYS or max_context <= PARTITION_SIZE:
        return False
    groups = num_rows * (num_heads // queries_per_group(num_heads, num_kv_heads))
    return groups < LONG_CONTEXT_MAX_THREADGROUPS


def supports(q: mx.array, k_cache: mx.array) -> bool:
    D = q.shape[-1]
    return (
        q.dtype in (mx.float32, mx.float16, mx.bfloat16)
        and k_cache.dtype in (mx.float32, mx.float16, mx.bfloat16)  # loads are widened to float
        and 0 < D <= MAX_HEAD_SIZE
        and k_cache.shape[-1] == D
    )


def _int32(x) -> mx.array:
    x = x if isinstance(x, mx.array) else mx.array(x, dtype=mx.int32)
    return x if x.dtype == mx.int32 else x.astype(mx.int32)


def paged_attention_kernel(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale, sliding_window=-1, softcap=0.0,
    sinks=None, partition_size: int = 0, num_simdgroups: int = NUM_SIMDGROUPS, max_context: int | None = None,
) -> mx.array:
    """The kernel itself, with the launch choices explicit (tests force each path here).

    partition_size 0: single pass; > 0: split-K with partitions of that many keys,
    enough of them for `max_context` keys (default: the block table's capacity).
    """
    T, H, D = q.shape
    _, BS, KVH, _ = k_cache.shape
    if H % KVH:
        raise ValueError(f"{H} query heads are not a multiple of {KVH} KV heads")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    if not supports(q, k_cache):
        raise ValueError(f"unsupported by the Metal kernel: head size {D}, dtypes {q.dtype}/{k_cache.dtype}")
    if T == 0:
        return mx.zeros((0, H, D), dtype=q.dtype)
    block_tables, seq_lens, cu_seqlens_q = _int32(block_tables), _int32(seq_lens), _int32(cu_seqlens_q)
    qpg = queries_per_group(H, KVH)
    nsg = int(num_simdgroups)
    window = int(sliding_window) if sliding_window and sliding_window > 0 else -1
    # no sinks: a finite "minus infinity" per head, whose exp is 0
    sinks = mx.full((H,), NO_SINK, mx.float32) if sinks is None else sinks.astype(mx.float32).reshape(H)
    inputs = [q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, float(scale), float(softcap or 0.0), window,
              sinks]
    template = [("T", q.dtype), ("D", D), ("BS", BS), ("QPG", qpg), ("NSG", nsg)]
    threads = nsg * 32
    if partition_size <= 0:
        return _kernel("single")(
            inputs=inputs, template=template, grid=(threads, H // qpg, T), threadgroup=(threads, 1, 1),
            output_shapes=[(T, H, D)], output_dtypes=[q.dtype],
        )[0]
    if max_context is None:
        max_context = block_tables.shape[1] * BS
    parts = max(1, math.ceil(max_context / partition_size))
    part_out, part_max, part_sum = _kernel("partition")(
        inputs=inputs, template=template + [("PS", int(partition_size))],
        grid=(threads * parts, H // qpg, T), threadgroup=(threads, 1, 1),
        output_shapes=[(T, H, parts, D), (T, H, parts), (T, H, parts)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return _kernel("merge")(
        inputs=[part_out, part_max, part_sum, sinks], template=[("T", q.dtype), ("D", D)],
        grid=(32, H, T), threadgroup=(32, 1, 1), output_shapes=[(T, H, D)], output_dtypes=[q.dtype],
    )[0]


def _max_context(plan, block_tables, block_size: int) -> int:
    """Longest context of the step: from the host-side plan when there is one (no device
    sync), else the block tables' capacity (an upper bound)."""
    try:
        return max(max(g.lens) for g in plan.groups)
    except (AttributeError, TypeError, ValueError):  # no plan, or one without lengths
        return block_tables.shape[1] * block_size


def paged_attention_metal(
    q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale, sliding_window=-1, softcap=0.0, sinks=None,
    plan=None
):
    """Same contract as `paged_attention_reference`; `plan` only tells the longest context."""
    if not supports(q, k_cache):
        key = (q.shape[-1], q.dtype, k_cache.dtype)
        if key not in _warned:
            _warned.add(key)
            log.warning("Metal paged attention does not support head size %d / %s with a %s cache: "
                        "using the reference", q.shape[-1], q.dtype, k_cache.dtype)
        return paged_attention_reference(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
            scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, plan=plan,
        )
    T, H, _ = q.shape
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    max_context = _max_context(plan, block_tables, BS)
    split = use_partitions(T, H, KVH, max_context)
    return paged_attention_kernel(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale, sliding_window=sliding_window,
        softcap=softcap, sinks=sinks, partition_size=PARTITION_SIZE if split else 0, max_context=max_context,
    )
