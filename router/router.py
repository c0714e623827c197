"""Router: admits a validated request, has it placed, streams the answer, frees what it held.

Per request: wait for an admission slot, let the `Placer` start it on a decode worker (and a
prefill worker, unless the decode worker prefills it itself), then stream the decode
worker's deltas as GenerateResponse messages (`ResponseStream`: detokenized, cut at stop
strings). A decode worker that dies mid-stream (its output stream lost, or the request ended
with an error) has the request migrated: placed again, up to `migration_limit` times, with
what was streamed as its prompt's tail (seeded sampling continues after it), and the same
stream goes on from there: no token lost or repeated. Whatever ends a request (finish, stop
string, client cancel, deadline, Abort, a worker failure) frees its blocks on every worker
that held any. The router also keeps the table of workers: registered, replaced after a
restart, drained, marked down; it talks to them with the cluster secret on every RPC, over
mutual TLS when `worker_tls` is given (see pdserve.worker_grpc: one certificate named
WORKER_TLS_NAME for the whole worker plane).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from pdserve.cluster_secret import ClusterSecret
from pdserve.engine.lora_request import LoRARequest
from pdserve.proto import pdserve_pb2
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.decode_client import DecodeClient
from pdserve.router.flight import Flight, Placement
from pdserve.router.lora_adapters import LoRAAdapters
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import Aborted, NoCapacity, Placer
from pdserve.router.store import RedisStore
from pdserve.router.stream import ResponseStream, WorkerFailed
from pdserve.router.validation import InvalidArgument, ModelContext, ValidRequest
from pdserve.router.workers import PrefillClient, WorkerClient, WorkerLost
from pdserve.tls import TLSFiles

logger = logging.getLogger(__name__)

# a request_id reused right after a cancel: the old request is on its way out, wait for it
REUSE_GRACE_S = 1.0


class RouterFollower(Protocol):
    """Another router process over the same workers, told each change of the worker table."""

    num_received: int

    async def add_worker(self, worker_id: str, role: str, address: str) -> None: ...

    def mark_down(self, worker_id: str) -> None: ...

    async def drain(self, worker_id: str, timeout_s: float) -> None: ...


class Router:
    def __init__(self, model: ModelContext, config: RouterConfig, metrics: RouterMetrics,
                 store: RedisStore | None = None, *, secret: ClusterSecret,
                 worker_tls: TLSFiles | None = None) -> None:
        if not isinstance(secret, ClusterSecret):
            raise ValueError("Router needs the cluster's ClusterSecret (secret=...): workers "
                             "refuse every RPC without it")
        self.model, self.config, self.metrics, self.store = model, config, metrics, store
        self.secret, self.worker_tls = secret, worker_tls
        # names this router to the decode workers: each streams it only the requests it placed
        self.router_id = f"router-{secrets.token_hex(6)}"
        self.admission = Admission(config.max_inflight_requests, config.max_queued_requests)
        self.prefill: dict[str, PrefillClient] = {}
        self.decode: dict[str, DecodeClient] = {}
        self.placer = Placer(config, metrics, store, self.prefill, self.decode)
        self.flights: dict[str, Flight] = {}
        self.num_received = 0  # requests accepted for placement, ever (the planner's rate)
        # other router processes serving the same workers: this router owns the worker table
        # and tells them every change (pdserve.launch.router_processes)
        self.followers: list[RouterFollower] = []
        # where to look for a request this process does not have (another router process
        # may hold it: the kernel spreads connections, so an Abort may land elsewhere)
        self.relay_abort: Callable[[str], Awaitable[bool]] | None = None
        self._background: set[asyncio.Task] = set()
        self._loras_published = False  # this process's startup adapters are in Redis

    # ---- workers ----

    async def add_worker(self, worker_id: str, role: str, address: str) -> None:
        """Register a worker, or re-register one that restarted (new address)."""
        pool: dict = self.prefill if role == "prefill" else self.decode
        old = pool.pop(worker_id, None)
        timeout = self.config.worker_rpc_timeout_s
        client = PrefillClient(worker_id, address, self.secret, timeout, self.worker_tls) \
            if role == "prefill" else DecodeClient(worker_id, address, self.secret, timeout,
                                                   self.config.outputs_silence_s, self.worker_tls,
                                                   self.router_id)
        pool[worker_id] = client
        client.start()
        if old is not None:
            old.mark_down("replaced")
            await old.close()
        for follower in self.followers:
            await follower.add_worker(worker_id, role, address)

    async def drain(self, worker_id: str, timeout_s: float = 600.0) -> None:
        """Take a worker out of rotation, wait for its in-flight requests, forget it."""
        pool: dict = self.prefill if worker_id in self.prefill else self.decode
        client = pool[worker_id]
        client.draining = True
        end = time.monotonic() + timeout_s
        drained = asyncio.gather(*(f.drain(worker_id, timeout_s) for f in self.followers))
        while time.monotonic() < end and any(
                client in (f.decode, f.prefill) for f in self.flights.values()):
            await asyncio.sleep(0.1)
        await drained
        if pool.get(worker_id) is client:  # not a client registered anew meanwhile
            del pool[worker_id]
        await client.close()

    def mark_down(self, worker_id: str) -> None:
        """The supervisor's word: out of rotation until its replacement is added (`add_worker`),
        and every request on it ends UNAVAILABLE."""
        for client in self.workers():
            if client.worker_id == worker_id:
                client.mark_dead("reported dead by the supervisor")
        for follower in self.followers:
            follower.mark_down(worker_id)

    @property
    def total_received(self) -> int:
        """Requests accepted for placement, ever, by this router and its followers."""
        return self.num_received + sum(f.num_received for f in self.followers)

    async def wait_ready(self, timeout: float) -> None:
        """Until every registered worker is in rotation; TimeoutError naming those that aren't."""
        end = time.monotonic() + timeout
        while not all(c.up for c in self.workers()):
            if time.monotonic() > end:
                down = [c.worker_id for c in self.workers() if not c.up]
                raise TimeoutError(f"workers {down} not reachable after {timeout} s")
            await asyncio.sleep(0.05)

    async def wait_idle(self, timeout_s: float) -> int:
        """Until no request is in flight or in line here, at most `timeout_s`; how many are
        left."""
        end = time.monotonic() + timeout_s
        while self.flights and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return len(self.flights)

    def workers(self) -> list[WorkerClient]:
        return [*self.prefill.values(), *self.decode.values()]

    async def close(self) -> None:
        for client in self.workers():
            await client.close()
        for task in list(self._background):
            task.cancel()

    # ---- LoRA adapters ----

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        """Serve one more adapter, on every router process of the deployment (checked off the
        event loop first: ValueError naming the field at fault)."""
        loras = self._loras()
        lora = await asyncio.to_thread(loras.check, name, path)
        if self.store is not None:
            await self.store.put_lora_adapter(lora)
        loras.add(lora)
        return lora

    async def unload_lora(self, name: str) -> LoRARequest:
        """Stop serving an adapter everywhere (requests in flight with it finish)."""
        loras = self._loras()
        lora = loras.get(name)
        if lora is None:
            raise ValueError(f"lora_name: no adapter {name!r} is loaded")
        if self.store is not None:
            await self.store.delete_lora_adapter(name)
        loras.remove(name)
        return lora

    async def sync_loras(self) -> None:
        """Serve the deployment's adapters as Redis lists them, having first put this
        process's startup ones there (unless a name is there already)."""
        loras = self.model.loras
        if loras is None or self.store is None:
            return
        if not self._loras_published:
            puts = [await self.store.put_lora_adapter(lora, only_new=True) for lora in loras]
            self._loras_published = all(puts)
        table = await self.store.lora_adapters() if self._loras_published else None
        if table is not None:
            loras.sync(table)

    def _loras(self) -> LoRAAdapters:
        if self.model.loras is None:
            raise ValueError("LoRA is not enabled on this server (--enable-lora)")
        return self.model.loras

    # ---- requests ----

    async def generate(self, req: ValidRequest,
                       received: float) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        await self._wait_reusable(req.request_id)
        flight = Flight(req.request_id)
        self.flights[req.request_id] = flight  # no await since the check: no one else took it
        self.num_received += 1
        try:
            async with self.admission.slot():
                queued_s = time.monotonic() - received
                try:
                    placement = await self.placer.place(req, flight)
                except Aborted:
                    yield pdserve_pb2.GenerateResponse(
                        request_id=req.request_id, finish_reason="abort",
                        usage=pdserve_pb2.Usage(prompt_tokens=len(req.prompt_token_ids)))
                    return
                stream = ResponseStream(req, self.model.tokenizer, placement, received, queued_s,
                                        self.metrics)
                async for message in self._stream(req, flight, stream):
                    yield message
        finally:
            del self.flights[req.request_id]
            flight.ended.set()
            if flight.decode is not None:  # whatever ended it: its queue goes with it
                flight.decode.close_request(flight.worker_request_id)
            if not flight.done:
                self._spawn(self._release(flight))

    async def _stream(self, req: ValidRequest, flight: Flight,
                      stream: ResponseStream) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """The stream's messages, the request migrated whenever its decode worker fails it
        mid-stream and the limit allows; WorkerLost / WorkerFailed when it does not."""
        failed: set[str] = set()  # decode workers that failed this request
        while True:
            try:
                async for message in stream.run(flight):
                    if message.finish_reason:  # before the client can send its next turn
                        await self._remember(req, stream)
                    yield message
                return
            except (WorkerLost, WorkerFailed) as exc:
                if stream.num_migrations >= self.config.migration_limit or len(
                        stream.token_ids) >= req.params.max_tokens:
                    raise
                failure = exc
            try:
                placement = await self._migrate(req, flight, stream, failure, failed)
            except Aborted:
                yield stream.aborted()
                return
            stream.resume(placement)

    async def _migrate(self, req: ValidRequest, flight: Flight, stream: ResponseStream,
                       failure: Exception, failed: set[str]) -> Placement:
        """Free the failed attempt and place the request again, what was streamed as its
        prompt's tail. Aborted; WorkerLost (naming both failures) when nothing can take it."""
        old, old_id = flight.decode, flight.worker_request_id
        if old is not None:
            failed.add(old.worker_id)
            old.close_request(old_id)
            if not flight.done:  # marked down need not be dead: it frees what it still holds
                self._spawn(old.abort(old_id))
        flight.decode, flight.done = None, False  # from here the flight names the new attempt
        if flight.aborted:
            raise Aborted
        logger.warning("%s: decode worker %s failed it after %d tokens (%s); migrating it "
                       "(%d of at most %d)", req.request_id, old.worker_id if old else "?",
                       len(stream.token_ids), failure, stream.num_migrations + 1,
                       self.config.migration_limit)
        try:
            placement = await self.placer.place(req.continued(stream.token_ids), flight,
                                                frozenset(failed))
        except (WorkerLost, NoCapacity, InvalidArgument) as exc:
            self.metrics.count_migration("failed")
            raise WorkerLost(f"{failure}; no other decode worker took the request: "
                             f"{exc}") from None
        self.metrics.count_migration("ok")
        return placement

    async def _wait_reusable(self, request_id: str) -> None:
        """InvalidArgument if `request_id` is still in flight after REUSE_GRACE_S."""
        old = self.flights.get(request_id)
        if old is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(old.ended.wait(), REUSE_GRACE_S)
        if request_id in self.flights:
            raise InvalidArgument(f"request_id {request_id!r} is already in flight")

    async def abort(self, request_id: str, relay: bool = True) -> bool:
        """Abort an in-flight request: here, or (`relay`) in another router process."""
        flight = self.flights.get(request_id)
        if flight is None:
            if relay and self.relay_abort is not None:
                return await self.relay_abort(request_id)
            return False
        flight.aborted = True
        if flight.prefill is not None:
            await flight.prefill.abort(flight.worker_request_id)
        if flight.decode is not None:
            await flight.decode.abort(flight.worker_request_id)  # the stream ends with "abort"
        return True

    async def _remember(self, req: ValidRequest, stream: ResponseStream) -> None:
        """The session's history: the client's prompt and every token streamed, on the decode
        worker that holds them (after a migration, the last one). Stored before the final
        message goes out, so a next turn sent on receiving it finds the session."""
        if req.session_id and self.store is not None:
            history = list(req.prompt_token_ids) + stream.token_ids
            await self.store.put_session(req.session_id, history,
                                         stream.placement.decode.worker_id)

    async def _release(self, flight: Flight) -> None:
        """A request that ended early: free what any worker still holds for it."""
        if flight.prefill is not None:
            await flight.prefill.abort(flight.worker_request_id)
        if flight.decode is not None:
            await flight.decode.abort(flight.worker_request_id)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
