/* CPU kernels for what MLX's CPU backend runs slowly: varlen paged attention (the Metal
 * kernel's algorithm in C), SwiGLU (MLX's CPU exp is scalar libm), and further down RMSNorm,
 * RoPE, few-row Linears, K/V and state row writes, the gated delta rule and depthwise
 * convolutions.
 *
 * Built on first use by `cluster/worker/kernels/cpu.py` with the system C compiler and
 * loaded through ctypes; the engine calls it once per layer per step. One work item is
 * one KV head x a block of up to MAX_ROWS / G consecutive query tokens of one sequence,
 * or for a decode row (one token) up to MAX_ROWS / G KV heads at once, whose rows of each
 * slot are contiguous: its rows (tokens x the G query heads sharing each KV head) walk
 * the context through the block table together, so each K/V row is loaded once per
 * item, with an online softmax in float32 over tiles of TILE keys. Blocks of
 * several rows score a tile against a transposed copy of its keys (plain FMAs, no
 * horizontal sums), which is what makes prefill fast. Items are spread over threads with
 * OpenMP when the compiler has it.
 *
 * Layouts: q [T, H, D] float32 with unit stride in D; k_pool / v_pool [slots, KVH, D]
 * contiguous, slot = block_id * block_size + offset, in float32, float16 or bfloat16
 * (kv_kind 0, 1, 2: --kv-cache-dtype; a half-precision tile is widened to float32 as it
 * is loaded, and all arithmetic stays float32); out [T, H, D] float32 contiguous.
 * A query at chunk position i of a chunk of q_len in a context of L tokens attends keys
 * 0 .. L - q_len + i, and with sliding_window W > 0 only the last W of them. sinks (NULL:
 * none) holds one logit per query head that joins its softmax with no value (gpt-oss).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

#define TILE 32
#define MAX_ROWS 32 /* query rows (tokens x heads of a group) per work item */
#define MAX_GROUP 32
#define MAX_HEAD_DIM 576 /* DeepSeek MLA: latent 512 + rope key 64; Gemma 4: 512 */
#define NEG_BIG (-1.0e30f)

/* 8 floats (GCC/clang vector extension): TILE is 4 of them */
typedef float vf8 __attribute__((vector_size(32)));

/* exp(x) for x <= 0 (softmax after max subtraction): range reduction to 2^n * 2^f,
 * f in [-0.5, 0.5], degree-6 polynomial; relative error ~1e-7. Branch-free, so the
 * loops that call it vectorise. Below 2^-125 it returns exactly 0, never a subnormal:
 * without flush-to-zero, arithmetic on subnormals costs ~100 cycles an operation. */
static inline float exp_neg(float x) {
    float t = x * 1.4426950408889634f;
    const float zero = t < -125.0f ? 0.0f : 1.0f;
    t = t < -125.0f ? -125.0f : t;
    float n = floorf(t + 0.5f);
    float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f * zero;
}

/* IEEE half -> float, branch-free (normals, subnormals, inf and NaN): the half's exponent
 * and mantissa shifted into a float's, rescaled by 2^-112; subnormals through the float
 * 0.5 + m * 2^-24 trick. */
static inline float bits_float(uint32_t u) { union { uint32_t u; float f; } x = { u }; return x.f; }
static inline uint32_t float_bits(float f) { union { float f; uint32_t u; } x = { f }; return x.u; }
static inline float half_to_float(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normal = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float subnormal = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_float(sign | (two_w < (1u << 27) ? float_bits(subnormal) : float_bits(normal)));
}
static inline float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

/* n elements of a pool row (kind 1: float16, 2: bfloat16) into float32 */
static inline void widen(const uint16_t *src, float *dst, int n, int kind) {
    if (kind == 1) {
        int i = 0;
#ifdef __F16C__
        /* x86's F16C converts 8 halves in one instruction (exact, subnormals included) */
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
        for (; i < n; i++) dst[i] = half_to_float(src[i]);
    } else
        for (int i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
}

static inline float dot(const float *a, const float *b, int d) {
    float s = 0.0f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* out[j] = q . krow[j] for the n keys of a tile (a decode row's scores). With AVX, 8 keys
 * at a time: 8 independent FMA chains, then one horizontal-add tree for all 8 sums instead
 * of a reduction per key (which, at D = 64, cost as much as the dot itself). Entries n ..
 * of the last group of 8 are written with some key's score; the caller masks them. */
static inline void scores(const float *q, const float *const *krow, int n, int D, float *out) {
#if defined(__AVX__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (int j0 = 0; j0 < n; j0 += 8) {
            __m256 a[8];
            for (int jj = 0; jj < 8; jj++) {
                const float *k = krow[j0 + jj < n ? j0 + jj : j0];
                __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
                for (int d = 8; d < D; d += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), s);
                a[jj] = s;
            }
            const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            _mm256_storeu_ps(out + j0, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                                     _mm256_permute2f128_ps(u0, u1, 0x31)));
        }
        return;
    }
#endif
    for (int j = 0; j < n; j++) out[j] = dot(q, krow[j], D);
}

int orch_paged_attention(
    const float *q, int64_t q_stride_t, int64_t q_stride_h,
    const void *k_pool_, const void *v_pool_, int32_t kv_kind,
    const int32_t *block_tables, int32_t max_blocks,
    const int32_t *seq_lens, const int32_t *cu_seqlens_q, int32_t num_seqs,
    int32_t num_tokens, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
    float scale, int32_t sliding_window, float softcap, const float *sinks,
    float *out)
{
    if (num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim < 1 || head_dim > MAX_HEAD_DIM || block_size < 1 || num_seqs < 0 || num_tokens < 0 ||
        kv_kind < 0 || kv_kind > 2)
        return -1;
    /* element offsets into the pools; a float32 pool is read in place, a half one widened */
    const float *k_pool = (const float *)k_pool_, *v_pool = (const float *)v_pool_;
    const uint16_t *k_half = (const uint16_t *)k_pool_, *v_half = (const uint16_t *)v_pool_;
    const int esize = kv_kind ? 2 : 4;
    const int G = num_heads / num_kv_heads;
    const int D = head_dim;
    const int QB = MAX_ROWS / G; /* query tokens per item */
    /* a decode row's item takes HG KV heads at once: a slot's rows of those heads are
     * contiguous, so the context is read as whole runs of memory, not one head's 2-8
     * cache lines out of every slot (which left decode attention latency-bound) */
    const int HG = num_kv_heads < MAX_ROWS / G ? num_kv_heads : MAX_ROWS / G;
    const int decode_groups = (num_kv_heads + HG - 1) / HG;
    /* first[s]: index of sequence s's first item */
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * ((size_t)num_seqs + 1));
    if (!first) return -2;
    first[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        first[s + 1] = first[s] + (q_len == 1 ? decode_groups : (int64_t)(q_len + QB - 1) / QB * num_kv_heads);
    }
    const int64_t items = first[num_seqs];
    const float mul = softcap > 0.0f ? scale / softcap : scale;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        int lo = 0, hi = num_seqs - 1; /* the last s with first[s] <= item (skips empty ones) */
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (first[mid] <= item) lo = mid; else hi = mid - 1;
        }
        const int s = lo;
        const int64_t local = item - first[s];
        const int q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        /* this item: query tokens [i0, i0 + nq) x KV heads [h0, h0 + nh) */
        int i0, nq, h0, nh;
        if (q_len == 1) {
            i0 = 0; nq = 1;
            h0 = (int)local * HG;
            nh = num_kv_heads - h0 < HG ? num_kv_heads - h0 : HG;
        } else {
            i0 = (int)(local / num_kv_heads) * QB;
            nq = q_len - i0 < QB ? q_len - i0 : QB;
            h0 = (int)(local % num_kv_heads);
            nh = 1;
        }
        const int RH = nq * G; /* rows per KV head: row hh * RH + r is token r / G, head (h0 + hh) * G + r % G */
        const int R = RH * nh;
        const int32_t *table = block_tables + (int64_t)s * max_blocks;

        float qs[MAX_ROWS][MAX_HEAD_DIM];
        float acc[MAX_ROWS][MAX_HEAD_DIM];
        float sc[MAX_ROWS][TILE] __attribute__((aligned(32)));
        float kt[MAX_HEAD_DIM][TILE] __attribute__((aligned(32)));
        float m[MAX_ROWS], l[MAX_ROWS];
        int rstart[MAX_ROWS], rend[MAX_ROWS];
        const float *kbase[TILE], *vbase[TILE]; /* key j's row of head h0 (nh heads follow it) */
        const float *krow[TILE];
        const float *vrow[TILE];
        /* a half-precision tile, widened: heap, only when the pool is half (TILE x nh x D x 2) */
        float *wide = kv_kind ? (float *)malloc(sizeof(float) * 2 * TILE * (size_t)nh * D) : NULL;
        for (int r = 0; r < R; r++) {
            const int hh = r / RH, rr = r % RH;
            const int i = i0 + rr / G;
            const int head = (h0 + hh) * G + rr % G;
            const int t = cu_seqlens_q[s] + i;
            const float *src = q + t * q_stride_t + (int64_t)head * q_stride_h;
            for (int d = 0; d < D; d++) qs[r][d] = src[d] * mul;
            memset(acc[r], 0, sizeof(float) * D);
            /* a sink is one more logit with no value: the softmax starts from it */
            m[r] = sinks ? sinks[head] : NEG_BIG;
            l[r] = sinks ? 1.0f : 0.0f;
            rend[r] = seq_lens[s] - q_len + i + 1; /* keys [rstart, rend) */
            rstart[r] = sliding_window > 0 && rend[r] > sliding_window ? rend[r] - sliding_window : 0;
        }
        const int kstart = rstart[0], kend = rend[RH - 1]; /* every head's rows span the same keys */
        const int transposed = RH >= 4;
        const int64_t run = (int64_t)nh * D; /* elements of a slot's rows for these heads */
        for (int j0 = kstart; j0 < kend; j0 += TILE) {
            const int n = kend - j0 < TILE ? kend - j0 : TILE;
            /* key j0 + j's slot: its block and offset walked along, not divided out per key */
            int blk = j0 / block_size, off = j0 % block_size;
            for (int j = 0; j < n; j++) {
                const int64_t slot = (int64_t)table[blk] * block_size + off;
                if (++off == block_size) { off = 0; blk++; }
                const int64_t at = (slot * num_kv_heads + h0) * D;
                if (kv_kind) {
                    widen(k_half + at, wide + (size_t)j * run, (int)run, kv_kind);
                    widen(v_half + at, wide + (size_t)(TILE + j) * run, (int)run, kv_kind);
                    kbase[j] = wide + (size_t)j * run;
                    vbase[j] = wide + (size_t)(TILE + j) * run;
                } else {
                    kbase[j] = k_pool + at;
                    vbase[j] = v_pool + at;
                }
            }
            /* Ask for the whole first tile's K/V rows up front: walked key by key the loads
             * are one cache miss deep, and that is what bounds decode attention (~15%
             * faster). Each later tile was asked for while the one before it ran (below). */
            if (!kv_kind && j0 == kstart)
                for (int j = 0; j < n; j++)
                    for (int64_t d = 0; d < run; d += 16) {
                        __builtin_prefetch(kbase[j] + d);
                        __builtin_prefetch(vbase[j] + d);
                    }
            /* Ask for the next tile's K/V rows now: walked key by key, the loads would be
             * one cache miss deep, and decode attention is bound by exactly that. (This
             * tile had n = TILE keys when there is a next one: blk, off are its first.) */
            for (int p = j0 + TILE; p < j0 + 2 * TILE && p < kend; p++) {
                const int64_t slot = (int64_t)table[blk] * block_size + off;
                if (++off == block_size) { off = 0; blk++; }
                const char *kp = (const char *)k_pool_ + (slot * num_kv_heads + h0) * D * esize;
                const char *vp = (const char *)v_pool_ + (slot * num_kv_heads + h0) * D * esize;
                for (int64_t d = 0; d < run * esize; d += 64) {
                    __builtin_prefetch(kp + d);
                    __builtin_prefetch(vp + d);
                }
            }
            for (int hh = 0; hh < nh; hh++) {
                float (*const qh)[MAX_HEAD_DIM] = qs + hh * RH, (*const ah)[MAX_HEAD_DIM] = acc + hh * RH;
                float (*const sh)[TILE] = sc + hh * RH;
                float *const mh = m + hh * RH, *const lh = l + hh * RH;
                const int *const rs = rstart + hh * RH, *const re = rend + hh * RH;
                for (int j = 0; j < n; j++) {
                    krow[j] = kbase[j] + hh * D;
                    vrow[j] = vbase[j] + hh * D;
                }
                if (transposed) {
                    for (int j = 0; j < TILE; j++)
                        for (int d = 0; d < D; d++) kt[d][j] = j < n ? krow[j][d] : 0.0f;
                    /* sh[r][0:TILE] = sum_d q[r][d] * kt[d][0:TILE], two rows at a time: eight
                     * independent vector accumulators, each key vector loaded once per pair */
                    for (int r = 0; r < RH; r += 2) {
                        const float *q0 = qh[r], *q1 = qh[r + 1 < RH ? r + 1 : r];
                        vf8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
                        for (int d = 0; d < D; d++) {
                            const vf8 *kr = (const vf8 *)kt[d];
                            const float u = q0[d], w = q1[d];
                            a0 += u * kr[0]; a1 += u * kr[1]; a2 += u * kr[2]; a3 += u * kr[3];
                            b0 += w * kr[0]; b1 += w * kr[1]; b2 += w * kr[2]; b3 += w * kr[3];
                        }
                        vf8 *x = (vf8 *)sh[r];
                        x[0] = a0; x[1] = a1; x[2] = a2; x[3] = a3;
                        if (r + 1 < RH) {
                            x = (vf8 *)sh[r + 1];
                            x[0] = b0; x[1] = b1; x[2] = b2; x[3] = b3;
                        }
                    }
                } else {
                    for (int r = 0; r < RH; r++) scores(qh[r], krow, n, D, sh[r]);
                }
                for (int r = 0; r < RH; r++) {
                    const int jlo = rs[r] > j0 ? rs[r] - j0 : 0;
                    const int jhi = re[r] - j0 < n ? re[r] - j0 : n;
                    float *x = sh[r];
                    if (jhi <= jlo) { /* no key of this tile for this row */
                        memset(x, 0, sizeof(float) * TILE);
                        continue;
                    }
                    if (softcap > 0.0f)
                        for (int j = jlo; j < jhi; j++) x[j] = tanhf(x[j]) * softcap;
                    float mt = NEG_BIG;
                    for (int j = jlo; j < jhi; j++) mt = x[j] > mt ? x[j] : mt;
                    const float m_new = mt > mh[r] ? mt : mh[r];
                    const float corr = exp_neg(mh[r] - m_new);
                    float sum = 0.0f;
                    for (int j = 0; j < TILE; j++) {
                        const float e = j >= jlo && j < jhi ? exp_neg(x[j] - m_new) : 0.0f;
                        x[j] = e;
                        sum += e;
                    }
                    lh[r] = lh[r] * corr + sum;
                    mh[r] = m_new;
                    if (corr != 1.0f)
                        for (int d = 0; d < D; d++) ah[r][d] *= corr;
                }
                if (D % 32 == 0) {
                    /* ah[r] += sum_j p[r][j] * v[j], two rows and 32 columns at a time held in
                     * registers: 8 independent FMA chains (4 were bound by the FMA latency), each
                     * V vector loaded once for both rows. An odd last row pairs with itself. */
                    for (int r = 0; r < RH; r += 2) {
                        const int r1 = r + 1 < RH ? r + 1 : r;
                        const float *p0 = sh[r], *p1 = sh[r1];
                        for (int d0 = 0; d0 < D; d0 += 32) {
                            vf8 a0, a1, a2, a3, b0, b1, b2, b3;
                            memcpy(&a0, ah[r] + d0, 32); memcpy(&a1, ah[r] + d0 + 8, 32);
                            memcpy(&a2, ah[r] + d0 + 16, 32); memcpy(&a3, ah[r] + d0 + 24, 32);
                            memcpy(&b0, ah[r1] + d0, 32); memcpy(&b1, ah[r1] + d0 + 8, 32);
                            memcpy(&b2, ah[r1] + d0 + 16, 32); memcpy(&b3, ah[r1] + d0 + 24, 32);
                            for (int j = 0; j < n; j++) {
                                const float w = p0[j], u = p1[j];
                                vf8 v0, v1, v2, v3;
                                memcpy(&v0, vrow[j] + d0, 32); memcpy(&v1, vrow[j] + d0 + 8, 32);
                                memcpy(&v2, vrow[j] + d0 + 16, 32); memcpy(&v3, vrow[j] + d0 + 24, 32);
                                a0 += w * v0; a1 += w * v1; a2 += w * v2; a3 += w * v3;
                                b0 += u * v0; b1 += u * v1; b2 += u * v2; b3 += u * v3;
                            }
                            memcpy(ah[r] + d0, &a0, 32); memcpy(ah[r] + d0 + 8, &a1, 32);
                            memcpy(ah[r] + d0 + 16, &a2, 32); memcpy(ah[r] + d0 + 24, &a3, 32);
                            if (r1 != r) {
                                memcpy(ah[r1] + d0, &b0, 32); memcpy(ah[r1] + d0 + 8, &b1, 32);
                                memcpy(ah[r1] + d0 + 16, &b2, 32); memcpy(ah[r1] + d0 + 24, &b3, 32);
                            }
                        }
                    }
                } else {
                    for (int j = 0; j < n; j++) {
                        const float *v = vrow[j];
                        for (int r = 0; r < RH; r++) {
                            const float w = sh[r][j];
                            if (w == 0.0f) continue;
                            for (int d = 0; d < D; d++) ah[r][d] += w * v[d];
                        }
                    }
                }
            } /* heads */
        }
        for (int r = 0; r < R; r++) {
            const int rr = r % RH;
            const int t = cu_seqlens_q[s] + i0 + rr / G;
            float *dst = out + ((int64_t)t * num_heads + (h0 + r / RH) * G + rr % G) * D;
            const float inv = 1.0f / l[r];
            for (int d = 0; d < D; d++) dst[d] = acc[r][d] * inv;
        }
        free(wide);
    }
    free(first);
    return 0;
}

/* silu(gate) * x over n floats: gate * x / (1 + exp(-gate)). exp_neg needs x <= 0, so
 * for gate < 0 use exp(-gate) = 1 / exp(gate); both branches are computed and blended,
 * which keeps the loop vectorised. */
void orch_swiglu_f32(const float *gate, const float *x, float *out, int64_t n)
{
#pragma omp parallel for schedule(static) if (n > 16384)
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        const float e = exp_neg(g < 0.0f ? g : -g); /* exp(-|g|) */
        const float sig = g < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
        out[i] = g * sig * x[i];
    }
}

/* The step's K/V rows into the pools, in place: row t (row_bytes of k, the same of v,
 * already in the pool's dtype) to pool slot slots[t]. MLX's scatter does this element by
 * element (1.2 ms for 512 rows of 4 x 64 floats, per pool); here it is one memcpy a row.
 * v may be NULL (a pool that holds K only). */
void orch_write_rows(const char *k, const char *v, const int32_t *slots, int64_t T, int64_t row_bytes,
                     char *k_pool, char *v_pool)
{
    for (int64_t t = 0; t < T; t++) {
        const int64_t at = (int64_t)slots[t] * row_bytes;
        memcpy(k_pool + at, k + t * row_bytes, (size_t)row_bytes);
        if (v) memcpy(v_pool + at, v + t * row_bytes, (size_t)row_bytes);
    }
}

/* The gated delta rule (Qwen3-Next / Qwen3.5 linear attention) over one step's tokens of
 * B sequences, in order, as mlx-lm's `gated_delta_ops` (its CPU path): for each sequence
 * b and value head h, the state S [Dv, Dk] at each token t
 *     S *= g            (g[b, t, h] a scalar, or with g_vec a vector over Dk)
 *     kv = S k          delta = (v - kv) * beta[b, t, h]
 *     S += delta k^T    y[b, t, h] = S q
 * with q, k of key head h / (Hv / Hk). q, k [B, T, Hk, Dk]; v, y [B, T, Hv, Dv]; g
 * [B, T, Hv] or [B, T, Hv, Dk]; beta [B, T, Hv]; state_in, state_out [B, Hv, Dv, Dk]; all
 * float32 and contiguous. One row of S (one dv) is independent of the others, so each
 * row stays in registers through the T tokens. Returns -1 when Dk is too large. */
#define GDN_MAX_DK 1024
int orch_gated_delta(const float *q, const float *k, const float *v, const float *g, const float *beta,
                     const float *state_in, float *state_out, float *y,
                     int64_t B, int64_t T, int32_t Hk, int32_t Hv, int32_t Dk, int32_t Dv, int32_t g_vec)
{
    if (Dk < 1 || Dk > GDN_MAX_DK || Dv < 1 || Hk < 1 || Hv % Hk) return -1;
    const int rf = Hv / Hk;
#pragma omp parallel for schedule(static) collapse(2) if (B * Hv * T * Dv * Dk > 65536)
    for (int64_t b = 0; b < B; b++) {
        for (int32_t h = 0; h < Hv; h++) {
            float s[GDN_MAX_DK];
            const int hk = h / rf;
            for (int32_t r = 0; r < Dv; r++) {
                const float *in = state_in + (((b * Hv) + h) * Dv + r) * Dk;
                for (int i = 0; i < Dk; i++) s[i] = in[i];
                for (int64_t t = 0; t < T; t++) {
                    const int64_t bt = b * T + t;
                    const float *kt = k + (bt * Hk + hk) * Dk, *qt = q + (bt * Hk + hk) * Dk;
                    const float bet = beta[bt * Hv + h];
                    float kv = 0.0f;
                    if (g_vec) {
                        const float *gt = g + (bt * Hv + h) * Dk;
                        for (int i = 0; i < Dk; i++) { s[i] *= gt[i]; kv += s[i] * kt[i]; }
                    } else {
                        const float gt = g[bt * Hv + h];
                        for (int i = 0; i < Dk; i++) { s[i] *= gt; kv += s[i] * kt[i]; }
                    }
                    const float delta = (v[(bt * Hv + h) * Dv + r] - kv) * bet;
                    float out = 0.0f;
                    for (int i = 0; i < Dk; i++) { s[i] += kt[i] * delta; out += s[i] * qt[i]; }
                    y[(bt * Hv + h) * Dv + r] = out;
                }
                float *o = state_out + (((b * Hv) + h) * Dv + r) * Dk;
                for (int i = 0; i < Dk; i++) o[i] = s[i];
            }
        }
    }
    return 0;
}

/* A depthwise convolution (groups = channels, stride 1, no padding, no dilation: the
 * short causal convolutions of Qwen3-Next / Qwen3.5, Mamba-2 and LFM2, whose inputs come
 * already padded with the state): x [B, L, C], w [C, K] (mlx's [C, K, 1]), bias [C] or
 * NULL; out [B, L - K + 1, C] = sum over k of x[b, t + k, c] w[c, k] (+ bias[c]), summed
 * in order of k. Runs along c, so the loops vectorise. */
int orch_depthwise_conv1d(const float *x, const float *w, const float *bias, float *out,
                          int64_t B, int64_t L, int64_t C, int32_t K)
{
    const int64_t Lo = L - K + 1;
    if (Lo <= 0 || K < 1) return -1;
    float *wt = malloc(sizeof(float) * (size_t)(K * C)); /* [K, C]: tap k of every channel, contiguous */
    if (!wt) return -2;
    for (int64_t c = 0; c < C; c++)
        for (int k = 0; k < K; k++) wt[k * C + c] = w[c * K + k];
#pragma omp parallel for schedule(static) collapse(2) if (B * Lo * C * K > 262144)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < Lo; t++) {
            float *o = out + (b * Lo + t) * C;
            const float *xi = x + (b * L + t) * C;
            for (int64_t c = 0; c < C; c++) o[c] = xi[c] * wt[c];
            for (int k = 1; k < K; k++) {
                const float *xk = xi + k * C, *wk = wt + k * C;
                for (int64_t c = 0; c < C; c++) o[c] += xk[c] * wk[c];
            }
            if (bias)
                for (int64_t c = 0; c < C; c++) o[c] += bias[c];
        }
    }
    free(wt);
    return 0;
}

/* y [M, N] = x [M, K] w [N, K]^T (+ bias [N]): an nn.Linear for the few rows of a decode
 * step, float32. BLAS packs the whole weight matrix into its own layout on every call, which
 * at a few rows costs more than the product; here each weight row is read once, in place,
 * by one of two kernels. Weight blocks are split over the threads; the weights' loads are
 * aligned when the matrix is (cpu.py allocates them so).
 *
 * - 1-3 rows (`linear_dot`): blocks of 4 weight rows x 3 x rows, 8-wide dot products
 *   summed across their lanes at the end. At so few rows the step is a read of the weights
 *   and nothing else; this kernel reads them fastest.
 * - 4 rows and more (`linear_bcast`): x is transposed into xt [K, MP] (rows padded with
 *   zeros to MP, a multiple of 8) so that one k of 8 rows is a vector; each weight element
 *   is broadcast and multiplied into S of them. A tile is S vectors x 12 / S weight rows
 *   (1 x 12, 2 x 6, 3 x 4): 12 accumulators and S + 12 / S loads for 12 FMAs (the dot
 *   kernel needs 15), no horizontal sums, and each output is one accumulator lane summed
 *   in plain k order. Past 24 rows, pairs of vectors pass each block of 6 weight rows in
 *   turn, the block in L1 after the first. While a block's rows stream in, the next
 *   block's are prefetched: the weights come from DRAM (a model is larger than the cache),
 *   and the hardware prefetcher alone left the kernel waiting on memory. 1.5-2x the dot
 *   kernel at 8-32 rows; ahead of OpenBLAS below 48 rows. */
typedef float vf8u __attribute__((vector_size(32), aligned(4)));

static inline float hsum8(vf8 v) {
    const float a = (v[0] + v[4]) + (v[1] + v[5]), b = (v[2] + v[6]) + (v[3] + v[7]);
    return a + b;
}

static inline vf8 ld8(const float *p) { return *(const vf8u *)p; }
static inline vf8 bcast8(float v) { return (vf8){v, v, v, v, v, v, v, v}; }

#define LIN_MR 3
#define LIN_NR 4

/* rows m0 .. m0 + mr of x (mr <= LIN_MR) against weight rows n0 .. n0 + nr (nr <= LIN_NR) */
static inline __attribute__((always_inline)) void linear_block(
    const float *x, int64_t K, const float *w, const float *bias, float *y,
    int64_t N, int64_t m0, int mr, int64_t n0, int nr)
{
    const int64_t K8 = K & ~(int64_t)7;
    vf8 acc[LIN_MR][LIN_NR];
    for (int i = 0; i < LIN_MR; i++)
        for (int j = 0; j < LIN_NR; j++) acc[i][j] = (vf8){0};
    const float *xr[LIN_MR], *wr[LIN_NR];
    for (int i = 0; i < LIN_MR; i++) xr[i] = x + (m0 + (i < mr ? i : 0)) * K;
    for (int j = 0; j < LIN_NR; j++) wr[j] = w + (n0 + (j < nr ? j : 0)) * K;
    if (mr == LIN_MR && nr == LIN_NR) {
        /* 12 accumulators (enough independent FMA chains to fill both pipes) + 4 weight
         * vectors = AVX2's 16 registers; x is read as the FMAs' memory operand */
        const float *x0 = xr[0], *x1 = xr[1], *x2 = xr[2];
        vf8 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0},
            a20 = {0}, a21 = {0}, a22 = {0}, a23 = {0};
        for (int64_t k = 0; k < K8; k += 8) {
            const vf8 w0 = ld8(wr[0] + k), w1 = ld8(wr[1] + k), w2 = ld8(wr[2] + k), w3 = ld8(wr[3] + k);
            vf8 xv = ld8(x0 + k);
            a00 += xv * w0; a01 += xv * w1; a02 += xv * w2; a03 += xv * w3;
            xv = ld8(x1 + k);
            a10 += xv * w0; a11 += xv * w1; a12 += xv * w2; a13 += xv * w3;
            xv = ld8(x2 + k);
            a20 += xv * w0; a21 += xv * w1; a22 += xv * w2; a23 += xv * w3;
        }
        acc[0][0] = a00; acc[0][1] = a01; acc[0][2] = a02; acc[0][3] = a03;
        acc[1][0] = a10; acc[1][1] = a11; acc[1][2] = a12; acc[1][3] = a13;
        acc[2][0] = a20; acc[2][1] = a21; acc[2][2] = a22; acc[2][3] = a23;
    } else {
        for (int64_t k = 0; k < K8; k += 8)
            for (int i = 0; i < mr; i++) {
                const vf8 xv = ld8(xr[i] + k);
                for (int j = 0; j < nr; j++) acc[i][j] += xv * ld8(wr[j] + k);
            }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = hsum8(acc[i][j]);
            for (int64_t k = K8; k < K; k++) s += xr[i][k] * wr[j][k];
            y[(m0 + i) * N + n0 + j] = bias ? s + bias[n0 + j] : s;
        }
}

static int linear_dot(const float *x_, int64_t M, int64_t K, const float *w, const float *bias, float *y, int64_t N)
{
    float *x = aligned_alloc(64, (size_t)((M * K * 4 + 63) & ~(int64_t)63)); /* x's loads aligned too */
    if (!x) return -2;
    memcpy(x, x_, (size_t)(M * K) * sizeof(float));
    const int64_t nb = (N + LIN_NR - 1) / LIN_NR;
#pragma omp parallel for schedule(static) if (M * N * K > 200000)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t n0 = b * LIN_NR;
        const int nr = N - n0 < LIN_NR ? (int)(N - n0) : LIN_NR;
        for (int64_t m0 = 0; m0 < M; m0 += LIN_MR)
            linear_block(x, K, w, bias, y, N, m0, M - m0 < LIN_MR ? (int)(M - m0) : LIN_MR, n0, nr);
    }
    free(x);
    return 0;
}

/* A broadcast tile: S vectors of xt from vector v0 (rows 8 v0 ..) x weight rows n0 .. n0 + nr
 * (nr <= 12 / S; the missing rows repeat row n0 and are not stored), accumulators a<j><v>
 * named out so that they stay in registers. pf: the next block's first row, or NULL. */
#define TILE_ARGS const float *xt, int64_t MP, int64_t K, const float *w, const float *bias, float *y, \
    int64_t M, int64_t N, int64_t n0, int nr, int64_t v0, const float *pf
#define TILE_BEGIN(NR)                                                                                \
    const float *r_[12];                                                                              \
    for (int j = 0; j < 12; j++) r_[j] = w + (n0 + (j < nr && j < (NR) ? j : 0)) * K;                 \
    const float *r0 = r_[0], *r1 = r_[1], *r2 = r_[2], *r3 = r_[3], *r4 = r_[4], *r5 = r_[5],         \
                *r6 = r_[6], *r7 = r_[7], *r8 = r_[8], *r9 = r_[9], *r10 = r_[10], *r11 = r_[11];     \
    (void)r3; (void)r4; (void)r5; (void)r6; (void)r7; (void)r8; (void)r9; (void)r10; (void)r11;       \
    const float *xp = xt + v0 * 8;                                                                    \
    float out_[12][32]
#define TILE_PREFETCH(NR) \
    if (pf && (k & 15) == 0) for (int j = 0; j < (NR); j++) __builtin_prefetch(pf + j * K + k + 16)
#define XV(v) const vf8 x##v = *(const vf8 *)(xp + k * MP + (v) * 8)
#define FMA1(j) { const vf8 b = bcast8(r##j[k]); a##j##0 += b * x0; }
#define FMA2(j) { const vf8 b = bcast8(r##j[k]); a##j##0 += b * x0; a##j##1 += b * x1; }
#define FMA3(j) { const vf8 b = bcast8(r##j[k]); a##j##0 += b * x0; a##j##1 += b * x1; a##j##2 += b * x2; }
#define OUT(j, v) memcpy(&out_[j][(v) * 8], &a##j##v, 32)

static void tile_store(float out_[][32], int S, int nr, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t n0, int64_t v0)
{
    for (int j = 0; j < nr; j++) {
        const float bj = bias ? bias[n0 + j] : 0.0f;
        for (int i = 0; i < S * 8 && v0 * 8 + i < M; i++) y[(v0 * 8 + i) * N + n0 + j] = out_[j][i] + bj;
    }
}

static void tile_1x12(TILE_ARGS)
{
    TILE_BEGIN(12);
    vf8 a00 = {0}, a10 = {0}, a20 = {0}, a30 = {0}, a40 = {0}, a50 = {0}, a60 = {0}, a70 = {0}, a80 = {0},
        a90 = {0}, a100 = {0}, a110 = {0};
    for (int64_t k = 0; k < K; k++) {
        TILE_PREFETCH(12);
        XV(0);
        FMA1(0) FMA1(1) FMA1(2) FMA1(3) FMA1(4) FMA1(5) FMA1(6) FMA1(7) FMA1(8) FMA1(9) FMA1(10) FMA1(11)
    }
    OUT(0, 0); OUT(1, 0); OUT(2, 0); OUT(3, 0); OUT(4, 0); OUT(5, 0); OUT(6, 0); OUT(7, 0); OUT(8, 0);
    OUT(9, 0); OUT(10, 0); OUT(11, 0);
    tile_store(out_, 1, nr, bias, y, M, N, n0, v0);
}

static void tile_2x6(TILE_ARGS)
{
    TILE_BEGIN(6);
    vf8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0}, a40 = {0},
        a41 = {0}, a50 = {0}, a51 = {0};
    for (int64_t k = 0; k < K; k++) {
        TILE_PREFETCH(6);
        XV(0); XV(1);
        FMA2(0) FMA2(1) FMA2(2) FMA2(3) FMA2(4) FMA2(5)
    }
    OUT(0, 0); OUT(0, 1); OUT(1, 0); OUT(1, 1); OUT(2, 0); OUT(2, 1); OUT(3, 0); OUT(3, 1); OUT(4, 0);
    OUT(4, 1); OUT(5, 0); OUT(5, 1);
    tile_store(out_, 2, nr, bias, y, M, N, n0, v0);
}

static void tile_3x4(TILE_ARGS)
{
    TILE_BEGIN(4);
    vf8 a00 = {0}, a01 = {0}, a02 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a20 = {0}, a21 = {0}, a22 = {0},
        a30 = {0}, a31 = {0}, a32 = {0};
    for (int64_t k = 0; k < K; k++) {
        TILE_PREFETCH(4);
        XV(0); XV(1); XV(2);
        FMA3(0) FMA3(1) FMA3(2) FMA3(3)
    }
    OUT(0, 0); OUT(0, 1); OUT(0, 2); OUT(1, 0); OUT(1, 1); OUT(1, 2); OUT(2, 0); OUT(2, 1); OUT(2, 2);
    OUT(3, 0); OUT(3, 1); OUT(3, 2);
    tile_store(out_, 3, nr, bias, y, M, N, n0, v0);
}

static int linear_bcast(const float *x, int64_t M, int64_t K, const float *w, const float *bias, float *y, int64_t N)
{
    /* MV vectors of 8 rows (the last one padded with zero rows); past 24 rows an even
     * number of them, for the 2 x 6 tile */
    const int64_t MV = M <= 24 ? (M + 7) / 8 : (M + 15) / 16 * 2, MP = MV * 8;
    float *xt = aligned_alloc(64, (size_t)((K * MP * 4 + 63) & ~(int64_t)63));
    if (!xt) return -2;
    for (int64_t k = 0; k < K; k++)
        for (int64_t m = 0; m < MP; m++) xt[k * MP + m] = m < M ? x[m * K + k] : 0.0f;
    /* vectors per tile: all of them up to 3 (1 x 12, 2 x 6, 3 x 4), past that pairs (2 x 6,
     * the fastest: a block's 6 weight rows stay in L1 for its later pairs) */
    const int S = MV <= 3 ? (int)MV : 2, NR = 12 / S;
    const int64_t nb = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) if (M * N * K > 200000)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t n0 = b * NR;
        const int nr = N - n0 < NR ? (int)(N - n0) : NR;
        /* the block's rows come from memory on its first tile only: that one prefetches
         * (the last of its prefetches reach 16 floats past the next block's rows, which a
         * prefetch may: it never faults) */
        const float *pf = n0 + 2 * NR <= N ? w + (n0 + NR) * K : NULL;
        for (int64_t v0 = 0; v0 < MV; v0 += S, pf = NULL) {
            if (S == 1) tile_1x12(xt, MP, K, w, bias, y, M, N, n0, nr, v0, pf);
            else if (S == 2) tile_2x6(xt, MP, K, w, bias, y, M, N, n0, nr, v0, pf);
            else tile_3x4(xt, MP, K, w, bias, y, M, N, n0, nr, v0, pf);
        }
    }
    free(xt);
    return 0;
}

int orch_linear_f32(const float *x, int64_t M, int64_t K, const float *w, const float *bias, float *y, int64_t N)
{
    if (M <= 0 || N <= 0) return 0;
    return M >= 4 ? linear_bcast(x, M, K, w, bias, y, N) : linear_dot(x, M, K, w, bias, y, N);
}

/* y[M, N] = x[M, K] @ w[N, K]^T + beta * y by a BLAS's cblas_sgemm (`sgemm`: the OpenBLAS
 * the worker loaded before MLX), called with the arguments MLX's CPU matmul passes it, on
 * slices of the output columns spread over this library's OpenMP threads. A BLAS called
 * inside a parallel region runs on its caller's thread alone, so the only wait between
 * the threads is OpenMP's barrier at the end, which sleeps: OpenBLAS's own threads spin
 * (sched_yield) while one of them waits for another, and on a CPU shared with other work
 * that spinning took the cores the step needed (beside a busy loop per core, 112-row steps
 * took 1.4-1.7 s through MLX, 0.6-0.8 s here, 0.23 s on a quiet machine). The BLAS picks its kernels by the slice's size, so an
 * output element may differ from the unsplit product's in its last bits (float32 rounding:
 * tests/test_host_forward.py holds both to a dot product's rounding bound). */
typedef void (*orch_sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                              float *, int);

void orch_sgemm_nt(void *sgemm, const float *x, int64_t M, int64_t K, const float *w, int64_t N, float beta,
                   float *y)
{
    const orch_sgemm_fn f = (orch_sgemm_fn)sgemm;
    int parts = 1; /* one slice per OpenMP thread */
#ifdef _OPENMP
    parts = omp_get_max_threads();
#endif
#pragma omp parallel for schedule(static, 1) num_threads(parts) if (parts > 1)
    for (int p = 0; p < parts; p++) {
        /* slice bounds on 16-column boundaries (whole vector tiles for the BLAS kernels) */
        const int64_t n0 = (N * p / parts) & ~(int64_t)15, n1 = p == parts - 1 ? N : (N * (p + 1) / parts) & ~(int64_t)15;
        if (n1 > n0)
            f(101, 111, 112, (int)M, (int)(n1 - n0), (int)K, 1.0f, x, (int)K, w + n0 * K, (int)K, beta, y + n0, (int)N);
    }
}

/* RMSNorm of `rows` rows of `dim` floats, as MLX's `fast.rms_norm`: out = w * (x * r), r =
 * 1 / sqrt(mean(x^2) + eps). With `residual` (non-NULL), first h += residual in place and
 * normalise the sum: a decoder block's residual add and the next norm in one pass. */
void orch_add_rmsnorm_f32(float *h, const float *residual, const float *w, float *out, int64_t rows, int64_t dim,
                          float eps)
{
    for (int64_t t = 0; t < rows; t++) {
        float *x = h + t * dim;
        if (residual) {
            const float *r = residual + t * dim;
            for (int64_t i = 0; i < dim; i++) x[i] += r[i];
        }
        float ss = 0.0f;
        for (int64_t i = 0; i < dim; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *o = out + t * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (x[i] * inv);
    }
}

/* RoPE for a step's rows, as mlx's `fast.rope` with a position per row: x, out [T, H, D]
 * float32; row t at position pos[t] * scale; the first `dims` features of each head rotate
 * by angle position x inv_freq[i] (dims / 2 frequencies), as halves (i, i + dims / 2) or,
 * `traditional`, as pairs (2i, 2i + 1); the rest are copied. cos and sin are computed once
 * a row, for all its heads. */
int orch_rope_f32(const float *x, const int32_t *pos, const float *inv_freq, float *out,
                  int64_t T, int64_t H, int32_t D, int32_t dims, int32_t traditional, float scale)
{
    if (dims < 0 || dims > D || D > MAX_HEAD_DIM) return -1;
    const int half = dims / 2;
#pragma omp parallel for schedule(static) if (T * H * D > 262144)
    for (int64_t t = 0; t < T; t++) {
        float c[MAX_HEAD_DIM / 2], s[MAX_HEAD_DIM / 2];
        const float p = (float)pos[t] * scale;
        for (int i = 0; i < half; i++) {
            const float a = p * inv_freq[i];
            c[i] = cosf(a);
            s[i] = sinf(a);
        }
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + (t * H + h) * D;
            float *o = out + (t * H + h) * D;
            if (traditional)
                for (int i = 0; i < half; i++) {
                    const float x1 = xr[2 * i], x2 = xr[2 * i + 1];
                    o[2 * i] = x1 * c[i] - x2 * s[i];
                    o[2 * i + 1] = x1 * s[i] + x2 * c[i];
                }
            else
                for (int i = 0; i < half; i++) {
                    const float x1 = xr[i], x2 = xr[i + half];
                    o[i] = x1 * c[i] - x2 * s[i];
                    o[i + half] = x1 * s[i] + x2 * c[i];
                }
            for (int i = 2 * half; i < D; i++) o[i] = xr[i];
        }
    }
    return 0;
}
