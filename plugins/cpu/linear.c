/* y[m, n] = x[m, :] . W[n, :] + b[n], float32, any number of rows m, W pre-packed at load.
 *
 * Why packed: the dot-product GEMV this replaces (one weight row against a few x rows, horizontal
 * sums at the end) re-read its weights once per three x rows and spent its time on loads, so a
 * 16-row decode step ran at ~40 GFLOP/s. Here W is stored once, at engine load, as panels of
 * PANEL (16) output features, k-major: P[p][i][j] = W[16p + j][i] (zero rows pad the last panel
 * pair). A register tile of MR x rows x TN = NP panels' columns keeps MR * TN accumulators; each
 * step i loads TN weights (contiguous, one or two cache lines) and broadcasts MR x values, so each
 * loaded weight vector serves MR rows and the FMAs of the tile are all independent:
 *
 *     ISA (compile flags)   vector   MR x TN   accumulators   loads per FMA
 *     AVX-512               16 lanes  8 x 32    16 zmm         (2 + 8) / 16
 *     AVX2 / AVX            8 lanes   6 x 16    12 ymm         (2 + 6) / 12
 *     portable              8 lanes   2 x 16    4 (8 xmm)      (2 + 2) / 4
 *
 * Blocking: up to DIRECT_ROWS rows (small decode batches, bound by memory) each tile streams its
 * panels over all of K (long sequential reads that the prefetchers follow). More rows go
 * GotoBLAS' way: chunks of MC rows, K in chunks of KC; the KC x TN weight slice a tile reads
 * (32 KB on AVX-512) stays in L1 for the chunk's row tiles while their KC x values (<= 96 KB)
 * stay in L2. Either way each weight byte comes from memory once per MC rows: once per decode
 * step up to MC rows. (Measured, one thread, [64 x 4864] x [4864 x 896]: 125 GFLOP/s K-blocked,
 * 71 streaming whole panels from L2; a 12-row tile (24 accumulators) ran slower than 8 rows.)
 * Threads split the panel pairs (static schedule: a thread keeps the same columns through every
 * K chunk, so the partial sums it stores in y between chunks are its own). OpenMP is the runtime
 * torch loaded (libgomp.so.1): these regions share torch's thread pool.
 *
 * The packed layout does not depend on the ISA (every variant reads 16-float panels, AVX-512 two
 * at a time), so an engine packed once runs under any forced ISA. Built with -ffp-contract=fast
 * (multiply-adds fused into FMAs: one rounding, not two); results differ from F.linear only in
 * summation order.
 */
#include <stdint.h>
#include <string.h>

#define PANEL 16 /* output features per packed panel */
#define PAIR 32  /* panels come in pairs: the packed layout pads N to a multiple of this */
#define KC 256

#if defined(__AVX512F__)
#define VL 16
#define MR 8
#define NP 2
#elif defined(__AVX__)
#define VL 8
#define MR 6
#define NP 1
#else
#define VL 8
#define MR 2
#define NP 1
#endif
#define PV (PANEL / VL) /* vectors per panel row */
#define NV (NP * PV)    /* vectors across a tile's columns */
#define TN (NP * PANEL) /* columns of a tile */
#define MC (MR * 12)    /* rows per chunk: 96 on AVX-512, 72 on AVX2 */
#define DIRECT_ROWS 8 /* up to this many rows: no K blocking (see above) */

typedef float vf __attribute__((vector_size(VL * 4)));

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
/* x[0] in every lane, as a broadcast load (`(vf){0} + s` would cost an add and a shuffle-port uop) */
#if VL == 16
#define SPLAT(s) ((vf){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s})
#else
#define SPLAT(s) ((vf){s, s, s, s, s, s, s, s})
#endif

/* The tile: rows x[0..mr) (row stride ldx) times the NP panels at wp (panel stride ps floats),
 * K steps 0..kc. first: start from bias (TN values, or NULL for zeros), else add to y. */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx,
                                                      const float *wp, int64_t ps, int64_t kc, float *y,
                                                      int64_t ldy, const float *bias, int first) {
    vf acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            acc[r][v] = first ? (bias ? vload(bias + v * VL) : (vf){0}) : vload(y + r * ldy + v * VL);
    for (int64_t i = 0; i < kc; i++) {
        vf b[NV];
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
#pragma GCC unroll 4
            for (int q = 0; q < PV; q++) b[p * PV + q] = vload(wp + p * ps + i * PANEL + q * VL);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const float s = x[r * ldx + i];
            const vf a = SPLAT(s);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[r][v] += a * b[v];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) vstore(y + r * ldy + v * VL, acc[r][v]);
}

/* mr as a compile-time constant in each case: the accumulators stay in registers. */
static void tile_rows(int mr, const float *x, int64_t ldx, const float *wp, int64_t ps, int64_t kc, float *y,
                      int64_t ldy, const float *bias, int first) {
    switch (mr) {
#define CASE(R) case R: tile(R, x, ldx, wp, ps, kc, y, ldy, bias, first); break;
    CASE(1) CASE(2)
#if MR > 2
    CASE(3) CASE(4) CASE(5) CASE(6)
#endif
#if MR > 6
    CASE(7) CASE(8)
#endif
#undef CASE
    default: break;
    }
}

/* The tile at columns n0.. of y (cols of them valid; TN or fewer at the end of N). */
static void tile_at(int mr, const float *x, int64_t ldx, const float *wp, int64_t ps, int64_t kc, float *y,
                    int64_t ldy, const float *bias, int first, int64_t n0, int64_t cols) {
    if (cols == TN) {
        tile_rows(mr, x, ldx, wp, ps, kc, y + n0, ldy, bias ? bias + n0 : 0, first);
        return;
    }
    float t[MR * TN]; /* the last, partial tile: through a full-width scratch tile */
    for (int r = 0; r < mr; r++)
        for (int64_t c = 0; c < TN; c++)
            t[r * TN + c] = c >= cols ? 0.0f : first ? (bias ? bias[n0 + c] : 0.0f) : y[r * ldy + n0 + c];
    tile_rows(mr, x, ldx, wp, ps, kc, t, TN, 0, 0);
    for (int r = 0; r < mr; r++) memcpy(y + r * ldy + n0, t + r * TN, (size_t)cols * sizeof(float));
}

int64_t trtforge_packed_panels(int64_t n) { return (n + PAIR - 1) / PAIR * (PAIR / PANEL); }

void trtforge_packed_linear(const float *x, int64_t m, const float *wp, const float *bias, float *y,
                            int64_t n, int64_t k, int64_t threads) {
    const int64_t tiles = (n + TN - 1) / TN, ps = k * PANEL;
    /* One chunk of rows (decode): no K blocking, so each tile streams its panels whole (long
     * sequential reads the prefetchers follow; the panels stay in L2 for the next row tile). */
    const int64_t kb = m <= DIRECT_ROWS ? k : KC;
#pragma omp parallel num_threads(threads)
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t mc = m - m0 < MC ? m - m0 : MC;
        for (int64_t k0 = 0; k0 < k; k0 += kb) {
            const int64_t kc = k - k0 < kb ? k - k0 : kb;
#pragma omp for schedule(static) nowait
            for (int64_t g = 0; g < tiles; g++) {
                const int64_t n0 = g * TN, cols = n - n0 < TN ? n - n0 : TN;
                const float *w = wp + g * NP * ps + k0 * PANEL;
                for (int64_t r0 = m0; r0 < m0 + mc; r0 += MR) {
                    const int mr = (int)(m0 + mc - r0 < MR ? m0 + mc - r0 : MR);
                    tile_at(mr, x + r0 * k + k0, k, w, ps, kc, y + r0 * n, n, bias, k0 == 0, n0, cols);
                }
            }
        }
    }
}

/* out = W [n, k] packed: trtforge_packed_panels(n) panels of k x 16 floats (zeros past row n).
 * Written in order (16 floats per k step, read from the panel's 16 rows, each read sequentially). */
void trtforge_pack_linear(const float *w, int64_t n, int64_t k, float *out, int64_t threads) {
    const int64_t panels = trtforge_packed_panels(n);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        float *o = out + p * k * PANEL;
        const float *rows[PANEL];
        int64_t valid = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        if (valid < 0) valid = 0;
        for (int64_t j = 0; j < PANEL; j++) rows[j] = j < valid ? w + (p * PANEL + j) * k : 0;
        if (valid == PANEL) {
            for (int64_t i = 0; i < k; i++)
#pragma GCC unroll 16
                for (int64_t j = 0; j < PANEL; j++) o[i * PANEL + j] = rows[j][i];
        } else {
            for (int64_t i = 0; i < k; i++)
                for (int64_t j = 0; j < PANEL; j++) o[i * PANEL + j] = j < valid ? rows[j][i] : 0.0f;
        }
    }
}

/* out[t] = W[ids[t]] (rows of the unpacked weight, k floats each), for an embedding table stored
 * packed as its tied LM head; 1 when an id is outside [0, n). */
int trtforge_packed_rows(const float *wp, int64_t n, int64_t k, const int64_t *ids, int64_t count, float *out) {
    for (int64_t t = 0; t < count; t++)
        if (ids[t] < 0 || ids[t] >= n) return 1;
    for (int64_t t = 0; t < count; t++) {
        const float *src = wp + (ids[t] / PANEL) * k * PANEL + ids[t] % PANEL;
        float *dst = out + t * k;
        for (int64_t i = 0; i < k; i++) dst[i] = src[i * PANEL];
    }
    return 0;
}
