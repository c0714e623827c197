"""pack/unpack references against their definition: every CPU path (reused `out`, numpy
byte-view rows, head slices, bf16, a strided cache) writes exactly the indexed blocks."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference.pack_blocks import pack_blocks_ref, unpack_blocks_ref

SHAPE = (10, 16, 4, 32)  # [num_blocks, block_size, num_kv_heads, head_dim]
IDS = torch.tensor([7, 0, 3, 9])


@pytest.mark.parametrize("heads", [(0, 4), (1, 3), (2, 4)])
@pytest.mark.parametrize("reuse_out", [False, True])
def test_pack_is_the_indexed_blocks(heads, reuse_out):
    k, v = torch.randn(SHAPE), torch.randn(SHAPE)
    h0, h1 = heads
    out = torch.full((2, len(IDS), SHAPE[1], h1 - h0, SHAPE[3]), float("nan")) if reuse_out \
        else None
    packed = pack_blocks_ref(k, v, IDS, h0, h1, out=out)
    assert torch.equal(packed, torch.stack([k[IDS][:, :, h0:h1], v[IDS][:, :, h0:h1]]))
    assert out is None or packed.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(0, 4), (1, 3), (2, 4)])
def test_unpack_writes_exactly_the_indexed_blocks(heads, dtype):
    h0, h1 = heads
    buf = torch.randn(2, len(IDS), SHAPE[1], h1 - h0, SHAPE[3]).to(dtype)
    k, v = torch.randn(SHAPE).to(dtype), torch.randn(SHAPE).to(dtype)
    want_k, want_v = k.clone(), v.clone()
    want_k[IDS, :, h0:h1], want_v[IDS, :, h0:h1] = buf[0], buf[1]
    unpack_blocks_ref(buf, k, v, IDS, h0, h1)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_unpack_into_a_strided_cache():
    """A last dim with stride 2 can't be viewed as bytes: the torch indexing path runs."""
    wide = [torch.randn(*SHAPE[:3], SHAPE[3] * 2) for _ in range(2)]
    k, v = (w[..., ::2] for w in wide)
    buf = torch.randn(2, len(IDS), SHAPE[1], 2, SHAPE[3])
    unpack_blocks_ref(buf, k, v, IDS, 1, 3)
    assert torch.equal(k[IDS, :, 1:3], buf[0]) and torch.equal(v[IDS, :, 1:3], buf[1])
