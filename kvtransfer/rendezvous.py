"""Channels over torch.distributed from a TCPStore rendezvous, with no global world.

Every decode rank listens on an endpoint (host, port, rank): a TCPStore it hosts itself
(`GlooListener(host)`, port 0 = any free port, read back from `.endpoint`), or the store of
its TP rank 0 (`GlooListener(host, rank=r, port=p, host_store=False)`); keys are namespaced
by rank. The hosted store listens on `host` only (a socket bound here and handed to TCPStore:
by default TCPStore listens on every interface). Nothing read from the store is unpickled.

Handshake (keys under `pdkv/v1/<rank>/`):
    sender    n = add("n", 1); set("req/<n>", ConnectRequest JSON); wait("ack/<nonce>")
    receiver  in order, polls "req/<k>", answers "ok" or "refused:<code>:<reason>"
    both      control group  ProcessGroupGloo(PrefixStore(".../pair/<nonce>/c"), 0|1, 2)
              data group     the same under ".../d", or ProcessGroupNCCL on CUDA
The sender is rank 0, the receiver rank 1. A closed channel leaves its reason at
".../pair/<nonce>/reason" for the other side's error message.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.kvtransfer.channel import RECEIVER, SENDER, PairChannel
from pdserve.kvtransfer.connector import (
    AcceptFn,
    ChannelFn,
    Connector,
    ConnectRequest,
    Listener,
    check_request,
    decode_answer,
    encode_answer,
)
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.layout import KVLayout

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how often the accept loop looks for a connect request
MAX_REASON_CHARS = 1024


def _prefix(rank: int) -> str:
    return f"pdkv/v1/{rank}"


class StoreReasons:
    """`ReasonBoard` on a store client that nobody blocks on (so a lock is enough)."""

    def __init__(self, store: dist.Store) -> None:
        self._store, self.lock = store, threading.Lock()

    def publish(self, key: str, reason: str) -> None:
        try:
            with self.lock:
                self._store.set(f"{key}/reason", reason[:MAX_REASON_CHARS])
        except RuntimeError:
            logger.debug("could not publish close reason of %s", key, exc_info=True)

    def fetch(self, key: str) -> str | None:
        try:
            with self.lock:
                if not self._store.check([f"{key}/reason"]):
                    return None
                raw = self._store.get(f"{key}/reason")
        except RuntimeError:
            return None
        return raw[:MAX_REASON_CHARS].decode("utf-8", errors="replace")


def make_groups(
    store: dist.Store, name: str, rank: int, host: str, device: torch.device,
    timeout: timedelta,
) -> tuple[Any, Any]:
    """(control, data) 2-rank groups under the store prefix `name`; blocks for the peer."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout  # bounds the connect; every later wait passes its own timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    control = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/c", store), rank, 2, opts)
    if device.type == "cuda":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        data = dist.ProcessGroupNCCL(dist.PrefixStore(f"{name}/d", store), rank, 2, nccl_opts)
    else:
        data = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/d", store), rank, 2, opts)
    return control, data


def _client(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False)


class GlooConnector(Connector):
    """Sender side over TCPStore rendezvous; one store client per destination store."""

    def __init__(self, source: Endpoint, device: torch.device | str = "cpu",
                 connect_timeout_s: float = 10.0) -> None:
        super().__init__(source)
        self.device = torch.device(device)
        self.timeout = timedelta(seconds=connect_timeout_s)
        self._stores: dict[tuple[str, int], tuple[dist.TCPStore, StoreReasons]] = {}

    def _open(self, dest: Endpoint, layout: KVLayout) -> PairChannel:
        try:
            store, reasons = self._store(dest)
            nonce = os.urandom(16).hex()
            prefix = _prefix(dest.rank)
            request = ConnectRequest(self.source, nonce, layout)
            with reasons.lock:  # the client is not safe for concurrent blocking calls
                n = store.add(f"{prefix}/n", 1)
                store.set(f"{prefix}/req/{n}", request.encode())
                store.wait([f"{prefix}/ack/{nonce}"], self.timeout)
                answer = store.get(f"{prefix}/ack/{nonce}")
                store.delete_key(f"{prefix}/ack/{nonce}")
                decode_answer(answer, dest)
                name = f"{prefix}/pair/{nonce}"
                control, data = make_groups(store, name, SENDER, self.source.host, self.device,
                                            self.timeout)
        except RuntimeError as e:  # DistStoreError, gloo connect errors (TransferError passes)
            if isinstance(e, TransferError):
                raise
            self._stores.pop((dest.host, dest.port), None)
            raise TransferError(f"can't open a channel to {dest.key}: {e}",
                                ErrorCode.PEER_LOST) from None
        return PairChannel(control, data, rank=SENDER, name=name, peer_key=dest.key,
                           reasons=reasons, device=self.device)

    def _store(self, dest: Endpoint) -> tuple[dist.TCPStore, StoreReasons]:
        key = (dest.host, dest.port)
        if key not in self._stores:
            store = _client(dest.host, dest.port, self.timeout)
            self._stores[key] = (store, StoreReasons(store))
        return self._stores[key]

    def _close_transport(self) -> None:
        self._stores.clear()


class GlooListener(Listener):
    """Receiver side: hosts (or joins) a TCPStore and accepts channels in a thread."""

    def __init__(
        self, host: str = "127.0.0.1", rank: int = 0, port: int = 0, host_store: bool = True,
        device: torch.device | str = "cpu", connect_timeout_s: float = 10.0,
    ) -> None:
        self.host, self.device = host, torch.device(device)
        self.timeout = timedelta(seconds=connect_timeout_s)
        self._master: dist.TCPStore | None = None
        if host_store:
            sock = socket.create_server((host, port), backlog=128)
            port = sock.getsockname()[1]
            # TCPStore takes the already-bound socket (and owns the fd from here on).
            self._master = dist.TCPStore(host, port, None, True, timeout=self.timeout,
                                         wait_for_workers=False, master_listen_fd=sock.detach())
        self.endpoint = Endpoint(host, port, rank)
        self._prefix = _prefix(rank)
        self._accept_store = _client(host, port, self.timeout)  # only the accept thread
        self._reason_store = _client(host, port, self.timeout)  # never blocked on
        self.reasons = StoreReasons(self._reason_store)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    def listen(self, accept: AcceptFn, on_channel: ChannelFn) -> None:
        self._thread = threading.Thread(target=self._loop, args=(accept, on_channel),
                                        name=f"kv-accept-{self.endpoint.key}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(1.0 + self.timeout.total_seconds())
            if self._thread.is_alive():
                logger.warning("accept thread of %s did not stop", self.endpoint.key)
        self._master = None  # the server stops with its last reference

    def _loop(self, accept: AcceptFn, on_channel: ChannelFn) -> None:
        # Polls with check() instead of blocking in wait(): a timed-out TCPStore wait logs a
        # C++ warning each time, and the Event makes close() immediate.
        store, k, since = self._accept_store, 1, time.monotonic()
        while not self._closing.wait(POLL_S):
            key = f"{self._prefix}/req/{k}"
            try:
                if not store.check([key]):
                    # A sender that took a number and died leaves a hole: skip it after a while.
                    if time.monotonic() - since > self.timeout.total_seconds() and store.add(
                            f"{self._prefix}/n", 0) > k:
                        logger.warning("skipping connect request %d of %s: never written", k,
                                       self.endpoint.key)
                        k, since = k + 1, time.monotonic()
                    continue
                raw = store.get(key)
                store.delete_key(key)
            except RuntimeError as e:  # the store's host (TP rank 0) is gone
                logger.error("rendezvous store of %s failed, accepting no more channels: %s",
                             self.endpoint.key, e)
                return
            k, since = k + 1, time.monotonic()
            self._handle(raw, accept, on_channel)

    def _handle(self, raw: bytes, accept: AcceptFn, on_channel: ChannelFn) -> None:
        try:
            request = ConnectRequest.decode(raw)
        except ValueError as e:
            logger.warning("ignoring a malformed connect request on %s: %s",
                           self.endpoint.key, e)
            return
        refusal = check_request(accept, request)
        store = self._accept_store
        store.set(f"{self._prefix}/ack/{request.nonce}", encode_answer(refusal))
        if refusal is not None:
            logger.warning("refused %s on %s: %s", request.source.key, self.endpoint.key,
                           refusal[1])
            return
        name = f"{self._prefix}/pair/{request.nonce}"
        try:
            control, data = make_groups(store, name, RECEIVER, self.host, self.device,
                                        self.timeout)
        except RuntimeError as e:
            logger.warning("channel from %s never came up: %s", request.source.key, e)
            return
        on_channel(request.source, PairChannel(
            control, data, rank=RECEIVER, name=name, peer_key=request.source.key,
            reasons=self.reasons, device=self.device))
