/* SwiGLU's activation on the CPU: out = silu(gate) * up, for x = [gate | up] per row.
 *
 * `silu_and_mul_ref`'s numerics for bf16: silu(g) = g * sigmoid(g) in fp32, rounded to bf16 (as
 * torch's bf16 `silu` returns it), times up in fp32, rounded again (torch's bf16 `mul`). One
 * pass over the rows where torch makes two (and a temporary): the rows are spread over torch's
 * OpenMP threads when there are enough of them to pay for the fork. The sigmoid takes
 * e^-|g| from `exp_nonpositive` (about 1 ulp in fp32, below bf16's rounding).
 * Rows are contiguous: x [rows][2 * width], out [rows][width], both bf16.
 */
#include <stdint.h>

#include "bf16.h"
#include "exp.h"

static inline float silu(float g) {
    float e = exp_nonpositive(g < 0.0f ? g : -g);  /* e^-|g| */
    return g * (g < 0.0f ? e : 1.0f) / (1.0f + e);
}

void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t width) {
#pragma omp parallel for if (rows >= 64) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * width, *up = gate + width;
        uint16_t *o = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++)
            o[i] = f32_to_bf16(round_bf16(silu(bf16_to_f32(gate[i]))) * bf16_to_f32(up[i]));
    }
}
