"""Router: admits a validated request, routes it, drives both workers, streams the answer.

Per request: pick a decode worker (session affinity, KV headroom) -> either let it prefill a
mostly-cached prompt itself, or reserve its blocks, prefill on the chosen prefill worker
(queue length, Redis prefix hits) which pushes the KV there, and start decode with the first
token. Tokens stream back from the decode worker's step outputs; the router detokenizes and
cuts at stop strings. Whatever ends a request (finish, stop string, client cancel, deadline,
Abort, a worker failure) frees its blocks on every worker that held any.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from pdserve.engine.block_hash import hash_blocks
from pdserve.engine.wire import sampling_to_proto
from pdserve.proto import pdserve_pb2, worker_pb2
from pdserve.router.admission import Admission
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import (
    DecodeLoad,
    PrefillLoad,
    RoutingInfo,
    choose_decode,
    choose_prefill,
    prefill_locally,
    shared_prefix_len,
)
from pdserve.router.store import RedisStore, Session
from pdserve.router.stream import ResponseStream
from pdserve.router.validation import InvalidArgument, ModelContext, ValidRequest
from pdserve.router.workers import DecodeClient, PrefillClient, WorkerClient, WorkerLost

logger = logging.getLogger(__name__)

RETRY_S = (0.005, 0.1)  # backoff while every decode worker is full
MAX_PREFILL_ATTEMPTS = 3  # a prefill worker that dies mid-prompt: retry on another


class Aborted(Exception):
    """Abort was called before the request reached a decode worker."""


class PrefillLost(Exception):
    """The prefill worker failed before the first token: the request can go elsewhere."""

    def __init__(self, worker_id: str, detail: str) -> None:
        super().__init__(f"prefill worker {worker_id} failed: {detail}")
        self.worker_id = worker_id


class NoCapacity(Exception):
    """No decode worker could hold the request's KV before its deadline."""


@dataclass(frozen=True)
class RouterConfig:
    block_size: int = 16
    max_inflight_requests: int = 256
    max_queued_requests: int = 1024
    kv_transfer_timeout_s: float = 30.0
    max_local_prefill_tokens: int = 256
    colocated: bool = False  # no prefill pool: every decode worker prefills its own prompts


@dataclass
class Flight:
    """What the router knows of one in-flight request: who holds its state, under which id
    (a retry after a lost prefill worker uses a fresh one, so no late message of the first
    attempt can reach the second)."""

    request_id: str
    worker_request_id: str = ""
    decode: DecodeClient | None = None
    prefill: PrefillClient | None = None
    aborted: bool = False
    done: bool = False


@dataclass
class Placement:
    decode: DecodeClient
    queue: asyncio.Queue
    prefill: worker_pb2.PrefillResponse | None = None  # None: prefilled on the decode worker
    session_hit: int = 0


class Router:
    def __init__(self, model: ModelContext, config: RouterConfig, metrics: RouterMetrics,
                 store: RedisStore | None = None) -> None:
        self.model, self.config, self.metrics, self.store = model, config, metrics, store
        self.admission = Admission(config.max_inflight_requests, config.max_queued_requests)
        self.prefill: dict[str, PrefillClient] = {}
        self.decode: dict[str, DecodeClient] = {}
        self.flights: dict[str, Flight] = {}
        self.num_received = 0  # requests accepted for placement, ever (the planner's rate)
        self._background: set[asyncio.Task] = set()

    # ---- workers ----

    async def add_worker(self, worker_id: str, role: str, address: str) -> None:
        """Register a worker, or re-register one that restarted (new address)."""
        pool: dict = self.prefill if role == "prefill" else self.decode
        old = pool.pop(worker_id, None)
        client = PrefillClient(worker_id, address) if role == "prefill" else DecodeClient(
            worker_id, address)
        pool[worker_id] = client
        client.start()
        if old is not None:
            old.mark_down("replaced")
            await old.close()

    async def drain(self, worker_id: str, timeout_s: float = 600.0) -> None:
        """Take a worker out of rotation, wait for its in-flight requests, forget it."""
        pool: dict = self.prefill if worker_id in self.prefill else self.decode
        client = pool[worker_id]
        client.draining = True
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and any(
                client in (f.decode, f.prefill) for f in self.flights.values()):
            await asyncio.sleep(0.1)
        del pool[worker_id]
        await client.close()

    def mark_down(self, worker_id: str) -> None:
        for client in self.workers():
            if client.worker_id == worker_id:
                client.mark_down("reported dead by the supervisor")

    async def wait_ready(self, timeout: float) -> None:
        """Until every registered worker is in rotation; TimeoutError naming those that aren't."""
        end = time.monotonic() + timeout
        while not all(c.up for c in self.workers()):
            if time.monotonic() > end:
                down = [c.worker_id for c in self.workers() if not c.up]
                raise TimeoutError(f"workers {down} not reachable after {timeout} s")
            await asyncio.sleep(0.05)

    def workers(self) -> list[WorkerClient]:
        return [*self.prefill.values(), *self.decode.values()]

    async def close(self) -> None:
        for client in self.workers():
            await client.close()
        for task in list(self._background):
            task.cancel()

    # ---- requests ----

    async def generate(self, req: ValidRequest,
                       received: float) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        if req.request_id in self.flights:
            raise InvalidArgument(f"request_id {req.request_id!r} is already in flight")
        flight = Flight(req.request_id, req.request_id)
        self.flights[req.request_id] = flight
        self.num_received += 1
        try:
            async with self.admission.slot():
                queued_s = time.monotonic() - received
                try:
                    placement = await self._place(req, flight)
                except Aborted:
                    yield pdserve_pb2.GenerateResponse(
                        request_id=req.request_id, finish_reason="abort",
                        usage=pdserve_pb2.Usage(prompt_tokens=len(req.prompt_token_ids)))
                    return
                stream = ResponseStream(req, self.model.tokenizer, placement, received, queued_s,
                                        self.metrics)
                async for message in stream.run(flight):
                    yield message
                self._after(req, placement, stream)
        finally:
            del self.flights[req.request_id]
            if not flight.done:
                self._spawn(self._release(flight))

    async def abort(self, request_id: str) -> bool:
        flight = self.flights.get(request_id)
        if flight is None:
            return False
        flight.aborted = True
        if flight.prefill is not None:
            await flight.prefill.abort(flight.worker_request_id)
        if flight.decode is not None:
            await flight.decode.abort(flight.worker_request_id)  # the stream ends with "abort"
        return True

    async def _place(self, req: ValidRequest, flight: Flight) -> Placement:
        session = None
        if req.session_id and self.store is not None:
            session = await self.store.get_session(req.session_id)
        deadline = time.monotonic() + self.config.kv_transfer_timeout_s
        excluded: set[str] = set()
        lost_prefill: set[str] = set()
        for delay in _backoff():
            if flight.aborted:
                raise Aborted
            decode = self._choose_decode(req, session, excluded)
            if decode is None:
                if not any(c.in_rotation for c in self.decode.values()):
                    raise WorkerLost("no decode worker is up")
                if time.monotonic() > deadline:
                    raise NoCapacity("every decode worker's KV cache is full; retry later")
                excluded.clear()
                await asyncio.sleep(delay)
                continue
            if lost_prefill:  # a retry: no late message of the last attempt may match it
                flight.worker_request_id = f"{req.request_id}~{secrets.token_hex(6)}"
            placement = Placement(decode, decode.open(flight.worker_request_id))
            flight.decode = decode
            try:
                if await self._dispatch(req, flight, placement, session, deadline, lost_prefill):
                    return placement
                excluded.add(decode.worker_id)
            except PrefillLost as exc:
                lost_prefill.add(exc.worker_id)
                await decode.abort(flight.worker_request_id)  # it named the lost worker
                if len(lost_prefill) >= MAX_PREFILL_ATTEMPTS:
                    raise WorkerLost(str(exc)) from None
                logger.warning("%s: %s; retrying on another prefill worker", req.request_id, exc)
            decode.close_request(flight.worker_request_id)
            flight.decode = None
        raise AssertionError("unreachable")

    async def _dispatch(self, req: ValidRequest, flight: Flight, placement: Placement,
                        session: Session | None, deadline: float,
                        lost_prefill: set[str]) -> bool:
        """Start the request on `placement.decode`; False if that worker refused it."""
        decode, rid = placement.decode, flight.worker_request_id
        sampling = sampling_to_proto(req.params)
        prompt = list(req.prompt_token_ids)
        if session is not None and session.decode_worker == decode.worker_id:
            placement.session_hit = shared_prefix_len(session.token_ids, prompt)
        if self.config.colocated or placement.session_hit and prefill_locally(
                len(prompt), placement.session_hit, self.config.max_local_prefill_tokens):
            return await decode.submit(worker_pb2.SubmitRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling))
        prefill, hits = await self.choose_prefill(prompt, lost_prefill)
        wall_deadline = time.time() + max(deadline - time.monotonic(), 0.0)
        reply = await decode.reserve(worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling,
            sources=[prefill.source], deadline=wall_deadline))
        if not reply.granted:
            return False
        flight.prefill = prefill
        try:
            placement.prefill = await prefill.prefill(
                worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                          sampling=sampling, descriptor=reply.descriptor),
                len(prompt) - hits, timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.aio.AioRpcError as exc:
            if flight.aborted:
                raise Aborted from None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                prefill.mark_down(exc.details())
            raise PrefillLost(prefill.worker_id, exc.details()) from None
        finally:
            flight.prefill = None
        first = placement.prefill
        start = worker_pb2.StartRequest(request_id=rid, first_token_id=first.first_token_id)
        if first.HasField("logprob"):
            start.logprob.CopyFrom(first.logprob)
        await decode.start_request(start)
        self.metrics.observe_transfer(first.transfer_bytes, first.transfer_s)
        return True

    def _choose_decode(self, req: ValidRequest, session: Session | None,
                       excluded: set[str]) -> DecodeClient | None:
        loads = [
            DecodeLoad(c.worker_id, c.load.num_blocks,
                       c.load.num_free_blocks - c.num_pending[0],
                       c.load.num_running + c.load.num_waiting + c.num_pending[1],
                       c.load.max_num_seqs)
            for c in self.decode.values() if c.in_rotation and c.load is not None
        ]
        info = RoutingInfo(
            len(req.prompt_token_ids),
            -(-(len(req.prompt_token_ids) + 1) // self.config.block_size),
            session.decode_worker if session else None,
        )
        chosen = choose_decode(loads, info, excluded)
        if chosen is None:
            return None
        decode = self.decode[chosen]
        decode.note_sent(info.num_blocks_needed)
        return decode

    async def choose_prefill(self, prompt: list[int],
                             excluded: set[str] = frozenset()) -> tuple[PrefillClient, int]:
        """The prefill worker for this prompt and its prefix-cache hit there (tokens)."""
        up = [c for c in self.prefill.values() if c.in_rotation and c.worker_id not in excluded]
        if not up:
            raise WorkerLost("no prefill worker is up")
        hits: dict[str, int] = {}
        if self.store is not None and len(up) > 1:
            hashes = hash_blocks(prompt, self.config.block_size)
            blocks = await self.store.prefix_hits(hashes, [c.worker_id for c in up])
            hits = {w: n * self.config.block_size for w, n in blocks.items()}
        loads = [PrefillLoad(c.worker_id, c.num_inflight, c.num_inflight_tokens) for c in up]
        chosen = choose_prefill(loads, RoutingInfo(len(prompt), 0, prefix_hits=hits))
        return self.prefill[chosen], hits.get(chosen, 0)

    def _after(self, req: ValidRequest, placement: Placement, stream: ResponseStream) -> None:
        if req.session_id and self.store is not None:
            history = list(req.prompt_token_ids) + stream.token_ids
            self._spawn(self.store.put_session(req.session_id, history,
                                               placement.decode.worker_id))

    async def _release(self, flight: Flight) -> None:
        """A request that ended early: free what any worker still holds for it."""
        if flight.prefill is not None:
            await flight.prefill.abort(flight.worker_request_id)
        if flight.decode is not None:
            flight.decode.close_request(flight.worker_request_id)
            await flight.decode.abort(flight.worker_request_id)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _backoff():
    delay = RETRY_S[0]
    while True:
        yield delay
        delay = min(delay * 2, RETRY_S[1])

