/* gpt-oss's gated activation on the CPU: for x = [gate | up] per row (de-interleaved at load),
 *
 *     out = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = min(gate, limit)
 *
 * `swigluoai_and_mul_ref`'s numerics for bf16: computed in fp32 from the bf16 inputs, rounded
 * to bf16 once. The sigmoid takes e^-|z| from `exp_nonpositive` (about 1 ulp in fp32, below
 * bf16's rounding); NaN stays NaN through the clamps, as torch's clamp keeps it. fused_moe.c
 * includes this file for `swigluoai`, so its experts compute the same bits.
 * Rows are contiguous: x [rows][2 * width], out [rows][width], both bf16.
 */
#include <stdint.h>

#include "bf16.h"
#include "exp.h"

static inline float swigluoai(float gate, float up, float alpha, float limit) {
    float g = gate > limit ? limit : gate;
    float u = up > limit ? limit : up < -limit ? -limit : up;
    float z = g * alpha, e = exp_nonpositive(z < 0.0f ? z : -z);  /* e^-|z| */
    float glu = g * ((z < 0.0f ? e : 1.0f) / (1.0f + e));
    return (u + 1.0f) * glu;
}

void swigluoai_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t width,
                            float alpha, float limit) {
#pragma omp parallel for if (rows >= 64) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * width, *up = gate + width;
        uint16_t *o = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++)
            o[i] = f32_to_bf16(swigluoai(bf16_to_f32(gate[i]), bf16_to_f32(up[i]), alpha, limit));
    }
}
