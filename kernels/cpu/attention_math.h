/* What every CPU attention path shares (paged_decode_attention.c and its bf16 headers):
 * 16-float vectors, the 16-dot reduction tree `sum16`, `exp_shifted` (a softmax's
 * exponentials and its denominator; `exp_shifted_sink` with an attention sink's logit in
 * the denominator), `window_start` and `soft_cap_scores` (the per-layer variants: sliding
 * window, logit soft-capping). */
#ifndef PDSERVE_ATTENTION_MATH_H
#define PDSERVE_ATTENTION_MATH_H

#include <math.h>
#include <stdint.h>

#include "exp.h"

/* 16 floats: one AVX-512 register where there is one (GCC/clang vector extensions). */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

/* Sixteen vectors -> one: lane u is the sum of a[u]'s lanes (a is overwritten). A tree of
 * shuffles and adds, 15 steps for 16 sums, where summing each vector alone takes 4 dependent
 * steps apiece: what makes the scores pass cheap (the dots need no reduction per token). */
static inline v16 sum16(v16 *a) {
    for (int i = 0; i < 8; i++)
        a[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUF(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                    30, 31);
    for (int i = 0; i < 4; i++)
        a[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                    27)
             + SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                    31);
    for (int i = 0; i < 2; i++)
        a[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                    29)
             + SHUF(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                    31);
    return SHUF(a[0], a[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUF(a[0], a[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* s[0:len] = exp(s - m), and s[len:len + tail] = 0, m the max of s and `sink` (gpt-oss's
 * attention sink: one more logit with no value; -INFINITY: none); returns the softmax's
 * denominator, the sum of the exponentials and exp(sink - m) (the weights are left
 * unnormalized). Without a sink, exactly `exp_shifted`. */
static inline float exp_shifted_sink(float *s, int64_t len, int64_t tail, float sink) {
    float top = sink, sum = 0.0f;
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; t++) sum += (s[t] = exp_nonpositive(s[t] - top));
    for (int64_t t = len; t < len + tail; t++) s[t] = 0.0f;
    return sink == -INFINITY ? sum : sum + exp_nonpositive(sink - top);
}

/* s[0:len] = exp(s - max(s)), and s[len:len + tail] = 0; returns the sum (the softmax's
 * denominator: the weights are left unnormalized). */
static inline float exp_shifted(float *s, int64_t len, int64_t tail) {
    return exp_shifted_sink(s, len, tail, -INFINITY);
}

/* The first key a query sees: the one `window` before its end (keys p - window < j <= p for
 * the query at p = len - 1), or 0 (window 0: no window). */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* tanh(x), vectorizable: (1 - e) / (1 + e) with e = exp(-2|x|), and for |x| < 1/4, where
 * 1 - e cancels, its odd Taylor series to x^9 (error < 1e-9). Both within ~2e-7 of tanh. */
static inline float tanh_f32(float x) {
    float a = x < 0.0f ? -x : x, a2 = a * a;
    float e = exp_nonpositive(-2.0f * a);
    float far = (1.0f - e) / (1.0f + e);
    float near = a * (1.0f + a2 * (-1.0f / 3 + a2 * (2.0f / 15 + a2 * (-17.0f / 315
                 + a2 * (62.0f / 2835)))));
    float t = a < 0.25f ? near : far;
    return x < 0.0f ? -t : t;
}

/* s[0:len] = cap * tanh(s / cap): Gemma 2's attention logit soft-capping (cap > 0). */
static inline void soft_cap_scores(float *s, int64_t len, float cap) {
    float inv = 1.0f / cap;
#pragma omp simd
    for (int64_t t = 0; t < len; t++) s[t] = cap * tanh_f32(s[t] * inv);
}

#endif
