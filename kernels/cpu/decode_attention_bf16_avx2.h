/* Decode attention for bf16 caches on CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3,
 * Intel before Cooper Lake), included by paged_decode_attention.c. Head sizes a multiple
 * of 16 (up to 256), up to 8 query heads per KV head.
 *
 * - bf16 -> fp32 in registers: a 32-byte load holds 16 dims; each 32-bit lane shifted left by
 *   16 is its even dim as fp32, the lane with its low half masked off its odd dim. The queries
 *   are widened once per item into the same order (8 even dims, then 8 odd, per 16), so a dot
 *   is two FMAs per 16 dims and nothing is shuffled per token.
 * - A work item is one sequence's query, or a tile of up to 4 consecutive positions of one
 *   sequence (a prefill chunk's tokens, found by their lengths and block tables), when its
 *   query heads per KV head times 4 fit in registers. Key rows are read whole and in order
 *   (every KV head of a token), each loaded and widened once for the whole tile. With fewer
 *   queries than threads (a lone sequence), an item is one KV head's slice instead.
 * - Scores 8 tokens at a time, the 8 dots of a head summed together by `sum8` (hadd tree);
 *   softmax in fp32 (`exp_shifted`); the probabilities stay fp32 for the values.
 * - Values 16 tokens at a time (their rows stay in L1), 16 dims by up to 4 heads in registers.
 * - The sequence's cache offsets are computed once per item; each pass asks for its cache's
 *   rows 32 tokens ahead (into L2: blocks lie anywhere, the prefetchers lose the stream).
 *
 * Against the fp32 path these caches took here before (rows converted into a buffer, 64-byte
 * vector code that GCC splits in two on AVX2), AMD Zen 3, 2 threads, SmolLM2's 9 heads / 3 KV
 * heads of 64, the two built side by side in one process: 30 layers with cold caches
 * 1.09-1.18x (32 x 300 tokens 43.2 -> 37.1 ms: memory-bound), a 2000-token prefill's
 * attention 2.50x (3 layers 434 -> 173 ms). Each query's output is bit-identical whether it
 * runs alone or in a tile.
 *
 * A sliding window: a tile's rows start at its first query's first visible key, and each
 * query's scores before its own first get weight 0. A soft cap rewrites the fp32 scores before
 * their softmax, and a head's sink joins its softmax's denominator (attention_math.h).
 */
#ifndef PDSERVE_DECODE_ATTENTION_BF16_AVX2_H
#define PDSERVE_DECODE_ATTENTION_BF16_AVX2_H

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "attention_math.h" /* exp_shifted */
#include "bf16.h"

#define BF16_PATH 1
#define BF16_DIM_STEP 16 /* head_dim: a multiple of 16 (one 32-byte load) */
#define BF16_MAX_DIM 256
#define MAX_GROUP 8         /* query heads per KV head */
#define VALUE_HEADS 4       /* query heads per values pass: 8 sums in registers */
#define SCORE_STEP 8        /* tokens per group of the scores pass */
#define VALUE_STEP 16       /* tokens per group of the values pass (their rows stay in L1) */
#define PREFETCH_TOKENS 32  /* tokens each pass asks for ahead of the ones it reads */
#define QUERY_TILE 4        /* positions of one sequence per work item */
#define MAX_TILE_SUMS 12    /* query heads x tile positions whose dots stay in registers */

#define UNROLLED _Pragma("GCC unroll 16") /* register-sized loops: sums stay in registers */

static inline __m256 even_dims(__m256i lanes) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
}
static inline __m256 odd_dims(__m256i lanes) {
    return _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline __m256i load8x32(const uint16_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}

/* Eight vectors -> one: lane u is the sum of a[u]'s lanes. */
static inline __m256 sum8(const __m256 *a) {
    __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                         _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* Asks for the rows of tokens [*asked, until) of one cache (`bytes` each, into L2). */
static inline void ask_rows(const uint16_t *cache, const int64_t *off, int64_t *asked,
                            int64_t until, int64_t bytes) {
    for (; *asked < until; (*asked)++)
        for (int64_t b = 0; b < bytes; b += 64)
            __builtin_prefetch((const char *)(cache + off[*asked]) + b, 0, 1);
}

/* acc[h] += sum over tokens t0 .. end of p[h][t] * v[t] for N heads (rows of `stride`
 * probabilities, DIM sums each in the widened order), v[t] = v_head + off[t]. */
static inline __attribute__((always_inline)) void weigh_values(
        const uint16_t *v_head, const int64_t *off, int64_t t0, int64_t end, const float *p,
        int64_t stride, float *acc, int64_t N, int64_t DIM) {
    UNROLLED for (int64_t c = 0; c < DIM; c += 16) {
        __m256 even[VALUE_HEADS], odd[VALUE_HEADS];
        UNROLLED for (int64_t h = 0; h < N; h++) {
            even[h] = _mm256_loadu_ps(acc + h * DIM + c);
            odd[h] = _mm256_loadu_ps(acc + h * DIM + c + 8);
        }
        for (int64_t t = t0; t < end; t++) {
            __m256i raw = load8x32(v_head + off[t] + c);
            __m256 e = even_dims(raw), o = odd_dims(raw);
            UNROLLED for (int64_t h = 0; h < N; h++) {
                __m256 w = _mm256_broadcast_ss(p + h * stride + t);
                even[h] = _mm256_fmadd_ps(e, w, even[h]);
                odd[h] = _mm256_fmadd_ps(o, w, odd[h]);
            }
        }
        UNROLLED for (int64_t h = 0; h < N; h++) {
            _mm256_storeu_ps(acc + h * DIM + c, even[h]);
            _mm256_storeu_ps(acc + h * DIM + c + 8, odd[h]);
        }
    }
}

/* QT queries of one sequence, every head: query i is `q[i]` ([KV * GROUP][DIM] bf16) over
 * tokens firsts[i] .. lens[i] - 1 (lens[QT - 1] the longest, firsts[i] 0 without a window),
 * `off[t]` token t's row in the caches (elements), `soft_cap` 0 or the scores' cap, `sinks`
 * the KV * GROUP heads' sink logits (NULL: none). The queries share each key row's load and
 * widening (prefill chunks: a run of consecutive positions). Scratch: `qf` and `acc` hold
 * KV * GROUP * DIM floats per query, `scores` QT * KV * GROUP rows of `stride` (>= lens[QT - 1]
 * + SCORE_STEP), `part` QT * KV * GROUP * SCORE_STEP vectors. Rows are read whole and in
 * order, a block's tokens in turn. */
static inline __attribute__((always_inline)) void attend_tile_avx2(
        const uint16_t *const *q, const int64_t *firsts, const int64_t *lens, int64_t QT,
        const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *off, int64_t KV,
        int64_t GROUP, int64_t DIM, float scale, float soft_cap, const float *sinks,
        int64_t stride, float *qf, float *scores, __m256 *part, float *acc,
        uint16_t *const *out) {
    int64_t heads = KV * GROUP, row_bytes = KV * DIM * 2, asked = 0, len = lens[QT - 1];
    for (int64_t i = 0; i < QT; i++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t d = 0; d < DIM; d += 2) {  /* dims 2j, 2j + 1 -> j, 8 + j of their 16 */
                int64_t at = (i * heads + h) * DIM + (d & ~15) + (d & 15) / 2;
                qf[at] = bf16_to_f32(q[i][h * DIM + d]) * scale;
                qf[at + 8] = bf16_to_f32(q[i][h * DIM + d + 1]) * scale;
            }
    for (int64_t t0 = 0; t0 < len; t0 += SCORE_STEP) {
        int64_t until = t0 + SCORE_STEP + PREFETCH_TOKENS;
        ask_rows(k_cache, off, &asked, until < len ? until : len, row_bytes);
        for (int u = 0; u < SCORE_STEP; u++) {  /* past the end: the last row (weight 0) */
            const uint16_t *k = k_cache + off[t0 + u < len ? t0 + u : len - 1];
            for (int64_t g = 0; g < KV; g++) {
                __m256 sum[MAX_TILE_SUMS];
                UNROLLED for (int64_t j = 0; j < QT * GROUP; j++) sum[j] = _mm256_setzero_ps();
                UNROLLED for (int64_t c = 0; c < DIM; c += 16) {
                    __m256i raw = load8x32(k + g * DIM + c);
                    __m256 e = even_dims(raw), o = odd_dims(raw);
                    UNROLLED for (int64_t j = 0; j < QT * GROUP; j++) {  /* query j / GROUP */
                        const float *qh = qf + ((j / GROUP * KV + g) * GROUP + j % GROUP) * DIM;
                        sum[j] = _mm256_fmadd_ps(e, _mm256_loadu_ps(qh + c), sum[j]);
                        sum[j] = _mm256_fmadd_ps(o, _mm256_loadu_ps(qh + c + 8), sum[j]);
                    }
                }
                UNROLLED for (int64_t j = 0; j < QT * GROUP; j++)
                    part[((j / GROUP * KV + g) * GROUP + j % GROUP) * SCORE_STEP + u] = sum[j];
            }
        }
        for (int64_t h = 0; h < QT * heads; h++)  /* stride has slack past len */
            _mm256_storeu_ps(scores + h * stride + t0, sum8(part + h * SCORE_STEP));
    }
    for (int64_t h = 0; h < QT * heads; h++) {  /* a shorter query's tail gets weight 0 */
        float *s = scores + h * stride;
        int64_t first = firsts[h / heads], end = lens[h / heads];
        for (int64_t t = 0; t < first; t++) s[t] = 0.0f;  /* before its window: weight 0 */
        if (soft_cap > 0.0f) soft_cap_scores(s + first, end - first, soft_cap);
        float sink = sinks ? sinks[h % heads] : -INFINITY;
        float sum = exp_shifted_sink(s + first, end - first, len - end, sink);
        s[len] = sum > 0.0f ? 1.0f / sum : 0.0f;  /* len 0: zeros */
    }
    for (int64_t i = 0; i < QT * heads * DIM; i++) acc[i] = 0.0f;
    asked = 0;
    for (int64_t t0 = 0; t0 < len; t0 += VALUE_STEP) {
        int64_t end = t0 + VALUE_STEP < len ? t0 + VALUE_STEP : len;
        int64_t until = end + PREFETCH_TOKENS;
        ask_rows(v_cache, off, &asked, until < len ? until : len, row_bytes);
        for (int64_t g = 0; g < QT * KV; g++) {  /* (query, KV head): its GROUP rows */
            const uint16_t *v_head = v_cache + g % KV * DIM;
            int64_t first = 0;
            for (; first + VALUE_HEADS <= GROUP; first += VALUE_HEADS)
                weigh_values(v_head, off, t0, end, scores + (g * GROUP + first) * stride, stride,
                             acc + (g * GROUP + first) * DIM, VALUE_HEADS, DIM);
            if (GROUP % VALUE_HEADS)
                weigh_values(v_head, off, t0, end, scores + (g * GROUP + first) * stride, stride,
                             acc + (g * GROUP + first) * DIM, GROUP % VALUE_HEADS, DIM);
        }
    }
    for (int64_t h = 0; h < QT * heads; h++) {
        float inv = scores[h * stride + len];
        uint16_t *o = out[h / heads] + h % heads * DIM;
        for (int64_t d = 0; d < DIM; d += 2) {
            int64_t at = h * DIM + (d & ~15) + (d & 15) / 2;
            o[d] = f32_to_bf16(acc[at] * inv);
            o[d + 1] = f32_to_bf16(acc[at + 8] * inv);
        }
    }
}

/* Whether work item s continues item s - 1's run: the next position of the same sequence
 * (the same blocks, as far as it reads). */
static int continues(const int32_t *block_tables, int64_t table_stride, const int32_t *lens,
                     int64_t s, int64_t block_size) {
    if (s == 0 || lens[s] != lens[s - 1] + 1 || lens[s - 1] == 0) return 0;
    size_t bytes = sizeof(int32_t) * (size_t)((lens[s] + block_size - 1) / block_size);
    return memcmp(block_tables + s * table_stride, block_tables + (s - 1) * table_stride,
                  bytes) == 0;
}

/* attend_tile_avx2 with QT, GROUP and DIM literal for the common shapes (their loops unroll,
 * sums stay in registers), each its own function (one with all of them inlined spilled its
 * pointers inside the loops), and one for any shape; KV literal 1 for the items of one KV
 * head (1.2x faster there than KV = 1 at run time). */
typedef void (*tile_fn)(const uint16_t *const *, const int64_t *, const int64_t *,
                        const uint16_t *, const uint16_t *, const int64_t *, int64_t, int64_t,
                        int64_t, float, float, const float *, int64_t, float *, float *,
                        __m256 *, float *, uint16_t *const *);
#define TILE_FN(NAME, QT, KV, G, D)                                                           \
    static void NAME(const uint16_t *const *q, const int64_t *firsts, const int64_t *lens,    \
                     const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *off,    \
                     int64_t kv, int64_t group, int64_t dim, float scale, float soft_cap,     \
                     const float *sinks, int64_t stride, float *qf, float *scores,            \
                     __m256 *part, float *acc, uint16_t *const *out) {                        \
        (void)kv, (void)group, (void)dim;                                                     \
        attend_tile_avx2(q, firsts, lens, QT, k_cache, v_cache, off, KV, G, D, scale,         \
                         soft_cap, sinks, stride, qf, scores, part, acc, out);                \
    }
TILE_FN(one_any, 1, kv, group, dim)
TILE_FN(one_3x64, 1, kv, 3, 64)
TILE_FN(one_4x64, 1, kv, 4, 64)
TILE_FN(one_1x128, 1, kv, 1, 128)
TILE_FN(one_4x128, 1, kv, 4, 128)
TILE_FN(one_8x128, 1, kv, 8, 128)
TILE_FN(tile_any, QUERY_TILE, kv, group, dim)
TILE_FN(tile_3x64, QUERY_TILE, kv, 3, 64)
TILE_FN(tile_1x128, QUERY_TILE, kv, 1, 128)
TILE_FN(head_any, 1, 1, group, dim)
TILE_FN(head_3x64, 1, 1, 3, 64)
TILE_FN(head_4x64, 1, 1, 4, 64)
TILE_FN(head_4x128, 1, 1, 4, 128)
TILE_FN(head_8x128, 1, 1, 8, 128)
#undef TILE_FN

/* The function for tiles of `tile` queries (1 or QUERY_TILE) of `group` x `dim` heads; `split`:
 * of one KV head (one query per tile only). */
static tile_fn pick_tile(int64_t tile, int64_t group, int64_t dim, int split) {
    if (split)
        return group == 3 && dim == 64    ? head_3x64
             : group == 4 && dim == 64    ? head_4x64
             : group == 4 && dim == 128   ? head_4x128
             : group == 8 && dim == 128   ? head_8x128
                                          : head_any;
    if (tile > 1)
        return group == 3 && dim == 64 ? tile_3x64 : group == 1 && dim == 128 ? tile_1x128
                                                                                : tile_any;
    return group == 3 && dim == 64    ? one_3x64
         : group == 4 && dim == 64    ? one_4x64
         : group == 1 && dim == 128   ? one_1x128
         : group == 4 && dim == 128   ? one_4x128
         : group == 8 && dim == 128   ? one_8x128
                                      : one_any;
}

/* Every sequence of a bf16 batch on the AVX2 path. Tiles are up to QUERY_TILE consecutive
 * positions of one sequence (a prefill chunk's tokens), else one query; a work item is a tile
 * (every head), or, with fewer queries than threads, one KV head of a tile. */
static int attend_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int32_t *block_tables, int64_t table_stride,
                       const int32_t *context_lens, uint16_t *out, int64_t num_seqs,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t max_context, float scale, int64_t window,
                       float soft_cap, const float *sinks) {
    int64_t group = num_heads / num_kv_heads, kv_dim = num_kv_heads * head_dim;
    int64_t stride = max_context + SCORE_STEP, q_dim = num_heads * head_dim;
    int64_t tile = group <= MAX_TILE_SUMS / QUERY_TILE ? QUERY_TILE : 1, tiles = 0;
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!starts) return -1;
    for (int64_t s = 0, run = 0; s < num_seqs; s++) {  /* tile starts */
        run = continues(block_tables, table_stride, context_lens, s, block_size) ? run + 1 : 0;
        if (run % tile == 0) starts[tiles++] = s;
    }
    starts[tiles] = num_seqs;
    /* fewer queries than threads (a lone sequence's step): items of one KV head each, so the
     * heads share the cores (1.1-1.2x at 1 x 500 tokens, 1.1-1.3x at 1 x 2000, 2 threads).
     * With more, each item reads whole rows: cold rows stream faster whole than a slice at a
     * time (batch 16 x 250: 0.93x, as slices one head after another). The same bits either
     * way. */
    int split = num_seqs < omp_get_max_threads() && num_kv_heads > 1;
    int64_t kv = split ? 1 : num_kv_heads, parts = num_kv_heads / kv, part_dim = kv * head_dim;
    tile_fn one = pick_tile(1, group, head_dim, split), many = pick_tile(tile, group, head_dim, 0);
    int failed = 0;
#pragma omp parallel
    {
        float *qf = malloc(sizeof(float) * (size_t)(tile * q_dim));
        float *acc = malloc(sizeof(float) * (size_t)(tile * q_dim));
        float *scores = malloc(sizeof(float) * (size_t)(tile * num_heads * stride));
        __m256 *part = aligned_alloc(32, sizeof(__m256) * (size_t)(tile * num_heads * SCORE_STEP));
        int64_t *off = malloc(sizeof(int64_t) * (size_t)(max_context > 0 ? max_context : 1));
        int ok = qf && acc && scores && part && off;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tiles * parts; item++) {
            if (!ok) continue;
            int64_t i = item % tiles, first = item / tiles * part_dim;  /* tile i, from dim */
            int64_t s = starts[i], n = starts[i + 1] - s, len = context_lens[s + n - 1];
            const int32_t *table = block_tables + (s + n - 1) * table_stride;  /* the longest */
            /* rows from the shortest query's first visible key: off[0] is token `lo` */
            int64_t lo = window_start(context_lens[s], window);
            for (int64_t t = lo, b = lo / block_size, j = lo % block_size; t < len; b++, j = 0)
                for (int64_t base = (int64_t)table[b] * block_size * kv_dim + first;
                     j < block_size && t < len; j++)  /* block by block: no division */
                    off[t++ - lo] = base + j * kv_dim;
            const uint16_t *qs[QUERY_TILE];
            uint16_t *os[QUERY_TILE];
            int64_t firsts[QUERY_TILE], lens[QUERY_TILE];
            for (int64_t j = 0; j < tile; j++) {  /* a short tile repeats its first query */
                int64_t at = j < n ? s + n - 1 - j : s;  /* longest last: reversed */
                qs[tile - 1 - j] = q + at * q_stride + first * group;
                os[tile - 1 - j] = out + at * q_dim + first * group;
                firsts[tile - 1 - j] = window_start(context_lens[at], window) - lo;
                lens[tile - 1 - j] = context_lens[at] - lo;
            }
            const float *item_sinks = sinks ? sinks + first / head_dim * group : NULL;
            (n == 1 ? one : many)(qs, firsts, lens, k_cache, v_cache, off, kv, group, head_dim,
                                  scale, soft_cap, item_sinks, stride, qf, scores, part, acc,
                                  os);
        }
        free(qf);
        free(acc);
        free(scores);
        free(part);
        free(off);
    }
    free(starts);
    return failed ? -1 : 0;
}
#endif
#endif
