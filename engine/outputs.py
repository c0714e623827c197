"""RequestOutput: what a caller sees of a request after each step and at its end."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.scheduler_output import TokenLogprobs


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability, its rank (1: the most likely), its text alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # every generated token so far
    text: str = ""  # every released character so far
    delta_token_ids: list[int] = field(default_factory=list)  # new in this step
    delta_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs asked for: from the output with the first token on, one
    # entry per prompt token, None for the first, else {token id: Logprob} (prompt token
    # first, then the top-n best first), as vLLM's.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
