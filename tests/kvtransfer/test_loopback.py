"""KVSender -> KVReceiver in one process (LoopbackHub): the production code paths minus sockets."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from pdserve.kvtransfer import ErrorCode, KVReceiver, KVSender, LoopbackHub, TransferError
from tests.kernel_device import kernel_device
from tests.kvtransfer.kvdata import (
    SECRET,
    TINY,
    assert_landed,
    descriptor,
    endpoints,
    full_caches,
    shard,
    zero_caches,
)

SRC_BLOCKS = 12
DST_BLOCKS = 16
# The round trip also runs on a GPU in the kernel tests' GPU mode (scripts/gpu_check.sh): CUDA
# caches through the real sender, receiver and the Triton block packing.
DEVICE = kernel_device(os.environ)


class Cluster:
    """p prefill ranks and d decode ranks on one hub, their caches on `device`."""

    def __init__(self, p: int, d: int, layout=TINY, sender_layout=None, device="cpu") -> None:
        self.hub, self.layout = LoopbackHub(), layout
        self.src_eps, self.dst_eps = endpoints(1000, p), endpoints(2000, d)
        self.source = full_caches(layout, SRC_BLOCKS, seed=p * 10 + d, device=device)
        self.receivers, self.dest_caches = [], []
        for ep, (h0, h1) in zip(self.dst_eps, layout.head_ranges(d)):
            caches = zero_caches(layout, DST_BLOCKS, h1 - h0, device)
            self.dest_caches.append(caches)
            self.receivers.append(
                KVReceiver(layout, self.hub.listener(ep, secret=SECRET), d, caches))
        slayout = sender_layout or layout
        self.senders = [
            KVSender(slayout, self.hub.connector(ep, secret=SECRET), p,
                     shard(self.source, h0, h1))
            for ep, (h0, h1) in zip(self.src_eps, slayout.head_ranges(p))]

    def expect(self, dst_blocks: list[int], ttl: float = 30.0, name: str = "r"):
        desc = descriptor(self.layout, self.src_eps, self.dst_eps, dst_blocks, ttl, name)
        for r in self.receivers:
            r.expect(desc)
        return desc

    def push(self, batch, layers=None, finish=True) -> None:
        plans = [s.plan(batch) for s in self.senders]
        handles = [s.push_layer(layer, p) for layer in (layers or range(self.layout.num_layers))
                   for s, ps in zip(self.senders, plans) for p in ps]
        for h in handles:
            h.wait()
        if finish:
            for s, ps in zip(self.senders, plans):
                for p in ps:
                    s.finish(p).wait()

    def close(self) -> None:
        for s in self.senders:
            s.close()
        for r in self.receivers:
            r.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_round_trip_with_resharding(p: int, d: int, dtype: str) -> None:
    layout = dataclasses.replace(TINY, dtype=dtype)
    c = Cluster(p, d, layout, device=DEVICE)
    requests = [([0, 1, 2], [9, 4, 15]), ([5], [0]), ([7, 3, 10, 11], [1, 2, 3, 8])]
    descs = [c.expect(dst, name=f"r{i}") for i, (_, dst) in enumerate(requests)]
    c.push([(desc, src) for desc, (src, _) in zip(descs, requests)])
    for j, (r, (h0, h1)) in enumerate(zip(c.receivers, layout.head_ranges(d))):
        for desc in descs:
            assert r.wait(desc.transfer_id, timeout=5)
        for src, dst in requests:
            assert_landed(c.source, c.dest_caches[j], src, dst, h0, h1)
        untouched = sorted(set(range(DST_BLOCKS)) - {b for _, dst in requests for b in dst})
        assert all(not k[untouched].any() and not v[untouched].any() for k, v in c.dest_caches[j])
    c.close()


def test_one_message_per_layer_and_destination() -> None:
    c = Cluster(1, 2)
    descs = [c.expect([i]) for i in range(3)]
    plans = c.senders[0].plan([(d, [i]) for i, d in enumerate(descs)])
    assert len(plans) == 2  # one per destination rank, each carrying all three requests
    assert all(len(p.slices) == 3 for p in plans)
    c.close()


def test_chunked_pushes_with_block_offsets() -> None:
    c = Cluster(1, 1)
    desc = c.expect([3, 4, 5, 6])
    sender = c.senders[0]
    for chunk, offset in (([0, 1], 0), ([2, 3], 2)):
        for p in sender.plan([(desc, chunk)], block_offsets=[offset]):
            for layer in range(TINY.num_layers):
                sender.push_layer(layer, p).wait()
    assert c.receivers[0].wait(desc.transfer_id, timeout=5)
    assert_landed(c.source, c.dest_caches[0], [0, 1, 2, 3], [3, 4, 5, 6], 0, 4)
    assert c.receivers[0].poll().completed == ()  # already reported by wait()
    c.close()


def test_poll_reports_completion_once() -> None:
    c = Cluster(1, 1)
    desc = c.expect([1, 2])
    c.push([(desc, [0, 1])])
    deadline = time.time() + 5
    while not (events := c.receivers[0].poll()).completed and time.time() < deadline:
        time.sleep(0.01)
    assert events.completed == (desc.transfer_id,)
    assert c.receivers[0].poll().completed == ()
    c.close()


def test_cancelled_transfer_is_skipped_and_others_land() -> None:
    c = Cluster(1, 1)
    keep, drop = c.expect([1, 2]), c.expect([3, 4])
    c.receivers[0].cancel(drop.transfer_id)
    c.push([(keep, [0, 1]), (drop, [2, 3])])
    assert c.receivers[0].wait(keep.transfer_id, timeout=5)
    with pytest.raises(TransferError) as e:
        c.receivers[0].wait(drop.transfer_id)
    assert e.value.code is ErrorCode.CANCELLED
    assert not any(k[[3, 4]].any() for k, _ in c.dest_caches[0])  # nothing written there
    c.close()


def test_done_with_missing_layers_fails_fast() -> None:
    c = Cluster(1, 1)
    desc = c.expect([1, 2], ttl=30)
    t0 = time.time()
    c.push([(desc, [0, 1])], layers=[0, 1])  # the last layer never sent, then DONE
    with pytest.raises(TransferError, match="never sent"):
        c.receivers[0].wait(desc.transfer_id)
    assert time.time() - t0 < 5
    c.close()


def test_duplicate_data_fails_the_transfer() -> None:
    c = Cluster(1, 1)
    desc = c.expect([1])
    c.push([(desc, [0])], layers=[0], finish=False)
    c.push([(desc, [0])], layers=[0], finish=False)
    with pytest.raises(TransferError, match="arrived twice"):
        c.receivers[0].wait(desc.transfer_id, timeout=5)
    c.close()


def test_sender_abort_fails_the_receiver_promptly() -> None:
    c = Cluster(1, 1)
    desc = c.expect([1, 2])
    plans = c.senders[0].plan([(desc, [0, 1])])
    c.senders[0].push_layer(0, plans[0]).wait()
    c.senders[0].abort(plans, ErrorCode.PREFILL_FAILED)
    with pytest.raises(TransferError) as e:
        c.receivers[0].wait(desc.transfer_id, timeout=5)
    assert e.value.code is ErrorCode.PREFILL_FAILED and e.value.transfer_ids == (desc.transfer_id,)
    c.close()


def test_deadline_without_any_data() -> None:
    c = Cluster(1, 1)
    desc = c.expect([1], ttl=0.3)
    t0 = time.time()
    with pytest.raises(TransferError) as e:
        c.receivers[0].wait(desc.transfer_id)
    assert e.value.code is ErrorCode.DEADLINE and 0.25 < time.time() - t0 < 2
    assert c.receivers[0].poll().failed == ()  # reported once, by wait()
    with pytest.raises(TransferError, match="deadline passed"):  # the sender refuses too
        c.senders[0].push_layer(0, c.senders[0].plan([(desc, [0])])[0])
    c.close()


def test_layout_mismatch_fails_both_ends_and_writes_nothing() -> None:
    other = dataclasses.replace(TINY, model="tiny-qwen2")  # same shapes, other model
    c = Cluster(1, 1, sender_layout=other)
    desc = c.expect([1, 2])
    with pytest.raises(TransferError) as sent:
        c.push([(desc, [0, 1])])
    with pytest.raises(TransferError) as got:
        c.receivers[0].wait(desc.transfer_id, timeout=5)
    for e in (sent.value, got.value):
        assert e.code is ErrorCode.LAYOUT_MISMATCH
        assert "model: 'tiny-llama' vs 'tiny-qwen2'" in str(e)
    assert not any(k.any() or v.any() for k, v in c.dest_caches[0])
    c.close()


def test_expect_validates_the_descriptor() -> None:
    c = Cluster(1, 2)
    desc = c.expect([1])
    with pytest.raises(ValueError, match="already in use"):
        c.receivers[0].expect(desc)
    with pytest.raises(ValueError, match="past the cache"):
        c.receivers[0].expect(descriptor(TINY, c.src_eps, c.dst_eps, [DST_BLOCKS]))
    wrong = descriptor(TINY, c.src_eps, endpoints(3000, 2), [1])
    with pytest.raises(ValueError, match="this receiver is"):
        c.receivers[0].expect(wrong)
    with pytest.raises(ValueError, match="names sources"):
        c.senders[0].plan([(descriptor(TINY, endpoints(7, 1), c.dst_eps, [1]), [0])])
    with pytest.raises(ValueError, match="don't fit"):
        c.senders[0].plan([(desc, [0, 1])])
    c.close()


def test_receiver_close_fails_pending_and_sender_sees_it() -> None:
    c = Cluster(1, 1)
    desc = c.expect([1, 2])
    plans = c.senders[0].plan([(desc, [0, 1])])
    c.senders[0].push_layer(0, plans[0]).wait()
    c.receivers[0].close()
    with pytest.raises(TransferError) as got:
        c.receivers[0].wait(desc.transfer_id)
    assert got.value.code is ErrorCode.SHUTDOWN
    with pytest.raises(TransferError) as sent:
        c.senders[0].push_layer(1, plans[0]).wait()
    assert sent.value.code in (ErrorCode.SHUTDOWN, ErrorCode.PEER_LOST)
    assert sent.value.transfer_ids == (desc.transfer_id,)
    c.close()


def test_big_batches_split_into_several_plans() -> None:
    layout = dataclasses.replace(TINY, num_layers=1)
    hub = LoopbackHub()
    src, dst = endpoints(1, 1), endpoints(2, 1)
    caches = full_caches(layout, 300, seed=3)
    rx_caches = zero_caches(layout, 300, 4)
    rx = KVReceiver(layout, hub.listener(dst[0], secret=SECRET), 1, rx_caches)
    tx = KVSender(layout, hub.connector(src[0], secret=SECRET), 1, caches)
    descs = [descriptor(layout, src, dst, [i]) for i in range(300)]
    for d in descs:
        rx.expect(d)
    plans = tx.plan([(d, [i]) for i, d in enumerate(descs)])
    assert [len(p.slices) for p in plans] == [128, 128, 44]
    for p in plans:
        tx.push_layer(0, p).wait()
    assert all(rx.wait(d.transfer_id, timeout=5) for d in descs)
    assert torch.equal(rx_caches[0][0], caches[0][0])
    tx.close()
    rx.close()


def test_packed_messages_skip_cancelled_entries() -> None:
    """More than MAX_SEGMENTED_SLICES requests: one packed payload per layer."""
    c = Cluster(1, 2)
    descs = [c.expect([i]) for i in range(10)]
    c.receivers[0].cancel(descs[3].transfer_id)
    c.push([(d, [i]) for i, d in enumerate(descs)])
    for i, d in enumerate(descs):
        if i == 3:
            with pytest.raises(TransferError, match="cancelled"):
                c.receivers[0].wait(d.transfer_id, timeout=5)
            assert c.receivers[1].wait(d.transfer_id, timeout=5)  # rank 1 still wanted it
        else:
            assert all(r.wait(d.transfer_id, timeout=5) for r in c.receivers)
    keep = [i for i in range(10) if i != 3]
    assert_landed(c.source, c.dest_caches[0], keep, keep, 0, 2)
    assert_landed(c.source, c.dest_caches[1], list(range(10)), list(range(10)), 2, 4)
    assert not any(k[3].any() or v[3].any() for k, v in c.dest_caches[0])
    c.close()


def test_zero_copy_when_blocks_are_consecutive_on_both_sides() -> None:
    c = Cluster(1, 1)
    desc = c.expect(list(range(6, 14)))
    c.push([(desc, list(range(2, 10)))])
    assert c.receivers[0].wait(desc.transfer_id, timeout=5)
    assert_landed(c.source, c.dest_caches[0], list(range(2, 10)), list(range(6, 14)), 0, 4)
    c.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_round_trip(dtype: str) -> None:
    layout = dataclasses.replace(TINY, dtype=dtype)
    c = Cluster(2, 1, layout=layout)
    desc = c.expect([4, 5, 9])
    c.push([(desc, [1, 2, 3])])
    assert c.receivers[0].wait(desc.transfer_id, timeout=5)
    assert_landed(c.source, c.dest_caches[0], [1, 2, 3], [4, 5, 9], 0, 4)
    c.close()


def test_cancel_waits_for_a_direct_write_in_flight() -> None:
    import threading

    c = Cluster(1, 1)
    rx = c.receivers[0]
    desc = c.expect([1, 2])
    res = rx._transfers[desc.transfer_id]
    with rx._cond:
        res.claim(0, 0, 4, 0, 2, direct=True)  # as if the transport were writing blocks 1, 2

    def land_later() -> None:
        time.sleep(0.3)
        with rx._cond:
            res.release()
            rx._cond.notify_all()

    threading.Thread(target=land_later).start()
    t0 = time.time()
    rx.cancel(desc.transfer_id)
    assert 0.25 < time.time() - t0 < 1.5 and res.inflight == 0
    assert rx.poll().failed == ()  # cancel() itself handed the blocks back
    c.close()


def test_loopback_handshake_needs_the_same_secret() -> None:
    """The in-process path runs the signed handshake too: another secret gets no channel."""
    from pdserve.cluster_secret import ClusterSecret

    hub = LoopbackHub()
    src, dst = endpoints(1, 1), endpoints(2, 1)
    rx = KVReceiver(TINY, hub.listener(dst[0], secret=SECRET), 1, zero_caches(TINY, 4, 4))
    intruder = KVSender(TINY, hub.connector(src[0], secret=ClusterSecret.generate()), 1,
                        full_caches(TINY, 4, seed=1))
    desc = descriptor(TINY, src, dst, [0])
    rx.expect(desc)
    with pytest.raises(TransferError) as e:
        intruder.push_layer(0, intruder.plan([(desc, [0])])[0])
    assert e.value.code is ErrorCode.UNAUTHENTICATED
    assert rx.pending() == 1  # nothing reached the receiver's transfers
    with pytest.raises(ValueError, match="ClusterSecret"):
        hub.connector(src[0], secret="not-a-secret")
    intruder.close()
    rx.close()
