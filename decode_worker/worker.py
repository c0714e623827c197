"""DecodeWorker: rank 0 of a decode group — reservations, KV arrival, batching, streams.

Admission is memory reservation: `reserve` holds blocks for a prompt (or refuses, holding
nothing) and returns the TransferDescriptor the prefill worker pushes into. A request joins
the running batch once its KV has landed on every TP rank and its first token (sampled by
prefill) is known. `submit` instead prefills a prompt here (when this worker's prefix cache
already holds most of it, e.g. the next turn of a session). Every reservation has a deadline;
a failed or late transfer, an abort or a finish frees the request's blocks on every rank.

The transfers themselves are the KV connector's (kvtransfer.receive_connector): it holds
the one record of each, and the engine's own step asks it, before scheduling, what landed,
failed or expired. Outputs leave as one batch per engine step (`next_outputs`), every
request's news together. All engine and TP-group work happens on the worker's loop thread
(engine.loop); the public methods are thread-safe and only queue commands.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence

from pdserve.decode_worker.outputs import DecodeOutput
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.loop import EngineLoop
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.engine.worker_stats import WorkerStats
from pdserve.kvtransfer.connector import Listener
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.receive_connector import KVReceiveConnector, RemotePrefill

logger = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(
        self,
        config: EngineConfig,
        listener: Listener,
        endpoints: Sequence[Endpoint],
        model_name: str,
        tp: TensorParallel | None = None,
    ) -> None:
        tp = tp or TensorParallel()
        self.layout = KVLayout.from_model_config(config.model, config.cache.block_size,
                                                 model_name)
        self.connector = KVReceiveConnector(self.layout, listener, endpoints, tp)
        self.core = EngineCore(config, tp, self.connector)
        self.tp, self.config = self.core.tp, self.core.config
        self.endpoints = self.connector.endpoints
        self._step_outputs: list[DecodeOutput] = []
        self._outputs: queue.Queue[tuple[DecodeOutput, ...]] = queue.Queue()
        self._loop = EngineLoop("decode-loop", self._step, self._fail_all)

    # ---- public, thread-safe ----

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sources: Sequence[Endpoint],
        deadline: float,
    ) -> TransferDescriptor | None:
        """Hold blocks for the prompt's KV; the descriptor to push into, or None if full."""
        request = Request(request_id, tuple(prompt_token_ids), params,
                          self.config.model.eos_token_ids,
                          kv_transfer=RemotePrefill(tuple(sources), deadline))
        return self._loop.call(lambda: self.core.reserve_remote(request))

    def start(
        self, request_id: str, first_token: int, logprobs: TokenLogprobs | None = None
    ) -> None:
        """The prefill side's first token: the request runs once its KV has landed."""
        if not 0 <= first_token < self.config.model.vocab_size:
            raise ValueError(f"first_token {first_token} is outside the vocabulary")
        self._loop.call(lambda: self.connector.start(request_id, first_token, logprobs))

    def submit(self, request_id: str, prompt_token_ids: Sequence[int],
               params: SamplingParams) -> bool:
        """Prefill and decode here (prefix cache first); False, holding nothing, when full."""
        request = Request(request_id, tuple(prompt_token_ids), params,
                          self.config.model.eos_token_ids)
        return self._loop.call(lambda: self._submit(request))

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
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

    def stats(self) -> WorkerStats:
        return self._loop.call(
            lambda: WorkerStats.from_core(self.core, num_reserved=self.connector.num_pending))

    def close(self) -> None:
        if not self._loop.stop(self._shutdown):  # it had died: release the listener here
            self.connector.close()

    # ---- loop thread ----

    def _step(self) -> bool:
        if self.core.has_unfinished_requests():
            for out in self.core.step():
                self._step_outputs.append(DecodeOutput.from_core(out))
        self._flush()
        return self.core.scheduler.has_runnable_requests()

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
        """The loop died: end every request with the reason rather than hang its stream."""
        for request_id in list(self.core.scheduler.requests):
            self._step_outputs.append(
                DecodeOutput(request_id, (), "error", f"decode worker died: {exc}"))
        self._flush()

    def _shutdown(self) -> None:
        for request_id in self.connector.pending_request_ids():
            self._abort(request_id, "decode worker shutting down")
        self._flush()
        self.core.shutdown()
