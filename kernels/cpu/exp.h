/* A vectorizable exp for the C kernels beside this file (kernels/cpu/build.py builds them). */
#ifndef PDSERVE_EXP_H
#define PDSERVE_EXP_H

#include <stdint.h>

/* exp(x) for x <= 0 (a softmax's shifted scores, SiLU's e^-|x|), in a form the compiler
 * vectorizes (glibc's expf is a scalar call per element): e^x = 2^n * 2^f with
 * n = round(x log2 e), |f| <= 1/2, and 2^f by its Taylor series to degree 6 (relative error
 * < 2e-7, about 1 ulp). */
static inline float exp_nonpositive(float x) {
    float t = (x < -87.0f ? -87.0f : x) * 1.44269504088896341f;  /* 2^-126: still normal */
    float n = __builtin_rintf(t), y = (t - n) * 0.693147180559945309f;
    float p = 1.0f + y * (1.0f + y * (0.5f + y * (1.0f / 6 + y * (1.0f / 24 + y * (1.0f / 120
              + y * (1.0f / 720))))));
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

#endif
