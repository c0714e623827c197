"""The C store_kv (`kernels/cpu/store_kv.c`) against the torch reference: bit-identical."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu.store_kv import store_kv_cpu
from pdserve.kernels.reference.store_kv import store_kv_ref


def _caches(dtype, num_blocks=20, block_size=16, num_kv_heads=3, head_dim=64):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, 7.0, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 300])  # 300: split over the OpenMP threads
def test_matches_reference_on_qkv_views(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (9 + 2 * 3) * 64, generator=gen).to(dtype)
    key = qkv[:, 9 * 64 : 12 * 64].view(num_tokens, 3, 64)  # token stride 15 * 64
    value = qkv[:, 12 * 64 :].view(num_tokens, 3, 64)
    slots = torch.randperm(20 * 16, generator=gen)[:num_tokens]
    ours, ref = _caches(dtype), _caches(dtype)
    store_kv_cpu(key, value, *ours, slots)
    store_kv_ref(key, value, *ref, slots)
    for a, b in zip(ours, ref):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())  # untouched slots stay NaN / 7


def test_skips_padding_and_refuses_slots_past_the_cache():
    key, value = torch.randn(3, 3, 64), torch.randn(3, 3, 64)
    k_cache, v_cache = _caches(torch.float32)
    store_kv_cpu(key, value, k_cache, v_cache, torch.tensor([4, -1, 20]))
    assert torch.equal(k_cache.view(-1, 3, 64)[[4, 20]], key[[0, 2]])
    assert torch.equal(v_cache.view(-1, 3, 64)[[4, 20]], value[[0, 2]])
    assert torch.isnan(k_cache.view(-1, 3, 64)).sum() == (20 * 16 - 2) * 3 * 64
    before = k_cache.clone()
    with pytest.raises(IndexError, match="past the cache"):
        store_kv_cpu(key, value, k_cache, v_cache, torch.tensor([5, 6, 20 * 16]))
    assert torch.equal(k_cache.nan_to_num(), before.nan_to_num())  # nothing written


def test_other_layouts_take_the_reference():
    """fp32 K/V into a bf16 cache: converted as the reference converts them."""
    key, value = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    ours, ref = _caches(torch.bfloat16), _caches(torch.bfloat16)
    store_kv_cpu(key, value, *ours, torch.tensor([3, 8]))
    store_kv_ref(key, value, *ref, torch.tensor([3, 8]))
    assert torch.equal(ours[0].nan_to_num(), ref[0].nan_to_num())
