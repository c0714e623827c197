"""DecodeWorker: rank 0 of a decode group — reservations, KV arrival, batching, streams.

Admission is memory reservation: `reserve` holds blocks for a prompt (or refuses, holding
nothing) and returns the TransferDescriptor the prefill worker pushes into. A request joins
the running batch once its KV has landed on every TP rank and its first token (sampled by
prefill) is known. `submit` instead prefills a prompt here (when this worker's prefix cache
already holds most of it, e.g. the next turn of a session); `submit_pulling` first pulls the
prompt's prefix from another decode worker that holds it, whose `push_prefix` sends it
(decode_worker.prefix_push). Every reservation has a deadline;
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

import contextlib
import logging
import math
import queue
import time
from collections.abc import Sequence

from pdserve.decode_worker.outputs import DecodeOutput
from pdserve.decode_worker.prefix_push import PrefixPusher
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.input_processor import prepare_params
from pdserve.engine.kv_connector import RemotePrefill
from pdserve.engine.loop import EngineLoop, LoopClosedError
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.plan_broadcast import IdleBeat
from pdserve.engine.request import Request, RequestStatus, check_num_prior_output_tokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.engine.worker_stats import WorkerStats
from pdserve.kvtransfer.connector import Connector, Listener
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.errors import TransferError
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.receive_connector import KVReceiveConnector
from pdserve.wire import check_logprobs, check_prompt, check_request_id, check_token_id

logger = logging.getLogger(__name__)

MAX_RESERVATION_S = 60.0
TP_BEAT_S = 2.0


class ReservationNotFound(LookupError):
    """Start for a request with no live reservation here (unknown, expired or started)."""


class PrefixGone(LookupError):
    """PushPrefix for blocks this worker's prefix cache no longer holds (the puller was told)."""


class PushFailed(RuntimeError):
    """PushPrefix's KV did not reach the puller (refused, peer lost, deadline)."""


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
        transport: Connector | None = None,
    ) -> None:
        """`transport`: this worker's KV sender identity, for pushing prefixes to other decode
        workers (TP 1 only); None: it serves no pulls."""
        tp = tp or TensorParallel()
        if transport is not None and tp.size > 1:
            raise ValueError("a TP group's ranks each hold a KV-head shard: it pushes no prefix "
                             "(pass no transport)")
        self.max_reservation_s = max_reservation_s
        self.layout = KVLayout.from_model_config(config.model, config.cache.block_size,
                                                 model_name)
        self.connector = KVReceiveConnector(self.layout, listener, endpoints, tp)
        self.core = EngineCore(config, tp, self.connector)
        self.tp, self.config = self.core.tp, self.core.config
        self.endpoints = self.connector.endpoints
        self.pusher = None if transport is None else PrefixPusher(
            self.layout, transport, self.core.runner.kv_caches)
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
        deadline = self._checked_deadline(deadline)
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

    def submit_pulling(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams, sources: Sequence[Endpoint],
                       num_pull_tokens: int, deadline: float, num_output_tokens: int = 0,
                       lora: LoRARequest | None = None) -> tuple[bool, TransferDescriptor | None]:
        """`submit`, the prompt's first `num_pull_tokens` tokens (whole blocks, not the last
        token) pulled first from the decode worker `sources` names, until `deadline` (capped
        at now + max_reservation_s; then they are computed here). Returns (granted, the
        descriptor that worker pushes into; None when this one holds that prefix already)."""
        prompt = self._checked_prompt(request_id, prompt_token_ids)
        params = prepare_params(params, None, self.config.model.vocab_size)
        num_output_tokens = check_num_prior_output_tokens(num_output_tokens, len(prompt))
        block_size = self.layout.block_size
        if (isinstance(num_pull_tokens, bool) or not isinstance(num_pull_tokens, int)
                or not 0 < num_pull_tokens < len(prompt) or num_pull_tokens % block_size):
            raise ValueError(f"num_pull_tokens must be a positive multiple of the block size "
                             f"{block_size} below the prompt's {len(prompt)} tokens, got "
                             f"{num_pull_tokens!r}")
        if params.prompt_logprobs is not None:
            raise ValueError("pull_sources: a request asking for prompt_logprobs computes every "
                             "prompt position, so it pulls no prefix")
        if len(sources) != 1:
            raise ValueError("pull_sources must name the one endpoint of a TP-1 decode worker")
        deadline = self._checked_deadline(deadline)
        request = Request(request_id, prompt, params, self.config.model.eos_token_ids,
                          kv_transfer=RemotePrefill(tuple(sources), deadline, num_pull_tokens),
                          num_prior_output_tokens=num_output_tokens, lora=lora)
        return self._loop.call(lambda: self._submit_pulling(request))

    def push_prefix(self, request_id: str, prompt_token_ids: Sequence[int],
                    lora: LoRARequest | None, descriptor: TransferDescriptor) -> float:
        """Push the prefix `prompt_token_ids` (run with `lora`: its blocks' hash chain), which
        this worker's prefix cache holds, into another decode worker's reserved blocks
        (`descriptor`, from its `submit_pulling`). Seconds the push took once every byte has
        left. PrefixGone when a block is no longer held, PushFailed when the push failed
        (either way the puller is told at once); ValueError naming a bad field."""
        prompt = self._checked_prompt(request_id, prompt_token_ids)
        if self.pusher is None:
            raise ValueError("this decode worker pushes no prefix (a TP group, or started "
                             "without a KV transport)")
        if descriptor.request_id != request_id:
            raise ValueError(f"descriptor is for request {descriptor.request_id!r}, "
                             f"not {request_id!r}")
        descriptor.check_layout(self.layout)
        if tuple(descriptor.sources) != (self.pusher.source,):
            raise ValueError(f"descriptor names sources {[s.key for s in descriptor.sources]}; "
                             f"this decode worker is {self.pusher.source.key}")
        if len(prompt) != descriptor.num_blocks * self.layout.block_size:
            raise ValueError(f"prompt_token_ids has {len(prompt)} tokens; the descriptor's "
                             f"{descriptor.num_blocks} blocks hold "
                             f"{descriptor.num_blocks * self.layout.block_size}")
        kv = self.core.kv_cache
        try:
            blocks = self._loop.call(lambda: kv.hold_cached(
                prompt, lora, descriptor.first_block, descriptor.num_pushed_blocks))
        except LookupError as exc:
            self.pusher.refuse(descriptor, str(exc))
            raise PrefixGone(str(exc)) from None
        try:
            return self.pusher.push(descriptor, [b.block_id for b in blocks])
        except TransferError as exc:
            raise PushFailed(f"pushing {request_id}'s prefix failed: {exc}") from None
        finally:
            with contextlib.suppress(LoopClosedError):  # a closed worker holds nothing
                self._loop.call(lambda: kv.release_held(blocks))

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
        if not self._loop.stop(self._shutdown):  # it had died: release the transports here
            self.connector.close()
            if self.pusher is not None:
                self.pusher.close()

    def _checked_deadline(self, deadline: float) -> float:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not (
                math.isfinite(deadline)):
            raise ValueError(f"deadline must be a finite time.time() number, got {deadline!r}")
        return min(float(deadline), time.time() + self.max_reservation_s)

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

    def _submit_pulling(self, request: Request) -> tuple[bool, TransferDescriptor | None]:
        if len(self.core.scheduler.requests) >= self.config.scheduler.max_num_seqs:
            return False, None
        descriptor = self.core.reserve_remote(request)  # raises for an id already in flight
        return request.request_id in self.core.scheduler.requests, descriptor

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
        if self.pusher is not None:
            self.pusher.close()
