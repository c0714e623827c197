"""A real KV pair (TCPStore rendezvous, two threads of this process) on the kernel tests'
device (`PDSERVE_KERNEL_DEVICE`). On the CPU its data group is gloo and the KV lands. On one
GPU both ends are on the same device, where NCCL cannot form a group ("Duplicate GPU
detected" at the first send): the pair must be refused at once with DEVICE_CONFLICT, not hang
until a timeout. (Two GPUs, the NCCL path proper, need a machine the GPU check does not have.)
"""

from __future__ import annotations

import os
import time

import pytest

from pdserve.kvtransfer import (
    ErrorCode,
    GlooConnector,
    GlooListener,
    KVReceiver,
    KVSender,
    TransferError,
)
from tests.kernel_device import kernel_device
from tests.kvtransfer.kvdata import (
    SECRET,
    TINY,
    assert_landed,
    descriptor,
    endpoints,
    full_caches,
    zero_caches,
)

DEVICE = kernel_device(os.environ)
CONNECT_S = 20.0  # what a hang would wait; a refusal must come well before


def test_a_kv_pair_on_the_device_lands_or_is_refused_at_once():
    listener = GlooListener("127.0.0.1", device=DEVICE, connect_timeout_s=CONNECT_S,
                            secret=SECRET)
    dest = zero_caches(TINY, 8, 4, DEVICE)
    rx = KVReceiver(TINY, listener, 1, dest)
    source = full_caches(TINY, 6, seed=4, device=DEVICE)
    source_ep = endpoints(1000, 1)
    tx = KVSender(TINY, GlooConnector(source_ep[0], device=DEVICE, connect_timeout_s=CONNECT_S,
                                      secret=SECRET), 1, source)
    desc = descriptor(TINY, source_ep, [listener.endpoint], [5, 1, 2])
    rx.expect(desc)
    start = time.monotonic()
    try:
        plans = tx.plan([(desc, [0, 3, 4])])
        if DEVICE == "cpu":
            for handle in [tx.push_layer(i, p) for i in range(TINY.num_layers) for p in plans]:
                handle.wait()
            assert rx.wait(desc.transfer_id, timeout=10)
            assert_landed(source, dest, [0, 3, 4], [5, 1, 2], 0, 4)
            return
        with pytest.raises(TransferError) as refused:
            for handle in [tx.push_layer(i, p) for i in range(TINY.num_layers) for p in plans]:
                handle.wait()
        assert refused.value.code is ErrorCode.DEVICE_CONFLICT, refused.value
        assert time.monotonic() - start < CONNECT_S / 2
    finally:
        tx.close()
        rx.close()
