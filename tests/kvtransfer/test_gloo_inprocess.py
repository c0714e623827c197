"""Real gloo channels (TCPStore rendezvous, 127.0.0.1, port 0) between threads of this process."""

from __future__ import annotations

import dataclasses
import time

import pytest

from pdserve.kvtransfer import (
    Endpoint,
    ErrorCode,
    GlooConnector,
    GlooListener,
    KVReceiver,
    KVSender,
    MessageHeader,
    TransferError,
)
from pdserve.kvtransfer.header import Kind, TransferSlice
from tests.kvtransfer.kvdata import (
    SECRET,
    TINY,
    assert_landed,
    descriptor,
    endpoints,
    full_caches,
    zero_caches,
)

SOURCE = endpoints(1000, 1)


@pytest.fixture(params=["127.0.0.1", "127.0.0.2"])
def rig(request):
    """One prefill rank (TP=1) -> two decode ranks (TP=2) sharing rank 0's store; rank 1 on
    rank 0's address, or on another (as on another node: it binds its own, joins rank 0's
    store there, and senders reach it through that store)."""
    rank0 = GlooListener("127.0.0.1", rank=0, connect_timeout_s=5, secret=SECRET)
    rank1 = GlooListener(request.param, rank=1, port=rank0.endpoint.port, host_store=False,
                         connect_timeout_s=5, secret=SECRET, store_host="127.0.0.1")
    assert rank1.endpoint == Endpoint("127.0.0.1", rank0.endpoint.port, 1)
    dests = [zero_caches(TINY, 16, 2), zero_caches(TINY, 16, 2)]
    receivers = [KVReceiver(TINY, lst, 2, caches) for lst, caches in zip((rank0, rank1), dests)]
    source = full_caches(TINY, 12, seed=5)
    sender = KVSender(TINY, GlooConnector(SOURCE[0], connect_timeout_s=5, secret=SECRET), 1,
                      source)
    yield sender, receivers, source, dests
    sender.close()
    for r in reversed(receivers):  # rank 0 hosts the store the others poll: last
        r.close()


def _dests(receivers):
    return [r.endpoint for r in receivers]


def test_round_trip_over_gloo(rig) -> None:
    sender, receivers, source, dests = rig
    requests = [([0, 1, 2], [9, 4, 15]), ([5, 6], [0, 1])]
    descs = [descriptor(TINY, SOURCE, _dests(receivers), dst) for _, dst in requests]
    for d in descs:
        for r in receivers:
            r.expect(d)
    plans = sender.plan([(d, src) for d, (src, _) in zip(descs, requests)])
    handles = [sender.push_layer(layer, p) for layer in range(TINY.num_layers) for p in plans]
    for h in handles:
        h.wait()
    for p in plans:
        sender.finish(p).wait()
    for j, r in enumerate(receivers):
        for d in descs:
            assert r.wait(d.transfer_id, timeout=10)
        for src, dst in requests:
            assert_landed(source, dests[j], src, dst, 2 * j, 2 * j + 2)


def test_layout_mismatch_refused_at_the_handshake(rig) -> None:
    _, receivers, _, dests = rig
    other = dataclasses.replace(TINY, model="another-model")
    liar = KVSender(other, GlooConnector(SOURCE[0], connect_timeout_s=5, secret=SECRET), 1,
                    full_caches(other, 12, seed=6))
    desc = descriptor(TINY, SOURCE, _dests(receivers), [1, 2])
    for r in receivers:
        r.expect(desc)
    with pytest.raises(TransferError) as sent:
        liar.push_layer(0, liar.plan([(desc, [0, 1])])[0])
    for r in receivers[:1]:
        with pytest.raises(TransferError) as got:
            r.wait(desc.transfer_id, timeout=5)
        assert got.value.code is ErrorCode.LAYOUT_MISMATCH
        assert "model: 'tiny-llama' vs 'another-model'" in str(got.value)
    assert sent.value.code is ErrorCode.LAYOUT_MISMATCH and "refused" in str(sent.value)
    assert sent.value.transfer_ids == (desc.transfer_id,)
    assert not any(k.any() or v.any() for caches in dests for k, v in caches)
    liar.close()


def test_deadline_when_nothing_ever_comes(rig) -> None:
    _, receivers, _, _ = rig
    desc = descriptor(TINY, SOURCE, _dests(receivers), [1], ttl=0.5)
    receivers[0].expect(desc)
    t0 = time.time()
    with pytest.raises(TransferError) as e:
        receivers[0].wait(desc.transfer_id)
    assert e.value.code is ErrorCode.DEADLINE
    assert 0.45 < time.time() - t0 < 1.5


def test_stalled_payload_fails_at_the_deadline_then_channel_recovers(rig) -> None:
    sender, receivers, source, dests = rig
    rx = receivers[0]
    desc = descriptor(TINY, SOURCE, [rx.endpoint, receivers[1].endpoint], [1], ttl=0.8)
    rx.expect(desc)
    # A sender that posts a header and then never its payload (hung mid-message).
    channel = sender._connector.connect(rx.endpoint, TINY)
    header = MessageHeader.for_layer(TINY, 1, 0, 0, 2, (TransferSlice(desc.transfer_id, 0, 1),),
                                     desc.deadline)
    _, ops = channel.post_message(header, TINY)
    channel.wait(ops[0], time.time() + 5)
    t0 = time.time()
    with pytest.raises(TransferError) as e:
        rx.wait(desc.transfer_id)
    assert e.value.code is ErrorCode.DEADLINE and time.time() - t0 < 1.5
    # The unpacker's payload wait runs out just after; the channel closes on both sides and
    # the sender learns why from the store.
    t1 = time.time()
    while not channel.closed and time.time() - t1 < 5:
        time.sleep(0.02)
    assert channel.closed
    with pytest.raises(TransferError, match="missed its deadline"):
        channel.post_message(header, TINY)
    # The next transfer opens a fresh channel and goes through.
    fresh = descriptor(TINY, SOURCE, [rx.endpoint, receivers[1].endpoint], [2, 3])
    for r in receivers:
        r.expect(fresh)
    plans = sender.plan([(fresh, [4, 5])])
    for h in [sender.push_layer(layer, p) for layer in range(TINY.num_layers) for p in plans]:
        h.wait()
    assert rx.wait(fresh.transfer_id, timeout=10)
    assert_landed(source, dests[0], [4, 5], [2, 3], 0, 2)
    assert sender._connector.connect(rx.endpoint, TINY) is not channel


def test_receiver_close_reaches_the_sender_with_its_reason(rig) -> None:
    sender, receivers, _, _ = rig
    rx = receivers[1]
    channel = sender._connector.connect(rx.endpoint, TINY)
    rx.close()
    t0 = time.time()
    while not channel.closed and time.time() - t0 < 5:
        time.sleep(0.01)
    assert channel.closed and time.time() - t0 < 1.0
    done = MessageHeader.for_control(TINY, Kind.DONE, ErrorCode.NONE, 1, 2, 4, (b"x" * 16,),
                                     time.time() + 5)
    with pytest.raises(TransferError, match="receiver shut down") as e:
        channel.post_message(done, TINY)
    assert e.value.code is ErrorCode.SHUTDOWN


def test_zero_copy_both_ends_over_gloo() -> None:
    """TP=1 -> TP=1, consecutive blocks on both sides: sent from and received into the cache."""
    listener = GlooListener("127.0.0.1", connect_timeout_s=5, secret=SECRET)
    dest = zero_caches(TINY, 16, 4)
    rx = KVReceiver(TINY, listener, 1, dest)
    source = full_caches(TINY, 12, seed=8)
    tx = KVSender(TINY, GlooConnector(SOURCE[0], connect_timeout_s=5, secret=SECRET), 1,
                  source)
    try:
        descs = [descriptor(TINY, SOURCE, [listener.endpoint], list(range(3, 9))),
                 descriptor(TINY, SOURCE, [listener.endpoint], [12, 10])]  # staged
        for d in descs:
            rx.expect(d)
        plans = tx.plan([(descs[0], list(range(6))), (descs[1], [7, 9])])
        for h in [tx.push_layer(layer, p) for layer in range(TINY.num_layers) for p in plans]:
            h.wait()
        assert all(rx.wait(d.transfer_id, timeout=10) for d in descs)
    finally:
        tx.close()
        rx.close()
    assert_landed(source, dest, list(range(6)), list(range(3, 9)), 0, 4)
    assert_landed(source, dest, [7, 9], [12, 10], 0, 4)
