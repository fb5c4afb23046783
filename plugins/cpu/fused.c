/* Fused float32 CPU kernels for the network's small per-token ops (fused.py decides when they run;
 * their torch references are the network's own code). One call replaces several ATen ops, which on a
 * batch-1 decode step cost more in dispatch than in arithmetic.
 *
 * Rows are contiguous; dim / inter / head_dim are multiples of 8 (the caller checks).
 */
#include <math.h>

#include "native_vec.h"

/* out = rms_norm(x [+ residual]) * weight, HF's order: (x * rsqrt(mean(x^2) + eps)) * w.
 * With a residual: residual += x first (in place) and the sum is normalised — vLLM's
 * fused_add_rms_norm, which lets a decoder layer keep its residual stream in one buffer. */
void trtforge_rms_norm(const float *x, float *residual, const float *weight, float *out,
                       int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * dim;
        float *o = out + r * dim;
        if (residual) {
            float *res = residual + r * dim;
            for (int64_t i = 0; i < dim; i += 8) v8_store(res + i, v8_load(res + i) + v8_load(src + i));
            src = res;
        }
        v8f acc = v8_splat(0.0f);
        for (int64_t i = 0; i < dim; i += 8) {
            const v8f v = v8_load(src + i);
            acc += v * v;
        }
        const v8f inv = v8_splat(1.0f / sqrtf(v8_sum(acc) / (float)dim + eps));
        for (int64_t i = 0; i < dim; i += 8) v8_store(o + i, (v8_load(src + i) * inv) * v8_load(weight + i));
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i],  silu(g) = g / (1 + exp(-g)). */
void trtforge_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i += 8) {
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
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *lo = x + t * token_stride + h * head_dim, *hi = lo + half;
            int64_t i = 0;
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
