"""verify's emitted tokens are distributed as the target's (small vocab, exact computation).

Each check is a concentration bound with false-failure probability DELTA, not a tuned number:
an empirical distribution over c categories from n draws has L1 distance >= sqrt(2 (c ln 2 +
ln(1/DELTA)) / n) from the true one with probability <= DELTA (Bretagnolle-Huber-Carol), and an
empirical frequency is off by >= sqrt(ln(2/DELTA) / (2n)) with probability <= DELTA (Hoeffding).
12 cases x 4 bounds: this file fails by chance with probability <= 48 * DELTA = 4.8e-5.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplingBatch, make_generator
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.verify import Group, verify

CPU = torch.device("cpu")
V = 5  # vocab
K = 2  # drafts per group: positions 0..K
DELTA = 1e-6
NUM_CALLS, GROUPS_PER_CALL = 40, 1_000  # 40_000 groups per case
BOUNDARY_MARGIN = 1e-3  # a filter boundary this close could flip between fp32 and fp64


def exact_distribution(
    logits: Sequence[float], params: SamplingParams
) -> tuple[list[float], float]:
    """The processed target distribution in float64 (temperature, top-k, top-p over the
    renormalised top-k, min-p against the best), and how close any filter boundary came."""
    scaled = [x / params.temperature for x in logits]
    peak = max(scaled)
    weights = [math.exp(x - peak) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    ranked = sorted(range(len(probs)), key=lambda i: probs[i], reverse=True)
    kept = ranked[: params.top_k] if params.top_k > 0 else ranked
    margin = math.inf
    if params.top_p < 1.0:
        head_mass, before, head = sum(probs[i] for i in kept), 0.0, []
        for i in kept:  # a token stays while the mass strictly before it is < top_p
            if before >= params.top_p:
                break
            head.append(i)
            before += probs[i] / head_mass
            margin = min(margin, abs(before - params.top_p))
        kept = head
    if params.min_p > 0.0:
        best = probs[ranked[0]]
        margin = min([margin] + [abs(probs[i] / best - params.min_p) for i in kept])
        kept = [i for i in kept if probs[i] >= params.min_p * best]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))], margin


def l1_bound(num: int, categories: int) -> float:
    return math.sqrt(2 * (categories * math.log(2) + math.log(1 / DELTA)) / num)


def frequency_bound(num: int) -> float:
    return math.sqrt(math.log(2 / DELTA) / (2 * num))


def assert_distribution(samples: list[int], expected: list[float], what: str) -> None:
    counts = [0] * len(expected)
    for s in samples:
        counts[s] += 1
    never = [i for i, p in enumerate(expected) if p == 0.0 and counts[i] > 0]
    assert not never, f"{what}: drew zero-probability tokens {never} (counts {counts})"
    num = len(samples)
    l1 = sum(abs(c / num - p) for c, p in zip(counts, expected))
    bound = l1_bound(num, len(expected))
    assert l1 < bound, f"{what}: L1 {l1:.4f} >= {bound:.4f} (counts {counts}, p {expected})"


def _position_logits() -> torch.Tensor:
    return torch.randn(K + 1, V, generator=torch.Generator().manual_seed(3)) * 1.2  # [K+1, V]


def _draw_groups(params: SamplingParams, drafts: tuple[int, ...], seeded: bool) -> list[list[int]]:
    """NUM_CALLS verify calls of GROUPS_PER_CALL copies of the same K+1 positions; seeded
    groups keep their own generator (distinct seeds) from call to call."""
    logits = _position_logits().repeat(GROUPS_PER_CALL, 1)  # [groups * (K+1), V]
    rows = logits.shape[0]
    batch = SamplingBatch.from_params([params] * rows, [None] * rows, V, CPU)
    generators = [make_generator(100 + i, CPU) if seeded else None
                  for i in range(GROUPS_PER_CALL)]
    groups = [Group(i * (K + 1), drafts, generators[i]) for i in range(GROUPS_PER_CALL)]
    sampler, emitted = Sampler(seed=7), []
    for _ in range(NUM_CALLS):
        emitted += verify(sampler, logits, batch, groups)[0]
    return emitted


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("seeded", [False, True], ids=["shared-noise", "seeded"])
@pytest.mark.parametrize(
    "params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
def test_emitted_tokens_follow_the_target_distribution(params: SamplingParams, seeded: bool):
    exact = [exact_distribution(row, params) for row in _position_logits().tolist()]
    assert min(margin for _, margin in exact) > BOUNDARY_MARGIN, "pick other logits"
    p = [dist for dist, _ in exact]
    # The most likely tokens as drafts: often accepted, so position 1 gets many samples.
    drafts = tuple(max(range(V), key=p[j].__getitem__) for j in range(K))
    assert 0.25 < p[0][drafts[0]] < 0.85 and 0.25 < p[1][drafts[1]] < 0.85  # both outcomes
    if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
        assert all(0.0 in dist for dist in p[:2]), "the filter must drop something here"
    emitted = _draw_groups(params, drafts, seeded)
    num = len(emitted)
    assert num == NUM_CALLS * GROUPS_PER_CALL
    for tokens in emitted:  # a prefix of the drafts, then the target's own token
        assert 1 <= len(tokens) <= K + 1
        assert list(tokens[:-1]) == list(drafts[: len(tokens) - 1])
        assert len(tokens) == K + 1 or tokens[-1] != drafts[len(tokens) - 1]
    # (a) the first emitted token ~ p0, whether the draft was accepted or not
    assert_distribution([t[0] for t in emitted], p[0], "position 0")
    # (b) the second, given the first draft held ~ p1
    after = [t[1] for t in emitted if t[0] == drafts[0]]
    assert_distribution(after, p[1], "position 1 | draft 0 accepted")
    # draft 0 accepted with probability p0(d0)
    accepted = len(after) / num
    assert abs(accepted - p[0][drafts[0]]) < frequency_bound(num), (accepted, p[0][drafts[0]])
    # how many tokens each group emits: 1 + the number of drafts accepted in a row
    a0, a1 = p[0][drafts[0]], p[1][drafts[1]]
    assert_distribution([len(t) - 1 for t in emitted], [1 - a0, a0 * (1 - a1), a0 * a1],
                        "number emitted")


@pytest.mark.parametrize("seeded", [False, True], ids=["shared-noise", "seeded"])
def test_a_draft_outside_the_kept_tokens_is_never_accepted(seeded: bool) -> None:
    params = SamplingParams(temperature=1.0, top_k=2)
    p0, _ = exact_distribution(_position_logits()[0].tolist(), params)
    worst = min(range(V), key=lambda i: _position_logits()[0, i].item())
    assert p0[worst] == 0.0
    logits = _position_logits().repeat(200, 1)
    batch = SamplingBatch.from_params([params] * logits.shape[0], [None] * logits.shape[0],
                                      V, CPU)
    groups = [Group(i * (K + 1), (worst, 0), make_generator(i, CPU) if seeded else None)
              for i in range(200)]
    emitted, _ = verify(Sampler(seed=1), logits, batch, groups)
    assert all(len(t) == 1 and p0[t[0]] > 0.0 for t in emitted)
