/* bf16 linear layers on the CPU: y = x W^T (+ b), W packed once at load. Two instruction sets
 * read the one packed layout: AVX512-BF16 (`vdpbf16ps`, below) and AVX2 + FMA (fp32 FMAs on
 * weights widened in registers, further down).
 *
 * A decode step multiplies a handful of token rows by every weight of the model, so its linears
 * are bound by how fast the weights stream from memory. oneDNN's packed kernels stream them at
 * 15-20 GB/s on 1-16 rows here; this one at 25-40, is 1.2-1.3x faster at 32 rows, within 5% at
 * 512 and 0-14% slower at a prefill's 2048: one packed copy of each weight serves every step.
 *
 * Packed layout (`pack` in packed_linear.py): W [N, K] -> [N / 64][K / 2][64][2], i.e. tiles of
 * 64 output columns (N % 64 == 0); within a tile, for each pair of inputs (k, k + 1), the 64
 * columns' two weights side by side: one 64-byte row per register, the pairs `vdpbf16ps`
 * multiplies. A tile is one contiguous stream of K * 128 bytes.
 *
 * Each (row block, tile) work item keeps up to 6 rows x 64 columns of fp32 sums in 24 registers;
 * per input pair it loads the tile's 4 weight registers once and broadcasts each row's pair of
 * inputs against them. Sums are fp32 from the first product on (as oneDNN's), the bias added in
 * fp32, and rounded to bf16 (nearest, ties to even) once on store. Items are spread over the
 * OpenMP threads of the calling process (torch's runtime, shared: see build.py) one at a time
 * as each thread is free (dynamic): where other processes share the cores (`pdserve up` on a
 * small machine: a prefill worker beside the decode ranks), a thread the OS puts aside for a
 * while no longer holds up the step with its fixed share of the tiles. Served on 2 cores that
 * took TPOT p50 from 47-49 ms to 42-43 ms; offline it changes nothing.
 *
 * With AMX (below the AVX512-BF16 tiles) 2 rows or more go through the tile unit instead.
 *
 * Built everywhere; `linear_bf16_supported()` says whether this CPU has either instruction set
 * (callers keep oneDNN where it does not).
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#ifdef __AVX512BF16__
#include <immintrin.h>

#define TILE_COLS 64 /* output columns per tile: 4 registers of 16 fp32 sums */
#define TILE_VECS 4
#define MAX_ROWS 6 /* token rows per pass over a tile: 6 x 4 = 24 accumulators */
#define ROW_BLOCK 96 /* token rows per work item (a multiple of MAX_ROWS) */
#define X_FP32 0     /* tiles read the bf16 rows as they are */
#define STREAM_AHEAD 0 /* the tiles here ask for nothing ahead */

typedef uint16_t row_t;

/* ROWS rows of x against one tile (64 columns of y, bias). */
#define TILE_KERNEL(ROWS)                                                                     \
    static void tile_##ROWS(const uint16_t *x, int64_t k, const uint16_t *w,                  \
                            const uint16_t *bias, uint16_t *y, int64_t n,                     \
                            const uint16_t *ahead) {                                          \
        (void)ahead; /* the AVX2 path's prefetches; here unmeasured */                       \
        __m512 acc[ROWS][TILE_VECS];                                                          \
        for (int v = 0; v < TILE_VECS; v++) {                                                 \
            __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(                          \
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(                   \
                                      (const __m256i *)(bias + 16 * v))), 16))                \
                            : _mm512_setzero_ps();                                            \
            for (int r = 0; r < ROWS; r++) acc[r][v] = b;                                     \
        }                                                                                     \
        for (int64_t p = 0; p < k / 2; p++) {                                                 \
            const uint16_t *wp = w + p * 2 * TILE_COLS;                                       \
            __m512bh wv[TILE_VECS];                                                           \
            for (int v = 0; v < TILE_VECS; v++)                                               \
                wv[v] = (__m512bh)_mm512_loadu_si512(wp + 32 * v);                            \
            for (int r = 0; r < ROWS; r++) {                                                  \
                int32_t pair; /* x[r][2p], x[r][2p + 1] */                                    \
                __builtin_memcpy(&pair, x + r * k + 2 * p, sizeof pair);                      \
                __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);                              \
                for (int v = 0; v < TILE_VECS; v++)                                           \
                    acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xr);                       \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < ROWS; r++)                                                        \
            for (int v = 0; v < TILE_VECS; v++)                                               \
                _mm256_storeu_si256((__m256i *)(y + r * n + 16 * v),                          \
                                    (__m256i)_mm512_cvtneps_pbh(acc[r][v]));                  \
    }

TILE_KERNEL(1)
TILE_KERNEL(2)
TILE_KERNEL(3)
TILE_KERNEL(4)
TILE_KERNEL(5)
TILE_KERNEL(6)

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, const uint16_t *,
                        uint16_t *, int64_t, const uint16_t *);
static const tile_fn TILES[MAX_ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* CPUs with AMX (Intel Sapphire Rapids and later): 2 rows or more go through the tile unit, up
 * to 16 at a time, which multiplies them by 16 input pairs by 16 columns in one `tdpbf16ps`. The
 * packed layout is already what it reads: a tile's 16 pair rows of 16 columns (64 bytes each,
 * 256 bytes apart in the layout) are one B operand. Against the AVX512-BF16 tiles above, on 2
 * cores of a Xeon with AMX (tests/kernels' shapes and SmolLM2's, the weights in cache): 2-15
 * rows 1.1-7.6x faster, 16-2048 rows 3.9-9.5x (there 0.9-3.0x oneDNN's AMX kernels); one row
 * keeps the tiles above (as fast, or faster). Sums are fp32, the bias added once they are done,
 * rounded to bf16 once. Linux lends the tile registers to a process that asks
 * (`amx_permitted`); where it refuses, every row takes the tiles above. */
#include <sys/syscall.h>
long syscall(long number, ...); /* <unistd.h> declares it only outside strict C11 */

#define AMX 1
#define AMX_ROWS 16 /* token rows per pass: a tile register's rows */
#define AMX_K 32    /* inputs per step: 16 pairs, 64 bytes of a row */
#define AMX_MIN_ROWS 2 /* one row keeps the AVX512-BF16 tiles (as fast, or faster) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use the tile registers (asked once; 1 yes, 0 no). */
static int amx_permitted(void) {
    static int state; /* 0: not asked yet, 1: yes, -1: no */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* This thread's tile registers for passes of `rows` rows (1 to AMX_ROWS): tmm0-3 the fp32
 * sums of a tile's four 16-column quarters, tmm4 the rows' next 32 inputs, tmm5 a quarter's
 * 16 input pairs; rows of 64 bytes. */
static void amx_configure(int64_t rows) {
    struct tile_config config = {.palette = 1};
    for (int t = 0; t < 6; t++) {
        config.colsb[t] = 64;
        config.rows[t] = t == 5 ? AMX_K / 2 : (uint8_t)rows;
    }
    _tile_loadconfig(&config);
}

/* `rows` rows of x (as configured; k % AMX_K == 0) against one tile (64 columns of y, bias). */
static void amx_tile(const uint16_t *x, int64_t rows, int64_t k, const uint16_t *w,
                     const uint16_t *bias, uint16_t *y, int64_t n) {
    const int64_t pair_row = 2 * TILE_COLS * sizeof(uint16_t); /* bytes between pair rows */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kk = 0; kk < k; kk += AMX_K) {
        const uint16_t *wp = w + kk / 2 * 2 * TILE_COLS; /* pair row kk / 2 */
        _tile_loadd(4, x + kk, k * sizeof(uint16_t));
        _tile_loadd(5, wp, pair_row);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, wp + 32, pair_row);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, wp + 64, pair_row);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, wp + 96, pair_row);
        _tile_dpbf16ps(3, 4, 5);
    }
    float sums[AMX_ROWS][TILE_COLS];
    _tile_stored(0, &sums[0][0], sizeof sums[0]);
    _tile_stored(1, &sums[0][16], sizeof sums[0]);
    _tile_stored(2, &sums[0][32], sizeof sums[0]);
    _tile_stored(3, &sums[0][48], sizeof sums[0]);
    for (int v = 0; v < TILE_VECS; v++) {
        __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_loadu_si256((const __m256i *)(bias + 16 * v))), 16))
                        : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)(y + r * n + 16 * v),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_add_ps(_mm512_loadu_ps(&sums[r][16 * v]), b)));
    }
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
/* CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3, Intel before Cooper Lake): the same
 * layout with tiles of 16 columns, in fp32 FMAs. A pair row is then one 64-byte cache line and a
 * tile one sequential stream that a pass over it reads whole (with 64-column tiles, AVX2's 16
 * registers could hold the sums of only a quarter of a pair row: four strided passes, which
 * streamed cold weights at 5-8 GB/s). A 32-byte load holds 8 columns' weights for inputs 2p and
 * 2p + 1 in each 32-bit lane: the lane shifted left by 16 is weight 2p as fp32, the lane with its
 * low half masked off is weight 2p + 1. The input rows are widened to fp32 once per call
 * (`x_rows`), so each input is one broadcast load. Up to 6 rows x 16 columns of sums stay in 12
 * registers: per pair the even weights go to every row, then the odd (two weight registers live,
 * not four). Where a tile takes several passes (7+ rows: a decode step's batch), the first asks
 * for the next tile into L2, which then streams in while the later passes read this one from L1
 * (4 -> 6 rows and that: 1.07-1.20x at 8-16 rows, the same at 1-4 and 256 rows, A/B in one
 * process). Where one pass reads a tile (1-6 rows), it asks for its own stream 4 KB ahead: the
 * hardware's prefetchers alone left the weights at 11-15 GB/s of the 17-22 two cores read
 * (1.07-1.23x at 1-6 rows). torch's bf16 matmul has no AVX2 kernel (0.8 GFLOP/s on 2 Zen 3
 * cores here); this runs at 90-140 GFLOP/s there (noisy host; 84 on one thread with a tile in
 * L1, 92% of its FMAs' peak), where MKL's fp32 GEMM reaches 104 and the FMAs 178. */
#include <immintrin.h>

#define TILE_COLS 16
#define MAX_ROWS 6
#define ROW_BLOCK 96 /* a multiple of MAX_ROWS */
#define X_FP32 1     /* tiles read the rows widened to fp32 */
#define STREAM_AHEAD 2048 /* weights (4 KB) a tile's one pass asks for ahead of its reads */

typedef float row_t;

static inline __m256 low_bf16(__m256i lanes) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
}
static inline __m256 high_bf16(__m256i lanes) {
    return _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 8 fp32 -> 8 bf16, nearest, ties to even (as vcvtneps2bf16 rounds; NaN stays NaN). */
static inline __m128i to_bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    u = _mm256_srli_epi32(u, 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

/* The register-sized loops below are unrolled whole, so their sums stay in registers (GCC
 * otherwise keeps a copy of the array in memory, updated on every pair: 1.4-1.7x slower). */
#define UNROLLED _Pragma("GCC unroll 8")

/* ROWS rows of x (fp32) against one tile (16 columns of y, bias). */
#define TILE_KERNEL(ROWS)                                                                     \
    static void tile_##ROWS(const float *x, int64_t k, const uint16_t *w,                     \
                            const uint16_t *bias, uint16_t *y, int64_t n,                     \
                            const uint16_t *ahead) {                                          \
        __m256 acc[ROWS][2];                                                                  \
        UNROLLED for (int v = 0; v < 2; v++) {                                                \
            __m256 b = bias ? low_bf16(_mm256_cvtepu16_epi32(                                 \
                                  _mm_loadu_si128((const __m128i *)(bias + 8 * v))))          \
                            : _mm256_setzero_ps();                                            \
            UNROLLED for (int r = 0; r < ROWS; r++) acc[r][v] = b;                            \
        }                                                                                     \
        for (int64_t p = 0; p < k / 2; p++) {                                                 \
            const uint16_t *wp = w + p * 2 * TILE_COLS;                                       \
            if (ahead) __builtin_prefetch(ahead + p * 2 * TILE_COLS, 0, 2);                   \
            __m256 w0[2], w1[2];                                                              \
            UNROLLED for (int v = 0; v < 2; v++)                                              \
                w0[v] = low_bf16(_mm256_loadu_si256((const __m256i *)(wp + 16 * v)));         \
            UNROLLED for (int r = 0; r < ROWS; r++) {                                         \
                __m256 x0 = _mm256_broadcast_ss(x + r * k + 2 * p);                           \
                UNROLLED for (int v = 0; v < 2; v++)                                          \
                    acc[r][v] = _mm256_fmadd_ps(w0[v], x0, acc[r][v]);                        \
            }                                                                                 \
            UNROLLED for (int v = 0; v < 2; v++)                                              \
                w1[v] = high_bf16(_mm256_loadu_si256((const __m256i *)(wp + 16 * v)));        \
            UNROLLED for (int r = 0; r < ROWS; r++) {                                         \
                __m256 x1 = _mm256_broadcast_ss(x + r * k + 2 * p + 1);                       \
                UNROLLED for (int v = 0; v < 2; v++)                                          \
                    acc[r][v] = _mm256_fmadd_ps(w1[v], x1, acc[r][v]);                        \
            }                                                                                 \
        }                                                                                     \
        UNROLLED for (int r = 0; r < ROWS; r++)                                               \
            UNROLLED for (int v = 0; v < 2; v++)                                              \
                _mm_storeu_si128((__m128i *)(y + r * n + 8 * v), to_bf16x8(acc[r][v]));        \
    }

TILE_KERNEL(1)
TILE_KERNEL(2)
TILE_KERNEL(3)
TILE_KERNEL(4)
TILE_KERNEL(5)
TILE_KERNEL(6)

typedef void (*tile_fn)(const float *, int64_t, const uint16_t *, const uint16_t *, uint16_t *,
                        int64_t, const uint16_t *);
static const tile_fn TILES[MAX_ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* x [m, k] bf16 -> fp32 (exact), or NULL if out of memory. */
static float *x_rows(const uint16_t *x, int64_t m, int64_t k) {
    float *f = malloc(sizeof(float) * (size_t)(m * k));
    if (f)
        for (int64_t i = 0; i < m * k; i++) f[i] = bf16_to_f32(x[i]);
    return f;
}

#endif

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))

/* Output columns per work item: 128 bytes of each row of y, whole cache lines, so that no two
 * threads write to the same line of y (AVX2's tiles are 16 columns: four per item). */
#define ITEM_COLS 64

int linear_bf16_supported(void) { return 1; }

/* Output columns per tile of the packed layout on this CPU (packed_linear.py packs by it). */
int linear_bf16_tile_cols(void) { return TILE_COLS; }

/* Whether 2 rows or more go through AMX's tile unit here (built with it, and Linux lends it). */
int linear_bf16_amx(void) {
#ifdef AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* y [m, n] = x [m, k] . W [n, k]^T (+ bias [n] or NULL); w packed as above, n % TILE_COLS == 0
 * and k even (the wrapper checks). 0, or -1 if out of memory (nothing written). */
/* rows x [rows, k] (row_t) times the packed tiles [col0, col1) of w [*, k] (+ bias[col0:col1],
 * bias NULL: none) into y (bf16, ldy apart, y at column col0): one work item. With AMX (2 rows
 * or more, k a multiple of 32) in passes of 16 rows through the tile unit; else in passes of
 * equal size (7 rows go as 4 + 3, not 6 + 1), the first of which asks for what it reads next:
 * a tile's one pass, its own stream further on; the first of several, the next tile.
 * fused_moe.c runs its GEMMs through it too. */
static void gemm_cols(const row_t *x, int64_t rows, int64_t k, const uint16_t *w,
                      const uint16_t *bias, int64_t col0, int64_t col1, uint16_t *y,
                      int64_t ldy) {
#ifdef AMX
    if (rows >= AMX_MIN_ROWS && k % AMX_K == 0 && amx_permitted()) {
        for (int64_t r = 0; r < rows; r += AMX_ROWS) {
            int64_t count = rows - r < AMX_ROWS ? rows - r : AMX_ROWS;
            if (r == 0 || count < AMX_ROWS) amx_configure(count);
            for (int64_t col = col0; col < col1; col += TILE_COLS)
                amx_tile(x + r * k, count, k, w + col * k, bias ? bias + col : 0,
                         y + r * ldy + (col - col0), ldy);
        }
        _tile_release();
        return;
    }
#endif
    for (int64_t col = col0; col < col1; col += TILE_COLS)
        for (int64_t r = 0; r < rows;) {
            int64_t passes = (rows - r + MAX_ROWS - 1) / MAX_ROWS;
            int64_t count = (rows - r + passes - 1) / passes;
            const uint16_t *ahead = 0;
            if (r == 0)
                ahead = count == rows             ? w + col * k + STREAM_AHEAD
                        : col + TILE_COLS < col1 ? w + (col + TILE_COLS) * k : 0;
            TILES[count](x + r * k, k, w + col * k, bias ? bias + col : 0,
                         y + r * ldy + (col - col0), ldy, ahead);
            r += count;
        }
}

int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                int64_t m, int64_t n, int64_t k) {
#if X_FP32
    float *rows = x_rows(x, m, k);
    if (!rows) return -1;
#else
    const uint16_t *rows = x;
#endif
    int64_t items = (n + ITEM_COLS - 1) / ITEM_COLS, blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i = 0; i < items; i++) {
            int64_t r0 = b * ROW_BLOCK, end = (b + 1) * ROW_BLOCK < m ? (b + 1) * ROW_BLOCK : m;
            int64_t col0 = i * ITEM_COLS, last = (i + 1) * ITEM_COLS < n ? (i + 1) * ITEM_COLS : n;
            gemm_cols(rows + r0 * k, end - r0, k, w, bias, col0, last, y + r0 * n + col0, n);
        }
#if X_FP32
    free(rows);
#endif
    return 0;
}

#else

int linear_bf16_supported(void) { return 0; }

int linear_bf16_tile_cols(void) { return 0; }

int linear_bf16_amx(void) { return 0; }

int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                int64_t m, int64_t n, int64_t k) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k;
    return -1;
}

#endif
