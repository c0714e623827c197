"""DecodeWorker: rank 0 of a decode group — reservations, KV arrival, batching, streams.

Admission is memory reservation: `reserve` holds blocks for a prompt (or refuses, holding
nothing) and returns the TransferDescriptor the prefill worker pushes into. A request joins
the running batch once its KV has landed on every TP rank and its first token (sampled by
prefill) is known. `submit` instead prefills a prompt here (when this worker's prefix cache
already holds most of it, e.g. the next turn of a session). Every reservation has a deadline;
a failed or late transfer, an abort or a finish frees the request's blocks on every rank.
Every field a caller sends is checked before anything is queued (ValueError, naming it), and
a caller's reservation deadline is capped at now + `max_reservation_s`.

The transfers themselves are the KV connector's (kvtransfer.receive_connector): it holds
the one record of each, and the engine's own step asks it, before scheduling, what landed,
failed or expired. Outputs leave as one batch per engine step (`next_outputs`), every
request's news together. All engine and TP-group work happens on the worker's loop thread
(engine.loop); the public methods are thread-safe and only queue commands. An idle rank 0
of a TP group sends its followers an "idle" message every `tp_beat_s` (engine.plan_broadcast).
A step that raises (e.g. a TP collective timed out on a hung rank) ends the loop: every
request ends with the reason and its blocks are freed, without touching the TP group again.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Sequence

from pdserve.decode_worker.outputs import DecodeOutput
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.input_processor import prepare_params
from pdserve.engine.loop import EngineLoop, LoopClosedError
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import IdleBeat
from pdserve.engine.request import Request, RequestStatus, check_num_prior_output_tokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.engine.worker_stats import WorkerStats
from pdserve.kvtransfer.connector import Listener
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.receive_connector import KVReceiveConnector, RemotePrefill
from pdserve.wire import check_logprobs, check_prompt, check_request_id, check_token_id

logger = logging.getLogger(__name__)

MAX_RESERVATION_S = 60.0
TP_BEAT_S = 2.0


class ReservationNotFound(LookupError):
    """Start for a request with no live reservation here (unknown, expired or started)."""


class DecodeWorker:
    def __init__(
        self,
        config: EngineConfig,
        listener: Listener,
        endpoints: Sequence[Endpoint],
        model_name: str,
        tp: TensorParallel | None = None,
        *,
        max_reservation_s: float = MAX_RESERVATION_S,
        tp_beat_s: float = TP_BEAT_S,
    ) -> None:
        tp = tp or TensorParallel()
        self.max_reservation_s = max_reservation_s
        self.layout = KVLayout.from_model_config(config.model, config.cache.block_size,
                                                 model_name)
        self.connector = KVReceiveConnector(self.layout, listener, endpoints, tp)
        self.core = EngineCore(config, tp, self.connector)
        self.tp, self.config = self.core.tp, self.core.config
        self.endpoints = self.connector.endpoints
        self._step_outputs: list[DecodeOutput] = []
        self._outputs: queue.Queue[tuple[DecodeOutput, ...]] = queue.Queue()
        self._beat = IdleBeat(self.tp, tp_beat_s)
        self._loop = EngineLoop("decode-loop", self._step, self._fail_all)

    # ---- public, thread-safe ----

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sources: Sequence[Endpoint],
        deadline: float,
        num_output_tokens: int = 0,
        lora: LoRARequest | None = None,
    ) -> TransferDescriptor | None:
        """Hold blocks for the prompt's KV; the descriptor to push into, or None if full.
        The deadline is capped at now + max_reservation_s. `num_output_tokens`: the prompt's
        tail a migrated request generated elsewhere (seeded sampling continues after it);
        `lora`: the adapter it runs with (the prompt's KV computed with it too)."""
        prompt = self._checked_prompt(request_id, prompt_token_ids)
        params = prepare_params(params, None, self.config.model.vocab_size)
        num_output_tokens = check_num_prior_output_tokens(num_output_tokens, len(prompt))
        if not sources:
            raise ValueError("sources must name the prefill worker's ranks")
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not (
                math.isfinite(deadline)):
            raise ValueError(f"deadline must be a finite time.time() number, got {deadline!r}")
        deadline = min(float(deadline), time.time() + self.max_reservation_s)
        request = Request(request_id, prompt, params, self.config.model.eos_token_ids,
                          kv_transfer=RemotePrefill(tuple(sources), deadline),
                          num_prior_output_tokens=num_output_tokens, lora=lora)
        return self._loop.call(lambda: self.core.reserve_remote(request))

    def start(
        self, request_id: str, first_token: int, logprobs: TokenLogprobs | None = None
    ) -> None:
        """The prefill side's first token: the request runs once its KV has landed.
        ReservationNotFound when no live reservation waits for it."""
        check_request_id(request_id)
        vocab_size = self.config.model.vocab_size
        check_token_id("first_token_id", first_token, vocab_size)
        if logprobs is not None:
            check_logprobs(logprobs, vocab_size)
        self._loop.call(lambda: self._start(request_id, first_token, logprobs))

    def submit(self, request_id: str, prompt_token_ids: Sequence[int],
               params: SamplingParams, num_output_tokens: int = 0,
               lora: LoRARequest | None = None) -> bool:
        """Prefill and decode here (prefix cache first); False, holding nothing, when full.
        `num_output_tokens` and `lora` as for `reserve`."""
        prompt = self._checked_prompt(request_id, prompt_token_ids)
        params = prepare_params(params, None, self.config.model.vocab_size)
        num_output_tokens = check_num_prior_output_tokens(num_output_tokens, len(prompt))
        request = Request(request_id, prompt, params, self.config.model.eos_token_ids,
                          num_prior_output_tokens=num_output_tokens, lora=lora)
        return self._loop.call(lambda: self._submit(request))

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        check_request_id(request_id)
        return self._loop.call(lambda: self._abort(request_id, reason))

    def next_outputs(self, timeout: float | None = None) -> tuple[DecodeOutput, ...]:
        """The next step's outputs (every request with news), or () after `timeout` seconds."""
        try:
            return self._outputs.get(timeout=timeout)
        except queue.Empty:
            return ()

    def is_alive(self) -> bool:
        """Whether the engine loop still runs (a dead loop serves nothing)."""
        return self._loop.is_alive()

    def seconds_since_beat(self) -> float:
        """How long since the engine loop last came round: large while a step is wedged."""
        return self._loop.seconds_since_beat()

    def stats(self) -> WorkerStats:
        """Read on the loop thread; once the loop has died, here (nothing else touches it)."""
        try:
            return self._loop.call(
                lambda: WorkerStats.from_core(self.core, num_reserved=self.connector.num_pending))
        except LoopClosedError:
            if not self._loop.join():
                raise
            return WorkerStats.from_core(self.core, num_reserved=self.core.scheduler.num_remote)

    def close(self) -> None:
        if not self._loop.stop(self._shutdown):  # it had died: release the listener here
            self.connector.close()

    def _checked_prompt(self, request_id: str, prompt: Sequence[int]) -> tuple[int, ...]:
        check_request_id(request_id)
        model = self.config.model
        return check_prompt(prompt, model.vocab_size, model.max_model_len)

    # ---- loop thread ----

    def _step(self) -> bool:
        self._beat.tick()
        if self.core.has_unfinished_requests():
            for out in self.core.step():
                self._step_outputs.append(DecodeOutput.from_core(out))
        self._flush()
        return self.core.scheduler.has_runnable_requests()

    def _start(self, request_id: str, first_token: int,
               logprobs: TokenLogprobs | None) -> None:
        request = self.core.scheduler.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ReservationNotFound(f"request_id {request_id!r} has no reservation here "
                                      "(unknown, expired or already started)")
        if time.time() > request.kv_transfer.deadline:  # expired; the next step reclaims it
            raise ReservationNotFound(f"the reservation of {request_id!r} expired")
        self.connector.start(request_id, first_token, logprobs)

    def _submit(self, request: Request) -> bool:
        scheduler = self.core.scheduler
        if request.request_id in scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        if len(scheduler.requests) >= self.config.scheduler.max_num_seqs:
            return False
        self.core.add_request(request)
        return True

    def _abort(self, request_id: str, reason: str) -> bool:
        """End a request now, freeing its blocks (and cancelling its transfer) on every rank."""
        found = self.core.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if found:
            logger.info("request %s ended: abort (%s)", request_id, reason)
            self._step_outputs.append(DecodeOutput(request_id, (), "abort"))
        return found

    def _flush(self) -> None:
        if self._step_outputs:
            self._outputs.put(tuple(self._step_outputs))
            self._step_outputs = []

    def _fail_all(self, exc: BaseException) -> None:
        """The loop died: end every request with the reason rather than hang its stream, and
        free its blocks. The TP group may be what failed (a rank hung or died), so nothing
        is sent to it: the scheduler forgets its connector first; the followers' copies go
        with the group, which the supervisor replaces whole."""
        scheduler = self.core.scheduler
        scheduler.connector = None
        for request_id in list(scheduler.requests):
            self._step_outputs.append(
                DecodeOutput(request_id, (), "error", f"decode worker died: {exc}"))
            scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        self._flush()

    def _shutdown(self) -> None:
        for request_id in self.connector.pending_request_ids():
            self._abort(request_id, "decode worker shutting down")
        self._flush()
        self.core.shutdown()
