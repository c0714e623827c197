"""The router's price of a prefix hit in a worker's KV tiers: which tier each leading block
counts in, and what a hit there saves at the worker's measured costs; and of the remote tier,
a prefix another decode worker holds: pulled or recomputed."""

from __future__ import annotations

import pytest

from pdserve.router.policy import (
    UNMEASURED_HIT_SHARE,
    PrefillLoad,
    PullCosts,
    RoutingInfo,
    TierCosts,
    TierHits,
    choose_prefill,
    leading_tier_hits,
    priced_hit_tokens,
    pull_tokens,
)

BS = 16


@pytest.mark.parametrize("held, expected", [
    ({}, TierHits()),
    ({"device": [1, 1, 0]}, TierHits(device=2)),
    ({"device": [1, 0, 1], "host": [1, 1, 0]}, TierHits(device=2, host=1)),  # device first
    ({"host": [1, 1], "disk": [1, 1, 1, 1]}, TierHits(host=2, disk=2)),
    ({"device": [0, 1], "host": [0, 1], "disk": [0, 1]}, TierHits()),  # no first block
    ({"device": [1], "disk": [0, 1, 1]}, TierHits(device=1, disk=2)),  # columns of any length
])
def test_each_leading_block_counts_in_the_fastest_tier_holding_it(held, expected):
    assert leading_tier_hits({t: [bool(x) for x in col] for t, col in held.items()}) == expected


def test_a_device_hit_saves_its_whole_prefill_measured_or_not():
    assert priced_hit_tokens(TierHits(device=3), TierCosts(), BS) == 3 * BS


def test_a_tier_hit_saves_its_prefill_less_the_measured_load():
    costs = TierCosts(prefill_s_per_token=1e-3, host_load_s=4e-3, disk_load_s=8e-3)
    # a block: 16 ms to prefill; 4 ms to load from host; 8 + 4 ms from disk
    assert priced_hit_tokens(TierHits(host=2), costs, BS) == round(2 * BS * 0.75)
    assert priced_hit_tokens(TierHits(disk=2), costs, BS) == round(2 * BS * 0.25)
    assert priced_hit_tokens(TierHits(1, 1, 1), costs, BS) == round(BS * (1 + 0.75 + 0.25))


def test_a_load_slower_than_recomputing_saves_nothing():
    costs = TierCosts(prefill_s_per_token=1e-4, host_load_s=2e-3, disk_load_s=1e-2)
    assert priced_hit_tokens(TierHits(host=5, disk=5), costs, BS) == 0


@pytest.mark.parametrize("costs", [
    TierCosts(),  # nothing measured
    TierCosts(host_load_s=1e-3, disk_load_s=1e-3),  # no prefill rate yet
])
def test_an_unmeasured_tier_counts_part_of_a_hit(costs):
    expected = round(4 * BS * UNMEASURED_HIT_SHARE)
    assert priced_hit_tokens(TierHits(host=2, disk=2), costs, BS) == expected


def test_disk_needs_its_host_load_measured_too():
    costs = TierCosts(prefill_s_per_token=1e-3, disk_load_s=1e-3)  # host never loaded yet
    assert priced_hit_tokens(TierHits(disk=2), costs, BS) == round(2 * BS * UNMEASURED_HIT_SHARE)


def test_placement_prefers_the_worker_whose_cheap_tier_holds_the_prefix():
    costs = TierCosts(prefill_s_per_token=1e-3, host_load_s=1e-3, disk_load_s=14e-3)
    hits = {"p-host": priced_hit_tokens(TierHits(host=10), costs, BS),
            "p-disk": priced_hit_tokens(TierHits(disk=10), costs, BS),
            "p-none": 0}
    workers = [PrefillLoad(w, 0, 0) for w in ("p-disk", "p-host", "p-none")]
    assert choose_prefill(workers, RoutingInfo(200, 0, prefix_hits=hits)) == "p-host"
    busy = [PrefillLoad("p-host", 2, 150), PrefillLoad("p-disk", 0, 0),
            PrefillLoad("p-none", 0, 0)]  # its queue outweighs the host hit: disk's still helps
    assert choose_prefill(busy, RoutingInfo(200, 0, prefix_hits=hits)) == "p-disk"


@pytest.mark.parametrize("prompt, held, expected", [
    (100, 64, 64),  # whole blocks the holder has
    (100, 70, 64),  # a partial block is not pulled
    (64, 64, 48),  # never the prompt's last token: its logits are computed here
    (65, 64, 64),
    (100, 15, 0),  # less than a block
    (100, 0, 0),
    (10, 200, 0),  # a prompt shorter than a block
    (1000, 200, 192),  # the holder's history ends before the prompt does
])
def test_a_pull_takes_the_held_whole_blocks_before_the_last_token(prompt, held, expected):
    assert pull_tokens(prompt, held, BS, PullCosts()) == expected


@pytest.mark.parametrize("costs", [
    PullCosts(),
    PullCosts(pull_s_per_block=1.0),  # the recompute rate unknown
    PullCosts(prefill_s_per_token=1e-6),  # no pull measured yet
])
def test_an_unmeasured_pull_is_tried(costs):
    assert pull_tokens(100, 64, BS, costs) == 64


@pytest.mark.parametrize("per_block, per_token, pulls", [
    (0.010, 0.001, True),  # 10 ms a block against 16 ms to recompute one
    (0.020, 0.001, False),  # 20 ms against 16 ms
    (1 / 64, 1 / 1024, False),  # a tie (exact in binary) recomputes: no transfer for nothing
    (0.0, 0.001, True),
])
def test_a_measured_pull_is_taken_only_when_cheaper_than_recomputing(per_block, per_token,
                                                                     pulls):
    costs = PullCosts(pull_s_per_block=per_block, prefill_s_per_token=per_token)
    assert pull_tokens(100, 64, BS, costs) == (64 if pulls else 0)


def test_pull_counts_are_checked():
    with pytest.raises(ValueError, match="block_size"):
        pull_tokens(100, 64, 0, PullCosts())
    with pytest.raises(ValueError, match="counts"):
        pull_tokens(-1, 64, BS, PullCosts())
