"""The pool reuses buffers; a reservation with a direct write in flight is not reported
before the write settles."""

from __future__ import annotations

import time

import torch

from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.reservation import Reservation, TransferState
from pdserve.kvtransfer.staging import BufferPool
from tests.kvtransfer.kvdata import TINY, descriptor, endpoints


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
