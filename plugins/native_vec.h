/* 8-lane float vectors for trtforge's CPU kernels (GCC/Clang vector extensions: AVX/AVX2 on
 * x86-64 with -march=native, two NEON registers on ARM, plain loops elsewhere), and the few
 * helpers the kernels share. No -ffast-math: every operation is IEEE float32.
 */
#ifndef TRTFORGE_NATIVE_VEC_H
#define TRTFORGE_NATIVE_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f v8_load(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void v8_store(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline v8f v8_splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* Lanes where mask is all ones take a, others b. */
static inline v8f v8_select(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

static inline float v8_sum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* exp(x) lane-wise, Cephes' single-precision algorithm (relative error ~2e-7): x = n ln2 + r,
 * exp(r) by a degree-6 polynomial, 2^n through the exponent bits. NaN stays NaN; inputs are
 * clamped to [-87.3, 88.37], so exp(-inf) gives ~1e-38 rather than 0 (harmless next to softmax
 * sums of at least 1 and silu's 1 + exp(-x)). */
static inline v8f v8_exp(v8f x) {
    x = v8_select(x > v8_splat(88.3762626647949f), v8_splat(88.3762626647949f), x);
    x = v8_select(x < v8_splat(-87.3365478515625f), v8_splat(-87.3365478515625f), x);
    v8f fx = x * 1.44269504088896341f + 0.5f;
    v8f tr = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8f); /* toward zero */
    fx = v8_select(tr > fx, tr - 1.0f, tr);                                   /* floor */
    x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
    v8f y = v8_splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    v8i n = (__builtin_convertvector(fx, v8i) + 127) << 23;
    return y * (v8f)n;
}

/* 16-lane twins of the above for the AVX-512 kernels (one zmm register under AVX-512F; GCC splits
 * them into two ymm / four xmm registers elsewhere, so they also compile, slower, on the other
 * paths). Same IEEE operations, lane for lane. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f v16_load(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void v16_store(float *p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16f v16_splat(float x) { return (v16f){0} + x; }
static inline v16f v16_select(v16i mask, v16f a, v16f b) { return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask)); }

static inline float v16_sum(v16f v) {
    v8f lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return v8_sum(lo + hi);
}

/* v8_exp's algorithm on 16 lanes (the same constants and steps, so the same results lane for lane). */
static inline v16f v16_exp(v16f x) {
    x = v16_select(x > v16_splat(88.3762626647949f), v16_splat(88.3762626647949f), x);
    x = v16_select(x < v16_splat(-87.3365478515625f), v16_splat(-87.3365478515625f), x);
    v16f fx = x * 1.44269504088896341f + 0.5f;
    v16f tr = __builtin_convertvector(__builtin_convertvector(fx, v16i), v16f); /* toward zero */
    fx = v16_select(tr > fx, tr - 1.0f, tr);                                     /* floor */
    x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
    v16f y = v16_splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    v16i n = (__builtin_convertvector(fx, v16i) + 127) << 23;
    return y * (v16f)n;
}

/* The inner step of a GEMV register tile of 3 rows x 4 weight rows: accumulators a00..a23 (row r,
 * weight row c) += x_r[i..i+8) * b_c. A macro, not a function, so the twelve accumulators stay in
 * registers whatever the compiler decides about inlining; shared by the float32 and quantized GEMVs,
 * which differ only in how b0..b3 are loaded. */
#define TILE_3X4_FMA(x0, x1, x2, i, b0, b1, b2, b3) do {                 \
        v8f a_ = v8_load((x0) + (i));                                        \
        a00 += a_ * (b0); a01 += a_ * (b1); a02 += a_ * (b2); a03 += a_ * (b3); \
        a_ = v8_load((x1) + (i));                                            \
        a10 += a_ * (b0); a11 += a_ * (b1); a12 += a_ * (b2); a13 += a_ * (b3); \
        a_ = v8_load((x2) + (i));                                            \
        a20 += a_ * (b0); a21 += a_ * (b1); a22 += a_ * (b2); a23 += a_ * (b3); \
    } while (0)

#endif
