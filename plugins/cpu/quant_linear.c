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
 * Prefill (more rows): trtforge_dequant_* write the float32 weights once for a dense GEMM.
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
