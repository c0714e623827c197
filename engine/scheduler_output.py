"""The messages between Scheduler and ModelRunner: a self-contained plan and its result.

A plan carries everything a runner needs (tokens, positions, block tables), so the same
message can be broadcast from the scheduling rank to every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.engine.kv_tiers import TierOps, TierResults
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.sampling_params import SamplingParams


class SamplingHistory(Protocol):
    """What rank 0 reads of a request to process its logits (engine.request.Request is one):
    its tokens, which of them it generated, its stop ids and its grammar."""

    output_token_ids: list[int]  # generated here
    eos_token_ids: Sequence[int]
    grammar: Any  # engine.structured_output.GrammarState | None

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_sampled_tokens(self) -> int: ...  # generated here and where it came from


@dataclass(frozen=True)
class PromptLogprobsTask:
    """Prompt logprobs a step owes one request: those of the prompt tokens at positions
    first_position, first_position + 1, ..., each from the logits one position before it."""

    first_position: int  # >= 1; its logits row is first_position - 1
    token_ids: tuple[int, ...]  # the prompt tokens at those positions
    num_top: int  # the top-n alternatives to return with each (0: none)


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]  # tokens computed this step
    num_computed_tokens: int  # position of token_ids[0]
    block_ids: tuple[int, ...]  # the request's whole block table
    sampling_params: SamplingParams | None  # None: a prefill chunk that samples nothing
    num_output_tokens: int = 0  # tokens the request has generated so far (here or elsewhere)
    # Speculative decoding: the last this-many of token_ids are proposed drafts to verify
    # (sampled at every one of them and at the token before).
    num_spec_tokens: int = 0
    # The request's KV-connector parameters, on the entry that computes its prompt's last
    # token (its prompt KV is complete after this step): a prefill worker pushes it there.
    # Not part of the TP broadcast: followers never push.
    kv_transfer: object | None = field(default=None, compare=False)
    prompt_logprobs: PromptLogprobsTask | None = None  # positions this chunk computes
    # The request itself, on an entry that samples with logits processing (penalties, a
    # grammar, ...): rank 0 reads its tokens and grammar. Not part of the TP broadcast.
    request: SamplingHistory | None = field(default=None, compare=False)
    lora: LoRARequest | None = None  # the adapter its tokens run with

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]  # single-token (decode-shaped) requests first
    finished_request_ids: tuple[str, ...] = ()  # the runner drops their per-request state
    kv_tiers: TierOps = TierOps()  # copies to and from the tiers under the device pool

    @property
    def num_decodes(self) -> int:  # one token each, so no drafts
        return sum(1 for r in self.requests if r.num_tokens == 1)

    @property
    def total_num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the chosen token, and of the top-n alternatives when asked."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # tokens at least as likely, itself included (prompt logprobs)


@dataclass(frozen=True)
class KVSaveResult:
    """How one request's KV left this worker, in the step that completed its prompt."""

    num_bytes: int
    seconds: float  # first layer pushed -> every byte acknowledged
    error: str | None = None  # the push failed: the request fails with this


@dataclass(frozen=True)
class RunnerOutput:
    # Only requests whose plan entry asked for a sample: one token, or with drafts the
    # accepted drafts and then the target's own token.
    sampled_token_ids: dict[str, tuple[int, ...]]
    logprobs: dict[str, tuple[TokenLogprobs, ...]]  # one per sampled token, when asked
    kv_saves: dict[str, KVSaveResult] = field(default_factory=dict)  # by the KV connector
    # Per request with a PromptLogprobsTask: one per position of the task, in order.
    prompt_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    kv_tiers: TierResults = TierResults()  # the tiers' copies that finished since last step


@dataclass(frozen=True)
class EngineCoreOutput:
    """One request's news from one step: tokens (token ids only) and whether it finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why, when finish_reason is "error" (a KV transfer failed)
    kv_save: KVSaveResult | None = None  # its prompt KV was pushed this step
    # Asked for: positions 1 .. prompt end, on the output of the request's first token.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
