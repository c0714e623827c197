/* Batched multi-LoRA on the CPU: `lora_shrink_ref` and `lora_expand_ref` (kernels/reference/
 * lora.py), each one call per linear over the step's segments (runs of tokens of one slot).
 *
 * A segment's rows are cut into work items of up to ROWS rows, spread over torch's OpenMP
 * threads (static: a thread's items are mostly of one segment, its slot's weights warm in L2).
 * Within an item every weight is loaded (and widened from bf16) once for all its rows, whose
 * sums stay in registers (one compiled copy per row count):
 *
 * - shrink: buf[t, j] = a[slot, j, :] . x[t, :], the dot over `in` contiguous in both; x's rows
 *   are widened to fp32 once per item (a thread's scratch), each row's sums kept as 16 lanes,
 *   and 16 outputs' lanes reduced by one tree (`sum16`);
 * - expand: the rank is short (16), so a dot per output would be mostly its reduction; instead
 *   16 x 16 blocks of b[slot] (16 outputs, 16 of the rank) are transposed in registers and each
 *   row's 16 outputs are 16 FMAs of buf's values broadcast, added to y in fp32 and rounded once
 *   to y's dtype (nearest, ties to even).
 *
 * Sums are fp32 from the first product, in FMAs. dtype: 0 = float32, 1 = bfloat16 (x, a; y, b);
 * buf is fp32. Rows are contiguous; segments of slot -1 are zero in buf and leave y untouched.
 *
 * SmolLM2-135M's q/k/v at decode (bf16, 32 tokens over 8 slots, in 576, 3 slices of 576, rank
 * 16, 2 threads of an AVX512-BF16 EPYC): shrink 22 us + expand 23 us (with the Python glue)
 * beside the base linear's 200 us (torch's F.linear); the torch reference takes 960 us.
 */
#if defined(__GNUC__) && !defined(__clang__)
/* a * b + c as one FMA (-std=c11 turns GCC's contraction off; clang contracts by default) */
#pragma GCC optimize("fp-contract=fast")
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_math.h" /* v16, SHUF, sum16 */
#include "bf16.h"

#define ROWS 8 /* token rows per work item (BY_ROWS lists 1..8) */
#define PARALLEL_MACS (1 << 18) /* less work than this runs on the calling thread */

typedef uint16_t h16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

typedef struct {
    int64_t start, rows, slot; /* rows [start, start + rows) of one segment */
} Item;

/* CALL(dtype, rows) with both literal, for n = 1..ROWS rows: one specialized copy each. */
#define BY_DTYPE(N, CALL)                                                                     \
    case N:                                                                                   \
        if (dtype == 1)                                                                       \
            CALL(1, N);                                                                       \
        else                                                                                  \
            CALL(0, N);                                                                       \
        break;
#define BY_ROWS(n, CALL)                                                                      \
    switch (n) {                                                                              \
        BY_DTYPE(1, CALL) BY_DTYPE(2, CALL) BY_DTYPE(3, CALL) BY_DTYPE(4, CALL)               \
        BY_DTYPE(5, CALL) BY_DTYPE(6, CALL) BY_DTYPE(7, CALL) BY_DTYPE(8, CALL)               \
    }

/* p[i:i + 16] of `dtype` as fp32. */
static inline v16 load16(const void *p, int64_t i, int dtype) {
    v16 v;
    if (dtype == 1) {
        h16 h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        return (v16)(__builtin_convertvector(h, u32x16) << 16);
    }
    memcpy(&v, (const float *)p + i, sizeof v);
    return v;
}

static inline float load1(const void *p, int64_t i, int dtype) {
    return dtype == 1 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The segments' items (slot -1 skipped); returns how many, the rows they hold in *active. */
static int64_t make_items(const int32_t *starts, const int32_t *slots, int64_t num_segments,
                          Item *items, int64_t *active) {
    int64_t n = 0;
    *active = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        if (slots[s] < 0)
            continue;
        for (int64_t t = starts[s]; t < starts[s + 1]; t += ROWS) {
            int64_t rows = starts[s + 1] - t < ROWS ? starts[s + 1] - t : ROWS;
            items[n++] = (Item){t, rows, slots[s]};
            *active += rows;
        }
    }
    return n;
}

/* ---- shrink ---- */

/* out[r] lane u = weight row u . rows[r] over `len`, for up to 16 weight rows (`dtype`,
 * `stride` elements apart; lanes past `count` 0) and N rows (a literal where called). */
static inline __attribute__((always_inline)) void dots16(
    const void *w, int64_t stride, int64_t count, const float *const *rows, int64_t len,
    int dtype, const int n, v16 *out) {
    v16 part[ROWS][16];
    for (int64_t u = 0; u < 16; u++) {
        v16 acc[ROWS] = {0};
        if (u < count) {
            const void *wu = (const char *)w + u * stride * (dtype == 1 ? 2 : 4);
            int64_t i = 0;
            for (; i + 16 <= len; i += 16) {
                v16 wv = load16(wu, i, dtype);
                _Pragma("GCC unroll 8") for (int r = 0; r < n; r++)
                    acc[r] += wv * *(const v16 *)(rows[r] + i);
            }
            for (; i < len; i++)
                for (int r = 0; r < n; r++) acc[r][0] += load1(wu, i, dtype) * rows[r][i];
        }
        for (int r = 0; r < n; r++) part[r][u] = acc[r];
    }
    for (int r = 0; r < n; r++) out[r] = sum16(part[r]);
}

/* buf rows of one item = its x rows (widened into `scratch` if bf16) times a[slot]^T. */
static void shrink_item(const void *x, const void *a, float *buf, float *scratch, Item it,
                        int64_t in, int64_t width, int dtype) {
    int64_t elem = dtype == 1 ? 2 : 4;
    const float *rows[ROWS];
    for (int64_t r = 0; r < it.rows; r++) {
        if (dtype != 1) {
            rows[r] = (const float *)x + (it.start + r) * in;
            continue;
        }
        const uint16_t *src = (const uint16_t *)x + (it.start + r) * in;
        float *dst = scratch + r * in;
#pragma omp simd
        for (int64_t i = 0; i < in; i++) dst[i] = bf16_to_f32(src[i]);
        rows[r] = dst;
    }
    const char *w = (const char *)a + it.slot * width * in * elem; /* [width][in] */
    for (int64_t j = 0; j < width; j += 16) {
        int64_t count = width - j < 16 ? width - j : 16;
        v16 sums[ROWS];
#define SHRINK(D, N) dots16(w + j * in * elem, in, count, rows, in, D, N, sums)
        BY_ROWS(it.rows, SHRINK)
#undef SHRINK
        for (int64_t r = 0; r < it.rows; r++)
            memcpy(buf + (it.start + r) * width + j, &sums[r], (size_t)count * sizeof(float));
    }
}

/* ---- expand ---- */

/* One butterfly stage of a transpose of n vectors: vectors i and i + d (i & d == 0) swap
 * lanes j + d of v[i] with lanes j of v[i + d] (j & d == 0). Stages d = 1, 2, 4 transpose
 * each 8-lane half of 8 vectors, and d = 8 after them all 16 lanes of 16. */
#define STAGE(v, n, d, LO, HI)                                                                \
    _Pragma("GCC unroll 16") for (int i = 0; i < (n); i++) if (!(i & (d))) {                 \
        u32x16 lo = v[i], hi = v[i + (d)];                                                    \
        v[i] = SHUF(lo, hi, LO);                                                              \
        v[i + (d)] = SHUF(lo, hi, HI);                                                        \
    }
#define D1_LO 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define D1_HI 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define D2_LO 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define D2_HI 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define D4_LO 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define D4_HI 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define D8_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define D8_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31

/* bt[k] lane u = w[u][k] as fp32: a 16 x 16 block of rows `stride` bytes apart, transposed.
 * bf16: rows u and u + 8 side by side in one vector of 8 column pairs each, the 8 x 8 pairs
 * transposed as 32-bit lanes, each pair then split into its two columns. */
static inline __attribute__((always_inline)) void transposed(const char *w, int64_t stride, int dtype, v16 *bt) {
    u32x16 v[16];
    if (dtype == 1) {
        for (int i = 0; i < 8; i++) {
            u32x8 lo, hi;
            memcpy(&lo, w + i * stride, sizeof lo);
            memcpy(&hi, w + (i + 8) * stride, sizeof hi);
            v[i] = SHUF(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        }
        STAGE(v, 8, 1, D1_LO, D1_HI)
        STAGE(v, 8, 2, D2_LO, D2_HI)
        STAGE(v, 8, 4, D4_LO, D4_HI)
        for (int p = 0; p < 8; p++) {
            bt[2 * p] = (v16)(v[p] << 16);
            bt[2 * p + 1] = (v16)(v[p] & 0xFFFF0000u);
        }
        return;
    }
    for (int u = 0; u < 16; u++) memcpy(&v[u], w + u * stride, sizeof v[u]);
    STAGE(v, 16, 1, D1_LO, D1_HI)
    STAGE(v, 16, 2, D2_LO, D2_HI)
    STAGE(v, 16, 4, D4_LO, D4_HI)
    STAGE(v, 16, 8, D8_LO, D8_HI)
    for (int k = 0; k < 16; k++) bt[k] = (v16)v[k];
}

/* bt[k] lane u = b[u][k] (`rank` apart) as fp32 for u < count, k < kc; 0 past them. */
static inline __attribute__((always_inline)) void block(const void *b, int64_t rank, int64_t count, int64_t kc, int dtype,
                         v16 *bt) {
    int64_t elem = dtype == 1 ? 2 : 4;
    if (count == 16 && kc == 16) {
        transposed(b, rank * elem, dtype, bt);
        return;
    }
    char tile[16 * 16 * 4] = {0}; /* a block cut short: its part, zero-padded */
    for (int64_t u = 0; u < count; u++)
        memcpy(tile + u * 16 * elem, (const char *)b + u * rank * elem, (size_t)(kc * elem));
    transposed(tile, 16 * elem, dtype, bt);
}

/* y[i:i + count] += d (fp32), rounded once to y's `dtype`: 16 bf16 in vector registers,
 * rounded as round_bf16 (nearest, ties to even; NaN stays NaN). */
static inline void add_to(void *y, int64_t i, v16 d, int64_t count, int dtype) {
    if (dtype == 1 && count == 16) {
        h16 h;
        memcpy(&h, (uint16_t *)y + i, sizeof h);
        v16 sum = (v16)(__builtin_convertvector(h, u32x16) << 16) + d;
        u32x16 u = (u32x16)sum, nan = (u32x16)(sum != sum);
        u = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16 & ~nan) | (0x7FC0u & nan);
        h = __builtin_convertvector(u, h16);
        memcpy((uint16_t *)y + i, &h, sizeof h);
        return;
    }
    float delta[16];
    memcpy(delta, &d, sizeof delta);
    if (dtype == 1) {
        uint16_t *p = (uint16_t *)y + i;
#pragma omp simd
        for (int64_t u = 0; u < count; u++) p[u] = f32_to_bf16(bf16_to_f32(p[u]) + delta[u]);
    } else {
        float *p = (float *)y + i;
#pragma omp simd
        for (int64_t u = 0; u < count; u++) p[u] += delta[u];
    }
}

/* y[t + r][o:o + count] += h rows r (`width` apart) . b rows o.. (`b` at row o of the slot,
 * `h` at the slice's columns), N rows (a literal where called). */
static inline __attribute__((always_inline)) void expand_rows(
    void *y, int64_t out, int64_t t, int64_t o, int64_t count, const float *h, int64_t width,
    const char *b, int64_t rank, int dtype, const int n) {
    v16 acc[ROWS] = {0};
    for (int64_t k = 0; k < rank; k += 16) {
        int64_t kc = rank - k < 16 ? rank - k : 16;
        v16 bt[16];
        block(b + k * (dtype == 1 ? 2 : 4), rank, count, kc, dtype, bt);
        _Pragma("GCC unroll 8") for (int r = 0; r < n; r++) {
            const float *hr = h + r * width + k;
            if (kc == 16) {
                _Pragma("GCC unroll 16") for (int c = 0; c < 16; c++) acc[r] += hr[c] * bt[c];
            } else {
                for (int64_t c = 0; c < kc; c++) acc[r] += hr[c] * bt[c];
            }
        }
    }
    for (int r = 0; r < n; r++) add_to(y, (t + r) * out + o, acc[r], count, dtype);
}

/* y rows of one item += each slice's buf columns times its rows of b[slot]^T. */
static void expand_item(void *y, const float *buf, const void *b, const int64_t *offsets,
                        int64_t num_slices, Item it, int64_t out, int64_t rank, int dtype) {
    int64_t elem = dtype == 1 ? 2 : 4, width = num_slices * rank;
    const char *w = (const char *)b + it.slot * out * rank * elem; /* [out][rank] */
    for (int64_t s = 0; s < num_slices; s++) {
        const float *h = buf + it.start * width + s * rank;
        for (int64_t o = offsets[s]; o < offsets[s + 1]; o += 16) {
            int64_t count = offsets[s + 1] - o < 16 ? offsets[s + 1] - o : 16;
#define EXPAND(D, N) expand_rows(y, out, it.start, o, count, h, width, w + o * rank * elem, \
                                 rank, D, N)
            BY_ROWS(it.rows, EXPAND)
#undef EXPAND
        }
    }
}

/* ---- entry points ---- */

static Item *alloc_items(int64_t num_tokens, int64_t num_segments) {
    return malloc((size_t)(num_tokens / ROWS + num_segments + 1) * sizeof(Item));
}

/* buf [T][width] fp32 = x [T][in] times a [slots][width][in]^T per token's slot; 0 if none.
 * Returns 0, or -1 where memory ran out. */
int lora_shrink(const void *x, const void *a, float *buf, const int32_t *starts,
                const int32_t *slots, int64_t num_segments, int64_t num_tokens, int64_t in,
                int64_t width, int dtype) {
    Item *items = alloc_items(num_tokens, num_segments);
    if (!items)
        return -1;
    int64_t active, n = make_items(starts, slots, num_segments, items, &active);
    for (int64_t s = 0; s < num_segments; s++)
        if (slots[s] < 0)
            memset(buf + starts[s] * width, 0,
                   (size_t)((starts[s + 1] - starts[s]) * width) * sizeof(float));
    int failed = 0;
#pragma omp parallel if (n >= 2 && active * width * in >= PARALLEL_MACS)
    {
        float *scratch = dtype == 1 ? malloc((size_t)(ROWS * in + 16) * sizeof(float)) : NULL;
        if (dtype == 1 && !scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++)
            if (dtype != 1 || scratch)
                shrink_item(x, a, buf, scratch, items[i], in, width, dtype);
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}

/* y [T][out] += per slice s: buf [T][slices * rank] columns [s rank, (s + 1) rank) times
 * b [slots][out][rank] rows [offsets[s], offsets[s + 1])^T, per token's slot; none: as is.
 * Returns 0, or -1 where memory ran out. */
int lora_expand(void *y, const float *buf, const void *b, const int64_t *offsets,
                int64_t num_slices, const int32_t *starts, const int32_t *slots,
                int64_t num_segments, int64_t num_tokens, int64_t out, int64_t rank, int dtype) {
    Item *items = alloc_items(num_tokens, num_segments);
    if (!items)
        return -1;
    int64_t active, n = make_items(starts, slots, num_segments, items, &active);
#pragma omp parallel for if (n >= 2 && active * out * rank >= PARALLEL_MACS) schedule(static)
    for (int64_t i = 0; i < n; i++)
        expand_item(y, buf, b, offsets, num_slices, items[i], out, rank, dtype);
    free(items);
    return 0;
}
