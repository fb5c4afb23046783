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

/* ---- Mixture-of-Experts decode (serving/worker/cpu_decode_plan.py runs an MoE layer with these) -------------
 * Their torch reference is models/moe.py (`route`, `SparseMoE._grouped`, `_add_shared`), step for step:
 *   route:   softmax of the router logits, the k most probable experts (ties: the lower id), renormalised over
 *            the k where `normalize`; the (token, slot) pairs counted per expert and numbered in expert order
 *            (stable: token order within an expert), so each expert's tokens are one contiguous run
 *   gather:  the tokens' rows in that order, one run per expert, for the experts' GEMMs
 *   combine: each token's k expert outputs weighted and summed in its top-k order, + sigmoid(gate) * shared */

/* Per-head RMSNorm in place (Qwen3's q/k norms): the head_dim floats of head h < heads of token t, at
 * x + t * token_stride + h * head_dim, normalised with `weight` [head_dim] as trtforge_rms_norm does a row. */
void trtforge_head_rms_norm(float *x, const float *weight, int64_t tokens, int64_t heads, int64_t token_stride,
                            int64_t head_dim, float eps) {
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            float *row = x + t * token_stride + h * head_dim;
            rms_norm_row(row, NULL, weight, row, head_dim, eps);
        }
}

/* logits [tokens, experts] -> weights [tokens, k] (float32), ids [tokens, k] (expert of each pair, top-k order),
 * counts [experts] (pairs per expert), position [tokens * k] (pair p's place in expert order), sorted_token
 * [tokens * k] (the token of the pair at each place). A NaN logit is never chosen over a number. */
void trtforge_moe_route(const float *logits, int64_t tokens, int64_t experts, int64_t k, int64_t normalize,
                        float *weights, int64_t *ids, int64_t *counts, int64_t *position, int64_t *sorted_token) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *l = logits + t * experts;
        float m = l[0];
        for (int64_t e = 1; e < experts; e++) m = l[e] > m ? l[e] : m;
        float sum = 0.0f;
        for (int64_t e = 0; e < experts; e++) sum += expf(l[e] - m);
        int64_t *chosen = ids + t * k;
        float *w = weights + t * k, total = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < experts; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= chosen[i] == e;
                if (!taken && (best < 0 || l[e] > l[best] || (l[best] != l[best] && l[e] == l[e]))) best = e;
            }
            chosen[j] = best;
            w[j] = expf(l[best] - m) / sum;
            total += w[j];
        }
        if (normalize)
            for (int64_t j = 0; j < k; j++) w[j] = w[j] / total;
    }
    /* counting sort of the pairs by expert: counts -> starts -> (numbering) ends -> counts again */
    const int64_t pairs = tokens * k;
    for (int64_t e = 0; e < experts; e++) counts[e] = 0;
    for (int64_t p = 0; p < pairs; p++) counts[ids[p]]++;
    int64_t start = 0;
    for (int64_t e = 0; e < experts; e++) {
        const int64_t n = counts[e];
        counts[e] = start;
        start += n;
    }
    for (int64_t p = 0; p < pairs; p++) {
        position[p] = counts[ids[p]]++;
        sorted_token[position[p]] = p / k;
    }
    for (int64_t e = experts - 1; e > 0; e--) counts[e] -= counts[e - 1];
}

/* out[i] = x[rows[i]] for i < n (rows of dim floats). */
void trtforge_gather_rows(const float *x, const int64_t *rows, int64_t n, int64_t dim, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *src = x + rows[i] * dim;
        float *dst = out + i * dim;
        for (int64_t c = 0; c < dim; c++) dst[c] = src[c];
    }
}

/* out[t] = sum over j < k, in order, of weights[t, j] * ys[position[t * k + j]]  (rows of dim floats; ys in
 * expert order), then, with a shared expert (shared [tokens, dim] and its gate's logit shared_gate [tokens]),
 * out[t] += sigmoid(shared_gate[t]) * shared[t] — models/moe.py's order of operations. */
void trtforge_moe_combine(const float *ys, const int64_t *position, const float *weights, int64_t tokens, int64_t k,
                          int64_t dim, const float *shared, const float *shared_gate, float *out) {
#pragma omp parallel for schedule(static) if (tokens > 1 && tokens * k * dim >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < tokens; t++) {
        float *o = out + t * dim;
        const float s = shared ? 1.0f / (1.0f + expf(-shared_gate[t])) : 0.0f;
        int64_t i = 0;
        for (; i + WIDE <= dim; i += WIDE) {
            vw acc = vw_splat(weights[t * k]) * vw_load(ys + position[t * k] * dim + i);
            for (int64_t j = 1; j < k; j++)
                acc = acc + vw_splat(weights[t * k + j]) * vw_load(ys + position[t * k + j] * dim + i);
            if (shared) acc = acc + vw_splat(s) * vw_load(shared + t * dim + i);
            vw_store(o + i, acc);
        }
        for (; i < dim; i += 8) {
            v8f acc = v8_splat(weights[t * k]) * v8_load(ys + position[t * k] * dim + i);
            for (int64_t j = 1; j < k; j++)
                acc = acc + v8_splat(weights[t * k + j]) * v8_load(ys + position[t * k + j] * dim + i);
            if (shared) acc = acc + v8_splat(s) * v8_load(shared + t * dim + i);
            v8_store(o + i, acc);
        }
    }
}
