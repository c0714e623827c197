"""Benchmark workloads: seeded, the lengths asked for, no shared prefixes, multi-turn sessions."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.bench.workloads import (
    FIRST_ID,
    BenchRequest,
    grid,
    sessions,
    sharegpt_like,
    turn_prompt,
)

VOCAB = 49152  # SmolLM2's vocabulary


def _prompts(reqs: list[BenchRequest]) -> list[list[int]]:
    return [r.prompt_token_ids for r in reqs]


def _no_shared_prefix(prompts: list[list[int]], k: int = 4) -> bool:
    """No two prompts start with the same k tokens (so they share no KV block either)."""
    return len({tuple(p[:k]) for p in prompts}) == len(prompts)


def test_sharegpt_like_seeded_and_bounded():
    a = sharegpt_like(200, VOCAB, seed=3)
    assert a == sharegpt_like(200, VOCAB, seed=3)
    assert _prompts(a) != _prompts(sharegpt_like(200, VOCAB, seed=4))
    assert all(4 <= len(r.prompt_token_ids) <= 1024 and 4 <= r.output_len <= 512 for r in a)
    assert all(FIRST_ID <= t < VOCAB for r in a for t in r.prompt_token_ids)
    assert all(r.session_id == "" and r.turn == 0 and not r.continues_session for r in a)
    assert _no_shared_prefix(_prompts(a))


def test_sharegpt_like_validation():
    with pytest.raises(ValueError, match="num_requests"):
        sharegpt_like(0, VOCAB)
    with pytest.raises(ValueError, match="scale"):
        sharegpt_like(4, VOCAB, scale=0)
    with pytest.raises(ValueError, match="vocab_size"):
        sharegpt_like(4, 10)


def test_grid_every_cell_shuffled_and_seeded():
    reqs = grid([8, 32, 64], [4, 16], num_per_cell=5, vocab_size=VOCAB, seed=1)
    assert len(reqs) == 3 * 2 * 5
    cells = Counter((len(r.prompt_token_ids), r.output_len) for r in reqs)
    assert cells == {(i, o): 5 for i in (8, 32, 64) for o in (4, 16)}
    assert reqs == grid([8, 32, 64], [4, 16], 5, VOCAB, seed=1)
    order = [(len(r.prompt_token_ids), r.output_len) for r in reqs]
    assert order != sorted(order)  # shuffled, not in product order
    other = grid([8, 32, 64], [4, 16], 5, VOCAB, seed=2)
    assert [(len(r.prompt_token_ids), r.output_len) for r in other] != order
    assert _no_shared_prefix(_prompts(reqs))
    assert all(FIRST_ID <= t < VOCAB for r in reqs for t in r.prompt_token_ids)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([], [4], 1), "at least one"),
        (([8], [0], 1), ">= 1"),
        (([8], [4], 0), "num_per_cell"),
    ],
)
def test_grid_validation(args, match):
    with pytest.raises(ValueError, match=match):
        grid(*args, vocab_size=VOCAB, seed=0)


def test_sessions_ids_turns_and_lengths():
    conv = sessions(4, 3, first_len=20, turn_len=6, output_len=5, vocab_size=VOCAB, seed=7)
    assert [s[0].session_id for s in conv] == [f"bench-7-{i}" for i in range(4)]
    for s in conv:
        assert [r.turn for r in s] == [0, 1, 2]
        assert len({r.session_id for r in s}) == 1
        assert [len(r.prompt_token_ids) for r in s] == [20, 6, 6]
        assert all(r.output_len == 5 for r in s)
        assert [r.continues_session for r in s] == [False, True, True]
    assert conv == sessions(4, 3, 20, 6, 5, VOCAB, seed=7)
    assert conv != sessions(4, 3, 20, 6, 5, VOCAB, seed=8)
    assert _no_shared_prefix([s[0].prompt_token_ids for s in conv])


def test_turn_prompt_builds_the_conversation():
    (s,) = sessions(1, 3, first_len=20, turn_len=6, output_len=5, vocab_size=VOCAB, seed=0)
    history: list[int] = []
    for t, req in enumerate(s):
        prompt = turn_prompt(history, req)
        # turn t: first_len + t * (output_len + turn_len) = 20 + 11 t tokens
        assert len(prompt) == 20 + 11 * t
        assert prompt[:len(history)] == history and prompt[len(history):] == req.prompt_token_ids
        answer = [100 + t] * req.output_len
        history = prompt + answer
    with pytest.raises(ValueError, match="empty history"):
        turn_prompt([1, 2], s[0])


def test_sessions_validation():
    with pytest.raises(ValueError, match="session"):
        sessions(0, 2, 8, 8, 8, VOCAB, 0)
    with pytest.raises(ValueError, match="turn_len"):
        sessions(1, 2, 8, 0, 8, VOCAB, 0)
    with pytest.raises(ValueError, match="session_id"):
        BenchRequest([1, 2], 4, turn=1)
