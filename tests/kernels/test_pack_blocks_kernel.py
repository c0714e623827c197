"""Triton pack_blocks / unpack_blocks against the torch references (interpreter)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference.pack_blocks import pack_blocks_ref, unpack_blocks_ref
from pdserve.kernels.triton.pack_blocks import pack_blocks, unpack_blocks


def _caches(dtype, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return tuple(torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
                     for _ in range(2))
    return tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))


@pytest.mark.parametrize(
    "dtype,block_size,num_kv_heads,head_dim,heads",
    [
        (torch.float32, 16, 3, 64, (0, 3)),  # every head
        (torch.float16, 32, 8, 128, (2, 6)),  # a TP shard
        (torch.bfloat16, 16, 2, 64, (1, 2)),
        (torch.int8, 16, 4, 64, (0, 2)),
    ],
)
def test_pack_and_unpack_match_reference(dtype, block_size, num_kv_heads, head_dim, heads):
    shape = (9, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = _caches(dtype, shape)
    block_ids = torch.tensor([7, 2, 5, 0])
    buffer = pack_blocks(k_cache, v_cache, block_ids, *heads)
    assert buffer.is_contiguous()
    assert buffer.shape == (2, 4, block_size, heads[1] - heads[0], head_dim)
    assert torch.equal(buffer, pack_blocks_ref(k_cache, v_cache, block_ids, *heads))
    assert torch.equal(buffer[1, 0], v_cache[7, :, heads[0] : heads[1]])  # the documented layout

    dst = _caches(dtype, shape, seed=1)  # random, so a missed or stray write shows
    dst_ref = tuple(t.clone() for t in dst)
    targets = torch.tensor([1, 8, 3, 4])
    unpack_blocks(buffer, *dst, targets, *heads)
    unpack_blocks_ref(buffer, *dst_ref, targets, *heads)
    assert torch.equal(dst[0], dst_ref[0]) and torch.equal(dst[1], dst_ref[1])


def test_reshard_one_prefill_rank_to_two_decode_ranks():
    """Prefill TP=1 holds 4 KV heads; decode TP=2 ranks hold 2 each, in other block ids."""
    k_cache, v_cache = _caches(torch.float32, (6, 16, 4, 64))
    block_ids = torch.tensor([4, 1, 3])
    for rank, targets in enumerate((torch.tensor([0, 5, 2]), torch.tensor([3, 0, 1]))):
        heads = (2 * rank, 2 * rank + 2)
        dst_k, dst_v = torch.zeros(6, 16, 2, 64), torch.zeros(6, 16, 2, 64)
        unpack_blocks(pack_blocks(k_cache, v_cache, block_ids, *heads), dst_k, dst_v,
                      targets, 0, 2)
        assert torch.equal(dst_k[targets], k_cache[block_ids, :, heads[0] : heads[1]])
        assert torch.equal(dst_v[targets], v_cache[block_ids, :, heads[0] : heads[1]])


def test_int8_scales_travel_as_head_dim_one_cache():
    k_scale = torch.rand(6, 16, 4).half() + 0.1
    v_scale = torch.rand(6, 16, 4).half() + 0.1
    block_ids = torch.tensor([5, 0])
    buffer = pack_blocks(k_scale.unsqueeze(-1), v_scale.unsqueeze(-1), block_ids, 1, 3)
    assert torch.equal(buffer[0, :, :, :, 0], k_scale[block_ids, :, 1:3])
    dst_k, dst_v = torch.zeros(3, 16, 2).half(), torch.zeros(3, 16, 2).half()
    unpack_blocks(buffer, dst_k.unsqueeze(-1), dst_v.unsqueeze(-1), torch.tensor([2, 1]), 0, 2)
    assert torch.equal(dst_v[[2, 1]], v_scale[block_ids, :, 1:3])


def test_pack_rejects_bad_head_range():
    k_cache, v_cache = _caches(torch.float32, (2, 16, 2, 64))
    with pytest.raises(ValueError, match="head_end"):
        pack_blocks(k_cache, v_cache, torch.tensor([0]), 1, 3)


def test_pack_into_a_reused_buffer():
    k_cache, v_cache = _caches(torch.float32, (9, 16, 4, 64))
    block_ids = torch.tensor([7, 2, 5])
    out = torch.full((2, 3, 16, 2, 64), float("nan"))
    packed = pack_blocks(k_cache, v_cache, block_ids, 1, 3, out=out)
    assert packed.data_ptr() == out.data_ptr()
    assert torch.equal(out, pack_blocks_ref(k_cache, v_cache, block_ids, 1, 3))
    with pytest.raises(ValueError, match="out"):
        pack_blocks(k_cache, v_cache, block_ids, 0, 3, out=out)  # 3 heads don't fit
