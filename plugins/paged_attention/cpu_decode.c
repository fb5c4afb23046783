/* Paged-KV decode attention for float32 on CPU: the KV write and the attention of sequences that
 * each add one token, in one call (cpu_native.py says when it is used; reference.py holds the
 * contract it must match).
 *
 * Per sequence b and KV head h, the G = Hq / Hkv query heads that share h are done together, so
 * each cached K and V row is read once (GQA):
 *   1. store the new k/v rows at slot_mapping[b] (pool layout [2, num_blocks, bs, Hkv, D]);
 *   2. s[g, j] = scale * q_g . K_j for every position j < L, walking the block table;
 *   3. p[g, j] = exp(s[g, j] - max_j s[g, j]);  out_g = sum_j p[g, j] V_j / sum_j p[g, j].
 * softcap > 0 (Gemma 2's attention soft-capping) replaces each score of step 2 by
 * softcap * tanh(s / softcap) before step 3; 0 leaves the scores as they are.
 * Two passes over the context (scores, then values); scores live in a per-thread scratch buffer.
 * q, k, v may be views into a fused qkv activation: token b's heads start at b * {q,k,v}_stride
 * and are contiguous within the token.
 * head_dim must be a multiple of 8 (the caller checks).
 *
 * int8 KV (`trtforge_decode_attention_int8`): the pool holds int8 values and a second pool
 * float32 scales [2, num_blocks, bs, Hkv], one per token and head. The new k/v rows are quantised
 * as reference.quantize_kv does (scale = max|x| / 127, q = round-half-even(x / scale), the same
 * IEEE operations, so the stored bytes are identical); cached rows are dequantised in registers:
 * s[g, j] = scale * scale_k[j] * (q_g . Kq_j), out_g = sum_j (p[g, j] scale_v[j]) Vq_j.
 *
 * Returns 0, or -1 when a block id, slot or length is out of range: everything is checked before
 * anything is written, and nothing is read or written out of bounds (the caller raises).
 */
#include <math.h>
#include <stdlib.h>

#include "native_vec.h"

#ifdef __AVX2__
#include <immintrin.h>
/* Eight int8 values as floats: one vpmovsxbd + vcvtdq2ps (GCC lowers the generic conversion
 * below to scalar inserts). */
static inline v8f load_i8(const int8_t *p) {
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
typedef int8_t v8c __attribute__((vector_size(8)));
static inline v8f load_i8(const int8_t *p) {
    v8c c;
    memcpy(&c, p, sizeof c);
    return __builtin_convertvector(__builtin_convertvector(c, v8i), v8f);
}
#endif

static _Thread_local float *scratch;
static _Thread_local size_t scratch_len;

static float *scores_buffer(size_t n) {
    if (n > scratch_len) {
        free(scratch);
        scratch = malloc(n * sizeof(float));
        scratch_len = scratch ? n : 0;
    }
    return scratch;
}

/* The kernels below are written once for both pool types and specialised by the compiler: each
 * is always inlined into a float32 and an int8 caller with I8 a constant, so the float path keeps
 * its plain loads and a per-key scale of exactly 1 folds away. `ks` (int8 only) points at the
 * first key's (or value's) scale; stride ks_stride per slot. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE v8f load_row(const void *p, int64_t off, int I8) {
    return I8 ? load_i8((const int8_t *)p + off) : v8_load((const float *)p + off);
}

ALWAYS_INLINE float key_scale(const float *ks, int64_t ks_stride, int64_t i, int I8) {
    return I8 ? ks[i * ks_stride] : 1.0f;
}

/* s[g * s_stride + i] = scale * ks_i * q_g . k_i for the `group` query heads q_g and the n keys
 * k_i = k + i * row of one block, four keys at a time: each q chunk is loaded once per four
 * keys, and the four sums are independent dependency chains. */
ALWAYS_INLINE void block_scores(const float *q, const void *k, const float *ks, int64_t ks_stride, int64_t n,
                                int64_t row, int64_t group, int64_t head_dim, float scale, float *s,
                                int64_t s_stride, int I8) {
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * head_dim;
        float *sg = s + g * s_stride;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
            v8f a0 = v8_splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < head_dim; d += 8) {
                const v8f qd = v8_load(qg + d);
                a0 += qd * load_row(k, i * row + d, I8);
                a1 += qd * load_row(k, (i + 1) * row + d, I8);
                a2 += qd * load_row(k, (i + 2) * row + d, I8);
                a3 += qd * load_row(k, (i + 3) * row + d, I8);
            }
            sg[i] = v8_sum(a0) * (scale * key_scale(ks, ks_stride, i, I8));
            sg[i + 1] = v8_sum(a1) * (scale * key_scale(ks, ks_stride, i + 1, I8));
            sg[i + 2] = v8_sum(a2) * (scale * key_scale(ks, ks_stride, i + 2, I8));
            sg[i + 3] = v8_sum(a3) * (scale * key_scale(ks, ks_stride, i + 3, I8));
        }
        for (; i < n; i++) {
            v8f acc = v8_splat(0.0f);
            for (int64_t d = 0; d < head_dim; d += 8) acc += v8_load(qg + d) * load_row(k, i * row + d, I8);
            sg[i] = v8_sum(acc) * (scale * key_scale(ks, ks_stride, i, I8));
        }
    }
}

/* out_g += sum_i (p[g * p_stride + i] vs_i) v_i for the n values v_i = v + i * row of one block,
 * four values per pass over out_g. */
ALWAYS_INLINE void block_values(const float *p, const void *v, const float *vs, int64_t vs_stride, int64_t n,
                                int64_t row, int64_t group, int64_t head_dim, int64_t p_stride, float *out,
                                int I8) {
    for (int64_t g = 0; g < group; g++) {
        const float *pg = p + g * p_stride;
        float *og = out + g * head_dim;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
            const v8f p0 = v8_splat(pg[i] * key_scale(vs, vs_stride, i, I8)),
                      p1 = v8_splat(pg[i + 1] * key_scale(vs, vs_stride, i + 1, I8)),
                      p2 = v8_splat(pg[i + 2] * key_scale(vs, vs_stride, i + 2, I8)),
                      p3 = v8_splat(pg[i + 3] * key_scale(vs, vs_stride, i + 3, I8));
            for (int64_t d = 0; d < head_dim; d += 8)
                v8_store(og + d, v8_load(og + d) + ((p0 * load_row(v, i * row + d, I8) +
                                                     p1 * load_row(v, (i + 1) * row + d, I8)) +
                                                    (p2 * load_row(v, (i + 2) * row + d, I8) +
                                                     p3 * load_row(v, (i + 3) * row + d, I8))));
        }
        for (; i < n; i++) {
            const v8f pi = v8_splat(pg[i] * key_scale(vs, vs_stride, i, I8));
            for (int64_t d = 0; d < head_dim; d += 8)
                v8_store(og + d, v8_load(og + d) + pi * load_row(v, i * row + d, I8));
        }
    }
}

/* Softmax of s[0..n) in place. */
static void softmax(float *s, int64_t n) {
    float m = s[0], total = 0.0f;
    for (int64_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
    int64_t j = 0;
    v8f sums = v8_splat(0.0f);
    for (; j + 8 <= n; j += 8) {
        v8f e = v8_exp(v8_load(s + j) - m);
        v8_store(s + j, e);
        sums += e;
    }
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        total += s[j];
    }
    const float inv = 1.0f / (v8_sum(sums) + total);
    for (j = 0; j < n; j++) s[j] *= inv;
}

/* Position j of the context lives at slot table[j / block_size] * block_size + j % block_size;
 * the loops walk block by block (no division per position: a 64-bit divide costs ~40 cycles).
 * key_pool/value_pool point at this head's first value; int8: key_scales/value_scales at this
 * head's first scale (num_kv_heads per slot). */
ALWAYS_INLINE void attend(const float *q, const void *key_pool, const void *value_pool, const float *key_scales,
                          const float *value_scales, const int32_t *table, int64_t len, int64_t block_size,
                          int64_t row, int64_t num_kv_heads, int64_t group, int64_t head_dim, float scale,
                          float softcap, float *s, float *out, int I8) {
    const int64_t elem = I8 ? (int64_t)sizeof(int8_t) : (int64_t)sizeof(float);
    for (int64_t start = 0, b = 0; start < len; start += block_size, b++) {
        const int64_t n = len - start < block_size ? len - start : block_size, first = (int64_t)table[b] * block_size;
        block_scores(q, (const char *)key_pool + first * row * elem, I8 ? key_scales + first * num_kv_heads : NULL,
                     num_kv_heads, n, row, group, head_dim, scale, s + start, len, I8);
    }
    if (softcap > 0.0f) {
        const float inv_cap = 1.0f / softcap;
        for (int64_t j = 0; j < group * len; j++) s[j] = softcap * tanhf(s[j] * inv_cap);
    }
    for (int64_t g = 0; g < group; g++) softmax(s + g * len, len);
    memset(out, 0, group * head_dim * sizeof(float));
    for (int64_t start = 0, b = 0; start < len; start += block_size, b++) {
        const int64_t n = len - start < block_size ? len - start : block_size, first = (int64_t)table[b] * block_size;
        block_values(s + start, (const char *)value_pool + first * row * elem,
                     I8 ? value_scales + first * num_kv_heads : NULL, num_kv_heads, n, row, group, head_dim,
                     len, out, I8);
    }
}

/* Every sequence's attention, KV head by KV head (its G query heads together); -1 if no scratch. */
ALWAYS_INLINE int attend_all(const float *q, int64_t q_stride, const void *key_pool, const void *value_pool,
                             const float *key_scales, const float *value_scales, const int32_t *block_tables,
                             int64_t table_width, const int32_t *seq_lens, float *out, int64_t num_seqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, float softcap, int I8, int64_t threads) {
    const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * head_dim;
    const int64_t elem = I8 ? (int64_t)sizeof(int8_t) : (int64_t)sizeof(float);
    int failed = 0;
    /* (sequence, KV head) pairs over the OpenMP threads (torch's pool: same libgomp); dynamic, as
     * context lengths differ. Each thread has its own score buffer (thread-local). */
    const int64_t work = num_seqs * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(|| : failed)
    for (int64_t bh = 0; bh < work; bh++) {
        const int64_t b = bh / num_kv_heads, h = bh % num_kv_heads, len = seq_lens[b];
        float *s = scores_buffer((size_t)(group * len));
        if (!s) { failed = 1; continue; }
        attend(q + b * q_stride + h * group * head_dim, (const char *)key_pool + h * head_dim * elem,
               (const char *)value_pool + h * head_dim * elem, I8 ? key_scales + h : NULL,
               I8 ? value_scales + h : NULL, block_tables + b * table_width, len, block_size, row,
               num_kv_heads, group, head_dim, scale, softcap, s, out + (b * num_heads + h * group) * head_dim, I8);
    }
    return failed ? -1 : 0;
}

static int inputs_ok(int64_t num_blocks, int64_t block_size, const int64_t *slot_mapping,
                     const int32_t *block_tables, int64_t table_width, const int32_t *seq_lens,
                     int64_t num_seqs) {
    const int64_t num_slots = num_blocks * block_size;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t len = seq_lens[b], slot = slot_mapping[b];
        if (len < 1 || len > table_width * block_size || slot < 0 || slot >= num_slots) return 0;
        const int32_t *table = block_tables + b * table_width;
        for (int64_t i = 0; i < (len + block_size - 1) / block_size; i++)
            if (table[i] < 0 || table[i] >= num_blocks) return 0;
    }
    return 1;
}

int trtforge_decode_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                              const float *v, int64_t v_stride, float *pool,
                              int64_t num_blocks, int64_t block_size, const int64_t *slot_mapping,
                              const int32_t *block_tables, int64_t table_width,
                              const int32_t *seq_lens, float *out, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              float scale, float softcap, int64_t threads) {
    const int64_t row = num_kv_heads * head_dim; /* floats per slot */
    const int64_t num_slots = num_blocks * block_size;
    float *key_pool = pool, *value_pool = pool + num_slots * row;
    if (!inputs_ok(num_blocks, block_size, slot_mapping, block_tables, table_width, seq_lens, num_seqs))
        return -1;
    for (int64_t b = 0; b < num_seqs; b++) {
        memcpy(key_pool + slot_mapping[b] * row, k + b * k_stride, row * sizeof(float));
        memcpy(value_pool + slot_mapping[b] * row, v + b * v_stride, row * sizeof(float));
    }
    return attend_all(q, q_stride, key_pool, value_pool, NULL, NULL, block_tables, table_width, seq_lens,
                      out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, softcap, 0, threads);
}

/* ---- int8 KV --------------------------------------------------------------------------------- */

/* One head's D values quantised into q (reference.quantize_kv); returns the scale. */
static float quantize_row(const float *x, int64_t head_dim, int8_t *q) {
    float m = 0.0f;
    for (int64_t d = 0; d < head_dim; d++) {
        const float a = fabsf(x[d]);
        m = a > m ? a : m;
    }
    const float scale = m / 127.0f, divisor = scale > 0.0f ? scale : 1.0f;
    for (int64_t d = 0; d < head_dim; d++) {
        float r = nearbyintf(x[d] / divisor);
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        q[d] = (int8_t)r;
    }
    return scale;
}

int trtforge_decode_attention_int8(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                                   const float *v, int64_t v_stride, int8_t *pool, float *scales,
                                   int64_t num_blocks, int64_t block_size, const int64_t *slot_mapping,
                                   const int32_t *block_tables, int64_t table_width,
                                   const int32_t *seq_lens, float *out, int64_t num_seqs,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   float scale, float softcap, int64_t threads) {
    const int64_t row = num_kv_heads * head_dim; /* int8 values per slot */
    const int64_t num_slots = num_blocks * block_size;
    int8_t *key_pool = pool, *value_pool = pool + num_slots * row;
    float *key_scales = scales, *value_scales = scales + num_slots * num_kv_heads;
    if (!inputs_ok(num_blocks, block_size, slot_mapping, block_tables, table_width, seq_lens, num_seqs))
        return -1;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t slot = slot_mapping[b];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            key_scales[slot * num_kv_heads + h] =
                quantize_row(k + b * k_stride + h * head_dim, head_dim, key_pool + slot * row + h * head_dim);
            value_scales[slot * num_kv_heads + h] =
                quantize_row(v + b * v_stride + h * head_dim, head_dim, value_pool + slot * row + h * head_dim);
        }
    }
    return attend_all(q, q_stride, key_pool, value_pool, key_scales, value_scales, block_tables, table_width,
                      seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, softcap, 1,
                      threads);
}
