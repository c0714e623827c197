"""The sender's pack_into writes kernels.pack_blocks' wire format; the pool reuses buffers;
a reservation with a direct write in flight is not reported before the write settles."""

from __future__ import annotations

import time

import pytest
import torch

from kernels.pack_blocks import pack_blocks_ref, unpack_blocks_ref
from kvtransfer.errors import ErrorCode, TransferError
from kvtransfer.reservation import Reservation, TransferState
from kvtransfer.staging import BufferPool, pack_into, unpack_from
from tests.kvtransfer.kvdata import TINY, descriptor, endpoints, full_caches


@pytest.mark.parametrize("heads", [(0, 4), (1, 3), (2, 4)])
def test_pack_into_matches_pack_blocks_ref(heads: tuple[int, int]) -> None:
    (k, v), = full_caches(TINY, 10, seed=1)[:1]
    ids = torch.tensor([7, 0, 3, 9])
    h0, h1 = heads
    out = torch.full((2, 4, TINY.block_size, h1 - h0, TINY.head_dim), float("nan"))
    assert torch.equal(pack_into(out, k, v, ids, h0, h1), pack_blocks_ref(k, v, ids, h0, h1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(0, 4), (1, 3), (2, 4)])
def test_unpack_from_matches_unpack_blocks_ref(heads: tuple[int, int], dtype: torch.dtype) -> None:
    h0, h1 = heads
    ids = torch.tensor([7, 0, 3, 9])
    buf = torch.randn(2, 4, TINY.block_size, h1 - h0, TINY.head_dim).to(dtype)
    caches = [tuple(torch.randn(10, TINY.block_size, 4, TINY.head_dim).to(dtype)
                    for _ in range(2)) for _ in range(2)]
    ref, fast = caches[0], tuple(c.clone() for c in caches[0])
    unpack_blocks_ref(buf, *ref, ids, h0, h1)
    with torch.inference_mode():
        unpack_from(buf, *fast, ids, h0, h1)
    assert all(torch.equal(a, b) for a, b in zip(ref, fast, strict=True))
    # a cache whose last dim is strided can't be viewed as bytes: the reference path runs
    wide = [torch.randn(10, TINY.block_size, 4, TINY.head_dim * 2).to(dtype) for _ in range(2)]
    k, v = (w[..., ::2] for w in wide)
    unpack_from(buf, k, v, ids, h0, h1)
    assert torch.equal(k[ids, :, h0:h1], buf[0]) and torch.equal(v[ids, :, h0:h1], buf[1])


def test_pool_reuses_and_caps() -> None:
    pool = BufferPool(max_bytes=1024)
    a = pool.take((2, 8), torch.float32, torch.device("cpu"))
    pool.give(a)
    b = pool.take((4, 4), torch.float32, torch.device("cpu"))  # same bytes, other shape
    assert b.data_ptr() == a.data_ptr() and b.shape == (4, 4)
    big = pool.take((1024,), torch.float32, torch.device("cpu"))
    pool.give(big)  # 4 KiB > cap: not kept
    assert pool.take((1024,), torch.float32, torch.device("cpu")).data_ptr() != big.data_ptr()


def test_direct_claim_keeps_a_failed_transfer_unsettled() -> None:
    desc = descriptor(TINY, endpoints(1, 1), endpoints(2, 1), [4, 5, 6, 9])
    res = Reservation(desc, (4, 5, 6, 9), torch.tensor([4, 5, 6, 9]), 0, 4, TINY.num_layers)
    assert res.consecutive(0, 3) and not res.consecutive(0, 4) and res.consecutive(3, 1)
    res.claim(0, 0, 4, 0, 3, direct=True)
    assert res.check_slice(0, 0, 4, 1, 1) is not None  # claimed cells can't come twice
    res.state, res.error = TransferState.FAILED, TransferError("x", ErrorCode.CANCELLED)
    assert not res.settled  # the transport may still be writing blocks 4..6
    res.release()
    assert res.settled
    assert time.time() < res.deadline
