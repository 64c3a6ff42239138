/* CPU kernels for the engine's two hot spots that MLX's CPU backend runs slowly:
 * varlen paged attention (the Metal kernel's algorithm in C) and SwiGLU (MLX's CPU exp
 * is scalar libm).
 *
 * Built on first use by `cluster/worker/kernels/cpu.py` with the system C compiler and
 * loaded through ctypes; the engine calls it once per layer per step. One work item is
 * one query token x one KV head: the G query heads sharing that KV head walk the token's
 * context through the block table together (each K/V row is loaded once for G heads),
 * with an online softmax in float32 over tiles of TILE keys. Items are spread over
 * threads with OpenMP when the compiler has it.
 *
 * Layouts (float32): q [T, H, D] with unit stride in D; k_pool / v_pool [slots, KVH, D]
 * contiguous, slot = block_id * block_size + offset; out [T, H, D] contiguous.
 * A query at chunk position i of a chunk of q_len in a context of L tokens attends keys
 * 0 .. L - q_len + i, and with sliding_window W > 0 only the last W of them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 32
#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
#define NEG_BIG (-1.0e30f)

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

static inline float dot(const float *a, const float *b, int d) {
    float s = 0.0f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

int orch_paged_attention_f32(
    const float *q, int64_t q_stride_t, int64_t q_stride_h,
    const float *k_pool, const float *v_pool,
    const int32_t *block_tables, int32_t max_blocks,
    const int32_t *seq_lens, const int32_t *cu_seqlens_q, int32_t num_seqs,
    const int32_t *row_seq, int32_t num_tokens,
    int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
    float scale, int32_t sliding_window, float softcap,
    float *out)
{
    if (num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim < 1 || head_dim > MAX_HEAD_DIM || block_size < 1)
        return -1;
    const int G = num_heads / num_kv_heads;
    const int D = head_dim;
    const int64_t items = (int64_t)num_tokens * num_kv_heads;

#pragma omp parallel for schedule(dynamic, 2)
    for (int64_t item = 0; item < items; item++) {
        const int t = (int)(item / num_kv_heads);
        const int h = (int)(item % num_kv_heads);
        const int s = row_seq[t];
        const int q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        const int end = seq_lens[s] - q_len + (t - cu_seqlens_q[s]) + 1; /* keys [start, end) */
        int start = 0;
        if (sliding_window > 0 && end > sliding_window) start = end - sliding_window;
        const int32_t *table = block_tables + (int64_t)s * max_blocks;

        float qs[MAX_GROUP][MAX_HEAD_DIM];
        float acc[MAX_GROUP][MAX_HEAD_DIM];
        float sc[MAX_GROUP][TILE];
        float m[MAX_GROUP], l[MAX_GROUP];
        const float *krow[TILE];
        const float *vrow[TILE];
        for (int g = 0; g < G; g++) {
            const float *src = q + t * q_stride_t + (int64_t)(h * G + g) * q_stride_h;
            const float mul = softcap > 0.0f ? scale / softcap : scale;
            for (int d = 0; d < D; d++) qs[g][d] = src[d] * mul;
            memset(acc[g], 0, sizeof(float) * D);
            m[g] = NEG_BIG;
            l[g] = 0.0f;
        }
        for (int j0 = start; j0 < end; j0 += TILE) {
            const int n = end - j0 < TILE ? end - j0 : TILE;
            for (int j = 0; j < n; j++) {
                const int p = j0 + j;
                const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                krow[j] = k_pool + (slot * num_kv_heads + h) * D;
                vrow[j] = v_pool + (slot * num_kv_heads + h) * D;
            }
            for (int g = 0; g < G; g++) {
                float mt = NEG_BIG;
                for (int j = 0; j < n; j++) {
                    float x = dot(qs[g], krow[j], D);
                    if (softcap > 0.0f) x = tanhf(x) * softcap;
                    sc[g][j] = x;
                    mt = x > mt ? x : mt;
                }
                const float m_new = mt > m[g] ? mt : m[g];
                const float corr = exp_neg(m[g] - m_new);
                float sum = 0.0f;
                for (int j = 0; j < n; j++) {
                    const float e = exp_neg(sc[g][j] - m_new);
                    sc[g][j] = e;
                    sum += e;
                }
                l[g] = l[g] * corr + sum;
                m[g] = m_new;
                if (corr != 1.0f)
                    for (int d = 0; d < D; d++) acc[g][d] *= corr;
            }
            for (int j = 0; j < n; j++) {
                const float *v = vrow[j];
                for (int g = 0; g < G; g++) {
                    const float w = sc[g][j];
                    for (int d = 0; d < D; d++) acc[g][d] += w * v[d];
                }
            }
        }
        for (int g = 0; g < G; g++) {
            float *dst = out + ((int64_t)t * num_heads + h * G + g) * D;
            const float inv = 1.0f / l[g];
            for (int d = 0; d < D; d++) dst[d] = acc[g][d] * inv;
        }
    }
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
