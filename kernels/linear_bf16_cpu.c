/* bf16 linear layers on a CPU with AVX512-BF16: y = x W^T (+ b), W packed once at load.
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
 * OpenMP threads of the calling process (torch's runtime, shared: see native.py) one at a time
 * as each thread is free (dynamic): where other processes share the cores (`pdserve up` on a
 * small machine: a prefill worker beside the decode ranks), a thread the OS puts aside for a
 * while no longer holds up the step with its fixed share of the tiles. Served on 2 cores that
 * took TPOT p50 from 47-49 ms to 42-43 ms; offline it changes nothing.
 *
 * Built everywhere; `linear_bf16_supported()` says whether this CPU has the instructions
 * (callers keep oneDNN where it does not).
 */
#include <stdint.h>

#ifdef __AVX512BF16__
#include <immintrin.h>

#define TILE_COLS 64 /* output columns per tile: 4 registers of 16 fp32 sums */
#define TILE_VECS 4
#define MAX_ROWS 6 /* token rows per pass over a tile: 6 x 4 = 24 accumulators */
#define ROW_BLOCK 96 /* token rows per work item (a multiple of MAX_ROWS) */

/* ROWS rows of x against one tile (64 columns of y, bias). */
#define TILE_KERNEL(ROWS)                                                                     \
    static void tile_##ROWS(const uint16_t *x, int64_t k, const uint16_t *w,                  \
                            const uint16_t *bias, uint16_t *y, int64_t n) {                   \
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
                        uint16_t *, int64_t);
static const tile_fn TILES[MAX_ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

int linear_bf16_supported(void) { return 1; }

/* y [m, n] = x [m, k] . W [n, k]^T (+ bias [n] or NULL); w packed as above, n % 64 == 0 and
 * k even (the wrapper checks). */
void linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int64_t m, int64_t n, int64_t k) {
    int64_t tiles = n / TILE_COLS, blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t col = t * TILE_COLS;
            int64_t end = (b + 1) * ROW_BLOCK < m ? (b + 1) * ROW_BLOCK : m;
            for (int64_t r = b * ROW_BLOCK; r < end;) {
                /* passes of equal size: 7 rows go as 4 + 3, not 6 + 1 */
                int64_t passes = (end - r + MAX_ROWS - 1) / MAX_ROWS;
                int64_t rows = (end - r + passes - 1) / passes;
                TILES[rows](x + r * k, k, w + t * k * TILE_COLS, bias ? bias + col : 0,
                            y + r * n + col, n);
                r += rows;
            }
        }
}

#else

int linear_bf16_supported(void) { return 0; }

void linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int64_t m, int64_t n, int64_t k) {
    (void)x, (void)w, (void)bias, (void)y, (void)m, (void)n, (void)k;
}

#endif
