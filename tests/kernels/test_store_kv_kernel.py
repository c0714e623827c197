"""Triton store_kv / store_kv_int8 against the torch references (interpreter)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_quant import allocate_kv_cache, dequantize_kv_ref
from pdserve.kernels.reference.store_kv import store_kv_int8_ref, store_kv_ref
from pdserve.kernels.triton.store_kv import store_kv, store_kv_int8


def _inputs(num_tokens, block_size, num_kv_heads, head_dim, num_blocks=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return key, value, slots, cache_shape, gen


@pytest.mark.parametrize(
    "dtype,block_size,num_kv_heads,head_dim",
    [(torch.float32, 16, 3, 64), (torch.float16, 32, 8, 128), (torch.bfloat16, 16, 1, 128)],
)
def test_store_kv_matches_reference(dtype, block_size, num_kv_heads, head_dim):
    key, value, slots, shape, gen = _inputs(21, block_size, num_kv_heads, head_dim)
    key, value = key.to(dtype), value.to(dtype)  # same dtype as the cache: an exact copy
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # random, so missed slots show
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_casts_and_strided_input():
    key, value, slots, shape, gen = _inputs(9, 16, 2, 64)
    qkv = torch.randn(9, 6, 64, generator=gen)  # K/V as views of a fused projection
    key, value = qkv[:, 2:4], qkv[:, 4:6]
    k_cache = torch.zeros(shape, dtype=torch.float16)
    v_cache = torch.zeros(shape, dtype=torch.float16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_skips_negative_slots():
    key, value, slots, shape, gen = _inputs(6, 16, 2, 64)
    slots[2] = -1  # a padding token
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    keep = torch.arange(6) != 2
    store_kv_ref(key[keep], value[keep], k_ref, v_ref, slots[keep])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_int8_matches_reference(dtype):
    key, value, slots, shape, _ = _inputs(19, 16, 3, 64, seed=1)
    key, value = (key * 4).to(dtype), value.to(dtype)
    ours = allocate_kv_cache(*shape, torch.int8, torch.device("cpu"))
    ref = allocate_kv_cache(*shape, torch.int8, torch.device("cpu"))
    store_kv_int8(key, value, *ours, slots)
    store_kv_int8_ref(key, value, *ref, slots)
    for got, want in zip(ours[2:], ref[2:], strict=True):  # scales: same fp16 rounding
        assert torch.equal(got, want)
    for got, want in zip(ours[:2], ref[:2], strict=True):  # values: a tie may round apart
        assert (got.int() - want.int()).abs().max() <= 1
        assert (got != want).float().mean() < 1e-3
    # Round trip: every stored element within half a quantization step (+ fp16 slack).
    k_q, _, k_s, _ = ours
    flat_q = k_q.view(-1, 3, 64)[slots]
    flat_s = k_s.view(-1, 3)[slots]
    err = (dequantize_kv_ref(flat_q, flat_s) - key.float()).abs()
    assert (err <= flat_s.float()[..., None] * 0.5 + 1e-6).all()
    assert flat_q.abs().amax(-1).min() >= 126  # the scale uses the int8 range fully


def test_store_kv_int8_rejects_float_cache():
    key, value, slots, shape, _ = _inputs(3, 16, 2, 64)
    k, v = torch.zeros(shape), torch.zeros(shape)
    scales = torch.zeros(shape[:3], dtype=torch.float16)
    with pytest.raises(ValueError, match="k_cache must have dtype"):
        store_kv_int8(key, value, k, v, scales, scales.clone(), slots)
