"""What a decode worker streams per request: token ids only (the router detokenizes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeOutput:
    request_id: str
    token_ids: tuple[int, ...]  # new this step
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
