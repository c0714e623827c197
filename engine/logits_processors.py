"""Per-request logits processing before sampling: bad words, min_tokens, logit_bias, penalties.

Each row of a step's logits is one position of one request, with the tokens that request had
generated before it (a draft row also counts the drafts ahead of it). The structured-output
mask is applied before these (engine.structured_output); temperature and the filters after
(engine.sampler). The order and the arithmetic are vLLM's (see SamplingParams). Penalty
state is no separate store: it is counted from the request's own tokens each step, so it
moves with the request across the prefill/decode split and on migration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsRow:
    """What one logits row's processing depends on."""

    params: SamplingParams
    all_token_ids: Sequence[int]  # prompt + everything generated before this position
    num_generated: int  # the tail of all_token_ids that the request generated
    num_output: int  # generated here (max_tokens and min_tokens count these)
    stop_ids: Sequence[int]  # EOS and stop token ids: banned while min_tokens is unmet

    @property
    def generated(self) -> Sequence[int]:
        return self.all_token_ids[len(self.all_token_ids) - self.num_generated:]


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[LogitsRow | None]) -> None:
    """In place on fp32 `logits` [len(rows), V]; a None row is left as it is."""
    rows = [row if row is not None else _NOTHING for row in rows]
    banned = [(r, t) for r, row in enumerate(rows) for t in _banned(row)]
    if banned:
        index = torch.tensor(banned, device=logits.device)
        logits[index[:, 0], index[:, 1]] = float("-inf")
    bias = [(r, t, b) for r, row in enumerate(rows) for t, b in row.params.logit_bias]
    if bias:
        r_t = torch.tensor([(r, t) for r, t, _ in bias], device=logits.device)
        values = torch.tensor([b for _, _, b in bias], dtype=logits.dtype, device=logits.device)
        logits.index_put_((r_t[:, 0], r_t[:, 1]), values, accumulate=True)
    penalized = [r for r, row in enumerate(rows) if _penalized(row.params)]
    if penalized:
        _apply_penalties(logits, [rows[r] for r in penalized], penalized)


_NOTHING = LogitsRow(SamplingParams(), (), 0, 0, ())


def _banned(row: LogitsRow) -> list[int]:
    params = row.params
    banned = [word[-1] for word in params.bad_words_token_ids
              if _ends_with(row.generated, word[:-1])]
    if row.num_output < params.min_tokens:
        banned += row.stop_ids
    return banned


def _ends_with(tokens: Sequence[int], prefix: Sequence[int]) -> bool:
    n = len(prefix)
    return n == 0 or (len(tokens) >= n and list(tokens[len(tokens) - n:]) == list(prefix))


def _penalized(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[LogitsRow], index: list[int]) -> None:
    """Counts of each row's generated tokens and a mask of all its tokens, as [n, V] tensors
    built by one scatter each (a padding column past the vocabulary takes the padding)."""
    device, vocab = logits.device, logits.shape[1]
    counts = _scatter([row.generated for row in rows], vocab, device)  # [n, V]
    seen = _scatter([row.all_token_ids for row in rows], vocab, device) > 0
    x = logits[index]
    rep = torch.tensor([row.params.repetition_penalty for row in rows], device=device)
    rep = rep.unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([row.params.frequency_penalty for row in rows], device=device)
    pres = torch.tensor([row.params.presence_penalty for row in rows], device=device)
    x -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0)
    logits[index] = x


def _scatter(token_lists: Sequence[Sequence[int]], vocab: int,
             device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        padded[i, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]
