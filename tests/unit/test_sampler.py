"""Sampler: greedy, seeded reproducibility, exact distributions (chi-square), logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from pdserve.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
NUM_SAMPLES = 20_000
# Upper 0.1% points of the chi-square distribution by degrees of freedom (standard tables).
CHI2_CRITICAL_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
# A boundary (top-p mass, min-p ratio) closer than this could flip between fp32 and fp64.
BOUNDARY_MARGIN = 1e-3


def _batch(params: list[SamplingParams], vocab_size: int, generators=None) -> SamplingBatch:
    if generators is None:
        generators = [make_generator(p.seed, CPU) for p in params]
    return SamplingBatch.from_params(params, generators, vocab_size, CPU)


def _logits(vocab_size: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


def target_distribution(logits: list[float], params: SamplingParams) -> tuple[list[float], float]:
    """The exact sampling distribution by enumeration in float64, and its boundary margin."""
    vocab = range(len(logits))
    scaled = [x / params.temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    order = sorted(vocab, key=lambda i: -probs[i])
    keep = order[: params.top_k] if params.top_k > 0 else order
    margin = math.inf
    if params.top_p < 1.0:
        mass, kept, cumulative = sum(probs[i] for i in keep), [], 0.0
        for i in keep:
            kept.append(i)
            cumulative += probs[i] / mass
            margin = min(margin, abs(cumulative - params.top_p))
            if cumulative >= params.top_p:
                break
        keep = kept
    if params.min_p > 0.0:
        best = max(probs[i] for i in keep)
        margin = min(margin, *(abs(probs[i] / best - params.min_p) for i in keep))
        keep = [i for i in keep if probs[i] >= params.min_p * best]
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in vocab], margin


def _draw(logits: torch.Tensor, params: SamplingParams, num: int, seed: int) -> torch.Tensor:
    batch = _batch([params] * num, logits.shape[-1])
    out = Sampler(seed=seed)(logits.expand(num, -1).contiguous(), batch)
    return out.token_ids


def assert_matches_distribution(tokens: torch.Tensor, expected: list[float]) -> None:
    """Chi-square goodness of fit at the 0.1% level; zero-probability tokens never drawn."""
    counts = torch.bincount(tokens, minlength=len(expected)).tolist()
    num = len(tokens)
    excluded = [i for i, p in enumerate(expected) if p == 0.0]
    assert all(counts[i] == 0 for i in excluded), f"excluded tokens drawn: {counts}"
    kept = [i for i, p in enumerate(expected) if p > 0.0]
    if len(kept) == 1:
        assert counts[kept[0]] == num
        return
    assert min(expected[i] * num for i in kept) >= 5, "chi-square needs >= 5 expected per bin"
    chi2 = sum((counts[i] - expected[i] * num) ** 2 / (expected[i] * num) for i in kept)
    critical = CHI2_CRITICAL_999[len(kept) - 1]
    assert chi2 < critical, f"chi2={chi2:.1f} >= {critical} (counts {counts}, p {expected})"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=3),
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.6),
        SamplingParams(top_p=0.9, temperature=1.3),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.8, top_k=6, top_p=0.85, min_p=0.1),
        SamplingParams(temperature=1.2, top_k=5, min_p=0.05),
    ],
    ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}",
)
def test_sampling_matches_exact_distribution(params: SamplingParams) -> None:
    logits = _logits(8, seed=3)
    expected, margin = target_distribution(logits.tolist(), params)
    assert margin > BOUNDARY_MARGIN, "pick other logits: a filter boundary is too close"
    assert_matches_distribution(_draw(logits, params, NUM_SAMPLES, seed=11), expected)


def test_mixed_batch_applies_each_rows_own_params() -> None:
    # Interleaved rows with different settings share one vectorised pass (sort path + top-k).
    configs = [
        SamplingParams(temperature=0.9, top_k=4),
        SamplingParams(top_p=0.7, min_p=0.05),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5),
    ]
    logits = [_logits(8, seed=20 + i) for i in range(len(configs))]
    num = 8_000
    params = [configs[row % len(configs)] for row in range(num * len(configs))]
    rows = torch.stack([logits[row % len(configs)] for row in range(len(params))])
    out = Sampler(seed=5)(rows, _batch(params, 8))
    for i, config in enumerate(configs):
        tokens = out.token_ids[i :: len(configs)]
        if config.greedy:
            assert (tokens == logits[i].argmax()).all()
            continue
        expected, margin = target_distribution(logits[i].tolist(), config)
        assert margin > BOUNDARY_MARGIN
        assert_matches_distribution(tokens, expected)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=7), SamplingParams(top_p=0.3), SamplingParams(min_p=0.1)],
    ids=["top_k", "top_p", "min_p"],
)
def test_filtered_tokens_never_drawn_in_a_large_vocab(params: SamplingParams) -> None:
    logits = _logits(2_000, seed=9, scale=3.0)
    expected, margin = target_distribution(logits.tolist(), params)
    assert margin > BOUNDARY_MARGIN
    allowed = {i for i, p in enumerate(expected) if p > 0.0}
    assert 1 < len(allowed) < 2_000
    drawn = set(_draw(logits, params, 2_000, seed=4).tolist())
    assert drawn <= allowed
    assert len(drawn) > 1


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 1_000, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, _batch([SamplingParams(temperature=0.0)] * 16, 1_000))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None


def test_greedy_rows_in_a_random_batch_and_tiny_temperature() -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(1))
    greedy = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-7, top_p=0.5)]
    for random_params in (SamplingParams(), SamplingParams(top_k=50)):  # unfiltered, top-k path
        params = [greedy[row // 4] if row % 2 == 0 else random_params for row in range(8)]
        out = Sampler(seed=0)(logits, _batch(params, 500))
        assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(dim=-1))


def _run_seeded(
    step_logits: list[torch.Tensor], params: SamplingParams, companions: int, sampler_seed: int
) -> list[int]:
    """Samples the seeded request each step, at a moving row among `companions` other rows."""
    generator = make_generator(params.seed, CPU)
    others = [SamplingParams(), SamplingParams(seed=99, top_k=5), SamplingParams(temperature=0.0)]
    noise = torch.Generator().manual_seed(sampler_seed)
    sampler, tokens = Sampler(seed=sampler_seed), []
    vocab_size = step_logits[0].shape[0]
    for step, logits in enumerate(step_logits):
        row = step % (companions + 1)
        batch_params = [others[i % len(others)] for i in range(companions)]
        gens = [make_generator(p.seed, CPU) for p in batch_params]
        batch_params.insert(row, params)
        gens.insert(row, generator)
        rows = torch.randn(companions + 1, vocab_size, generator=noise)
        rows[row] = logits
        out = sampler(rows, _batch(batch_params, vocab_size, gens))
        tokens.append(int(out.token_ids[row]))
    return tokens


def test_seeded_request_is_reproducible_and_batch_independent() -> None:
    noise = torch.Generator().manual_seed(7)
    step_logits = [torch.randn(64, generator=noise) * 0.5 for _ in range(60)]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = _run_seeded(step_logits, params, companions=0, sampler_seed=1)
    crowded = _run_seeded(step_logits, params, companions=5, sampler_seed=2)
    assert crowded == alone
    assert len(set(alone)) > 10  # near-flat logits: the draw, not the argmax, decides
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=1235)
    assert _run_seeded(step_logits, other_seed, companions=0, sampler_seed=1) != alone


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(2))
    batch = _batch([SamplingParams()] * 64, 100)
    first, again = Sampler(seed=3)(logits, batch), Sampler(seed=3)(logits, batch)
    assert torch.equal(first.token_ids, again.token_ids)
    assert not torch.equal(first.token_ids, Sampler(seed=4)(logits, batch).token_ids)


def test_logprobs_are_raw_log_softmax_and_top_n_are_the_largest() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)) * 3
    asked = [None, 0, 1, 3, 5, None]
    params = [SamplingParams(temperature=0.5, top_k=10, logprobs=n) for n in asked]
    out = Sampler(seed=0)(logits, _batch(params, 300))
    assert out.top_logprob_ids is not None and out.top_logprobs is not None
    assert out.top_logprob_ids.shape == (6, 5) and out.top_logprobs.shape == (6, 5)
    for row in range(6):
        raw = logits[row].double().tolist()
        top = max(raw)
        log_z = top + math.log(sum(math.exp(x - top) for x in raw))
        chosen = int(out.token_ids[row])
        assert out.logprobs[row].item() == pytest.approx(raw[chosen] - log_z, abs=1e-4)
        best = sorted(range(300), key=lambda i: -raw[i])[:5]
        assert out.top_logprob_ids[row].tolist() == best
        want = [raw[i] - log_z for i in best]
        assert out.top_logprobs[row].tolist() == pytest.approx(want, abs=1e-4)


def test_logprobs_zero_returns_only_the_chosen_token() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(6))
    out = Sampler(seed=0)(logits, _batch([SamplingParams(logprobs=0)] * 3, 50))
    assert isinstance(out, SamplerOutput)
    assert out.logprobs is not None and out.logprobs.shape == (3,)
    assert out.top_logprob_ids is None and out.top_logprobs is None
    want = logits.log_softmax(dim=-1).gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    assert torch.allclose(out.logprobs, want)


def test_batch_flags_skip_disabled_features() -> None:
    plain = _batch([SamplingParams(), SamplingParams(top_k=0, seed=1)], 10)
    assert not (plain.use_top_k or plain.use_top_p or plain.use_min_p or plain.all_greedy)
    assert plain.seeded_rows == (1,) and plain.max_num_logprobs is None
    # Filters on greedy rows cost nothing either; top_k beyond the vocab is no filter.
    greedy = _batch([SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1)], 10)
    assert greedy.all_greedy and not (greedy.use_top_k or greedy.use_top_p or greedy.use_min_p)
    assert not _batch([SamplingParams(top_k=50)], 10).use_top_k


def test_bad_inputs_raise_value_error() -> None:
    batch = _batch([SamplingParams()] * 2, 10)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(3, 10), batch)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 11), batch)
    with pytest.raises(ValueError, match="generator"):
        SamplingBatch.from_params([SamplingParams()], [], 10, CPU)
