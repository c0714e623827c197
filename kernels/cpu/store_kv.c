/* Write a step's new K/V rows into the paged cache on the CPU: `store_kv_ref` without torch's
 * per-call cost (two `index_copy_` calls per layer took ~11 us each at batch 1).
 *
 * Each token's row (every KV head, `row_bytes` bytes, contiguous) is copied from the step's
 * keys and values (`*_stride` bytes apart: views into the fused qkv projection) to its slot
 * in each cache. Negative slots are skipped (padding, as the Triton kernel does); a slot past
 * the cache fails the call before anything is written.
 */
#include <stdint.h>
#include <string.h>

int store_kv(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
             char *k_cache, char *v_cache, const int64_t *slots, int64_t num_tokens,
             int64_t num_slots, int64_t row_bytes) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] >= num_slots) return -1;
#pragma omp parallel for if (num_tokens >= 256) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row_bytes, key + t * key_stride, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, value + t * value_stride, (size_t)row_bytes);
    }
    return 0;
}
