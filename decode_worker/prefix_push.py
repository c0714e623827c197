"""PrefixPusher: a decode worker's side of a prefix pull — its cached blocks, pushed out.

A session's next turn may land on a decode worker B other than the one that ran the last turn
(A: full, draining, or failed). Instead of recomputing the prefix A still caches, B reserves
blocks for it (its Submit with `pull_sources`, engine.scheduler) and A pushes them there, over
the same authenticated KV channels a prefill worker uses (kvtransfer.sender): one message per
layer, the blocks read straight from A's cache.

The blocks are held (a reference each, KVCacheManager.hold_cached) on A's loop thread before
the first byte is read and given back after the last one left: a cached block is never
written while referenced, so the push runs on the caller's thread while A keeps decoding. One
push at a time: each holds the sender's channels for its whole length. A push that fails, or
that A cannot serve (a block evicted since), tells B at once, which then computes the prefix
itself; nothing B receives is used unless every block of every layer landed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

import torch

from pdserve.kvtransfer.connector import Connector
from pdserve.kvtransfer.descriptor import TransferDescriptor
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.layout import KVLayout, transfer_view
from pdserve.kvtransfer.sender import KVSender, PushHandle

logger = logging.getLogger(__name__)


class PrefixPusher:
    """Pushes blocks of a TP-1 decode worker's `kv_caches` through `transport`."""

    def __init__(self, layout: KVLayout, transport: Connector,
                 kv_caches: Sequence[tuple[torch.Tensor, ...]]) -> None:
        self.layout = layout
        self.source = transport.source
        self.sender = KVSender(layout, transport, 1, transfer_view(layout, kv_caches))
        self._lock = threading.Lock()

    def push(self, descriptor: TransferDescriptor, block_ids: Sequence[int]) -> float:
        """Send `block_ids` (this worker's, held by the caller) into the descriptor's blocks,
        every layer, and wait until each byte left and the receiver was told it is complete.
        Seconds it took; TransferError (the receiver told, best effort) when it failed."""
        with self._lock:
            plans = self.sender.plan([(descriptor, block_ids)])
            started = time.perf_counter()
            handles: list[PushHandle] = []
            try:
                for layer in range(self.layout.num_layers):
                    handles += [self.sender.push_layer(layer, plan) for plan in plans]
                for handle in handles:
                    handle.wait()
                for plan in plans:
                    self.sender.finish(plan).wait()
            except TransferError:
                self.sender.abort(plans, ErrorCode.PREFILL_FAILED)
                for handle in handles:  # they read the blocks the caller is about to give back
                    with contextlib.suppress(TransferError):
                        handle.wait()
                raise
            return time.perf_counter() - started

    def refuse(self, descriptor: TransferDescriptor, reason: str) -> None:
        """Tell the puller now that nothing will come (it computes the prefix itself instead
        of waiting for the deadline). Best effort: never raises."""
        logger.info("prefix pull %s refused: %s", descriptor.request_id, reason)
        with self._lock:
            try:  # any block id will do: an abort names only the transfer
                plans = self.sender.plan([(descriptor, [0] * descriptor.num_pushed_blocks)])
            except ValueError:
                return
            self.sender.abort(plans, ErrorCode.PREFILL_FAILED)

    def close(self) -> None:
        self.sender.close()
