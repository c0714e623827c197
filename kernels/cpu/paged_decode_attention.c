/* Paged decode attention on the CPU: one query token per sequence, K/V read in place.
 *
 * The torch reference copies every sequence's blocks out of the cache before SDPA reads them
 * again; this reads each cached key and value once, straight through the block table. One work
 * item per sequence: each cached token row (every KV head, contiguous) is loaded once and scored
 * against all query heads; the heads that share a KV head (GQA) read the same slice of it. Two
 * passes over the context: scores (q . k, fp32) and their softmax, then the probability-weighted
 * sum of the values. Head sizes that are a multiple of 16 take both passes 16 tokens at a time
 * in 16-float vectors: the dots of 16 tokens are summed together by one shuffle tree (`sum16`)
 * and each head's accumulator stays in registers over 16 value rows (1.35x on 2 threads at
 * batch 16, ~400 tokens); other sizes 4 at a time with plain loops. Items are
 * spread over the OpenMP threads of the calling process (torch's own runtime: this library is
 * loaded into a process that already has libgomp, and shares it).
 *
 * bf16 caches on a CPU with AVX512-BF16, head sizes a multiple of 32 and up to 8 query heads
 * per KV head take `decode_attention_bf16.h` instead: bf16 dot products, no conversion, rows
 * asked for ahead of use (1.2-1.4x per step's attention). On a CPU with AVX2 and FMA but not
 * AVX512-BF16, bf16 caches with head sizes a multiple of 16 take `decode_attention_bf16_avx2.h`
 * (widened in registers; a prefill chunk's positions 4 to a work item).
 *
 * Per-layer variants (`paged_decode_attention_variant`; 0 = off, `paged_decode_attention` is
 * both off): a sliding window of W keys starts each query's walk at its first visible key
 * (len - W: the keys before it are never read, their blocks never touched), and a soft cap c
 * turns each score s (scaled) into c * tanh(s / c) before the softmax. Every path takes both,
 * and with both off computes what it did before they were added. Attention sinks
 * (`paged_decode_attention_sinks`: gpt-oss; NULL = none) give each query head one more logit
 * in its softmax's denominator, with no value (`exp_shifted_sink`).
 *
 * Layouts (element strides; the Python wrapper checks them):
 *   q        [num_seqs, num_heads, head_dim]   token stride q_stride, head stride head_dim
 *   caches   [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   out      [num_seqs, num_heads, head_dim], contiguous
 * dtype: 0 = float32, 1 = bfloat16 (math in fp32, rounded to nearest even on store).
 */
#include <stdlib.h>
#include <string.h>

#include "attention_math.h"
#include "bf16.h"

#define UNROLL 4 /* tokens per group in the loops below (the code spells out 4) */
#define SCORE_TOKENS 16 /* tokens per group of the scores pass, when head_dim % 16 == 0 */

/* The scores of SCORE_TOKENS rows (fp32, kv_dim apart) for one query head: lane u is
 * q . row u's head slice. head_dim is a multiple of 16. */
static inline v16 dot16(const float *qh, const float *kh, int64_t head_dim, int64_t kv_dim) {
    v16 part[SCORE_TOKENS];
    for (int u = 0; u < SCORE_TOKENS; u++) {
        const float *k = kh + u * kv_dim;
        v16 acc = *(const v16 *)qh * *(const v16 *)k;
        for (int64_t d = 16; d < head_dim; d += 16)
            acc += *(const v16 *)(qh + d) * *(const v16 *)(k + d);
        part[u] = acc;
    }
    return sum16(part);
}

#include "decode_attention_bf16.h"      /* AVX512-BF16: attend_bf16, BF16_PATH */
#include "decode_attention_bf16_avx2.h" /* AVX2 + FMA: attend_bf16, BF16_PATH */

/* dst[0:n] = src[0:n] * mul, as fp32. */
static inline void load_row(const void *src, int dtype, int64_t n, float mul, float *dst) {
    if (dtype == 1) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]) * mul;
    } else {
        const float *s = (const float *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = s[i] * mul;
    }
}

static inline void store_row(const float *src, int dtype, int64_t n, float mul, void *dst) {
    if (dtype == 1) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i] * mul);
    } else {
        float *d = (float *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = src[i] * mul;
    }
}

/* Walks one sequence's cached rows through its block table, block by block (a division per
 * token costs more than the dots). */
typedef struct {
    const char *cache, *block, *row;  /* row: the last one read */
    const int32_t *table;
    int64_t block_size, block_bytes, token_bytes, next_block, in_block, len;
} RowWalk;

/* A walk over `len` rows of one cache from token `start` (0 <= start, start + len <= the
 * sequence's length); token `start` is the walk's token 0. */
static inline RowWalk walk_from(const char *cache, const int32_t *table, int64_t block_size,
                                int64_t token_bytes, int64_t start, int64_t len) {
    RowWalk w = {cache, NULL, NULL, table, block_size, block_size * token_bytes, token_bytes,
                 start / block_size, block_size, len};
    if (start % block_size && len > 0) {  /* mid-block: that block is already the current one */
        w.block = cache + (int64_t)table[w.next_block++] * w.block_bytes;
        w.in_block = start % block_size;
    }
    return w;
}

/* The next UNROLL rows from token t0, each converted into `out` (kv_dim floats apiece); past
 * the end the last row repeats (its probability is 0). */
static inline void next_rows(RowWalk *w, int64_t t0, int dtype, int64_t kv_dim, float *out) {
    for (int u = 0; u < UNROLL; u++) {
        if (t0 + u < w->len) {
            if (w->in_block == w->block_size) {
                w->block = w->cache + (int64_t)w->table[w->next_block++] * w->block_bytes;
                w->in_block = 0;
            }
            w->row = w->block + w->in_block++ * w->token_bytes;
        }
        load_row(w->row, dtype, kv_dim, 1.0f, out + u * kv_dim);
    }
}

/* Tokens ahead of the scores pass whose key and value rows it asks for (into L2, where the
 * values pass finds them too): blocks lie anywhere in the cache, so the hardware prefetchers
 * lose the stream at every block boundary. */
#define AHEAD_TOKENS 32

/* Asks for the rows of the walk's tokens up to `until` (keys through `w`, the values at the
 * same offsets in `v_cache`); `w` is a walk of its own, ahead of the one that reads. */
static inline void ask_ahead(RowWalk *w, const char *v_cache, int64_t *asked, int64_t until) {
    for (; *asked < until && *asked < w->len; (*asked)++) {
        if (w->in_block == w->block_size) {
            w->block = w->cache + (int64_t)w->table[w->next_block++] * w->block_bytes;
            w->in_block = 0;
        }
        const char *k = w->block + w->in_block++ * w->token_bytes, *v = v_cache + (k - w->cache);
        for (int64_t b = 0; b < w->token_bytes; b += 64) {
            __builtin_prefetch(k + b, 0, 1);
            __builtin_prefetch(v + b, 0, 1);
        }
    }
}

/* One sequence, every head: each cached token row (all KV heads, contiguous) is read once.
 * Always inlined, so the call sites below that pass a literal head_dim get loops of known
 * length (fully unrolled, no remainder code): the common head sizes run ~2x faster. */
static inline __attribute__((always_inline)) void attend_one(const char *q, const char *k_cache, const char *v_cache,
                       const int32_t *table, int64_t len, int64_t num_heads, int64_t group,
                       int64_t head_dim, int64_t block_size, int64_t num_kv_heads, int64_t elem,
                       int dtype, float scale, int64_t window, float soft_cap,
                       const float *sinks, int64_t score_stride, float *qf, float *row,
                       float *scores, float *acc, char *out) {
    int64_t kv_dim = num_kv_heads * head_dim, token_bytes = kv_dim * elem;
    int64_t start = window_start(len, window);
    len -= start;  /* from here on, tokens count from the window's first */
    RowWalk keys = walk_from(k_cache, table, block_size, token_bytes, start, len);
    RowWalk values = walk_from(v_cache, table, block_size, token_bytes, start, len);
    RowWalk ahead = keys;
    int64_t asked = 0;
    load_row(q, dtype, num_heads * head_dim, scale, qf);
    /* Tokens go SCORE_TOKENS at a time where head_dim is a multiple of 16, else UNROLL: each
     * query head is loaded once per group for the dots, each accumulator once per group for
     * the values. */
    int64_t t0 = 0;
    if (head_dim % 16 == 0) {
        for (; t0 < len; t0 += SCORE_TOKENS) {
            ask_ahead(&ahead, v_cache, &asked, t0 + SCORE_TOKENS + AHEAD_TOKENS);
            for (int u = 0; u < SCORE_TOKENS; u += UNROLL)
                next_rows(&keys, t0 + u, dtype, kv_dim, row + u * kv_dim);
            for (int64_t h = 0; h < num_heads; h++) {
                v16 s = dot16(qf + h * head_dim, row + (h / group) * head_dim, head_dim, kv_dim);
                __builtin_memcpy(scores + h * score_stride + t0, &s, sizeof s);  /* slack */
            }
        }
    }
    for (; t0 < len; t0 += UNROLL) {
        ask_ahead(&ahead, v_cache, &asked, t0 + UNROLL + AHEAD_TOKENS);
        next_rows(&keys, t0, dtype, kv_dim, row);
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = qf + h * head_dim, *kh = row + (h / group) * head_dim;
            float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
            for (int64_t d = 0; d < head_dim; d++) {
                d0 += qh[d] * kh[d];
                d1 += qh[d] * kh[kv_dim + d];
                d2 += qh[d] * kh[2 * kv_dim + d];
                d3 += qh[d] * kh[3 * kv_dim + d];
            }
            float *s = scores + h * score_stride + t0;
            s[0] = d0, s[1] = d1, s[2] = d2, s[3] = d3;  /* scores has UNROLL slots of slack */
        }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        float *s = scores + h * score_stride;
        if (soft_cap > 0.0f) soft_cap_scores(s, len, soft_cap);
        float sink = sinks ? sinks[h] : -INFINITY;
        float sum = exp_shifted_sink(s, len, SCORE_TOKENS, sink);  /* the tail gets weight 0 */
        for (int64_t t = 0; t < len; t++) s[t] /= sum;
    }
    memset(acc, 0, (size_t)(num_heads * head_dim) * sizeof(float));
    t0 = 0;
    if (head_dim % 16 == 0) {  /* 16 rows per group: each accumulator loaded once per group */
        for (; t0 < len; t0 += SCORE_TOKENS) {
            for (int u = 0; u < SCORE_TOKENS; u += UNROLL)
                next_rows(&values, t0 + u, dtype, kv_dim, row + u * kv_dim);
            for (int64_t h = 0; h < num_heads; h++) {
                const float *p = scores + h * score_stride + t0;
                const float *vh = row + (h / group) * head_dim;
                float *a = acc + h * head_dim;
                for (int64_t d = 0; d < head_dim; d += 16) {
                    v16 x = *(v16 *)(a + d);
                    for (int u = 0; u < SCORE_TOKENS; u++)
                        x += p[u] * *(const v16 *)(vh + u * kv_dim + d);
                    *(v16 *)(a + d) = x;
                }
            }
        }
    }
    for (; t0 < len; t0 += UNROLL) {
        next_rows(&values, t0, dtype, kv_dim, row);
        for (int64_t h = 0; h < num_heads; h++) {
            const float *p = scores + h * score_stride + t0, *vh = row + (h / group) * head_dim;
            float *a = acc + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                a[d] += p[0] * vh[d] + p[1] * vh[kv_dim + d] + p[2] * vh[2 * kv_dim + d] +
                        p[3] * vh[3 * kv_dim + d];
        }
    }
    store_row(acc, dtype, num_heads * head_dim, 1.0f, out);
}

/* Every query's attention; `window` keys (0: all), scores capped at `soft_cap` (0: not),
 * `sinks` [num_heads] fp32 each head's sink logit (NULL: none). */
int paged_decode_attention_sinks(const void *q, int64_t q_stride, const void *k_cache,
                                 const void *v_cache, const int32_t *block_tables,
                                 int64_t table_stride, const int32_t *context_lens, void *out,
                                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t max_context,
                                 int dtype, float scale, int64_t window, float soft_cap,
                                 const float *sinks) {
    int64_t group = num_heads / num_kv_heads, elem = dtype == 1 ? 2 : 4;
    int64_t q_dim = num_heads * head_dim, kv_dim = num_kv_heads * head_dim;
    int failed = 0;
#ifdef BF16_PATH
    if (dtype == 1 && head_dim % BF16_DIM_STEP == 0 && head_dim <= BF16_MAX_DIM &&
        group <= MAX_GROUP)
        return attend_bf16(q, q_stride, k_cache, v_cache, block_tables, table_stride,
                           context_lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
                           block_size, max_context, scale, window, soft_cap, sinks);
#endif
#pragma omp parallel
    {
        float *qf = malloc(sizeof(float) * (size_t)q_dim);
        float *acc = malloc(sizeof(float) * (size_t)q_dim);
        float *row = malloc(sizeof(float) * (size_t)(SCORE_TOKENS * kv_dim));
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * (max_context + SCORE_TOKENS)));
        int ok = qf && acc && row && scores;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            if (!ok) continue;
            const char *qs = (const char *)q + s * q_stride * elem;
            const int32_t *table = block_tables + s * table_stride;
            char *os = (char *)out + s * q_dim * elem;
#define ATTEND(HEAD_DIM)                                                                      \
    attend_one(qs, (const char *)k_cache, (const char *)v_cache, table, context_lens[s],      \
               num_heads, group, HEAD_DIM, block_size, num_kv_heads, elem, dtype, scale,      \
               window, soft_cap, sinks, max_context + SCORE_TOKENS, qf, row, scores, acc, os)
            if (head_dim == 64)
                ATTEND(64);
            else if (head_dim == 128)
                ATTEND(128);
            else
                ATTEND(head_dim);
#undef ATTEND
        }
        free(qf);
        free(acc);
        free(row);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* A window and a soft cap, no sinks: the entry decoder_layer.c calls through its pointer. */
int paged_decode_attention_variant(const void *q, int64_t q_stride, const void *k_cache,
                                   const void *v_cache, const int32_t *block_tables,
                                   int64_t table_stride, const int32_t *context_lens,
                                   void *out, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                   int64_t max_context, int dtype, float scale, int64_t window,
                                   float soft_cap) {
    return paged_decode_attention_sinks(q, q_stride, k_cache, v_cache, block_tables,
                                        table_stride, context_lens, out, num_seqs, num_heads,
                                        num_kv_heads, head_dim, block_size, max_context, dtype,
                                        scale, window, soft_cap, NULL);
}

/* Full causal attention, uncapped. */
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache,
                           const void *v_cache, const int32_t *block_tables,
                           int64_t table_stride, const int32_t *context_lens, void *out,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t max_context,
                           int dtype, float scale) {
    return paged_decode_attention_variant(q, q_stride, k_cache, v_cache, block_tables,
                                          table_stride, context_lens, out, num_seqs, num_heads,
                                          num_kv_heads, head_dim, block_size, max_context, dtype,
                                          scale, 0, 0.0f);
}
