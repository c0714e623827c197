"""LLMEngine: text in, text out, on top of EngineCore (which speaks token ids only).

It validates and tokenizes before anything is allocated, detokenizes incrementally, and
ends a request when a stop string appears (freeing its blocks at once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.input_processor import (
    Prompt,
    check_prompt_length,
    prepare_params,
    tokenize_prompt,
)
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.prompt_logprobs import output_prompt_logprobs
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import EngineCoreOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request: adding it can no longer fail on its input."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    lora: LoRARequest | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any | None) -> None:
        """`tokenizer` None: token-id prompts only; outputs carry ids and empty text."""
        self.core = EngineCore(config, tokenizer=tokenizer)
        self.config = self.core.config
        self.tokenizer = tokenizer
        self._outputs: dict[str, RequestOutput] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def prepare(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> PreparedRequest:
        """Validate everything about a request without touching engine state (but reading
        its LoRA adapter into host memory)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params)}")
        model = self.config.model
        ids = tokenize_prompt(prompt, self.tokenizer, model.vocab_size)
        check_prompt_length(len(ids), model.max_model_len)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and none was loaded "
                             "(skip_tokenizer_init=True): use stop_token_ids")
        params = prepare_params(params, self.tokenizer, model.vocab_size)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request)}")
        self.core.add_lora(lora_request)
        text = prompt if isinstance(prompt, str) else None
        return PreparedRequest(request_id, text, tuple(ids), params, lora_request)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        rid = prepared.request_id
        if rid in self._outputs:
            raise ValueError(f"request_id {rid!r} is already in flight")
        request = Request(
            request_id=rid,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=prepared.params,
            eos_token_ids=self.config.model.eos_token_ids,
            lora=prepared.lora,
        )
        self.core.add_request(request)
        self._outputs[rid] = RequestOutput(
            rid, prepared.prompt, list(prepared.prompt_token_ids),
            logprobs=[] if prepared.params.logprobs is not None else None,
        )
        if self.tokenizer is not None:
            self._detokenizers[rid] = IncrementalDetokenizer(
                self.tokenizer, prepared.prompt_token_ids, prepared.params.stop,
                prepared.params.skip_special_tokens,
            )

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None
    ) -> None:
        self.add_prepared(self.prepare(request_id, prompt, params))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its final output, or None if unknown."""
        if not self.core.finish_request(request_id, RequestStatus.FINISHED_ABORTED):
            return None
        out = self._outputs.pop(request_id)
        self._detokenizers.pop(request_id, None)
        out.delta_token_ids, out.delta_text = [], ""
        out.finished, out.finish_reason = True, "abort"
        return _snapshot(out)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return [self._process(out) for out in self.core.step()]

    def _process(self, core_out: EngineCoreOutput) -> RequestOutput:
        rid = core_out.request_id
        out, detok = self._outputs[rid], self._detokenizers.get(rid, _NO_TEXT)
        update = detok.update(core_out.new_token_ids)
        # with several tokens in the step, those after one completing a stop string are dropped
        new_token_ids = core_out.new_token_ids[: update.num_tokens]
        delta_text = update.delta
        finish_reason, stop_reason = core_out.finish_reason, core_out.stop_reason
        if update.stop_string is not None:
            if finish_reason is None:
                self.core.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            finish_reason, stop_reason = "stop", update.stop_string
        elif finish_reason is not None:
            delta_text += detok.flush()
        out.token_ids.extend(new_token_ids)
        out.delta_token_ids = list(new_token_ids)
        out.text += delta_text
        out.delta_text = delta_text
        if out.logprobs is not None:
            out.logprobs.extend(core_out.new_logprobs[: update.num_tokens])
        out.num_cached_tokens = core_out.num_cached_tokens
        if core_out.prompt_logprobs is not None:
            out.prompt_logprobs = output_prompt_logprobs(
                out.prompt_token_ids, core_out.prompt_logprobs, self._decode_alone)
        if finish_reason is not None:
            out.finished, out.finish_reason, out.stop_reason = True, finish_reason, stop_reason
            del self._outputs[rid]
            self._detokenizers.pop(rid, None)
        return _snapshot(out)

    def _decode_alone(self, token_id: int) -> str | None:
        """A token's text as logprobs show it (vLLM's: decoded alone); None without a
        tokenizer."""
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])


class _NoText:
    """The detokenizer of an engine without a tokenizer: no text, no stop strings."""

    @staticmethod
    def update(token_ids: Sequence[int]) -> DetokenizerUpdate:
        return DetokenizerUpdate("", len(token_ids))

    @staticmethod
    def flush() -> str:
        return ""


_NO_TEXT = _NoText()


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the caller may keep while the engine goes on appending to the original."""
    logprobs = None if out.logprobs is None else list(out.logprobs)
    return replace(out, token_ids=list(out.token_ids), logprobs=logprobs)
