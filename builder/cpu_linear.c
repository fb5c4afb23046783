/* y[m, n] = x[m, :] . W[n, :] + b[n] for a few rows m (decode), float32, W dense row-major [N, K].
 *
 * A decode step's linear layers only stream their weights: one row of x meets each weight once, so
 * the work is reading W at memory speed. Output rows are split evenly between the OpenMP threads
 * (each streams one contiguous half of W); each thread takes four weight rows at a time and keeps
 * four independent dot products, so the additions do not wait on each other. With up to 4 rows of
 * x, every row reuses the four weight rows from the cache. OpenMP here is the runtime torch already
 * loaded (same libgomp.so.1), so these regions share torch's thread pool rather than adding one.
 *
 * K must be a multiple of 8 (the caller checks); bias may be NULL.
 */
#include "native_vec.h"

static inline float finish(v8f acc, const float *bias, int64_t n) {
    return v8_sum(acc) + (bias ? bias[n] : 0.0f);
}

void trtforge_gemv(const float *x, int64_t rows, const float *w, const float *bias, float *y,
                   int64_t n_out, int64_t k, int64_t threads) {
    const int64_t blocks = (n_out + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * 4;
        if (n0 + 4 <= n_out) {
            const float *w0 = w + n0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = x + r * k;
                v8f a0 = v8_splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t i = 0; i < k; i += 8) {
                    const v8f xv = v8_load(xr + i);
                    a0 += xv * v8_load(w0 + i);
                    a1 += xv * v8_load(w1 + i);
                    a2 += xv * v8_load(w2 + i);
                    a3 += xv * v8_load(w3 + i);
                }
                float *yr = y + r * n_out + n0;
                yr[0] = finish(a0, bias, n0);
                yr[1] = finish(a1, bias, n0 + 1);
                yr[2] = finish(a2, bias, n0 + 2);
                yr[3] = finish(a3, bias, n0 + 3);
            }
        } else {
            for (int64_t n = n0; n < n_out; n++)
                for (int64_t r = 0; r < rows; r++) {
                    v8f acc = v8_splat(0.0f);
                    for (int64_t i = 0; i < k; i += 8) acc += v8_load(x + r * k + i) * v8_load(w + n * k + i);
                    y[r * n_out + n] = finish(acc, bias, n);
                }
        }
    }
}
