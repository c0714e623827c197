"""Request: one generation, owner of its tokens; RequestStatus: where it is in its life."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import PromptLogprobsTask, TokenLogprobs

if TYPE_CHECKING:
    from pdserve.engine.structured_output import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved, KV arriving from prefill
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its KV transfer failed or expired

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until scheduled
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # What the KV connector needs to move this request's KV, opaque to the engine: where a
    # reserved prompt's KV comes from (decode), or where a prompt's KV goes (prefill).
    kv_transfer: object | None = None
    # A request moved here from a worker that died: the prompt's last this-many tokens were
    # generated there, so its seeded sampler skips that many draws (the stream continues)
    num_prior_output_tokens: int = 0
    # Speculative decoding: tokens proposed to follow this one-token-behind request, verified
    # in its next step (set by the proposer, taken by the scheduler's next plan).
    spec_token_ids: list[int] = field(default_factory=list)
    # Asked for (sampling_params.prompt_logprobs): those of prompt positions 1, 2, ... so far.
    # Kept across preemption, so a recomputed prompt adds none twice.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Its structured output's matcher (sampling_params.structured_outputs), set by the engine
    # that admits it, having replayed the tokens generated elsewhere; advanced by each token
    # appended here.
    grammar: GrammarState | None = None
    lora: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without copying the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        head = list(self.prompt_token_ids[start:end]) if start < num_prompt else []
        tail = self.output_token_ids[max(start - num_prompt, 0) : max(end - num_prompt, 0)]
        return head + tail

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token this request generated, here and on the worker it came from."""
        return self.all_token_ids[self.num_prompt_tokens - self.num_prior_output_tokens:]

    @property
    def num_sampled_tokens(self) -> int:
        """Tokens sampled for this request so far, here and on the worker it came from."""
        return self.num_prior_output_tokens + len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: no prefix-cache hit may skip any."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def prompt_logprobs_task(self, start: int, num_tokens: int) -> PromptLogprobsTask | None:
        """The prompt logprobs a step computing tokens [start, start + num_tokens) owes: the
        prompt positions in (start, start + num_tokens] not yet held (position p's come from
        the logits at p - 1, so a chunk's last row serves the next chunk's first token)."""
        if not self.needs_prompt_logprobs:
            return None
        first = max(start, len(self.prompt_logprobs)) + 1
        end = min(start + num_tokens, self.num_prompt_tokens - 1) + 1
        if first >= end:
            return None
        return PromptLogprobsTask(first, self.prompt_token_ids[first:end],
                                  self.sampling_params.prompt_logprobs)

    def add_prompt_logprobs(
        self, task: PromptLogprobsTask | None, entries: tuple[TokenLogprobs, ...] | None
    ) -> None:
        """Keep what a step computed for `task` (None: it had none, or computed none)."""
        if task is None or entries is None:
            return
        assert task.first_position == len(self.prompt_logprobs) + 1, task
        assert len(entries) == len(task.token_ids), (task, len(entries))
        self.prompt_logprobs.extend(entries)

    def first_output_prompt_logprobs(self, num_new: int) -> tuple[TokenLogprobs, ...] | None:
        """The prompt logprobs, when asked, for the output whose `num_new` tokens (appended)
        are the request's first."""
        if self.sampling_params.prompt_logprobs is None or self.needs_prompt_logprobs:
            return None
        return tuple(self.prompt_logprobs) if len(self.output_token_ids) == num_new else None

    def append_output(
        self, token_ids: tuple[int, ...], max_model_len: int
    ) -> tuple[int, RequestStatus | None]:
        """Append sampled tokens one by one up to the first that ends the request (EOS, a
        stop token, max_tokens, the context window): how many were appended, and the end."""
        for num, token_id in enumerate(token_ids, 1):
            self.output_token_ids.append(token_id)
            if self.grammar is not None:
                self.grammar.accept((token_id,))
            status = self.stop_status(token_id, max_model_len)
            if status is not None:
                return num, status
        return len(token_ids), None

    def stop_status(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """Whether appending `token_id` (already appended) ends the request, and how."""
        params = self.sampling_params
        if self.grammar is not None and self.grammar.terminated:  # only a stop token could end it
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def check_num_prior_output_tokens(value: object, num_prompt_tokens: int) -> int:
    """A migrated request's generated tail, as the wire's `num_output_tokens` gives it: an
    integer in [0, prompt length), the prompt keeping at least one token of its own."""
    if isinstance(value, bool) or not isinstance(value, int) or not (
            0 <= value < num_prompt_tokens):
        raise ValueError(f"num_output_tokens must be an integer in [0, {num_prompt_tokens}) "
                         f"(the prompt's tail the request generated elsewhere), got {value!r}")
    return value
