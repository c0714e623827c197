/* One decoder layer of a Llama-family model (bf16, CPU backend) as one call per step.
 *
 * The model's Python modules make a dozen calls per layer (RMSNorm, the fused QKV projection,
 * RoPE, the K/V store, attention, the output projection, RMSNorm again, gate/up, SiLU * up,
 * down), and each costs 5-16 us of wrapper and interpreter time: at a decode step's few rows
 * that was as much time as the work. Here the same kernels run back to back from C, through
 * pointers to the very functions their Python wrappers call (`Kernels`, filled from the other
 * libraries of kernels/cpu/ by decoder_layers.py), so the results are bit-identical to the
 * module path and no kernel is written twice.
 *
 * A step's tokens (decodes and prefill chunks alike) attend through one call of the decode
 * kernel, one query per token: each token carries its sequence's block table and sees its own
 * position + 1 cached tokens, which is what the CPU prefill attention does per chunk.
 *
 * Qwen3's per-head q/k RMSNorms (`q_norm`, `k_norm`: NULL where the model has none) run in
 * place on the QKV rows before RoPE, through the same rms_norm kernel the modules call on
 * each head's head_dim values (a row's result does not depend on its neighbours, so norming
 * it where it lies is bit-identical to norming the modules' copy). A sliding-window layer
 * (`window` keys, 0: the whole context) takes the attention kernel's window; soft-capped
 * layers are not this block (their layers keep the modules).
 *
 * `parts` says which halves run: ATTENTION (norm, QKV, RoPE, store, attention, O) and MLP
 * (norm, gate/up, SiLU * up, down). Under tensor parallelism the caller all-reduces the
 * hidden state between the halves (the O and down projections give partial sums).
 *
 * LoRA: a step with adapters (`Step.lora_starts` not NULL) adds each token's adapter delta
 * right after each of the four linears, as the module path does (`ParallelLinear._with_lora`:
 * after the QKV bias, before the q/k norms; O's and down's before the all-reduce, each rank's
 * partial delta joining its partial sum), through lora.c's shrink and expand: the very calls
 * of `lora_shrink_cpu` / `lora_expand_cpu`, on the same inputs (the normed rows, the attention
 * output, SiLU * up), so the result stays bit-identical. A base step (NULL) skips it all.
 */
#include <stdint.h>
#include <string.h>

#define BF16 1 /* the kernels' dtype code */
#define ATTENTION 1
#define MLP 2
#define SLOT_PAST_CACHE 1
#define OUT_OF_MEMORY 2

typedef void (*rms_norm_fn)(const void *x, const void *residual, const void *weight, void *out,
                            void *new_residual, int64_t rows, int64_t hidden, float eps,
                            int dtype);
typedef int (*linear_fn)(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                         uint16_t *y, int64_t m, int64_t n, int64_t k);
typedef void (*rotary_fn)(void *q, int64_t q_stride, void *k, int64_t k_stride,
                          const int64_t *positions, const float *cos_cache,
                          const float *sin_cache, int64_t num_tokens, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int dtype);
typedef int (*store_kv_fn)(const char *key, int64_t key_stride, const char *value,
                           int64_t value_stride, char *k_cache, char *v_cache,
                           const int64_t *slots, int64_t num_tokens, int64_t num_slots,
                           int64_t row_bytes);
typedef int (*attention_fn)(const void *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *context_lens, void *out,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, int64_t max_context,
                            int dtype, float scale, int64_t window, float soft_cap);
typedef void (*silu_and_mul_fn)(const uint16_t *x, uint16_t *out, int64_t rows, int64_t width);
typedef int (*lora_shrink_fn)(const void *x, const void *a, float *buf, const int32_t *starts,
                              const int32_t *slots, int64_t num_segments, int64_t num_tokens,
                              int64_t in, int64_t width, int dtype);
typedef int (*lora_expand_fn)(void *y, const float *buf, const void *b, const int64_t *offsets,
                              int64_t num_slices, const int32_t *starts, const int32_t *slots,
                              int64_t num_segments, int64_t num_tokens, int64_t out,
                              int64_t rank, int dtype);

typedef struct {
    rms_norm_fn rms_norm;
    linear_fn linear;
    rotary_fn rotary_embedding;
    store_kv_fn store_kv;
    attention_fn attention;
    silu_and_mul_fn silu_and_mul;
    lora_shrink_fn lora_shrink;
    lora_expand_fn lora_expand;
} Kernels;

/* One linear's adapter slots (kernels/lora_mapping.py LoRAWeights), bf16: a [slots][slices *
 * rank][in], b [slots][out][rank], offsets [slices + 1] (each slice's rows of out). a NULL:
 * the layer is bound without adapters. */
typedef struct {
    const uint16_t *a, *b;
    const int64_t *offsets;
    int64_t num_slices, rank;
} Adapter;

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN }; /* Layer.lora, in the linears' order */

/* A layer's weights as packed at load (linears in linear_bf16.c's layout), this rank's
 * shard of the heads and of the intermediate size. qkv_bias, q_norm and k_norm ([head_dim])
 * are NULL where the model has none; window 0: full attention. */
typedef struct {
    const Kernels *kernels;
    const uint16_t *input_norm, *qkv, *qkv_bias, *o_proj, *post_norm, *gate_up, *down;
    const uint16_t *q_norm, *k_norm;
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, window;
    float eps, scale;
    Adapter lora[4];
} Layer;

/* A step's tokens and the buffers every layer reuses ([num_tokens, ...] bf16 rows). */
typedef struct {
    int64_t num_tokens;
    const int64_t *positions, *slots;
    const float *cos, *sin;            /* [max_positions, head_dim] */
    const int32_t *block_tables;       /* [num_tokens, table_stride]: each token's sequence's */
    int64_t table_stride;
    const int32_t *context_lens;       /* [num_tokens]: position + 1 */
    int64_t max_context, block_size, num_slots;
    uint16_t *hidden, *residual;       /* in and out: the layer's input, then its output */
    uint16_t *normed, *qkv, *attn, *gate_up, *act;
    /* LoRA (kernels/lora_mapping.py LoRAMapping): runs of tokens of one slot (-1: none);
     * lora_starts NULL: a base step. lora_buf: [num_tokens, the widest slices * rank] fp32. */
    const int32_t *lora_starts, *lora_slots; /* [lora_segments + 1], [lora_segments] */
    int64_t lora_segments;
    float *lora_buf;
} Step;

/* Heads per call of the norm kernel: under the row count at which it spreads its rows over
 * the threads (64), so a call made from head_norms' threads never forks a nested team. */
#define NORM_ROWS 32

/* `heads` rows of head_dim at x, RMS-normed in place by `weight` (a row's result does not
 * depend on how many rows one call takes). */
static void norm_heads(const Layer *l, const uint16_t *weight, uint16_t *x, int64_t heads) {
    for (int64_t h = 0; h < heads; h += NORM_ROWS) {
        uint16_t *xh = x + h * l->head_dim;
        int64_t rows = heads - h < NORM_ROWS ? heads - h : NORM_ROWS;
        l->kernels->rms_norm(xh, NULL, weight, xh, NULL, rows, l->head_dim, l->eps, BF16);
    }
}

/* Each token's q heads and k heads (`stride` apart from token to token) normed in place;
 * tokens spread over the threads when there are as many rows as the kernel would spread. */
static void head_norms(const Layer *l, uint16_t *q, uint16_t *k, int64_t stride, int64_t t) {
#pragma omp parallel for if (t * (l->num_heads + l->num_kv_heads) >= 64) schedule(static)
    for (int64_t i = 0; i < t; i++) {
        norm_heads(l, l->q_norm, q + i * stride, l->num_heads);
        norm_heads(l, l->k_norm, k + i * stride, l->num_kv_heads);
    }
}

/* y [t][out] += the adapters' delta of x [t][in] (shrink into lora_buf, then expand), as
 * `KernelBackend.add_lora`; nothing on a base step or a layer bound without adapters. */
static int add_lora(const Layer *l, const Step *s, int which, const uint16_t *x, uint16_t *y,
                    int64_t in, int64_t out) {
    const Adapter *ad = &l->lora[which];
    if (!s->lora_starts || !ad->a)
        return 0;
    const Kernels *f = l->kernels;
    int64_t t = s->num_tokens, width = ad->num_slices * ad->rank;
    if (f->lora_shrink(x, ad->a, s->lora_buf, s->lora_starts, s->lora_slots, s->lora_segments,
                       t, in, width, BF16))
        return OUT_OF_MEMORY;
    if (f->lora_expand(y, s->lora_buf, ad->b, ad->offsets, ad->num_slices, s->lora_starts,
                       s->lora_slots, s->lora_segments, t, out, ad->rank, BF16))
        return OUT_OF_MEMORY;
    return 0;
}

/* y [t][n] = x [t][k] W^T (+ bias), then adapter `which`'s delta: one linear of the modules. */
static int project(const Layer *l, const Step *s, int which, const uint16_t *x,
                   const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n, int64_t k) {
    if (l->kernels->linear(x, w, bias, y, s->num_tokens, n, k))
        return OUT_OF_MEMORY;
    return add_lora(l, s, which, x, y, k, n);
}

/* Norm, QKV, (q/k norms,) RoPE, store, attention, O: `hidden` becomes the attention's output. */
static int attention_half(const Layer *l, const Step *s, char *k_cache, char *v_cache,
                          int first) {
    const Kernels *f = l->kernels;
    int64_t t = s->num_tokens, d = l->head_dim;
    int64_t q_size = l->num_heads * d, kv_size = l->num_kv_heads * d;
    int64_t qkv_size = q_size + 2 * kv_size;
    if (first) { /* the embedding is the residual stream */
        f->rms_norm(s->hidden, NULL, l->input_norm, s->normed, NULL, t, l->hidden, l->eps, BF16);
        memcpy(s->residual, s->hidden, (size_t)(t * l->hidden) * sizeof(uint16_t));
    } else {
        f->rms_norm(s->hidden, s->residual, l->input_norm, s->normed, s->residual, t, l->hidden,
                    l->eps, BF16);
    }
    if (project(l, s, LORA_QKV, s->normed, l->qkv, l->qkv_bias, s->qkv, qkv_size, l->hidden))
        return OUT_OF_MEMORY;
    uint16_t *q = s->qkv, *k = q + q_size, *v = k + kv_size;
    if (l->q_norm) head_norms(l, q, k, qkv_size, t);
    f->rotary_embedding(q, qkv_size, k, qkv_size, s->positions, s->cos, s->sin, t, l->num_heads,
                        l->num_kv_heads, d, BF16);
    int64_t row_bytes = kv_size * (int64_t)sizeof(uint16_t);
    if (f->store_kv((const char *)k, qkv_size * 2, (const char *)v, qkv_size * 2, k_cache,
                    v_cache, s->slots, t, s->num_slots, row_bytes))
        return SLOT_PAST_CACHE;
    if (f->attention(q, qkv_size, k_cache, v_cache, s->block_tables, s->table_stride,
                     s->context_lens, s->attn, t, l->num_heads, l->num_kv_heads, d,
                     s->block_size, s->max_context, BF16, l->scale, l->window, 0.0f))
        return OUT_OF_MEMORY;
    return project(l, s, LORA_O, s->attn, l->o_proj, NULL, s->hidden, l->hidden, q_size);
}

/* Norm, gate/up, SiLU * up, down: `hidden` becomes the MLP's output. */
static int mlp_half(const Layer *l, const Step *s) {
    const Kernels *f = l->kernels;
    int64_t t = s->num_tokens;
    f->rms_norm(s->hidden, s->residual, l->post_norm, s->normed, s->residual, t, l->hidden,
                l->eps, BF16);
    if (project(l, s, LORA_GATE_UP, s->normed, l->gate_up, NULL, s->gate_up,
                2 * l->intermediate, l->hidden))
        return OUT_OF_MEMORY;
    f->silu_and_mul(s->gate_up, s->act, t, l->intermediate);
    return project(l, s, LORA_DOWN, s->act, l->down, NULL, s->hidden, l->hidden, l->intermediate);
}

/* 0, SLOT_PAST_CACHE (nothing of this layer's K/V written), or OUT_OF_MEMORY. */
int decoder_layer(const Layer *layer, const Step *step, void *k_cache, void *v_cache, int parts,
                  int first) {
    if (parts & ATTENTION) {
        int rc = attention_half(layer, step, (char *)k_cache, (char *)v_cache, first);
        if (rc) return rc;
    }
    return parts & MLP ? mlp_half(layer, step) : 0;
}
