"""The router's view of each worker: an authenticated gRPC client, its last load, whether it is up.

Liveness and load are separate signals. A worker is down when its process is: the connection
is refused or broken (UNAVAILABLE, gRPC keepalive pings unanswered), it says it is going
away, the supervisor reports it dead (`mark_down`), or, for a decode worker, its `Outputs`
stream breaks or stays silent for `silence_s` (a healthy worker sends at least a keepalive
every second). A late or failed `GetLoad` poll is no death: the worker stays in rotation with
its last load, marked stale. A decode worker's `Outputs` stream is read by one task (in
router/decode_client.py) and sorted into per-request mailboxes; when the worker goes down,
every request on it ends with WorkerLost (UNAVAILABLE to the client) at once, never a hang.

With worker-plane mutual TLS (`tls`), each channel is TLS, presents the cluster's certificate
and verifies the worker's against the cluster CA under the name WORKER_TLS_NAME (workers are
dialed by IP; one certificate with that DNS name serves them all).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc

from pdserve.address import split_host_port
from pdserve.cluster_secret import ClusterSecret
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.router.validation import InvalidArgument
from pdserve.tls import TLSFiles
from pdserve.worker_grpc import MESSAGE_OPTIONS, TLS_CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.2
LOAD_TIMEOUT_S = 2.0
RPC_TIMEOUT_S = 10.0  # Reserve / Start / Submit: generous, a saturated CPU answers late
OUTPUTS_SILENCE_S = 10.0
RECONNECT_S = 0.5
# 64 MiB both ways (a prompt near the public 4 MiB limit grows on its way to a worker); HTTP/2
# pings every 10 s find a half-open connection or a stopped process within 15 s.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = MESSAGE_OPTIONS + (
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
# A decode worker's Outputs stream has a connection of its own with a small fixed receive
# window (no BDP growth): when the router falls behind the worker's steps they wait on the
# worker, which merges them into one message (decode_worker.coalesce), instead of piling up
# here, megabytes deep, to be read a step at a time; and the unary RPCs (Submit, Reserve)
# never queue behind that backlog in a shared connection window.
OUTPUTS_WINDOW_BYTES = 32 * 1024
OUTPUTS_CHANNEL_OPTIONS = CHANNEL_OPTIONS + (
    ("grpc.http2.lookahead_bytes", OUTPUTS_WINDOW_BYTES),
    ("grpc.http2.bdp_probe", 0),
)
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
# an Abort that cannot reach the worker frees nothing there: the worker is gone, or (a closed
# channel) replaced by a restarted process that never held the request
ABORT_MISSES = (grpc.aio.AioRpcError, grpc.aio.UsageError)


class WorkerLost(Exception):
    """The worker holding a request died or became unreachable."""


class ReservationLost(WorkerLost):
    """The decode worker no longer knows the reservation (it expired): place the request again."""


class WorkerBusy(WorkerLost):
    """The worker did not answer a control RPC in time; it stays in rotation."""


class RequestTooLarge(InvalidArgument):
    """A worker message built from the request is over the worker plane's size limit."""


@dataclass(frozen=True)
class Lost:
    """Put into a request's queue when its decode worker goes down."""

    reason: str


class WorkerClient:
    def __init__(self, worker_id: str, role: str, address: str, secret: ClusterSecret,
                 rpc_timeout_s: float = RPC_TIMEOUT_S, tls: TLSFiles | None = None) -> None:
        if not isinstance(secret, ClusterSecret):
            raise ValueError(f"a worker client needs the cluster's ClusterSecret, got "
                             f"{type(secret).__name__}")
        self.worker_id, self.role, self.address = worker_id, role, address
        self.channel = worker_channel(address, tls)
        self.metadata = secret.grpc_metadata()  # on every RPC: workers refuse calls without
        self.rpc_timeout_s = rpc_timeout_s
        self.load: worker_pb2.WorkerLoad | None = None
        self.load_stale = False  # the last poll failed: `load` is older than it should be
        self.up = False
        # the supervisor reported its process dead: it is being replaced (the replacement comes
        # as a new client, Router.add_worker), so this one never returns to rotation
        self.dead = False
        self.draining = False  # being scaled down: no new requests, in-flight ones finish
        self.num_inflight = 0
        self.num_inflight_tokens = 0
        self._tasks: list[asyncio.Task] = []
        self._refused = False  # UNAUTHENTICATED logged (once per episode, not every poll)

    @property
    def in_rotation(self) -> bool:
        return self.up and not self.draining

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._poll_load(), name=f"load-{self.worker_id}"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.channel.close()

    def mark_down(self, reason: str) -> None:
        if self.up:
            logger.warning("%s worker %s (%s) is down: %s", self.role, self.worker_id,
                           self.address, reason)
        self.up = False

    def mark_dead(self, reason: str) -> None:
        """Down for good: after a network cut the old process answers again until the
        supervisor's kill reaches it, and requests placed on it then would be lost."""
        self.dead = True
        self.mark_down(reason)

    def error(self, exc: grpc.aio.AioRpcError) -> Exception:
        """What a failed RPC means for the request (and whether the worker is down)."""
        code, detail = exc.code(), exc.details()
        where = f"{self.role} worker {self.worker_id}"
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgument(detail)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the request's fault, not the worker's
            return RequestTooLarge(f"the request is too large for the worker plane: {detail}")
        if code == grpc.StatusCode.NOT_FOUND:
            return ReservationLost(f"{where}: {detail}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return WorkerBusy(f"{where} did not answer within {self.rpc_timeout_s:g} s")
        if code in _GONE:
            self._refusal(exc)
            self.mark_down(f"{code.name}: {detail}")
        return WorkerLost(f"{where}: {code.name}: {detail}")

    def _refusal(self, exc: grpc.aio.AioRpcError) -> None:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED and not self._refused:
            self._refused = True
            logger.error("%s worker %s (%s) refused the router's cluster secret: the router and "
                         "the workers must share one PDSERVE_CLUSTER_SECRET (%s)", self.role,
                         self.worker_id, self.address, exc.details())

    async def _call(self, method, request):
        """A control RPC, authenticated; a failure becomes `error(exc)`."""
        try:
            return await method(request, timeout=self.rpc_timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise self.error(exc) from None
        except grpc.aio.UsageError:  # closed: the worker was replaced or removed meanwhile
            raise WorkerLost(f"{self.role} worker {self.worker_id} was replaced or removed "
                             "while the request was on it") from None

    async def _poll_load(self) -> None:
        while True:
            try:
                load = await self._get_load()
            except grpc.aio.AioRpcError as exc:
                self._poll_failed(exc)
            else:
                self.load, self.load_stale, self._refused = load, False, False
                up = self._on_load() and not self.dead
                if up and not self.up:
                    logger.info("%s worker %s is up at %s", self.role, self.worker_id,
                                self.address)
                self.up = up
            await asyncio.sleep(LOAD_INTERVAL_S)

    def _poll_failed(self, exc: grpc.aio.AioRpcError) -> None:
        """Unreachable (refused, broken, pings unanswered) is down; late is only stale."""
        state = self.channel.get_state(try_to_connect=False)
        if exc.code() in _GONE or state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            self._refusal(exc)
            self.mark_down(f"GetLoad: {exc.code().name} ({state.name})")
            return
        if not self.load_stale:
            logger.info("%s worker %s: load report late (%s); keeping its last load",
                        self.role, self.worker_id, exc.code().name)
        self.load_stale = True

    async def _get_load(self) -> worker_pb2.WorkerLoad:
        return await self._stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=LOAD_TIMEOUT_S,
                                        metadata=self.metadata)

    def _on_load(self) -> bool:
        """A load report came in: whether the worker is in rotation now."""
        return True


def worker_channel(address: str, tls: TLSFiles | None,
                   options: tuple[tuple[str, int], ...] = CHANNEL_OPTIONS) -> grpc.aio.Channel:
    """The channel to one worker: plaintext, or mutual TLS checking the name WORKER_TLS_NAME."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    if tls.ca is None:
        raise ValueError("worker-plane TLS is mutual: it needs the CA that signs the workers' "
                         "certificate")
    return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                   options=[*options, *TLS_CHANNEL_OPTIONS])


class PrefillClient(WorkerClient):
    def __init__(self, worker_id: str, address: str, secret: ClusterSecret,
                 rpc_timeout_s: float = RPC_TIMEOUT_S, tls: TLSFiles | None = None) -> None:
        super().__init__(worker_id, "prefill", address, secret, rpc_timeout_s, tls)
        self._stub = worker_pb2_grpc.PrefillWorkerStub(self.channel)
        self._calls: set[grpc.aio.UnaryUnaryCall] = set()  # Prefill RPCs in flight here
        host, port = split_host_port(address)
        self.source = worker_pb2.Endpoint(host=host, port=port, rank=0)  # its KV identity

    async def prefill(self, request: worker_pb2.PrefillRequest, num_tokens: int,
                      timeout: float) -> worker_pb2.PrefillResponse:
        """Raises grpc.aio.AioRpcError (the placer decides which side a failure is on), or
        WorkerLost when the worker is marked down while the prompt is on it."""
        call = self._stub.Prefill(request, timeout=timeout, metadata=self.metadata)
        self._calls.add(call)
        self.num_inflight += 1
        self.num_inflight_tokens += num_tokens
        try:
            return await call
        except asyncio.CancelledError:
            if call.cancelled() and not asyncio.current_task().cancelling():  # by mark_down
                raise WorkerLost(f"prefill worker {self.worker_id} went down") from None
            raise
        finally:
            self._calls.discard(call)
            self.num_inflight -= 1
            self.num_inflight_tokens -= num_tokens

    def mark_down(self, reason: str) -> None:
        """Out of rotation, and its prompts go elsewhere now, not at their KV deadline (a
        stopped process holds a connection open until it is killed)."""
        super().mark_down(reason)
        for call in list(self._calls):
            call.cancel()

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(*ABORT_MISSES):
            await self._stub.Abort(worker_pb2.WorkerAbortRequest(request_id=request_id),
                                   timeout=LOAD_TIMEOUT_S, metadata=self.metadata)
