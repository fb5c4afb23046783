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
 * panels over all of K (long sequential reads that the prefetchers follow), threads splitting
 * the tiles evenly. More rows go GotoBLAS' way, in work units of (a chunk of <= MC rows, a block
 * of <= NB tiles) over all of K, in K blocks of <= KC steps: the KC x TN weight slice of a tile
 * (16 KB on AVX-512) stays in L1 for the chunk's row tiles, the chunk's KC x values (<= 48 KB)
 * and the unit's partial sums (MC x NB * TN: <= 192 KB) stay in L2, so the partial sums stored
 * in y between K blocks never go to memory, however wide N is (the old loop order swept all of
 * a thread's N per K block: 96 rows of the 9728-wide gate+up or the LM head spilled out of L2,
 * ~155 GFLOP/s instead of ~230). Chunks, K blocks and row tiles are cut into near-equal parts
 * (`split`: 128 rows run as 2 x 64, 17 rows as 6 + 6 + 5, K = 896 as 7 x 128), so no part is a
 * thin remainder. Each weight byte still comes from memory once per chunk, and each row tile of
 * a tile prefetches a share of the next tile's slice into L2 as it runs, so that slice arrives
 * spread over the whole tile rather than in one burst when the next starts (down_proj, 4864 x
 * 896, one thread: +15%). Units go to whichever thread is free (schedule(dynamic), at least
 * UNITS_PER_THREAD per thread, a unit's columns a whole number of tiles, i.e. 128-byte lines of
 * y): on a machine shared with other work one thread often runs slower, and a static split
 * waits for it. OpenMP is the runtime torch loaded (libgomp.so.1): these regions share torch's
 * thread pool.
 *
 * Measured (2-vCPU Sapphire-Rapids-class Xeon shared with other work, 2 threads, GFLOP/s, best
 * of 5 alternating with oneDNN's `_linear_pointwise`; scripts/bench_linear.py):
 *
 *     m rows            16         64        256        2048      (packed / oneDNN; before)
 *     qkv  896x1152     149/70     185/155   193/192    196/197   (before: 129, 180, 179, 175)
 *     o    896x896      179/92     171/130   176/181    179/189   (162, 148, 172, 175)
 *     gate+up 896x9728  165/97     196/177   201/214    184/160   (146, 178, 160, 137)
 *     down 4864x896     159/98     203/173   188/194    191/193   (150, 185, 168, 171)
 *     LM head 896x151936 169/97    211/148   193/165    247/195   (116, 156, 145, 172)
 *
 * 1-8 rows: 1.1-3.7x oneDNN, the same code as before (bound by memory). The two vCPUs' FMA peak measured
 * ~240-330 GFLOP/s there depending on the neighbours' load, so these numbers vary by +-10%
 * between runs; compare columns of one run.
 *
 * Tried and dropped: a 12 x 32 tile (24 accumulators) with the chunk's x packed into a
 * contiguous interleaved buffer (GotoBLAS' packed A): the kernel alone is no faster than 8 x 32
 * in L1 (both at the FMA peak), and packing cost ~7% at N = 896; x-stationary order (a row
 * tile's x in L1, the weights streamed from L2 per row tile): 5-10% slower; KC = 256: no
 * better overall, worse for 2048 x 4864 x 896.
 *
 * The packed layout does not depend on the ISA (every variant reads 16-float panels, AVX-512 two
 * at a time), so an engine packed once runs under any forced ISA. Built with -ffp-contract=fast
 * (multiply-adds fused into FMAs: one rounding, not two); results differ from F.linear only in
 * summation order.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16 /* output features per packed panel */
#define PAIR 32  /* panels come in pairs: the packed layout pads N to a multiple of this */

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
#define DIRECT_ROWS 8   /* up to this many rows: no K blocking (see above) */

#define KC 128         /* K steps per block (balanced: K = 896 runs 7 x 128, 4864 runs 38 x 128) */
#define MC (12 * MR)    /* rows per chunk (balanced: 128 rows run 2 x 64): 96 on AVX-512, 72 on AVX2 */
#define NB 16           /* tiles per column block: 512 columns on AVX-512 */
#define UNITS_PER_THREAD 4

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
 * K steps 0..kc. first: start from bias (TN values, or NULL for zeros), else add to y. During its
 * first npf steps it also prefetches (into L2) one line per panel of the slice at pf, one K step
 * each: the weights the next tile will read (see the blocking notes above). */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t ldx,
                                                      const float *wp, int64_t ps, int64_t kc, float *y,
                                                      int64_t ldy, const float *bias, int first,
                                                      const float *pf, int64_t npf) {
    vf acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            acc[r][v] = first ? (bias ? vload(bias + v * VL) : (vf){0}) : vload(y + r * ldy + v * VL);
#define STEP(i)                                                                                   \
    do {                                                                                          \
        vf b[NV];                                                                                 \
        _Pragma("GCC unroll 4") for (int p = 0; p < NP; p++)                                      \
        _Pragma("GCC unroll 4") for (int q = 0; q < PV; q++)                                      \
            b[p * PV + q] = vload(wp + p * ps + (i) * PANEL + q * VL);                            \
        _Pragma("GCC unroll 8") for (int r = 0; r < mr; r++) {                                    \
            const float s = x[r * ldx + (i)];                                                     \
            const vf a = SPLAT(s);                                                                \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] += a * b[v];           \
        }                                                                                         \
    } while (0)
    int64_t i = 0;
    for (; i < npf; i++) {
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) __builtin_prefetch(pf + p * ps + i * PANEL, 0, 2);
        STEP(i);
    }
    for (; i < kc; i++) STEP(i);
#undef STEP
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) vstore(y + r * ldy + v * VL, acc[r][v]);
}

/* mr as a compile-time constant in each case: the accumulators stay in registers. */
static void tile_rows(int mr, const float *x, int64_t ldx, const float *wp, int64_t ps, int64_t kc, float *y,
                      int64_t ldy, const float *bias, int first, const float *pf, int64_t npf) {
    switch (mr) {
#define CASE(R) case R: tile(R, x, ldx, wp, ps, kc, y, ldy, bias, first, pf, npf); break;
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
                    int64_t ldy, const float *bias, int first, int64_t n0, int64_t cols, const float *pf,
                    int64_t npf) {
    if (cols == TN) {
        tile_rows(mr, x, ldx, wp, ps, kc, y + n0, ldy, bias ? bias + n0 : 0, first, pf, npf);
        return;
    }
    float t[MR * TN]; /* the last, partial tile: through a full-width scratch tile */
    for (int r = 0; r < mr; r++)
        for (int64_t c = 0; c < TN; c++)
            t[r * TN + c] = c >= cols ? 0.0f : first ? (bias ? bias[n0 + c] : 0.0f) : y[r * ldy + n0 + c];
    tile_rows(mr, x, ldx, wp, ps, kc, t, TN, 0, 0, pf, npf);
    for (int r = 0; r < mr; r++) memcpy(y + r * ldy + n0, t + r * TN, (size_t)cols * sizeof(float));
}

/* [*lo, *hi): part i of 0..total cut into `parts` parts whose sizes differ by at most one. */
static inline void split(int64_t total, int64_t parts, int64_t i, int64_t *lo, int64_t *hi) {
    const int64_t base = total / parts, extra = total % parts;
    *lo = i * base + (i < extra ? i : extra);
    *hi = *lo + base + (i < extra);
}

#define CEIL(a, b) (((a) + (b) - 1) / (b))

int64_t trtforge_packed_panels(int64_t n) { return CEIL(n, PAIR) * (PAIR / PANEL); }

/* A few rows (decode, m <= DIRECT_ROWS), tiles g0..g1: each tile streams its panels over all of K. */
static void linear_direct(const float *x, int64_t m, const float *wp, const float *bias, float *y, int64_t n,
                          int64_t k, int64_t g0, int64_t g1) {
    const int64_t ps = k * PANEL, tiles = CEIL(m, MR);
    for (int64_t g = g0; g < g1; g++)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t r0, r1;
            split(m, tiles, t, &r0, &r1);
            tile_at((int)(r1 - r0), x + r0 * k, k, wp + g * NP * ps, ps, k, y + r0 * n, n, bias, 1, g * TN,
                    n - g * TN < TN ? n - g * TN : TN, 0, 0);
        }
}

/* Rows m0..m1 (one chunk, <= MC) against tiles b0..b1 (one column block), over all of K: K
 * blocks of <= KC steps; in each, every tile of the block against every row tile of the chunk
 * (the tile's KC x TN weights in L1, the chunk's x block and the block's partial sums in L2).
 * While a tile runs its row tiles they prefetch the next tile's weight slice into L2, a share
 * each, so the slice that comes from memory arrives spread over the whole tile, not in a burst
 * at the start of the next. */
static void linear_block(const float *x, int64_t m0, int64_t m1, const float *wp, const float *bias, float *y,
                         int64_t n, int64_t k, int64_t b0, int64_t b1) {
    const int64_t ps = k * PANEL, kblocks = CEIL(k, KC), tiles = CEIL(m1 - m0, MR);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        int64_t k0, k1;
        split(k, kblocks, kb, &k0, &k1);
        for (int64_t g = b0; g < b1; g++) {
            /* the slice after this one: the next tile, else the block's first at the next K block */
            int64_t pg = g + 1, pk0 = k0, pk1 = k1;
            if (pg == b1) pg = b0, split(k, kblocks, kb + 1, &pk0, &pk1);
            const int prefetch = pg < b1 && pk0 < k;
            const float *w = wp + g * NP * ps + k0 * PANEL;
            for (int64_t t = 0; t < tiles; t++) {
                int64_t r0, r1, p0 = 0, p1 = 0;
                split(m1 - m0, tiles, t, &r0, &r1);
                if (prefetch) split(pk1 - pk0, tiles, t, &p0, &p1);
                if (p1 - p0 > k1 - k0) p1 = p0 + k1 - k0;
                tile_at((int)(r1 - r0), x + (m0 + r0) * k + k0, k, w, ps, k1 - k0, y + (m0 + r0) * n, n, bias,
                        kb == 0, g * TN, n - g * TN < TN ? n - g * TN : TN,
                        wp + pg * NP * ps + (pk0 + p0) * PANEL, p1 - p0);
            }
        }
    }
}

void trtforge_packed_linear(const float *x, int64_t m, const float *wp, const float *bias, float *y,
                            int64_t n, int64_t k, int64_t threads) {
    const int64_t tiles = CEIL(n, TN);
    if (m <= DIRECT_ROWS) {
#pragma omp parallel num_threads(threads)
        {
            int64_t g0, g1;
            split(tiles, omp_get_num_threads(), omp_get_thread_num(), &g0, &g1);
            linear_direct(x, m, wp, bias, y, n, k, g0, g1);
        }
        return;
    }
    /* Work units: (chunk of rows, block of tiles), taken by whichever thread is free (a core
     * shared with other work finishes fewer), at least UNITS_PER_THREAD per thread. */
    const int64_t chunks = CEIL(m, MC);
    int64_t blocks = CEIL(tiles, NB);
    if (blocks * chunks < UNITS_PER_THREAD * threads) blocks = CEIL(UNITS_PER_THREAD * threads, chunks);
    if (blocks > tiles) blocks = tiles;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t u = 0; u < chunks * blocks; u++) {
        int64_t m0, m1, b0, b1;
        split(m, chunks, u / blocks, &m0, &m1);
        split(tiles, blocks, u % blocks, &b0, &b1);
        linear_block(x, m0, m1, wp, bias, y, n, k, b0, b1);
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
