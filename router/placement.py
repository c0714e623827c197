"""Placer: where a request runs, and getting it started there.

Pick a decode worker (session affinity, KV headroom) -> either let it prefill a mostly-cached
prompt itself, or reserve its blocks, prefill on the chosen prefill worker (queue length,
Redis prefix hits), which pushes the KV there, and start decode with the first token. A
session turn that lands on another decode worker than its last one's may have that worker pull
the prefix the last one still caches (router.prefix_pulls: when the pull, at its measured
cost, beats recomputing it), then prefill the rest itself. The
choices are `policy`'s pure functions; the placer applies them. A decode worker that refuses
(or answers too late) is skipped, with backoff while every one is full, until the KV transfer
deadline. An attempt that fails for a reason another attempt may not meet (a prefill worker
lost mid-prompt, a KV transfer the decode side failed, a reservation that expired) is undone
on the decode side and placed again, under a fresh worker-side id, at most MAX_ATTEMPTS times.
An Abort is honoured at every step: the flight is re-checked after every await.

Why one file: every step (choose, prefill here or there, pull, retry, undo) acts on one
flight and its attempt's decode worker; split, each failure path's undo would cross files.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping

import grpc

from pdserve.engine.block_hash import chain_root, hash_blocks
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.step_budget import StepFit
from pdserve.proto import pdserve_pb2, worker_pb2
from pdserve.router.config import RouterConfig
from pdserve.router.decode_client import DecodeClient
from pdserve.router.disaggregation import LOCAL, Option, decide
from pdserve.router.flight import Flight, Placement, new_worker_request_id
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import (
    DecodeLoad,
    PrefillLoad,
    RoutingInfo,
    TierCosts,
    choose_decode,
    choose_prefill,
    early_rejection,
    prefill_locally,
    priced_hit_tokens,
    shared_prefix_len,
)
from pdserve.router.prefix_pulls import PrefixPulls
from pdserve.router.store import RedisStore, Session
from pdserve.router.validation import InvalidArgument, ValidRequest
from pdserve.router.workers import (
    PrefillClient,
    ReservationLost,
    WorkerBusy,
    WorkerClient,
    WorkerLost,
)
from pdserve.wire import lora_to_proto, sampling_to_proto

logger = logging.getLogger(__name__)

RETRY_S = (0.005, 0.1)  # backoff while every decode worker is full
MAX_ATTEMPTS = 3  # failed attempts (lost prefill worker, failed transfer, ...) before giving up


class Aborted(Exception):
    """Abort was called before the request reached a decode worker."""


class PrefillLost(WorkerLost):
    """The prefill worker failed before the first token: the request can go elsewhere."""

    def __init__(self, worker_id: str, detail: str) -> None:
        super().__init__(f"prefill worker {worker_id} failed: {detail}")
        self.worker_id = worker_id


class DecodeSideFailed(WorkerLost):
    """The prefill worker's KV push failed because of the decode side (Prefill: ABORTED)."""


class NoCapacity(Exception):
    """No decode worker could hold the request's KV before its deadline."""


class TTFTUnmeetable(Exception):
    """Early rejection: every prefill worker is predicted to miss the TTFT SLO for it."""

    def __init__(self, retry_after_s: float, ttft_slo_s: float) -> None:
        super().__init__(f"every prefill worker is predicted to give the first token "
                         f"{retry_after_s:.3g} s past the TTFT SLO of {ttft_slo_s:g} s; retry "
                         f"in {retry_after_s:.3g} s")
        self.retry_after_s = retry_after_s


RETRYABLE = (PrefillLost, DecodeSideFailed, ReservationLost, WorkerBusy)


def _check(flight: Flight) -> None:
    """Abort may come during any await: an aborted flight goes no further."""
    if flight.aborted:
        raise Aborted


class Placer:
    """Reads the router's worker tables (it never changes them) and the Redis store."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, store: RedisStore | None,
                 prefill: Mapping[str, PrefillClient],
                 decode: Mapping[str, DecodeClient]) -> None:
        self.config, self.metrics, self.store = config, metrics, store
        self.prefill, self.decode = prefill, decode
        self.pulls = PrefixPulls(config, metrics, prefill, decode)

    async def place(self, req: ValidRequest, flight: Flight,
                    avoid: frozenset[str] = frozenset()) -> Placement:
        """Start the request on some worker(s); its placement. Aborted, NoCapacity,
        InvalidArgument or WorkerLost when it can't be. Whatever raises leaves `flight`
        naming the decode worker of the last attempt (the caller releases it). `avoid`:
        decode workers that failed this request mid-stream (a migration), never chosen."""
        session = None
        if req.session_id and self.store is not None:
            session = await self.store.get_session(req.session_id)
        deadline = time.monotonic() + self.config.kv_transfer_timeout_s
        excluded: set[str] = set()
        lost_prefill: set[str] = set()
        failures: list[WorkerLost] = []
        for delay in _backoff():
            _check(flight)
            decode = self._choose_decode(req, session, excluded | avoid)
            if decode is None:
                self._check_room(deadline, avoid)
                excluded.clear()
                await asyncio.sleep(delay)
                continue
            flight.worker_request_id = new_worker_request_id(req.request_id)
            placement = Placement(decode, decode.open(flight.worker_request_id))
            flight.decode = decode
            try:
                if await self._dispatch(req, flight, placement, session, deadline, lost_prefill):
                    return placement
                excluded.add(decode.worker_id)  # refused: it holds nothing for the request
            except RETRYABLE as exc:
                _check(flight)
                await self._failed_attempt(req, flight, exc, excluded, lost_prefill, failures)
            except (WorkerLost, InvalidArgument):
                _check(flight)  # the failure may be the abort's own doing
                raise
            decode.close_request(flight.worker_request_id)
            flight.decode = None
        raise AssertionError("unreachable")

    def _check_room(self, deadline: float, avoid: frozenset[str] = frozenset()) -> None:
        """No decode worker took the request: why it can't wait for one, if it can't."""
        if not any(c.in_rotation and c.worker_id not in avoid for c in self.decode.values()):
            raise WorkerLost("no decode worker is up")
        if time.monotonic() > deadline:
            raise NoCapacity("every decode worker's KV cache is full; retry later")

    async def _failed_attempt(self, req: ValidRequest, flight: Flight, exc: WorkerLost,
                              excluded: set[str], lost_prefill: set[str],
                              failures: list[WorkerLost]) -> None:
        """Undo the attempt on its decode worker and steer the next one away from the cause;
        WorkerLost after MAX_ATTEMPTS failures."""
        decode = flight.decode
        await decode.abort(flight.worker_request_id)  # frees its reservation, if any
        if isinstance(exc, PrefillLost):
            lost_prefill.add(exc.worker_id)
        elif not isinstance(exc, ReservationLost):  # expired: that worker is not to blame
            excluded.add(decode.worker_id)
        failures.append(exc)
        if len(failures) >= MAX_ATTEMPTS:
            raise WorkerLost(f"{len(failures)} attempts failed, the last: {exc}") from None
        logger.warning("%s: %s; placing it again", req.request_id, exc)

    async def _dispatch(self, req: ValidRequest, flight: Flight, placement: Placement,
                        session: Session | None, deadline: float,
                        lost_prefill: set[str]) -> bool:
        """Start the request on `placement.decode`; False if that worker refused it."""
        decode, rid = placement.decode, flight.worker_request_id
        sampling = sampling_to_proto(req.params)
        prompt = list(req.prompt_token_ids)
        pull = None
        if session is not None and session.decode_worker == decode.worker_id:
            placement.session_hit = shared_prefix_len(session.token_ids, prompt)
        elif session is not None:
            pull = self.pulls.choose(req, session, decode, deadline)
        held = placement.session_hit or (pull.num_tokens if pull else 0)
        try:
            prefill, hits = await self._where_to_prefill(req, prompt, decode, held, lost_prefill,
                                                         pull.predicted_s if pull else 0.0)
        except (WorkerLost, TTFTUnmeetable):  # nothing reached the decode worker: nothing to free
            decode.close_request(rid)
            flight.decode = None
            raise
        if prefill is None:
            submit = worker_pb2.SubmitRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                num_output_tokens=req.num_output_tokens, lora=lora_to_proto(req.lora))
            if pull is not None:
                submit.pull_sources.append(pull.source)
                submit.num_pull_tokens, submit.pull_deadline = pull.num_tokens, pull.deadline
            decode.note_sent(0, 0, len(prompt) - held)
            reply = await decode.submit(submit)
            _check(flight)
            if reply.granted and pull is not None:
                await self.pulls.run(req, rid, pull, reply.pull_descriptor)
            return reply.granted
        _check(flight)
        wall_deadline = time.time() + max(deadline - time.monotonic(), 0.0)
        decode_sampling = pdserve_pb2.SamplingParams()
        decode_sampling.CopyFrom(sampling)
        decode_sampling.ClearField("prompt_logprobs")  # the prefill worker computes those
        reply = await decode.reserve(worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=decode_sampling,
            sources=[prefill.source], deadline=wall_deadline,
            num_output_tokens=req.num_output_tokens, lora=lora_to_proto(req.lora)))
        _check(flight)
        if not reply.granted:
            return False
        request = worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                            sampling=sampling, descriptor=reply.descriptor,
                                            num_output_tokens=req.num_output_tokens,
                                            lora=lora_to_proto(req.lora))
        placement.prefill = await self._prefill(flight, prefill, decode, request,
                                                len(prompt) - hits, deadline)
        _check(flight)
        await self._start_decode(decode, rid, placement.prefill)
        _check(flight)
        return True

    async def _prefill(self, flight: Flight, prefill: PrefillClient, decode: DecodeClient,
                       request: worker_pb2.PrefillRequest, num_new_tokens: int,
                       deadline: float) -> worker_pb2.PrefillResponse:
        """Run the prompt on `prefill`, which pushes its KV to the blocks reserved on
        `decode`; cancelled (DecodeSideFailed) if `decode` is marked down meanwhile."""
        flight.prefill = prefill
        task = asyncio.ensure_future(prefill.prefill(
            request, num_new_tokens, timeout=max(deadline - time.monotonic(), 0.001)))
        decode.feeding.add(task)
        if not decode.up:  # marked down since the reservation
            task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            _check(flight)
            raise DecodeSideFailed(f"decode worker {decode.worker_id} went down while the "
                                   "KV was on its way") from None
        except grpc.aio.AioRpcError as exc:
            _check(flight)
            raise _prefill_error(prefill, exc) from None
        except WorkerLost as exc:  # marked down mid-prompt: another prefill worker may take it
            _check(flight)
            raise PrefillLost(prefill.worker_id, str(exc)) from None
        finally:
            decode.feeding.discard(task)
            flight.prefill = None

    async def _start_decode(self, decode: DecodeClient, rid: str,
                            first: worker_pb2.PrefillResponse) -> None:
        start = worker_pb2.StartRequest(request_id=rid, first_token_id=first.first_token_id)
        if first.HasField("logprob"):
            start.logprob.CopyFrom(first.logprob)
        await decode.start_request(start)
        self.metrics.observe_transfer(first.transfer_bytes, first.transfer_s, first.skipped_bytes)

    def _choose_decode(self, req: ValidRequest, session: Session | None,
                       excluded: set[str]) -> DecodeClient | None:
        info = RoutingInfo(
            len(req.prompt_token_ids),
            -(-(len(req.prompt_token_ids) + 1) // self.config.block_size),
            session.decode_worker if session else None,
            lora_name=req.lora.lora_name if req.lora is not None else None,
        )
        # a worker whose last load poll was late is served only when no fresh one fits
        for stale in (False, True):
            loads = [_decode_load(c) for c in self.decode.values()
                     if c.in_rotation and c.load is not None and c.load_stale == stale]
            chosen = choose_decode(loads, info, excluded)
            if chosen is not None:
                break
        else:
            return None
        decode = self.decode[chosen]
        decode.note_sent(info.num_blocks_needed)
        return decode

    async def _where_to_prefill(self, req: ValidRequest, prompt: list[int],
                                decode: DecodeClient, held: int, lost_prefill: set[str],
                                pull_s: float = 0.0) -> tuple[PrefillClient | None, int]:
        """(None, 0): `decode`, which holds the prompt's first `held` tokens (a session's, or
        a pull's, landing in `pull_s` as predicted), prefills it; else the prefill worker that
        does and its prefix hit there.
        Fixed placement is local only for a short uncached tail; adaptive placement asks
        router.disaggregation, that rule serving until the workers' step times are measured.
        TTFTUnmeetable: early rejection refuses the request (a migrated one never is)."""
        config = self.config
        fixed_local = bool(held) and prefill_locally(len(prompt), held,
                                                     config.max_local_prefill_tokens)
        if config.colocated or fixed_local and config.prefill_placement == "fixed":
            return None, 0
        try:
            prefill, hits, miss_s = await self.choose_prefill(prompt, lost_prefill, req.lora)
        except WorkerLost:
            if fixed_local:  # no prefill worker is up: the decode worker can take the tail
                return None, 0
            raise
        local, local_ttft_s = fixed_local, None
        if config.prefill_placement == "adaptive":
            remote = _prefill_option(prefill, len(prompt) - hits)
            decision = decide(remote, _decode_option(decode, len(prompt) - held, pull_s,
                                                     remote.fit), fixed_local, config.tpot_slo_s)
            self.metrics.observe_placement(decision)
            logger.debug("%s: prefill %s on %s (%s); predicted TTFT %s s, TPOT %s s",
                         req.request_id, decision.where, decision.worker_id, decision.reason,
                         _g(decision.ttft_s), _g(decision.tpot_s))
            local, local_ttft_s = decision.where == LOCAL, decision.ttft_s
        if miss_s is not None and not req.num_output_tokens:  # a migrated one streamed already
            if not local:
                raise TTFTUnmeetable(miss_s, config.ttft_slo_s)
            if local_ttft_s is not None and local_ttft_s > config.ttft_slo_s:
                raise TTFTUnmeetable(min(miss_s, local_ttft_s - config.ttft_slo_s),
                                     config.ttft_slo_s)
        return (None, 0) if local else (prefill, hits)

    async def choose_prefill(self, prompt: list[int], excluded: set[str] = frozenset(),
                             lora: LoRARequest | None = None
                             ) -> tuple[PrefillClient, int, float | None]:
        """The prefill worker for this prompt (run with `lora`), its prefix-cache hit there
        (tokens) and, with early rejection on, by how many seconds every prefill worker is
        predicted to miss the TTFT SLO (None: some may meet it)."""
        up = [c for c in self.prefill.values() if c.in_rotation and c.worker_id not in excluded]
        if not up:
            raise WorkerLost("no prefill worker is up")
        hits: dict[str, int] = {}
        if self.store is not None and len(up) > 1:
            hashes = hash_blocks(prompt, self.config.block_size, root=chain_root(lora))
            blocks = await self.store.prefix_hits(hashes, [c.worker_id for c in up])
            hits = {w: priced_hit_tokens(held, _tier_costs(self.prefill[w].load),
                                         self.config.block_size)
                    for w, held in blocks.items()}
        loads = [PrefillLoad(c.worker_id, c.num_inflight, c.num_inflight_tokens,
                             _adapters(c)) for c in up]
        info = RoutingInfo(len(prompt), 0, prefix_hits=hits,
                           lora_name=lora.lora_name if lora is not None else None)
        miss_s = None
        if self.config.early_rejection:
            rates = {c.worker_id: c.load.prefill_s_per_token if c.load else None for c in up}
            miss_s = early_rejection(loads, info, rates, self.config.ttft_slo_s)
        chosen = choose_prefill(loads, info)
        return self.prefill[chosen], hits.get(chosen, 0), miss_s


def _prefill_error(prefill: PrefillClient, exc: grpc.aio.AioRpcError) -> Exception:
    """Which side a failed Prefill is on: the request, the decode side, or the prefill worker
    (marked down only when it said it is going away or could not be reached)."""
    code = exc.code()
    if code == grpc.StatusCode.ABORTED:
        return DecodeSideFailed(f"the KV transfer from {prefill.worker_id} failed on the "
                                f"decode side: {exc.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the request's KV deadline: no time to retry
        return WorkerLost(f"prefill on {prefill.worker_id} did not finish within the KV "
                          f"transfer deadline")
    error = prefill.error(exc)
    if isinstance(error, InvalidArgument):
        return error
    return PrefillLost(prefill.worker_id, f"{code.name}: {exc.details()}")


def _decode_load(c: DecodeClient) -> DecodeLoad:
    """Its last report, less what the router has sent it since."""
    return DecodeLoad(c.worker_id, c.load.num_blocks, c.load.num_free_blocks - c.num_pending[0],
                      c.load.num_running + c.load.num_waiting + c.num_pending[1],
                      c.load.max_num_seqs, _adapters(c))


def _prefill_option(c: PrefillClient, num_uncached_tokens: int) -> Option:
    """A prefill worker as the place to prefill a prompt (router.disaggregation): its queue is
    the router's own count of the uncached tokens it sent there. Its steps are prompts, so
    even its mean cost per token (no slope fitted yet) prices one."""
    load = c.load
    return Option(c.worker_id, c.num_inflight_tokens, num_uncached_tokens,
                  step_fit(load, fitted_only=False), _budget(load))


def _decode_option(c: DecodeClient, num_uncached_tokens: int, wait_s: float,
                   prompt_line: StepFit | None) -> Option:
    """The decode worker as the place to prefill a prompt, after `wait_s` (a prefix it pulls):
    its queue is the prompt tokens it reported queued plus those sent since, beside the
    sequences it last reported running (those sent since wait for their own prefill, here
    or remote, while this one runs). Until it has timed prompts of clearly different sizes
    its prompt slope is not a prompt's: it is priced at `prompt_line`'s (the prefill worker's)
    beside its own fixed and decode costs, once it has those."""
    load = c.load
    tokens = c.num_pending[2]
    queued, running = (load.num_prefill_tokens, load.num_running) if load else (0, 0)
    line = step_fit(load, fitted_only=True)
    if line is None and prompt_line is not None and (own := step_fit(load, False)) is not None \
            and own.per_decode_s is not None:
        line = StepFit(own.intercept_s, prompt_line.per_token_s, own.per_decode_s)
    return Option(c.worker_id, queued + tokens, num_uncached_tokens, line, _budget(load),
                  num_decoding=running, wait_s=wait_s)


def step_fit(load: worker_pb2.WorkerLoad | None, fitted_only: bool) -> StepFit | None:
    """The step-time fit a worker last reported (None: none, one that is not a number, or no
    fitted prompt slope when `fitted_only`); a negative intercept or decode slope (a fit over
    noise) reads as none. The planner sizes its pools from it too (planner.measured)."""
    if load is None or (fitted_only and not load.step_slope_fitted):
        return None
    values = (load.step_intercept_s, load.prefill_s_per_token, load.decode_s_per_token)
    if not (all(map(math.isfinite, values)) and load.prefill_s_per_token > 0):
        return None
    return StepFit(max(load.step_intercept_s, 0.0), load.prefill_s_per_token,
                   load.decode_s_per_token if load.decode_s_per_token > 0 else None)


def _budget(load: worker_pb2.WorkerLoad | None) -> int:
    return max(load.step_token_budget, 1) if load is not None else 1


def _g(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3g}"


def _tier_costs(load: worker_pb2.WorkerLoad | None) -> TierCosts:
    """What a prefix hit in each of a worker's KV tiers costs it, as it last measured."""
    if load is None:
        return TierCosts()
    return TierCosts(load.prefill_s_per_token or None, load.kv_host_load_s or None,
                     load.kv_disk_load_s or None)


def _adapters(c: WorkerClient) -> frozenset[str]:
    """The LoRA adapters the worker last said it holds."""
    return frozenset(c.load.lora_adapters) if c.load is not None else frozenset()


def _backoff():
    delay = RETRY_S[0]
    while True:
        yield delay
        delay = min(delay * 2, RETRY_S[1])
