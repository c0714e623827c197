"""The two transport roles, independent of how bytes move.

A channel is always opened by the *sender* (prefill rank) towards a *receiver* (decode rank)
that listens on its rendezvous endpoint, through the signed handshake of
kvtransfer.handshake: the receiver authenticates the request and compares the layout before
any group exists and either refuses (with an ErrorCode and reason that both sides raise as
TransferError) or builds the channel. So a layout mismatch is caught before a single KV byte
is posted, and a peer without the cluster secret gets no channel at all.

`Connector` (sender side) caches one channel per destination rank and reopens it once it is
closed; `Listener` (receiver side) hands accepted channels to the receiver. Implementations:
`kvtransfer.rendezvous` (TCPStore + gloo/NCCL) and `kvtransfer.loopback` (in-process). A
transport's `device` is the device kind its data groups carry (None: any, in-process): the
sender and receiver refuse a KV cache on another kind at construction.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable

import torch

from pdserve.kvtransfer.channel import PairChannel
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.handshake import AcceptFn
from pdserve.kvtransfer.layout import KVLayout

logger = logging.getLogger(__name__)

CLOSE_JOIN_S = 5.0

ChannelFn = Callable[[Endpoint, PairChannel], None]
__all__ = ["AcceptFn", "ChannelFn", "Connector", "Listener"]


class Connector(abc.ABC):
    """Sender side: one cached channel per destination rank, reopened after a close.
    Transports implement `_open` (gloo over a TCPStore, or the in-process loopback)."""

    device: torch.device | None = None  # whose tensors its channels carry; None: any

    def __init__(self, source: Endpoint) -> None:
        self.source = source
        self._channels: dict[str, PairChannel] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._closed = False

    def connect(self, dest: Endpoint, layout: KVLayout) -> PairChannel:
        """The open channel to `dest`, opening one if needed; raises TransferError."""
        with self._lock:
            if self._closed:
                raise TransferError("sender transport is closed", ErrorCode.SHUTDOWN)
            lock = self._locks.setdefault(dest.key, threading.Lock())
        with lock:
            channel = self._channels.get(dest.key)
            if channel is not None and not channel.closed:
                return channel
            channel = self._open(dest, layout)
            channel.start_watchdog()
            self._channels[dest.key] = channel
            logger.info("channel %s: %s -> %s", channel.name, self.source.key, dest.key)
            return channel

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close("sender closed")
        for channel in channels:
            channel.join(CLOSE_JOIN_S)
        self._close_transport()

    @abc.abstractmethod
    def _open(self, dest: Endpoint, layout: KVLayout) -> PairChannel:
        """Handshake with `dest` (layouts compared) and return the pair's channel."""

    @abc.abstractmethod
    def _close_transport(self) -> None:
        """Release what the transport holds besides the channels (store clients, ...)."""


class Listener(abc.ABC):
    """Receiver side: accepts channels on `endpoint` until closed."""

    endpoint: Endpoint
    device: torch.device | None = None  # whose tensors its channels carry; None: any

    @abc.abstractmethod
    def listen(self, accept: AcceptFn, on_channel: ChannelFn) -> None:
        """Start accepting: `accept` vets each request, `on_channel` gets each new channel."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop accepting."""

