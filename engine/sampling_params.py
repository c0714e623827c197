"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.engine.structured_outputs_params import StructuredOutputsParams


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; every bound is checked here, naming the field.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 and min_p 0 disable
    theirs. `logprobs` None returns none, 0 the chosen token's, n also the top-n.
    `prompt_logprobs` likewise for every prompt token (vLLM's: from the raw logits one
    position before it); such a request computes its whole prompt, taking no prefix-cache hit.

    Before temperature, in vLLM's order: the structured-output mask, `bad_words` (a word's
    last token is banned where the output ends with the rest of it), `min_tokens` (EOS and
    stop ids banned until that many are generated), `logit_bias` (token id -> added to its
    logit), then the penalties: `repetition_penalty` over prompt and output (a logit > 0 is
    divided by it, one < 0 multiplied), `frequency_penalty` (times each token's count in the
    output) and `presence_penalty` (once per token present) subtracted. Logprobs stay those
    of the raw logits. `bad_words_token_ids` are the words tokenized: filled in by whoever
    holds the tokenizer (the LLM, the router), as vLLM does.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a dict is accepted
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None  # a dict is accepted

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0  # OpenAI's range, either sign

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=self.MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=self.MAX_LOGPROBS)
        self._check_logits_processing()

    def _check_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got "
                             f"{self.repetition_penalty}")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        pairs = tuple(sorted((_as_token_id(t), b) for t, b in pairs))
        for _, value in pairs:
            _check_float("logit_bias", value)
            if abs(value) > self.MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in pairs))
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        words = tuple(tuple(w) for w in self.bad_words_token_ids)
        for word in words:
            if not word:
                raise ValueError("bad_words_token_ids: a word has no tokens")
            for token_id in word:
                _check_int("bad_words_token_ids", token_id, low=0)
        object.__setattr__(self, "bad_words_token_ids", words)
        if isinstance(self.structured_outputs, Mapping):  # as JSON carries it
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams(**self.structured_outputs))
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{self.structured_outputs!r}")

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature and the filters changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens
                    or self.bad_words_token_ids or self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _as_token_id(value: object) -> int:
    """A logit_bias key: an int, or (as JSON object keys are) its decimal string."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    _check_int("logit_bias", value, low=0)
    return value


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
