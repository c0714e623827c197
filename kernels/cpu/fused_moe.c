/* A MoE layer's bf16 experts on the CPU as one call: routing, every expert's gate/up GEMM,
 * SiLU * up, down GEMM and the weighted sum over each token's k slots, in one OpenMP region.
 *
 * The per-expert path (fused_moe.py's `LinearExperts`) runs one `linear_bf16` pair per expert
 * that received tokens, each GEMM its own OpenMP region: a decode step of 4 layers (top-8 of
 * 64 experts, a few rows) made ~160 regions, each ending in a barrier that waits for the
 * slowest thread. Where other processes share the cores, a thread the OS puts aside holds up
 * every one of them (a 1-row GEMM on [512, 1024]: 11.8 ms with 2 threads, 80 us with 1), and
 * the wrappers and the fp32 `index_add_` add ~0.3-1 ms per call. Here (H 1024, I 256, E 64,
 * top-8, AVX512-BF16, 2 shared cores, best of 9): 1 token 0.65 -> 0.40 ms on 1 thread,
 * 0.67 -> 0.35 on 2; 32 tokens 5.6 -> 3.7 and 5.6 -> 3.0. On the host busy (load 8 on 2
 * cores), 2 threads' mean per call at 1 token went from 95 ms to 5.6 (1 thread: 1.0).
 *
 * Here the (token, slot) pairs are counting-sorted by local expert (stable, as the reference's
 * argsort; ids outside [expert_start, expert_start + E) are dropped), each expert's run of
 * pairs cut into blocks of up to ROW_BLOCK rows, and the work is one queue of items that the
 * threads take one at a time (an atomic counter), in this order:
 *   gather  (block)            the block's token rows copied (AVX2: widened to fp32) in order;
 *   gate_up (block, 64 cols)   gate and up tiles of those columns, SiLU * up into `act`;
 *   down    (block, 64 cols)   `act` rows against w2's tiles into the expert outputs (bf16);
 *   combine (token)            sum_j weight_j * out_j in fp32 in sorted order, rounded once.
 * An item waits only for the items it reads (per-block counters, acquire/release), which
 * were all handed out before it: no barrier inside the region, no item waits for a thread
 * that has not started, and a thread that is late finds the queue drained and leaves. The
 * only wait for every thread is the region's end, once per layer.
 *
 * Numerics are the Python path's, bit for bit: the GEMMs are linear_bf16.c's own `gemm_cols` (its
 * source is included: the packed layout and micro-kernels, AMX's too, are not written twice),
 * SiLU * up is silu_and_mul.c's (included too), and the combine does what `run_experts` does: each bf16
 * expert output times its fp32 routing weight in fp32, added in sorted (expert) order into
 * fp32 zeros, as `index_add_` adds, rounded to bf16 once. Against `fused_moe_ref` that is
 * the reference's rounding points with linear_bf16's GEMM sums in place of torch's.
 *
 * Weights: w13[e] [2 I, H] and w2[e] [H, I] of each local expert, packed for linear_bf16.c
 * (`packed_linear.pack`), given as arrays of E pointers. I and H multiples of TILE_COLS
 * (gate tile c and up tile c then start on tile boundaries; fused_moe.py checks).
 *
 * gpt-oss's experts: biases b13 [E, 2 I] (gate, then up) and b2 [E, H] (bf16, NULL: none) go
 * into the tiles' fp32 sums as linear_bf16's bias does, and activation 1 ("swigluoai",
 * swigluoai_and_mul.c's, included too) replaces SiLU * up: the per-expert path's numerics
 * again, bit for bit (its linears called with the expert's bias rows).
 *
 * Note: build.py's cache key hashes this file and the headers, not the .c files included
 * below; a change to linear_bf16.c or silu_and_mul.c alone does not rebuild this library.
 * fused_moe.py checks that both agree on the tile width, and tests/kernels/test_fused_moe.py
 * that this call is bit-identical to the per-expert path built from the current sources.
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep under -std=c11 */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "linear_bf16.c"  /* gemm_cols, TILE_COLS, ROW_BLOCK, ITEM_COLS, row_t, X_FP32 */
#include "silu_and_mul.c" /* silu(): silu_and_mul_cpu's numerics */
#include "swigluoai_and_mul.c" /* swigluoai(): swigluoai_and_mul_cpu's numerics */

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))

#define COMBINE_COLS 256 /* fp32 sums a combine keeps at once (1 KB on the stack) */
/* A thread whose item reads one still in flight spins about one decode item's time (waits
 * here are a few us in all per call), then naps, leaving its core free: on a busy host the
 * thread it waits for may be queued behind other processes, and a core that spins (or only
 * sched_yields) is never idle for the OS to move that thread onto. */
#define SPINS 256
#define NAP_NS 50000

typedef struct {
    int64_t expert, start, rows; /* sorted pairs [start, start + rows) of one expert */
} Block;

/* One call's inputs, its sort and its buffers (rows: sorted pair order). */
typedef struct {
    const uint16_t *x;                   /* [T, H] */
    const float *weights;                /* [T * k] */
    const uint16_t *const *w13, *const *w2;
    const uint16_t *b13, *b2;            /* [E, 2 I], [E, H], or NULL */
    int activation;                      /* 0: SiLU * up, 1: swigluoai */
    float alpha, limit;                  /* swigluoai's */
    uint16_t *out;                       /* [T, H] */
    int64_t num_tokens, top_k, hidden, inter;
    int64_t *pairs;                      /* [n] flat pair index (token * k + slot), by expert */
    int64_t *token_pos, *token_count;    /* [T, k] each token's sorted positions, ascending; [T] */
    int64_t *block_of;                   /* [n] each sorted position's block */
    Block *blocks;
    int64_t num_blocks, gate_up_chunks, down_chunks;
    int64_t *gathered, *gate_up_done, *down_done; /* [num_blocks] items finished */
    row_t *rows, *act;                   /* [n, H], [n, I]: the tiles' input rows */
    uint16_t *expert_out;                /* [n, H] */
} Moe;

#if X_FP32 /* the AVX2 tiles read fp32 rows: bf16 values, widened (exact) */
static inline row_t to_row(float v) { return round_bf16(v); }
static inline row_t from_bf16(uint16_t h) { return bf16_to_f32(h); }
#else
static inline row_t to_row(float v) { return f32_to_bf16(v); }
static inline row_t from_bf16(uint16_t h) { return h; }
#endif

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static void wait_for(const int64_t *counter, int64_t value) {
    const struct timespec nap = {0, NAP_NS};
    for (int spins = 0; __atomic_load_n(counter, __ATOMIC_ACQUIRE) < value; spins++)
        if (spins < SPINS)
            _mm_pause();
        else
            nanosleep(&nap, NULL);
}

static void finished(int64_t *counter) { __atomic_fetch_add(counter, 1, __ATOMIC_RELEASE); }

static void gather(const Moe *m, const Block *b) {
    int64_t h = m->hidden;
    for (int64_t s = b->start; s < b->start + b->rows; s++) {
        const uint16_t *src = m->x + m->pairs[s] / m->top_k * h;
        row_t *dst = m->rows + s * h;
#pragma omp simd
        for (int64_t i = 0; i < h; i++) dst[i] = from_bf16(src[i]);
    }
}

/* act columns [c0, c0 + 64) of the block's rows: silu(gate) * up, as silu_and_mul_bf16, or
 * swigluoai(gate, up), as swigluoai_and_mul_bf16 (gate and up with their biases). */
static void gate_up(const Moe *m, const Block *b, int64_t chunk) {
    uint16_t gate[ROW_BLOCK * ITEM_COLS], up[ROW_BLOCK * ITEM_COLS];
    int64_t h = m->hidden, inter = m->inter;
    int64_t c0 = chunk * ITEM_COLS, c1 = min64(c0 + ITEM_COLS, inter), width = c1 - c0;
    const row_t *x = m->rows + b->start * h;
    const uint16_t *w = m->w13[b->expert], *bias = m->b13 ? m->b13 + b->expert * 2 * inter : 0;
    gemm_cols(x, b->rows, h, w, bias, c0, c1, gate, width);
    gemm_cols(x, b->rows, h, w, bias, inter + c0, inter + c1, up, width);
    float alpha = m->alpha, limit = m->limit;
    for (int64_t r = 0; r < b->rows; r++) {
        const uint16_t *g = gate + r * width, *u = up + r * width;
        row_t *a = m->act + (b->start + r) * inter + c0;
        if (m->activation == 1) {
#pragma omp simd
            for (int64_t i = 0; i < width; i++)
                a[i] = to_row(swigluoai(bf16_to_f32(g[i]), bf16_to_f32(u[i]), alpha, limit));
        } else {
#pragma omp simd
            for (int64_t i = 0; i < width; i++)
                a[i] = to_row(round_bf16(silu(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
        }
    }
}

static void down(const Moe *m, const Block *b, int64_t chunk) {
    int64_t h = m->hidden, c0 = chunk * ITEM_COLS, c1 = min64(c0 + ITEM_COLS, h);
    gemm_cols(m->act + b->start * m->inter, b->rows, m->inter, m->w2[b->expert],
              m->b2 ? m->b2 + b->expert * h : 0, c0, c1, m->expert_out + b->start * h + c0, h);
}

/* out[t] = sum over t's pairs in sorted order of weight * expert_out, in fp32 from zero. */
static void combine(const Moe *m, int64_t t) {
    int64_t h = m->hidden, count = m->token_count[t];
    const int64_t *pos = m->token_pos + t * m->top_k;
    for (int64_t j = 0; j < count; j++)
        wait_for(&m->down_done[m->block_of[pos[j]]], m->down_chunks);
    for (int64_t c0 = 0; c0 < h; c0 += COMBINE_COLS) {
        int64_t width = min64(COMBINE_COLS, h - c0);
        float acc[COMBINE_COLS] = {0};
        for (int64_t j = 0; j < count; j++) {
            float w = m->weights[m->pairs[pos[j]]];
            const uint16_t *e = m->expert_out + pos[j] * h + c0;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) acc[i] += w * bf16_to_f32(e[i]);
        }
        uint16_t *o = m->out + t * h + c0;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) o[i] = f32_to_bf16(acc[i]);
    }
}

/* Item i of the queue (module doc), once the items it reads are finished. */
static void run_item(const Moe *m, int64_t i) {
    int64_t nb = m->num_blocks, ga = m->gate_up_chunks, dn = m->down_chunks;
    if (i < nb) {
        gather(m, &m->blocks[i]);
        finished(&m->gathered[i]);
        return;
    }
    i -= nb;
    if (i < nb * ga) {
        int64_t b = i / ga;
        wait_for(&m->gathered[b], 1);
        gate_up(m, &m->blocks[b], i % ga);
        finished(&m->gate_up_done[b]);
        return;
    }
    i -= nb * ga;
    if (i < nb * dn) {
        int64_t b = i / dn;
        wait_for(&m->gate_up_done[b], ga);
        down(m, &m->blocks[b], i % dn);
        finished(&m->down_done[b]);
        return;
    }
    combine(m, i - nb * dn);
}

static int64_t local_expert(const void *ids, int ids_int32, int64_t p, int64_t start,
                            int64_t num_experts) {
    int64_t id = ids_int32 ? ((const int32_t *)ids)[p] : ((const int64_t *)ids)[p];
    return id >= start && id - start < num_experts ? id - start : -1;
}

/* Counting sort of the pairs by local expert, the blocks, each token's sorted positions. */
static void sort_pairs(Moe *m, const void *ids, int ids_int32, int64_t start, int64_t num_experts,
                       int64_t *first) {
    int64_t num_pairs = m->num_tokens * m->top_k;
    for (int64_t p = 0; p < num_pairs; p++) {
        int64_t e = local_expert(ids, ids_int32, p, start, num_experts);
        if (e >= 0) first[e + 1]++;
    }
    for (int64_t e = 0; e < num_experts; e++) first[e + 1] += first[e];
    for (int64_t p = 0; p < num_pairs; p++) {
        int64_t e = local_expert(ids, ids_int32, p, start, num_experts);
        if (e >= 0) m->pairs[first[e]++] = p; /* first[e] ends at expert e's end */
    }
    m->num_blocks = 0;
    for (int64_t e = 0, s = 0; e < num_experts; s = first[e++])
        for (; s < first[e]; s += ROW_BLOCK) {
            Block *b = &m->blocks[m->num_blocks];
            *b = (Block){e, s, min64(ROW_BLOCK, first[e] - s)};
            for (int64_t r = s; r < s + b->rows; r++) m->block_of[r] = m->num_blocks;
            m->num_blocks++;
        }
    for (int64_t s = 0; s < first[num_experts - 1]; s++) {
        int64_t t = m->pairs[s] / m->top_k;
        m->token_pos[t * m->top_k + m->token_count[t]++] = s;
    }
}

static void release(void **buffers, int count) {
    for (int i = 0; i < count; i++) free(buffers[i]);
}

int fused_moe_tile_cols(void) { return TILE_COLS; }

/* out [T, H] bf16 = the experts' weighted sum (module doc) for x [T, H] bf16, topk_weights
 * [T, k] fp32, topk_ids [T, k] (int32 where ids_int32, else int64), all contiguous; w13 / w2
 * E pointers to packed weights; b13 / b2 their biases (contiguous bf16, or NULL); activation
 * 0 (SiLU * up) or 1 (swigluoai with alpha, limit). 0, or -1 if out of memory (nothing
 * written). */
int fused_moe_bf16(const uint16_t *x, const float *topk_weights, const void *topk_ids,
                   int ids_int32, const uint16_t *const *w13, const uint16_t *const *w2,
                   const uint16_t *b13, const uint16_t *b2, int activation, float alpha,
                   float limit, uint16_t *out, int64_t num_tokens, int64_t top_k,
                   int64_t num_experts, int64_t expert_start, int64_t hidden, int64_t inter) {
    int64_t n = num_tokens * top_k, max_blocks = num_experts + n / ROW_BLOCK + 1;
    Moe m = {.x = x, .weights = topk_weights, .w13 = w13, .w2 = w2, .b13 = b13, .b2 = b2,
             .activation = activation, .alpha = alpha, .limit = limit, .out = out,
             .num_tokens = num_tokens, .top_k = top_k, .hidden = hidden, .inter = inter};
    void *buffers[] = {
        m.pairs = malloc(sizeof(int64_t) * (size_t)(n + 1)),
        m.token_pos = malloc(sizeof(int64_t) * (size_t)(n + 1)),
        m.token_count = calloc((size_t)num_tokens + 1, sizeof(int64_t)),
        m.block_of = malloc(sizeof(int64_t) * (size_t)(n + 1)),
        m.blocks = malloc(sizeof(Block) * (size_t)max_blocks),
        /* the counters gathered, gate_up_done, down_done ([max_blocks] each), then the
         * sort's E + 1 expert offsets: all from zero */
        m.gathered = calloc(3 * (size_t)max_blocks + (size_t)num_experts + 1, sizeof(int64_t)),
        m.rows = malloc(sizeof(row_t) * (size_t)(n * hidden + 1)),
        m.act = malloc(sizeof(row_t) * (size_t)(n * inter + 1)),
        m.expert_out = malloc(sizeof(uint16_t) * (size_t)(n * hidden + 1)),
    };
    int count = (int)(sizeof buffers / sizeof buffers[0]);
    for (int i = 0; i < count; i++)
        if (!buffers[i]) {
            release(buffers, count);
            return -1;
        }
    m.gate_up_done = m.gathered + max_blocks;
    m.down_done = m.gate_up_done + max_blocks;
    sort_pairs(&m, topk_ids, ids_int32, expert_start, num_experts, m.down_done + max_blocks);
    m.gate_up_chunks = (inter + ITEM_COLS - 1) / ITEM_COLS;
    m.down_chunks = (hidden + ITEM_COLS - 1) / ITEM_COLS;
    int64_t items = m.num_blocks * (1 + m.gate_up_chunks + m.down_chunks) + num_tokens;
    int64_t next = 0;
#pragma omp parallel
    for (int64_t i; (i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < items;)
        run_item(&m, i);
    release(buffers, count);
    return 0;
}

#else

int fused_moe_tile_cols(void) { return 0; }

int fused_moe_bf16(const uint16_t *x, const float *topk_weights, const void *topk_ids,
                   int ids_int32, const uint16_t *const *w13, const uint16_t *const *w2,
                   const uint16_t *b13, const uint16_t *b2, int activation, float alpha,
                   float limit, uint16_t *out, int64_t num_tokens, int64_t top_k,
                   int64_t num_experts, int64_t expert_start, int64_t hidden, int64_t inter) {
    (void)x, (void)topk_weights, (void)topk_ids, (void)ids_int32, (void)w13, (void)w2;
    (void)b13, (void)b2, (void)activation, (void)alpha, (void)limit;
    (void)out, (void)num_tokens, (void)top_k, (void)num_experts, (void)expert_start;
    (void)hidden, (void)inter;
    return -1;
}

#endif
