/* Fused float32 CPU kernels for the network's small per-token ops (fused.py decides when they run;
 * their torch references are the network's own code). One call replaces several ATen ops, which on a
 * batch-1 decode step cost more in dispatch than in arithmetic.
 *
 * Rows are contiguous; dim / inter / head_dim are multiples of 8 (the caller checks). The loops
 * take 16 floats at a time on AVX-512 (one zmm; 8 elsewhere) and end with an 8-float step where a
 * row is an odd number of 8s. Big batches (at least PARALLEL_FLOATS values) are split by rows over
 * the OpenMP threads — torch's pool and thread count (the same libgomp; torch.set_num_threads sets
 * it) — small ones stay on the calling thread, where a fork/join would cost more than the loop.
 * No -ffast-math, no contraction: IEEE float32 operations in the order written.
 */
#include <math.h>

#include "native_vec.h"

#define PARALLEL_FLOATS 32768

#if defined(__AVX512F__)
#define WIDE 16
typedef v16f vw;
#define vw_load v16_load
#define vw_store v16_store
#define vw_splat v16_splat
#define vw_exp v16_exp
#define vw_sum v16_sum
#else
#define WIDE 8
typedef v8f vw;
#define vw_load v8_load
#define vw_store v8_store
#define vw_splat v8_splat
#define vw_exp v8_exp
#define vw_sum v8_sum
#endif

/* One row of rms_norm: o = (src * rsqrt(mean(src^2) + eps)) * w; residual: res += x first, src = res. */
static void rms_norm_row(const float *x, float *res, const float *weight, float *o, int64_t dim, float eps) {
    const float *src = x;
    if (res) {
        int64_t i = 0;
        for (; i + WIDE <= dim; i += WIDE) vw_store(res + i, vw_load(res + i) + vw_load(x + i));
        for (; i < dim; i += 8) v8_store(res + i, v8_load(res + i) + v8_load(x + i));
        src = res;
    }
    vw acc = vw_splat(0.0f);
    v8f tail = v8_splat(0.0f);
    int64_t i = 0;
    for (; i + WIDE <= dim; i += WIDE) {
        const vw v = vw_load(src + i);
        acc += v * v;
    }
    for (; i < dim; i += 8) {
        const v8f v = v8_load(src + i);
        tail += v * v;
    }
    const float inv = 1.0f / sqrtf((vw_sum(acc) + v8_sum(tail)) / (float)dim + eps);
    const vw inv_w = vw_splat(inv);
    i = 0;
    for (; i + WIDE <= dim; i += WIDE) vw_store(o + i, (vw_load(src + i) * inv_w) * vw_load(weight + i));
    for (; i < dim; i += 8) v8_store(o + i, (v8_load(src + i) * v8_splat(inv)) * v8_load(weight + i));
}

/* out = rms_norm(x [+ residual]) * weight, HF's order: (x * rsqrt(mean(x^2) + eps)) * w.
 * With a residual: residual += x first (in place) and the sum is normalised — vLLM's
 * fused_add_rms_norm, which lets a decoder layer keep its residual stream in one buffer. */
void trtforge_rms_norm(const float *x, float *residual, const float *weight, float *out,
                       int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * dim >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row(x + r * dim, residual ? residual + r * dim : NULL, weight, out + r * dim, dim, eps);
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i],  silu(g) = g / (1 + exp(-g)). */
void trtforge_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * inter >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + WIDE <= inter; i += WIDE) {
            const vw g = vw_load(gate + i);
            vw_store(o + i, g / (1.0f + vw_exp(-g)) * vw_load(up + i));
        }
        for (; i < inter; i += 8) {
            const v8f g = v8_load(gate + i);
            v8_store(o + i, g / (1.0f + v8_exp(-g)) * v8_load(up + i));
        }
    }
}

/* Rotate, in place, the first `heads` heads of every token's row in x (token t's heads start at
 * x + t * token_stride), half-split convention: with a = x[i], b = x[i + D/2],
 *   x[i] = a cos[i] - b sin[i],   x[i + D/2] = b cos[i + D/2] + a sin[i + D/2];
 * cos/sin are [tokens, D] (both halves stored, attention scaling included). */
void trtforge_rope(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads,
                   int64_t token_stride, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens > 1 && tokens * heads * head_dim >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *lo = x + t * token_stride + h * head_dim, *hi = lo + half;
            int64_t i = 0;
            for (; i + WIDE <= half; i += WIDE) {
                const vw a = vw_load(lo + i), b = vw_load(hi + i);
                vw_store(lo + i, a * vw_load(c + i) - b * vw_load(s + i));
                vw_store(hi + i, b * vw_load(c + half + i) + a * vw_load(s + half + i));
            }
            for (; i + 8 <= half; i += 8) {
                const v8f a = v8_load(lo + i), b = v8_load(hi + i);
                v8_store(lo + i, a * v8_load(c + i) - b * v8_load(s + i));
                v8_store(hi + i, b * v8_load(c + half + i) + a * v8_load(s + half + i));
            }
            for (; i < half; i++) {
                const float a = lo[i], b = hi[i];
                lo[i] = a * c[i] - b * s[i];
                hi[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}
