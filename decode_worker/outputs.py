"""What a decode worker streams per request: token ids only (the router detokenizes)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduler_output import EngineCoreOutput, TokenLogprobs


@dataclass(frozen=True)
class DecodeOutput:
    request_id: str
    token_ids: tuple[int, ...]  # new this step
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error"
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when asked
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens this worker served from its prefix cache
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # with the first token, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_core(cls, out: EngineCoreOutput) -> DecodeOutput:
        return cls(out.request_id, out.new_token_ids, out.finish_reason, out.error,
                   out.new_logprobs, out.stop_reason, max(out.num_cached_tokens, 0),
                   out.prompt_logprobs or ())
