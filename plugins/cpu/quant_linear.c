/* Weight-only quantized linear layers on CPU, float32 activations (quant_linear.py is the reference):
 *
 *   int8: W[n, k] = q[n, k] * scale[n]              q int8, one scale per output row
 *   int4: W[n, k] = q[n, k] * scale[n, k / group]   q in [-8, 7], two per byte: element 2i in the low
 *                                                    nibble of byte i, 2i+1 in the high one
 *
 * Decode (up to a few dozen rows of x): a step streams the weights, so the packed weights are read
 * once and dequantised in registers — int8 bytes sign-extended and converted, int4 nibbles moved to
 * the top of a 32-bit lane and shifted back arithmetically (sign extension in two shifts) — and
 * multiplied like linear.c: blocks of four weight rows split evenly over the OpenMP threads, three
 * rows of x per loaded weight vector. The per-row int8 scale is applied once at the end; the int4
 * group scale multiplies the dequantised vector (the value the reference dequantises to, exactly),
 * except for a single row, where each group's partial sum is scaled instead (one multiply-add per
 * group rather than one multiply per 8 weights: a batch-1 int4 step is otherwise compute-bound).
 *
 * Prefill (more rows) with float activations: trtforge_dequant_* write the float32 weights once for a
 * dense GEMM. (By default every row count takes the int8-activation kernels further down instead.)
 *
 * K must be a multiple of 8 and, for int4, group a multiple of 8 (the caller checks); bias may be NULL.
 */
#include "native_vec.h"

typedef int8_t v8c __attribute__((vector_size(8)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#ifdef __AVX2__
#include <immintrin.h>
/* GCC 12 lowers the generic 8-byte → 8-lane conversion below to 16 scalar inserts (measured: the
 * int8 GEMV ran at half the float32 one's speed); AVX2 has it as one vpmovsxbd. */
static inline v8f load_i8(const int8_t *p) {
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline v8f load_i8(const int8_t *p) {
    v8c c;
    memcpy(&c, p, sizeof c);
    return __builtin_convertvector(__builtin_convertvector(c, v8i), v8f);
}
#endif

/* Eight int4 values from four bytes: nibble j of the little-endian word is element j. */
static inline v8f load_i4(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, sizeof w);
    const v8u word = {w, w, w, w, w, w, w, w};
    const v8u up = {28, 24, 20, 16, 12, 8, 4, 0};
    return __builtin_convertvector((v8i)(word << up) >> 28, v8f);
}

/* Weight vector i (elements 8i..8i+7) of row `row`, dequantised (int4: with its group's scale). */
#define W_INT8(row, i) load_i8((const int8_t *)(row) + (i))
#define W_INT4(row, s, i) (load_i4((const uint8_t *)(row) + (i) / 2) * v8_splat((s)[(i) / group]))  /* edge rows only */

static inline float out8(v8f acc, const float *scale, const float *bias, int64_t n) {
    return v8_sum(acc) * scale[n] + (bias ? bias[n] : 0.0f);
}

static inline float out4(v8f acc, const float *bias, int64_t n) { return v8_sum(acc) + (bias ? bias[n] : 0.0f); }

/* ---- int8 ------------------------------------------------------------------------------------ */
static void int8_block(const float *x, int64_t rows, const int8_t *q, const float *scale, const float *bias,
                       float *y, int64_t n0, int64_t n_out, int64_t k) {
    const int8_t *w0 = q + n0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3) {
        const float *x0 = x + r * k, *x1 = x0 + k, *x2 = x1 + k;
        v8f a00 = v8_splat(0.0f), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
            a20 = a00, a21 = a00, a22 = a00, a23 = a00;
        for (int64_t i = 0; i < k; i += 8) {
            const v8f b0 = W_INT8(w0, i), b1 = W_INT8(w1, i), b2 = W_INT8(w2, i), b3 = W_INT8(w3, i);
            TILE_3X4_FMA(x0, x1, x2, i, b0, b1, b2, b3);
        }
        float *y0 = y + r * n_out + n0, *y1 = y0 + n_out, *y2 = y1 + n_out;
        y0[0] = out8(a00, scale, bias, n0); y0[1] = out8(a01, scale, bias, n0 + 1); y0[2] = out8(a02, scale, bias, n0 + 2); y0[3] = out8(a03, scale, bias, n0 + 3);
        y1[0] = out8(a10, scale, bias, n0); y1[1] = out8(a11, scale, bias, n0 + 1); y1[2] = out8(a12, scale, bias, n0 + 2); y1[3] = out8(a13, scale, bias, n0 + 3);
        y2[0] = out8(a20, scale, bias, n0); y2[1] = out8(a21, scale, bias, n0 + 1); y2[2] = out8(a22, scale, bias, n0 + 2); y2[3] = out8(a23, scale, bias, n0 + 3);
    }
    for (; r < rows; r++) {
        const float *xr = x + r * k;
        v8f a0 = v8_splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < k; i += 8) {
            const v8f xv = v8_load(xr + i);
            a0 += xv * W_INT8(w0, i); a1 += xv * W_INT8(w1, i); a2 += xv * W_INT8(w2, i); a3 += xv * W_INT8(w3, i);
        }
        float *yr = y + r * n_out + n0;
        yr[0] = out8(a0, scale, bias, n0); yr[1] = out8(a1, scale, bias, n0 + 1); yr[2] = out8(a2, scale, bias, n0 + 2); yr[3] = out8(a3, scale, bias, n0 + 3);
    }
}

static void int8_rows(const float *x, int64_t rows, const int8_t *q, const float *scale, const float *bias,
                      float *y, int64_t n0, int64_t n1, int64_t n_out, int64_t k) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t r = 0; r < rows; r++) {
            v8f acc = v8_splat(0.0f);
            for (int64_t i = 0; i < k; i += 8) acc += v8_load(x + r * k + i) * W_INT8(q + n * k, i);
            y[r * n_out + n] = out8(acc, scale, bias, n);
        }
}

void trtforge_gemv_int8(const float *x, int64_t rows, const int8_t *q, const float *scale, const float *bias,
                        float *y, int64_t n_out, int64_t k, int64_t threads) {
    const int64_t blocks = (n_out + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * 4;
        if (n0 + 4 <= n_out) int8_block(x, rows, q, scale, bias, y, n0, n_out, k);
        else int8_rows(x, rows, q, scale, bias, y, n0, n_out, n_out, k); /* the last 1-3 weight rows */
    }
}

/* ---- int4 ------------------------------------------------------------------------------------ */
/* One row of x against weight rows n0..n0+3: each group's partial sums scaled once. */
static void int4_row(const float *xr, const uint8_t *q, const float *scale, const float *bias, float *yr,
                     int64_t n0, int64_t k, int64_t group) {
    const int64_t kb = k / 2, groups = k / group;
    const uint8_t *w0 = q + n0 * kb, *w1 = w0 + kb, *w2 = w1 + kb, *w3 = w2 + kb;
    const float *s0 = scale + n0 * groups, *s1 = s0 + groups, *s2 = s1 + groups, *s3 = s2 + groups;
    v8f t0 = v8_splat(0.0f), t1 = t0, t2 = t0, t3 = t0;
    for (int64_t g = 0; g < groups; g++) {
        v8f a0 = v8_splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = g * group; i < (g + 1) * group; i += 8) {
            const v8f xv = v8_load(xr + i);
            a0 += xv * load_i4(w0 + i / 2); a1 += xv * load_i4(w1 + i / 2);
            a2 += xv * load_i4(w2 + i / 2); a3 += xv * load_i4(w3 + i / 2);
        }
        t0 += a0 * s0[g]; t1 += a1 * s1[g]; t2 += a2 * s2[g]; t3 += a3 * s3[g];
    }
    yr[n0] = out4(t0, bias, n0); yr[n0 + 1] = out4(t1, bias, n0 + 1);
    yr[n0 + 2] = out4(t2, bias, n0 + 2); yr[n0 + 3] = out4(t3, bias, n0 + 3);
}

static void int4_block3(const float *x, int64_t r, const uint8_t *q, const float *scale, const float *bias,
                        float *y, int64_t n0, int64_t n_out, int64_t k, int64_t group) {
    const int64_t kb = k / 2, groups = k / group;
    const uint8_t *w0 = q + n0 * kb, *w1 = w0 + kb, *w2 = w1 + kb, *w3 = w2 + kb;
    const float *s0 = scale + n0 * groups, *s1 = s0 + groups, *s2 = s1 + groups, *s3 = s2 + groups;
    const float *x0 = x + r * k, *x1 = x0 + k, *x2 = x1 + k;
    v8f a00 = v8_splat(0.0f), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
        a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t g = 0; g < groups; g++) { /* the group's scales hoisted: no division per vector */
        const v8f c0 = v8_splat(s0[g]), c1 = v8_splat(s1[g]), c2 = v8_splat(s2[g]), c3 = v8_splat(s3[g]);
        for (int64_t i = g * group; i < (g + 1) * group; i += 8) {
            const v8f b0 = load_i4(w0 + i / 2) * c0, b1 = load_i4(w1 + i / 2) * c1, b2 = load_i4(w2 + i / 2) * c2,
                      b3 = load_i4(w3 + i / 2) * c3;
            TILE_3X4_FMA(x0, x1, x2, i, b0, b1, b2, b3);
        }
    }
    float *y0 = y + r * n_out + n0, *y1 = y0 + n_out, *y2 = y1 + n_out;
    y0[0] = out4(a00, bias, n0); y0[1] = out4(a01, bias, n0 + 1); y0[2] = out4(a02, bias, n0 + 2); y0[3] = out4(a03, bias, n0 + 3);
    y1[0] = out4(a10, bias, n0); y1[1] = out4(a11, bias, n0 + 1); y1[2] = out4(a12, bias, n0 + 2); y1[3] = out4(a13, bias, n0 + 3);
    y2[0] = out4(a20, bias, n0); y2[1] = out4(a21, bias, n0 + 1); y2[2] = out4(a22, bias, n0 + 2); y2[3] = out4(a23, bias, n0 + 3);
}

static void int4_rows(const float *x, int64_t rows, const uint8_t *q, const float *scale, const float *bias,
                      float *y, int64_t n0, int64_t n1, int64_t n_out, int64_t k, int64_t group) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t r = 0; r < rows; r++) {
            v8f acc = v8_splat(0.0f);
            for (int64_t i = 0; i < k; i += 8)
                acc += v8_load(x + r * k + i) * W_INT4(q + n * (k / 2), scale + n * (k / group), i);
            y[r * n_out + n] = out4(acc, bias, n);
        }
}

void trtforge_gemv_int4(const float *x, int64_t rows, const uint8_t *q, const float *scale, const float *bias,
                        float *y, int64_t n_out, int64_t k, int64_t group, int64_t threads) {
    const int64_t blocks = (n_out + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * 4;
        if (n0 + 4 > n_out) { int4_rows(x, rows, q, scale, bias, y, n0, n_out, n_out, k, group); continue; }
        int64_t r = 0;
        if (rows > 1)
            for (; r + 3 <= rows; r += 3) int4_block3(x, r, q, scale, bias, y, n0, n_out, k, group);
        for (; r < rows; r++) int4_row(x + r * k, q, scale, bias, y + r * n_out, n0, k, group);
    }
}

/* ---- dequantisation for prefill ---------------------------------------------------------------- */
void trtforge_dequant_int8(const int8_t *q, const float *scale, float *out, int64_t n_out, int64_t k,
                           int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < n_out; n++) {
        const v8f s = v8_splat(scale[n]);
        for (int64_t i = 0; i < k; i += 8) v8_store(out + n * k + i, W_INT8(q + n * k, i) * s);
    }
}

void trtforge_dequant_int4(const uint8_t *q, const float *scale, float *out, int64_t n_out, int64_t k,
                           int64_t group, int64_t threads) {
    const int64_t groups = k / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < n_out; n++)
        for (int64_t g = 0; g < groups; g++) {
            const v8f s = v8_splat(scale[n * groups + g]);
            for (int64_t i = g * group; i < (g + 1) * group; i += 8)
                v8_store(out + n * k + i, load_i4(q + (n * k + i) / 2) * s);
        }
}

/* ==== int8 activations (W8A8 / W4A8 dot products) ============================================== *
 *
 * The weight-only kernels above convert every weight to float32: ~0.5-1 G conversions and FMAs a
 * batch-1 step of a 0.5B model, which made them compute-bound at 2-3x the copy-bandwidth bound on
 * 2 AVX2 cores. These instead quantise the (few) activation rows to int8 once per call and take
 * integer dot products, as llama.cpp's Q8_0 / Q4_0 AVX2 paths do:
 *
 *   activations: per row and block of QK = 32 inputs, d = max|x| / 127 (1 where the block is all
 *                zero), xq = round-half-even(x / d) in [-127, 127] — quant_linear.py's
 *                `quantize_activations` is the same IEEE arithmetic, so the bytes are identical;
 *   int8 weights: per block, sum(xq * q) with vpmaddubsw (|xq| unsigned times q carrying xq's sign,
 *                vpsignb; pairs <= 2 * 127 * 127, no int16 saturation) + vpmaddwd → 8 int32 lanes,
 *                converted and multiplied by d once (FMA); the row scale once at the end;
 *   int4 weights: 32 packed bytes (64 weights, two blocks) per load; nibbles XOR 8 are q + 8 in
 *                [0, 15], unsigned, so vpmaddubsw takes them against the signed xq directly and the
 *                excess 8 * sum(xq) (precomputed per row, lane by lane) is subtracted in int32: the
 *                integer dot is exact. The low nibbles are the even inputs and the high ones the odd
 *                inputs, so the activation rows are stored permuted to match (per 64 inputs: the
 *                32 even ones, then the 32 odd ones; a lone last block of 32: 16 even, 16 odd).
 *                Group scales: per group of inputs (a multiple of 64) the block sums times d are
 *                accumulated, then multiplied by the group's scale; other multiples of 32 multiply
 *                by d * group scale per block.
 *   streaming: the next block of weight rows is prefetched in software (PREFETCH_NEXT).
 *
 * Any number of rows (decode steps and prefill chunks): rows in L2-sized tiles, two rows x four weight
 * rows per register tile (row2 kernels), the weight blocks of a tile split over the threads.
 *
 * Every block's integer dot is exact; results differ from `gemv_a8_reference` (torch) by float32
 * summation order only. K must be a multiple of 32 and the int4 group too (quant_linear.py falls
 * back to the float-activation kernels otherwise). Without AVX2 the same arithmetic runs in scalar C.
 */
#include <math.h>
#include <stdlib.h>

#define QK 32

typedef struct {                 /* one call's quantised activation rows (thread-local, reused) */
    int8_t *q;                   /* [rows, k]: int8 layout natural, int4 layout permuted */
    float *d;                    /* [rows, k / QK] block scales */
    float *d4;                   /* [rows, k / QK * 4]: each block scale four times (int4: a pair of blocks' lanes) */
    int32_t *corr;               /* [rows, (k / QK + 1) * 4]: int4 only, 8 * sum(xq) per int32 lane of the dot
                                  * (a lone last block's 8 lanes reach 4 past k / QK * 4) */
    uint8_t *xa;                 /* [rows, k]: |xq| (the AVX2 panel GEMM's unsigned operand) */
    size_t cap;
} act_buf;

static __thread act_buf tls_act;

static int act_reserve(act_buf *a, int64_t rows, int64_t k) {
    const size_t need = (size_t)(rows * k);
    if (need <= a->cap) return 0;
    free(a->q); free(a->d); free(a->d4); free(a->corr); free(a->xa);
    a->q = malloc(need + 64);
    a->xa = malloc(need + 64);
    a->d = malloc(need / QK * sizeof(float) + 64);
    a->d4 = malloc(need / QK * 4 * sizeof(float) + 64);
    a->corr = malloc(need / QK * 8 * sizeof(int32_t) + 64);  /* rows <= need / QK */
    a->cap = (a->q && a->d && a->d4 && a->corr && a->xa) ? need : 0;
    return a->cap ? 0 : -1;
}

/* One block of 32 inputs → 32 int8 (natural order) and its scale. */
static float quant_block(const float *x, int8_t *out) {
#ifdef __AVX2__
    const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_and_ps(_mm256_loadu_ps(x), nosign);
    for (int j = 1; j < 4; j++) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + 8 * j), nosign));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 h2 = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h2, _mm_movehdup_ps(h2)));
#else
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
#endif
    const float d = amax > 0.0f ? amax / 127.0f : 1.0f;
#ifdef __AVX2__
    const __m256 dv = _mm256_set1_ps(d);
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    __m256i v[4];
    for (int j = 0; j < 4; j++) {  /* vcvtps2dq rounds half to even (the default MXCSR mode), as torch.round */
        __m256i t = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + 8 * j), dv));
        v[j] = _mm256_max_epi32(_mm256_min_epi32(t, lim), nlim);
    }
    /* packs interleave the 128-bit lanes: restore element order with a dword permutation */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int i = 0; i < QK; i++) {
        float r = nearbyintf(x[i] / d);
        out[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
#endif
    return d;
}

/* Quantise `rows` rows of x [rows, k]; int4: permuted layout, lane scales and corrections. */
static void quantize_rows(const float *x, int64_t rows, int64_t k, int int4, act_buf *a, int64_t threads) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        int8_t *q = a->q + r * k;
        float *d = a->d + r * nb, *d4 = a->d4 + r * nb * 4;
        int32_t *corr = a->corr + r * (nb + 1) * 4;
#ifdef __AVX2__
        if (int4) {  /* the same layout and corrections as below, with shuffles and the kernel's own dot */
            const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                   0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            const __m256i eight = _mm256_set1_epi8(8), ones = _mm256_set1_epi16(1);
            for (int64_t b = 0; b < nb; b += 2) {
                int8_t tmp[2 * QK];
                const int lone = b + 1 == nb;
                for (int64_t c = b; c < b + (lone ? 1 : 2); c++) {
                    d[c] = quant_block(x + r * k + c * QK, tmp + (c - b) * QK);
                    for (int j = 0; j < 4; j++) d4[c * 4 + j] = d[c];
                }
                /* per 128-bit lane: 8 even inputs, then 8 odd; then the lanes' halves regrouped */
                const __m256i p0 = _mm256_permute4x64_epi64(
                    _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)tmp), split), 0xD8);
                if (lone) {  /* [16 even | 16 odd] */
                    _mm256_storeu_si256((__m256i *)(q + b * QK), p0);
                    _mm256_storeu_si256((__m256i *)(corr + b * 4), _mm256_madd_epi16(_mm256_maddubs_epi16(eight, p0), ones));
                    break;
                }
                const __m256i p1 = _mm256_permute4x64_epi64(
                    _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(tmp + QK)), split), 0xD8);
                const __m256i e = _mm256_permute2x128_si256(p0, p1, 0x20), o = _mm256_permute2x128_si256(p0, p1, 0x31);
                _mm256_storeu_si256((__m256i *)(q + b * QK), e);
                _mm256_storeu_si256((__m256i *)(q + b * QK + 32), o);
                _mm256_storeu_si256((__m256i *)(corr + b * 4), _mm256_madd_epi16(
                    _mm256_add_epi16(_mm256_maddubs_epi16(eight, e), _mm256_maddubs_epi16(eight, o)), ones));
            }
            continue;
        }
#endif
        for (int64_t b = 0; b < nb; b++) {
            int8_t tmp[QK];
            d[b] = quant_block(x + r * k + b * QK, int4 ? tmp : q + b * QK);
            for (int j = 0; j < 4; j++) d4[b * 4 + j] = d[b];
            if (!int4) continue;
            /* where each input goes: in a pair of blocks (2p, 2p+1), input i of the 64 goes to
             * i/2 (even) or 32 + i/2 (odd); a lone last block: i/2 or 16 + i/2 */
            const int64_t pair = b / 2, lone = (b == nb - 1) && (nb % 2);
            int8_t *base = q + (lone ? b * QK : pair * 2 * QK);
            const int off = lone ? 0 : (int)(b % 2) * 16, half = lone ? 16 : 32;
            for (int i = 0; i < QK; i++) base[(i % 2) * half + off + i / 2] = tmp[i];
        }
        if (!int4) continue;
        /* corrections, per int32 lane of the dot as the kernel forms it: the lane j (0..7) of a
         * pair's dot covers int16 lanes 2j, 2j+1 of even + odd products = bytes 4j..4j+3 of both
         * halves (lanes 0-3: the first block, 4-7: the second); a lone block: lanes 0-3 even bytes,
         * 4-7 odd bytes, i.e. bytes 4j..4j+3 of its 32 */
        for (int64_t b = 0; b + 1 < nb || (b < nb && nb % 2); b += 2) {
            const int lone = (b == nb - 1);
            const int8_t *base = q + b * QK;
            for (int j = 0; j < 8; j++) {
                int32_t s = 0;
                for (int t = 0; t < 4; t++) s += lone ? base[4 * j + t] : base[4 * j + t] + base[32 + 4 * j + t];
                corr[b * 4 + j] = 8 * s;
            }
        }
    }
}

#ifdef __AVX2__
/* ---- AVX2 ---- */
/* The weight rows of a later block of outputs (contiguous after this block's), fetched while this
 * block computes: one iteration consumes NW * 32 bytes of this block, so a sweep over it prefetches a
 * whole block — the next one for int8, the one after for int4 (half the bytes a block: the same
 * distance in bytes). Measured on the 0.5B model's GEMVs (2 threads, weights out of cache): without
 * it a thread's four interleaved row streams of ~1-5 KB read DRAM at about half the copy bandwidth
 * (int8 27.3 → 17.6 ms a step's GEMVs, int4 18.8 → 12.1 ms). Past the matrix end it is a no-op. */
#define PREFETCH_NEXT(next, off, NW) do {                                                   \
        if ((NW) == 4) {                                                                    \
            _mm_prefetch((const char *)(next) + (off), _MM_HINT_T0);                        \
            _mm_prefetch((const char *)(next) + (off) + 64, _MM_HINT_T0);                   \
        }                                                                                   \
    } while (0)

static inline __m256i dot_i8(__m256i xa, __m256i xq, __m256i w) {  /* 8 int32 lanes of sum(xq * w) */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, xq)), _mm256_set1_epi16(1));
}

static inline float hsum_ps(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* One activation row against NW (1..4) int8 weight rows. */
static inline __attribute__((always_inline)) void q8_int8_row(const int8_t *xq, const float *xd, const int8_t *w,
                                                               const float *scale, const float *bias, float *yr,
                                                               int64_t n0, int64_t k, const int NW) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const int64_t nb = k / QK;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const __m256i xa = _mm256_sign_epi8(xv, xv);
        const __m256 dv = _mm256_broadcast_ss(xd + b);
        PREFETCH_NEXT(w + (n0 + NW) * k, b * NW * QK, NW);
        for (int j = 0; j < NW; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (n0 + j) * k + b * QK));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8(xa, xv, wv)), dv, acc[j]);
        }
    }
    for (int j = 0; j < NW; j++) yr[n0 + j] = hsum_ps(acc[j]) * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
}

/* Two activation rows against four int8 weight rows: each weight vector loaded once for both rows
 * (more rows per call: prefill chunks and large decode batches). */
static inline __attribute__((always_inline)) void q8_int8_row2(const int8_t *xq0, const float *xd0, const int8_t *xq1,
                                                                const float *xd1, const int8_t *w, const float *scale,
                                                                const float *bias, float *y0, float *y1, int64_t n0,
                                                                int64_t k) {
    __m256 a0[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 a1[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const int64_t nb = k / QK;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xv0 = _mm256_loadu_si256((const __m256i *)(xq0 + b * QK)), xa0 = _mm256_sign_epi8(xv0, xv0);
        const __m256i xv1 = _mm256_loadu_si256((const __m256i *)(xq1 + b * QK)), xa1 = _mm256_sign_epi8(xv1, xv1);
        const __m256 d0 = _mm256_broadcast_ss(xd0 + b), d1 = _mm256_broadcast_ss(xd1 + b);
        for (int j = 0; j < 4; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (n0 + j) * k + b * QK));
            a0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8(xa0, xv0, wv)), d0, a0[j]);
            a1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8(xa1, xv1, wv)), d1, a1[j]);
        }
    }
    for (int j = 0; j < 4; j++) {
        y0[n0 + j] = hsum_ps(a0[j]) * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
        y1[n0 + j] = hsum_ps(a1[j]) * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

/* 8 int32 lanes of sum((q + 8) * xq) over 64 packed int4 weights (two blocks) and the permuted xq. */
static inline __m256i dot_u4_pair(const uint8_t *w, const int8_t *xq) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)w), _mm256_set1_epi8((char)0x88));
    const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),
                                       _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

static inline __m256i dot_u4_lone(const uint8_t *w, const int8_t *xq) {  /* one block: 16 bytes */
    const __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)w), _mm_set1_epi8((char)0x88));
    const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)xq)), _mm256_set1_epi16(1));
}

/* One activation row against NW (1..4) int4 weight rows. */
static inline __attribute__((always_inline)) void q8_int4_row(const int8_t *xq, const float *xd, const float *xd4,
                                                               const int32_t *corr, const uint8_t *w,
                                                               const float *scale, const float *bias, float *yr,
                                                               int64_t n0, int64_t k, int64_t group, const int NW) {
    const int64_t kb = k / 2, nb = k / QK, groups = k / group;
    __m256 t[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    if (group % (2 * QK) == 0) {  /* pairs of blocks inside a group: the group scale once per group */
        for (int64_t g = 0; g < groups; g++) {
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t i = g * group; i < (g + 1) * group; i += 2 * QK) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(corr + i / QK * 4));
                const __m256 dv = _mm256_loadu_ps(xd4 + i / QK * 4);
                PREFETCH_NEXT(w + (n0 + 2 * NW) * kb, i / 2 * NW, NW);
                for (int j = 0; j < NW; j++) {
                    const __m256i s = _mm256_sub_epi32(dot_u4_pair(w + (n0 + j) * kb + i / 2, xq + i), c);
                    a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dv, a[j]);
                }
            }
            for (int j = 0; j < NW; j++) t[j] = _mm256_fmadd_ps(a[j], _mm256_broadcast_ss(scale + (n0 + j) * groups + g), t[j]);
        }
    } else {  /* groups of an odd number of blocks: d times the group scale per block */
        const int64_t per_group = group / QK;  /* blocks per group (odd here) */
        int64_t b = 0, g0 = 0, in_g = 0;       /* block b is block in_g of group g0: no division per pair */
        for (; b + 2 <= nb; b += 2) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(corr + b * 4));
            const __m256 dv = _mm256_loadu_ps(xd4 + b * 4);
            const int64_t g1 = in_g + 1 < per_group ? g0 : g0 + 1;
            for (int j = 0; j < NW; j++) {
                const float *s = scale + (n0 + j) * groups;
                const __m256 sv = _mm256_set_m128(_mm_set1_ps(s[g1]), _mm_set1_ps(s[g0]));
                const __m256i p = _mm256_sub_epi32(dot_u4_pair(w + (n0 + j) * kb + b * QK / 2, xq + b * QK), c);
                t[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dv, sv), t[j]);
            }
            in_g += 2;
            while (in_g >= per_group) { in_g -= per_group; g0++; }  /* group 32: two groups a pair */
        }
        if (b < nb) {  /* a lone last block */
            const __m256i c = _mm256_loadu_si256((const __m256i *)(corr + b * 4));
            const int64_t g = g0;
            for (int j = 0; j < NW; j++) {
                const __m256i p = _mm256_sub_epi32(dot_u4_lone(w + (n0 + j) * kb + b * QK / 2, xq + b * QK), c);
                t[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(xd[b] * scale[(n0 + j) * groups + g]), t[j]);
            }
        }
    }
    for (int j = 0; j < NW; j++) yr[n0 + j] = hsum_ps(t[j]) + (bias ? bias[n0 + j] : 0.0f);
}

/* Two activation rows against four int4 weight rows, groups a multiple of 64 inputs: each packed
 * weight vector is loaded and split into nibbles once for both rows. */
static inline __attribute__((always_inline)) void q8_int4_row2(const int8_t *xq0, const float *xd40, const int32_t *corr0,
                                                                const int8_t *xq1, const float *xd41, const int32_t *corr1,
                                                                const uint8_t *w, const float *scale, const float *bias,
                                                                float *y0, float *y1, int64_t n0, int64_t k,
                                                                int64_t group) {
    const int64_t kb = k / 2, groups = k / group;
    const __m256i m = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x88), ones = _mm256_set1_epi16(1);
    __m256 t0[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 t1[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        __m256 a0[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 a1[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = g * group; i < (g + 1) * group; i += 2 * QK) {
            const __m256i e0 = _mm256_loadu_si256((const __m256i *)(xq0 + i)), o0 = _mm256_loadu_si256((const __m256i *)(xq0 + i + 32));
            const __m256i e1 = _mm256_loadu_si256((const __m256i *)(xq1 + i)), o1 = _mm256_loadu_si256((const __m256i *)(xq1 + i + 32));
            PREFETCH_NEXT(w + (n0 + 8) * kb, i / 2 * 4, 4);
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + (n0 + j) * kb + i / 2)), flip);
                const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
                const __m256i s0 = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, e0), _mm256_maddubs_epi16(hi, o0)), ones),
                    _mm256_loadu_si256((const __m256i *)(corr0 + i / QK * 4)));
                const __m256i s1 = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, e1), _mm256_maddubs_epi16(hi, o1)), ones),
                    _mm256_loadu_si256((const __m256i *)(corr1 + i / QK * 4)));
                a0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_loadu_ps(xd40 + i / QK * 4), a0[j]);
                a1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_loadu_ps(xd41 + i / QK * 4), a1[j]);
            }
        }
        for (int j = 0; j < 4; j++) {
            const __m256 sc = _mm256_broadcast_ss(scale + (n0 + j) * groups + g);
            t0[j] = _mm256_fmadd_ps(a0[j], sc, t0[j]);
            t1[j] = _mm256_fmadd_ps(a1[j], sc, t1[j]);
        }
    }
    for (int j = 0; j < 4; j++) {
        y0[n0 + j] = hsum_ps(t0[j]) + (bias ? bias[n0 + j] : 0.0f);
        y1[n0 + j] = hsum_ps(t1[j]) + (bias ? bias[n0 + j] : 0.0f);
    }
}

#else
/* ---- portable scalar C: the same integer dots and scale products (natural summation order) ---- */
static inline void q8_int8_row(const int8_t *xq, const float *xd, const int8_t *w, const float *scale,
                               const float *bias, float *yr, int64_t n0, int64_t k, const int NW) {
    for (int j = 0; j < NW; j++) {
        const int8_t *wr = w + (n0 + j) * k;
        float acc = 0.0f;
        for (int64_t b = 0; b < k / QK; b++) {
            int32_t s = 0;
            for (int i = 0; i < QK; i++) s += (int32_t)xq[b * QK + i] * wr[b * QK + i];
            acc += (float)s * xd[b];
        }
        yr[n0 + j] = acc * scale[n0 + j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

static inline void q8_int4_row(const int8_t *xq, const float *xd, const float *xd4, const int32_t *corr,
                               const uint8_t *w, const float *scale, const float *bias, float *yr, int64_t n0,
                               int64_t k, int64_t group, const int NW) {
    (void)xd4; (void)corr;
    const int64_t nb = k / QK, groups = k / group;
    for (int j = 0; j < NW; j++) {
        const uint8_t *wr = w + (n0 + j) * (k / 2);
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            /* xq is permuted: input i of block b sits where quantize_rows put it */
            const int lone = (b == nb - 1) && (nb % 2);
            const int8_t *base = xq + (lone ? b * QK : (b / 2) * 2 * QK);
            const int off = lone ? 0 : (int)(b % 2) * 16, half = lone ? 16 : 32;
            int32_t s = 0;
            for (int i = 0; i < QK; i++) {
                const int e = (int)(b * QK + i);
                const int nib = (wr[e / 2] >> (4 * (e % 2))) & 0xF;
                s += (int32_t)(nib - ((nib & 8) << 1)) * base[(i % 2) * half + off + i / 2];
            }
            acc += (float)s * (xd[b] * scale[(n0 + j) * groups + b * QK / group]);
        }
        yr[n0 + j] = acc + (bias ? bias[n0 + j] : 0.0f);
    }
}
#endif

/* y = x W^T + b with x quantised per block to int8; returns -1 when the scratch cannot be allocated. */
/* Rows of x per tile: a tile's quantised rows (x_tile_bytes of int8) stay in L2 while every weight
 * block passes over them. Without tiles a long prefill chunk re-read all of x from L3/DRAM for
 * every block of four weight rows (2048 rows x 4864 inputs = 10 MB per block). */
#ifndef X_TILE_BYTES
#define X_TILE_BYTES (128 * 1024)
#endif

static inline int64_t row_tile(int64_t k) {
    const int64_t t = (X_TILE_BYTES / k) & ~(int64_t)1;  /* even: the two-row kernels */
    return t < 2 ? 2 : t;
}

static inline void int8_a8_block(const act_buf *a, int64_t r0, int64_t r1, const int8_t *q, const float *scale,
                                 const float *bias, float *y, int64_t n0, int64_t n_out, int64_t k) {
    const int8_t *xq = a->q;
    const float *xd = a->d;
    const int64_t nb = k / QK;
    int64_t r = r0;
#ifdef __AVX2__
    if (n0 + 4 <= n_out)
        for (; r + 2 <= r1; r += 2)
            q8_int8_row2(xq + r * k, xd + r * nb, xq + (r + 1) * k, xd + (r + 1) * nb, q, scale, bias,
                         y + r * n_out, y + (r + 1) * n_out, n0, k);
#endif
    for (; r < r1; r++) {  /* the block's weights stay in L1/L2 across rows */
        if (n0 + 4 <= n_out) q8_int8_row(xq + r * k, xd + r * nb, q, scale, bias, y + r * n_out, n0, k, 4);
        else for (int64_t n = n0; n < n_out; n++) q8_int8_row(xq + r * k, xd + r * nb, q, scale, bias, y + r * n_out, n, k, 1);
    }
}

static inline void int4_a8_block(const act_buf *a, int64_t r0, int64_t r1, const uint8_t *q, const float *scale,
                                 const float *bias, float *y, int64_t n0, int64_t n_out, int64_t k, int64_t group) {
    const int64_t nb = k / QK;
    int64_t r = r0;
#ifdef __AVX2__
    if (n0 + 4 <= n_out && group % (2 * QK) == 0)
        for (; r + 2 <= r1; r += 2)
            q8_int4_row2(a->q + r * k, a->d4 + r * nb * 4, a->corr + r * (nb + 1) * 4,
                         a->q + (r + 1) * k, a->d4 + (r + 1) * nb * 4, a->corr + (r + 1) * (nb + 1) * 4,
                         q, scale, bias, y + r * n_out, y + (r + 1) * n_out, n0, k, group);
#endif
    for (; r < r1; r++) {
        const int8_t *xq = a->q + r * k;
        const float *xd = a->d + r * nb, *xd4 = a->d4 + r * nb * 4;
        const int32_t *corr = a->corr + r * (nb + 1) * 4;
        if (n0 + 4 <= n_out) q8_int4_row(xq, xd, xd4, corr, q, scale, bias, y + r * n_out, n0, k, group, 4);
        else for (int64_t n = n0; n < n_out; n++) q8_int4_row(xq, xd, xd4, corr, q, scale, bias, y + r * n_out, n, k, group, 1);
    }
}

/* y = x W^T + b with x quantised per block to int8; returns -1 when the scratch cannot be allocated.
 * Any number of rows: tiles of row_tile(k) rows, each tile's weight blocks split over the threads.
 * One body for both weight types (int4: group > 0), specialised by the compiler per caller. */
static inline __attribute__((always_inline)) int a8_gemm(const float *x, int64_t rows, const void *q,
                                                          const float *scale, const float *bias, float *y,
                                                          int64_t n_out, int64_t k, int64_t group, int int4,
                                                          int64_t threads) {
    act_buf *a = &tls_act;
    if (act_reserve(a, rows, k)) return -1;
    quantize_rows(x, rows, k, int4, a, threads);
    const int64_t blocks = (n_out + 3) / 4, tile = row_tile(k);
#pragma omp parallel num_threads(threads)
    for (int64_t r0 = 0; r0 < rows; r0 += tile) {
        const int64_t r1 = r0 + tile < rows ? r0 + tile : rows;
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            if (int4) int4_a8_block(a, r0, r1, (const uint8_t *)q, scale, bias, y, blk * 4, n_out, k, group);
            else int8_a8_block(a, r0, r1, (const int8_t *)q, scale, bias, y, blk * 4, n_out, k);
        }
    }
    return 0;
}

int trtforge_gemv_int8_a8(const float *x, int64_t rows, const int8_t *q, const float *scale, const float *bias,
                          float *y, int64_t n_out, int64_t k, int64_t threads) {
    return a8_gemm(x, rows, q, scale, bias, y, n_out, k, 0, 0, threads);
}

int trtforge_gemv_int4_a8(const float *x, int64_t rows, const uint8_t *q, const float *scale, const float *bias,
                          float *y, int64_t n_out, int64_t k, int64_t group, int64_t threads) {
    return a8_gemm(x, rows, q, scale, bias, y, n_out, k, group, 1, threads);
}

/* The activation quantisation alone (natural layout), for the tests: xq [rows, k], d [rows, k / 32]. */
void trtforge_quantize_activations(const float *x, int64_t rows, int64_t k, int8_t *xq, float *d) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < k / QK; b++) d[r * (k / QK) + b] = quant_block(x + r * k + b * QK, xq + r * k + b * QK);
}

/* ==== int8 weights x int8 activations on AVX-512 VNNI (batched decode and prefill) ================ *
 *
 * The AVX2 kernels above take 2 instructions (vpmaddubsw + vpmaddwd) per 32 multiply-adds and keep
 * the weights row-major, so a batched step is bound by their arithmetic (an int8 engine ran a
 * 64-request load slower than float32). Here one vpdpbusd does 64 u8 x s8 multiply-adds into 16
 * int32 lanes, on weights packed at load for it: panels of 16 output rows, per group of 4 inputs
 * the panel's 16 x 4 bytes (one 64-byte vector; zero rows pad the last panel). vpdpbusd takes
 * unsigned activations, so they are stored + 128 (xq ^ 0x80) and 128 * sum(q) over each block of
 * 32 inputs (packed beside the weights, `wsum`) is subtracted from the block's int32 dot: still
 * exact. A register tile is 8 rows x 16 outputs: 8 int32 block accumulators, 8 float
 * accumulators (+= dot * d per block), the row scale and bias once at the end. The panels are
 * split over the threads; rows in tiles of 8 reuse a panel from L2.
 *
 * trtforge_vnni() says whether this build has it (compiled for an AVX-512 VNNI CPU); without it
 * the functions exist but return -2 (the caller keeps the AVX2 kernels).
 */
#if defined(__AVX2__)
/* Also read by the AVX2 panel GEMM below (which ignores wsum). */
/* out [ceil(n/16)][k/4][16][4] int8, wsum [ceil(n/16)][k/32][16] int32 = 128 * block sums.
 * Written in order: per group of 4 inputs, 4 bytes from each of the panel's 16 rows. */
int trtforge_pack_int8_vnni(const int8_t *q, int64_t n, int64_t k, int8_t *out, int32_t *wsum, int64_t threads) {
    const int64_t panels = (n + 15) / 16, nb = k / QK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *rows[16];
        static const int8_t zeros[QK] = {0};
        for (int64_t j = 0; j < 16; j++) rows[j] = p * 16 + j < n ? q + (p * 16 + j) * k : 0;
        int8_t *o = out + p * k * 16;
        for (int64_t g = 0; g < k / 4; g++)
            for (int64_t j = 0; j < 16; j++) memcpy(o + (g * 16 + j) * 4, rows[j] ? rows[j] + g * 4 : zeros, 4);
        for (int64_t b = 0; b < nb; b++)
            for (int64_t j = 0; j < 16; j++) {
                int32_t sum = 0;
                if (rows[j])
                    for (int64_t i = 0; i < QK; i++) sum += rows[j][b * QK + i];
                wsum[(p * nb + b) * 16 + j] = 128 * sum;
            }
    }
    return 0;
}

#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define VNNI_MR 8

int trtforge_vnni(void) { return 1; }
int trtforge_int8_panels(void) { return 2; }

static inline __attribute__((always_inline)) void vnni_tile(const int mr, const uint8_t *xu, const float *xd,
                                                           int64_t k, const int8_t *wp, const int32_t *ws,
                                                           const float *scale, const float *bias, float *y,
                                                           int64_t ldy, int64_t n0, int64_t cols) {
    const int64_t nb = k / QK;
    __m512 f[VNNI_MR];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[VNNI_MR];
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int64_t g = 0; g < QK / 4; g++) {
            const __m512i w = _mm512_loadu_si512((const void *)(wp + (b * (QK / 4) + g) * 64));
#pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                int32_t x4;
                memcpy(&x4, xu + r * k + b * QK + g * 4, 4);
                acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(x4), w);
            }
        }
        const __m512i wsb = _mm512_loadu_si512((const void *)(ws + b * 16));
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++)
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], wsb)), _mm512_set1_ps(xd[r * nb + b]), f[r]);
    }
    const __mmask16 m = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
    const __m512 sc = _mm512_maskz_loadu_ps(m, scale + n0);
    const __m512 bi = bias ? _mm512_maskz_loadu_ps(m, bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(y + r * ldy + n0, m, _mm512_fmadd_ps(f[r], sc, bi));
}

static void vnni_rows(int mr, const uint8_t *xu, const float *xd, int64_t k, const int8_t *wp, const int32_t *ws,
                      const float *scale, const float *bias, float *y, int64_t ldy, int64_t n0, int64_t cols) {
    switch (mr) {
#define CASE(R) case R: vnni_tile(R, xu, xd, k, wp, ws, scale, bias, y, ldy, n0, cols); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    default: break;
    }
}

/* y = x W^T + b, x quantised per block like the kernels above; W packed by trtforge_pack_int8_vnni.
 * Returns -1 when the activation scratch cannot be allocated. */
int trtforge_gemm_int8_vnni(const float *x, int64_t rows, const int8_t *wp, const int32_t *wsum, const float *scale,
                            const float *bias, float *y, int64_t n, int64_t k, int64_t threads) {
    act_buf *a = &tls_act;
    if (act_reserve(a, rows, k)) return -1;
    quantize_rows(x, rows, k, 0, a, threads);
    uint8_t *xu = (uint8_t *)a->q;
    for (int64_t i = 0; i < rows * k; i++) xu[i] ^= 0x80; /* xq + 128, unsigned */
    const int64_t panels = (n + 15) / 16, nb = k / QK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * 16, cols = n - n0 < 16 ? n - n0 : 16;
        for (int64_t r0 = 0; r0 < rows; r0 += VNNI_MR) {
            const int mr = (int)(rows - r0 < VNNI_MR ? rows - r0 : VNNI_MR);
            vnni_rows(mr, xu + r0 * k, a->d + r0 * nb, k, wp + p * k * 16, wsum + p * nb * 16, scale, bias,
                      y + r0 * n, n, n0, cols);
        }
    }
    return 0;
}
#elif defined(__AVX2__)
/* ---- the same panels on AVX2 without VNNI ----
 * The row kernels above re-read each weight row for every pair of activation rows and pay a float
 * conversion per output, row and block; a batched step was bound by that (an int8 engine's 64-request
 * load ran slower than float32). Here one 32-byte vector holds a panel half's 8 outputs x 4 inputs, so
 * per activation row and group of 4 inputs: vpsignb (x's sign onto the weights, as dot_i8), vpmaddubsw
 * against |x| broadcast, vpmaddwd into 8 int32 lanes that are 8 outputs, vpaddd — 32 multiply-adds in
 * 4 instructions, with no horizontal sums; the block's int32 sums times d once per 8 outputs. The
 * integer dot is exact (pairs <= 2 * 127 * 127), so results equal the row kernels' up to float32
 * summation order. A register tile is AVX2_MR rows x 16 outputs; panels split over the threads. */
#define AVX2_MR 4

int trtforge_vnni(void) { return 0; }
int trtforge_int8_panels(void) { return 1; }

static inline __attribute__((always_inline)) void avx2_panel_tile(const int mr, const int8_t *xq, const uint8_t *xa,
                                                                 const float *xd, int64_t k, const int8_t *wp,
                                                                 const float *scale, const float *bias, float *y,
                                                                 int64_t ldy, int64_t n0, int64_t cols) {
    const int64_t nb = k / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 f[AVX2_MR][2];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i acc[AVX2_MR][2];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int64_t g = 0; g < QK / 4; g++) {
            const int8_t *w = wp + (b * (QK / 4) + g) * 64;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)w), w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                int32_t s4, a4;
                memcpy(&s4, xq + r * k + b * QK + g * 4, 4);
                memcpy(&a4, xa + r * k + b * QK + g * 4, 4);
                const __m256i xs = _mm256_set1_epi32(s4), xu = _mm256_set1_epi32(a4);
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xu, _mm256_sign_epi8(w0, xs)), ones));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xu, _mm256_sign_epi8(w1, xs)), ones));
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            const __m256 d = _mm256_broadcast_ss(xd + r * nb + b);
            f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][0]), d, f[r][0]);
            f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][1]), d, f[r][1]);
        }
    }
    float sc[16], bi[16];
    for (int64_t j = 0; j < 16; j++) {
        sc[j] = j < cols ? scale[n0 + j] : 0.0f;
        bi[j] = j < cols && bias ? bias[n0 + j] : 0.0f;
    }
    for (int r = 0; r < mr; r++) {
        float out[16];
        _mm256_storeu_ps(out, _mm256_fmadd_ps(f[r][0], _mm256_loadu_ps(sc), _mm256_loadu_ps(bi)));
        _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(f[r][1], _mm256_loadu_ps(sc + 8), _mm256_loadu_ps(bi + 8)));
        memcpy(y + r * ldy + n0, out, (size_t)cols * sizeof(float));
    }
}

static void avx2_panel_rows(int mr, const int8_t *xq, const uint8_t *xa, const float *xd, int64_t k, const int8_t *wp,
                            const float *scale, const float *bias, float *y, int64_t ldy, int64_t n0, int64_t cols) {
    switch (mr) {
#define CASE(R) case R: avx2_panel_tile(R, xq, xa, xd, k, wp, scale, bias, y, ldy, n0, cols); break;
    CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
    default: break;
    }
}

/* y = x W^T + b as the VNNI kernel computes it (wsum unused: the activations stay signed). */
int trtforge_gemm_int8_vnni(const float *x, int64_t rows, const int8_t *wp, const int32_t *wsum, const float *scale,
                            const float *bias, float *y, int64_t n, int64_t k, int64_t threads) {
    (void)wsum;
    act_buf *a = &tls_act;
    if (act_reserve(a, rows, k)) return -1;
    quantize_rows(x, rows, k, 0, a, threads);
    for (int64_t i = 0; i < rows * k; i += 32)  /* k is a multiple of 32 */
        _mm256_storeu_si256((__m256i *)(a->xa + i), _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(a->q + i))));
    const int64_t panels = (n + 15) / 16, nb = k / QK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * 16, cols = n - n0 < 16 ? n - n0 : 16;
        for (int64_t r0 = 0; r0 < rows; r0 += AVX2_MR) {
            const int mr = (int)(rows - r0 < AVX2_MR ? rows - r0 : AVX2_MR);
            avx2_panel_rows(mr, a->q + r0 * k, a->xa + r0 * k, a->d + r0 * nb, k, wp + p * k * 16, scale, bias,
                            y + r0 * n, n, n0, cols);
        }
    }
    return 0;
}
#else
int trtforge_vnni(void) { return 0; }
int trtforge_int8_panels(void) { return 0; }
int trtforge_pack_int8_vnni(const int8_t *q, int64_t n, int64_t k, int8_t *out, int32_t *wsum, int64_t threads) {
    (void)q; (void)n; (void)k; (void)out; (void)wsum; (void)threads;
    return -2;
}
int trtforge_gemm_int8_vnni(const float *x, int64_t rows, const int8_t *wp, const int32_t *wsum, const float *scale,
                            const float *bias, float *y, int64_t n, int64_t k, int64_t threads) {
    (void)x; (void)rows; (void)wp; (void)wsum; (void)scale; (void)bias; (void)y; (void)n; (void)k; (void)threads;
    return -2;
}
#endif

/* ---- pre-quantized checkpoints' extras around the kernels above (quant_linear.py: the references) ------
 *
 * The kernels compute x·(q·s)ᵀ on a layer's codes; a pre-quantized layer with zero points (w = (q - z)·s)
 * then takes off Σ_g (s·z)[n, g] · Σ_{i in group g} x[r, i] (`zero_point_correction`), and an act-order
 * one first gathers its input x[r, perm[j]] into the weight columns' order (`gather_columns`). */

/* out[r, j] = x[r, perm[j]] (x and out [rows, k], distinct). */
void trtforge_gather_columns(const float *x, int64_t rows, int64_t k, const int64_t *perm, float *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++) out[r * k + j] = x[r * k + perm[j]];
}

/* y[r, n] -= Σ_g zs_t[g, n] · Σ_{i in group g} x[r, i], x [rows, k] (k / groups a multiple of 8), zs_t the
 * scale · zero products transposed, [groups, n_out] (contiguous over n: eight outputs per vector).
 * Returns -1 when the group sums' scratch cannot be allocated, else 0. */
int trtforge_zero_point_correction(const float *x, int64_t rows, int64_t k, int64_t groups, const float *zs_t,
                                   float *y, int64_t n_out, int64_t threads) {
    const int64_t group = k / groups;
    float *gs = malloc((size_t)(rows * groups) * sizeof(float));
    if (!gs) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *p = x + r * k + g * group;
            v8f acc = v8_splat(0.0f);
            for (int64_t i = 0; i < group; i += 8) acc += v8_load(p + i);
            gs[r * groups + g] = v8_sum(acc);
        }
    const int64_t vec = n_out / 8, blocks = (vec + 3) / 4;  /* blocks of four vectors: each group sum splat once */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n_out * groups >= 1 << 16)
    for (int64_t b = 0; b <= blocks; b++) {
        if (b == blocks) {  /* the last n_out % 8 outputs */
            for (int64_t n = vec * 8; n < n_out; n++)
                for (int64_t r = 0; r < rows; r++) {
                    float acc = 0.0f;
                    for (int64_t g = 0; g < groups; g++) acc += gs[r * groups + g] * zs_t[g * n_out + n];
                    y[r * n_out + n] -= acc;
                }
            continue;
        }
        const int64_t n0 = b * 32, nv = vec - b * 4 < 4 ? vec - b * 4 : 4;
        for (int64_t r = 0; r < rows; r++) {
            const float *s = gs + r * groups;
            float *out = y + r * n_out + n0;
            if (nv == 4) {
                v8f a0 = v8_splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t g = 0; g < groups; g++) {
                    const v8f sg = v8_splat(s[g]);
                    const float *z = zs_t + g * n_out + n0;
                    a0 += sg * v8_load(z), a1 += sg * v8_load(z + 8), a2 += sg * v8_load(z + 16);
                    a3 += sg * v8_load(z + 24);
                }
                v8_store(out, v8_load(out) - a0), v8_store(out + 8, v8_load(out + 8) - a1);
                v8_store(out + 16, v8_load(out + 16) - a2), v8_store(out + 24, v8_load(out + 24) - a3);
            } else {
                for (int64_t j = 0; j < nv * 8; j += 8) {
                    v8f acc = v8_splat(0.0f);
                    for (int64_t g = 0; g < groups; g++) acc += v8_splat(s[g]) * v8_load(zs_t + g * n_out + n0 + j);
                    v8_store(out + j, v8_load(out + j) - acc);
                }
            }
        }
    }
    free(gs);
    return 0;
}
