"""ResponseStream: one request's decode-worker deltas turned into GenerateResponse messages.

Detokenizes incrementally, cuts at stop strings, and records TTFT / ITL / end-to-end latency.
Each message carries every token that reached the request's mailbox since the previous one:
one step's when the reader keeps up, several merged when it does not (see Mailbox).
With a remote prefill the first token is sent as soon as the prefill worker returns it (that
is the TTFT), and dropped from the decode worker's first delta, which repeats it.
"""

from __future__ import annotations

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
        prefill, want_logprobs = self.placement.prefill, self.req.params.logprobs is not None
        skip = 0
        if prefill is not None:  # the first token is known now: send it
            skip = 1
            logprobs = [prefill.logprob] if want_logprobs and prefill.HasField("logprob") else []
            message, stop = self._message([prefill.first_token_id], logprobs)
            if stop is not None:
                yield self._finish(message, "stop", stop)
                return
            yield message
        mailbox = self.placement.mailbox
        while True:
            # everything that arrived since the last message goes out as one (see Mailbox)
            items = await mailbox.take()
            token_ids, logprobs, end = _gather(items, skip, want_logprobs)
            skip = 0
            message, stop = self._message(token_ids, logprobs)
            finished = not (end is None or isinstance(end, Lost) or end.finish_reason == "error")
            cached = getattr(end if end is not None else items[-1], "num_cached_tokens", 0)
            if stop is not None:  # if the worker is still generating, the caller frees it
                yield self._finish(message, "stop", stop, cached)
                return
            if finished:
                flight.done = True  # the worker has freed it already
                message.text += self.detok.flush()
                yield self._finish(message, end.finish_reason, end.stop_reason, cached)
                return
            if message.token_ids or message.text:
                yield message  # before a failure too: what came first still reaches the client
            if isinstance(end, Lost):
                raise WorkerLost(end.reason)
            if end is not None:
                flight.done = True  # the worker has freed it already
                raise WorkerFailed(end.error or "decode worker failed the request")

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
        message = pdserve_pb2.GenerateResponse(request_id=self.req.request_id, text=update.delta,
                                               token_ids=token_ids, logprobs=logprobs)
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


def _gather(items: list, skip: int, want_logprobs: bool) -> tuple[list[int], list, Any]:
    """The tokens (and logprobs) of a run of mailbox items, the first `skip` dropped, and the
    item that ends the request (a finish, an error delta or Lost), if one came."""
    token_ids: list[int] = []
    logprobs: list = []
    for item in items:
        if isinstance(item, Lost) or item.finish_reason == "error":
            return token_ids, logprobs, item
        token_ids += item.token_ids[skip:]
        if want_logprobs:
            logprobs += item.logprobs[skip:]
        skip = 0
        if item.finish_reason:
            return token_ids, logprobs, item
    return token_ids, logprobs, None
