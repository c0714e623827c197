"""N-gram (prompt lookup) proposals: what followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n in [n_min, n_max] that occurs. No model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.engine.request import Request
from pdserve.engine.spec.config import SpeculativeConfig


def lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the best earlier match of the suffix: the longest match
    (at most n_max tokens, at least n_min), the latest among equally long ones."""
    last = len(tokens) - 1
    if last < 1:
        return []
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # earlier copies of the last token
    if ends.size == 0:
        return []
    lengths = np.ones(ends.size, np.int64)
    alive = np.ones(ends.size, bool)
    for j in range(1, min(n_max, last + 1)):
        starts = ends - j
        alive &= starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[last - j]
        if not alive.any():
            break
        lengths += alive
    best = int(lengths.max())
    if best < n_min:
        return []
    end = int(ends[np.flatnonzero(lengths == best)[-1]])
    return tokens[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    """Keeps each request's tokens as a growing int64 array, so a step converts only the
    tokens that are new since the last."""

    cheap = True

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, length)

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> None:
        cfg = self.config
        for request, k in zip(requests, num_drafts):
            tokens = self._array(request)
            request.spec_token_ids = lookup(
                tokens, k, cfg.prompt_lookup_max, cfg.prompt_lookup_min
            )

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._tokens.pop(request_id, None)

    def _array(self, request: Request) -> np.ndarray:
        buffer, length = self._tokens.get(request.request_id, (np.empty(0, np.int64), 0))
        total = request.num_tokens
        if total > buffer.size:
            grown = np.empty(max(2 * buffer.size, total + 64), np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        if total > length:
            buffer[length:total] = request.token_slice(length, total)
        self._tokens[request.request_id] = (buffer, total)
        return buffer[:total]
