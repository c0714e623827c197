"""ResponseStream: one request's decode-worker deltas turned into GenerateResponse messages.

Detokenizes incrementally, cuts at stop strings, and records TTFT / ITL / end-to-end latency.
With a remote prefill the first token is sent as soon as the prefill worker returns it (that
is the TTFT), and dropped from the decode worker's first delta, which repeats it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.proto import pdserve_pb2
from pdserve.router.flight import Flight, Placement
from pdserve.router.metrics import RouterMetrics
from pdserve.router.validation import ValidRequest
from pdserve.router.workers import Lost, WorkerLost


class WorkerFailed(Exception):
    """The decode worker ended the request with an error (e.g. its KV transfer failed)."""


class ResponseStream:
    def __init__(self, req: ValidRequest, tokenizer: Any, placement: Placement,
                 received: float, queued_s: float, metrics: RouterMetrics) -> None:
        self.req, self.placement, self.metrics = req, placement, metrics
        self.received, self.queued_s = received, queued_s
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params.stop,
                                            req.params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.first_at: float | None = None
        self.last_at = received

    async def run(self, flight: Flight) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        prefill = self.placement.prefill
        skip = 0
        if prefill is not None:  # the first token is known now: send it
            skip = 1
            logprobs = [prefill.logprob] if prefill.HasField("logprob") else []
            message, stop = self._message([prefill.first_token_id], logprobs)
            if stop is not None:
                yield self._finish(message, "stop", stop)
                return
            yield message
        queue: asyncio.Queue = self.placement.queue
        while True:
            delta = await queue.get()
            if isinstance(delta, Lost):
                raise WorkerLost(delta.reason)
            if delta.finish_reason == "error":
                flight.done = True  # the worker has freed it already
                raise WorkerFailed(delta.error or "decode worker failed the request")
            token_ids, logprobs = list(delta.token_ids)[skip:], list(delta.logprobs)[skip:]
            skip = 0
            if delta.finish_reason:
                flight.done = True
            message, stop = self._message(token_ids, logprobs)
            if stop is not None:  # the worker is still generating: the caller frees it
                flight.done = False
                yield self._finish(message, "stop", stop, delta.num_cached_tokens)
                return
            if delta.finish_reason:
                message.text += self.detok.flush()
                yield self._finish(message, delta.finish_reason, delta.stop_reason,
                                   delta.num_cached_tokens)
                return
            if message.token_ids or message.text:
                yield message

    def _message(self, token_ids: list[int],
                 logprobs: list) -> tuple[pdserve_pb2.GenerateResponse, str | None]:
        """The message for these new tokens, and the stop string they completed, if any."""
        now = time.monotonic()
        if token_ids:
            if self.first_at is None:
                self.first_at = now
                self.metrics.observe_ttft(now - self.received)
                if len(token_ids) > 1:
                    self.metrics.observe_itl(0.0, len(token_ids) - 1)
            else:
                self.metrics.observe_itl(now - self.last_at, len(token_ids))
            self.last_at = now
        self.token_ids += token_ids
        update = self.detok.update(token_ids)
        message = pdserve_pb2.GenerateResponse(
            request_id=self.req.request_id, text=update.delta, token_ids=token_ids,
            logprobs=logprobs if self.req.params.logprobs is not None else [],
        )
        return message, update.stop_string

    def _finish(self, message: pdserve_pb2.GenerateResponse, reason: str,
                stop_reason: str | None, worker_cached: int = 0) -> pdserve_pb2.GenerateResponse:
        now = time.monotonic()
        prefill = self.placement.prefill
        cached = prefill.num_cached_tokens if prefill is not None else worker_cached
        num_prompt = len(self.req.prompt_token_ids)
        message.finish_reason = reason
        message.stop_reason = stop_reason or ""
        message.usage.CopyFrom(pdserve_pb2.Usage(
            prompt_tokens=num_prompt, completion_tokens=len(self.token_ids), cached_tokens=cached))
        ttft = (self.first_at or now) - self.received
        message.timings.CopyFrom(pdserve_pb2.Timings(
            queue_s=self.queued_s, ttft_s=ttft, e2e_s=now - self.received))
        self.metrics.observe_e2e(now - self.received)
        self.metrics.count_tokens(num_prompt, len(self.token_ids), cached)
        return message
