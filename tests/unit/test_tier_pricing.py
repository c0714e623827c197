"""The router's price of a prefix hit in a worker's KV tiers: which tier each leading block
counts in, and what a hit there saves at the worker's measured costs."""

from __future__ import annotations

import pytest

from pdserve.router.policy import (
    UNMEASURED_HIT_SHARE,
    PrefillLoad,
    RoutingInfo,
    TierCosts,
    TierHits,
    choose_prefill,
    leading_tier_hits,
    priced_hit_tokens,
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
