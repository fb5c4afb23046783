/* Paged-KV decode attention for float32 on CPU: the KV write and the attention of sequences that
 * each add one token, in one call (cpu_native.py says when it is used; reference.py holds the
 * contract it must match).
 *
 * Work is split into (sequence, KV head) pairs, longest context first, handed to the OpenMP
 * threads one at a time (so a long sequence starts early and short ones fill in behind it); with at
 * least 4 sequences per thread, a sequence's pairs go to one thread together, one after the other
 * (its slots' pages are then read by one core while they are hot: 1.13-1.26x at 16-64 sequences of
 * 256 positions, scripts/bench_attention_cpu.py on a 2-core Xeon). A pair
 * does the G = Hq / Hkv query heads that share its KV head together, in two passes over the
 * context, W = 16 positions at a time (AVX-512; 8 on the AVX2 and portable builds):
 *   1. scores: for each of the W key rows K_i and each query head g, the lane-wise products
 *      q_g * K_i summed over D into one vector per key (the K rows stay in L1 across the G heads);
 *      the W vectors are then reduced by a shuffle tree into ONE vector holding the W scores
 *      s[g, j..j+W) (no horizontal sum per key), times scale (int8: times each key's scale);
 *   2. softmax per query head over the whole context, vectorised: max, e = exp(s - max), sum;
 *   3. values: out_g += e[g, j] V_j with out_g's D floats in registers over the W rows, and
 *      out_g /= sum at the end.
 * softcap > 0 (Gemma 2's attention soft-capping) replaces each score of step 1 by
 * softcap * tanh(s / softcap) before step 2; 0 leaves the scores as they are.
 * window > 0 (sliding-window attention): the token at position p = len - 1 sees positions
 * (p - window, p] only, so the walk starts at max(0, len - window) (its first block; earlier blocks
 * are never read, they may be freed placeholders); 0: the whole context.
 * Scores live in a per-thread scratch buffer (G rows of the context, padded to W).
 *
 *   pool (one layer) [2][num_blocks][block_size][Hkv][D]      one pair reads, per position j:
 *   slot = table[j / block_size] * block_size + j % block_size   K[slot][h][0..D), V[slot][h][0..D)
 *
 * q, k, v may be views into a fused qkv activation: token b's heads start at b * {q,k,v}_stride
 * and are contiguous within the token. head_dim must be a multiple of 8 (the caller checks); on
 * AVX-512 an odd number of 8-float halves ends in a half vector.
 *
 * int8 KV (`trtforge_decode_attention_int8`): the pool holds int8 values and a second pool
 * float32 scales [2, num_blocks, bs, Hkv], one per token and head. The new k/v rows are quantised
 * as reference.quantize_kv does (scale = max|x| / 127, q = round-half-even(x / scale), the same
 * IEEE operations, so the stored bytes are identical); cached rows are dequantised in registers:
 * s[g, j] = scale * scale_k[j] * (q_g . Kq_j), out_g = sum_j (e[g, j] scale_v[j]) Vq_j.
 *
 * No -ffast-math (IEEE operations; NaN propagates); cpu_native.py builds it with
 * -ffp-contract=fast, so a * b + c may become one fused multiply-add.
 * Returns 0, or -1 when a block id, slot or length is out of range (or no scratch memory):
 * everything is checked before anything is written, and nothing is read or written out of bounds
 * (the caller raises).
 */
#include <math.h>
#include <stdlib.h>

#include "native_vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---- W-lane vectors ---------------------------------------------------------------------------- */
#if defined(__AVX512F__)
#define W 16
typedef v16f vf;
typedef v16i vi;
#define vf_load v16_load
#define vf_store v16_store
#define vf_splat v16_splat
#define vf_select v16_select
#define vf_exp v16_exp
#define vf_sum v16_sum
static const vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
#define W 8
typedef v8f vf;
typedef v8i vi;
#define vf_load v8_load
#define vf_store v8_store
#define vf_splat v8_splat
#define vf_select v8_select
#define vf_exp v8_exp
#define vf_sum v8_sum
static const vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

/* W floats at p, or (half: AVX-512 only) 8 floats and 8 zero lanes. */
ALWAYS_INLINE vf load_f32(const float *p, int half) {
#if W == 16
    if (half) return (vf)_mm512_zextps256_ps512(_mm256_loadu_ps(p));
#else
    (void)half;
#endif
    return vf_load(p);
}

ALWAYS_INLINE void store_f32(float *p, vf v, int half) {
#if W == 16
    if (half) { _mm256_storeu_ps(p, _mm512_castps512_ps256((__m512)v)); return; }
#else
    (void)half;
#endif
    vf_store(p, v);
}

/* W (or 8) int8 values as floats: vpmovsxbd + vcvtdq2ps (GCC lowers the generic conversion to
 * scalar inserts, hence the intrinsics). */
ALWAYS_INLINE vf load_i8(const int8_t *p, int half) {
#if W == 16
    if (!half) return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    return (vf)_mm512_zextps256_ps512(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))));
#elif defined(__AVX2__)
    (void)half;
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    (void)half;
    typedef int8_t v8c __attribute__((vector_size(8)));
    v8c c;
    memcpy(&c, p, sizeof c);
    return __builtin_convertvector(__builtin_convertvector(c, v8i), v8f);
#endif
}

/* The kernels below are written once for both pool types and specialised by the compiler: each
 * is always inlined into a float32 and an int8 caller with I8 a constant, so the float path keeps
 * its plain loads and the per-key scales fold away. */
ALWAYS_INLINE vf load_row(const void *row, int64_t d, int half, int I8) {
    return I8 ? load_i8((const int8_t *)row + d, half) : load_f32((const float *)row + d, half);
}

/* r[i] = sum of the lanes of p[i], i < W: a transpose-and-add tree, 45 shuffles and adds for
 * 16 vectors (a horizontal sum each would take ~8 dependent steps per key). */
ALWAYS_INLINE vf reduce_lanes(const vf *p) {
#if W == 16
    __m512 l2[4];
    for (int k = 0; k < 4; k++) {
        const __m512 a = (__m512)p[4 * k], b = (__m512)p[4 * k + 1], c = (__m512)p[4 * k + 2],
                     d = (__m512)p[4 * k + 3];
        /* per 128-bit lane: [a, b, a, b] then [a, b, c, d] partial sums */
        const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
        l2[k] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    /* across the 128-bit lanes: keys 0-3 | 0-3 | 4-7 | 4-7, then 0-3 | 4-7 | 8-11 | 12-15 */
    const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(l2[0], l2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(l2[0], l2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(l2[2], l2[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(l2[2], l2[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return (vf)_mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
#elif defined(__AVX2__)
    __m256 l2[2];
    for (int k = 0; k < 2; k++) {
        const __m256 a = (__m256)p[4 * k], b = (__m256)p[4 * k + 1], c = (__m256)p[4 * k + 2],
                     d = (__m256)p[4 * k + 3];
        const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
        const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
        l2[k] = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(l2[0], l2[1], 0x20), _mm256_permute2f128_ps(l2[0], l2[1], 0x31));
#else
    vf r;
    for (int i = 0; i < W; i++) r[i] = v8_sum(p[i]);
    return r;
#endif
}

/* ---- one (sequence, KV head) pair ------------------------------------------------------------ */

/* Prefetch the `bytes` bytes at p (locality 3: into L1, 2: into L2), one 64-byte line at a time. */
ALWAYS_INLINE void prefetch_row(const char *p, int64_t bytes, const int locality) {
    for (int64_t b = 0; b < bytes; b += 64) {
        if (locality == 3) __builtin_prefetch(p + b, 0, 3);
        else __builtin_prefetch(p + b, 0, 2);
    }
}

/* The context's positions W at a time: rows[i] = the i-th position's K (or V) row of this head,
 * scales[i] its int8 scale; positions past the end repeat the last one (their lanes are ignored).
 * Walks the block table block by block (no division per position: a 64-bit divide costs ~40
 * cycles). */
typedef struct {
    const int32_t *table;
    int64_t block_size, len, pos, block, offset;
} Walk;

ALWAYS_INLINE int64_t next_slots(Walk *w, int64_t slots[W]) {
    const int64_t n = w->len - w->pos < W ? w->len - w->pos : W;
    for (int64_t i = 0; i < W; i++) {
        if (i < n) {
            slots[i] = (int64_t)w->table[w->block] * w->block_size + w->offset;
            if (++w->offset == w->block_size) w->offset = 0, w->block++;
        } else {
            slots[i] = slots[n - 1];
        }
    }
    w->pos += n;
    return n;
}

/* Accumulates q_a . K_i into partial[i] and q_b . K_i into partial[W/2 + i] for the NK keys rows[i]
 * (NB = 2: two query heads, W/2 keys; NB = 1: one head, W keys, q_b unused), each K vector loaded
 * once for both heads. */
ALWAYS_INLINE void dot_keys(const float *qa, const float *qb, const char *const *rows, int64_t head_dim,
                            vf *partial, const int NB, int I8) {
    const int64_t full = head_dim / W, half = head_dim % W != 0;
    const int NK = NB == 2 ? W / 2 : W;
    for (int i = 0; i < W; i++) partial[i] = vf_splat(0.0f);
    for (int64_t c = 0; c < full + half; c++) {
        const int last_half = half && c == full;
        const vf a = load_f32(qa + c * W, last_half), b = NB == 2 ? load_f32(qb + c * W, last_half) : a;
        for (int i = 0; i < NK; i++) {
            const vf k = load_row(rows[i], c * W, last_half, I8);
            partial[i] += a * k;
            if (NB == 2) partial[W / 2 + i] += b * k;
        }
    }
}

/* s[g * stride + i] = key_scale[i] * q_g . K_i for the W keys of `rows` and the G query heads.
 * Two heads at a time against W/2 keys (W independent accumulators, half the K loads): the tree
 * then yields [head g's W/2 scores | head g+1's]; an odd last head takes all W keys at once. */
ALWAYS_INLINE void group_scores(const float *q, const char *const *rows, vf key_scale, int64_t group,
                                int64_t head_dim, float *s, int64_t stride, int I8) {
    vf pair_scale[2], partial[W];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < W; i++) pair_scale[h][i] = key_scale[h * (W / 2) + i % (W / 2)];
    int64_t g = 0;
    for (; g + 2 <= group; g += 2) {
        const float *qa = q + g * head_dim, *qb = qa + head_dim;
        for (int h = 0; h < 2; h++) {
            dot_keys(qa, qb, rows + h * (W / 2), head_dim, partial, 2, I8);
            const vf r = reduce_lanes(partial) * pair_scale[h];
            memcpy(s + g * stride + h * (W / 2), &r, sizeof(float) * (W / 2));
            memcpy(s + (g + 1) * stride + h * (W / 2), (const float *)&r + W / 2, sizeof(float) * (W / 2));
        }
    }
    if (g < group) {
        dot_keys(q + g * head_dim, NULL, rows, head_dim, partial, 1, I8);
        vf_store(s + g * stride, reduce_lanes(partial) * key_scale);
    }
}

/* og[h][d0 .. d0 + CT vectors) += sum_i e[h][i] V_i over the n rows, for NH (1 or 2) query heads:
 * NH * CT (<= 8) accumulators in registers, each V vector loaded once for the NH heads; HALF: the
 * last vector is a half one. */
ALWAYS_INLINE void values_tile(const float *const *e, const char *const *rows, int64_t n, int64_t d0,
                               float *const *og, const int NH, const int CT, const int HALF, int I8) {
    vf acc[2][4];
    for (int h = 0; h < NH; h++)
        for (int k = 0; k < CT; k++) acc[h][k] = load_f32(og[h] + d0 + k * W, HALF && k == CT - 1);
    for (int64_t i = 0; i < n; i++) {
        vf p[2];
        for (int h = 0; h < NH; h++) p[h] = vf_splat(e[h][i]);
        for (int k = 0; k < CT; k++) {
            const vf v = load_row(rows[i], d0 + k * W, HALF && k == CT - 1, I8);
            for (int h = 0; h < NH; h++) acc[h][k] += p[h] * v;
        }
    }
    for (int h = 0; h < NH; h++)
        for (int k = 0; k < CT; k++) store_f32(og[h] + d0 + k * W, acc[h][k], HALF && k == CT - 1);
}

/* values_tile over all of D: tiles of four vectors, then the remainder's specialisation. */
ALWAYS_INLINE void values_heads(const float *const *e, const char *const *rows, int64_t n, int64_t head_dim,
                                float *const *og, const int NH, int I8) {
    const int64_t full = head_dim / W, half = head_dim % W != 0, tail = (full % 4) * 2 + half;
    int64_t c = 0;
    for (; c + 4 <= full; c += 4) values_tile(e, rows, n, c * W, og, NH, 4, 0, I8);
    switch (tail) { /* (full vectors left) * 2 + half */
    case 1: values_tile(e, rows, n, c * W, og, NH, 1, 1, I8); break;
    case 2: values_tile(e, rows, n, c * W, og, NH, 1, 0, I8); break;
    case 3: values_tile(e, rows, n, c * W, og, NH, 2, 1, I8); break;
    case 4: values_tile(e, rows, n, c * W, og, NH, 2, 0, I8); break;
    case 5: values_tile(e, rows, n, c * W, og, NH, 3, 1, I8); break;
    case 6: values_tile(e, rows, n, c * W, og, NH, 3, 0, I8); break;
    case 7: values_tile(e, rows, n, c * W, og, NH, 4, 1, I8); break;
    default: break;
    }
}

/* out_g += sum_i e[g, i] (scale_v[i]) V_i for the G heads, n <= W rows, two heads at a time. */
ALWAYS_INLINE void group_values(const float *s, int64_t stride, const char *const *rows, const float *value_scale,
                                int64_t n, int64_t group, int64_t head_dim, float *out, int I8) {
    float scaled[2][W];
    for (int64_t g = 0; g < group; g += 2) {
        const int nh = group - g >= 2 ? 2 : 1;
        const float *e[2];
        float *og[2];
        for (int h = 0; h < nh; h++) {
            e[h] = s + (g + h) * stride, og[h] = out + (g + h) * head_dim;
            if (I8) {
                for (int64_t i = 0; i < n; i++) scaled[h][i] = e[h][i] * value_scale[i];
                e[h] = scaled[h];
            }
        }
        if (nh == 2) values_heads(e, rows, n, head_dim, og, 2, I8);
        else values_heads(e, rows, n, head_dim, og, 1, I8);
    }
}

/* s[0..len) <- exp(s - max s), s[len..padded) <- 0; returns 1 / sum. padded: len rounded up to W. */
static float softmax_row(float *s, int64_t len, int64_t padded) {
    for (int64_t j = len; j < padded; j++) s[j] = -INFINITY;
    vf mv = vf_load(s);
    for (int64_t j = W; j < padded; j += W) {
        const vf x = vf_load(s + j);
        mv = vf_select(x > mv, x, mv);
    }
    float m = mv[0];
    for (int i = 1; i < W; i++) m = mv[i] > m ? mv[i] : m;
    vf sums = vf_splat(0.0f);
    for (int64_t j = 0; j < padded; j += W) {
        vf e = vf_exp(vf_load(s + j) - m);
        e = vf_select(IOTA < (vi){0} + (int32_t)(len - j), e, vf_splat(0.0f)); /* padding: 0 */
        vf_store(s + j, e);
        sums += e;
    }
    return 1.0f / vf_sum(sums);
}

/* One pair: q the group's G query heads [G, D]; key_pool/value_pool point at this head's first
 * value of slot 0 (int8: key_scales/value_scales at its first scale); row_bytes per slot. */
ALWAYS_INLINE void attend(const float *q, const char *key_pool, const char *value_pool, const float *key_scales,
                          const float *value_scales, const int32_t *table, int64_t len, int64_t block_size,
                          int64_t row_bytes, int64_t num_kv_heads, int64_t group, int64_t head_dim, float scale,
                          float softcap, int64_t window, float *s, float *out, int I8) {
    /* window: positions first..len-1 only (n_ctx of them); 0: all. Score j is position first + j. */
    const int64_t first = window > 0 && len > window ? len - window : 0, n_ctx = len - first;
    const int64_t first_block = first ? first / block_size : 0, first_offset = first ? first % block_size : 0;
    const int64_t padded = (n_ctx + W - 1) / W * W, stride = padded;
    const char *rows[W];
    int64_t slots[W], next[W];
    float vscale[W];
    const int64_t row_used = head_dim * (I8 ? 1 : (int64_t)sizeof(float)); /* this head's bytes of a slot */
    /* Block-table jumps defeat the hardware prefetcher, and a memory-bound pass then waits on each
     * row: pass 1 prefetches the next W keys into L1 and these W positions' values into L2 (for
     * pass 3, which prefetches its next W values into L1). */
    Walk walk = {table, block_size, len, first, first_block, first_offset};
    next_slots(&walk, next);
    for (int i = 0; i < W; i++) prefetch_row(key_pool + next[i] * row_bytes, row_used, 3);
    for (int64_t j = 0; j < n_ctx; j += W) {
        memcpy(slots, next, sizeof slots);
        if (j + W < n_ctx) {
            next_slots(&walk, next);
            for (int i = 0; i < W; i++) prefetch_row(key_pool + next[i] * row_bytes, row_used, 3);
        }
        vf key_scale = vf_splat(scale);
        for (int i = 0; i < W; i++) {
            rows[i] = key_pool + slots[i] * row_bytes;
            prefetch_row(value_pool + slots[i] * row_bytes, row_used, 2);
            if (I8) key_scale[i] = scale * key_scales[slots[i] * num_kv_heads];
        }
        group_scores(q, rows, key_scale, group, head_dim, s + j, stride, I8);
    }
    if (softcap > 0.0f) {
        const float inv_cap = 1.0f / softcap;
        for (int64_t g = 0; g < group; g++)
            for (int64_t j = 0; j < n_ctx; j++) s[g * stride + j] = softcap * tanhf(s[g * stride + j] * inv_cap);
    }
    float inv_sum[group];
    for (int64_t g = 0; g < group; g++) inv_sum[g] = softmax_row(s + g * stride, n_ctx, padded);
    memset(out, 0, group * head_dim * sizeof(float));
    walk = (Walk){table, block_size, len, first, first_block, first_offset};
    int64_t n_next = next_slots(&walk, next);
    for (int64_t j = 0; j < n_ctx; j += W) {
        const int64_t n = n_next;
        memcpy(slots, next, sizeof slots);
        if (j + W < n_ctx) {
            n_next = next_slots(&walk, next);
            for (int i = 0; i < W; i++) prefetch_row(value_pool + next[i] * row_bytes, row_used, 3);
        }
        for (int i = 0; i < W; i++) {
            rows[i] = value_pool + slots[i] * row_bytes;
            if (I8) vscale[i] = value_scales[slots[i] * num_kv_heads];
        }
        group_values(s + j, stride, rows, vscale, n, group, head_dim, out, I8);
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] *= inv_sum[g];
}

/* ---- the batch --------------------------------------------------------------------------------- */

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

static int by_key(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Sequence indices, longest context first (ties: lower index first); NULL if out of memory. */
static int64_t *longest_first(const int32_t *seq_lens, int64_t num_seqs) {
    int64_t *order = malloc((size_t)(num_seqs > 0 ? num_seqs : 1) * sizeof *order);
    if (!order) return NULL;
    for (int64_t b = 0; b < num_seqs; b++) order[b] = ((int64_t)(INT32_MAX - seq_lens[b]) << 32) | b;
    qsort(order, (size_t)num_seqs, sizeof *order, by_key);
    for (int64_t b = 0; b < num_seqs; b++) order[b] &= 0xffffffff;
    return order;
}

/* Every sequence's attention, KV head by KV head (its G query heads together); -1 if no memory. */
ALWAYS_INLINE int attend_all(const float *q, int64_t q_stride, const void *key_pool, const void *value_pool,
                             const float *key_scales, const float *value_scales, const int32_t *block_tables,
                             int64_t table_width, const int32_t *seq_lens, float *out, int64_t num_seqs,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, float softcap, int64_t window, int I8, int64_t threads) {
    const int64_t group = num_heads / num_kv_heads, elem = I8 ? (int64_t)sizeof(int8_t) : (int64_t)sizeof(float);
    const int64_t row_bytes = num_kv_heads * head_dim * elem;
    int64_t *order = longest_first(seq_lens, num_seqs);
    if (!order) return -1;
    int failed = 0;
    /* (sequence, KV head) pairs over the OpenMP threads (torch's pool: same libgomp), longest
     * first, one at a time. Each thread has its own score buffer (thread-local). */
    const int64_t per_item = num_seqs >= 4 * threads ? num_kv_heads : 1; /* pairs per work item */
    const int64_t work = num_seqs * num_kv_heads / per_item;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(|| : failed)
    for (int64_t item = 0; item < work; item++) {
      for (int64_t sub = 0; sub < per_item; sub++) {
        const int64_t pair = item * per_item + sub;
        const int64_t b = order[pair / num_kv_heads], h = pair % num_kv_heads, len = seq_lens[b];
        const int64_t span = window > 0 && len > window ? window : len; /* positions attended */
        float *s = scores_buffer((size_t)(group * ((span + W - 1) / W * W)));
        if (!s) { failed = 1; continue; }
        attend(q + b * q_stride + h * group * head_dim, (const char *)key_pool + h * head_dim * elem,
               (const char *)value_pool + h * head_dim * elem, I8 ? key_scales + h : NULL,
               I8 ? value_scales + h : NULL, block_tables + b * table_width, len, block_size, row_bytes,
               num_kv_heads, group, head_dim, scale, softcap, window, s, out + (b * num_heads + h * group) * head_dim,
               I8);
      }
    }
    free(order);
    return failed ? -1 : 0;
}

static int inputs_ok(int64_t num_blocks, int64_t block_size, const int64_t *slot_mapping,
                     const int32_t *block_tables, int64_t table_width, const int32_t *seq_lens,
                     int64_t num_seqs, int64_t window) {
    const int64_t num_slots = num_blocks * block_size;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t len = seq_lens[b], slot = slot_mapping[b];
        if (len < 1 || len > table_width * block_size || slot < 0 || slot >= num_slots) return 0;
        const int32_t *table = block_tables + b * table_width;
        /* window: entries before the first block in the window are never read (freed: FREED_BLOCK) */
        const int64_t first = window > 0 && len > window ? (len - window) / block_size : 0;
        for (int64_t i = first; i < (len + block_size - 1) / block_size; i++)
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
                              float scale, float softcap, int64_t window, int64_t threads) {
    const int64_t row = num_kv_heads * head_dim; /* floats per slot */
    const int64_t num_slots = num_blocks * block_size;
    float *key_pool = pool, *value_pool = pool + num_slots * row;
    if (!inputs_ok(num_blocks, block_size, slot_mapping, block_tables, table_width, seq_lens, num_seqs, window))
        return -1;
    for (int64_t b = 0; b < num_seqs; b++) {
        memcpy(key_pool + slot_mapping[b] * row, k + b * k_stride, row * sizeof(float));
        memcpy(value_pool + slot_mapping[b] * row, v + b * v_stride, row * sizeof(float));
    }
    return attend_all(q, q_stride, key_pool, value_pool, NULL, NULL, block_tables, table_width, seq_lens,
                      out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, softcap, window, 0, threads);
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
                                   float scale, float softcap, int64_t window, int64_t threads) {
    const int64_t row = num_kv_heads * head_dim; /* int8 values per slot */
    const int64_t num_slots = num_blocks * block_size;
    int8_t *key_pool = pool, *value_pool = pool + num_slots * row;
    float *key_scales = scales, *value_scales = scales + num_slots * num_kv_heads;
    if (!inputs_ok(num_blocks, block_size, slot_mapping, block_tables, table_width, seq_lens, num_seqs, window))
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
                      seq_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, softcap, window, 1,
                      threads);
}
