"""N-gram prompt lookup: `lookup` against a brute-force reference, and NgramProposer's
incremental per-request buffer against `lookup` on the whole sequence."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.ngram import NgramProposer, lookup


def reference(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Longest n first, the latest start i (window ending before the last token) first."""
    last = len(tokens) - 1
    for n in range(n_max, n_min - 1, -1):
        suffix = tokens[len(tokens) - n :] if n <= len(tokens) else None
        for i in range(last - n, -1, -1):  # i + n <= last
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def _lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    return lookup(np.array(tokens, dtype=np.int64), k, n_max, n_min)


def test_lookup_matches_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    found = 0
    for _ in range(4_000):
        alphabet = rng.randint(2, 5)  # small, so matches of every length happen
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 40))]
        n_max = rng.randint(1, 7)
        n_min = rng.randint(1, n_max)
        k = rng.randint(0, 8)
        want = reference(tokens, k, n_max, n_min)
        assert _lookup(tokens, k, n_max, n_min) == want, (tokens, k, n_max, n_min)
        found += bool(want)
    assert found > 1_000  # the comparison mostly covered real proposals, not just []


def test_lookup_agrees_when_long_matches_are_common() -> None:
    # Periodic text with rare edits: long suffix matches at many offsets, ties between them.
    rng = random.Random(1)
    for _ in range(500):
        period = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        tokens = (period * 20)[: rng.randint(2, 80)]
        for _ in range(rng.randint(0, 3)):
            tokens[rng.randrange(len(tokens))] = rng.randrange(4)
        n_max, k = rng.randint(1, 8), rng.randint(1, 6)
        n_min = rng.randint(1, n_max)
        assert _lookup(tokens, k, n_max, n_min) == reference(tokens, k, n_max, n_min)


@pytest.mark.parametrize("tokens", [[], [7]], ids=["empty", "one-token"])
def test_too_short_sequences_propose_nothing(tokens: list[int]) -> None:
    assert _lookup(tokens, 4, 3, 1) == []


def test_no_earlier_occurrence_proposes_nothing() -> None:
    assert _lookup([1, 2, 3, 4], 3, 3, 1) == []


def test_a_match_shorter_than_n_min_proposes_nothing() -> None:
    tokens = [1, 2, 3, 9, 3]  # only the last token recurs: a 1-gram match
    assert _lookup(tokens, 2, 4, 2) == []
    assert _lookup(tokens, 2, 4, 1) == [9, 3]


def test_k_larger_than_what_follows_the_match_is_cut_short() -> None:
    assert _lookup([1, 2, 1], 5, 2, 1) == [2, 1]  # what follows runs up to the end


def test_longest_match_wins_over_a_later_shorter_one() -> None:
    tokens = [7, 2, 3, 40, 8, 3, 50, 7, 2, 3]  # [7 2 3] at 0, [3] alone at 5
    assert _lookup(tokens, 2, 3, 1) == [40, 8]
    assert _lookup(tokens, 2, 1, 1) == [50, 7]  # n_max 1: every match has length 1, latest


def test_latest_among_equally_long_matches() -> None:
    assert _lookup([1, 5, 1, 6, 1], 2, 3, 1) == [6, 1]
    # n_max caps the length: [4 1 2] matches 3 at 0; capped at 2 it ties [1 2] at 5 (later)
    tokens = [4, 1, 2, 30, 9, 1, 2, 60, 4, 1, 2]
    assert _lookup(tokens, 1, 3, 1) == [30]
    assert _lookup(tokens, 1, 2, 1) == [60]


def test_k_zero_proposes_nothing() -> None:
    assert _lookup([1, 2, 1], 0, 2, 1) == []


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, tuple(prompt), SamplingParams(max_tokens=1_000))


def _config(k: int, n_max: int, n_min: int) -> SpeculativeConfig:
    return SpeculativeConfig("ngram", k, prompt_lookup_max=n_max, prompt_lookup_min=n_min)


@pytest.mark.parametrize("n_max,n_min,k", [(4, 1, 3), (2, 2, 5), (6, 3, 1)])
def test_proposer_tracks_growing_requests_like_a_full_lookup(n_max, n_min, k) -> None:
    rng = random.Random(n_max * 10 + n_min)
    proposer = NgramProposer(_config(k, n_max, n_min))
    requests = [_request(f"r{i}", [rng.randrange(4) for _ in range(rng.randint(1, 30))])
                for i in range(4)]
    proposed = 0
    for step in range(120):  # past several buffer growths (the buffer starts at length + 64)
        active = [r for i, r in enumerate(requests) if (step + i) % 3 != 0]  # not every step
        num_drafts = [rng.randint(1, k) for _ in active]
        for r in active:
            r.spec_token_ids = [-1]  # must be overwritten, with [] when nothing matches
        proposer.propose(active, num_drafts)
        for r, drafts in zip(active, num_drafts):
            want = _lookup(r.all_token_ids, drafts, n_max, n_min)
            assert r.spec_token_ids == want, (step, r.request_id)
            assert want == reference(r.all_token_ids, drafts, n_max, n_min)
            proposed += bool(want)
        for r in requests:  # one to several tokens per step, as verified drafts give
            r.output_token_ids.extend(rng.randrange(4) for _ in range(rng.randint(1, 3)))
    assert proposed > 100


def test_forget_drops_the_request_state() -> None:
    proposer = NgramProposer(_config(3, 3, 1))
    old = _request("same-id", [1, 2, 3, 1, 2, 3, 1, 2, 3, 1])
    proposer.propose([old], [3])
    assert old.spec_token_ids == [2, 3, 1]
    proposer.forget(["same-id", "never-seen"])  # unknown ids are ignored
    # A new request under the same id: a stale buffer would still hold the old tokens.
    new = _request("same-id", [5, 6, 7, 8, 5, 6, 7, 8, 5])
    stale = [1, 2, 3, 1, 2, 3, 1, 2, 3]  # what a kept buffer of length 10 would give for 9
    assert reference(stale, 3, 3, 1) != reference(new.all_token_ids, 3, 3, 1)
    proposer.propose([new], [3])
    assert new.spec_token_ids == reference(new.all_token_ids, 3, 3, 1) == [6, 7, 8]


def test_forgetting_one_request_keeps_the_others() -> None:
    proposer = NgramProposer(_config(2, 2, 1))
    a, b = _request("a", [1, 2, 1]), _request("b", [3, 4, 3])
    proposer.propose([a, b], [2, 2])
    proposer.forget(["a"])
    b.output_token_ids.append(4)
    proposer.propose([b], [2])
    assert b.spec_token_ids == reference(b.all_token_ids, 2, 2, 1) == [3, 4]
