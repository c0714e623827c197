"""DecodeClient: the router's client of one decode worker, and the reader of its output stream.

One task reads the worker's `Outputs` stream (this router's subscription: the worker sends it
only the requests this router placed, named by `router_id`) and sorts each step's deltas into
per-request mailboxes; a mailbox lives from `open` (before the request is reserved or
submitted) to `close_request` (whatever ended the request), so the table holds only requests
in flight. The stream has a connection of its own (workers.OUTPUTS_CHANNEL_OPTIONS).
The stream is the worker's heartbeat: a healthy worker sends at least an empty message every
second, so `silence_s` without any message means a wedged or stopped worker (or a half-open
connection). Then, as on a broken stream or any `mark_down`, every open request ends with
`Lost` at once, and the reader reconnects (within the worker's grace, or it frees this
router's requests as orphans). Whatever marked the worker down, its stream is torn down then:
the worker is back in rotation only once a stream opened after that has delivered and a load
poll answers. (A stream that stalled across a network cut may wake up again or not; a request
placed on the strength of it would fail at its silence timer.)
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.cluster_secret import ClusterSecret
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.router.mailbox import Mailbox
from pdserve.router.workers import (
    ABORT_MISSES,
    LOAD_TIMEOUT_S,
    OUTPUTS_CHANNEL_OPTIONS,
    OUTPUTS_SILENCE_S,
    RECONNECT_S,
    RPC_TIMEOUT_S,
    Lost,
    WorkerClient,
    worker_channel,
)
from pdserve.tls import TLSFiles


class DecodeClient(WorkerClient):
    def __init__(self, worker_id: str, address: str, secret: ClusterSecret,
                 rpc_timeout_s: float = RPC_TIMEOUT_S,
                 silence_s: float = OUTPUTS_SILENCE_S, tls: TLSFiles | None = None,
                 router_id: str = "") -> None:
        super().__init__(worker_id, "decode", address, secret, rpc_timeout_s, tls)
        if silence_s <= 0:
            raise ValueError(f"silence_s must be > 0 (seconds), got {silence_s}")
        self.silence_s, self.router_id = silence_s, router_id
        self._stub = worker_pb2_grpc.DecodeWorkerStub(self.channel)
        self._outputs_channel = worker_channel(address, tls, OUTPUTS_CHANNEL_OPTIONS)
        self._mailboxes: dict[str, Mailbox] = {}
        self._outputs: grpc.aio.UnaryStreamCall | None = None  # the current Outputs stream
        self._streaming = False  # ... has delivered a message
        # (blocks, requests, prompt tokens to prefill here) the router has sent here, ever
        self._sent = (0, 0, 0)
        self._sent_before_load = (0, 0, 0)  # ... before it asked for the load it holds
        self.feeding: set[asyncio.Task] = set()  # prefills pushing KV here (Placer)

    def start(self) -> None:
        super().start()
        self._tasks.append(asyncio.create_task(self._read_outputs(),
                                               name=f"outputs-{self.worker_id}"))

    async def close(self) -> None:
        await super().close()
        await self._outputs_channel.close()
        self._fail_all("the router is closing")

    @property
    def num_open(self) -> int:
        """Requests with a mailbox here (in flight on this worker)."""
        return len(self._mailboxes)

    def open(self, request_id: str) -> Mailbox:
        """The mailbox this request's deltas arrive in; open it before reserving or submitting."""
        mailbox = self._mailboxes[request_id] = Mailbox()
        return mailbox

    def close_request(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)

    def mark_down(self, reason: str) -> None:
        """Out of rotation, every request waiting on this worker ends (WorkerLost), and the
        prefills pushing KV here are cancelled: their requests go elsewhere now, not when
        the push gives up."""
        super().mark_down(reason)
        self._fail_all(reason)
        for task in list(self.feeding):
            task.cancel()
        self._streaming = False
        if self._outputs is not None:  # the reader opens a fresh stream (see the module doc)
            self._outputs.cancel()

    async def reserve(self, request: worker_pb2.ReserveRequest) -> worker_pb2.ReserveResponse:
        request.router_id = self.router_id  # its deltas come to this router's subscription
        return await self._call(self._stub.Reserve, request)

    async def start_request(self, request: worker_pb2.StartRequest) -> None:
        await self._call(self._stub.Start, request)

    async def submit(self, request: worker_pb2.SubmitRequest) -> worker_pb2.SubmitResponse:
        request.router_id = self.router_id
        return await self._call(self._stub.Submit, request)

    async def push_prefix(self, request: worker_pb2.PushPrefixRequest,
                          timeout: float) -> worker_pb2.PushPrefixResponse:
        """Have this worker push a prefix it caches to another one (a pull); `error(exc)`'s
        exceptions when it fails (ReservationLost: it no longer holds that prefix)."""
        try:
            return await self._stub.PushPrefix(request, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise self.error(exc) from None

    async def abort(self, request_id: str) -> bool:
        try:
            response = await self._stub.Abort(
                worker_pb2.WorkerAbortRequest(request_id=request_id), timeout=LOAD_TIMEOUT_S,
                metadata=self.metadata)
            return response.found
        except ABORT_MISSES:
            return False

    def note_sent(self, num_blocks: int, num_requests: int = 1,
                  num_prefill_tokens: int = 0) -> None:
        """A request is on its way here (and `num_prefill_tokens` of its prompt to prefill
        here): count it until a load report includes it."""
        sent = (num_blocks, num_requests, num_prefill_tokens)
        self._sent = tuple(a + b for a, b in zip(self._sent, sent))

    @property
    def num_pending(self) -> tuple[int, int, int]:
        """(blocks, requests, prompt tokens to prefill) sent since the load report was asked
        for: not in it yet."""
        return tuple(a - b for a, b in zip(self._sent, self._sent_before_load))

    async def _get_load(self) -> worker_pb2.WorkerLoad:
        sent = self._sent
        load = await super()._get_load()
        self._sent_before_load = sent
        return load

    def _on_load(self) -> bool:
        return self._streaming  # not in rotation until its outputs can be read

    async def _read_outputs(self) -> None:
        while True:
            self._outputs = call = worker_pb2_grpc.DecodeWorkerStub(
                self._outputs_channel).Outputs(
                worker_pb2.OutputsRequest(router_id=self.router_id), metadata=self.metadata)
            try:
                reason = await self._pump(call)
            except grpc.aio.AioRpcError as exc:
                self._refusal(exc)  # a refused secret is logged loudly
                reason = f"output stream broke: {exc.code().name}"
            except asyncio.CancelledError:
                if not call.cancelled() or asyncio.current_task().cancelling():
                    raise
                reason = "output stream torn down"  # by mark_down
            finally:
                call.cancel()
            self.mark_down(reason)
            await asyncio.sleep(RECONNECT_S)

    async def _pump(self, call) -> str:
        """Sort the stream's deltas until it ends or falls silent; why it stopped.

        Each read is a `wait_for` (on 3.11 a task of its own), not an `asyncio.timeout`: the
        extra hop lets the streams find several tokens in their mailboxes when the router is
        saturated (256 streams: 2.0 vs 1.2 tokens per message, ~40% more tokens/s; see
        benchmarks/router_throughput.py). 3.11's wait_for can drop a cancel that lands as a
        read completes, hence the `cancelling()` check."""
        task = asyncio.current_task()
        while True:
            try:
                step = await asyncio.wait_for(call.read(), self.silence_s)
            except TimeoutError:
                return f"output stream silent for {self.silence_s:g} s"
            if task.cancelling():
                raise asyncio.CancelledError
            if step is grpc.aio.EOF:
                return "output stream ended"
            if call.cancelled():  # torn down by mark_down as this step came in
                return "output stream torn down"
            self._streaming = True
            mailboxes = self._mailboxes
            for delta in step.deltas:
                mailbox = mailboxes.get(delta.request_id)
                if mailbox is not None:
                    mailbox.put(delta)

    def _fail_all(self, reason: str) -> None:
        for mailbox in self._mailboxes.values():
            mailbox.put(Lost(f"decode worker {self.worker_id} lost: {reason}"))
        self._mailboxes.clear()
