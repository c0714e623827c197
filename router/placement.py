"""Placer: where a request runs, and getting it started there.

Pick a decode worker (session affinity, KV headroom) -> either let it prefill a mostly-cached
prompt itself, or reserve its blocks, prefill on the chosen prefill worker (queue length,
Redis prefix hits), which pushes the KV there, and start decode with the first token. The
choices are `policy`'s pure functions; the placer applies them. A decode worker that refuses
is skipped (with backoff while every one is full, until the KV transfer deadline); a prefill
worker lost mid-prompt is retried on another, under a fresh worker-side request id.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping

import grpc

from pdserve.engine.block_hash import hash_blocks
from pdserve.engine.wire import sampling_to_proto
from pdserve.proto import worker_pb2
from pdserve.router.config import RouterConfig
from pdserve.router.flight import Flight, Placement
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
from pdserve.router.validation import ValidRequest
from pdserve.router.workers import DecodeClient, PrefillClient, WorkerLost

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


class Placer:
    """Reads the router's worker tables (it never changes them) and the Redis store."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, store: RedisStore | None,
                 prefill: Mapping[str, PrefillClient],
                 decode: Mapping[str, DecodeClient]) -> None:
        self.config, self.metrics, self.store = config, metrics, store
        self.prefill, self.decode = prefill, decode

    async def place(self, req: ValidRequest, flight: Flight) -> Placement:
        """Start the request on some worker(s); its placement. Aborted, NoCapacity or
        WorkerLost when it can't be."""
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
                self._check_room(deadline)
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
                await self._prefill_lost(req, decode, flight.worker_request_id, exc,
                                         lost_prefill)
            decode.close_request(flight.worker_request_id)
            flight.decode = None
        raise AssertionError("unreachable")

    def _check_room(self, deadline: float) -> None:
        """No decode worker took the request: why it can't wait for one, if it can't."""
        if not any(c.in_rotation for c in self.decode.values()):
            raise WorkerLost("no decode worker is up")
        if time.monotonic() > deadline:
            raise NoCapacity("every decode worker's KV cache is full; retry later")

    async def _prefill_lost(self, req: ValidRequest, decode: DecodeClient, rid: str,
                            exc: PrefillLost, lost_prefill: set[str]) -> None:
        """Free the decode side of the failed attempt; WorkerLost after too many."""
        lost_prefill.add(exc.worker_id)
        await decode.abort(rid)  # it named the lost worker
        if len(lost_prefill) >= MAX_PREFILL_ATTEMPTS:
            raise WorkerLost(str(exc)) from None
        logger.warning("%s: %s; retrying on another prefill worker", req.request_id, exc)

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
        request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                            sampling=sampling, descriptor=reply.descriptor)
        placement.prefill = await self._prefill(flight, prefill, request, len(prompt) - hits,
                                                deadline)
        await self._start_decode(decode, rid, placement.prefill)
        return True

    async def _prefill(self, flight: Flight, prefill: PrefillClient,
                       request: worker_pb2.PrefillRequest, num_new_tokens: int,
                       deadline: float) -> worker_pb2.PrefillResponse:
        """Run the prompt on `prefill`, which pushes its KV to the reserved blocks."""
        flight.prefill = prefill
        try:
            return await prefill.prefill(request, num_new_tokens,
                                         timeout=max(deadline - time.monotonic(), 0.001))
        except grpc.aio.AioRpcError as exc:
            if flight.aborted:
                raise Aborted from None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                prefill.mark_down(exc.details())
            raise PrefillLost(prefill.worker_id, exc.details()) from None
        finally:
            flight.prefill = None

    async def _start_decode(self, decode: DecodeClient, rid: str,
                            first: worker_pb2.PrefillResponse) -> None:
        start = worker_pb2.StartRequest(request_id=rid, first_token_id=first.first_token_id)
        if first.HasField("logprob"):
            start.logprob.CopyFrom(first.logprob)
        await decode.start_request(start)
        self.metrics.observe_transfer(first.transfer_bytes, first.transfer_s)

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


def _backoff():
    delay = RETRY_S[0]
    while True:
        yield delay
        delay = min(delay * 2, RETRY_S[1])
