/* Structured outputs' token mask on fp32 logits: a token whose bit is 0 gets -inf.
 *
 * `apply_token_bitmask_ref`'s result in one pass: a word with every bit set (no constraint, or
 * tokens the grammar allows) is skipped, a word with none set (most of a grammar's vocabulary)
 * is 32 stores, the rest bit by bit. Rows are spread over torch's OpenMP threads.
 * logits [rows][vocab] fp32, bitmask [rows][words] int32, words * 32 >= vocab.
 */
#include <math.h>
#include <stdint.h>

void apply_token_bitmask_f32(float *logits, const int32_t *bitmask, int64_t rows, int64_t vocab,
                             int64_t words) {
#pragma omp parallel for if (rows >= 4) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *x = logits + r * vocab;
        const uint32_t *mask = (const uint32_t *)(bitmask + r * words);
        for (int64_t w = 0; w * 32 < vocab; w++) {
            uint32_t m = mask[w];
            if (m == UINT32_MAX)
                continue;
            int64_t base = w * 32, n = vocab - base < 32 ? vocab - base : 32;
            if (m == 0) {
                for (int64_t b = 0; b < n; b++)
                    x[base + b] = -INFINITY;
                continue;
            }
            for (int64_t b = 0; b < n; b++)
                if (!((m >> b) & 1u))
                    x[base + b] = -INFINITY;
        }
    }
}
