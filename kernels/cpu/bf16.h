/* bf16 <-> fp32 for the C kernels beside this file (kernels/cpu/build.py builds them). */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

/* To the nearest bf16 value, ties to even, kept as fp32 (NaN stays NaN). */
static inline float round_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    if (isnan(f)) return f;
    x.u = (x.u + 0x7FFFu + ((x.u >> 16) & 1u)) & 0xFFFF0000u;
    return x.f;
}

/* The bits of a value round_bf16 produced (or of any fp32, rounded first). */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = round_bf16(f);
    return isnan(f) ? 0x7FC0 : (uint16_t)(x.u >> 16);
}

/* A value rounded to a kernel's `dtype` (0 = float32: as is, 1 = bfloat16), kept as fp32. */
static inline float to_dtype(float v, int dtype) { return dtype == 1 ? round_bf16(v) : v; }

#endif
