"""Channels over torch.distributed from a TCPStore rendezvous, with no global world.

Every decode rank listens on an endpoint (host, port, rank): a TCPStore it hosts itself
(`GlooListener(host, secret=...)`, port 0 = any free port, read back from `.endpoint`), or
the store of its TP rank 0 (`GlooListener(host, rank=r, port=p, host_store=False,
store_host=rank 0's host, ...)`, rank 0 maybe on another node);
keys are namespaced by rank. The hosted store listens on `host` only (a socket bound here and
handed to TCPStore: by default TCPStore listens on every interface). Nothing read from the
store is unpickled, and nothing read from it is trusted before its HMAC checked out.

Handshake (keys under `pdkv/v2/<rank>/`, messages of kvtransfer.handshake):
    sender    queue_push("q", signed ConnectRequest); wait("ack/<nonce>") (bounded)
    receiver  accept thread: pops "q", verifies, answers a signed "ok" or
              "refused:<code>:<reason>" at "ack/<nonce>"; never blocks on a peer
    both      control group  ProcessGroupGloo(PrefixStore(pair_name(nonce) + "/c"), 0|1, 2)
              data group     the same under "/d" on CPU; on CUDA (the connector's and the
                             listener's `device`, from the worker spec) ProcessGroupNCCL under
                             "/d", once the two ends traded device identities over the control
                             group and proved to be on two GPUs (kvtransfer.device_groups):
                             NCCL can't pair one GPU with itself, so that is refused at once
                             with TransferError(DEVICE_CONFLICT) instead of failing later.
                             Both ends need the same device kind: a CPU end facing a CUDA
                             one fails within the connect timeout (PEER_LOST, says why)
The receiver forms each pair's groups in a thread of its own (at most
`max_pending_handshakes` at once, each bounded by the connect timeout), so a peer that
posts a request and never joins delays nobody else. The sender is rank 0, the receiver rank
1. A closed channel leaves its reason at "<pair>/reason" for the other side's error message.

What the store cannot give: TCPStore and gloo have no authentication of their own. Anyone
who reaches the port can still read, pop or overwrite store keys (a denial of service, not a
channel: a request or answer they make is refused for its signature) — keep KV ports on the
cluster network (docs/security.md).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.cluster_secret import ClusterSecret
from pdserve.kvtransfer.channel import RECEIVER, SENDER, PairChannel
from pdserve.kvtransfer.connector import AcceptFn, ChannelFn, Connector, Listener
from pdserve.kvtransfer.descriptor import Endpoint
from pdserve.kvtransfer.device_groups import (
    DeviceIdentity,
    IdentityFn,
    collective_backend,
    gather_identities,
    local_identity,
    nccl_group,
    shared_gpu_reason,
)
from pdserve.kvtransfer.errors import ErrorCode, TransferError
from pdserve.kvtransfer.handshake import (
    ConnectRequest,
    HandshakeRefused,
    ReplayGuard,
    check_answer,
    check_request,
    check_secret,
    encode_answer,
    open_request,
    pair_name,
)
from pdserve.kvtransfer.layout import KVLayout

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how often the accept loop looks for a connect request
MAX_REASON_CHARS = 1024
MAX_PENDING_HANDSHAKES = 16  # accepted peers whose groups are still forming
CLOSE_JOIN_S = 1.0


def store_prefix(rank: int) -> str:
    """Where a rank's handshake keys live in the store (the request queue is "<prefix>/q")."""
    return f"pdkv/v2/{rank}"


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
    timeout: timedelta, *, identity: IdentityFn = local_identity,
) -> tuple[Any, Any]:
    """(control, data) 2-rank groups under the store prefix `name`; blocks for the peer.

    The control group is gloo (headers are CPU bytes); the data group carries tensors of
    `device`: gloo on CPU, NCCL on CUDA, formed only once the two ends proved to be on two
    GPUs (`identity(device)` traded over the control group; TransferError otherwise)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout  # bounds the connect; every later wait passes its own timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    control = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/c", store), rank, 2, opts)
    if collective_backend(device) == "nccl":
        refuse_one_gpu(control, identity(device), timeout)
        data = nccl_group(dist.PrefixStore(f"{name}/d", store), rank, 2, timeout)
    else:
        data = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/d", store), rank, 2, opts)
    return control, data


def refuse_one_gpu(control: Any, mine: DeviceIdentity, timeout: timedelta) -> None:
    """Trade device identities over the pair's gloo control group; TransferError when both
    ends are on one GPU (NCCL would fail their first send) or the peer sends none."""
    try:
        pair = gather_identities(control, 2, mine, timeout)
    except (RuntimeError, ValueError) as e:
        raise TransferError(
            f"the peer sent no valid device identity within {timeout.total_seconds():g} s "
            f"({e}): it is gone, or it runs on another device kind; both ends of a KV pair "
            "must run with the same --device", ErrorCode.PEER_LOST) from None
    why = shared_gpu_reason(pair, "KV pair (prefill rank 0, decode rank 1)",
                            "give the prefill and decode workers different GPUs (Ray "
                            "num_gpus per worker, or distinct CUDA_VISIBLE_DEVICES), or run "
                            "both with --device cpu")
    if why is not None:
        raise TransferError(why, ErrorCode.DEVICE_CONFLICT)


def _client(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the store at host:port. A refused connection (nothing listens there: the
    peer is gone) fails at once, where TCPStore would retry it until its timeout, twice (~20 s
    for a 10 s timeout): the sender's request is failed and placed again that much sooner."""
    try:
        socket.create_connection((host, port), timeout=timeout.total_seconds()).close()
    except ConnectionRefusedError:
        raise RuntimeError(f"nothing listens at {host}:{port} (connection refused)") from None
    except OSError:
        pass  # unreachable or slow: TCPStore's own bounded retries decide
    return dist.TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False)


class GlooConnector(Connector):
    """Sender side over TCPStore rendezvous; one store client per destination store.

    `device` is where the KV it sends lives (the worker spec's): its channels' data groups
    are gloo on CPU, NCCL on CUDA; the name says what the handshake and headers ride on."""

    def __init__(self, source: Endpoint, device: torch.device | str = "cpu",
                 connect_timeout_s: float = 10.0, *, secret: ClusterSecret) -> None:
        super().__init__(source)
        self.device = torch.device(device)
        collective_backend(self.device)  # an unsupported device fails here, not per channel
        self.timeout = timedelta(seconds=connect_timeout_s)
        self._secret = check_secret(secret)
        self._stores: dict[tuple[str, int], tuple[dist.TCPStore, StoreReasons]] = {}

    def _open(self, dest: Endpoint, layout: KVLayout) -> PairChannel:
        prefix = store_prefix(dest.rank)
        request = ConnectRequest(self.source, dest, layout)
        ack = f"{prefix}/ack/{request.nonce}"
        name = pair_name(self._secret, prefix, request.nonce)
        try:
            store, reasons = self._store(dest)
            with reasons.lock:  # the client is not safe for concurrent blocking calls
                store.queue_push(f"{prefix}/q", request.encode(self._secret))
                store.wait([ack], self.timeout)
                answer = store.get(ack)
                store.delete_key(ack)
                check_answer(self._secret, request.nonce, answer, dest)
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
    """Receiver side: hosts (or joins) a TCPStore and accepts channels in a thread; `device`
    as for GlooConnector (the receiving KV cache's: NCCL data groups on CUDA). `host` is the
    address this rank binds (its store, when it hosts one, and its groups' pairs);
    `store_host` where the store it joins listens (a TP follower's: rank 0's host, which may
    be another node's), `host` by default. Senders address it by the store's."""

    def __init__(
        self, host: str = "127.0.0.1", rank: int = 0, port: int = 0, host_store: bool = True,
        device: torch.device | str = "cpu", connect_timeout_s: float = 10.0, *,
        secret: ClusterSecret, max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
        store_host: str | None = None,
    ) -> None:
        store_host = host if store_host is None else store_host
        if host_store and store_host != host:
            raise ValueError(f"a listener hosting its store binds it on its own host {host}, "
                             f"not {store_host}")
        if type(max_pending_handshakes) is not int or max_pending_handshakes < 1:
            raise ValueError(f"max_pending_handshakes must be an int >= 1, "
                             f"got {max_pending_handshakes!r}")
        self.host, self.device = host, torch.device(device)
        collective_backend(self.device)
        self.timeout = timedelta(seconds=connect_timeout_s)
        self._secret, self._replays = check_secret(secret), ReplayGuard()
        self.max_pending_handshakes = max_pending_handshakes
        self._slots = threading.BoundedSemaphore(max_pending_handshakes)
        self._master: dist.TCPStore | None = None
        if host_store:
            sock = socket.create_server((host, port), backlog=128)
            port = sock.getsockname()[1]
            # TCPStore takes the already-bound socket (and owns the fd from here on).
            self._master = dist.TCPStore(host, port, None, True, timeout=self.timeout,
                                         wait_for_workers=False, master_listen_fd=sock.detach())
        self.endpoint = Endpoint(store_host, port, rank)
        self._prefix = store_prefix(rank)
        self._accept_store = _client(store_host, port, self.timeout)  # only the accept thread
        self._reason_store = _client(store_host, port, self.timeout)  # never blocked on
        self.reasons = StoreReasons(self._reason_store)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._joins: list[threading.Thread] = []  # handshake threads (accept thread only)

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
        end = time.monotonic() + CLOSE_JOIN_S  # a forming group ends by its own timeout
        for t in self._joins:
            t.join(max(end - time.monotonic(), 0.0))

    def _loop(self, accept: AcceptFn, on_channel: ChannelFn) -> None:
        # Polls without blocking: a timed-out TCPStore wait logs a C++ warning each time, and
        # the Event makes close() immediate. Nothing here waits on a peer.
        store, queue = self._accept_store, f"{self._prefix}/q"
        while not self._closing.wait(POLL_S):
            while not self._closing.is_set():
                try:
                    raw = store.queue_pop(queue, block=False)
                except dist.QueueEmptyError:
                    break
                except RuntimeError as e:  # the store's host (TP rank 0) is gone
                    logger.error("rendezvous store of %s failed, accepting no more "
                                 "channels: %s", self.endpoint.key, e)
                    return
                try:
                    self._handle(raw, accept, on_channel)
                except Exception:  # noqa: BLE001 - one bad request must not end accepting
                    logger.exception("connect request on %s failed", self.endpoint.key)

    def _handle(self, raw: bytes, accept: AcceptFn, on_channel: ChannelFn) -> None:
        try:  # authenticated and well-formed before anything else happens
            request = open_request(raw, self._secret, self._replays, self.endpoint)
        except HandshakeRefused as e:
            self._answer(e.nonce, (e.code, str(e)), "a peer")
            return
        refusal = check_request(accept, request)
        if refusal is None and not self._slots.acquire(blocking=False):
            refusal = (ErrorCode.PEER_LOST, f"{self.max_pending_handshakes} channel "
                       "handshakes are already pending here: try again")
        if refusal is not None:
            self._answer(request.nonce, refusal, request.source.key)
            return
        try:
            store = self._accept_store.clone()  # the group's own client: blocks in its thread
            self._answer(request.nonce, None, request.source.key)
            thread = threading.Thread(target=self._join, args=(request, store, on_channel),
                                      name=f"kv-join-{request.source.key}", daemon=True)
            thread.start()
        except BaseException:
            self._slots.release()
            raise
        self._joins = [t for t in self._joins if t.is_alive()] + [thread]

    def _answer(self, nonce: str | None, refusal: tuple[ErrorCode, str] | None,
                who: str) -> None:
        if refusal is not None:
            logger.warning("refused %s on %s: %s", who, self.endpoint.key, refusal[1])
        if nonce is not None:  # else there is no one to tell: unframed bytes
            self._accept_store.set(f"{self._prefix}/ack/{nonce}",
                                   encode_answer(self._secret, nonce, refusal))

    def _join(self, request: ConnectRequest, store: dist.Store, on_channel: ChannelFn) -> None:
        """One accepted peer's groups, bounded by the connect timeout; then its channel."""
        name = pair_name(self._secret, self._prefix, request.nonce)
        try:
            control, data = make_groups(store, name, RECEIVER, self.host, self.device,
                                        self.timeout)
        except RuntimeError as e:
            logger.warning("channel from %s never came up: %s", request.source.key, e)
            return
        finally:
            self._slots.release()
        channel = PairChannel(control, data, rank=RECEIVER, name=name,
                              peer_key=request.source.key, reasons=self.reasons,
                              device=self.device)
        if self._closing.is_set():
            channel.close("receiver shut down", ErrorCode.SHUTDOWN)
            return
        on_channel(request.source, channel)
