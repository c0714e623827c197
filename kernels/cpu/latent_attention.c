/* Paged latent (MLA) decode attention on the CPU: absorbed queries against the latent cache.
 *
 * Every query head of a layer reads the same cached entries (kv_lora_rank latent values, then
 * rope_dim RoPE'd key values), each twice: the whole entry as a key, its latent part as a value.
 * So one work item is a sequence and a block of HEADS query heads, the heads the lanes of one
 * register (16 with AVX-512, else 8): a cached entry is read (and converted to fp32) once per
 * work item, and each of its numbers, broadcast, meets every head of the block in one fused
 * multiply-add, in both passes:
 *
 *   scores  S[u] (HEADS lanes) += entry_u[d] * qT[d]    (qT: the queries transposed, scaled)
 *   values  accT[r] (HEADS lanes) += entry_u[r] * P[u]  (accT: the outputs transposed)
 *
 * with TILE tokens' accumulators in registers. That is a small GEMM per CHUNK tokens, whose rows
 * are converted once into an fp32 buffer both passes read; the softmax is online across chunks
 * (fp32: running max and sum, the accumulator rescaled when a head's max grows). At 16 heads
 * it is ~30 flops per cached bf16 byte (a GQA decode does 2 to 8), so on a CPU the FMAs, not
 * the memory, set the pace (one core of a Xeon with AVX-512: ~100 GFLOP/s at ~3 GB/s).
 * Work items (sequences x head blocks) are spread over the OpenMP threads of the calling
 * process (torch's own runtime, as in paged_decode_attention.c).
 *
 * Layouts (element strides; the Python wrapper checks them):
 *   q      [num_seqs, num_heads, entry_dim]  token stride q_stride, head stride entry_dim
 *   cache  [num_blocks, block_size, entry_dim], contiguous
 *   out    [num_seqs, num_heads, rank], contiguous, in q's dtype
 * dtypes: 0 = float32, 1 = bfloat16 (math in fp32, rounded to nearest even on store).
 */
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define CHUNK 32 /* tokens per softmax step: their rows converted to fp32 once */
#ifdef __AVX512F__
#define HEADS 16 /* query heads per work item: the lanes of one register */
#define TILE 16  /* tokens whose accumulators stay in registers (16 + 1 of 32) */
#else
#define HEADS 8
#define TILE 8   /* 8 + 1 of AVX2's 16 registers */
#endif

typedef float vh __attribute__((vector_size(HEADS * sizeof(float))));  /* one per head */

/* acc + x * y, one fused multiply-add: spelled out, because -std=c11 keeps GCC from
 * contracting a * b + c, and -fassociative-math turns a chain of them into a tree of separate
 * multiplies and adds (2x the instructions in the values pass). */
static inline vh fma_heads(float x, vh y, vh acc) {
#if defined(__AVX512F__)
    return (vh)_mm512_fmadd_ps(_mm512_set1_ps(x), (__m512)y, (__m512)acc);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vh)_mm256_fmadd_ps(_mm256_set1_ps(x), (__m256)y, (__m256)acc);
#else
    return acc + x * y;
#endif
}

/* dst[0:n] = src[0:n] as fp32. */
static inline void to_f32(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == 1) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* The transposed, scaled queries of heads h0..h0+nh: qT[d][lane]; lanes past nh are 0. */
static void load_queries(const char *q, int dtype, int64_t entry_dim, int nh, float scale,
                         float *row, vh *qT) {
    int64_t elem = dtype == 1 ? 2 : 4;
    memset(qT, 0, (size_t)entry_dim * sizeof(vh));
    for (int h = 0; h < nh; h++) {
        to_f32(q + h * entry_dim * elem, dtype, entry_dim, row);
        for (int64_t d = 0; d < entry_dim; d++) qT[d][h] = row[d] * scale;
    }
}

/* Rows t0..t0+n of one sequence into `rows` (entry_dim floats apiece), through its block
 * table; the rows from n up to the next multiple of TILE are zeroed (their weight is 0, and
 * uninitialised memory could hold NaN). The next chunk's rows are asked for on the way. */
ALWAYS_INLINE void load_chunk(const char *cache, int dtype, const int32_t *table,
                              int64_t block_size, int64_t entry_dim, int64_t t0, int64_t n,
                              int64_t len, float *rows) {
    int64_t row_bytes = entry_dim * (dtype == 1 ? 2 : 4);
    for (int64_t u = 0; u < n; u++) {
        int64_t t = t0 + u, ahead = t + CHUNK;
        const char *row = cache + ((int64_t)table[t / block_size] * block_size
                                   + t % block_size) * row_bytes;
        to_f32(row, dtype, entry_dim, rows + u * entry_dim);
        if (ahead < len) {
            const char *next = cache + ((int64_t)table[ahead / block_size] * block_size
                                        + ahead % block_size) * row_bytes;
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b, 0, 1);
        }
    }
    int64_t padded = (n + TILE - 1) / TILE * TILE;
    memset(rows + n * entry_dim, 0, (size_t)((padded - n) * entry_dim) * sizeof(float));
}

/* scores[u] = qT . row u for u < n (rounded up to TILE), HEADS heads per vector. */
ALWAYS_INLINE void chunk_scores(const float *rows, const vh *qT, int64_t entry_dim, int64_t n,
                                vh *scores) {
    for (int64_t u0 = 0; u0 < n; u0 += TILE) {
        const float *r = rows + u0 * entry_dim;
        vh s[TILE] = {0};
        for (int64_t d = 0; d < entry_dim; d++) {
            vh qd = qT[d];
            for (int u = 0; u < TILE; u++) s[u] = fma_heads(r[u * entry_dim + d], qd, s[u]);
        }
        for (int u = 0; u < TILE; u++) scores[u0 + u] = s[u];
    }
}

/* exp(x) lane by lane, for x <= 0 (vectorized by the loop). */
static inline vh exp_heads(vh x) {
    float a[HEADS];
    __builtin_memcpy(a, &x, sizeof a);
#pragma omp simd
    for (int i = 0; i < HEADS; i++) a[i] = exp_nonpositive(a[i]);
    __builtin_memcpy(&x, a, sizeof a);
    return x;
}

static inline vh max_heads(vh a, vh b) {
    for (int i = 0; i < HEADS; i++) a[i] = a[i] > b[i] ? a[i] : b[i];
    return a;
}

/* The online softmax's step over one chunk's scores: the running max and sum updated, the
 * scores turned into weights (0 from n up to the next multiple of TILE), the accumulator
 * rescaled where a head's max grew. */
static void chunk_softmax(vh *scores, int64_t n, int64_t rank, vh *m, vh *l, vh *accT) {
    vh top = *m;
    for (int64_t u = 0; u < n; u++) top = max_heads(top, scores[u]);
    vh alpha = exp_heads(*m - top), sum = {0};
    for (int64_t u = 0; u < n; u++) sum += (scores[u] = exp_heads(scores[u] - top));
    for (int64_t u = n; u % TILE; u++) scores[u] = (vh){0};
    *l = *l * alpha + sum;
    *m = top;
    int grew = 0;
    for (int i = 0; i < HEADS; i++) grew |= alpha[i] != 1.0f;
    if (grew)
        for (int64_t r = 0; r < rank; r++) accT[r] *= alpha;
}

/* accT[r] += the sum over u < n of row u's latent value r times its weights. */
ALWAYS_INLINE void chunk_values(const float *rows, const vh *p, int64_t entry_dim,
                                int64_t rank, int64_t n, vh *accT) {
    for (int64_t u0 = 0; u0 < n; u0 += TILE) {
        const float *r = rows + u0 * entry_dim;
        vh w[TILE];
        for (int u = 0; u < TILE; u++) w[u] = p[u0 + u];
        for (int64_t d = 0; d < rank; d++) {
            vh a = accT[d];
            for (int u = 0; u < TILE; u++) a = fma_heads(r[u * entry_dim + d], w[u], a);
            accT[d] = a;
        }
    }
}

/* out[h][r] = accT[r][h] / l[h] for the nh heads of the block, in `dtype`. */
static void store_out(const vh *accT, vh l, int64_t rank, int nh, int dtype, char *out) {
    for (int h = 0; h < nh; h++) {
        float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t r = 0; r < rank; r++) {
            float v = accT[r][h] * inv;
            if (dtype == 1)
                ((uint16_t *)out)[h * rank + r] = f32_to_bf16(v);
            else
                ((float *)out)[h * rank + r] = v;
        }
    }
}

typedef struct { /* what every work item of a call shares */
    const char *q, *cache;
    const int32_t *block_tables, *context_lens;
    char *out;
    int64_t q_stride, table_stride, num_heads, entry_dim, rank, block_size;
    int q_dtype, cache_dtype;
    float scale;
} LatentArgs;

/* One sequence, heads h0..h0+nh (nh <= HEADS). Scratch: qT [entry_dim], accT [rank],
 * scores [CHUNK + TILE] vhs, rows [(CHUNK + TILE) * entry_dim] floats. Always inlined, so
 * the call below with DeepSeek-V2/V3's literal widths gets loops of known length and rows at
 * constant offsets (one pointer, not TILE of them: ~1.2x, noisy). */
ALWAYS_INLINE void attend_heads(const LatentArgs *a, int64_t s, int64_t h0, int64_t entry_dim,
                                int64_t rank, vh *qT, vh *accT, vh *scores, float *rows) {
    int nh = (int)(a->num_heads - h0 < HEADS ? a->num_heads - h0 : HEADS);
    int64_t q_elem = a->q_dtype == 1 ? 2 : 4, len = a->context_lens[s];
    const int32_t *table = a->block_tables + s * a->table_stride;
    load_queries(a->q + (s * a->q_stride + h0 * entry_dim) * q_elem, a->q_dtype, entry_dim, nh,
                 a->scale, rows, qT);
    memset(accT, 0, (size_t)rank * sizeof(vh));
    vh m = {0}, l = {0};
    m -= 1e30f;
    for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
        int64_t n = len - t0 < CHUNK ? len - t0 : CHUNK;
        load_chunk(a->cache, a->cache_dtype, table, a->block_size, entry_dim, t0, n, len, rows);
        chunk_scores(rows, qT, entry_dim, n, scores);
        chunk_softmax(scores, n, rank, &m, &l, accT);
        chunk_values(rows, scores, entry_dim, rank, n, accT);
    }
    store_out(accT, l, rank, nh, a->q_dtype, a->out + (s * a->num_heads + h0) * rank * q_elem);
}

static void attend_any(const LatentArgs *a, int64_t s, int64_t h0, vh *qT, vh *accT,
                       vh *scores, float *rows) {
    attend_heads(a, s, h0, a->entry_dim, a->rank, qT, accT, scores, rows);
}

static void attend_576_512(const LatentArgs *a, int64_t s, int64_t h0, vh *qT, vh *accT,
                           vh *scores, float *rows) {
    attend_heads(a, s, h0, 576, 512, qT, accT, scores, rows);
}

/* Every sequence's absorbed decode; returns -1 if a thread's scratch could not be allocated. */
int paged_latent_decode_attention(const void *q, int64_t q_stride, int q_dtype,
                                  const void *cache, int cache_dtype,
                                  const int32_t *block_tables, int64_t table_stride,
                                  const int32_t *context_lens, void *out, int64_t num_seqs,
                                  int64_t num_heads, int64_t entry_dim, int64_t rank,
                                  int64_t block_size, float scale) {
    LatentArgs a = {q, cache, block_tables, context_lens, out, q_stride, table_stride,
                    num_heads, entry_dim, rank, block_size, q_dtype, cache_dtype, scale};
    int64_t head_blocks = (num_heads + HEADS - 1) / HEADS;
    void (*attend)(const LatentArgs *, int64_t, int64_t, vh *, vh *, vh *, float *) =
        entry_dim == 576 && rank == 512 ? attend_576_512 : attend_any;
    int failed = 0;
#pragma omp parallel
    {
        vh *qT = aligned_alloc(64, (size_t)entry_dim * sizeof(vh));
        vh *accT = aligned_alloc(64, (size_t)rank * sizeof(vh));
        vh *scores = aligned_alloc(64, (size_t)(CHUNK + TILE) * sizeof(vh));
        float *rows = malloc((size_t)((CHUNK + TILE) * entry_dim) * sizeof(float));
        int ok = qT && accT && scores && rows;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* a sequence's head blocks side by side: threads on one sequence share its entries */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * head_blocks; item++)
            if (ok) attend(&a, item / head_blocks, item % head_blocks * HEADS, qT, accT, scores,
                           rows);
        free(qT);
        free(accT);
        free(scores);
        free(rows);
    }
    return failed ? -1 : 0;
}
