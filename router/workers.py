"""The router's view of each worker: a gRPC client, its last load, whether it is up.

Every worker is polled for its load (`GetLoad`) every LOAD_INTERVAL_S; a failed poll or a
broken output stream takes it out of rotation at once, a good poll puts it back. A decode
worker's `Outputs` stream is read by one task here and sorted into per-request queues; when
it breaks, every request on that worker ends with WorkerLost (UNAVAILABLE to the client),
never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc

from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.router.validation import InvalidArgument

logger = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.2
LOAD_TIMEOUT_S = 2.0
RECONNECT_S = 0.5


class WorkerLost(Exception):
    """The worker holding a request died or became unreachable."""


@dataclass(frozen=True)
class Lost:
    """Put into a request's queue when its decode worker's output stream breaks."""

    reason: str


class WorkerClient:
    def __init__(self, worker_id: str, role: str, address: str) -> None:
        self.worker_id, self.role, self.address = worker_id, role, address
        self.channel = grpc.aio.insecure_channel(address)
        self.load: worker_pb2.WorkerLoad | None = None
        self.up = False
        self.draining = False  # being scaled down: no new requests, in-flight ones finish
        self.num_inflight = 0
        self.num_inflight_tokens = 0
        self._tasks: list[asyncio.Task] = []

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

    async def _call(self, call):
        """A control RPC; a transport failure takes the worker out of rotation (WorkerLost)."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(exc.details()) from None
            self.mark_down(f"{exc.code().name}: {exc.details()}")
            raise WorkerLost(f"{self.role} worker {self.worker_id}: {exc.details()}") from None

    def mark_down(self, reason: str) -> None:
        if self.up:
            logger.warning("%s worker %s (%s) is down: %s", self.role, self.worker_id,
                           self.address, reason)
        self.up = False

    async def _poll_load(self) -> None:
        while True:
            try:
                self.load = await self._get_load()
                up = self._on_load()
                if up and not self.up:
                    logger.info("%s worker %s is up at %s", self.role, self.worker_id,
                                self.address)
                self.up = up
            except grpc.aio.AioRpcError as exc:
                self.mark_down(f"GetLoad: {exc.code().name}")
            await asyncio.sleep(LOAD_INTERVAL_S)

    async def _get_load(self) -> worker_pb2.WorkerLoad:
        return await self._stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=LOAD_TIMEOUT_S)

    def _on_load(self) -> bool:
        """A load report came in: whether the worker is in rotation now."""
        return True


class PrefillClient(WorkerClient):
    def __init__(self, worker_id: str, address: str) -> None:
        super().__init__(worker_id, "prefill", address)
        self._stub = worker_pb2_grpc.PrefillWorkerStub(self.channel)
        host, port = address.rsplit(":", 1)
        self.source = worker_pb2.Endpoint(host=host, port=int(port), rank=0)  # its KV identity

    async def prefill(self, request: worker_pb2.PrefillRequest, num_tokens: int,
                      timeout: float) -> worker_pb2.PrefillResponse:
        self.num_inflight += 1
        self.num_inflight_tokens += num_tokens
        try:
            return await self._stub.Prefill(request, timeout=timeout)
        finally:
            self.num_inflight -= 1
            self.num_inflight_tokens -= num_tokens

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.Abort(worker_pb2.WorkerAbortRequest(request_id=request_id),
                                   timeout=LOAD_TIMEOUT_S)


class DecodeClient(WorkerClient):
    def __init__(self, worker_id: str, address: str) -> None:
        super().__init__(worker_id, "decode", address)
        self._stub = worker_pb2_grpc.DecodeWorkerStub(self.channel)
        self._queues: dict[str, asyncio.Queue] = {}
        self._streaming = False
        self._sent = (0, 0)  # (blocks, requests) the router has sent here, ever
        self._sent_before_load = (0, 0)  # ... before it asked for the load it holds

    def start(self) -> None:
        super().start()
        self._tasks.append(asyncio.create_task(self._read_outputs(),
                                               name=f"outputs-{self.worker_id}"))

    def open(self, request_id: str) -> asyncio.Queue:
        """The queue this request's deltas arrive on; open it before reserving or submitting."""
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close_request(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def reserve(self, request: worker_pb2.ReserveRequest) -> worker_pb2.ReserveResponse:
        return await self._call(self._stub.Reserve(request, timeout=LOAD_TIMEOUT_S))

    async def start_request(self, request: worker_pb2.StartRequest) -> None:
        await self._call(self._stub.Start(request, timeout=LOAD_TIMEOUT_S))

    async def submit(self, request: worker_pb2.SubmitRequest) -> bool:
        return (await self._call(self._stub.Submit(request, timeout=LOAD_TIMEOUT_S))).granted

    async def abort(self, request_id: str) -> bool:
        try:
            response = await self._stub.Abort(
                worker_pb2.WorkerAbortRequest(request_id=request_id), timeout=LOAD_TIMEOUT_S)
            return response.found
        except grpc.aio.AioRpcError:
            return False

    def note_sent(self, num_blocks: int) -> None:
        """A request is on its way here: count it until a load report includes it."""
        self._sent = (self._sent[0] + num_blocks, self._sent[1] + 1)

    @property
    def num_pending(self) -> tuple[int, int]:
        """(blocks, requests) sent since the load report was asked for: not in it yet."""
        return (self._sent[0] - self._sent_before_load[0],
                self._sent[1] - self._sent_before_load[1])

    async def _get_load(self) -> worker_pb2.WorkerLoad:
        sent = self._sent
        load = await super()._get_load()
        self._sent_before_load = sent
        return load

    def _on_load(self) -> bool:
        return self._streaming  # not in rotation until its outputs can be read

    async def _read_outputs(self) -> None:
        while True:
            try:
                call = self._stub.Outputs(worker_pb2.OutputsRequest())
                await call.wait_for_connection()
                self._streaming = True
                async for step in call:
                    for delta in step.deltas:
                        q = self._queues.get(delta.request_id)
                        if q is not None:
                            q.put_nowait(delta)
                reason = "output stream ended"
            except grpc.aio.AioRpcError as exc:
                reason = f"output stream broke: {exc.code().name}"
            self._streaming = False
            self.mark_down(reason)
            self._fail_all(reason)
            await asyncio.sleep(RECONNECT_S)

    def _fail_all(self, reason: str) -> None:
        for q in self._queues.values():
            q.put_nowait(Lost(f"decode worker {self.worker_id} lost: {reason}"))
        self._queues.clear()
