"""RequestOutput: what a caller sees of a request after each step and at its end."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.scheduler_output import TokenLogprobs


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
