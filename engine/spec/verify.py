"""Verification of proposed drafts in one target forward: exact for greedy and for sampling.

Proposals are deterministic here (the n-gram lookup, the draft model's argmax), so rejection
sampling with a point-mass proposal accepts draft d with probability p(d) and otherwise draws
from p without d, renormalised. Drawing the target's own token x ~ p at that position and
accepting iff x == d is exactly that: P(accept) = p(d), and after a rejection x ~ p(. | x != d).
The emitted tokens are therefore distributed as the target's, and each emitted token takes one
draw from the request's noise stream, as it would without speculation: a seeded request gives
the same tokens with speculation as without (greedy ones trivially).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    clamp_noise,
    draw_noise,
    with_logprobs,
)


@dataclass(frozen=True)
class Group:
    """One request's rows of the step's logits: its drafts' positions and the one before."""

    first_row: int
    drafts: tuple[int, ...]  # row first_row + j is the target's position for drafts[j]
    generator: torch.Generator | None  # a seeded random request's own noise stream


def accepted_prefix(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The target's tokens up to and including the first that differs from its draft (all
    len(drafts) + 1 of them when every draft holds)."""
    for j, draft in enumerate(drafts):
        if targets[j] != draft:
            return list(targets[: j + 1])
    return list(targets[: len(drafts) + 1])


def verify(
    sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, groups: Sequence[Group],
    raw: torch.Tensor | None = None,
) -> tuple[list[list[int]], SamplerOutput]:
    """`logits` [R, V] and `batch` one row each (no generators: shared noise for random rows);
    returns each group's emitted tokens, and the sampler output of the emitted rows in order
    (token ids and, when asked, their logprobs, from `raw` when given: see Sampler)."""
    logits = logits.float()
    targets = sampler.sample_tokens(logits, batch).tolist()
    x = None
    emitted, rows = [], []
    for g in groups:
        if g.generator is None:
            tokens = accepted_prefix(targets[g.first_row:], g.drafts)
        else:
            x = sampler.process(logits, batch) if x is None else x
            tokens = _seeded_prefix(x, g)
        emitted.append(tokens)
        rows.extend(range(g.first_row, g.first_row + len(tokens)))
    flat = torch.tensor([t for tokens in emitted for t in tokens], device=logits.device)
    index = torch.tensor(rows, device=logits.device)
    raw = logits if raw is None else raw.float()
    return emitted, with_logprobs(raw[index], flat, batch.max_num_logprobs)


def _seeded_prefix(x: torch.Tensor, g: Group) -> list[int]:
    """A seeded request's tokens, one draw of its own noise per position looked at, the same
    draw and arithmetic as the sampler's for one token: position j is drawn only once every
    earlier draft held."""
    tokens: list[int] = []
    for j in range(len(g.drafts) + 1):
        row = x[g.first_row + j]
        noise = clamp_noise(draw_noise(g.generator, row.shape[0], row.device))
        tokens.append(int((row - noise.log_()).max(dim=-1).indices))
        if j == len(g.drafts) or tokens[-1] != g.drafts[j]:
            break
    return tokens
