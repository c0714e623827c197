"""ResponseStream: one request's decode-worker deltas turned into GenerateResponse messages.

Detokenizes incrementally, cuts at stop strings, and records TTFT / ITL / end-to-end latency.
Each message carries every token that reached the request's mailbox since the previous one:
one step's when the reader keeps up, several merged when it does not (see Mailbox); the first
token always goes alone. With a remote prefill it is sent as soon as the prefill worker returns
it (that is the TTFT), and dropped from the decode worker's first delta, which repeats it.
One stream lives as long as its request: when the decode worker dies mid-stream, the router
places the request again (what was streamed becomes its prompt's tail) and `resume`s the
stream over the new placement, so detokenizer, stop strings, token count and timings carry on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.proto import pdserve_pb2, worker_pb2
from pdserve.router.flight import Flight, Placement
from pdserve.router.metrics import RouterMetrics
from pdserve.router.reasoning import keeps_special_tokens, split
from pdserve.router.tools import finish_reason, read_reply
from pdserve.router.validation import ValidRequest
from pdserve.router.workers import Lost, WorkerLost


class WorkerFailed(Exception):
    """The decode worker ended the request with an error (e.g. its KV transfer failed)."""


class ResponseStream:
    def __init__(self, req: ValidRequest, tokenizer: Any, placement: Placement,
                 received: float, queued_s: float, metrics: RouterMetrics) -> None:
        self.req, self.placement, self.metrics = req, placement, metrics
        self.received, self.queued_s = received, queued_s
        # a harmony reply's markers are special tokens: kept for the split, which drops them
        skip_special = (req.params.skip_special_tokens
                        and not keeps_special_tokens(req.reasoning_mode))
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params.stop,
                                            skip_special)
        self.token_ids: list[int] = []
        self.text = ""  # read at the end for reasoning and tool calls, when the request has them
        self.first_at: float | None = None
        self.last_at = received
        self.num_migrations = 0  # placements after the first
        # prompt tokens served from a prefix cache where the request was first placed (a
        # later placement's prompt holds generated tokens too: not the client's prompt)
        self.num_cached_tokens = 0

    def resume(self, placement: Placement) -> None:
        """Go on over `placement`: the request placed again after its decode worker failed,
        every token streamed so far the tail of its prompt there."""
        self.placement = placement
        self.num_migrations += 1

    def aborted(self) -> pdserve_pb2.GenerateResponse:
        """The last message of a request aborted between two placements."""
        message = pdserve_pb2.GenerateResponse(request_id=self.req.request_id,
                                               text=self._flush())
        return self._finish(message, "abort", None)

    async def run(self, flight: Flight) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """The current placement's messages to the end of the request; WorkerLost or
        WorkerFailed if its decode worker fails it first (the caller may `resume`)."""
        prefill, want_logprobs = self.placement.prefill, self.req.params.logprobs is not None
        first_placement, skip = self.num_migrations == 0, 0
        if prefill is not None:  # the first token is known now: send it
            skip = 1
            message, stop = self._prefilled(prefill)
            if stop is not None:
                yield self._finish(message, "stop", stop)
                return
            yield message
        mailbox, later = self.placement.mailbox, []
        while True:
            # everything that arrived since the last message goes out as one (see Mailbox),
            # but the first delta (the first token) alone, as a remote prefill's: the TTFT
            items, later = later or await mailbox.take(), []
            if self.first_at is None:  # the worker may have merged its first steps too
                items, later = _first_token(items, skip)
            token_ids, logprobs, end = _gather(items, skip, want_logprobs)
            skip = 0
            message, stop = self._message(token_ids, logprobs)
            message.prompt_logprobs.extend(lp for item in items if not isinstance(item, Lost)
                                           for lp in item.prompt_logprobs)
            finished = not (end is None or isinstance(end, Lost) or end.finish_reason == "error")
            if first_placement and prefill is None and (finished or end is None):
                # the decode worker's own prefix-cache hit, on every delta it sends
                self.num_cached_tokens = (end if finished else items[-1]).num_cached_tokens
            if stop is not None:  # if the worker is still generating, the caller frees it
                yield self._finish(message, "stop", stop)
                return
            if finished:
                flight.done = True  # the worker has freed it already
                message.text += self._flush()
                yield self._finish(message, end.finish_reason, end.stop_reason)
                return
            if message.token_ids or message.text:
                yield message  # before a failure too: what came first still reaches the client
            if isinstance(end, Lost):
                raise WorkerLost(end.reason)
            if end is not None:
                flight.done = True  # the worker has freed it already
                raise WorkerFailed(end.error or "decode worker failed the request")

    def _prefilled(self, prefill: worker_pb2.PrefillResponse
                   ) -> tuple[pdserve_pb2.GenerateResponse, str | None]:
        """The prefill worker's first token as a message, and the stop string it completed."""
        if self.num_migrations == 0:
            self.num_cached_tokens = prefill.num_cached_tokens
        want_logprobs = self.req.params.logprobs is not None
        logprobs = [prefill.logprob] if want_logprobs and prefill.HasField("logprob") else []
        message, stop = self._message([prefill.first_token_id], logprobs)
        message.prompt_logprobs.extend(prefill.prompt_logprobs)
        return message, stop

    def _message(self, token_ids: list[int],
                 logprobs: list) -> tuple[pdserve_pb2.GenerateResponse, str | None]:
        """The message for these new tokens, and the stop string they completed, if any: then
        it ends at the token that completed it (several come at once when the worker
        speculates or the reader fell behind), the same output as one token per message."""
        now = time.monotonic()
        update = self.detok.update(token_ids)
        token_ids, logprobs = token_ids[: update.num_tokens], logprobs[: update.num_tokens]
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
        self.text += update.delta
        message = pdserve_pb2.GenerateResponse(request_id=self.req.request_id, text=update.delta,
                                               token_ids=token_ids, logprobs=logprobs)
        return message, update.stop_string

    def _flush(self) -> str:
        """The detokenizer's held-back text, at the end."""
        tail = self.detok.flush()
        self.text += tail
        return tail

    def _read_reply(self, message: pdserve_pb2.GenerateResponse, reason: str) -> str:
        """The whole reply read into the last message: its reasoning split off (when the
        request has a reasoning mode), then tool calls read from the rest (when it has tools);
        returns the finish reason, "tool_calls" when the model called some."""
        content = self.text
        if self.req.reasoning_mode is not None:
            reasoning, content = split(self.text, self.req.reasoning_mode)
            message.reasoning_content, message.content = reasoning or "", content
        if self.req.tools is not None:
            content, calls = read_reply(self.req.tools, self.req.tool_call_parser, content)
            message.content = content or ""
            message.tool_calls.extend(pdserve_pb2.ToolCall(id=c.id, name=c.name,
                                                           arguments=c.arguments) for c in calls)
            reason = finish_reason(reason, bool(calls))
        return reason

    def _finish(self, message: pdserve_pb2.GenerateResponse, reason: str,
                stop_reason: str | None) -> pdserve_pb2.GenerateResponse:
        now = time.monotonic()
        cached = self.num_cached_tokens
        num_prompt = len(self.req.prompt_token_ids)
        reason = self._read_reply(message, reason)
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


def _first_token(items: list, skip: int) -> tuple[list, list]:
    """The first delta's first token (after `skip`) alone, and what follows it: a worker whose
    reader fell behind sends its first steps merged, but the first token is the TTFT."""
    first, later = items[0], items[1:]
    if isinstance(first, Lost) or first.finish_reason == "error" or len(
            first.token_ids) <= skip + 1:
        return [first], later
    n = skip + 1
    head = worker_pb2.RequestDelta(
        request_id=first.request_id, token_ids=first.token_ids[:n], logprobs=first.logprobs[:n],
        num_cached_tokens=first.num_cached_tokens, prompt_logprobs=first.prompt_logprobs)
    tail = worker_pb2.RequestDelta()
    tail.CopyFrom(first)
    del tail.token_ids[:n], tail.logprobs[:n], tail.prompt_logprobs[:]
    return [head], [tail, *later]


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
