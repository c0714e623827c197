"""Routing policies: decode by KV headroom with session affinity, prefill by estimated work."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.router.policy import (
    DecodeLoad,
    PrefillLoad,
    RoutingInfo,
    choose_decode,
    choose_prefill,
    prefill_locally,
    prefill_work,
    shared_prefix_len,
)


def _d(wid: str, free: int, running: int = 0, max_seqs: int = 8, total: int = 100) -> DecodeLoad:
    return DecodeLoad(wid, total, free, running, max_seqs)


def _p(wid: str, tokens: int, inflight: int = 0) -> PrefillLoad:
    return PrefillLoad(wid, inflight, tokens)


def _req(blocks: int = 4, prompt: int = 64, session: str | None = None, hits=None) -> RoutingInfo:
    return RoutingInfo(prompt, blocks, session, hits or {})


# -- choose_decode -------------------------------------------------------------------------------


def test_decode_most_free_blocks_wins():
    workers = [_d("a", 10), _d("b", 30), _d("c", 20)]
    assert choose_decode(workers, _req()) == "b"


def test_decode_empty_pool_is_none():
    assert choose_decode([], _req()) is None


def test_decode_none_when_nothing_fits():
    workers = [_d("a", 3), _d("b", 50, running=8, max_seqs=8)]
    assert choose_decode(workers, _req(blocks=4)) is None


def test_decode_fit_edges():
    # exactly enough free blocks fits; one running slot left fits
    assert choose_decode([_d("a", 4)], _req(blocks=4)) == "a"
    assert choose_decode([_d("a", 4, running=7, max_seqs=8)], _req(blocks=4)) == "a"
    assert choose_decode([_d("a", 3)], _req(blocks=4)) is None
    # negative free (router reserved more than last report) never fits, even zero need
    assert choose_decode([_d("a", -1)], _req(blocks=0)) is None
    assert choose_decode([_d("a", 0)], _req(blocks=0)) == "a"


def test_decode_full_batch_skipped_even_with_most_blocks():
    workers = [_d("a", 90, running=8, max_seqs=8), _d("b", 10)]
    assert choose_decode(workers, _req()) == "b"


def test_decode_affinity_honoured_when_it_fits():
    workers = [_d("a", 90), _d("b", 5)]
    assert choose_decode(workers, _req(blocks=4, session="b")) == "b"


def test_decode_affinity_skipped_when_too_few_blocks():
    workers = [_d("a", 20), _d("b", 3), _d("c", 90)]
    assert choose_decode(workers, _req(blocks=4, session="b")) == "c"


def test_decode_affinity_skipped_when_batch_full():
    workers = [_d("a", 20), _d("b", 90, running=4, max_seqs=4)]
    assert choose_decode(workers, _req(session="b")) == "a"


def test_decode_affinity_to_unknown_worker_falls_back():
    assert choose_decode([_d("a", 20), _d("b", 30)], _req(session="gone")) == "b"


def test_decode_affinity_skipped_when_excluded():
    workers = [_d("a", 20), _d("b", 90)]
    assert choose_decode(workers, _req(session="b"), excluded={"b"}) == "a"


def test_decode_excluded_skipped():
    workers = [_d("a", 20), _d("b", 90), _d("c", 50)]
    assert choose_decode(workers, _req(), excluded=("b",)) == "c"
    assert choose_decode(workers, _req(), excluded=["a", "b", "c"]) is None


def test_decode_ties_fewest_running_then_worker_id():
    workers = [_d("b", 30, running=2), _d("a", 30, running=3), _d("c", 30, running=2)]
    assert choose_decode(workers, _req()) == "b"
    workers = [_d("z", 30, running=1), _d("y", 30, running=1)]
    assert choose_decode(workers, _req()) == "y"


def test_decode_order_of_input_does_not_matter():
    workers = [_d("a", 30, running=1), _d("b", 30, running=1), _d("c", 29)]
    for perm in (workers, workers[::-1], [workers[1], workers[2], workers[0]]):
        assert choose_decode(perm, _req()) == "a"


# -- choose_prefill ------------------------------------------------------------------------------


def test_prefill_shortest_queue_without_hits():
    workers = [_p("a", 500), _p("b", 100), _p("c", 300)]
    assert choose_prefill(workers, _req()) == "b"


def test_prefill_empty_pool_and_all_excluded_is_none():
    assert choose_prefill([], _req()) is None
    assert choose_prefill([_p("a", 0)], _req(), excluded={"a"}) is None


def test_prefill_excluded_skipped():
    workers = [_p("a", 0), _p("b", 10)]
    assert choose_prefill(workers, _req(), excluded={"a"}) == "b"


def test_prefill_prefix_hit_beats_shorter_queue():
    # a: 200 queued + (1000 - 900) uncached = 300; b: 0 queued + 1000 uncached = 1000
    workers = [_p("a", 200), _p("b", 0)]
    assert choose_prefill(workers, _req(prompt=1000, hits={"a": 900})) == "a"


def test_shorter_queue_beats_prefix_hit():
    # a: 2000 queued + 100 uncached = 2100; b: 0 queued + 1000 uncached = 1000
    workers = [_p("a", 2000), _p("b", 0)]
    assert choose_prefill(workers, _req(prompt=1000, hits={"a": 900})) == "b"


def test_prefill_work_estimate():
    req = _req(prompt=100, hits={"a": 40, "b": 500, "c": -3})
    assert prefill_work(_p("a", 10), req) == 10 + 60
    assert prefill_work(_p("b", 10), req) == 10  # hit clamped to the prompt
    assert prefill_work(_p("c", 10), req) == 110  # nonsense negative hit ignored
    assert prefill_work(_p("d", 0), req) == 100  # no entry: nothing cached


def test_prefill_ties_fewer_inflight_then_worker_id():
    # equal work (100 + 64): fewer inflight wins
    workers = [_p("a", 100, inflight=3), _p("b", 100, inflight=1)]
    assert choose_prefill(workers, _req()) == "b"
    workers = [_p("b", 100, inflight=1), _p("a", 100, inflight=1)]
    assert choose_prefill(workers, _req()) == "a"
    # equal work reached differently: queue 0 + 64 uncached vs queue 32 + 32 uncached
    workers = [_p("b", 0, inflight=0), _p("a", 32, inflight=1)]
    assert choose_prefill(workers, _req(prompt=64, hits={"a": 32})) == "b"


# -- prefill_locally -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "cached", "limit", "expected"),
    [
        (1000, 900, 100, True),  # remainder exactly at the limit
        (1000, 899, 100, False),  # one over
        (1000, 1000, 100, True),  # fully cached
        (1000, 1200, 100, True),  # more cached than asked: nothing to compute
        (50, 0, 100, True),  # short cold prompt fits the limit
        (1000, 999, 0, False),  # disabled
        (1000, 1000, 0, False),  # disabled even when fully cached
        (1000, 999, -5, False),  # negative limit also disables
        (0, 0, 1, True),
    ],
)
def test_prefill_locally_threshold(prompt, cached, limit, expected):
    assert prefill_locally(prompt, cached, limit) is expected


def test_prefill_locally_rejects_negative_counts():
    with pytest.raises(ValueError, match="num_cached_on_decode"):
        prefill_locally(10, -1, 5)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        prefill_locally(-1, 0, 5)


# -- shared_prefix_len and snapshots -------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ([], [], 0),
        ([1, 2, 3], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 3, 4], 3),
        ([1, 2, 3, 4], [1, 2, 9, 4], 2),
        ([5], [6], 0),
        ((1, 2), [1, 2], 2),
    ],
)
def test_shared_prefix_len(a, b, n):
    assert shared_prefix_len(a, b) == n
    assert shared_prefix_len(b, a) == n


def test_snapshots_are_frozen_and_validated():
    req = RoutingInfo(10, 1)
    assert req.prefix_hits == {} and req.session_decode_worker is None
    assert RoutingInfo(10, 1).prefix_hits is not req.prefix_hits  # no shared default
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.num_prompt_tokens = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        _d("a", 1).num_free_blocks = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        RoutingInfo(-1, 1)
    with pytest.raises(ValueError, match="num_blocks_needed"):
        RoutingInfo(1, -1)
    hash(RoutingInfo(10, 1, "a", {"p": 3}))  # usable as a key despite the mapping field


# -- LoRA adapter affinity -----------------------------------------------------------------------


def test_decode_prefers_a_worker_holding_the_adapter_over_free_blocks():
    workers = [_d("a", 30), dataclasses.replace(_d("b", 10), lora_adapters=frozenset({"x"}))]
    assert choose_decode(workers, dataclasses.replace(_req(), lora_name="x")) == "b"
    assert choose_decode(workers, dataclasses.replace(_req(), lora_name="y")) == "a"
    assert choose_decode(workers, _req()) == "a"  # the base model: by free blocks alone


def test_decode_adapter_affinity_yields_to_fit_and_session():
    full = dataclasses.replace(_d("b", 2), lora_adapters=frozenset({"x"}))
    assert choose_decode([_d("a", 30), full], dataclasses.replace(_req(), lora_name="x")) == "a"
    holder = dataclasses.replace(_d("b", 20), lora_adapters=frozenset({"x"}))
    req = dataclasses.replace(_req(session="a"), lora_name="x")
    assert choose_decode([_d("a", 10), holder], req) == "a"


def test_prefill_adapter_breaks_ties_of_equal_work_only():
    holder = dataclasses.replace(_p("b", 100, inflight=3), lora_adapters=frozenset({"x"}))
    req = dataclasses.replace(_req(), lora_name="x")
    assert choose_prefill([_p("a", 100), holder], req) == "b"
    assert choose_prefill([_p("a", 50), holder], req) == "a"
