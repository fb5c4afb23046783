/* y[m, n] = x[m, :] . W[n, :] + b[n] for up to a few dozen rows m (decode batches), float32,
 * W dense row-major [N, K].
 *
 * A decode step's linear layers mostly stream their weights, and oneDNN's kernel for a handful of
 * rows reads them more than once (linear.py has the numbers). Here output rows are split evenly
 * between the OpenMP threads (each streams one contiguous share of W) in blocks of four weight
 * rows; each block is read from memory once and multiplied with three rows of x at a time: twelve
 * independent accumulators, so the FMAs never wait on each other and each loaded weight vector
 * serves three rows. OpenMP here is the runtime torch already loaded (same libgomp.so.1), so these
 * regions share torch's thread pool rather than adding one. Built with -ffp-contract=fast: the
 * multiply-adds fuse into FMAs (one rounding instead of two; 25 % faster at 16-32 rows).
 *
 * K must be a multiple of 8 (the caller checks); bias may be NULL.
 */
#include "native_vec.h"

static inline float finish(v8f acc, const float *bias, int64_t n) {
    return v8_sum(acc) + (bias ? bias[n] : 0.0f);
}

/* Rows r0.. r0+2 of x against weight rows n0..n0+3. */
static inline void tile3x4(const float *x, const float *w, const float *bias, float *y, int64_t r0,
                           int64_t n0, int64_t n_out, int64_t k) {
    const float *w0 = w + n0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    const float *x0 = x + r0 * k, *x1 = x0 + k, *x2 = x1 + k;
    v8f a00 = v8_splat(0.0f), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
        a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t i = 0; i < k; i += 8) {
        const v8f b0 = v8_load(w0 + i), b1 = v8_load(w1 + i), b2 = v8_load(w2 + i), b3 = v8_load(w3 + i);
        TILE_3X4_FMA(x0, x1, x2, i, b0, b1, b2, b3);
    }
    float *y0 = y + r0 * n_out + n0, *y1 = y0 + n_out, *y2 = y1 + n_out;
    y0[0] = finish(a00, bias, n0); y0[1] = finish(a01, bias, n0 + 1); y0[2] = finish(a02, bias, n0 + 2); y0[3] = finish(a03, bias, n0 + 3);
    y1[0] = finish(a10, bias, n0); y1[1] = finish(a11, bias, n0 + 1); y1[2] = finish(a12, bias, n0 + 2); y1[3] = finish(a13, bias, n0 + 3);
    y2[0] = finish(a20, bias, n0); y2[1] = finish(a21, bias, n0 + 1); y2[2] = finish(a22, bias, n0 + 2); y2[3] = finish(a23, bias, n0 + 3);
}

/* One row r of x against weight rows n0..n0+3. */
static inline void tile1x4(const float *x, const float *w, const float *bias, float *y, int64_t r,
                           int64_t n0, int64_t n_out, int64_t k) {
    const float *w0 = w + n0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k, *xr = x + r * k;
    v8f a0 = v8_splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < k; i += 8) {
        const v8f xv = v8_load(xr + i);
        a0 += xv * v8_load(w0 + i);
        a1 += xv * v8_load(w1 + i);
        a2 += xv * v8_load(w2 + i);
        a3 += xv * v8_load(w3 + i);
    }
    float *yr = y + r * n_out + n0;
    yr[0] = finish(a0, bias, n0); yr[1] = finish(a1, bias, n0 + 1); yr[2] = finish(a2, bias, n0 + 2); yr[3] = finish(a3, bias, n0 + 3);
}

void trtforge_gemv(const float *x, int64_t rows, const float *w, const float *bias, float *y,
                   int64_t n_out, int64_t k, int64_t threads) {
    const int64_t blocks = (n_out + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * 4;
        if (n0 + 4 <= n_out) {
            int64_t r = 0;
            for (; r + 3 <= rows; r += 3) tile3x4(x, w, bias, y, r, n0, n_out, k);
            for (; r < rows; r++) tile1x4(x, w, bias, y, r, n0, n_out, k);
        } else { /* the last 1-3 weight rows */
            for (int64_t n = n0; n < n_out; n++)
                for (int64_t r = 0; r < rows; r++) {
                    v8f acc = v8_splat(0.0f);
                    for (int64_t i = 0; i < k; i += 8) acc += v8_load(x + r * k + i) * v8_load(w + n * k + i);
                    y[r * n_out + n] = finish(acc, bias, n);
                }
        }
    }
}
