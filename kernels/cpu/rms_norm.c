/* RMSNorm with an optional fused residual add on the CPU: `rms_norm_ref`'s numerics.
 *
 * Per row: s = x + residual, rounded to the model dtype (as the unfused model rounds it); the
 * variance of s in fp32; s * rsqrt(variance + eps) rounded to the model dtype, then times the
 * weight, rounded again. One pass over the row for the sum, one for the output; rows are spread
 * over torch's OpenMP threads when there are enough of them to pay for the fork.
 * dtype: 0 = float32, 1 = bfloat16. Rows are contiguous; `residual` / `new_residual` may be NULL.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype == 1 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype == 1) {
        union { uint32_t u; float f; } x;
        x.f = v; /* already a bf16 value: the high half is exact */
        ((uint16_t *)p)[i] = (uint16_t)(x.u >> 16);
    } else {
        ((float *)p)[i] = v;
    }
}

static inline __attribute__((always_inline)) void norm_row(
    const void *x, const void *residual, const void *weight, void *out, void *new_residual,
    int64_t base, int64_t hidden, float eps, int dtype) {
    {
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) {
            float s = load(x, base + i, dtype);
            if (residual) s = to_dtype(s + load(residual, base + i, dtype), dtype);
            if (new_residual) store(new_residual, base + i, s, dtype);
            sum += s * s;
        }
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        const void *src = new_residual ? new_residual : x;
        for (int64_t i = 0; i < hidden; i++) {
            float normed = to_dtype(load(src, base + i, dtype) * inv, dtype);
            store(out, base + i, to_dtype(load(weight, i, dtype) * normed, dtype), dtype);
        }
    }
}

void rms_norm(const void *x, const void *residual, const void *weight, void *out,
              void *new_residual, int64_t rows, int64_t hidden, float eps, int dtype) {
#pragma omp parallel for if (rows >= 64) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == 1) /* a literal dtype: the inlined loops vectorize without branches */
            norm_row(x, residual, weight, out, new_residual, r * hidden, hidden, eps, 1);
        else
            norm_row(x, residual, weight, out, new_residual, r * hidden, hidden, eps, 0);
    }
}
