/* Decode attention for bf16 caches on CPUs with AVX512-BF16 (`vdpbf16ps`), included by
 * paged_decode_attention.c. One work item is one sequence, its KV heads one after the
 * other: the GROUP query heads that share a KV head read its key and value rows straight from
 * the cache, in bf16, never converted to fp32.
 *
 * - Scores: q . k as bf16 pairs summed into fp32 (the products are exact), 16 tokens at a
 *   time, the 16 dots of a head summed together by `sum16`.
 * - Softmax in fp32; the probabilities, kept unnormalized (at most 1), are rounded to bf16 for
 *   the weighted sum of the values, as the Triton kernel and flash attention on GPUs do.
 * - Values two tokens at a time: their rows interleaved (`unpacklo/hi`) so that one
 *   `vdpbf16ps` with the pair of probabilities adds both tokens to 16 dims of the output. The
 *   interleave leaves the dims in a fixed permuted order, undone once at the end.
 *
 * Per token and KV head of SmolLM2 (3 query heads, head_dim 64) that is 6 dots and 12 value
 * instructions where the fp32 path converts 128 values and runs 48 fp32 FMAs: ~2.5x fewer
 * instructions. What is left is memory: blocks lie anywhere in the cache, so the hardware
 * prefetchers lose the stream at every block, and a head's slice is a third of each row here.
 * The first KV head's pass asks for the whole rows (every head's keys and values) a few tokens
 * ahead, into L2, where the other heads' passes find them: 1.2x over asking for each head's
 * slice in its own pass, 1.2-1.4x over the fp32 path per step's attention (cold caches).
 *
 * A sliding window starts the walks at the window's first key; a soft cap rewrites the fp32
 * scores before their softmax, and a head's sink joins its softmax's denominator
 * (attention_math.h).
 */
#ifndef PDSERVE_DECODE_ATTENTION_BF16_H
#define PDSERVE_DECODE_ATTENTION_BF16_H

#ifdef __AVX512BF16__
#include <immintrin.h>
#include <stdint.h>

#include "attention_math.h" /* exp_shifted, sum16 */
#include "bf16.h"

#define BF16_PATH 1
#define MAX_DIM_VECS 8 /* head_dim <= 256: up to 8 vectors of 32 bf16 */
#define MAX_GROUP 8     /* query heads per KV head */
#define BF16_DIM_STEP 32 /* head_dim: a multiple of 32 */
#define BF16_MAX_DIM (32 * MAX_DIM_VECS)

/* Rows of one KV head, token by token through the block table (no division per token). */
typedef struct {
    const uint16_t *cache, *row;
    const int32_t *table;
    int64_t block_size, kv_dim, head_off, block, in_block;
} HeadWalk;

/* A walk whose first `walk_next` is token `first`: it stands where token first - 1 left it. */
static inline void walk_start(HeadWalk *w, const uint16_t *cache, const int32_t *table,
                              int64_t block_size, int64_t kv_dim, int64_t head_off,
                              int64_t first) {
    HeadWalk start = {cache, NULL, table, block_size, kv_dim, head_off, -1, block_size};
    if (first > 0) {
        start.block = (first - 1) / block_size;
        start.in_block = (first - 1) % block_size + 1;
        start.row = cache + (int64_t)table[start.block] * block_size * kv_dim + head_off
                  + (start.in_block - 1) * kv_dim;
    }
    *w = start;
}

/* The next token's row (every call must stay within the sequence's length). */
static inline const uint16_t *walk_next(HeadWalk *w) {
    if (w->in_block == w->block_size) {
        w->block++;
        w->in_block = 0;
        w->row = w->cache + (int64_t)w->table[w->block] * w->block_size * w->kv_dim + w->head_off;
    } else {
        w->row += w->kv_dim;
    }
    w->in_block++;
    return w->row;
}

static inline __m512bh bf16x32(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

/* Tokens the scores pass asks for ahead of the one it reads. */
#define PREFETCH_TOKENS 32

/* Ask for the next token's key and value rows (`bytes` each, into L2) ahead of their use. */
static inline void prefetch_next(HeadWalk *k, HeadWalk *v, int64_t bytes) {
    const char *kr = (const char *)walk_next(k), *vr = (const char *)walk_next(v);
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(kr + b, 0, 1);
        __builtin_prefetch(vr + b, 0, 1);
    }
}

/* One (sequence, KV head): `q` and `out` are its GROUP heads ([GROUP][DIM] bf16, contiguous),
 * `sinks` their GROUP sink logits (NULL: none);
 * `scores` holds GROUP x stride floats, `probs` GROUP x stride bf16 (stride >= len + 16).
 * `prefetch_bytes` of each row, from its start, are asked for ahead (0: none). */
static inline __attribute__((always_inline)) void attend_group_bf16(
        const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
        const int32_t *table, int64_t len, int64_t GROUP, int64_t DIM, int64_t block_size,
        int64_t kv_dim, int64_t head_off, float scale, int64_t window, float soft_cap,
        const float *sinks, int64_t stride, float *scores, uint16_t *probs, uint16_t *out,
        int64_t prefetch_bytes) {
    const int64_t nv = DIM / 32, first = window_start(len, window);
    len -= first;  /* from here on, tokens count from the window's first */
    HeadWalk w, kp, vp;
    walk_start(&w, k_cache, table, block_size, kv_dim, head_off, first);
    walk_start(&kp, k_cache, table, block_size, kv_dim, head_off, first);
    walk_start(&vp, v_cache, table, block_size, kv_dim, head_off, first);
    int64_t ahead = 0;  /* tokens whose rows were asked for */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        /* the rows of the next PREFETCH_TOKENS tokens (values too, read after the scores) */
        int64_t until = t0 + 16 + PREFETCH_TOKENS < len ? t0 + 16 + PREFETCH_TOKENS : len;
        for (; ahead < until && prefetch_bytes; ahead++) prefetch_next(&kp, &vp, prefetch_bytes);
        const uint16_t *rows[16];
        for (int u = 0; u < 16; u++)  /* past the end: the last row again (masked below) */
            rows[u] = t0 + u < len ? walk_next(&w) : rows[u - 1];
        for (int64_t h = 0; h < GROUP; h++) {
            v16 part[16];
            for (int u = 0; u < 16; u++) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < nv; c++)
                    acc = _mm512_dpbf16_ps(acc, bf16x32(q + h * DIM + 32 * c),
                                           bf16x32(rows[u] + 32 * c));
                part[u] = (v16)acc;
            }
            v16 s = sum16(part) * scale;
            __builtin_memcpy(scores + h * stride + t0, &s, sizeof s);  /* stride has slack */
        }
    }
    float sums[MAX_GROUP];
    for (int64_t h = 0; h < GROUP; h++) {
        float *s = scores + h * stride;
        if (soft_cap > 0.0f) soft_cap_scores(s, len, soft_cap);
        float sink = sinks ? sinks[h] : -INFINITY;
        sums[h] = exp_shifted_sink(s, len, 16, sink);  /* the tail: the last pair's partner, 0 */
        uint16_t *p = probs + h * stride;
        for (int64_t t = 0; t < len + 1; t += 16)
            _mm256_storeu_si256((__m256i *)(p + t),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
    }
    __m512 acc[MAX_GROUP][2 * MAX_DIM_VECS];
    for (int64_t h = 0; h < GROUP; h++)
        for (int64_t c = 0; c < 2 * nv; c++) acc[h][c] = _mm512_setzero_ps();
    walk_start(&w, v_cache, table, block_size, kv_dim, head_off, first);
    for (int64_t t = 0; t < len; t += 2) {
        const uint16_t *a = walk_next(&w), *b = t + 1 < len ? walk_next(&w) : a;  /* p = 0 */
        __m512i lo[MAX_DIM_VECS], hi[MAX_DIM_VECS];
        for (int64_t c = 0; c < nv; c++) {
            __m512i x = _mm512_loadu_si512(a + 32 * c), y = _mm512_loadu_si512(b + 32 * c);
            lo[c] = _mm512_unpacklo_epi16(x, y);
            hi[c] = _mm512_unpackhi_epi16(x, y);
        }
        for (int64_t h = 0; h < GROUP; h++) {
            int32_t pair;
            __builtin_memcpy(&pair, probs + h * stride + t, sizeof pair);
            __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
            for (int64_t c = 0; c < nv; c++) {
                acc[h][2 * c] = _mm512_dpbf16_ps(acc[h][2 * c], (__m512bh)lo[c], pp);
                acc[h][2 * c + 1] = _mm512_dpbf16_ps(acc[h][2 * c + 1], (__m512bh)hi[c], pp);
            }
        }
    }
    /* Lane i of the lo (hi) sum of vector c is dim 32c + 8(i / 4) + i % 4 (+ 4). */
    for (int64_t h = 0; h < GROUP; h++) {
        float inv = sums[h] > 0.0f ? 1.0f / sums[h] : 0.0f, lanes[32];  /* len 0: zeros */
        for (int64_t c = 0; c < nv; c++) {
            _mm512_storeu_ps(lanes, acc[h][2 * c]);
            _mm512_storeu_ps(lanes + 16, acc[h][2 * c + 1]);
            for (int i = 0; i < 16; i++) {
                int64_t d = 32 * c + 8 * (i / 4) + i % 4;
                out[h * DIM + d] = f32_to_bf16(lanes[i] * inv);
                out[h * DIM + d + 4] = f32_to_bf16(lanes[16 + i] * inv);
            }
        }
    }
}

/* Every sequence of a bf16 batch on the AVX512-BF16 path, its KV heads in turn, with GROUP and
 * DIM literal for the common shapes (their loops unroll, sums stay in registers). */
static int attend_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int32_t *block_tables, int64_t table_stride,
                       const int32_t *context_lens, uint16_t *out, int64_t num_seqs,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t max_context, float scale, int64_t window,
                       float soft_cap, const float *sinks) {
    int64_t group = num_heads / num_kv_heads, kv_dim = num_kv_heads * head_dim;
    int64_t stride = max_context + 32;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * stride));
        uint16_t *probs = malloc(sizeof(uint16_t) * (size_t)(group * stride));
        int ok = scores && probs;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t g = 0; g < num_kv_heads; g++) {
            if (!ok) continue;
            const uint16_t *qg = q + s * q_stride + g * group * head_dim;
            uint16_t *og = out + s * num_heads * head_dim + g * group * head_dim;
#define GROUP_BF16(G, D)                                                                      \
    attend_group_bf16(qg, k_cache, v_cache, block_tables + s * table_stride, context_lens[s],  \
                      G, D, block_size, kv_dim, g * head_dim, scale, window, soft_cap,         \
                      sinks ? sinks + g * group : NULL, stride, scores, probs, og,             \
                      g ? 0 : 2 * kv_dim)  /* head 0 asks for the whole rows */
            if (group == 3 && head_dim == 64) GROUP_BF16(3, 64);
            else if (group == 4 && head_dim == 64) GROUP_BF16(4, 64);
            else if (group == 1 && head_dim == 128) GROUP_BF16(1, 128);
            else if (group == 4 && head_dim == 128) GROUP_BF16(4, 128);
            else if (group == 8 && head_dim == 128) GROUP_BF16(8, 128);
            else GROUP_BF16(group, head_dim);
#undef GROUP_BF16
        }
        free(scores);
        free(probs);
    }
    return failed ? -1 : 0;
}
#endif /* __AVX512BF16__ */
#endif
