"""Issue 18, "skip what decode holds": the descriptor's `first_block`, end to end in-process.

The decode side's reservation shares the prompt's leading blocks its prefix cache holds; its
descriptor names destinations for the other blocks only (`first_block` = how many it skips),
the prefill side pushes only those, and the receiver has no way to let a push land in a
skipped block: such blocks are shared with other requests, and writing one would corrupt them.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from pdserve.engine.kv_connector import RemotePrefill
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from pdserve.kvtransfer import KVReceiver, LoopbackHub, TransferError
from pdserve.kvtransfer.descriptor import MAX_BLOCKS, DescriptorError, TransferDescriptor
from pdserve.kvtransfer.header import TransferSlice
from pdserve.kvtransfer.push_connector import KVPushConnector
from pdserve.kvtransfer.receive_connector import KVReceiveConnector
from pdserve.kvtransfer.sender import PushPlan
from tests.kvtransfer.kvdata import SECRET, TINY, endpoints, full_caches, zero_caches

SOURCES, DESTS = endpoints(3100, 1), endpoints(3200, 1)
NUM_BLOCKS = 16
HELD = [5, 6]  # the decode side's cached blocks of the prompt's first two blocks
FRESH = [9, 4, 11]  # the blocks it reserved for the rest
SRC = [0, 1, 2, 3, 7]  # the prefill side's blocks of the same 5-block prompt
SENTINEL = 7.0


def block_nbytes() -> int:
    """One request block, K and V, every layer and head, float32 (computed from the layout's
    definition, not from the code under test)."""
    return 2 * TINY.block_size * TINY.num_kv_heads * TINY.head_dim * 4 * TINY.num_layers


def skipping(first_block: int = len(HELD), block_ids=FRESH) -> TransferDescriptor:
    return TransferDescriptor.new("turn-2", TINY, SOURCES, [(DESTS[0], block_ids)],
                                  time.time() + 30, first_block)


def test_round_trip_keeps_the_skip_and_counts_bytes() -> None:
    d = skipping()
    back = TransferDescriptor.decode(d.encode())
    assert back == d and back.first_block == 2
    assert (back.num_blocks, back.num_pushed_blocks) == (5, 3)
    assert back.pushed_nbytes(TINY) == 3 * block_nbytes()
    assert back.skipped_nbytes(TINY) == 2 * block_nbytes()
    plain = TransferDescriptor.new("turn-1", TINY, SOURCES, [(DESTS[0], FRESH)], time.time() + 30)
    assert plain.first_block == 0 and plain.skipped_nbytes(TINY) == 0


@pytest.mark.parametrize("value", [-1, True, 2.0, "2", None, [2], MAX_BLOCKS - 2])
def test_decoder_refuses_an_inconsistent_skip(value) -> None:
    doc = json.loads(skipping().encode())
    doc["first_block"] = value  # MAX_BLOCKS - 2: with 3 pushed blocks, past MAX_BLOCKS
    with pytest.raises(DescriptorError, match="first_block"):
        TransferDescriptor.decode(json.dumps(doc))


def test_decoder_refuses_a_missing_skip_or_an_older_version() -> None:
    doc = json.loads(skipping().encode())
    del doc["first_block"]
    with pytest.raises(DescriptorError, match="keys"):
        TransferDescriptor.decode(json.dumps(doc))
    doc = json.loads(skipping().encode())
    doc["v"] = 1
    with pytest.raises(DescriptorError, match="version"):
        TransferDescriptor.decode(json.dumps(doc))
    with pytest.raises(DescriptorError, match="first_block"):
        skipping(first_block=-1)


class Pair:
    """One decode rank (receive connector over a loopback hub) and one prefill rank."""

    def __init__(self) -> None:
        hub = LoopbackHub()
        self.source = full_caches(TINY, 8, seed=5)
        self.dest = zero_caches(TINY, NUM_BLOCKS, TINY.num_kv_heads)
        for k, v in self.dest:  # what the decode side computed for the held blocks
            k[HELD], v[HELD] = SENTINEL, SENTINEL
        self.decode = KVReceiveConnector(TINY, hub.listener(DESTS[0], secret=SECRET), DESTS,
                                         TensorParallel())
        self.decode.register_kv_caches(self.dest)
        self.prefill = KVPushConnector(TINY, hub.connector(SOURCES[0], secret=SECRET))
        self.prefill.register_kv_caches(self.source)

    def reserve(self, num_cached_tokens: int, blocks=HELD + FRESH) -> TransferDescriptor:
        prompt = tuple(range(100, 100 + 5 * TINY.block_size - 1))  # 5 blocks, last one partial
        request = Request("turn-2", prompt, SamplingParams(), (),
                          kv_transfer=RemotePrefill(tuple(SOURCES), time.time() + 30))
        request.num_cached_tokens = num_cached_tokens  # what the scheduler found cached
        return self.decode.reserve(request, blocks)

    def receiver(self) -> KVReceiver:
        assert self.decode.receiver is not None
        return self.decode.receiver

    def held_intact(self) -> bool:
        return all(bool((k[HELD] == SENTINEL).all() and (v[HELD] == SENTINEL).all())
                   for k, v in self.dest)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_reservation_names_only_the_blocks_to_receive(pair) -> None:
    desc = pair.reserve(2 * TINY.block_size)
    assert desc.first_block == 2 and desc.destinations[0].block_ids == tuple(FRESH)
    assert not set(desc.destinations[0].block_ids) & set(HELD)  # no push can address them
    for cached, blocks in ((5, HELD + FRESH), (0, HELD + FRESH[:2]),
                           (5 * TINY.block_size, HELD + FRESH)):
        with pytest.raises(ValueError, match="cached"):  # not whole blocks / wrong count / all
            pair.reserve(cached, blocks)


def test_prefill_pushes_only_the_missing_blocks(pair) -> None:
    desc = pair.reserve(2 * TINY.block_size)
    entry = ScheduledRequest("turn-2", (1,), 5 * TINY.block_size - 2, tuple(SRC),
                             SamplingParams(), kv_transfer=desc)
    pair.prefill.start_save(SchedulerOutput((entry,)))
    for layer in range(TINY.num_layers):
        pair.prefill.save_kv_layer(layer)
    result = pair.prefill.wait_for_save()["turn-2"]
    assert result.error is None and result.num_bytes == 3 * block_nbytes()
    assert pair.receiver().wait(desc.transfer_id, timeout=5)
    for (sk, sv), (dk, dv) in zip(pair.source, pair.dest):
        assert torch.equal(dk[FRESH], sk[SRC[2:]]) and torch.equal(dv[FRESH], sv[SRC[2:]])
    assert pair.held_intact()


def test_a_push_into_the_skipped_blocks_is_refused(pair) -> None:
    desc = pair.reserve(2 * TINY.block_size)
    sender = pair.prefill.sender
    assert sender is not None
    with pytest.raises(ValueError, match="after the 2 the decode side holds"):
        sender.plan([(desc, SRC)])  # every block of the prompt: ours refuses to send it
    # a sender that ignores the skip anyway (offsets 0..4 of 3 reserved blocks)
    plan = PushPlan(DESTS[0], 0, TINY.num_kv_heads, (TransferSlice(desc.transfer_id, 0, 5),),
                    tuple(SRC), TINY.layout_id, desc.deadline, 1)
    with pytest.raises(TransferError, match=r"blocks \[0, 5\) overrun the 3 reserved"):
        sender.push_layer(0, plan).wait()  # the receiver closed the channel on its header
    with pytest.raises(TransferError):
        pair.receiver().wait(desc.transfer_id, timeout=5)
    assert pair.held_intact()
    for k, v in pair.dest:  # refused before receiving: no byte of it moved anywhere
        assert not k[FRESH].any() and not v[FRESH].any()
