"""SpeculativeConfig: which proposer, how many tokens it proposes; parsed like vLLM's
`speculative_config` (a dict, or its JSON text), every field checked by name."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """`ngram`: prompt lookup, no extra model; `draft`: `model`, a small model with the
    target's tokenizer, run greedily by the same worker over its own paged KV."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: the longest suffix n-gram looked up
    prompt_lookup_min: int = 1  # ngram: the shortest
    model: str | None = None  # draft: its directory (or a known name)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, "
                             f"got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens,
                   1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, self.prompt_lookup_max)
        if self.method == "draft" and not self.model:
            raise ValueError("speculative_config.model: the draft method needs a model path")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model: only the draft method takes a model")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_speculative_config(value: object) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a dict or its JSON text (as `--speculative-config` takes
    it) -> a checked config; None or an empty text means no speculation."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
    for name in ("method", "num_speculative_tokens"):
        if name not in value:
            raise ValueError(f"speculative_config.{name} is required")
    return SpeculativeConfig(**value)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], "
                         f"got {value!r}")
