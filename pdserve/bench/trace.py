"""`RequestRecord`: what the benchmark runner saw of one request, and its JSON form.

All times are seconds on one clock for the whole run (the runner uses `time.perf_counter()`),
so differences between any two records are meaningful; absolute values are not.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it.

    `chunk_times[i]` is when the i-th streamed message that carried tokens arrived and
    `chunk_tokens[i]` how many tokens it carried (>= 1). Messages without tokens (a final
    status) only move `end`. A failed request keeps what it streamed before the error; one
    the client cancelled or aborted on purpose (`interrupted`, see bench/interrupts.py) keeps
    what it streamed before that, and is neither ok nor failed.
    """

    request_id: str
    start: float  # when it was sent
    end: float  # last message received, or the error
    chunk_times: tuple[float, ...]
    chunk_tokens: tuple[int, ...]
    num_prompt_tokens: int
    error: str | None = None  # gRPC status name, e.g. "UNAVAILABLE"; None = success
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    session_id: str = ""
    interrupted: str = ""  # "cancel" | "abort": the client cut it short on purpose

    def __post_init__(self) -> None:
        if self.interrupted not in ("", "cancel", "abort"):
            raise ValueError(f"request {self.request_id}: interrupted must be '', 'cancel' or "
                             f"'abort', got {self.interrupted!r}")
        if len(self.chunk_times) != len(self.chunk_tokens):
            raise ValueError(
                f"request {self.request_id}: {len(self.chunk_times)} chunk_times but "
                f"{len(self.chunk_tokens)} chunk_tokens; record one of each per message"
            )
        if any(n < 1 for n in self.chunk_tokens):
            raise ValueError(
                f"request {self.request_id}: chunk_tokens must be >= 1 (record only "
                f"messages that carried tokens), got {list(self.chunk_tokens)}"
            )
        if self.num_prompt_tokens < 0 or self.cached_tokens < 0:
            raise ValueError(
                f"request {self.request_id}: token counts must be >= 0, got "
                f"num_prompt_tokens={self.num_prompt_tokens} cached_tokens={self.cached_tokens}"
            )

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def first_token_time(self) -> float | None:
        """Arrival of the first message that carried tokens; None if none did."""
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def last_token_time(self) -> float | None:
        """Arrival of the last message that carried tokens; None if none did."""
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def ok(self) -> bool:
        """It ran to its end: no error, and the client did not cut it short."""
        return self.error is None and not self.interrupted


_FIELDS = tuple(f.name for f in fields(RequestRecord))


def records_to_json(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Plain dicts (lists for the tuples), one per record, for `json.dump`."""
    out = []
    for r in records:
        d = {name: getattr(r, name) for name in _FIELDS}
        d["chunk_times"] = list(r.chunk_times)
        d["chunk_tokens"] = list(r.chunk_tokens)
        out.append(d)
    return out


def records_from_json(items: Sequence[Mapping[str, Any]]) -> list[RequestRecord]:
    """The inverse of `records_to_json`; unknown keys are an error (a different format)."""
    records = []
    for i, item in enumerate(items):
        unknown = set(item) - set(_FIELDS)
        if unknown:
            raise ValueError(
                f"record {i}: unknown keys {sorted(unknown)}; expected keys from {list(_FIELDS)}"
            )
        kwargs = dict(item)
        kwargs["chunk_times"] = tuple(float(t) for t in item.get("chunk_times", ()))
        kwargs["chunk_tokens"] = tuple(int(n) for n in item.get("chunk_tokens", ()))
        try:
            records.append(RequestRecord(**kwargs))
        except TypeError as e:  # a missing required field
            raise ValueError(f"record {i}: {e}") from None
    logger.debug("loaded %d request records", len(records))
    return records
