/* Rotary position embedding (rotate-half) on the CPU, in place: `rotary_embedding_ref`'s numerics.
 *
 * cos/sin are rounded to the model dtype, and so is every product and the sum, exactly where the
 * unfused torch expression `x * cos + rotate_half(x) * sin` rounds them: bf16 results are
 * bit-identical to Hugging Face's. q [tokens, heads, head_dim] and k may be strided views of a
 * fused qkv row (token stride given; heads packed). dtype: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

static inline __attribute__((always_inline)) void rotate(void *base, int64_t num_heads, int64_t head_dim, const float *cos,
                   const float *sin, int dtype) {
    int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        for (int64_t i = 0; i < half; i++) {
            int64_t lo = h * head_dim + i, hi = lo + half;
            float x1, x2;
            if (dtype == 1) {
                x1 = bf16_to_f32(((uint16_t *)base)[lo]);
                x2 = bf16_to_f32(((uint16_t *)base)[hi]);
            } else {
                x1 = ((float *)base)[lo];
                x2 = ((float *)base)[hi];
            }
            float c1 = to_dtype(cos[i], dtype), c2 = to_dtype(cos[i + half], dtype);
            float s1 = to_dtype(sin[i], dtype), s2 = to_dtype(sin[i + half], dtype);
            float a = to_dtype(x1 * c1, dtype), b = to_dtype(-x2 * s1, dtype);
            float c = to_dtype(x2 * c2, dtype), d = to_dtype(x1 * s2, dtype);
            float y1 = to_dtype(a + b, dtype), y2 = to_dtype(c + d, dtype);
            if (dtype == 1) {
                union { uint32_t u; float f; } u1 = {.f = y1}, u2 = {.f = y2};
                ((uint16_t *)base)[lo] = (uint16_t)(u1.u >> 16);
                ((uint16_t *)base)[hi] = (uint16_t)(u2.u >> 16);
            } else {
                ((float *)base)[lo] = y1;
                ((float *)base)[hi] = y2;
            }
        }
    }
}

void rotary_embedding(void *q, int64_t q_stride, void *k, int64_t k_stride,
                      const int64_t *positions, const float *cos_cache, const float *sin_cache,
                      int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int dtype) {
    int64_t elem = dtype == 1 ? 2 : 4;
#pragma omp parallel for if (num_tokens >= 64) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *cos = cos_cache + positions[t] * head_dim;
        const float *sin = sin_cache + positions[t] * head_dim;
        char *qt = (char *)q + t * q_stride * elem, *kt = (char *)k + t * k_stride * elem;
        if (dtype == 1) { /* a literal dtype: the inlined loops vectorize without branches */
            rotate(qt, num_heads, head_dim, cos, sin, 1);
            rotate(kt, num_kv_heads, head_dim, cos, sin, 1);
        } else {
            rotate(qt, num_heads, head_dim, cos, sin, 0);
            rotate(kt, num_kv_heads, head_dim, cos, sin, 0);
        }
    }
}
